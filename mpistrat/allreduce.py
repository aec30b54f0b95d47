"""``all_reduce``: reduce one tensor, a batch of tensors, or a rank's local replicas of one
tensor across a communicator.

What happens on every rank, in order:

1. the value is taken at the edge (:mod:`mpistrat.backends.interop`): arrays of any library
   (NumPy, CuPy, PyTorch, JAX, anything exposing DLPack, the array or CUDA array interface
   or the buffer protocol) become NumPy or CuPy arrays sharing their memory; the op and
   the spec are parsed and each tensor's spec entry is chosen by its byte size;
2. unless ``check=False``, the ranks agree that they all asked for the same thing (the
   form, shapes, dtypes, op, spec, ``inplace``, ``out``): every rank contributes a
   fixed-size block (a header holding a hash of its call) to one allgather (the
   *exchange* of :mod:`mpistrat.runtime.agreement`); a rank whose arguments were invalid
   takes part too, so a mistake on one rank raises the same error on every rank instead
   of leaving the others waiting;
3. the chosen entries are checked against the job's layout (e.g. shards above the number
   of gather ranks) — identical on every rank, so it fails everywhere or nowhere;
4. one array of at most ``FUSED_BYTES`` (4 KiB) of host memory, on up to
   ``FUSED_RANKS`` (16) ranks, is **small**: its data travels in the exchange's block
   (with ``check=False``, in one allgather of the data alone), and every rank reduces the
   ``W`` gathered arrays itself, in rank order (``((x0 + x1) + x2) + ...``), so one
   collective does the whole call; the spec's algorithm does not run;
5. otherwise, one tensor: its ``G`` local replicas are combined (in replica order), the
   algorithm reduces the result across ranks (in place when it can), MEAN divides by
   ``W * G``; a batch: the tensors go to their spec entries by size and are packed as
   ``MultiWorkerAllReduce.batch_reduce`` packs them (the algorithms read the packs
   straight from the tensors). Results are written into the inputs (``inplace=True``),
   into ``out``, or into new arrays, and come back as the caller's array type.

Calls are planned once: what a call needs beyond its arrays (the parsed op and spec, the
signature's hash, the views on the exchange's buffers) is kept per communicator, keyed by
the array's shape and dtype and the arguments (a spec as a string, an ``AllReduceSpec``
or a tuple of str and int items, TF's form), so a loop of small calls costs one
allgather and a few NumPy operations. What a plan cannot stand for, because it may
change between calls with equal keys, is checked on each call: with ``inplace=True``,
that the array is writeable (a read-only one takes the unplanned path, which raises on
every rank).

Inputs are never modified unless ``inplace=True``. Results are bitwise identical on
every rank. MEAN of integers returns float64, as TensorFlow does; SUM keeps the dtype.

Under :mod:`mpistrat.trace` each call is one span ``all_reduce`` (a ``cpu_op`` with
Kineto's collective args, the algorithm, bytes, the call's ``seq`` on the communicator
and the bandwidths; a phase when another collective, such as the torch backend's, calls
it), holding its ``agreement`` and phases. With tracing off the calls cost one branch.
"""

from __future__ import annotations

import functools
import itertools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from time import monotonic_ns
from typing import Any

import numpy as np

from . import algorithms, dispatch, engine, fused
from .backends import copy_all, get_backend
from .backends.interop import describe_type, is_writeable, restore, to_native
from .backends.protocol import ArrayBackend
from .errors import CollectiveMismatchError, TopologyError
from .ops import ReduceOp
from .runtime import recorder
from .runtime._commcache import comm_cache
from .runtime._mpi import Comm, world
from .runtime.agreement import (
    DOORS,
    FUSED_BYTES,
    FUSED_RANKS,
    agree_exchange,
    close_door,
    dtype_of,
    exchange,
    open_door,
    phase,
    signature_code,
)
from .runtime.topology import env_ranks_per_node
from .spec import AllReduceSpec, AllReduceSpecTuple, parse_spec
from .values import PerReplica

__all__ = ["all_reduce", "CollectiveMismatchError", "FUSED_BYTES", "FUSED_RANKS"]

_WHAT = "all_reduce"
_HINT = "the same form (one array, a batch, or replicas), shapes, dtypes, op and spec"


