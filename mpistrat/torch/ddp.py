"""mpistrat's own data-parallel wrapper for PyTorch (``mpistrat.torch.DistributedDataParallel``).

* :func:`broadcast_parameters` copies a module's parameters and buffers from a root rank
  to every rank (one ``Bcast``), so every rank starts from the same model;
  :func:`broadcast_optimizer_state` does the same for an optimizer's state.
* :class:`DistributedDataParallel` wraps a module like ``torch.nn.parallel.
  DistributedDataParallel``: when ``loss.backward()`` returns, every parameter's ``.grad``
  is the mean (or sum) over the ranks, bitwise identical on every rank.

How the gradients travel (docs/torch.md has the measurements):

* Every trainable parameter owns a slice of a flat **bucket** (one set of buckets per
  dtype, at most ``bucket_bytes`` each) in memory shared by the ranks of a node
  (:func:`mpistrat.shared_empty`), so the ``shm`` all-reduce reads and writes the
  buckets where they lie: no copy into MPI's queues, no copy out.
* Backward fills the buckets **without zeroing or accumulating**: autograd hands each
  parameter a fresh gradient (after ``zero_grad()``, whose default sets ``.grad`` to
  None), and the parameter's post-accumulate-grad hook writes it, divided by the number of
  ranks for MEAN, into the parameter's slice while it is still in cache, then points
  ``.grad`` at that slice. Keeping ``.grad`` as permanent views of one buffer instead
  would need ``zero_grad()`` to write zeros over every bucket and autograd to add into
  them, which costs more than the one copy.
* A bucket is all-reduced in place inside the hook that completes it, buckets in a fixed
  order on every rank (bucket ``k`` waits for ``k - 1``), so the reduction of the late
  layers' gradients runs while backward has yet to compute the early layers'.
* A model whose gradients fit one bucket of at most :data:`FUSED_BYTES` skips the
  per-parameter work: its hooks only mark the start of the pass, and at the end of
  backward one fused copy puts every gradient into the bucket, one pass divides it and
  one all-reduce reduces it (the gradients are still in cache; per-parameter Python costs
  more than it saves).
* At the end of backward, parameters that got no gradient on this rank contribute zeros;
  the last bucket also counts, per parameter, the ranks that had a gradient, and a
  parameter that none had keeps ``.grad = None`` on every rank, as in one process.

Under :mod:`mpistrat.trace` each bucket's reduction is a collective span ``bucket
all_reduce`` (args ``bucket``, ``bytes``, the algorithm and bandwidths) on the thread that
runs backward, and :func:`broadcast_parameters` one ``broadcast_parameters``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import dispatch
from ..backends import get_backend
from ..backends.torch_dtypes import NUMPY_DTYPES, numpy_dtype
from ..ops import ReduceOp
from ..runtime import recorder
from ..runtime._mpi import Comm, world
from ..runtime.agreement import agree, close_door, dtype_name, dtype_of, open_door
from ..runtime.shared import shared_empty
from ..runtime.topology import get_topology
from ..spec import parse_spec

__all__ = ["DistributedDataParallel", "broadcast_parameters",
           "broadcast_optimizer_state", "DEFAULT_BUCKET_BYTES", "FUSED_BYTES"]

DEFAULT_BUCKET_BYTES = 25 << 20  # few large buckets: measured on ResNet-50, docs/torch.md
# gradients up to this size, in one bucket, go into it at the end of backward in one fused
# pass instead of one hook at a time (measured both ways in docs/torch.md)
FUSED_BYTES = 2 << 20
_ALIGN = 4096  # bytes: each bucket starts on its own page

_GRADIENT_DTYPES = {d: t for d, t in NUMPY_DTYPES.items()
                    if d.is_floating_point or d.is_complex}


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The NumPy dtype that holds a torch dtype's gradients."""
    return numpy_dtype(dtype, "all-reduce gradients", _GRADIENT_DTYPES)


