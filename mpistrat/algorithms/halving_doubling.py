"""``rechd``: recursive halving-doubling for any number of ranks and any length.

Steps (``n`` ranks, ``p`` the largest power of two <= ``n``, ``rem = n - p``):

1. fold in: among the first ``2 rem`` ranks, each even rank sends its whole buffer to the
   odd rank above it, which adds it and stands for both; the even ranks sit out. The
   ``p`` remaining ranks get new ranks ``0 .. p-1``.
2. among the ``p`` ranks, either
   * recursive doubling (short buffers: at most 2 KiB, or fewer elements than ``p``):
     ``log2 p`` exchanges of the whole buffer with partner ``new_rank XOR mask``, each
     side adding the other's (``a + b`` and ``b + a`` are bitwise equal), or
   * recursive halving then doubling (Rabenseifner): the buffer is cut into ``p``
     segments; at each of ``log2 p`` steps partners split the range they share, each
     keeps one half, sends the other and adds the partner's copy of the kept half, so
     each rank ends owning one fully reduced segment; the steps are then replayed in
     reverse, exchanging the owned ranges, until everyone holds everything.
3. fold out: each odd rank of step 1 sends the result to the even rank below it.

The last halving step travels in pieces of at most ``PIPELINE_BYTES``, and each piece
goes back to the partner (that step's doubling) as soon as it is reduced, so the
all-gather overlaps the last additions instead of waiting for all of them.

Out of place (``source`` given, see :mod:`.source`): the first exchange reads the
source directly — step 1's even ranks send it, odd ranks receive their partner's data into
``buf`` and add their own; otherwise the first halving step sends the given-away half from
the source and receives the kept half into ``buf``. Short buffers copy the source first.

Messages go through the backend's transport (:mod:`mpistrat.backends.transport`): straight
to MPI for host buffers and CUDA-aware MPI, staged through pinned host memory otherwise.

Every element is reduced by one rank per step and then copied, so all ranks end bitwise
identical. Bytes sent per rank (halving-doubling, ``n = p``): ``2 (p - 1) / p`` of the
buffer, in ``2 log2 p`` messages: fewer, larger messages than the ring. TensorFlow's
version required a power-of-two rank count and a length divisible by it; this one
does not.
"""

from __future__ import annotations

from typing import Any

from ..backends.protocol import ArrayBackend
from ..ops import ReduceOp
from ..runtime._mpi import Comm
from ._chunks import capped, even_bounds
from .source import Source

__all__ = ["all_reduce", "SHORT_BYTES"]

SHORT_BYTES = 2048  # recursive doubling at or below this many bytes (MPICH's classic cut)
PIPELINE_BYTES = 4 << 20  # the last halving step and its doubling move pieces of this size
_TAG, _TAG_BACK = 3, 4