@dataclass(frozen=True)
class _Call:
    """One tensor (``arrays``: its ``G`` local replicas, as backend arrays)."""

    arrays: list[Any]
    likes: list[Any]          # the caller's values, to hand results back as their type
    outs: list[Any] | None    # ``out``'s arrays, one per replica
    out_likes: list[Any]      # ``out`` as the caller gave it, one per replica
    backend: ArrayBackend
    op: ReduceOp
    spec: AllReduceSpec
    entry: AllReduceSpecTuple
    inplace: bool
    ranks_per_node: int | None
    replicas: bool            # given as a PerReplica (a list comes back)
    small: bool               # reduced inside the exchange (see the module docstring)

    @property
    def signature(self) -> str:
        """What every rank must agree on, as text (built only when checking)."""
        first = self.arrays[0]
        text = (f"G={len(self.arrays)} shape={first.shape} dtype={first.dtype.str} "
                f"op={self.op.name} spec={self.spec} inplace={self.inplace} "
                f"out={self.outs is not None} form={'replicas' if self.replicas else 'one'} "
                f"via={'exchange' if self.small else 'algorithm'} "
                f"on={'gpu' if self.backend.name == 'cupy' else 'host'}")
        if algorithms.get(self.entry.alg).hierarchical:
            text += _node_grouping(self.ranks_per_node)
        return text


@dataclass(frozen=True)
class _Batch:
    """A batch of tensors, one replica each."""

    arrays: list[Any]
    likes: list[Any]
    outs: list[Any] | None
    out_likes: list[Any]
    op: ReduceOp
    spec: AllReduceSpec
    inplace: bool
    ranks_per_node: int | None
    on_gpu: bool              # device (CuPy) arrays: GPU algorithms such as nccl fit

    @property
    def signature(self) -> str:
        text = (f"batch {_batch_text(engine.structure(self.arrays))} op={self.op.name} "
                f"spec={self.spec} inplace={self.inplace} out={self.outs is not None} "
                f"on={'gpu' if self.on_gpu else 'host'}")
        if any(algorithms.get(entry.alg).hierarchical for entry in self.spec):
            text += _node_grouping(self.ranks_per_node)
        return text


@functools.lru_cache(maxsize=64)
def _batch_text(structure: tuple) -> str:
    return ";".join(f"{shape}:{dtype.str}" for shape, dtype in structure)


def _node_grouping(ranks_per_node: int | None) -> str:
    # ranks must agree on the node grouping too (a cached topology would hide it)
    effective = ranks_per_node if ranks_per_node is not None \
        else env_ranks_per_node()  # (the same parse get_topology uses)
    return f" ranks_per_node={effective}"


_SPEC_CACHE: dict[Any, AllReduceSpec] = {}


def _spec(spec: Any) -> AllReduceSpec:
    if isinstance(spec, AllReduceSpec):
        return spec
    # Keyed by repr: ("xring", True) == ("xring", 1) as tuples, but only one is valid.
    key = repr(spec) if isinstance(spec, (str, tuple)) else None
    cached = _SPEC_CACHE.get(key) if key is not None else None
    if cached is not None:
        return cached
    parsed = parse_spec(spec)
    if key is not None and len(_SPEC_CACHE) < 256:
        _SPEC_CACHE[key] = parsed
    return parsed


def _native(item: Any, what: str) -> Any:
    if type(item) is np.ndarray:
        return item
    if np.isscalar(item):
        return np.asarray(item)
    return to_native(item, what)


def _check_dtype(dtype: Any, op: ReduceOp, inplace: bool) -> None:
    if not (dtype.kind in "fiuc" or dtype.name == "bfloat16"):
        raise TypeError(f"cannot all-reduce dtype {dtype}: expected a numeric dtype "
                        f"(float16/32/64, bfloat16, int*, uint*, complex)")
    if dtype.kind == "c" and op in (ReduceOp.MIN, ReduceOp.MAX):
        raise TypeError(f"{op} is not defined for complex dtype {dtype}")
    if inplace and op is ReduceOp.MEAN and dtype.kind in "iu":
        raise TypeError(f"inplace=True cannot hold a MEAN of integers ({dtype}): the "
                        f"result is float64; drop inplace=True or use op='sum'")


def _check_writeable(array: Any, like: Any, what: str) -> None:
    if not is_writeable(array):
        why = " (JAX arrays are immutable)" if type(like).__module__.startswith("jax") else ""
        fix = "drop inplace=True and use the result" if what == "inplace=True" \
            else "pass writeable arrays as out"
        raise ValueError(f"{what} needs writeable arrays, got a read-only "
                         f"{describe_type(like)}{why}; {fix}")


