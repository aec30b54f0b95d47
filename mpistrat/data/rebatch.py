"""Split global batches into per-replica batches (TF's rebatching).

With ``N = W * R`` replicas (``W`` workers of ``R`` replicas each) and a global batch of
``B`` elements, ``f = B // N`` and ``k = B - N * f``; worker 0's list of per-replica sizes
is ``[f+1]*k + [f]*(N-k)`` and worker ``w`` uses it rotated left by ``w * R``. A worker
cycles through its list, ``R`` sizes per step, so every step consumes exactly ``B``
elements over all workers and per-replica sizes differ by at most one.

Two ways to apply the sizes:

* :func:`split_global_batch` (DATA sharding, and any single-worker run): every worker
  holds the whole global batch and keeps the contiguous pieces of its replicas; the
  replica with global id ``j = w*R + r`` gets the ``j``-th piece, the sizes being those
  of the batch's actual length (so a short last batch is still split evenly).
* :func:`cut_stream` (FILE and OFF sharding): every worker has its own stream of batches
  of ``B`` and cuts it into its replicas' sizes, pieces crossing batch boundaries.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Iterator
from typing import Any, cast

import numpy as np

from .._nest import describe, flatten, map_structure

__all__ = ["batch_sizes_for_worker", "split_global_batch", "cut_stream", "empty_like",
           "leading_size"]


def _count(value: Any, what: str, low: int) -> int:
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {value!r}") from None
    if isinstance(value, bool) or number < low:
        raise ValueError(f"{what} must be an integer >= {low}, got {value!r}")
    return number


def _balanced(total: int, parts: int) -> list[int]:
    f, k = divmod(total, parts)
    return [f + 1] * k + [f] * (parts - k)


def batch_sizes_for_worker(global_batch_size: int, num_workers: int,
                           replicas_per_worker: int, worker_index: int) -> list[int]:
    """The cycle of per-replica batch sizes of worker ``worker_index`` (length ``W * R``).

    ``batch_sizes_for_worker(7, 2, 2, 0) == [2, 2, 2, 1]``,
    ``batch_sizes_for_worker(7, 2, 2, 1) == [2, 1, 2, 2]``,
    ``batch_sizes_for_worker(7, 1, 2, 0) == [4, 3]``.
    """
    batch = _count(global_batch_size, "global_batch_size", 0)
    workers = _count(num_workers, "num_workers", 1)
    replicas = _count(replicas_per_worker, "replicas_per_worker", 1)
    worker = _count(worker_index, "worker_index", 0)
    if worker >= workers:
        raise ValueError(f"worker_index must be in [0, {workers - 1}] for "
                         f"num_workers={workers}, got {worker}")
    sizes = _balanced(batch, workers * replicas)
    shift = worker * replicas
    return sizes[shift:] + sizes[:shift]


def _step_sizes(length: int, workers: int, replicas: int, step: int) -> list[int]:
    """The per-replica sizes of every global replica at ``step`` (worker-major order)."""
    n = workers * replicas
    sizes = _balanced(length, n)
    shift = step * replicas % n
    return sizes[shift:] + sizes[:shift]


def leading_size(batch: Any, replicas: int) -> int:
    """The common first dimension of a batch's arrays.

    Raises:
        ValueError: an array has no first dimension, or first dimensions differ.
    """
    sizes = {np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in flatten(batch)}
    if None in sizes or len(sizes) != 1:
        raise ValueError(
            f"cannot split a batch across {replicas} replicas: every array needs the same "
            f"first (batch) dimension, got {describe(batch)}; batch the dataset with "
            f"Dataset.batch(global_batch_size), or yield arrays of equal length"
        )
    return cast(int, sizes.pop())  # not None: checked above


def split_global_batch(batch: Any, num_workers: int, replicas_per_worker: int,
                       worker_index: int, step: int) -> list[Any]:
    """This worker's per-replica pieces of one global batch (views into ``batch``)."""
    length = leading_size(batch, num_workers * replicas_per_worker)
    sizes = _step_sizes(length, num_workers, replicas_per_worker, step)
    first = worker_index * replicas_per_worker
    start = sum(sizes[:first])
    pieces = []
    for size in sizes[first:first + replicas_per_worker]:
        pieces.append(map_structure(lambda a, s=start, e=start + size: a[s:e], batch))
        start += size
    return pieces


def empty_like(batch: Any) -> Any:
    """A batch of zero elements with the dtypes and trailing shapes of ``batch``."""
    return map_structure(
        lambda a: np.zeros((0, *np.shape(a)[1:]), dtype=np.asarray(a).dtype)
        if np.ndim(a) else np.zeros((0,), dtype=np.asarray(a).dtype), batch)


def cut_stream(batches: Iterator[Any], sizes: list[int], replicas: int,
               drop_remainder: bool) -> Iterator[list[Any]]:
    """Cut one worker's stream of batches into steps of ``replicas`` pieces.

    Step ``t`` gives replica ``r`` ``sizes[(t * replicas + r) % len(sizes)]`` elements,
    taken in order across batch boundaries. When the stream ends inside a step, the
    remaining elements are shared evenly among the replicas (or dropped when
    ``drop_remainder``, so that every piece keeps its full size).
    """
    pending: deque[list[Any]] = deque()  # [batch, offset, length]
    available = 0
    template = None
    exhausted = False
    step = 0
    while True:
        want = [sizes[(step * replicas + r) % len(sizes)] for r in range(replicas)]
        need = sum(want)
        while available < max(need, 1) and not exhausted:  # read ahead to see the end
            batch = next(batches, None)
            if batch is None:
                exhausted = True
                break
            length = leading_size(batch, replicas)
            if template is None:
                template = empty_like(batch)
            if length:
                pending.append([batch, 0, length])
                available += length
        if not available:
            return
        if available < need:
            if drop_remainder:
                return
            want = _balanced(available, replicas)
        pieces = []
        for size in want:
            pieces.append(_take(pending, size, template))
            available -= size
        yield pieces
        step += 1


def _take(pending: deque[list[Any]], size: int, template: Any) -> Any:
    parts = []
    while size:
        entry = pending[0]
        batch, offset, length = entry
        n = min(size, length - offset)
        parts.append(map_structure(lambda a, s=offset, e=offset + n: a[s:e], batch))
        size -= n
        entry[1] += n
        if entry[1] == length:
            pending.popleft()
    if not parts:
        return template
    if len(parts) == 1:
        return parts[0]
    return map_structure(lambda *leaves: np.concatenate(leaves), *parts)
