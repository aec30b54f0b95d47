"""``xring``: ring reduce-scatter then ring all-gather, with ``shards`` pipelines in flight.

Steps (``n`` ranks, ``S`` pipelines): the buffer is cut into ``n * S`` near-equal chunks;
chunk ``g * S + s`` is segment ``g`` of pipeline ``s``. Every pipeline runs its own
ring with non-blocking sends and receives tagged by pipeline, so while one pipeline's
chunk is being added the others' chunks are on the wire.

* reduce-scatter, steps ``t = 0 .. n-2``: send segment ``(r - t) mod n`` to the right
  neighbour, receive segment ``(r - t - 1) mod n`` from the left into a scratch slot and
  add it into the buffer. Afterwards rank ``r`` holds the full reduction of segment
  ``(r + 1) mod n``, computed once, by one rank.
* all-gather, steps ``t = 0 .. n-2``: send segment ``(r + 1 - t) mod n`` to the right,
  receive segment ``(r - t) mod n`` from the left straight into the buffer (no copy).

Out of place (``source`` given, see :mod:`.source`): a rank's first send of each
pipeline goes out straight from the source, every reduce-scatter receive lands in ``buf``
(no scratch slot) and the rank's own source piece is added there; nothing is copied.

Messages go through the backend's transport (:mod:`mpistrat.backends.transport`): straight
to MPI for host buffers and with a CUDA-aware MPI, else staged through pinned host memory.

Every segment is reduced exactly once and then copied, so all ranks end bitwise
identical. Bytes sent per rank: ``2 (n - 1) / n`` of the buffer. Works for any length
(chunks may be empty) and any ``n``. Preconditions: contiguous 1-D buffer, ``S >= 1``.
"""

from __future__ import annotations

import functools
from typing import Any

from ..backends.protocol import ArrayBackend
from ..ops import ReduceOp
from ..runtime._mpi import Comm
from ._chunks import even_bounds
from .source import Source

__all__ = ["all_reduce"]


def all_reduce(comm: Comm, buf: Any, *, op: ReduceOp, shards: int = 1, backend: ArrayBackend,
               rotation: int = 0, source: Source | None = None) -> None:
    """Ring all-reduce over ``comm`` (``rotation`` is unused): of ``buf`` in place, or of
    ``source`` into ``buf`` when a source is given."""
    n = comm.Get_size()
    if n == 1 or buf.size == 0:
        if source is not None:
            source.copy_into(buf, backend=backend)
        return
    transport = backend.transport(comm)
    pipelines = shards
    rank = comm.Get_rank()
    if pipelines == 1:
        _one_pipeline(comm, buf, op, backend, transport, n, rank, source)
        return
    right, left = (rank + 1) % n, (rank - 1) % n
    bounds = even_bounds(buf.size, n * pipelines)
    widest = max(bounds[i + 1] - bounds[i] for i in range(n * pipelines))
    slots = None if source is not None else \
        backend.scratch("xring", widest * pipelines, buf.dtype)
    raw = backend.comm_view(buf)
    slots_raw = None if slots is None else backend.comm_view(slots)
    size = buf.itemsize
    last = 2 * (n - 1)  # steps per pipeline

    def chunk(segment: int, s: int) -> tuple[int, int]:
        index = segment * pipelines + s
        return bounds[index], bounds[index + 1]

    sends: list[list[Any]] = [[] for _ in range(pipelines)]
    recvs: list[list[Any]] = [[] for _ in range(pipelines)]
    step = [0] * pipelines
    pending: list[tuple[int, int]] = [(0, 0)] * pipelines

    def post(s: int) -> None:
        t = step[s]
        if t < n - 1:
            send_seg, recv_seg = (rank - t) % n, (rank - t - 1) % n
        else:
            if t == n - 1:  # entering all-gather: earlier sends read what we now overwrite
                transport.waitall(sends[s])
                sends[s].clear()
            t -= n - 1
            send_seg, recv_seg = (rank + 1 - t) % n, (rank - t) % n
        lo, hi = chunk(send_seg, s)
        if source is not None and step[s] == 0:  # our own piece, straight from the source
            sends[s].extend(source.isend(comm, lo, hi, right, s, backend))
        else:
            sends[s].append(transport.isend(raw[lo * size:hi * size], right, s))
        lo, hi = chunk(recv_seg, s)
        pending[s] = (lo, hi)
        if source is not None and step[s] == 0:  # the left neighbour sends from its source
            recvs[s] = source.irecv(comm, buf, lo, hi, left, s, backend)
            return
        if step[s] < n - 1 and slots_raw is not None:
            offset = s * widest * size
            target = slots_raw[offset:offset + (hi - lo) * size]
        else:
            target = raw[lo * size:hi * size]
        recvs[s] = [transport.irecv(target, left, s)]

    for s in range(pipelines):
        post(s)
    # Pipelines advance in round-robin order: waiting on each in turn keeps them in step
    # and, unlike Waitany, stays fast when ranks outnumber cores (MPICH's Waitany then
    # costs a scheduler time slice per call).
    for _ in range(last):
        for s in range(pipelines):
            lo, hi = pending[s]
            if source is not None and step[s] == 0:  # received into buf: add our own piece
                source.receive_and_combine(op, recvs[s], buf, lo, hi, backend)
            else:
                for request in recvs[s]:
                    request.Wait()
                if step[s] < n - 1 and source is not None:
                    source.combine_into(op, buf, lo, hi, backend)
                elif step[s] < n - 1:
                    assert slots is not None  # (made when there is no source)
                    backend.combine(op, buf[lo:hi], slots[s * widest:s * widest + hi - lo])
            step[s] += 1
            if step[s] < last:
                post(s)
    for requests in sends:
        transport.waitall(requests)