def _outs(out: Any, count: int, shape: Any, dtype: Any, form: str,
          ) -> tuple[list[Any], list[Any]]:
    """``out`` as backend arrays and as given, one per result, each checked against its
    result."""
    items = list(out.values if isinstance(out, PerReplica) else out) \
        if isinstance(out, (list, tuple, PerReplica)) else [out]
    if len(items) != count or form == "one" and isinstance(out, (list, tuple, PerReplica)):
        raise ValueError(f"out must be {'one array' if form == 'one' else f'{count} arrays'} "
                         f"like the result, got {len(items)}")
    arrays = [_native(item, "write the result into") for item in items]
    for index, (array, like) in enumerate(zip(arrays, items)):
        want_shape = shape[index] if form == "batch" else shape
        want_dtype = dtype[index] if form == "batch" else dtype
        if tuple(array.shape) != tuple(want_shape) or array.dtype != want_dtype:
            raise ValueError(
                f"out[{index}] has shape {tuple(array.shape)} and dtype {array.dtype}; the "
                f"result has shape {tuple(want_shape)} and dtype {want_dtype}: pass an "
                f"array of that shape and dtype" if form != "one" else
                f"out has shape {tuple(array.shape)} and dtype {array.dtype}; the result has "
                f"shape {tuple(want_shape)} and dtype {want_dtype}: pass an array of that "
                f"shape and dtype")
        _check_writeable(array, like, "out")
    return arrays, items


def _check_rpn(ranks_per_node: Any) -> None:
    if ranks_per_node is not None and (
            isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int)
            or ranks_per_node < 1):
        raise TopologyError(
            f"ranks_per_node must be a positive int or None, got {ranks_per_node!r}"
        )


_WARNED: list[bool] = []


def _warn_list_of_replicas(items: list[Any]) -> None:
    """Once per process: a list of like arrays used to mean one tensor's replicas."""
    if _WARNED or len(items) < 2:
        return
    first = items[0]
    if all(getattr(a, "shape", None) == first.shape and getattr(a, "dtype", None)
           == first.dtype for a in items[1:]):
        _WARNED.append(True)
        warnings.warn(
            "all_reduce(list) reduces each array of the list as a tensor of its own (a "
            "batch); before mpistrat 0.2 a list of arrays of one shape meant this rank's "
            "local replicas of one tensor, summed together. For replicas, pass "
            "mpistrat.PerReplica([...]).", FutureWarning, stacklevel=3)


def _prepare(value: Any, op: Any, spec: Any, inplace: bool, out: Any,
             ranks_per_node: int | None, size: int) -> _Call | _Batch:
    """Parse and check one call's arguments on this rank (no communication); ``size``:
    the communicator's."""
    reduce_op = ReduceOp.parse(op)
    _check_rpn(ranks_per_node)
    parsed = _spec(spec)
    if isinstance(value, (list, tuple)) and not _is_numbers(value):
        return _prepare_batch(list(value), reduce_op, parsed, inplace, out, ranks_per_node)
    if isinstance(value, PerReplica):
        likes = list(value.values)
    else:
        likes = [value]
    arrays = [_native(item, "all-reduce") for item in likes]
    backend = get_backend(arrays[0])
    first = arrays[0]
    for index, array in enumerate(arrays[1:], start=1):
        if array.shape != first.shape or array.dtype != first.dtype:
            raise ValueError(
                f"local replica {index} has shape {array.shape} and dtype {array.dtype}, "
                f"replica 0 has {first.shape} and {first.dtype}; every replica of a tensor "
                f"must have the same shape and dtype"
            )
        if get_backend(array) is not backend:
            raise ValueError(f"local replica {index} lives on another device than replica 0; "
                             f"the replicas of one all_reduce must share a backend")
    _check_dtype(first.dtype, reduce_op, inplace)
    if inplace:
        if out is not None:
            raise ValueError("inplace=True writes into the inputs: drop out, or inplace")
        for array, like in zip(arrays, likes):
            if isinstance(like, (int, float, complex, np.generic)):  # no memory to write
                raise ValueError(f"inplace=True needs arrays, got a {describe_type(like)}; "
                                 f"pass an array, or drop inplace=True")
            _check_writeable(array, like, "inplace=True")
    outs, out_likes = (None, []) if out is None else _outs(
        out, len(arrays), first.shape, reduce_op.result_dtype(first.dtype),
        "replicas" if isinstance(value, PerReplica) else "one")
    replicas = isinstance(value, PerReplica)
    small = (not replicas and size <= FUSED_RANKS and first.nbytes <= FUSED_BYTES
             and backend.name == "numpy")
    return _Call(arrays, likes, outs, out_likes, backend, reduce_op, parsed,
                 parsed.route(first.nbytes), inplace, ranks_per_node, replicas, small)


