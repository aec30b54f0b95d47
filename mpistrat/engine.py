"""The reduce engine beneath both front doors, :func:`mpistrat.all_reduce` and the
``CrossDeviceOps`` (the role TensorFlow's ``cross_device_utils`` plays between
``all_reduce.py`` and ``cross_device_ops.py``): routing a batch by spec entry, packing,
combining the local devices' components, running the algorithm, MEAN.

* :func:`routes` — which tensors of a batch go to which spec entry, and each entry's
  packing plan (cached by the batch's shapes and dtypes);
* :func:`reduce_sources` — one pack or tensor, given as a
  :class:`~mpistrat.algorithms.Source` per local device: combine the components in device
  order (:func:`local_sum`), then all-reduce across ranks through :mod:`mpistrat.dispatch`;
  with one device the algorithm reads the tensor where it lies (out of place, no copy);
  :func:`algorithm_reducer` binds it to one spec entry for a batch;
* :func:`reduce_batch` — a whole batch, pack by pack, MEAN applied, cut back into tensors;
* :func:`mean` — SUM divided by the contributions (floats in place; integers become
  float64, as TensorFlow's MEAN of integers does).

``all_reduce`` is a batch of one tensor with its spec entry chosen (no packing; in place
when asked); ``batch_reduce`` and ``reduce`` route and pack. Both reach an algorithm only
through :func:`reduce_sources`.

Under :mod:`mpistrat.trace` these steps are phases of their collective: ``pack``,
``local combine``, ``algorithm`` (:mod:`mpistrat.dispatch`; a batch's group of several
reductions as one), ``mean`` and ``copy-back`` (unpacking, each other device's copy).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from time import monotonic_ns
from typing import Any

import numpy as np

from . import algorithms, dispatch, packing
from .backends import get_backend
from .backends.protocol import ArrayBackend
from .ops import ReduceOp
from .runtime import recorder, shared
from .runtime._mpi import Comm
from .runtime.agreement import DOORS, phase
from .spec import AllReduceSpec

__all__ = ["Reducer", "Route", "SHARED_RESULT_BYTES", "structure", "cached_plan", "routes", "flat",
           "fitted_groups", "local_sum", "reduce_sources", "algorithm_reducer", "mean",
           "reduce_batch"]

Reducer = Callable[[list[Any], int], Any]
"""``reduce(sources, index) -> buffer``: all-reduce one pack or tensor given as one
:class:`~mpistrat.algorithms.Source` per local device (inputs, never modified) into a new
1-D buffer; ``index`` counts the all-reduces of the call (for rotating roots)."""

Route = tuple[tuple[int, ...], packing.PackPlan, str, int]

SHARED_RESULT_BYTES = 1 << 20
"""Packs from this size reduced by ``shm`` (or ``shm/<b>``) get their result buffer in
shared memory (:func:`mpistrat.runtime.shared.recycled`): each rank writes its reduced slice
there in place and its peers copy it from there, instead of one more copy through the
window; below it, one small all-reduce to agree on a buffer would cost more than it saves."""


def structure(arrays: Sequence[Any]) -> tuple:
    """A batch's shapes and dtypes: the key its packing plan and routing are cached by."""
    return tuple((a.shape, a.dtype) for a in arrays)


@functools.lru_cache(maxsize=64)
def cached_plan(shapes: tuple, bytes_per_pack: int, num_packs: int, agg_max_bytes: int,
                agg_max_group: int) -> packing.PackPlan:
    """The packing plan of a batch structure (:func:`structure`): by size, in
    ``num_packs`` packs, small tensors aggregated, or none."""
    specs = [(tuple(shape), np.dtype(dtype)) for shape, dtype in shapes]
    if bytes_per_pack > 0:
        return packing.plan_by_size(specs, bytes_per_pack)
    if num_packs > 0:
        return packing.plan_concat_and_split(specs, num_packs)
    if agg_max_bytes > 0 and agg_max_group > 0:
        return packing.plan_small_tensor_aggregation(specs, agg_max_bytes, agg_max_group)
    return packing.no_packing(specs)


@functools.lru_cache(maxsize=64)
def routes(shapes: tuple, spec: AllReduceSpec, num_packs: int, agg_max_bytes: int,
           agg_max_group: int, bytes_per_pack: int) -> tuple[Route, ...]:
    """Which tensors of a batch go to which spec entry (by byte size, entries in spec
    order) and each entry's packing plan: ``(indices, plan, algorithm, shards)`` per
    entry that gets tensors. Cached: a training loop reduces the same structure."""
    routed: dict[int, list[int]] = {}
    for i, (shape, dtype) in enumerate(shapes):
        routed.setdefault(spec.index_for(math.prod(shape) * dtype.itemsize), []).append(i)
    found = []
    for entry_index in sorted(routed):
        alg, shards, _ = spec[entry_index]
        indices = tuple(routed[entry_index])
        plan = cached_plan(tuple(shapes[i] for i in indices), bytes_per_pack, num_packs,
                           agg_max_bytes, agg_max_group)
        found.append((indices, plan, alg, shards))
    return tuple(found)


