"""``all_reduce``: reduce one tensor (or a rank's G local replicas of it) across a communicator.

What happens on every rank, in order:

1. the value is normalised: one array, or a list of the rank's ``G`` replica arrays of
   one shape and dtype; the op is parsed; the spec is parsed and the entry for the
   tensor's byte size is chosen;
2. unless ``check=False``, the ranks agree that they all asked for the same thing (``G``,
   shape, dtype, op, spec) with one small ``Allreduce`` of a hash; a rank whose
   arguments were invalid takes part too, so a mistake on one rank raises the same error
   on every rank instead of leaving the others waiting;
3. the chosen entry is checked against the job's layout (e.g. shards above the number of
   gather ranks) — identical on every rank, so it fails everywhere or nowhere;
4. the ``G`` replicas are combined locally (in replica order), the algorithm reduces the
   result across ranks in place, MEAN divides by ``W * G``, and the result is copied
   back out to ``G`` fresh arrays (or into the inputs with ``inplace=True``).

Inputs are never modified unless ``inplace=True``. Results are bitwise identical on
every rank. MEAN of integers returns float64, as TensorFlow does; SUM keeps the dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import algorithms, dispatch, engine
from .backends import get_backend
from .backends.protocol import ArrayBackend
from .errors import CollectiveMismatchError, TopologyError
from .ops import ReduceOp
from .runtime._commcache import comm_cache
from .runtime._mpi import Comm, world
from .runtime.agreement import agree
from .runtime.topology import env_ranks_per_node
from .spec import AllReduceSpec, AllReduceSpecTuple, parse_spec

__all__ = ["all_reduce", "CollectiveMismatchError"]


@dataclass(frozen=True)
class _Call:
    arrays: list[Any]
    backend: ArrayBackend
    op: ReduceOp
    spec: AllReduceSpec
    entry: AllReduceSpecTuple
    inplace: bool
    ranks_per_node: int | None

    @property
    def signature(self) -> str:
        """What every rank must agree on, as text (built only when checking)."""
        first = self.arrays[0]
        text = (f"G={len(self.arrays)} shape={first.shape} dtype={first.dtype.str} "
                f"op={self.op.name} spec={self.spec} inplace={self.inplace}")
        if algorithms.get(self.entry.alg).hierarchical:
            # ranks must agree on the node grouping too (a cached topology would hide it)
            effective = self.ranks_per_node if self.ranks_per_node is not None \
                else env_ranks_per_node()  # (the same parse get_topology uses)
            text += f" ranks_per_node={effective}"
        return text


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


def _prepare(value: Any, op: Any, spec: Any, inplace: bool,
             ranks_per_node: int | None) -> _Call:
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError("all_reduce got an empty list: give one array, or one array "
                             "per local replica")
        items = list(value)
    else:
        items = [value]
    backend = get_backend(items[0] if not np.isscalar(items[0]) else np.asarray(items[0]))
    arrays = [backend.asarray(item) for item in items]
    first = arrays[0]
    for index, array in enumerate(arrays[1:], start=1):
        if array.shape != first.shape or array.dtype != first.dtype:
            raise ValueError(
                f"local replica {index} has shape {array.shape} and dtype {array.dtype}, "
                f"replica 0 has {first.shape} and {first.dtype}; every replica of a tensor "
                f"must have the same shape and dtype"
            )
    dtype = first.dtype
    if not (dtype.kind in "fiuc" or dtype.name == "bfloat16"):
        raise TypeError(f"cannot all-reduce dtype {dtype}: expected a numeric dtype "
                        f"(float16/32/64, bfloat16, int*, uint*, complex)")
    reduce_op = ReduceOp.parse(op)
    if dtype.kind == "c" and reduce_op in (ReduceOp.MIN, ReduceOp.MAX):
        raise TypeError(f"{reduce_op} is not defined for complex dtype {dtype}")
    if inplace:
        for item in items:
            if not isinstance(item, np.ndarray) or not item.flags.c_contiguous \
                    or not item.flags.writeable:
                raise ValueError(
                    f"inplace=True needs writeable C-contiguous arrays, got a "
                    f"{type(item).__name__}"
                    + ("" if not isinstance(item, np.ndarray) else
                       f" (C-contiguous: {item.flags.c_contiguous}, writeable: "
                       f"{item.flags.writeable})")
                    + "; pass such arrays, or drop inplace=True"
                )
        if reduce_op is ReduceOp.MEAN and dtype.kind in "iu":
            raise TypeError(f"inplace=True cannot hold a MEAN of integers ({dtype}): the "
                            f"result is float64; drop inplace=True or use op='sum'")
    if ranks_per_node is not None and (
            isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int)
            or ranks_per_node < 1):
        raise TopologyError(
            f"ranks_per_node must be a positive int or None, got {ranks_per_node!r}"
        )
    parsed = _spec(spec)
    return _Call(arrays, backend, reduce_op, parsed, parsed.route(first.nbytes), inplace,
                 ranks_per_node)


class _Counter:
    """How many all-reduces ran on a communicator (rotates shuffle gather ranks)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0