def _is_numbers(value: Any) -> bool:
    """A list of numbers is one tensor (as ``numpy.asarray`` reads it), not a batch."""
    return bool(value) and all(np.isscalar(x) and not isinstance(x, (str, bytes))
                               for x in value)


def _prepare_batch(items: list[Any], op: ReduceOp, spec: AllReduceSpec, inplace: bool,
                   out: Any, ranks_per_node: int | None) -> _Batch:
    arrays = [_native(item, "all-reduce") for item in items]
    _warn_list_of_replicas(arrays)
    for array, like in zip(arrays, items):
        _check_dtype(array.dtype, op, inplace)
        if inplace:
            _check_writeable(array, like, "inplace=True")
    if inplace and out is not None:
        raise ValueError("inplace=True writes into the inputs: drop out, or inplace")
    kinds = {get_backend(a).name for a in arrays}
    if len(kinds) > 1:
        raise ValueError("a batch mixes host and device arrays; reduce them in two calls")
    outs, out_likes = (None, []) if out is None else _outs(
        out, len(arrays), [a.shape for a in arrays],
        [op.result_dtype(a.dtype) for a in arrays], "batch")
    return _Batch(arrays, items, outs, out_likes, op, spec, inplace, ranks_per_node,
                  "cupy" in kinds)


class _Door:
    """What ``all_reduce`` keeps per communicator: its plans by call key, its exchange
    and how many all-reduces ran an algorithm on it (rotates shuffle gather ranks)."""

    __slots__ = ("plans", "last", "calls", "size")

    def __init__(self, comm: Comm) -> None:
        self.plans: dict[tuple, Callable[..., Any]] = {}
        self.last: tuple = (None,) * 7  # the last plan used: its key, then the plan
        self.calls = 0
        self.size = comm.Get_size()


_PLAIN_TUPLES = frozenset(
    (str, *rest) for rest in itertools.chain.from_iterable(
        itertools.product((int, str), repeat=count) for count in range(3)))
"""The item types of a tuple spec (``(alg, shards, limit)``, 1 to 3 items) whose calls are
planned: tuples compare items by value, so ``("xring", True)`` or ``("xring", 1.0)`` would
find the plan of ``("xring", 1)`` although they are errors; keyed by a plain tuple alone,
a plan is found only by tuples that mean the same spec. Other tuples (NumPy integers
among them) take the unplanned path."""


_LAST: tuple[Any, Any] = (None, None)  # (communicator object, its _Door): the last one used


_WORLD: list[Comm] = []


def _world() -> Comm:
    _WORLD.append(world())
    return _WORLD[0]


def _door(comm: Comm) -> _Door:
    global _LAST
    cache = comm_cache(comm)
    door = cache.get("all_reduce")
    if door is None:
        door = cache["all_reduce"] = _Door(comm)
    _LAST = (comm, door)
    return door


