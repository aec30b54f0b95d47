"""The ``"mpistrat"`` backend of ``torch.distributed``: torch's collectives over MPI.

``import mpistrat.torch`` registers it (:func:`register`); then::

    dist.init_process_group("mpistrat")   # rank and size from MPI, no MASTER_ADDR

gives a default group whose collectives run over a duplicate of ``COMM_WORLD``, and
``dist.new_group(ranks)`` / ``new_subgroups`` groups over communicators of their own
(``MPI_Comm_create_group`` of exactly their ranks). torch's own machinery runs unchanged on
top: ``DistributedDataParallel`` calls :meth:`ProcessGroupMPI.allreduce` for each bucket,
``ZeroRedundancyOptimizer`` broadcasts, FSDP all-gathers and reduce-scatters,
``torch.distributed.checkpoint`` gathers and broadcasts objects.

How each call runs:

* Every collective starts with mpistrat's agreement (:mod:`mpistrat.runtime.agreement`):
  one collective in which each rank contributes a hash of its call (which collective, the
  shapes and dtypes, the op, the root). Ranks that called different collectives, shapes,
  dtypes or roots get the same :class:`~mpistrat.CollectiveMismatchError` on every rank
  instead of a hang; under ``mpistrat run`` the stall watch covers a rank that never comes.
* ``all_reduce`` (SUM, AVG, MIN, MAX) goes through :func:`mpistrat.all_reduce`, the one
  reduce engine: its small-message path carries arrays of up to 4 KiB inside the
  agreement (one collective in all), larger ones take the spec's algorithm (default
  ``shm`` on one node, ``shm/rechd`` across nodes; ``MPISTRAT_TORCH_SPEC`` sets another).
  PRODUCT and the bitwise ops gather every rank's tensor and combine them in rank order,
  so every rank gets the same bits; sparse COO tensors (DDP's gradients of a sparse
  embedding) are summed from every rank's indices and values.
* ``reduce_scatter`` and ``reduce`` run the same all-reduce and keep their part;
  ``broadcast``, ``all_gather``, ``gather``, ``scatter`` and ``all_to_all`` are MPI's own
  collectives over the tensors' bytes (every dtype travels, bfloat16 too).
* Collectives complete before they return (their ``Work`` is finished, ``wait()`` is free
  and ``get_future()`` is already done): the ranks' order of calls is the MPI order. A
  work's result is gloo's: the call's tensors (``all_gather``'s and the root's
  ``gather``'s output list, ``[]`` for a barrier). ``send``/``recv`` are non-blocking
  MPI requests that ``wait()`` completes, on a communicator of their own so that their
  tags never meet a collective.
* The group's methods take every form torch's ``ProcessGroup`` takes (its C++
  overloads): no options, one tensor instead of a list, ``op=``/``root=``/``timeout=``
  (``group.allreduce(t)``, ``group.broadcast(t, root=0)``, ``group.gather(outs, t, 0)``).
  Several tensors in ``allreduce``, ``broadcast`` and ``all_gather`` are c10d's
  multi-device form, run as gloo runs it: ``allreduce`` reduces every tensor of every
  rank into one result that each receives, ``broadcast`` sends the root's tensor
  ``rootTensor`` to each, ``all_gather`` of n inputs fills each of its n output lists
  with every rank's n inputs (independent tensors are ``allreduce_coalesced``'s).
* A timeout given to ``init_process_group``/``new_group`` (other than torch's default of
  30 minutes) bounds every collective's agreement and every send's or receive's wait:
  past it the ranks that arrived raise :class:`~mpistrat.CollectiveTimeoutError` naming
  the ranks that did not.
* CUDA tensors go through :func:`mpistrat.all_reduce`'s device path for ``all_reduce``
  (``MPISTRAT_TORCH_CUDA_SPEC``, default ``nccl``; not yet run on a GPU); the other
  collectives stage them through host memory.

The works the calls return are :mod:`mpistrat.torch.work`'s; the tensors become MPI
buffers through :mod:`mpistrat.torch.tensors`.

Under :mod:`mpistrat.trace` every collective is one span ``torch.distributed.<name>`` (a
``cpu_op`` with Kineto's collective args: ``Collective name``, ``dtype``, ``In msg
nelems``, ``Out msg nelems``, ``Group size``, ``Process Group Name``; and mpistrat's
algorithm, bytes, seq, algbw, busbw), holding its agreement and the phases of the
engine it calls (``mpistrat.all_reduce`` inside is a phase).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..allreduce import all_reduce, plan_of
from ..runtime import recorder
from ..runtime._mpi import Comm, mpi, world
from ..runtime.agreement import (
    DOORS,
    agree,
    close_door,
    dtype_name,
    note_algorithm,
    open_door,
    poll_agreements,
)
from ..runtime.topology import get_topology
from ..spec import parse_spec
from .tensors import (
    Staged,
    apart,
    byte_view,
    describe_tensors,
    host_view,
    numpy_dtype,
    numpy_view,
)
from .work import Done, Work, timeout_seconds

__all__ = ["BACKEND_NAME", "ProcessGroupMPI", "register", "use_instead_of_gloo", "TORCH_SPEC",
           "TORCH_CUDA_SPEC"]

BACKEND_NAME = "mpistrat"
TORCH_SPEC = "MPISTRAT_TORCH_SPEC"
"""Environment variable: the all-reduce spec of the backend's ``all_reduce`` of CPU tensors
(default ``shm`` on one node, ``shm/rechd`` across nodes)."""
TORCH_CUDA_SPEC = "MPISTRAT_TORCH_CUDA_SPEC"
"""Environment variable: the all-reduce spec of CUDA tensors (default ``nccl``)."""

_HINT = "the same collective with the same shapes, dtypes, op and root"
_RED = dist.ReduceOp.RedOpType
# reductions the engine runs (MEAN divides by the number of ranks, as torch's AVG)
_ENGINE_OPS = {_RED.SUM: "sum", _RED.AVG: "mean", _RED.MIN: "min", _RED.MAX: "max"}
# the others: every rank's tensor gathered, combined in rank order
_GATHER_OPS: dict[Any, Callable[..., Any]] = {
    _RED.PRODUCT: np.multiply, _RED.BAND: np.bitwise_and, _RED.BOR: np.bitwise_or,
    _RED.BXOR: np.bitwise_xor}
# (op, dtype) pairs whose all_reduce goes straight to the engine
_FAST = {(red, dtype): name for red, name in _ENGINE_OPS.items()
         for dtype in (torch.float16, torch.float32, torch.float64, torch.int32, torch.int64)
         if red != _RED.AVG or dtype.is_floating_point}
_SUMMABLE = frozenset(dtype for _, dtype in _FAST)
_SUM_OP = dist.ReduceOp.SUM
_ALLREDUCE_OPTIONS = dist.AllreduceOptions
_UNSET_TIMEOUT = _ALLREDUCE_OPTIONS().timeout  # (a call without a timeout of its own)
# (torch.distributed has no AllgatherOptions of its own: torch's C extension has)
_ALLGATHER_OPTIONS = torch._C._distributed_c10d.AllgatherOptions
# several tensors' all_reduce (c10d's multi-device form) combines them first, in list order
_COMBINE: dict[Any, Callable[..., Any]] = {
    _RED.SUM: torch.add, _RED.AVG: torch.add, _RED.PRODUCT: torch.mul,
    _RED.MIN: torch.minimum, _RED.MAX: torch.maximum, _RED.BAND: torch.bitwise_and,
    _RED.BOR: torch.bitwise_or, _RED.BXOR: torch.bitwise_xor}
_COMBINE_BOOL: dict[Any, Callable[..., Any]] = {
    _RED.SUM: torch.logical_or, _RED.AVG: torch.logical_or, _RED.MAX: torch.logical_or,
    _RED.BOR: torch.logical_or, _RED.PRODUCT: torch.logical_and,
    _RED.MIN: torch.logical_and, _RED.BAND: torch.logical_and, _RED.BXOR: torch.logical_xor}


class ProcessGroupMPI(dist.ProcessGroup):
    """A ``torch.distributed`` process group over an MPI communicator.

    Made by ``init_process_group("mpistrat")`` and ``new_group(...)`` (not by hand): see
    the module's documentation for what each call does.

    Args:
        comm: the group's communicator (the group's ranks, in group-rank order); the group
            owns it and frees it at :meth:`shutdown`.
        timeout: bound of every collective's agreement (None: none beyond the stall
            watch of ``mpistrat run``).
        spec: the all-reduce spec of ``all_reduce`` (parsed).
    """

    def __init__(self, comm: Comm, timeout: float | None, spec: Any) -> None:
        super().__init__(comm.Get_rank(), comm.Get_size())
        self._comm = comm
        self._p2p = comm.Dup()
        self._size = comm.Get_size()
        self._timeout = timeout
        self._spec = spec
        self._name = self._desc = ""
        self._device_spec: Any = None
        # the last fast all_reduce: (tensor, op, data_ptr, shape, its NumPy view, the
        # engine's op, its work, its plan, its agreed text on a timed group), so that a
        # call on the same tensor skips their making
        self._last: tuple = (None,) * 9

    # --- identity -----------------------------------------------------------------------

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return BACKEND_NAME

    def getRank(self) -> int:  # noqa: N802
        return self._comm.Get_rank()

    def getSize(self) -> int:  # noqa: N802
        return self._size

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._desc

    @property
    def comm(self) -> Comm:
        """The group's MPI communicator (collectives run on it)."""
        return self._comm

    def shutdown(self) -> None:
        for comm in (self._p2p, self._comm):
            if comm is not None and comm != mpi().COMM_NULL:
                comm.Free()
        self._p2p = self._comm = mpi().COMM_NULL

    def abort(self) -> None:
        mpi().COMM_WORLD.Abort(1)

    # --- tracing --------------------------------------------------------------------------

    def _traced(self, what: str, collective: str, inputs: Any, outputs: Any, algorithm: str,
                call: Callable[[], Done]) -> Done:
        """``call()`` (the collective again, going straight in) recorded as one span
        ``torch.distributed.<what>`` (a ``cpu_op``: torch's DistributedDataParallel and
        ZeroRedundancyOptimizer call these) with Kineto's args (``collective`` is
        Kineto's name of it) and the algorithm: ``algorithm``, else what ran inside."""
        start = open_door(self._comm)
        DOORS.direct = True
        try:
            return call()
        finally:
            DOORS.direct = False
            ins, outs = _flat_tensors(inputs), _flat_tensors(outputs)
            nbytes = max(sum(t.numel() * t.element_size() for t in ins),
                         sum(t.numel() * t.element_size() for t in outs))
            dtypes = {dtype_name(t.dtype) for t in ins or outs}
            close_door(start, f"torch.distributed.{what}", collective, self._size,
                       dtypes.pop() if len(dtypes) == 1 else "mixed" if dtypes else "",
                       sum(t.numel() for t in ins), sum(t.numel() for t in outs), nbytes,
                       algorithm, {"Process Group Name": self._name,
                                   "Process Group Description": self._desc})

    # --- agreement ------------------------------------------------------------------------

    def _agree(self, what: str, signature: str | None, error: BaseException | None = None,
               timeout: Any = None) -> None:
        seconds = timeout_seconds(timeout) if timeout is not None else None
        agree(self._comm, signature, error, f"torch.distributed.{what}", _HINT,
              timeout=self._timeout if seconds is None else seconds)

    def _checked(self, what: str, opts: Any, describe: Callable[[], str]) -> None:
        """Agree on ``describe()``'s text (an error in it raises on every rank)."""
        try:
            signature, error = describe(), None
        except (TypeError, ValueError) as exc:
            signature, error = None, exc
        self._agree(what, signature, error, getattr(opts, "timeout", None))

    # --- reductions -------------------------------------------------------------------------

    def _op(self, opts: Any, dtype: torch.dtype) -> Any:
        red = opts.reduceOp
        kind = getattr(red, "op", red)
        if kind in _ENGINE_OPS:
            if kind == _RED.AVG and (dtype == torch.bool or not (dtype.is_floating_point
                                                                  or dtype.is_complex)):
                raise TypeError(f"ReduceOp.AVG needs a floating-point or complex tensor, "
                                f"got {dtype}; reduce with SUM and divide")
            if kind in (_RED.MIN, _RED.MAX) and dtype.is_complex:
                raise TypeError(f"ReduceOp.{kind.name} is not defined for complex tensors "
                                f"({dtype})")
            if dtype == torch.bool:  # logical: SUM is OR, as in torch's other backends
                return {_RED.SUM: np.maximum, _RED.MIN: np.minimum,
                        _RED.MAX: np.maximum}[kind]
            return _ENGINE_OPS[kind]
        if kind in _GATHER_OPS:
            if kind != _RED.PRODUCT and (dtype.is_floating_point or dtype.is_complex):
                raise TypeError(f"ReduceOp.{kind.name} needs an integer or bool tensor, "
                                f"got {dtype}")
            if dtype == torch.bool and kind == _RED.PRODUCT:
                return np.minimum
            return _GATHER_OPS[kind]
        raise ValueError(f"the mpistrat backend does not support {red!r} (PREMUL_SUM is "
                         f"NCCL's); expected SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR or BXOR")

    def _reduce_arrays(self, arrays: list[np.ndarray], op: Any) -> None:
        """All-reduce host arrays in place (agreed already)."""
        if isinstance(op, str):
            all_reduce(arrays if len(arrays) > 1 else arrays[0], op, self._spec,
                       self._comm, check=False, inplace=True)
            return
        if recorder.on:
            note_algorithm("allgather+combine")
        for array in arrays:
            if array.dtype == np.bool_:
                array = array.view(np.uint8)
            if self._size == 1:
                continue
            gathered = np.empty((self._size,) + array.shape, dtype=array.dtype)
            self._comm.Allgather(array.reshape(-1).view(np.uint8),
                                 gathered.reshape(-1).view(np.uint8))
            result = np.array(gathered[0])  # (an array also for a 0-dim tensor)
            for k in range(1, self._size):
                op(result, gathered[k], out=result)
            array[...] = result

    def _reduce_signature(self, what: str, tensors: list[torch.Tensor], opts: Any) -> str:
        """The text a reduction's agreement compares (its errors: the call's)."""
        if not tensors:
            raise ValueError(f"{what} got no tensors")
        ops = {str(self._op(opts, t.dtype)) for t in tensors}
        for t in tensors:
            numpy_dtype(t.dtype)
        return f"{what} op={sorted(ops)} {describe_tensors(tensors)}"

    def _reduce(self, what: str, tensors: list[torch.Tensor], opts: Any) -> list[np.ndarray]:
        """Agree, then all-reduce ``tensors`` (CPU, contiguous) in place."""
        self._checked(what, opts, lambda: self._reduce_signature(what, tensors, opts))
        op = self._op(opts, tensors[0].dtype)
        if len({t.dtype for t in tensors}) > 1:
            for t in tensors:  # one dtype at a time
                self._reduce_arrays([host_view(t)], self._op(opts, t.dtype))
        else:
            self._reduce_arrays([host_view(t) for t in tensors], op)
        return []

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None, *rest: Any,
                  **forms: Any) -> Done:
        if opts.__class__ is not _ALLREDUCE_OPTIONS or tensors.__class__ is not list or \
                rest or forms:
            # no options, or torch's other forms: allreduce(tensor(s), op=SUM, timeout=None)
            tensors = _listed(tensors)
            opts = _options(_ALLREDUCE_OPTIONS, opts, rest, forms, ("op", "timeout"))
        if recorder.on:  # (off: this one branch; on: the call again, inside its span)
            if not DOORS.direct:
                return self._traced("all_reduce", "allreduce", tensors, tensors, "",
                                    lambda: self.allreduce(tensors, opts))
            DOORS.direct = False
        opts = _ALLREDUCE_OPTIONS() if opts is None else opts
        if len(tensors) == 1:
            # the common call (DDP's buckets, dist.all_reduce): straight into the engine,
            # whose own agreement checks the call on every rank (and carries a small
            # tensor's data); the result is in place when it returns. On a timed group,
            # the agreement the generic path makes (the same text, so that a rank here
            # and a rank there agree), within the timeout, then the engine unchecked
            tensor, red = tensors[0], opts.reduceOp
            hit = self._last
            if tensor is hit[0] and red == hit[1] and opts.timeout == _UNSET_TIMEOUT \
                    and tensor.data_ptr() == hit[2] and tensor.shape == hit[3]:
                # the same tensor as the last call, its storage and shape unchanged: its
                # NumPy view, op, plan (a small call's), agreed text and finished work
                # are still good (a work's result is the tensor itself, whichever call
                # finished it)
                if hit[8] is not None:
                    self._agree("all_reduce", hit[8])
                    all_reduce(hit[4], hit[5], self._spec, self._comm, check=False,
                               inplace=True)
                    return hit[6]
                plan = hit[7]
                if plan is None or recorder.on or plan(hit[4]) is None:
                    all_reduce(hit[4], hit[5], self._spec, self._comm, inplace=True)
                return hit[6]
            if red == _SUM_OP:  # (a pybind enum hashes slowly: SUM is tested first)
                op = "sum" if tensor.dtype in _SUMMABLE else None
            else:
                op = _FAST.get((red.op, tensor.dtype))
            if op is not None and tensor.is_cpu and tensor.is_contiguous() \
                    and opts.timeout == _UNSET_TIMEOUT:
                array, done = numpy_view(tensor), Done([tensor])
                plan = signature = None
                if self._timeout is None:
                    all_reduce(array, op, self._spec, self._comm, inplace=True)
                    plan = plan_of(array, op, self._spec, self._comm, inplace=True)
                else:
                    signature = self._reduce_signature("all_reduce", [tensor], opts)
                    self._agree("all_reduce", signature)
                    all_reduce(array, op, self._spec, self._comm, check=False, inplace=True)
                # (kept as its RedOpType: a ReduceOp compares with one 6x faster than
                # with another ReduceOp)
                self._last = (tensor, red.op, tensor.data_ptr(), tensor.shape, array, op,
                              done, plan, signature)
                return done
        if any(t.layout == torch.sparse_coo for t in tensors):
            return self._sparse_allreduce(tensors, opts)
        if len(tensors) > 1:
            return self._allreduce_several(tensors, opts)
        return self._allreduce("all_reduce", tensors, opts)

    def _allreduce_several(self, tensors: list[torch.Tensor], opts: Any) -> Done:
        """``allreduce`` of several tensors, c10d's multi-device form (as gloo runs it):
        every tensor of every rank reduced into one result, which every tensor receives.
        Each rank combines its tensors in list order, then one all-reduce runs (AVG:
        their sum, divided by the group's size, as gloo). Several independent tensors
        are ``allreduce_coalesced``'s."""
        first = tensors[0]

        def describe() -> str:
            for t in tensors[1:]:
                if (t.dtype, t.shape, t.layout) != (first.dtype, first.shape, first.layout):
                    raise ValueError(f"all_reduce of several tensors reduces them all into "
                                     f"one result: they must have one dtype and shape, got "
                                     f"{describe_tensors(tensors)}")
            return f"all_reduce of {len(tensors)} op={self._op(opts, first.dtype)} " \
                   f"{describe_tensors([first])}"
        self._checked("all_reduce", opts, describe)
        kind = getattr(opts.reduceOp, "op", opts.reduceOp)
        combine = (_COMBINE_BOOL if first.dtype == torch.bool else _COMBINE)[kind]
        with torch.no_grad():
            combined = first.detach().clone()
            for t in tensors[1:]:
                combined = combine(combined, t.detach().to(combined.device))
            self._allreduce("all_reduce", [combined], opts)
            for t in tensors:
                t.copy_(combined)
        return Done(tensors)

    def _sparse_allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Done:
        """SUM of sparse COO tensors (DDP's gradients of ``nn.Embedding(sparse=True)``):
        every rank's indices and values gathered, concatenated in rank order and
        coalesced; the result replaces each tensor's contents. Several tensors (c10d's
        multi-device form, as gloo) are all summed into one result that each receives."""
        def describe() -> str:
            if (opts.reduceOp.op != _RED.SUM
                    or any(t.layout != torch.sparse_coo for t in tensors)
                    or len({(tuple(t.shape), t.dtype) for t in tensors}) != 1):
                raise TypeError("sparse all_reduce takes sparse COO tensors of one shape "
                                "and dtype, and SUM")
            return f"all_reduce sparse {len(tensors)}x{tuple(tensors[0].shape)}:" \
                   f"{tensors[0].dtype}"
        self._checked("all_reduce", opts, describe)
        tensor = tensors[0]
        mine = tensor.detach().cpu()
        for other in tensors[1:]:
            mine = mine + other.detach().cpu()
        mine = mine.coalesce()
        indices = self._gather_rows(mine.indices().t().contiguous())
        values = self._gather_rows(mine.values().contiguous())
        total = torch.sparse_coo_tensor(indices.t(), values, tensor.shape).coalesce()
        with torch.no_grad():
            for t in tensors:
                t.copy_(total.to(t.device))
        return Done(tensors)

    def _gather_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Every rank's ``rows`` (same trailing shape and dtype), concatenated in rank
        order (``MPI_Allgatherv`` of their bytes)."""
        counts = self._comm.allgather(rows.numel() * rows.element_size())
        out = torch.empty(sum(counts) // max(rows.element_size(), 1), dtype=rows.dtype)
        starts = np.concatenate(([0], np.cumsum(counts)[:-1])).tolist()
        self._comm.Allgatherv(byte_view(rows), [byte_view(out), counts, starts, mpi().BYTE])
        return out.view(-1, *rows.shape[1:])

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Done:
        if recorder.on:  # (off: this one branch; on: the call again, inside its span)
            if not DOORS.direct:
                return self._traced("all_reduce_coalesced", "allreduce_coalesced", tensors,
                                    tensors, "",
                                    lambda: self.allreduce_coalesced(tensors, opts))
            DOORS.direct = False
        opts = dist.AllreduceCoalescedOptions() if opts is None else opts
        return self._allreduce("all_reduce_coalesced", tensors, opts)

    def _allreduce(self, what: str, tensors: list[torch.Tensor], opts: Any) -> Done:
        if len(tensors) == 1 and tensors[0].device.type == "cuda" \
                and (opts.reduceOp.op, tensors[0].dtype) in _FAST:
            # a CUDA tensor stays on its device: the engine's CuPy path (NCCL where the
            # spec says so), with the agreement first as for every call
            self._checked(what, opts, lambda: f"{what} op={self._op(opts, tensors[0].dtype)} "
                                              f"{describe_tensors(tensors)}")
            all_reduce(tensors[0], _FAST[opts.reduceOp.op, tensors[0].dtype],
                       self._cuda_spec(), self._comm, check=False, inplace=True)
            return Done(tensors)
        staged = [Staged(t) for t in tensors]
        self._reduce(what, [s.work for s in staged], opts)
        for s in staged:
            s.done()
        return Done(tensors)

    def _cuda_spec(self) -> Any:
        """The spec of CUDA tensors: ``MPISTRAT_TORCH_CUDA_SPEC``, default ``nccl``."""
        if self._device_spec is None:
            self._device_spec = _spec_from_env(TORCH_CUDA_SPEC, "nccl")
        return self._device_spec

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None, *rest: Any,
               **forms: Any) -> Done:
        if tensors.__class__ is not list or rest or forms or \
                not isinstance(opts, (dist.ReduceOptions, type(None))):
            # torch's other form: reduce(tensor, root, op=SUM, timeout=None)
            tensors = _listed(tensors)
            opts = _options(dist.ReduceOptions, opts, rest, forms, ("root", "op", "timeout"))
        if recorder.on:  # (off: this one branch; on: the call again, inside its span)
            if not DOORS.direct:
                return self._traced("reduce", "reduce", tensors, tensors, "",
                                    lambda: self.reduce(tensors, opts))
            DOORS.direct = False
        opts = dist.ReduceOptions() if opts is None else opts
        root = opts.rootRank
        self._check_root("reduce", root)
        if len(tensors) != 1:
            self._fail("reduce", ValueError(f"reduce takes one tensor, got {len(tensors)}"),
                       opts)
        tensor = tensors[0]
        work = tensor.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)
        self._reduce(f"reduce root={root}", [work], opts)
        if self._comm.Get_rank() == root:
            with torch.no_grad():
                tensor.copy_(work)
        return Done(tensors)

    def reduce_scatter(self, output_tensors: list[torch.Tensor],
                       input_tensors: list[list[torch.Tensor]], opts: Any = None,
                       *rest: Any, **forms: Any) -> Done:
        if isinstance(output_tensors, torch.Tensor):
            # torch's other form: reduce_scatter(output, inputs, op=SUM, timeout=None)
            output_tensors, input_tensors = [output_tensors], [list(input_tensors)]
        if rest or forms or not isinstance(opts, (dist.ReduceScatterOptions, type(None))):
            opts = _options(dist.ReduceScatterOptions, opts, rest, forms, ("op", "timeout"))
        if recorder.on:  # (off: this one branch; on: the call again, inside its span)
            if not DOORS.direct:
                return self._traced("reduce_scatter", "reduce_scatter", input_tensors,
                                    output_tensors, "",
                                    lambda: self.reduce_scatter(output_tensors,
                                                                input_tensors, opts))
            DOORS.direct = False
        opts = dist.ReduceScatterOptions() if opts is None else opts
        output, inputs = output_tensors[0], input_tensors[0]
        if len(inputs) != self._size:
            self._fail("reduce_scatter", ValueError(
                f"reduce_scatter needs one input tensor per rank ({self._size}), got "
                f"{len(inputs)}"), opts)
        flat = torch.cat([t.detach().reshape(-1).to("cpu") for t in inputs])
        self._reduce("reduce_scatter", [flat], opts)
        mine = self._comm.Get_rank()
        start = sum(t.numel() for t in inputs[:mine])
        with torch.no_grad():
            output.copy_(flat[start:start + inputs[mine].numel()].view(output.shape))
        return Done(output_tensors)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor,
                             opts: Any = None) -> Done:
        if recorder.on:  # (off: this one branch; on: the call again, inside its span)
            if not DOORS.direct:
                return self._traced("reduce_scatter_tensor", "_reduce_scatter_base", [input],
                                    [output], "",
                                    lambda: self._reduce_scatter_base(output, input, opts))
            DOORS.direct = False
        opts = dist.ReduceScatterOptions() if opts is None else opts
        if input.numel() != output.numel() * self._size:
            self._fail("reduce_scatter_tensor", ValueError(
                f"reduce_scatter_tensor's input has {input.numel()} elements: expected the "
                f"output's {output.numel()} times the group's {self._size} ranks"), opts)
        flat = input.detach().reshape(-1).to("cpu", copy=True)
        self._reduce("reduce_scatter_tensor", [flat], opts)
        n, mine = output.numel(), self._comm.Get_rank()
        with torch.no_grad():
            output.copy_(flat[mine * n:(mine + 1) * n].view(output.shape))
        return Done([output])

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> Done:
        if recorder.on:  # (off: this one branch; on: the call again, inside its span)
            if not DOORS.direct:
                return self._traced("reduce_scatter_tensor_coalesced",
                                    "reduce_scatter_tensor_coalesced", inputs, outputs, "",
                                    lambda: self.reduce_scatter_tensor_coalesced(
                                        outputs, inputs, opts))
            DOORS.direct = False
        for output, input in zip(outputs, inputs):
            self._reduce_scatter_base(output, input, opts)
        return Done(outputs)

    # --- data movement ------------------------------------------------------------------

    def _one_per_rank(self, what: str, tensors: Sequence[torch.Tensor],
                      like: torch.Tensor, each: int = 1) -> None:
        """Raise unless ``tensors`` holds ``each`` tensors per rank of ``like``'s size
        and dtype."""
        if len(tensors) != self._size * each:
            per = "one tensor" if each == 1 else f"{each} tensors"
            raise ValueError(f"{what} must be {per} per rank ({self._size} ranks), got "
                             f"{len(tensors)}")
        for t in tensors:
            if t.numel() != like.numel() or t.dtype != like.dtype:
                raise ValueError(f"{what} must match ({tuple(like.shape)}, {like.dtype}), "
                                 f"got {tuple(t.shape)}, {t.dtype}")

    def _check_root(self, what: str, root: int) -> None:
        if not 0 <= root < self._size:
            self._fail(what, ValueError(f"{what}: root {root} is not a rank of the group "
                                        f"(0 to {self._size - 1})"), None)

    def _fail(self, what: str, error: BaseException, opts: Any) -> None:
        self._agree(what, None, error, getattr(opts, "timeout", None))

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None, *rest: Any,
                  **forms: Any) -> Done:
        if tensors.__class__ is not list or rest or forms or \
                not isinstance(opts, (dist.BroadcastOptions, type(None))):
            # torch's other form: broadcast(tensor, root, timeout=None)
            tensors = _listed(tensors)
            opts = _options(dist.BroadcastOptions, opts, rest, forms, ("root", "timeout"))
        if recorder.on:  # (off: this one branch; on: the call again, inside its span)
            if not DOORS.direct:
                return self._traced("broadcast", "broadcast", tensors, tensors, "MPI_Bcast",
                                    lambda: self.broadcast(tensors, opts))
            DOORS.direct = False
        opts = dist.BroadcastOptions() if opts is None else opts
        root, index = opts.rootRank, opts.rootTensor
        self._check_root("broadcast", root)

        def describe() -> str:
            # several tensors: c10d's multi-device form (as gloo runs it), the root's
            # tensor rootTensor goes to every tensor of every rank
            if not 0 <= index < len(tensors):
                raise ValueError(f"broadcast: root tensor {index} is not one of the "
                                 f"{len(tensors)} tensors")
            like = tensors[index]
            if any((t.dtype, t.shape) != (like.dtype, like.shape) for t in tensors):
                raise ValueError(f"broadcast of several tensors sends the root's tensor "
                                 f"{index} to each: they must have one dtype and shape, "
                                 f"got {describe_tensors(tensors)}")
            return f"broadcast root={root} of {len(tensors)} {describe_tensors([like])}"
        self._checked("broadcast", opts, describe)
        is_root = self._comm.Get_rank() == root
        tensor = tensors[index]
        staged = Staged(tensor, read=is_root)
        if self._size > 1 and tensor.numel():
            self._comm.Bcast(byte_view(staged.work), root=root)
        if not is_root:
            staged.done()
        if len(tensors) > 1:
            with torch.no_grad():
                for other in tensors:
                    if other is not tensor:
                        other.copy_(tensor)
        return Done(tensors)

    def allgather(self, output_tensors: list[list[torch.Tensor]],
                  input_tensors: list[torch.Tensor], opts: Any = None, *rest: Any,
                  **forms: Any) -> Done:
        if isinstance(input_tensors, torch.Tensor):
            # torch's other form: allgather(outputs, input, timeout=None)
            output_tensors, input_tensors = [list(output_tensors)], [input_tensors]
        if rest or forms or not isinstance(opts, (_ALLGATHER_OPTIONS, type(None))):
            opts = _options(_ALLGATHER_OPTIONS, opts, rest, forms, ("timeout",))
        if recorder.on:  # (off: this one branch; on: the call again, inside its span)
            if not DOORS.direct:
                return self._traced("all_gather", "allgather", input_tensors, output_tensors,
                                    "MPI_Allgather",
                                    lambda: self.allgather(output_tensors, input_tensors, opts))
            DOORS.direct = False
        opts = _ALLGATHER_OPTIONS() if opts is None else opts
        # n inputs (c10d's multi-device form, as gloo runs it): each of the n output lists
        # gets every rank's n inputs, rank by rank (outputs[i][r * n + j] = rank r's j)
        n = len(input_tensors)

        def describe() -> str:
            if not n or len(output_tensors) != n:
                raise ValueError(f"all_gather needs one output list per input tensor, got "
                                 f"{len(output_tensors)} for {n}")
            like = input_tensors[0]
            for t in input_tensors[1:]:
                if t.numel() != like.numel() or t.dtype != like.dtype:
                    raise ValueError(f"all_gather's inputs must have one size and dtype, "
                                     f"got {describe_tensors(input_tensors)}")
            for outputs in output_tensors:
                self._one_per_rank("all_gather's outputs", outputs, like, n)
            return f"all_gather of {n} {describe_tensors([like])}"
        self._checked("all_gather", opts, describe)
        numel = input_tensors[0].numel()
        gathered = self._gather_all(input_tensors[0] if n == 1 else torch.cat(
            [t.detach().reshape(-1).to("cpu") for t in input_tensors]))
        with torch.no_grad():
            for outputs in output_tensors:
                for k, t in enumerate(outputs):
                    part = gathered[k // n, (k % n) * numel:(k % n + 1) * numel]
                    t.copy_(part.view(t.shape))
        # the work's result as gloo's: the output list (the lists, for several inputs)
        return Done(output_tensors[0] if n == 1 else output_tensors)

    def _gather_all(self, input: torch.Tensor) -> torch.Tensor:
        source = Staged(input).work
        gathered = torch.empty((self._size, source.numel()), dtype=source.dtype)
        self._comm.Allgather(byte_view(source), byte_view(gathered))
        return gathered

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor,
                        opts: Any = None) -> Done:
        if recorder.on:  # (off: this one branch; on: the call again, inside its span)
            if not DOORS.direct:
                return self._traced("all_gather_into_tensor", "_allgather_base", [input],
                                    [output], "MPI_Allgather",
                                    lambda: self._allgather_base(output, input, opts))
            DOORS.direct = False
        opts = _ALLGATHER_OPTIONS() if opts is None else opts

        def describe() -> str:
            if output.numel() != input.numel() * self._size or output.dtype != input.dtype:
                raise ValueError(f"all_gather_into_tensor's output must hold the group's "
                                 f"{self._size} inputs of {input.numel()} {input.dtype} "
                                 f"elements, got {output.numel()} of {output.dtype}")
            return f"all_gather_into_tensor {describe_tensors([input])}"
        self._checked("all_gather_into_tensor", opts, describe)
        staged = Staged(output, read=False)
        self._comm.Allgather(byte_view(apart(input, output)), byte_view(staged.work))
        staged.done()
        return Done([output])

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> Done:
        if recorder.on:  # (off: this one branch; on: the call again, inside its span)
            if not DOORS.direct:
                return self._traced("all_gather_into_tensor_coalesced",
                                    "allgather_into_tensor_coalesced", inputs, outputs,
                                    "MPI_Allgather",
                                    lambda: self.allgather_into_tensor_coalesced(
                                        outputs, inputs, opts))
            DOORS.direct = False
        for output, input in zip(outputs, inputs):
            self._allgather_base(output, input, opts)
        return Done(outputs)

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],
                            inputs: list[torch.Tensor], opts: Any = None) -> Done:
        if recorder.on:  # (off: this one branch; on: the call again, inside its span)
            if not DOORS.direct:
                return self._traced("all_gather_coalesced", "allgather_coalesced", inputs,
                                    output_lists, "MPI_Allgather",
                                    lambda: self.allgather_coalesced(output_lists, inputs,
                                                                     opts))
            DOORS.direct = False
        # torch's layout (gloo's): output_lists[rank][i] receives rank's inputs[i]
        if len(output_lists) != self._size or any(len(o) != len(inputs)
                                                  for o in output_lists):
            self._fail("all_gather_coalesced", ValueError(
                f"all_gather_coalesced needs one output list per rank ({self._size}), each "
                f"with one tensor per input ({len(inputs)})"), opts)
        for i, input in enumerate(inputs):
            self.allgather([[outputs[i] for outputs in output_lists]], [input], opts)
        return Done(output_lists)

    def gather(self, output_tensors: list[list[torch.Tensor]],
               input_tensors: list[torch.Tensor], opts: Any = None, *rest: Any,
               **forms: Any) -> Done:
        if isinstance(input_tensors, torch.Tensor):
            # torch's other form: gather(outputs, input, root, timeout=None)
            output_tensors, input_tensors = [list(output_tensors)], [input_tensors]
        if rest or forms or not isinstance(opts, (dist.GatherOptions, type(None))):
            opts = _options(dist.GatherOptions, opts, rest, forms, ("root", "timeout"))
        if recorder.on:  # (off: this one branch; on: the call again, inside its span)
            if not DOORS.direct:
                return self._traced("gather", "gather", input_tensors, output_tensors, "MPI_Gather",
                                    lambda: self.gather(output_tensors, input_tensors, opts))
            DOORS.direct = False
        opts = dist.GatherOptions() if opts is None else opts
        root = opts.rootRank
        self._check_root("gather", root)
        if len(input_tensors) != 1:
            self._fail("gather", ValueError(f"gather takes one input tensor, got "
                                            f"{len(input_tensors)}"), opts)
        input = input_tensors[0]
        is_root = self._comm.Get_rank() == root

        def describe() -> str:
            if is_root:
                self._one_per_rank("gather's outputs on the root",
                                   output_tensors[0] if output_tensors else [], input)
            return f"gather root={root} {describe_tensors([input])}"
        self._checked("gather", opts, describe)
        source = Staged(input).work
        if is_root:
            gathered = torch.empty((self._size, source.numel()), dtype=source.dtype)
            self._comm.Gather(byte_view(source), byte_view(gathered), root=root)
            with torch.no_grad():
                for k, t in enumerate(output_tensors[0]):
                    t.copy_(gathered[k].view(t.shape))
        else:
            self._comm.Gather(byte_view(source), None, root=root)
        # the work's result as gloo's: the root's output list
        return Done(output_tensors[0] if is_root else [])

    def scatter(self, output_tensors: list[torch.Tensor],
                input_tensors: list[list[torch.Tensor]], opts: Any = None, *rest: Any,
                **forms: Any) -> Done:
        if isinstance(output_tensors, torch.Tensor):
            # torch's other form: scatter(output, inputs, root, timeout=None)
            output_tensors, input_tensors = [output_tensors], [list(input_tensors)]
        if rest or forms or not isinstance(opts, (dist.ScatterOptions, type(None))):
            opts = _options(dist.ScatterOptions, opts, rest, forms, ("root", "timeout"))
        if recorder.on:  # (off: this one branch; on: the call again, inside its span)
            if not DOORS.direct:
                return self._traced("scatter", "scatter", input_tensors, output_tensors,
                                    "MPI_Scatter",
                                    lambda: self.scatter(output_tensors, input_tensors, opts))
            DOORS.direct = False
        opts = dist.ScatterOptions() if opts is None else opts
        root = opts.rootRank
        self._check_root("scatter", root)
        if len(output_tensors) != 1:
            self._fail("scatter", ValueError(f"scatter takes one output tensor, got "
                                             f"{len(output_tensors)}"), opts)
        output = output_tensors[0]
        is_root = self._comm.Get_rank() == root

        def describe() -> str:
            if is_root:
                self._one_per_rank("scatter's inputs on the root",
                                   input_tensors[0] if input_tensors else [], output)
            return f"scatter root={root} {describe_tensors([output])}"
        self._checked("scatter", opts, describe)
        staged = Staged(output, read=False)
        send = None
        if is_root:
            send = torch.stack([t.detach().reshape(-1).to("cpu") for t in input_tensors[0]])
        self._comm.Scatter(None if send is None else byte_view(send), byte_view(staged.work),
                           root=root)
        staged.done()
        return Done(output_tensors)

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> Done:
        if recorder.on:  # (off: this one branch; on: the call again, inside its span)
            if not DOORS.direct:
                return self._traced("all_to_all", "alltoall", input_tensors, output_tensors,
                                    "MPI_Alltoallv",
                                    lambda: self.alltoall(output_tensors, input_tensors, opts))
            DOORS.direct = False
        opts = dist.AllToAllOptions() if opts is None else opts

        def describe() -> str:
            if len(output_tensors) != self._size or len(input_tensors) != self._size:
                raise ValueError(f"all_to_all needs one input and one output tensor per "
                                 f"rank ({self._size}), got {len(input_tensors)} and "
                                 f"{len(output_tensors)}")
            if len({t.dtype for t in [*output_tensors, *input_tensors]}) > 1:
                raise ValueError("all_to_all's tensors must all have one dtype")
            return f"all_to_all dtype={input_tensors[0].dtype}"
        self._checked("all_to_all", opts, describe)
        send = torch.cat([t.detach().reshape(-1).to("cpu") for t in input_tensors])
        receive = torch.empty(sum(t.numel() for t in output_tensors), dtype=send.dtype)
        self._alltoallv(send, [t.numel() for t in input_tensors], receive,
                        [t.numel() for t in output_tensors])
        start = 0
        with torch.no_grad():
            for t in output_tensors:
                t.copy_(receive[start:start + t.numel()].view(t.shape))
                start += t.numel()
        return Done(output_tensors)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: list[int], input_split_sizes: list[int],
                      opts: Any = None, **forms: Any) -> Done:
        if forms or not isinstance(opts, (dist.AllToAllOptions, type(None))):
            # torch's other form: alltoall_base(output, input, splits, splits, timeout)
            opts = _options(dist.AllToAllOptions, opts, (), forms, ("timeout",))
        if recorder.on:  # (off: this one branch; on: the call again, inside its span)
            if not DOORS.direct:
                return self._traced("all_to_all_single", "alltoall_base", [input], [output],
                                    "MPI_Alltoallv",
                                    lambda: self.alltoall_base(
                                        output, input, output_split_sizes, input_split_sizes,
                                        opts))
            DOORS.direct = False
        opts = dist.AllToAllOptions() if opts is None else opts
        rows_out = output.shape[0] if output.dim() else 1
        rows_in = input.shape[0] if input.dim() else 1

        def splits(given: list[int], rows: int, which: str) -> list[int]:
            if not given:
                if rows % self._size:
                    raise ValueError(f"all_to_all_single's {which} has {rows} rows, not a "
                                     f"multiple of the group's {self._size} ranks: pass "
                                     f"{which}_split_sizes")
                return [rows // self._size] * self._size
            if len(given) != self._size or sum(given) != rows or min(given) < 0:
                raise ValueError(f"all_to_all_single's {which}_split_sizes {list(given)} "
                                 f"must be {self._size} sizes >= 0 adding up to its "
                                 f"{rows} rows")
            return list(given)

        out_rows: list[int] = []
        in_rows: list[int] = []

        def describe() -> str:
            out_rows[:] = splits(output_split_sizes, rows_out, "output")
            in_rows[:] = splits(input_split_sizes, rows_in, "input")
            if output.dtype != input.dtype:
                raise ValueError(f"all_to_all_single's output is {output.dtype}, its input "
                                 f"{input.dtype}: they must match")
            return f"all_to_all_single dtype={input.dtype}"
        self._checked("all_to_all_single", opts, describe)
        row_out = output.numel() // max(rows_out, 1)
        row_in = input.numel() // max(rows_in, 1)
        staged = Staged(output, read=False)
        self._alltoallv(apart(input, output).reshape(-1), [r * row_in for r in in_rows],
                        staged.work.reshape(-1), [r * row_out for r in out_rows])
        staged.done()
        return Done([output])

    def _alltoallv(self, send: torch.Tensor, send_counts: list[int], receive: torch.Tensor,
                   receive_counts: list[int]) -> None:
        size = send.element_size()
        counts_out = [c * size for c in send_counts]
        counts_in = [c * size for c in receive_counts]
        displ_out = np.concatenate(([0], np.cumsum(counts_out)[:-1])).tolist()
        displ_in = np.concatenate(([0], np.cumsum(counts_in)[:-1])).tolist()
        # every rank's splits are its own, so they are checked pairwise: each rank learns
        # what every peer sends it (one Alltoall of counts) and agrees on whether it
        # expects exactly that, so a mismatch raises on every rank instead of garbage
        sent = np.empty(self._size, dtype=np.int64)
        self._comm.Alltoall(np.asarray(send_counts, dtype=np.int64), sent)
        wrong = [k for k in range(self._size) if sent[k] != receive_counts[k]]
        error = None if not wrong else ValueError(
            f"all_to_all: rank {self._comm.Get_rank()} expects "
            f"{[receive_counts[k] for k in wrong]} elements from rank(s) {wrong}, which "
            f"send {[int(sent[k]) for k in wrong]}: each rank's output split for a peer "
            f"must be that peer's input split for it")
        self._agree("all_to_all", None if error else "all_to_all counts", error)
        MPI = mpi()
        self._comm.Alltoallv([byte_view(send), counts_out, displ_out, MPI.BYTE],
                             [byte_view(receive), counts_in, displ_in, MPI.BYTE])

    def barrier(self, opts: Any = None, **forms: Any) -> Done:
        if forms or not isinstance(opts, (dist.BarrierOptions, type(None))):
            opts = _options(dist.BarrierOptions, opts, (), forms, ("timeout",))
        if recorder.on:  # (off: this one branch; on: the call again, inside its span)
            if not DOORS.direct:
                return self._traced("barrier", "barrier", (), (), "agreement",
                                    lambda: self.barrier(opts))
            DOORS.direct = False
        opts = dist.BarrierOptions() if opts is None else opts
        # the agreement is itself a synchronising collective of every rank
        self._agree("barrier", "barrier", None, getattr(opts, "timeout", None))
        return Done([])

    # --- point to point -------------------------------------------------------------------

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> Work:  # noqa: N803
        tensor = tensors[0]
        if not 0 <= dstRank < self._size:
            raise ValueError(f"send: destination {dstRank} is not a rank of the group "
                             f"(0 to {self._size - 1})")
        t = recorder.begin()
        source = Staged(tensor).work
        data = byte_view(source)
        request = self._p2p.Isend(data, dest=dstRank, tag=tag)
        traced = self._posted(t, "send", tensor, dstRank, tag) if t else None
        return Work(tensors, request, buffer=data,
                     what=f"send to rank {dstRank} (tag {tag})", timeout=self._timeout,
                     traced=traced)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> Work:  # noqa: N803
        if not 0 <= srcRank < self._size:
            raise ValueError(f"recv: source {srcRank} is not a rank of the group "
                             f"(0 to {self._size - 1})")
        return self._receive(tensors, srcRank, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Work:
        return self._receive(tensors, mpi().ANY_SOURCE, tag)

    def _receive(self, tensors: list[torch.Tensor], source: int, tag: int) -> Work:
        t = recorder.begin()
        staged = Staged(tensors[0], read=False)
        request = self._p2p.Irecv(byte_view(staged.work), source=source, tag=tag)
        peer = f"rank {source}" if source >= 0 else "any rank"
        traced = self._posted(t, "recv", tensors[0], source, tag) if t else None
        return Work(tensors, request, finish=staged.done,
                     source=source if source >= 0 else -1,
                     what=f"recv from {peer} (tag {tag})", timeout=self._timeout,
                     traced=traced)

    def _posted(self, start: int, what: str, tensor: torch.Tensor, peer: int,
                tag: int) -> dict[str, Any]:
        """Record a send or receive posted at ``start`` (the span ``torch.distributed.send``
        or ``recv``, a ``cpu_op`` with Kineto's args, ``peer`` -1 for any rank); returns
        the args, which its work's ``wait()`` records again when it has to wait."""
        nelems = tensor.numel()
        args = {"Collective name": what, "dtype": dtype_name(tensor.dtype),
                "In msg nelems": nelems if what == "send" else 0,
                "Out msg nelems": nelems if what == "recv" else 0,
                "Group size": self._size, "bytes": nelems * tensor.element_size(),
                "peer": peer if peer >= 0 else -1, "tag": tag,
                "Process Group Name": self._name, "Process Group Description": self._desc}
        recorder.end(start, f"torch.distributed.{what}", recorder.COLLECTIVE, args)
        return args


# torch's other forms of a call (ProcessGroup's overloads, as its C++ binding takes them:
# allreduce(tensor, op=...), broadcast(tensor, root), gather(outputs, input, root) ...):
# the option each of their arguments sets
_FIELDS = {"op": "reduceOp", "root": "rootRank", "timeout": "timeout"}


def _options(cls: Any, opts: Any, rest: tuple, forms: dict[str, Any],
             names: tuple[str, ...]) -> Any:
    """A call's options: ``opts`` when it is one (a ``cls``), else a new ``cls`` set
    from the arguments of torch's other forms of the call: ``names`` (of ``op``,
    ``root``, ``timeout``) in their order after the tensors, or by keyword."""
    if not rest and not forms and (opts is None or isinstance(opts, cls)):
        return opts
    values = ([] if opts is None else [opts]) + list(rest)
    if len(values) > len(names) or any(isinstance(v, cls) for v in values):
        raise TypeError(f"unexpected arguments {values!r}: give a {cls.__name__} or "
                        f"{', '.join(names)}")
    given = dict(zip(names, values))
    for key, value in forms.items():
        if key not in names or key in given:
            raise TypeError(f"unexpected argument {key}={value!r}: give a {cls.__name__} "
                            f"or {', '.join(names)}")
        given[key] = value
    made = cls()
    for key, value in given.items():
        if value is not None:
            setattr(made, _FIELDS[key], value)
    return made


def _listed(tensors: Any) -> list[torch.Tensor]:
    """A call's tensors as a list (torch's other forms take one tensor)."""
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _flat_tensors(items: Any) -> list[torch.Tensor]:
    """The tensors of a collective's argument (a tensor, a list, a list of lists)."""
    if isinstance(items, torch.Tensor):
        return [items]
    found: list[torch.Tensor] = []
    if isinstance(items, (list, tuple)):
        for item in items:
            found += _flat_tensors(item)
    return found


# --- creation ---------------------------------------------------------------------------


def _spec_from_env(name: str, default: str) -> Any:
    text = os.environ.get(name, "").strip()
    try:
        return parse_spec(text or default)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}={text!r} is not an all-reduce spec: {exc}") from None


