"""``pscpu``: shuffle (parameter-server style) all-reduce in host memory.

Steps (``n`` ranks, ``k = shards`` gather ranks):

1. the buffer is cut TensorFlow's ragged way into ``k`` pieces (``k - 1`` pieces of
   ``len // k`` elements, the remainder on the last);
2. the gather ranks are a group of ``k`` ranks chosen as TF's ``group_device_names``
   does; successive tensors (``rotation``) use successive groups, so the gather work
   moves around the ranks;
3. every rank sends piece ``j`` to gather rank ``j``, which adds the ``n`` contributions
   in a fixed order (its own, then the other ranks' in rank order) — the piece is
   reduced once, on one rank;
4. each gather rank sends its reduced piece back to every rank (straight into the
   destination buffer).

Pieces travel in messages of at most ``PIECE_BYTES``: the gather rank adds each message
as it lands, while it is still in cache, and sends it back at once, so step 4 overlaps
the rest of step 3.

Out of place (``source`` given, see :mod:`.source`): the pieces go out from the tensors
as the Source's messages (cut to ``PIECE_BYTES``), the first other rank's contribution
lands straight in the output and the gather rank adds its own from its tensors there
(no copy into the output first), and the results land as soon as they come back.

Bytes: each non-gather rank sends and receives the whole buffer once; gather rank ``j``
receives ``(n - 1)`` copies of its piece and sends ``n - 1``. Bitwise identical results
on all ranks since every piece is reduced on exactly one rank. Preconditions: ``1 <= k
<= n`` (checked by the spec's topology check before any rank communicates).

:func:`reduce_to_root` is the same shuffle with step 4 sending only to one root: the
intra-node stage of hierarchical ``pscpu/...`` algorithms.

With CuPy buffers this is ``psgpu``: the gather ranks add the pieces on their GPU (the
backend's arithmetic) and the messages go through the backend's transport
(:mod:`.staging`: CUDA-aware MPI, or staged through pinned host memory).
"""

from __future__ import annotations

from typing import Any

from ..ops import ReduceOp
from ._chunks import capped, gather_groups, ragged_bounds
from .source import Source

__all__ = ["all_reduce", "reduce_to_root"]

PIECE_BYTES = 4 << 20  # pieces travel, are added and go back in messages of at most this
_TAG_GATHER, _TAG_SCATTER = 5, 6