def all_reduce(
    value: Any,
    op: Any = "sum",
    spec: Any = "xring",
    comm: Comm | None = None,
    *,
    check: bool = True,
    inplace: bool = False,
    out: Any = None,
    ranks_per_node: int | None = None,
) -> Any:
    """All-reduce ``value`` across every rank (and local replica) of ``comm``.

    Args:
        value: what to reduce, in one of three forms:

            * one array (any shape, a scalar too) of any library: NumPy, CuPy, PyTorch
              (CPU or CUDA), JAX, or anything exposing DLPack, ``__array_interface__``,
              ``__cuda_array_interface__`` or the buffer protocol — taken without a copy;
            * a list or tuple of arrays: a **batch**, each array reduced as a tensor of
              its own (Horovod's grouped all-reduce), routed and packed as
              ``MultiWorkerAllReduce.batch_reduce`` does, in one call;
            * a :class:`~mpistrat.PerReplica` of this rank's ``G`` local replicas of one
              tensor (same shape and dtype), combined locally and across ranks.
        op: ``"sum"``, ``"mean"``, ``"min"``, ``"max"`` (any case) or a :class:`ReduceOp`.
        spec: an all-reduce spec in any form :func:`~mpistrat.parse_spec` accepts; each
            tensor uses the entry for its byte size.
        comm: an mpi4py intracommunicator (default ``COMM_WORLD``); a ``Dup`` or
            ``Split`` works.
        check: agree across ranks that every rank passed the same call before any
            algorithm runs (one allgather of a fixed-size block per call, which also
            carries a small array's data: then it is the whole call). Turn it off only
            for calls whose structure is known to match, e.g. a training loop after its
            first step; every rank must pass the same ``check``.
        inplace: write the results into the input arrays (writeable ones; JAX arrays are
            immutable) instead of new ones.
        out: arrays to write the results into, shaped like the result: one array, a list
            (batch) or a list / ``PerReplica`` of ``G`` arrays (replicas).
        ranks_per_node: virtual node size for hierarchical algorithms (default
            ``MPISTRAT_RANKS_PER_NODE``, else physical nodes).

    A small call (one array of at most 4 KiB of host memory, up to 16 ranks) gathers
    every rank's array and reduces them on each rank in rank order, not through the
    spec's algorithm (whose entry is still checked against the job): the same bits on
    every rank, with or without ``check``.

    Returns:
        The reduced array, as the caller's array type (same shape; the same dtype except
        MEAN of integers, which is float64); a list of them for a batch or for
        replicas. With ``inplace=True`` or ``out``, the arrays written into.

    Raises:
        ValueError, TypeError: invalid arguments (on every rank when ``check``).
        CollectiveMismatchError: ranks passed different calls (on every rank).
        TopologyError: the spec entry does not fit this job (on every rank).
    """
    if recorder.on:  # (off: this one branch; on: the call again, inside its trace span)
        if not DOORS.direct:
            return _traced(value, op, spec, comm, check, inplace, out, ranks_per_node)
        DOORS.direct = False
    if comm is None:
        comm = _WORLD[0] if _WORLD else _world()
    last = _LAST
    door = last[1] if last[0] is comm else _door(comm)
    key: tuple | None = None
    if type(value) is np.ndarray and out is None and ranks_per_node is None:
        # the planned path: a NumPy array, keyed by everything a plan depends on (a
        # ranks_per_node of True would find the plan of 1: those calls are not planned);
        # the same arguments as the last call: found by identity, cheaper than hashing
        hit = door.last
        if value.dtype is hit[1] and op is hit[2] and spec is hit[3] \
                and inplace is hit[4] and check is hit[5] and value.shape == hit[0]:
            plan = hit[6]
        elif isinstance(spec, tuple) and tuple(map(type, spec)) not in _PLAIN_TUPLES:
            plan = None  # ("xring", True) equals ("xring", 1): it must not find that plan
        else:
            key = (value.shape, value.dtype, op, spec, inplace, check)
            try:
                plan = door.plans.get(key)
            except TypeError:  # an unhashable spec (a list)
                plan = key = None
            if plan is not None:
                door.last = (*key, plan)  # type: ignore[misc]
        # a plan stands for everything _prepare checks but the array's writeability,
        # which can change from call to call: a read-only array with inplace=True takes
        # the unplanned path, whose agreement raises on every rank
        if plan is not None and (not inplace or value.flags.writeable):
            result = plan(value)
            if result is not None:
                return result
    return _unplanned(comm, door, key, value, op, spec, check, inplace, out, ranks_per_node)


def plan_of(value: np.ndarray, op: Any, spec: Any, comm: Comm, *, inplace: bool = False,
            check: bool = True) -> Callable[..., Any] | None:
    """The plan an earlier :func:`all_reduce` of a NumPy array shaped like ``value``, with
    these arguments, made (small calls get one), or None.

    ``plan(array)`` makes that call again for ``array`` (the same shape and dtype,
    writeable when ``inplace``) — its agreement included — and returns the result, or
    returns None without communicating when the plan no longer applies (the node grouping
    it agreed on changed): then call :func:`all_reduce`. For a caller that repeats one
    call (the torch backend's ``dist.all_reduce``): it skips this module's lookup of the
    plan on every call. The plan records no trace span of its own: call
    :func:`all_reduce` while :mod:`mpistrat.trace` records."""
    try:
        return _door(comm).plans.get((value.shape, value.dtype, op, spec, inplace, check))
    except TypeError:  # an unhashable spec (a list): never planned
        return None