def _tensors_of(source: Any) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a module (parameters, then buffers), a mapping such as a
    state_dict, or an iterable of tensors, in a deterministic order."""
    if isinstance(source, torch.nn.Module):
        pairs = list(source.named_parameters()) + list(source.named_buffers())
    elif isinstance(source, Mapping):
        pairs = list(source.items())
    elif isinstance(source, Iterable):
        pairs = [(str(i), t) for i, t in enumerate(source)]
    else:
        raise TypeError(f"broadcast_parameters takes a torch.nn.Module, a state_dict or an "
                        f"iterable of tensors, got a {type(source).__name__}")
    for name, tensor in pairs:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"entry {name!r} is a {type(tensor).__name__}, not a tensor; "
                            f"pass only tensors (a module's state_dict() has only tensors)")
        if tensor.device.type != "cpu":
            raise ValueError(f"tensor {name!r} is on {tensor.device}: mpistrat.torch "
                             f"broadcasts CPU tensors; move the module to the CPU first")
    return pairs


def broadcast_parameters(source: Any, root: int = 0, comm: Comm | None = None) -> None:
    """Copy tensors from rank ``root`` into the same tensors on every other rank, in place.

    Collective over ``comm``: every rank passes the same structure (names, shapes and
    dtypes are checked on every rank first, so a mismatch raises everywhere instead of
    hanging). All tensors travel in one ``Bcast``.

    Args:
        source: a ``torch.nn.Module`` (its parameters and buffers), a mapping of names to
            tensors (e.g. ``module.state_dict()``), or an iterable of tensors.
        root: the rank whose values every rank gets.
        comm: an mpi4py intracommunicator (default ``COMM_WORLD``).

    Raises:
        TypeError, ValueError: bad arguments, or ranks that passed different structures
            (:class:`~mpistrat.CollectiveMismatchError`), on every rank.
    """
    comm = world() if comm is None else comm
    pairs: list[tuple[str, torch.Tensor]] = []
    error: BaseException | None = None
    try:
        if isinstance(root, bool) or not isinstance(root, int) \
                or not 0 <= root < comm.Get_size():
            raise ValueError(f"root must be a rank of the communicator (0 to "
                             f"{comm.Get_size() - 1}), got {root!r}")
        pairs = _tensors_of(source)
    except (TypeError, ValueError) as exc:
        error = exc
    signature = None if error is not None else f"root={root} " + ";".join(
        f"{name}:{tuple(t.shape)}:{t.dtype}" for name, t in pairs)
    start = open_door(comm) if recorder.on else 0
    try:
        agree(comm, signature, error, "broadcast_parameters",
              "the same root and tensors (names, shapes, dtypes) in the same order")
        if comm.Get_size() == 1 or not pairs:
            return
        sizes = [t.numel() * t.element_size() for _, t in pairs]
        starts = [0]  # every tensor on a 16-byte boundary, so any dtype can view it
        for size in sizes:
            starts.append(starts[-1] + -(-size // 16) * 16)
        flat = torch.empty(starts[-1], dtype=torch.uint8)
        with torch.no_grad():
            if comm.Get_rank() == root:
                for (_, tensor), at, size in zip(pairs, starts, sizes):
                    flat[at:at + size].view(tensor.dtype).view(tensor.shape).copy_(tensor)
            comm.Bcast(flat.numpy(), root=root)
            if comm.Get_rank() != root:
                for (_, tensor), at, size in zip(pairs, starts, sizes):
                    tensor.copy_(flat[at:at + size].view(tensor.dtype).view(tensor.shape))
    finally:
        if start:
            count = sum(t.numel() for _, t in pairs)
            close_door(start, "broadcast_parameters", "broadcast", comm.Get_size(),
                       _dtypes(pairs), count, count,
                       sum(t.numel() * t.element_size() for _, t in pairs), "MPI_Bcast",
                       {"root": root, "tensors": len(pairs)})


def _dtypes(pairs: list[tuple[str, torch.Tensor]]) -> str:
    """The tensors' dtype as the trace writes it ("mixed" for several)."""
    return dtype_of([t for _, t in pairs]) if pairs else ""


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root: int = 0,
                              comm: Comm | None = None) -> None:
    """Give every rank rank ``root``'s optimizer state (step counts, momentum buffers,
    hyperparameters of every group), through ``optimizer.load_state_dict``.

    Collective over ``comm``; call it after :func:`broadcast_parameters` when resuming
    from a checkpoint that only ``root`` loaded. A fresh optimizer has no state to send.
    """
    comm = world() if comm is None else comm
    if comm.Get_size() == 1:
        return
    state = comm.bcast(optimizer.state_dict() if comm.Get_rank() == root else None, root=root)
    if comm.Get_rank() != root:
        optimizer.load_state_dict(state)