def _spec_for(comm: Comm) -> Any:
    return _spec_from_env(TORCH_SPEC, "shm" if get_topology(comm).num_nodes == 1
                          else "shm/rechd")


def _create(backend_opts: Any, options: Any) -> ProcessGroupMPI:
    """torch's creator of a group (``extended_api``): the group's communicator is made
    over exactly its global ranks, collectively over those ranks."""
    # (the default group's list is empty: every rank)
    ranks = list(backend_opts.global_ranks_in_group) or list(range(backend_opts.group_size))
    everyone = world()
    size = everyone.Get_size()
    error: BaseException | None = None
    if backend_opts.group_size != len(ranks) or any(not 0 <= r < size for r in ranks):
        error = ValueError(f"the group's ranks {ranks} are not ranks of the MPI job "
                           f"(0 to {size - 1}): launch with mpiexec/mpistrat run, one "
                           f"process per torch rank")
    elif ranks[backend_opts.group_rank] != everyone.Get_rank():
        error = ValueError(f"torch's rank {ranks[backend_opts.group_rank]} is MPI rank "
                           f"{everyone.Get_rank()}: the torch ranks must be the MPI ranks "
                           f"(leave RANK unset, or set it to the MPI rank)")
    if error is not None:
        raise error
    if ranks == list(range(size)):
        comm = everyone.Dup()
    else:
        group = everyone.Get_group().Incl(ranks)
        try:
            comm = everyone.Create_group(group)
        finally:
            group.Free()
    timeout = timeout_seconds(backend_opts.timeout)
    try:
        spec, error = _spec_for(comm), None
    except ValueError as exc:
        spec, error = None, exc
    agree(comm, None if error else f"new group spec={spec} timeout={timeout}", error,
          "torch.distributed.new_group", "the same MPISTRAT_TORCH_SPEC and timeout")
    if timeout is not None:  # (every rank: they agreed on the timeout)
        poll_agreements(comm)  # (a timed agreement then needs no thread to stop waiting)
    return ProcessGroupMPI(comm, timeout, spec)