def _traced(value: Any, op: Any, spec: Any, comm: Comm | None, check: bool, inplace: bool,
            out: Any, ranks_per_node: int | None) -> Any:
    """:func:`all_reduce` while tracing: the call, recorded as one span ``all_reduce``
    (a ``cpu_op``, or a phase inside another collective such as the torch backend's) with
    its collective's args; its agreement and phases are recorded inside it."""
    if comm is None:
        comm = _WORLD[0] if _WORLD else _world()
    start = open_door(comm)
    DOORS.direct = True
    try:
        return all_reduce(value, op, spec, comm, check=check, inplace=inplace, out=out,
                          ranks_per_node=ranks_per_node)
    finally:
        DOORS.direct = False
        arrays, extra = _traced_arrays(value)
        nelems = sum(int(a.size) for a in arrays)
        close_door(start, "all_reduce", "allreduce", comm.Get_size(),
                   dtype_of(arrays), nelems, nelems,
                   sum(int(a.nbytes) for a in arrays), extra=extra)


def _traced_arrays(value: Any) -> tuple[list[Any], dict[str, Any] | None]:
    """The arrays of one call as the trace counts them (one tensor's bytes, a batch's in
    all), and what the args say of its form; none for a value that is not arrays."""
    try:
        if isinstance(value, PerReplica):
            return [_native(value.values[0], "all-reduce")], {"replicas": len(value.values)}
        if isinstance(value, (list, tuple)) and not _is_numbers(value):
            return [_native(item, "all-reduce") for item in value], {"tensors": len(value)}
        return [_native(value, "all-reduce")], None
    except (TypeError, ValueError, IndexError):
        return [], None


def _unplanned(comm: Comm, door: _Door, key: tuple | None, value: Any, op: Any, spec: Any,
               check: bool, inplace: bool, out: Any, ranks_per_node: int | None) -> Any:
    """A call without a plan: parse and check it, agree (unless ``check=False``), run it;
    small calls get a plan, kept under ``key`` where their arguments allow."""
    call: _Call | _Batch | None = None
    error = None
    try:
        call = _prepare(value, op, spec, inplace, out, ranks_per_node, door.size)
    except (ValueError, TypeError) as exc:
        if not check:
            raise
        error = exc
    if call is None:
        agree_exchange(comm, None, error, _WHAT, _HINT)  # raises, on every rank
    assert call is not None
    # (a key is made only for a tuple spec of plain str and int items, see _PLAIN_TUPLES)
    plannable = key is not None and type(op) in (str, ReduceOp) \
        and (type(spec) in (str, AllReduceSpec) or isinstance(spec, tuple))
    if isinstance(call, _Call) and call.small:
        plan = _small_plan(comm, call, check)
        if plannable:
            _keep(door, key, plan)
        first = call.arrays[0]
        result = plan(first, call.outs[0] if call.outs is not None else None)
        if inplace or call.outs is not None:
            return call.likes[0] if inplace else call.out_likes[0]
        return restore(result, call.likes[0])
    if plannable and isinstance(call, _Call) and not call.replicas:
        # (key is set only for one NumPy array without out=)
        plan = _large_plan(comm, door, call, check)
        _keep(door, key, plan)
        return plan(call.arrays[0])
    if check:
        agree_exchange(comm, call.signature, None, _WHAT, _HINT)
    if isinstance(call, _Batch):
        return _reduce_batch(comm, call)
    return _reduce_one(comm, door, call)


_MAX_PLANS = 256  # plans kept per communicator (a loop over ever new shapes starts over)


def _keep(door: _Door, key: Any, plan: Callable[..., Any]) -> None:
    if len(door.plans) >= _MAX_PLANS:
        door.plans.clear()
    door.plans[key] = plan
    door.last = (*key, plan)