def all_reduce(
    value: Any,
    op: Any = "sum",
    spec: Any = "xring",
    comm: Comm | None = None,
    *,
    check: bool = True,
    inplace: bool = False,
    ranks_per_node: int | None = None,
) -> Any:
    """All-reduce ``value`` across every rank (and local replica) of ``comm``.

    Args:
        value: one array (any shape, a scalar too), or a list of this rank's ``G`` local
            replica arrays of one shape and dtype.
        op: ``"sum"``, ``"mean"``, ``"min"``, ``"max"`` (any case) or a :class:`ReduceOp`.
        spec: an all-reduce spec in any form :func:`~mpistrat.parse_spec` accepts; the
            entry for the tensor's byte size is used.
        comm: an mpi4py intracommunicator (default ``COMM_WORLD``); a ``Dup`` or
            ``Split`` works.
        check: agree across ranks that every rank passed the same call before
            communicating (one small Allreduce). Turn it off only for calls whose
            structure is known to match, e.g. a training loop after its first step.
        inplace: write the result into the input arrays (C-contiguous) instead of new ones.
        ranks_per_node: virtual node size for hierarchical algorithms (default
            ``MPISTRAT_RANKS_PER_NODE``, else physical nodes).

    Returns:
        The reduced array (same shape; the same dtype except MEAN of integers, which is
        float64), or a list of ``G`` such arrays when ``value`` was a list.

    Raises:
        ValueError, TypeError: invalid arguments (on every rank when ``check``).
        CollectiveMismatchError: ranks passed different calls (on every rank).
        TopologyError: the spec entry does not fit this job (on every rank).
    """
    comm = world() if comm is None else comm
    call = error = None
    try:
        call = _prepare(value, op, spec, inplace, ranks_per_node)
    except (ValueError, TypeError) as exc:
        if not check:
            raise
        error = exc
    if check:
        agree(comm, call.signature if call is not None else None, error, "all_reduce",
              "the same number of replicas, shape, dtype, op and spec")
    assert call is not None
    arrays, backend, reduce_op = call.arrays, call.backend, call.op
    replicas = len(arrays)
    workers = comm.Get_size()
    dispatch.fit(call.entry.alg, comm, call.entry.shards, ranks_per_node=ranks_per_node,
                 devices_per_worker=replicas)

    # the engine combines the local replicas in replica order, then runs the algorithm
    first = arrays[0]
    into = backend.flat_view(first) if inplace and replicas == 1 else None
    sources = [] if into is not None else \
        [algorithms.Source.of(engine.flat(array, backend)) for array in arrays]
    counter = comm_cache(comm).setdefault("all_reduce_calls", _Counter())
    buf = engine.reduce_sources(comm, reduce_op, call.entry.alg, call.entry.shards, sources,
                                counter.value, checked=True, ranks_per_node=ranks_per_node,
                                into=into, backend=backend)
    if workers > 1 and buf.size:
        counter.value += 1
    buf = engine.mean(buf, reduce_op, workers * replicas)
    result = buf.reshape(first.shape)
    if inplace:
        for array in arrays:
            if array is not first or replicas > 1:
                backend.copy(array, result)
        outputs: Sequence[Any] = arrays
    else:
        outputs = [result] + [result.copy() for _ in arrays[1:]]
    if isinstance(value, (list, tuple)):
        return list(outputs)
    return outputs[0]