@functools.lru_cache(maxsize=256)
def _schedule(count: int, n: int, rank: int) -> tuple[tuple[tuple[int, int, int, int], ...],
                                                      int]:
    """One pipeline in place: per step, the element ranges ``(send lo, send hi, receive
    lo, receive hi)`` of this rank, and the widest segment (the scratch slot's size)."""
    bounds = even_bounds(count, n)
    steps = []
    for t in range(2 * (n - 1)):
        if t < n - 1:
            send, recv = (rank - t) % n, (rank - t - 1) % n
        else:
            u = t - (n - 1)
            send, recv = (rank + 1 - u) % n, (rank - u) % n
        steps.append((bounds[send], bounds[send + 1], bounds[recv], bounds[recv + 1]))
    return tuple(steps), max(bounds[i + 1] - bounds[i] for i in range(n))


def _one_pipeline(comm: Comm, buf: Any, op: ReduceOp, backend: ArrayBackend, transport: Any,
                  n: int, rank: int, source: Source | None) -> None:
    """The ring of one pipeline (the common case), its steps worked out once per buffer
    length: the same messages and additions as the general loop, with a fraction of its
    Python per step, which every step pays on the critical path. In place, a
    reduce-scatter step receives into a scratch slot and adds it to ``buf``; from a
    ``source``, the first step sends the source's own piece and every reduce-scatter
    receive lands in ``buf``, where the source's piece is added."""
    steps, widest = _schedule(buf.size, n, rank)
    right, left = (rank + 1) % n, (rank - 1) % n
    slots = None if source is not None else backend.scratch("xring", widest, buf.dtype)
    raw, size = backend.comm_view(buf), buf.itemsize
    slots_raw = None if slots is None else backend.comm_view(slots)
    scatter = n - 1  # the reduce-scatter's steps; the all-gather's follow
    sends: list[Any] = []
    for t, (slo, shi, rlo, rhi) in enumerate(steps):
        if t == scatter:  # entering all-gather: earlier sends read what we now overwrite
            transport.waitall(sends)
            sends = []
        if source is not None and t == 0:  # our own piece, straight from the source
            sends.extend(source.isend(comm, slo, shi, right, 0, backend))
            source.receive_and_combine(op, source.irecv(comm, buf, rlo, rhi, left, 0, backend),
                                       buf, rlo, rhi, backend)
            continue
        sends.append(transport.isend(raw[slo * size:shi * size], right, 0))
        if t >= scatter:
            transport.irecv(raw[rlo * size:rhi * size], left, 0).Wait()
        elif slots is not None:
            assert slots_raw is not None
            transport.irecv(slots_raw[:(rhi - rlo) * size], left, 0).Wait()
            backend.combine(op, buf[rlo:rhi], slots[:rhi - rlo])
        else:
            assert source is not None
            transport.irecv(raw[rlo * size:rhi * size], left, 0).Wait()
            source.combine_into(op, buf, rlo, rhi, backend)
    transport.waitall(sends)
