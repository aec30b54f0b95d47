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

Out of place (``source`` given, see :mod:`.source`): the first exchange reads the
source directly — step 1's even ranks send it, odd ranks receive their partner's data into
``buf`` and add their own; otherwise the first halving step sends the given-away half from
the source and receives the kept half into ``buf``. Short buffers copy the source first.

Every element is reduced by one rank per step and then copied, so all ranks end bitwise
identical. Bytes sent per rank (halving-doubling, ``n = p``): ``2 (p - 1) / p`` of the
buffer, in ``2 log2 p`` messages: fewer, larger messages than the ring. TensorFlow's
version required a power-of-two rank count and a length divisible by it; this one
does not.
"""

from __future__ import annotations

from typing import Any

from .._mpi import mpi
from ..ops import ReduceOp
from ._chunks import even_bounds
from .source import Source

__all__ = ["all_reduce", "SHORT_BYTES"]

SHORT_BYTES = 2048  # recursive doubling at or below this many bytes (MPICH's classic cut)
_TAG = 3


def all_reduce(comm: Any, buf: Any, *, op: ReduceOp, shards: int = 1, backend: Any,
               rotation: int = 0, source: Source | None = None) -> None:
    """Recursive halving-doubling all-reduce (``shards`` ignored): of ``buf`` in place, or
    of ``source`` into ``buf`` when a source is given."""
    n = comm.Get_size()
    if n == 1 or buf.size == 0:
        if source is not None:
            source.copy_into(buf, backend=backend)
        return
    MPI = mpi()
    rank = comm.Get_rank()
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    raw = backend.comm_view(buf)
    size = buf.itemsize

    # 1. fold the extra ranks in
    if rank < 2 * rem:
        if rank % 2 == 0:
            if source is not None:
                MPI.Request.Waitall(source.isend(comm, 0, buf.size, rank + 1, _TAG, backend))
            else:
                comm.Send([raw, MPI.BYTE], rank + 1, tag=_TAG)
            new_rank = -1
        elif source is not None:
            MPI.Request.Waitall(source.irecv(comm, buf, 0, buf.size, rank - 1, _TAG, backend))
            source.combine_into(op, buf, 0, buf.size, backend)
            new_rank = rank // 2
        else:
            scratch = backend.scratch("rechd", buf.size, buf.dtype)
            comm.Recv([backend.comm_view(scratch), MPI.BYTE], rank - 1, tag=_TAG)
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
                comm.Sendrecv([raw, MPI.BYTE], partner, _TAG, [scratch_raw, MPI.BYTE], partner, _TAG)
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
                if pending:  # first step, out of place: the kept half arrives in buf
                    requests = layout.irecv(comm, buf, k0, k1, partner, _TAG, backend)
                    requests += layout.isend(comm, g0, g1, partner, _TAG, backend)
                    MPI.Request.Waitall(requests)
                    layout.combine_into(op, buf, k0, k1, backend)
                elif layout is not None:  # first step, our data folded into buf
                    requests = layout.irecv(comm, scratch, k0, k1, partner, _TAG, backend, at=0)
                    requests += layout.isend(comm, g0, g1, partner, _TAG, backend, data=buf)
                    MPI.Request.Waitall(requests)
                    backend.combine(op, buf[k0:k1], scratch[:k1 - k0])
                else:
                    comm.Sendrecv([raw[g0 * size:g1 * size], MPI.BYTE], partner, _TAG,
                                  [scratch_raw[:(k1 - k0) * size], MPI.BYTE], partner, _TAG)
                    backend.combine(op, buf[k0:k1], scratch[:k1 - k0])
                layout = pending = None
                history.append((partner, keep, give))
                lo, hi = keep
                mask <<= 1
            for partner, keep, give in reversed(history):
                k0, k1 = bounds[keep[0]], bounds[keep[1]]
                g0, g1 = bounds[give[0]], bounds[give[1]]
                comm.Sendrecv([raw[k0 * size:k1 * size], MPI.BYTE], partner, _TAG,
                              [raw[g0 * size:g1 * size], MPI.BYTE], partner, _TAG)

    # 3. fold the extra ranks out
    if rank < 2 * rem:
        if rank % 2 == 0:
            comm.Recv([raw, MPI.BYTE], rank + 1, tag=_TAG)
        else:
            comm.Send([raw, MPI.BYTE], rank - 1, tag=_TAG)