def fitted_groups(comm: Comm, op: ReduceOp, arrays: Sequence[Any], spec: AllReduceSpec,
                  num_packs: int, agg_max_bytes: int, agg_max_group: int,
                  bytes_per_pack: int, *, ranks_per_node: int | None = None,
                  devices_per_worker: int = 1, gpus: bool = False,
                  ) -> list[tuple[Sequence[int], packing.PackPlan, Reducer]]:
    """The groups :func:`reduce_batch` takes for a batch (``arrays``: one device's
    tensors): :func:`routes`, each entry's algorithm checked against the job
    (:func:`dispatch.fit`, the same on every rank) and bound as a :data:`Reducer`."""
    groups: list[tuple[Sequence[int], packing.PackPlan, Reducer]] = []
    for indices, plan, alg, shards in routes(structure(arrays), spec, num_packs,
                                             agg_max_bytes, agg_max_group, bytes_per_pack):
        dispatch.fit(alg, comm, shards, ranks_per_node=ranks_per_node,
                     devices_per_worker=devices_per_worker, gpus=gpus)
        groups.append((indices, plan, algorithm_reducer(
            comm, op, alg, shards, checked=True, ranks_per_node=ranks_per_node)))
    return groups


def local_sum(op: ReduceOp, sources: list[Any], backend: ArrayBackend) -> Any:
    """A new buffer (recycled memory: it becomes a result) holding the combination of the
    local devices' sources, in device order."""
    t = monotonic_ns() if recorder.on else 0
    buf = backend.recycled(sources[0].size, sources[0].dtype)
    sources[0].copy_into(buf, backend=backend)
    for source in sources[1:]:
        source.combine_into(op, buf, 0, source.size, backend)
    if t:
        phase(t, "local combine", {"devices": len(sources), "bytes": buf.nbytes})
    return buf


def reduce_sources(comm: Comm, op: ReduceOp, alg: str, shards: int, sources: list[Any],
                   index: int, *, checked: bool = False, ranks_per_node: int | None = None,
                   into: Any = None, backend: ArrayBackend | None = None) -> Any:
    """All-reduce one tensor or pack given as a :class:`~mpistrat.algorithms.Source` per
    local device: combine them in device order (:func:`local_sum`), then run ``alg``
    across ranks; with one device the algorithm reads the source where it lies (out of
    place, no copy) into new memory (shared memory for ``shm`` from
    :data:`SHARED_RESULT_BYTES`). ``into``: with one device, the source's own flat
    memory, reduced in place instead (``sources`` may then be empty). ``index`` counts the
    all-reduces (rotating roots); ``checked``: the caller has checked that ``alg#shards``
    fits (:func:`dispatch.fit`); ``backend``: the buffers' backend, when the caller knows it.
    Returns the 1-D result."""
    if backend is None:
        backend = get_backend(sources[0].segments[0] if into is None else into)
    several = comm.Get_size() > 1
    if into is not None:
        buf = into
    elif len(sources) == 1 and several and sources[0].size:
        buf = None
        if sources[0].nbytes >= SHARED_RESULT_BYTES and _shares(alg) \
                and getattr(backend, "name", None) == "numpy":
            buf = shared.recycled(comm, sources[0].size, sources[0].dtype, ranks_per_node)
        if buf is None:
            buf = backend.recycled(sources[0].size, sources[0].dtype)
        dispatch.run(alg, comm, buf, op=op, shards=shards, backend=backend, rotation=index,
                     source=sources[0], checked=checked, ranks_per_node=ranks_per_node)
        return buf
    else:
        buf = local_sum(op, sources, backend)
    if several and buf.size:
        dispatch.run(alg, comm, buf, op=op, shards=shards, backend=backend, rotation=index,
                     checked=checked, ranks_per_node=ranks_per_node)
    return buf


@functools.lru_cache(maxsize=None)
def _shares(alg: str) -> bool:
    """True when ``alg``'s results can live in shared memory (``shm``, ``shm/<b>``)."""
    return "shm" in (alg, algorithms.get(alg).intra)


