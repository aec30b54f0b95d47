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
  so every rank gets the same bits.
* ``reduce_scatter`` and ``reduce`` run the same all-reduce and keep their part;
  ``broadcast``, ``all_gather``, ``gather``, ``scatter`` and ``all_to_all`` are MPI's own
  collectives over the tensors' bytes (every dtype travels, bfloat16 too).
* Collectives complete before they return (their ``Work`` is finished, ``wait()`` is free
  and ``get_future()`` is already done): the ranks' order of calls is the MPI order.
  ``send``/``recv`` are non-blocking MPI requests that ``wait()`` completes, on a
  communicator of their own so that their tags never meet a collective.
* A timeout given to ``init_process_group``/``new_group`` (other than torch's default of
  30 minutes) bounds every collective's agreement: past it every rank raises
  :class:`~mpistrat.CollectiveTimeoutError` naming the ranks that did not arrive.
* CUDA tensors go through :func:`mpistrat.all_reduce`'s device path (CuPy and NCCL where
  available, else staged through host memory) for ``all_reduce``; the other collectives
  stage them through host memory.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..allreduce import all_reduce
from ..errors import CollectiveTimeoutError
from ..runtime._mpi import Comm, mpi, world
from ..runtime.agreement import agree
from ..runtime.topology import get_topology
from ..spec import parse_spec

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
_UNSET_TIMEOUT = dist.AllreduceOptions().timeout  # (a call without a timeout of its own)
_NUMPY: dict[torch.dtype, Any] = {
    torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64,
    torch.complex64: np.complex64, torch.complex128: np.complex128, torch.int8: np.int8,
    torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64,
    torch.uint8: np.uint8, torch.bool: np.bool_}
for _name, _np in (("uint16", np.uint16), ("uint32", np.uint32), ("uint64", np.uint64)):
    if hasattr(torch, _name):
        _NUMPY[getattr(torch, _name)] = _np


def _bfloat16() -> Any:
    try:
        import ml_dtypes
    except ImportError:
        raise TypeError("bfloat16 tensors need the ml_dtypes package for NumPy's bfloat16: "
                        "pip install ml_dtypes") from None
    return ml_dtypes.bfloat16


def _np_dtype(dtype: torch.dtype) -> np.dtype:
    if dtype == torch.bfloat16:
        return np.dtype(_bfloat16())
    found = _NUMPY.get(dtype)
    if found is None:
        raise TypeError(f"the mpistrat backend cannot reduce tensors of dtype {dtype}: "
                        f"expected one of {sorted(str(d) for d in _NUMPY)} or torch.bfloat16")
    return np.dtype(found)


def _host(tensor: torch.Tensor) -> np.ndarray:
    """A NumPy view of a contiguous CPU tensor (any dtype, bfloat16 included)."""
    if tensor.dtype == torch.bfloat16:
        return _numpy_of(tensor.view(torch.int16)).view(_bfloat16())
    return _numpy_of(tensor)