def _large_plan(comm: Comm, door: _Door, call: _Call, check: bool) -> Callable[..., Any]:
    """The plan of a one-array NumPy call above the small size: what :func:`_prepare`
    and the signature work out (the spec entry, the agreement's code) done once;
    ``plan(array)`` agrees (when checking) and runs the entry's algorithm as
    :func:`_reduce_one` does — or returns None, without communicating, when the node
    grouping it agreed on has changed."""
    info = algorithms.get(call.entry.alg)
    grouping = info.hierarchical or info.single_node
    agreed_env = fused.grouping_env() if grouping else None
    signature = call.signature if check else ""
    code = signature_code(signature) if check else 0
    ex = exchange(comm) if check else None
    expected = ex.expected(code) if ex is not None else b""

    def plan(array: Any) -> Any:
        if grouping and fused.grouping_env() != agreed_env:
            return None
        if ex is not None:
            if ex.run(comm, code, _WHAT) != expected:
                ex.disagree(comm, signature, None, _WHAT, _HINT)
        elif check:  # (above FUSED_RANKS ranks: the plain agreement)
            agree_exchange(comm, signature, None, _WHAT, _HINT)
        return _reduce_one(comm, door, call, array)

    return plan


def _small_plan(comm: Comm, call: _Call, check: bool) -> Callable[..., Any]:
    """The plan of a small call (see the module docstring and :func:`mpistrat.fused.plan`)."""
    first = call.arrays[0]
    return fused.plan(comm, first.shape, first.dtype, call.op, call.inplace, call.entry,
                      call.ranks_per_node, call.signature if check else "", _WHAT, _HINT,
                      check)


def _reduce_one(comm: Comm, door: _Door, call: _Call, array: Any = None) -> Any:
    """One tensor (or its replicas) through the spec's algorithm; ``array``: a planned
    call's array, in place of the call's own (one NumPy array, shaped as planned)."""
    arrays, backend, reduce_op = call.arrays, call.backend, call.op
    likes = call.likes
    if array is not None:
        arrays = likes = [array]
    replicas = len(arrays)
    workers = door.size
    inplace, ranks_per_node = call.inplace, call.ranks_per_node
    dispatch.fit(call.entry.alg, comm, call.entry.shards, ranks_per_node=ranks_per_node,
                 devices_per_worker=replicas, gpus=backend.name == "cupy")

    # the engine combines the local replicas in replica order, then runs the algorithm;
    # with one replica it reduces in place, in the input (inplace) or in ``out``
    first = arrays[0]
    targets = arrays if inplace else call.outs
    into = None
    if replicas == 1 and targets is not None and targets[0].dtype == first.dtype:
        into = backend.flat_view(targets[0])
        if into is not None and not inplace:
            backend.copy(targets[0], first)
    sources = [] if into is not None else \
        [algorithms.Source.of(engine.flat(item, backend)) for item in arrays]
    buf = engine.reduce_sources(comm, reduce_op, call.entry.alg, call.entry.shards, sources,
                                door.calls, checked=True, ranks_per_node=ranks_per_node,
                                into=into, backend=backend)
    if workers > 1 and buf.size:
        door.calls += 1
    buf = engine.mean(buf, reduce_op, workers * replicas)
    result = buf.reshape(first.shape)
    t = monotonic_ns() if recorder.on else 0
    if targets is not None:
        for index, target in enumerate(targets):
            if index or into is None:
                backend.copy(target, result)
        handed = likes if inplace else call.out_likes
    else:
        outputs = [result] + [result.copy() for _ in arrays[1:]]
        handed = [restore(o, like) for o, like in zip(outputs, likes)]
    if t and (replicas > 1 or into is None and targets is not None):
        phase(t, "copy-back", {"devices": replicas})
    if call.replicas:
        return list(handed)
    return handed[0]


def _reduce_batch(comm: Comm, call: _Batch) -> list[Any]:
    """A batch: route by size, pack as ``batch_reduce`` does, write back or hand out."""
    arrays = call.arrays
    if not arrays:
        return []
    # num_packs=1, no aggregation: MultiWorkerAllReduce's defaults
    groups = engine.fitted_groups(comm, call.op, arrays, call.spec, 1, 0, 0, 0,
                                  ranks_per_node=call.ranks_per_node, gpus=call.on_gpu)
    results = engine.reduce_batch(comm, call.op, [(a,) for a in arrays], groups)
    targets = arrays if call.inplace else call.outs
    if targets is not None:
        t = monotonic_ns() if recorder.on else 0
        copy_all((target, result) for target, (result,) in zip(targets, results))
        if t:
            phase(t, "copy-back", {"tensors": len(targets)})
        return list(call.likes if call.inplace else call.out_likes)
    return [restore(result, like) for (result,), like in zip(results, call.likes)]