def register() -> None:
    """Register the ``"mpistrat"`` backend with ``torch.distributed`` (once; importing
    :mod:`mpistrat.torch` does it), and let ``init_process_group`` without
    ``MASTER_ADDR`` take the rank and size from MPI."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        devices = ["cpu", "cuda"]
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True,
                                      devices=devices)
    from .rendezvous import install

    install()


_SWAPPED: list[Any] = []


def use_instead_of_gloo() -> None:
    """Make this process's ``torch.distributed`` use the ``"mpistrat"`` backend wherever
    a script asks for gloo or for the default backends: ``init_process_group("gloo")``,
    ``init_process_group()``, ``"cpu:gloo,cuda:nccl"``, ``new_group(backend="gloo")``,
    and ``"mpi"`` (torch's MPI backend, which its wheels do not have); ``"nccl"`` alone is
    left to NCCL (what ``mpistrat run --torch-backend mpistrat`` does before the script
    runs)."""
    if _SWAPPED:
        return
    import torch.distributed.distributed_c10d as c10d

    def swap(backend: Any) -> Any:
        if backend is None:
            return BACKEND_NAME
        text = str(backend).lower()
        if text in ("gloo", "mpi"):  # (torch's own mpi backend is not in its wheels)
            return BACKEND_NAME
        if ":" in text and "gloo" in text:  # "cpu:gloo,cuda:nccl": one group serves both
            return BACKEND_NAME
        return backend

    original_init, original_new = c10d.init_process_group, c10d.new_group

    def init_process_group(backend: Any = None, *args: Any, **kwargs: Any) -> Any:
        return original_init(swap(backend), *args, **kwargs)

    def new_group(ranks: Any = None, timeout: Any = None, backend: Any = None,
                  *args: Any, **kwargs: Any) -> Any:
        return original_new(ranks, timeout, backend if backend is None else swap(backend),
                            *args, **kwargs)

    init_process_group.__doc__ = original_init.__doc__
    new_group.__doc__ = original_new.__doc__
    for module in (c10d, dist):
        module.init_process_group = init_process_group  # type: ignore[assignment]
        module.new_group = new_group  # type: ignore[assignment]
    _SWAPPED.append((original_init, original_new))


# torch 2.13 calls these by their newer names, earlier versions by the older ones
ProcessGroupMPI.all_gather_single = ProcessGroupMPI._allgather_base  # type: ignore[attr-defined]
ProcessGroupMPI.all_gather_single_coalesced = \
    ProcessGroupMPI.allgather_into_tensor_coalesced  # type: ignore[attr-defined]
ProcessGroupMPI.reduce_scatter_single = ProcessGroupMPI._reduce_scatter_base  # type: ignore
ProcessGroupMPI.reduce_scatter_single_coalesced = \
    ProcessGroupMPI.reduce_scatter_tensor_coalesced  # type: ignore[attr-defined]
ProcessGroupMPI.all_to_all_single = ProcessGroupMPI.alltoall_base  # type: ignore