class _Pass:
    """What one backward pass has done so far."""

    __slots__ = ("task", "next", "filled", "had", "calls")

    def __init__(self, count: int) -> None:
        self.task: int | None = None  # the backward pass being reduced
        self.next = 0  # the next bucket to reduce, in order
        self.filled = [False] * count  # the parameter's slice holds its share
        self.had = 0  # parameters this rank had a gradient for
        self.calls = 0  # all-reduces run, over every pass (rotates pscpu's gather ranks)


@dataclass
class _Bucket:
    """Consecutive parameters of one dtype whose gradients are reduced together."""

    array: np.ndarray  # the bucket, 1-D, in shared memory (what the all-reduce reads)
    params: list[int]  # indices into the reducer's parameter list
    pending: int = 0  # parameters still to be written this step


class DistributedDataParallel(torch.nn.Module):
    """Wrap ``module`` so that ``backward()`` leaves every parameter's ``.grad`` reduced
    across the ranks of ``comm`` (MEAN by default), bitwise identical on every rank.

    Construction is collective over ``comm``: it checks that every rank wraps the same
    parameters (shapes and dtypes), broadcasts the module's parameters and buffers from
    rank ``root`` (``broadcast=False`` skips that), and allocates the gradient buckets.

    Every rank must run the same number of ``backward()`` passes through the module, and
    each pass must reach at least one trainable parameter; which parameters get a gradient
    may differ between ranks and steps. Call ``optimizer.zero_grad()`` (which sets
    ``.grad`` to None) between steps: gradients left in place are accumulated into, as in
    one process, and reduced again. For gradient accumulation, run the first backward
    passes of a step inside :meth:`no_sync`.

    Args:
        module: the model; its parameters and buffers must be on the CPU.
        comm: an mpi4py intracommunicator (default ``COMM_WORLD``).
        op: ``"mean"`` (default) or ``"sum"`` over the ranks.
        spec: the all-reduce spec (any form :func:`mpistrat.parse_spec` accepts); default
            ``"shm"`` when every rank of ``comm`` is on one node, else ``"shm/rechd"``.
        bucket_bytes: the largest bucket (a larger parameter gets a bucket of its own).
        broadcast: broadcast parameters and buffers from ``root`` at construction.
        root: the rank whose initial state every rank takes.

    Raises:
        TypeError, ValueError: bad arguments, on every rank.
        CollectiveMismatchError: ranks wrapped different parameters or passed different
            options, on every rank.
    """

    def __init__(self, module: torch.nn.Module, *, comm: Comm | None = None,
                 op: str | ReduceOp = "mean", spec: Any = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, broadcast: bool = True,
                 root: int = 0) -> None:
        super().__init__()
        self.module = module
        self.comm = world() if comm is None else comm
        error: BaseException | None = None
        signature = None
        try:
            if not isinstance(module, torch.nn.Module):
                raise TypeError(f"DistributedDataParallel wraps a torch.nn.Module, got a "
                                f"{type(module).__name__}")
            self.op = ReduceOp.parse(op)
            if self.op not in (ReduceOp.MEAN, ReduceOp.SUM):
                raise ValueError(f"op must be 'mean' or 'sum' for gradients, got {op!r}")
            if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) \
                    or bucket_bytes < 1:
                raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
            params = [p for p in module.parameters() if p.requires_grad]
            for index, p in enumerate(params):
                if p.device.type != "cpu":
                    raise ValueError(f"parameter {index} is on {p.device}: mpistrat.torch "
                                     f"reduces CPU gradients; keep the module on the CPU")
                _numpy_dtype(p.dtype)
            if spec is None:
                spec = "shm" if get_topology(self.comm).num_nodes == 1 else "shm/rechd"
            self.spec = parse_spec(spec)
            signature = (f"op={self.op.name} spec={self.spec} bucket_bytes={bucket_bytes} "
                         f"root={root} broadcast={broadcast} params="
                         + ";".join(f"{tuple(p.shape)}:{p.dtype}" for p in params))
        except (TypeError, ValueError) as exc:
            error = exc
        agree(self.comm, signature, error, "DistributedDataParallel",
              "the same module structure and options")
        if broadcast:
            broadcast_parameters(module, root, self.comm)
        self._params = params
        self._size = self.comm.Get_size()
        self._buckets, self._bucket_of, self._views, self._counts = \
            self._make_buckets(bucket_bytes)
        # the spec entry of every bucket, checked once against the job's layout (on every
        # rank alike); each step then runs the algorithms without re-checking
        self._routes = [self.spec.route(b.array.nbytes) for b in self._buckets]
        for entry in set(self._routes):
            dispatch.fit(entry.alg, self.comm, entry.shards)
        self._backend = get_backend(self._counts)
        self._sync = True
        self._divide = self.op is ReduceOp.MEAN and self._size > 1
        # one small bucket: filled, divided and reduced at the end of backward in one pass
        self._fused = len(self._buckets) == 1 and self._buckets[0].array.nbytes <= FUSED_BYTES
        if self._fused:
            grads = self._buckets[0].array[:sum(p.numel() for p in params)]
            self._region = torch.from_numpy(grads.view(np.uint8)).view(params[0].dtype)
        # per-pass state in a plain object: attribute stores on a Module go through
        # Module.__setattr__, a few microseconds each, and the hooks make them per gradient
        self._pass = _Pass(len(params))
        self._had = np.zeros(len(params), dtype=bool)  # this rank had a gradient
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(i))
                         for i, p in enumerate(params)]

    # --- public --------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module (the hooks are on its parameters, so calling the module
        itself works as well).

        No step boundary of an elastic job is marked here (a step may run several
        forward passes): :class:`mpistrat.torch.DistributedBatchSampler` marks one before
        each batch, or the script calls :func:`mpistrat.elastic.step`."""
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside this context, backward passes only accumulate gradients locally; the
        first backward pass after it reduces what was accumulated."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    @property
    def buckets(self) -> list[tuple[torch.dtype, int, int]]:
        """(dtype, bytes, number of parameters) of every bucket, in reduction order."""
        return [(self._params[b.params[0]].dtype, b.array.nbytes, len(b.params))
                for b in self._buckets]

    def remove_hooks(self) -> None:
        """Stop reducing: remove the gradient hooks from the module's parameters."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # --- buckets ---------------------------------------------------------------------------

    def _make_buckets(self, bucket_bytes: int) -> tuple[list[_Bucket], list[int],
                                                        list[torch.Tensor], np.ndarray]:
        """Buckets in reverse parameter order (about the order backward produces the
        gradients), cut at ``bucket_bytes`` and by dtype; one shared array per dtype.

        The last bucket to be reduced carries one more element per parameter: 1 where
        this rank had a gradient, so its all-reduce also counts the ranks that had one.
        """
        groups: dict[torch.dtype, list[list[int]]] = {}
        order: list[tuple[torch.dtype, int]] = []  # (dtype, index in its group) per bucket
        size: dict[torch.dtype, int] = {}
        for i in reversed(range(len(self._params))):
            p = self._params[i]
            nbytes = p.numel() * p.element_size()
            lists = groups.setdefault(p.dtype, [])
            if not lists or (size[p.dtype] + nbytes > bucket_bytes and size[p.dtype] > 0):
                lists.append([])
                order.append((p.dtype, len(lists) - 1))
                size[p.dtype] = 0
            lists[-1].append(i)
            size[p.dtype] += nbytes
        views: list[torch.Tensor] = [torch.empty(0)] * len(self._params)
        bucket_of = [0] * len(self._params)
        arrays: dict[tuple[torch.dtype, int], np.ndarray] = {}
        counts = np.zeros(0, dtype=np.float32)
        for dtype in sorted(groups, key=str):  # the same allocation order on every rank
            np_dtype = _numpy_dtype(dtype)
            item = np_dtype.itemsize
            spans = [sum(self._params[i].numel() for i in members) for members in groups[dtype]]
            if order and order[-1][0] == dtype:
                spans[order[-1][1]] += len(self._params)
            padded = [-(-n * item // _ALIGN) * _ALIGN // item for n in spans]
            memory = shared_empty(max(1, sum(padded)), np_dtype, self.comm)
            as_torch = torch.from_numpy(memory.view(np.uint8)).view(dtype)
            at = 0
            for k, (members, span) in enumerate(zip(groups[dtype], spans)):
                arrays[dtype, k] = memory[at:at + span]
                offset = at
                for i in members:
                    p = self._params[i]
                    views[i] = as_torch[offset:offset + p.numel()].view(p.shape)
                    offset += p.numel()
                if (dtype, k) == order[-1]:
                    counts = memory[offset:offset + len(self._params)]
                at += padded[k]
        buckets = []
        for index, (dtype, k) in enumerate(order):
            members = groups[dtype][k]
            buckets.append(_Bucket(arrays[dtype, k], members))
            for i in members:
                bucket_of[i] = index
        return buckets, bucket_of, views, counts

    # --- one backward pass ---------------------------------------------------------------

    def _hook(self, index: int) -> Any:
        bucket = self._buckets[self._bucket_of[index]]
        task_id = torch._C._current_graph_task_id

        state = self._pass

        def start(param: torch.Tensor) -> None:  # (fused: the rest is in _finish)
            if self._sync and state.task != task_id():
                self._begin()

        def hook(param: torch.Tensor) -> None:
            if not self._sync:
                return
            if state.task != task_id():
                self._begin()
            if state.filled[index]:
                return
            self._fill(index, param)
            bucket.pending -= 1
            if not bucket.pending:
                buckets, count = self._buckets, len(self._buckets)
                while state.next < count and not buckets[state.next].pending:
                    self._reduce(state.next)
                    state.next += 1
        return start if self._fused else hook

    def _begin(self) -> None:
        """First gradient of a backward pass: reset, and reduce the rest at its end."""
        state = self._pass
        state.task = torch._C._current_graph_task_id()
        state.next = 0
        state.filled = [False] * len(self._params)
        state.had = 0
        self._had[:] = False
        for bucket in self._buckets:
            bucket.pending = len(bucket.params)
        torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _fill(self, index: int, param: torch.Tensor) -> None:
        """Write this rank's share of the gradient into the parameter's bucket slice."""
        view, grad = self._views[index], param.grad
        assert grad is not None
        if grad.requires_grad:  # (backward with create_graph=True)
            grad = grad.detach()
        if grad.data_ptr() != view.data_ptr():  # a fresh gradient: into the slice
            if self._divide:
                torch.div(grad, self._size, out=view)
            else:
                view.copy_(grad)
            param.grad = view
        elif self._divide:  # accumulated in the slice already
            view.div_(self._size)
        state = self._pass
        state.filled[index] = True
        state.had += 1
        self._had[index] = True

    def _fill_all(self) -> None:
        """:meth:`_fill` for every parameter of the one bucket at once: one fused copy of
        the fresh gradients, zeros for the missing ones, one division of the bucket
        (elementwise as :meth:`_fill`'s, so the same bits)."""
        state = self._pass
        views, grads = [], []
        for index, param in enumerate(self._params):
            grad, view = param.grad, self._views[index]
            if grad is None:
                view.zero_()
            else:
                state.had += 1
                self._had[index] = True
                if grad.data_ptr() != view.data_ptr():  # else accumulated in the slice
                    views.append(view)
                    grads.append(grad.detach() if grad.requires_grad else grad)
                    param.grad = view
        if views:
            torch._foreach_copy_(views, grads)
        if self._divide:
            self._region.div_(self._size)
        state.filled = [True] * len(self._params)

    def _reduce(self, index: int) -> None:
        """All-reduce bucket ``index`` in place (SUM: MEAN's division came with the copy).
        Traced: a span ``bucket all_reduce`` (a collective: cpu_op) on the thread that
        runs backward."""
        start = open_door(self.comm) if recorder.on else 0
        bucket = self._buckets[index]
        if index == len(self._buckets) - 1:
            self._counts[:] = self._had
        entry = self._routes[index]
        try:
            if self._size > 1:
                dispatch.run(entry.alg, self.comm, bucket.array, op=ReduceOp.SUM,
                             shards=entry.shards, backend=self._backend,
                             rotation=self._pass.calls, checked=True)
                self._pass.calls += 1
        finally:
            if start:
                close_door(start, "bucket all_reduce", "allreduce", self._size,
                           dtype_name(bucket.array.dtype), bucket.array.size, bucket.array.size,
                           bucket.array.nbytes, "" if self._size > 1 else "local",
                           {"bucket": index, "buckets": len(self._buckets),
                            "parameters": len(bucket.params)})

    def _finish(self) -> None:
        """End of backward: zeros for the parameters this rank has no gradient for, the
        remaining buckets in order, then ``.grad`` set by how many ranks had one."""
        state = self._pass
        state.task = None
        if self._fused:
            self._fill_all()
        for index, param in enumerate(self._params):
            if state.filled[index]:
                continue
            if param.grad is not None:  # accumulated earlier (no_sync), unused now
                self._fill(index, param)
            else:
                self._views[index].zero_()
                state.filled[index] = True
        for index in range(state.next, len(self._buckets)):
            self._reduce(index)
        state.next = len(self._buckets)
        if state.had < len(self._params):  # (a rank that had every one: all counts >= 1)
            for index, param in enumerate(self._params):
                if self._counts[index] == 0:
                    param.grad = None
                elif param.grad is None:
                    param.grad = self._views[index]