def _numpy_of(tensor: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor of a dtype NumPy has. Through DLPack, not
    ``Tensor.numpy()``, which marks the tensor's storage as never resizable again (a
    user's ``resize_`` after a collective would fail, as it does not with gloo)."""
    return np.from_dlpack(tensor.detach())


def _bytes(tensor: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor, as a uint8 NumPy view."""
    return _numpy_of(tensor.reshape(-1).view(torch.uint8))


class _Staged:
    """A contiguous CPU tensor to work on for ``tensor``, written back by :meth:`done`."""

    __slots__ = ("tensor", "work", "back")

    def __init__(self, tensor: torch.Tensor, read: bool = True) -> None:
        self.tensor = tensor
        self.back = tensor.device.type != "cpu" or not tensor.is_contiguous()
        if not self.back:
            self.work = tensor
        elif read:
            self.work = tensor.detach().to("cpu", memory_format=torch.contiguous_format,
                                           copy=True)
        else:
            self.work = torch.empty(tensor.shape, dtype=tensor.dtype)

    def done(self) -> None:
        if self.back:
            with torch.no_grad():
                self.tensor.copy_(self.work)


def _apart(input: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of ``input`` where it shares storage with ``output`` (FSDP
    all-gathers a shard that lives inside the output; MPI forbids aliased buffers),
    else ``input`` staged as usual."""
    if input.device == output.device and \
            input.untyped_storage().data_ptr() == output.untyped_storage().data_ptr():
        return input.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)
    return _Staged(input).work


def _describe(tensors: Sequence[torch.Tensor]) -> str:
    return ",".join(f"{tuple(t.shape)}:{t.dtype}:{t.device.type}" for t in tensors)


class _Work(dist._Work):
    """What a call of the backend returns: finished at once for collectives, finished
    by ``wait()`` for point-to-point requests."""

    def __init__(self, result: Any, requests: Sequence[Any] = (),
                 finish: Callable[[], None] | None = None, source: int = -1,
                 what: str = "", timeout: float | None = None) -> None:
        super().__init__()
        self._result = result
        self._requests = list(requests)
        self._finish = finish
        self._source = source
        self._what = what  # "recv from rank 1 (tag 0)", for the timeout's message
        self._timeout = timeout  # the group's, for a wait() without one
        self._lock = threading.Lock()
        # made on the first get_future() (DDP's buckets ask; a plain call never does)
        self._future: torch.futures.Future | None = None
        if not self._requests:
            self._complete()

    def _complete(self) -> None:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        if self._future is not None:
            self._future.set_result(self._result)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if not self._requests:
            return True
        with self._lock:  # (the caller and a future's thread may both wait)
            if self._requests:
                self._wait(timeout)
        return True

    def _wait(self, timeout: datetime.timedelta | None) -> None:
        seconds = _timeout_seconds(timeout) if timeout is not None else self._timeout
        status = mpi().Status()
        (request,) = self._requests  # (one request per work)
        if seconds is None:
            request.Wait(status)
        else:
            deadline = time.monotonic() + seconds
            while not request.Test(status):
                if time.monotonic() > deadline:
                    raise CollectiveTimeoutError(
                        f"torch.distributed {self._what} did not complete within "
                        f"{seconds:g} s: is the matching send/recv posted on the peer?",
                        [self._source] if self._source >= 0 else [])
                time.sleep(0.0002)
        self._done(status)

    def _done(self, status: Any) -> None:
        self._requests = []
        if self._source < 0:
            self._source = status.Get_source()
        self._complete()

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            self._future = torch.futures.Future()
            if not self._requests:
                self._future.set_result(self._result)
            else:  # a send or receive: a thread completes it (Wait releases the GIL)
                threading.Thread(target=self._finish_in_background, daemon=True,
                                 name="mpistrat-p2p").start()
        return self._future

    def _finish_in_background(self) -> None:
        try:
            self.wait()
        except BaseException as exc:  # noqa: BLE001 - handed to the future's waiter
            assert self._future is not None
            self._future.set_exception(exc)

    def is_completed(self) -> bool:
        if self._requests and self._lock.acquire(blocking=False):
            try:
                status = mpi().Status()
                if self._requests and self._requests[0].Test(status):
                    self._done(status)
            finally:
                self._lock.release()
        return not self._requests

    def is_success(self) -> bool:
        return self.is_completed()

    def exception(self) -> Any:
        return None

    def result(self) -> Any:
        self.wait()
        return self._result

    def _source_rank(self) -> int:
        self.wait()
        return self._source

    def source_rank(self) -> int:
        return self._source_rank()

    def synchronize(self) -> None:
        self.wait()


class _Done(dist._Work):
    """The work of a collective that has finished: what :class:`_Work` is for one without
    requests, at a quarter of the cost (the fast all_reduce returns one per call)."""

    def __init__(self, result: Any) -> None:
        super().__init__()
        self._result = result

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(self._result)
        return future

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> Any:
        return None

    def result(self) -> Any:
        return self._result

    def synchronize(self) -> None:
        pass


def _keep(data: Any) -> None:
    """(A send's buffer is referenced by its work until the request completes.)"""


def _timeout_seconds(timeout: Any) -> float | None:
    """Seconds of a user's timeout; None for no bound (unset, or torch's default)."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) \
        else float(timeout)
    if seconds <= 0 or timeout == _DEFAULT_TIMEOUT:
        return None
    return seconds


try:
    from torch.distributed.constants import default_pg_timeout as _DEFAULT_TIMEOUT
except ImportError:  # pragma: no cover - every torch this supports has it
    _DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


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
        # engine's op, its work), so that a call on the same tensor skips their making
        self._last: tuple = (None,) * 7

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

    # --- agreement ------------------------------------------------------------------------

    def _agree(self, what: str, signature: str | None, error: BaseException | None = None,
               timeout: Any = None) -> None:
        seconds = _timeout_seconds(timeout) if timeout is not None else None
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

    def _reduce(self, what: str, tensors: list[torch.Tensor], opts: Any) -> list[np.ndarray]:
        """Agree, then all-reduce ``tensors`` (CPU, contiguous) in place."""
        def describe() -> str:
            if not tensors:
                raise ValueError(f"{what} got no tensors")
            ops = {str(self._op(opts, t.dtype)) for t in tensors}
            for t in tensors:
                _np_dtype(t.dtype)
            return f"{what} op={sorted(ops)} {_describe(tensors)}"
        self._checked(what, opts, describe)
        op = self._op(opts, tensors[0].dtype)
        if len({t.dtype for t in tensors}) > 1:
            for t in tensors:  # one dtype at a time
                self._reduce_arrays([_host(t)], self._op(opts, t.dtype))
        else:
            self._reduce_arrays([_host(t) for t in tensors], op)
        return []

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        opts = dist.AllreduceOptions() if opts is None else opts
        if len(tensors) == 1 and self._timeout is None:
            # the common call (DDP's buckets, dist.all_reduce): straight into the engine,
            # whose own agreement checks the call on every rank (and carries a small
            # tensor's data); the result is in place when it returns
            tensor, red = tensors[0], opts.reduceOp
            hit = self._last
            if tensor is hit[0] and red == hit[1] and opts.timeout == _UNSET_TIMEOUT \
                    and tensor.data_ptr() == hit[2] and tensor.shape == hit[3]:
                # the same tensor as the last call, its storage and shape unchanged: its
                # NumPy view, op and finished work are still good (a work's result is
                # the tensor itself, whichever call finished it)
                all_reduce(hit[4], hit[5], self._spec, self._comm, inplace=True)
                return hit[6]
            if red == _SUM_OP:  # (a pybind enum hashes slowly: SUM is tested first)
                op = "sum" if tensor.dtype in _SUMMABLE else None
            else:
                op = _FAST.get((red.op, tensor.dtype))
            if op is not None and tensor.is_cpu and tensor.is_contiguous() \
                    and opts.timeout == _UNSET_TIMEOUT:
                array, done = _numpy_of(tensor), _Done([tensor])
                all_reduce(array, op, self._spec, self._comm, inplace=True)
                # (kept as its RedOpType: a ReduceOp compares with one 6x faster than
                # with another ReduceOp)
                self._last = (tensor, red.op, tensor.data_ptr(), tensor.shape, array, op,
                              done)
                return done
        if any(t.layout == torch.sparse_coo for t in tensors):
            return self._sparse_allreduce(tensors, opts)
        return self._allreduce("all_reduce", tensors, opts)

    def _sparse_allreduce(self, tensors: list[torch.Tensor], opts: Any) -> _Work:
        """SUM of sparse COO tensors (DDP's gradients of ``nn.Embedding(sparse=True)``):
        every rank's indices and values gathered, concatenated in rank order and
        coalesced; the result replaces each tensor's contents."""
        def describe() -> str:
            if (opts.reduceOp.op != _RED.SUM or len(tensors) != 1
                    or tensors[0].layout != torch.sparse_coo):
                raise TypeError("sparse all_reduce takes one sparse COO tensor and SUM")
            return f"all_reduce sparse {tuple(tensors[0].shape)}:{tensors[0].dtype}"
        self._checked("all_reduce", opts, describe)
        tensor = tensors[0]
        mine = tensor.detach().coalesce().cpu()
        indices = self._gather_rows(mine.indices().t().contiguous())
        values = self._gather_rows(mine.values().contiguous())
        total = torch.sparse_coo_tensor(indices.t(), values, tensor.shape).coalesce()
        with torch.no_grad():
            tensor.copy_(total.to(tensor.device))
        return _Work(tensors)

    def _gather_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Every rank's ``rows`` (same trailing shape and dtype), concatenated in rank
        order (``MPI_Allgatherv`` of their bytes)."""
        counts = self._comm.allgather(rows.numel() * rows.element_size())
        out = torch.empty(sum(counts) // max(rows.element_size(), 1), dtype=rows.dtype)
        starts = np.concatenate(([0], np.cumsum(counts)[:-1])).tolist()
        self._comm.Allgatherv(_bytes(rows), [_bytes(out), counts, starts, mpi().BYTE])
        return out.view(-1, *rows.shape[1:])

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        opts = dist.AllreduceCoalescedOptions() if opts is None else opts
        return self._allreduce("all_reduce_coalesced", tensors, opts)

    def _allreduce(self, what: str, tensors: list[torch.Tensor], opts: Any) -> _Work:
        if len(tensors) == 1 and tensors[0].device.type == "cuda" \
                and (opts.reduceOp.op, tensors[0].dtype) in _FAST:
            # a CUDA tensor stays on its device: the engine's CuPy path (NCCL where the
            # spec says so), with the agreement first as for every call
            self._checked(what, opts, lambda: f"{what} op={self._op(opts, tensors[0].dtype)} "
                                              f"{_describe(tensors)}")
            all_reduce(tensors[0], _FAST[opts.reduceOp.op, tensors[0].dtype],
                       self._cuda_spec(), self._comm, check=False, inplace=True)
            return _Work(tensors)
        staged = [_Staged(t) for t in tensors]
        self._reduce(what, [s.work for s in staged], opts)
        for s in staged:
            s.done()
        return _Work(tensors)

    def _cuda_spec(self) -> Any:
        """The spec of CUDA tensors: ``MPISTRAT_TORCH_CUDA_SPEC``, default ``nccl``."""
        if self._device_spec is None:
            self._device_spec = _spec_from_env(TORCH_CUDA_SPEC, "nccl")
        return self._device_spec

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        opts = dist.ReduceOptions() if opts is None else opts
        root = opts.rootRank
        tensor = tensors[0]
        self._check_root("reduce", root)
        work = tensor.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)
        self._reduce(f"reduce root={root}", [work], opts)
        if self._comm.Get_rank() == root:
            with torch.no_grad():
                tensor.copy_(work)
        return _Work(tensors)

    def reduce_scatter(self, output_tensors: list[torch.Tensor],
                       input_tensors: list[list[torch.Tensor]], opts: Any = None) -> _Work:
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
        return _Work(output_tensors)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor,
                             opts: Any = None) -> _Work:
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
        return _Work([output])

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> _Work:
        for output, input in zip(outputs, inputs):
            self._reduce_scatter_base(output, input, opts)
        return _Work(outputs)

    # --- data movement ------------------------------------------------------------------

    def _one_per_rank(self, what: str, tensors: Sequence[torch.Tensor],
                      like: torch.Tensor) -> None:
        """Raise unless ``tensors`` holds one tensor per rank of ``like``'s size and
        dtype."""
        if len(tensors) != self._size:
            raise ValueError(f"{what} must be one tensor per rank ({self._size}), got "
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

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        opts = dist.BroadcastOptions() if opts is None else opts
        root = opts.rootRank
        self._check_root("broadcast", root)
        self._checked("broadcast", opts, lambda: f"broadcast root={root} "
                                                 f"{_describe(tensors)}")
        is_root = self._comm.Get_rank() == root
        for tensor in tensors:
            staged = _Staged(tensor, read=is_root)
            if self._size > 1 and tensor.numel():
                self._comm.Bcast(_bytes(staged.work), root=root)
            if not is_root:
                staged.done()
        return _Work(tensors)

    def allgather(self, output_tensors: list[list[torch.Tensor]],
                  input_tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        opts = dist.AllgatherOptions() if opts is None else opts
        outputs, input = output_tensors[0], input_tensors[0]

        def describe() -> str:
            self._one_per_rank("all_gather's outputs", outputs, input)
            return f"all_gather {_describe([input])}"
        self._checked("all_gather", opts, describe)
        gathered = self._gather_all(input)
        with torch.no_grad():
            for k, t in enumerate(outputs):
                t.copy_(gathered[k].view(t.shape))
        return _Work(output_tensors)

    def _gather_all(self, input: torch.Tensor) -> torch.Tensor:
        source = _Staged(input).work
        gathered = torch.empty((self._size, source.numel()), dtype=source.dtype)
        self._comm.Allgather(_bytes(source), _bytes(gathered))
        return gathered

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor,
                        opts: Any = None) -> _Work:
        opts = dist.AllgatherOptions() if opts is None else opts

        def describe() -> str:
            if output.numel() != input.numel() * self._size or output.dtype != input.dtype:
                raise ValueError(f"all_gather_into_tensor's output must hold the group's "
                                 f"{self._size} inputs of {input.numel()} {input.dtype} "
                                 f"elements, got {output.numel()} of {output.dtype}")
            return f"all_gather_into_tensor {_describe([input])}"
        self._checked("all_gather_into_tensor", opts, describe)
        staged = _Staged(output, read=False)
        self._comm.Allgather(_bytes(_apart(input, output)), _bytes(staged.work))
        staged.done()
        return _Work([output])

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> _Work:
        for output, input in zip(outputs, inputs):
            self._allgather_base(output, input, opts)
        return _Work(outputs)

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],
                            inputs: list[torch.Tensor], opts: Any = None) -> _Work:
        # torch's layout (gloo's): output_lists[rank][i] receives rank's inputs[i]
        if len(output_lists) != self._size or any(len(o) != len(inputs)
                                                  for o in output_lists):
            self._fail("all_gather_coalesced", ValueError(
                f"all_gather_coalesced needs one output list per rank ({self._size}), each "
                f"with one tensor per input ({len(inputs)})"), opts)
        for i, input in enumerate(inputs):
            self.allgather([[outputs[i] for outputs in output_lists]], [input], opts)
        return _Work(output_lists)

    def gather(self, output_tensors: list[list[torch.Tensor]],
               input_tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        opts = dist.GatherOptions() if opts is None else opts
        root, input = opts.rootRank, input_tensors[0]
        self._check_root("gather", root)
        is_root = self._comm.Get_rank() == root

        def describe() -> str:
            if is_root:
                self._one_per_rank("gather's outputs on the root",
                                   output_tensors[0] if output_tensors else [], input)
            return f"gather root={root} {_describe([input])}"
        self._checked("gather", opts, describe)
        source = _Staged(input).work
        if is_root:
            gathered = torch.empty((self._size, source.numel()), dtype=source.dtype)
            self._comm.Gather(_bytes(source), _bytes(gathered), root=root)
            with torch.no_grad():
                for k, t in enumerate(output_tensors[0]):
                    t.copy_(gathered[k].view(t.shape))
        else:
            self._comm.Gather(_bytes(source), None, root=root)
        return _Work(output_tensors)

    def scatter(self, output_tensors: list[torch.Tensor],
                input_tensors: list[list[torch.Tensor]], opts: Any = None) -> _Work:
        opts = dist.ScatterOptions() if opts is None else opts
        root, output = opts.rootRank, output_tensors[0]
        self._check_root("scatter", root)
        is_root = self._comm.Get_rank() == root

        def describe() -> str:
            if is_root:
                self._one_per_rank("scatter's inputs on the root",
                                   input_tensors[0] if input_tensors else [], output)
            return f"scatter root={root} {_describe([output])}"
        self._checked("scatter", opts, describe)
        staged = _Staged(output, read=False)
        send = None
        if is_root:
            send = torch.stack([t.detach().reshape(-1).to("cpu") for t in input_tensors[0]])
        self._comm.Scatter(None if send is None else _bytes(send), _bytes(staged.work),
                           root=root)
        staged.done()
        return _Work(output_tensors)

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> _Work:
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
        return _Work(output_tensors)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: list[int], input_split_sizes: list[int],
                      opts: Any = None) -> _Work:
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
        staged = _Staged(output, read=False)
        self._alltoallv(_apart(input, output).reshape(-1), [r * row_in for r in in_rows],
                        staged.work.reshape(-1), [r * row_out for r in out_rows])
        staged.done()
        return _Work([output])

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
        self._comm.Alltoallv([_bytes(send), counts_out, displ_out, MPI.BYTE],
                             [_bytes(receive), counts_in, displ_in, MPI.BYTE])

    def barrier(self, opts: Any = None) -> _Work:
        opts = dist.BarrierOptions() if opts is None else opts
        # the agreement is itself a synchronising collective of every rank
        self._agree("barrier", "barrier", None, getattr(opts, "timeout", None))
        return _Work(None)

    # --- point to point -------------------------------------------------------------------

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> _Work:  # noqa: N803
        tensor = tensors[0]
        if not 0 <= dstRank < self._size:
            raise ValueError(f"send: destination {dstRank} is not a rank of the group "
                             f"(0 to {self._size - 1})")
        source = _Staged(tensor).work
        data = _bytes(source)
        request = self._p2p.Isend(data, dest=dstRank, tag=tag)
        return _Work(tensors, [request], finish=lambda: _keep(data),
                     what=f"send to rank {dstRank} (tag {tag})", timeout=self._timeout)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> _Work:  # noqa: N803
        if not 0 <= srcRank < self._size:
            raise ValueError(f"recv: source {srcRank} is not a rank of the group "
                             f"(0 to {self._size - 1})")
        return self._receive(tensors, srcRank, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> _Work:
        return self._receive(tensors, mpi().ANY_SOURCE, tag)

    def _receive(self, tensors: list[torch.Tensor], source: int, tag: int) -> _Work:
        staged = _Staged(tensors[0], read=False)
        request = self._p2p.Irecv(_bytes(staged.work), source=source, tag=tag)
        peer = f"rank {source}" if source >= 0 else "any rank"
        return _Work(tensors, [request], finish=staged.done,
                     source=source if source >= 0 else -1,
                     what=f"recv from {peer} (tag {tag})", timeout=self._timeout)


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
    timeout = _timeout_seconds(backend_opts.timeout)
    try:
        spec, error = _spec_for(comm), None
    except ValueError as exc:
        spec, error = None, exc
    agree(comm, None if error else f"new group spec={spec}", error,
          "torch.distributed.new_group", "the same MPISTRAT_TORCH_SPEC")
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
    ``init_process_group()``, ``"cpu:gloo,cuda:nccl"``, ``new_group(backend="gloo")``
    (what ``mpistrat run --torch-backend mpistrat`` does before the script runs)."""
    if _SWAPPED:
        return
    import torch.distributed.distributed_c10d as c10d

    def swap(backend: Any) -> Any:
        if backend is None:
            return BACKEND_NAME
        text = str(backend).lower()
        if text == "gloo" or text == "mpi":
            return BACKEND_NAME
        if ":" in text:  # "cpu:gloo,cuda:nccl"
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



# torch 2.13 calls these by their newer names; torch 2.1-2.12 by the older ones
ProcessGroupMPI.all_gather_single = ProcessGroupMPI._allgather_base  # type: ignore[attr-defined]
ProcessGroupMPI.all_gather_single_coalesced = \
    ProcessGroupMPI.allgather_into_tensor_coalesced  # type: ignore[attr-defined]
ProcessGroupMPI.reduce_scatter_single = ProcessGroupMPI._reduce_scatter_base  # type: ignore
ProcessGroupMPI.reduce_scatter_single_coalesced = \
    ProcessGroupMPI.reduce_scatter_tensor_coalesced  # type: ignore[attr-defined]
ProcessGroupMPI.all_to_all_single = ProcessGroupMPI.alltoall_base  # type: ignore