def all_reduce(comm: Comm, buf: Any, *, op: ReduceOp, shards: int = 1, backend: ArrayBackend,
               rotation: int = 0, source: Source | None = None) -> None:
    """Recursive halving-doubling all-reduce (``shards`` ignored): of ``buf`` in place, or
    of ``source`` into ``buf`` when a source is given."""
    n = comm.Get_size()
    if n == 1 or buf.size == 0:
        if source is not None:
            source.copy_into(buf, backend=backend)
        return
    transport = backend.transport(comm)
    rank = comm.Get_rank()
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    raw = backend.comm_view(buf)
    size = buf.itemsize

    # 1. fold the extra ranks in
    if rank < 2 * rem:
        if rank % 2 == 0:
            if source is not None:
                transport.waitall(source.isend(comm, 0, buf.size, rank + 1, _TAG, backend))
            else:
                transport.send(raw, rank + 1, _TAG)
            new_rank = -1
        elif source is not None:
            receives = source.irecv(comm, buf, 0, buf.size, rank - 1, _TAG, backend)
            source.receive_and_combine(op, receives, buf, 0, buf.size, backend)
            new_rank = rank // 2
        else:
            scratch = backend.scratch("rechd", buf.size, buf.dtype)
            transport.recv(backend.comm_view(scratch), rank - 1, _TAG)
            backend.combine(op, buf, scratch)
            new_rank = rank // 2
    else:
        new_rank = rank - rem

    def real(new: int) -> int:
        return 2 * new + 1 if new < rem else new + rem

    # 2. reduce among p ranks
    if new_rank >= 0 and p > 1:
        if buf.nbytes <= SHORT_BYTES or buf.size < p:
            if source is not None and rank >= 2 * rem:  # (folded-in ranks hold it in buf)
                source.copy_into(buf, backend=backend)
            scratch = backend.scratch("rechd", buf.size, buf.dtype)
            scratch_raw = backend.comm_view(scratch)
            mask = 1
            while mask < p:
                partner = real(new_rank ^ mask)
                transport.sendrecv(raw, partner, _TAG, scratch_raw, partner, _TAG)
                backend.combine(op, buf, scratch)
                mask <<= 1
        else:
            bounds = even_bounds(buf.size, p)
            # the largest half kept is the first step's lower half (segments differ by <= 1)
            scratch = backend.scratch("rechd", bounds[p // 2], buf.dtype)
            scratch_raw = backend.comm_view(scratch)
            lo, hi = 0, p
            history = []
            mask = 1
            # out of place, the first exchange is cut into the Source's messages on both
            # sides, also for a rank whose data already sits in buf (it folded in)
            layout, pending = source, source is not None and rank >= 2 * rem
            while mask < p:
                partner = real(new_rank ^ mask)
                mid = (lo + hi) // 2
                if new_rank & mask:
                    keep, give = (mid, hi), (lo, mid)
                else:
                    keep, give = (lo, mid), (mid, hi)
                k0, k1 = bounds[keep[0]], bounds[keep[1]]
                g0, g1 = bounds[give[0]], bounds[give[1]]
                # the last step pipelines its doubling when it reads buf; out of place the
                # Source's many messages make that slower (measured), so it does not
                last = 2 * mask == p and layout is None
                if layout is None and not last:
                    transport.sendrecv(raw[g0 * size:g1 * size], partner, _TAG,
                                       scratch_raw[:(k1 - k0) * size], partner, _TAG)
                    backend.combine(op, buf[k0:k1], scratch[:k1 - k0])
                else:
                    _exchange(comm, transport, buf, scratch, partner, (k0, k1), (g0, g1),
                              op=op, backend=backend, layout=layout, pending=pending,
                              last=last)
                layout, pending = None, False
                if not last:  # the last step's doubling ran inside _exchange
                    history.append((partner, keep, give))
                lo, hi = keep
                mask <<= 1
            for partner, keep, give in reversed(history):
                k0, k1 = bounds[keep[0]], bounds[keep[1]]
                g0, g1 = bounds[give[0]], bounds[give[1]]
                transport.sendrecv(raw[k0 * size:k1 * size], partner, _TAG,
                                   raw[g0 * size:g1 * size], partner, _TAG)

    # 3. fold the extra ranks out
    if rank < 2 * rem:
        if rank % 2 == 0:
            transport.recv(raw, rank + 1, _TAG)
        else:
            transport.send(raw, rank - 1, _TAG)


def _pieces(lo: int, hi: int, itemsize: int) -> list[tuple[int, int, bool]]:
    """``[lo, hi)`` cut into near-equal messages of at most :data:`PIPELINE_BYTES`."""
    return [(a, b, False) for a, b in capped(lo, hi, PIPELINE_BYTES // itemsize)]


def _exchange(comm: Comm, transport: Any, buf: Any, scratch: Any, partner: int,
              keep: tuple[int, int], give: tuple[int, int], *, op: ReduceOp,
              backend: ArrayBackend, layout: Source | None, pending: bool, last: bool) -> None:
    """One halving step in messages: send ``give``, receive and add ``keep``.

    The messages are the Source's (``layout``: the first step out of place) or even
    pieces. ``pending``: this rank's data is still in the Source (the kept range arrives
    straight in ``buf``); otherwise it is in ``buf`` (received into ``scratch``). With
    ``last``, the step's doubling runs here too, piece by piece: each kept piece goes
    back to the partner as soon as it is reduced, while later pieces are still arriving.
    """
    (k0, k1), (g0, g1) = keep, give
    raw = backend.comm_view(buf)
    size = buf.itemsize
    if layout is not None:
        kept, given = layout.messages(k0, k1), layout.messages(g0, g1)
        receives = layout.irecv(comm, buf if pending else scratch, k0, k1, partner, _TAG,
                                backend, at=None if pending else 0)
        sends = layout.isend(comm, g0, g1, partner, _TAG, backend,
                             data=None if pending else buf)
    else:
        kept, given = _pieces(k0, k1, size), _pieces(g0, g1, size)
        scratch_raw = backend.comm_view(scratch)
        receives = [transport.irecv(scratch_raw[(a - k0) * size:(b - k0) * size], partner,
                                    _TAG) for a, b, _ in kept]
        sends = [transport.isend(raw[a * size:b * size], partner, _TAG) for a, b, _ in given]
    # the doubling: our reduced pieces go back, the partner's arrive in the range we gave
    # away; both cut by merging the step's messages up to PIPELINE_BYTES
    back_cuts = _merged(kept, size) if last else []
    arrive_cuts = _merged(given, size) if last else []
    back: list[Any] = []
    arriving: list[Any] = []

    def receive_back(a: int, b: int) -> None:
        arriving.append(transport.irecv(raw[a * size:b * size], partner, _TAG_BACK))

    # (the messages each arriving piece covers end at ends[i]; sends[:done] are complete)
    ends = [sum(1 for a, _, _ in given if a < stop) for _, stop in arrive_cuts]
    done = 0
    if last and pending:  # our sends read the Source, never buf: receive at once
        for a, b in arrive_cuts:
            receive_back(a, b)
    for request, (a, b, _) in zip(receives, kept):
        request.Wait()
        if pending:
            assert layout is not None  # (pending only with a layout)
            layout.combine_into(op, buf, a, b, backend)
        else:
            backend.combine(op, buf[a:b], scratch[a - k0:b - k0])
        if last and back_cuts[len(back)][1] == b:  # a whole back piece is reduced
            start, stop = back_cuts[len(back)]
            back.append(transport.isend(raw[start * size:stop * size], partner, _TAG_BACK))
        if len(arriving) < len(arrive_cuts):  # a piece of buf we sent may be received
            while done < len(sends) and sends[done].Test():  # into once its sends are done
                done += 1
            while len(arriving) < len(arrive_cuts) and ends[len(arriving)] <= done:
                receive_back(*arrive_cuts[len(arriving)])
    transport.waitall(sends)
    if last:
        for a, b in arrive_cuts[len(arriving):]:
            receive_back(a, b)
        transport.waitall(back + arriving)


def _merged(messages: list[tuple[int, int, bool]], itemsize: int) -> list[tuple[int, int]]:
    """Consecutive messages merged while the piece stays within ``PIPELINE_BYTES`` (a
    larger message is a piece alone); both partners cut the same pieces."""
    out: list[tuple[int, int]] = []
    for a, b, _ in messages:
        if out and (b - out[-1][0]) * itemsize <= PIPELINE_BYTES:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out