def _shuffle(comm: Any, buf: Any, op: ReduceOp, owners: list[int], backend: Any,
             destinations: list[int] | None, source: Source | None = None) -> None:
    transport = backend.transport(comm)
    n, rank = comm.Get_size(), comm.Get_rank()
    k = len(owners)
    bounds = ragged_bounds(buf.size, k)
    raw = backend.comm_view(buf)
    size = buf.itemsize
    targets = [d for d in (range(n) if destinations is None else destinations) if d != rank]
    peers = [r for r in range(n) if r != rank]
    receives = destinations is None or rank in destinations
    # how each piece travels, both ways: in messages of at most PIECE_BYTES (the Source's
    # messages cut further), so that the gather rank adds each as it lands and sends it
    # back at once; empty pieces do not travel
    cut = [source.messages(bounds[j], bounds[j + 1], PIECE_BYTES) if source is not None
           else [(a, b, False) for a, b in capped(bounds[j], bounds[j + 1], PIECE_BYTES // size)
                 if b > a] for j in range(k)]
    mine = [j for j in range(k) if owners[j] == rank and cut[j]]
    theirs = [j for j in range(k) if owners[j] != rank and cut[j]]
    # post the receives of every contribution to the pieces this rank gathers: out of
    # place, the first peer's lands straight in the output (this rank adds its own
    # there); the others', and in place all of them, land in scratch slots
    slotted = peers[1:] if source is not None else peers
    incoming: dict[int, list[tuple[Any, list[Any]]]] = {}
    for j in mine:
        lo, length = bounds[j], bounds[j + 1] - bounds[j]
        slots = backend.scratch(f"pscpu{j}", length * len(slotted), buf.dtype)
        slots_raw = backend.comm_view(slots)
        entries = incoming[j] = []
        for peer in peers:  # (element x of the piece lands at into[x + shift])
            if peer in slotted:
                at = slotted.index(peer) * length
                slot, into, shift = slots[at:at + length], slots_raw, at - lo
            else:
                slot, into, shift = None, raw, 0
            entries.append((slot, [transport.irecv(into[(a + shift) * size:(b + shift) * size],
                                                   peer, _TAG_GATHER) for a, b, _ in cut[j]]))
    sends = []
    for j in theirs:
        if source is None:
            sends += [transport.isend(raw[a * size:b * size], owners[j], _TAG_GATHER)
                      for a, b, _ in cut[j]]
        else:
            sends += source.isend(comm, bounds[j], bounds[j + 1], owners[j], _TAG_GATHER,
                                  backend, max_bytes=PIECE_BYTES)
    # the results can land at once out of place (this rank sends from its Source); in
    # place only once this rank's pieces have left its buffer
    results = []
    if source is not None and receives:
        results = _receive_results(transport, raw, size, owners, theirs, cut)
    # reduce each owned piece message by message as the contributions land (in peer
    # order: deterministic), and send each reduced message back at once
    back = []
    for j in mine:
        lo = bounds[j]
        for m, (a, b, _) in enumerate(cut[j]):
            for slot, requests in incoming[j]:
                requests[m].Wait()
                if slot is None:  # the first peer's part is in place: add our own
                    source.combine_into(op, buf, a, b, backend)
                else:
                    backend.combine(op, buf[a:b], slot[a - lo:b - lo])
            back += [transport.isend(raw[a * size:b * size], dest, _TAG_SCATTER)
                     for dest in targets]
    transport.waitall(sends)
    if source is None and receives:
        results = _receive_results(transport, raw, size, owners, theirs, cut)
    transport.waitall(back + results)


def _receive_results(transport: Any, raw: Any, size: int, owners: list[int],
                     pieces: list[int], cut: list[Any]) -> list[Any]:
    """Receives of the reduced ``pieces`` from their gather ranks, in their messages."""
    return [transport.irecv(raw[a * size:b * size], owners[j], _TAG_SCATTER)
            for j in pieces for a, b, _ in cut[j]]


def _nothing_to_exchange(n: int, buf: Any, source: Source | None, backend: Any) -> bool:
    """True (after copying ``source`` into ``buf``) when one rank or an empty buffer
    leaves nothing to send."""
    if n > 1 and buf.size:
        return False
    if source is not None:
        source.copy_into(buf, backend=backend)
    return True


def all_reduce(comm: Any, buf: Any, *, op: ReduceOp, shards: int = 1, backend: Any,
               rotation: int = 0, source: Source | None = None) -> None:
    """Shuffle all-reduce of ``buf`` in place over ``comm`` with ``shards`` gather ranks,
    or of ``source`` into ``buf`` (every rank's Source cut alike: see :func:`.run`)."""
    n = comm.Get_size()
    if _nothing_to_exchange(n, buf, source, backend):
        return
    groups = gather_groups(n, shards)
    _shuffle(comm, buf, op, groups[rotation % len(groups)], backend, None, source)


def reduce_to_root(comm: Any, buf: Any, *, op: ReduceOp, backend: Any, root: int = 0,
                   source: Source | None = None) -> None:
    """Shuffle-reduce ``buf`` (or ``source``, as :func:`all_reduce`) onto ``root``: every
    rank gathers one piece, then sends it to ``root`` only. Other ranks' buffers are left
    partly reduced (scratch)."""
    n = comm.Get_size()
    if _nothing_to_exchange(n, buf, source, backend):
        return
    _shuffle(comm, buf, op, list(range(n)), backend, [root], source)