def algorithm_reducer(comm: Comm, op: ReduceOp, alg: str, shards: int, *,
                      checked: bool = False, ranks_per_node: int | None = None) -> Reducer:
    """:func:`reduce_sources` with ``alg#shards`` bound, as a :data:`Reducer`."""
    def reduce(sources: list[Any], index: int) -> Any:
        return reduce_sources(comm, op, alg, shards, sources, index, checked=checked,
                              ranks_per_node=ranks_per_node)

    reduce.alg = alg  # type: ignore[attr-defined]  # (the trace's name of a group's reductions)
    return reduce


def mean(buf: Any, op: ReduceOp, contributions: int) -> Any:
    """``buf`` after the all-reduce: SUM, MIN and MAX as they are; MEAN divided by the
    number of contributions (in place for floats; integers give a new float64 array)."""
    if op is not ReduceOp.MEAN:
        return buf
    t = monotonic_ns() if recorder.on else 0
    buf = get_backend(buf).divide(buf, contributions)
    if t:
        phase(t, "mean", {"contributions": contributions, "bytes": buf.nbytes})
    return buf


def reduce_batch(comm: Comm, op: ReduceOp, components: Sequence[Sequence[Any]],
                 groups: Sequence[tuple[Sequence[int], packing.PackPlan, Reducer]],
                 ) -> list[Any]:
    """All-reduce a batch given as ``components[i][d]`` (tensor i on local device d): each
    group of tensor indices is reduced pack by pack (the packs read straight from the
    tensors, see :mod:`mpistrat.algorithms.source`) into new buffers, which are then cut
    into the results. Returns, in input order, each tensor's result as one array per
    local device (the same array object for one device)."""
    replicas = len(components[0])
    contributions = comm.Get_size() * replicas
    results: list[Any] = [None] * len(components)
    counter = 0
    for indices, plan, reducer in groups:
        t = monotonic_ns() if recorder.on else 0
        per_device = [[components[i][d] for i in indices] for d in range(replicas)]
        # the plan was looked up by the first device's shapes and dtypes: only the other
        # devices' tensors need checking against it
        packs = [plan.segments(batch, validate=d > 0) for d, batch in enumerate(per_device)]
        wire = [[algorithms.Source(p[b]) for p in packs] for b in range(len(plan.packs))]
        for i in plan.passthrough:
            wire.append([algorithms.Source.of(flat(batch[i])) for batch in per_device])
        # (traced, a group of several reductions is one phase: few events per collective)
        grouped = bool(t) and len(wire) > 1
        if t:
            phase(t, "pack", {"tensors": len(indices), "packs": len(plan.packs),
                              "singles": len(plan.passthrough)})
            t = monotonic_ns() if recorder.on else 0
        if grouped:
            DOORS.quiet += 1
        try:
            reduced = []
            for sources in wire:
                reduced.append(reducer(sources, counter))
                counter += 1
        finally:
            if grouped:
                DOORS.quiet -= 1
        if grouped:  # (one rank: each reduction was a local combine)
            phase(t, "algorithm" if contributions > replicas else "local combine",
                  {"name": getattr(reducer, "alg", "?"), "reductions": len(reduced),
                   "bytes": sum(b.nbytes for b in reduced)})
        if op is ReduceOp.MEAN:
            t = monotonic_ns() if recorder.on else 0
            for k, buf in enumerate(reduced):
                if get_backend(buf).xp.issubdtype(buf.dtype, np.inexact):
                    reduced[k] = get_backend(buf).divide(buf, contributions)
            if t:
                phase(t, "mean", {"contributions": contributions,
                                  "bytes": sum(b.nbytes for b in reduced)})
        t = monotonic_ns() if recorder.on else 0
        tensors = plan.unpack(reduced[:len(plan.packs)], reduced[len(plan.packs):])
        for i, tensor in zip(indices, tensors):
            if op is ReduceOp.MEAN and tensor.dtype.kind in "iub":
                backend = get_backend(tensor)
                tensor = backend.divide(backend.flat_copy(tensor), contributions) \
                    .reshape(tensor.shape)
            # every other local device gets its own copy, on that device
            results[i] = (tensor,) if replicas == 1 else \
                [tensor] + [get_backend(components[i][d]).clone(tensor)
                            for d in range(1, replicas)]
        if t:
            phase(t, "copy-back", {"tensors": len(indices), "devices": replicas})
    return results


def flat(array: Any, backend: ArrayBackend | None = None) -> Any:
    """A 1-D view of ``array`` (a copy when it is not C-contiguous)."""
    backend = get_backend(array) if backend is None else backend
    view = backend.flat_view(array)
    return view if view is not None else backend.flat_copy(array)
