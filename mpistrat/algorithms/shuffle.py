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
the rest of step 3. In host memory the contributions that need a scratch slot (in place,
all of them) land in a ring of ``RING`` message-sized slots per peer, the next receive
posted into a slot as soon as it has been added: 8 MiB per peer that stay in cache
instead of a piece-sized scratch that goes through memory (in place, ResNet-50's 97.5
MiB on 2 ranks: 0.85-0.88x the time of a piece-sized scratch). The receives of a
rank's pieces are then posted a few at a time, so a rank that gathers several pieces
(``pscpu#3`` on 4 ranks) gets each piece's contributions under its own tag.

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
(:mod:`mpistrat.backends.transport`: CUDA-aware MPI, or staged through pinned host memory).
"""

from __future__ import annotations

from typing import Any

from ..backends.protocol import ArrayBackend
from ..ops import ReduceOp
from ..runtime._mpi import Comm
from ._chunks import capped, gather_groups, ragged_bounds
from .source import Source

__all__ = ["all_reduce", "reduce_to_root"]

PIECE_BYTES = 4 << 20  # pieces travel, are added and go back in messages of at most this
RING = 2  # host scratch: message-sized slots per peer a gather rank receives into
_TAG_GATHER, _TAG_SCATTER = 5, 6  # (gather tags: 5, then 7, 8, ... below)


def _gather_tags(owners: list[int]) -> list[int]:
    """The tag of the contributions to each piece: a rank that gathers several pieces
    (``pscpu#3`` on 4 ranks) posts their receives a ring at a time, so each of its pieces
    needs its own tag for the messages to match in order."""
    seen: dict[int, int] = {}
    tags = []
    for owner in owners:
        repeat = seen[owner] = seen.get(owner, -1) + 1
        tags.append(_TAG_GATHER if not repeat else _TAG_SCATTER + repeat)
    return tags


def _shuffle(comm: Comm, buf: Any, op: ReduceOp, owners: list[int], backend: ArrayBackend,
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
    tags = _gather_tags(owners)
    theirs = [j for j in range(k) if owners[j] != rank and cut[j]]
    # the receives of the contributions to the pieces this rank gathers: out of place, the
    # first peer's land straight in the output (this rank adds its own there); the
    # others', and in place all of them, land in scratch slots: in host memory a ring of
    # RING message-sized slots per peer, reposted as each is added, so they stay in cache
    slotted = peers[1:] if source is not None else peers
    host = getattr(backend, "name", None) == "numpy"
    incoming: dict[int, tuple[Any, ...]] = {}  # j: (slots, their bytes, width, depth, peers)
    for j in mine:
        messages = cut[j]
        width = max(b - a for a, b, _ in messages)
        depth = min(RING, len(messages)) if host else len(messages)
        slots = backend.scratch(f"pscpu{j}", width * depth * len(slotted), buf.dtype)
        slots_raw = backend.comm_view(slots)
        peers_in: list[tuple[int, int | None, list[Any]]] = []
        incoming[j] = (slots, slots_raw, width, depth, peers_in)
        for peer in peers:  # (slot d of a slotted peer's ring starts at ring + d * width)
            ring = slotted.index(peer) * depth * width if peer in slotted else None
            into = [raw[a * size:b * size] if ring is None else
                    slots_raw[(ring + m * width) * size:(ring + m * width + b - a) * size]
                    for m, (a, b, _) in enumerate(messages[:depth] if ring is not None
                                                  else messages)]
            peers_in.append((peer, ring, [transport.irecv(v, peer, tags[j]) for v in into]))
    sends = []
    for j in theirs:
        if source is None:
            sends += [transport.isend(raw[a * size:b * size], owners[j], tags[j])
                      for a, b, _ in cut[j]]
        else:
            sends += source.isend(comm, bounds[j], bounds[j + 1], owners[j], tags[j],
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
        messages = cut[j]
        slots, slots_raw, width, depth, peers_in = incoming[j]
        for m, (a, b, _) in enumerate(messages):
            for peer, ring, requests in peers_in:
                requests[m].Wait()
                if ring is None:  # the first peer's part is in place: add our own
                    assert source is not None  # (no ring only out of place)
                    source.combine_into(op, buf, a, b, backend)
                    continue
                at = ring + (m % depth) * width
                backend.combine(op, buf[a:b], slots[at:at + b - a])
                if m + depth < len(messages):  # the slot is free again: the next message
                    c, d, _ = messages[m + depth]
                    requests.append(transport.irecv(slots_raw[at * size:(at + d - c) * size],
                                                    peer, tags[j]))
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


def _nothing_to_exchange(n: int, buf: Any, source: Source | None, backend: ArrayBackend) -> bool:
    """True (after copying ``source`` into ``buf``) when one rank or an empty buffer
    leaves nothing to send."""
    if n > 1 and buf.size:
        return False
    if source is not None:
        source.copy_into(buf, backend=backend)
    return True


def all_reduce(comm: Comm, buf: Any, *, op: ReduceOp, shards: int = 1, backend: ArrayBackend,
               rotation: int = 0, source: Source | None = None) -> None:
    """Shuffle all-reduce of ``buf`` in place over ``comm`` with ``shards`` gather ranks,
    or of ``source`` into ``buf`` (every rank's Source cut alike: see :func:`.run`)."""
    n = comm.Get_size()
    if _nothing_to_exchange(n, buf, source, backend):
        return
    groups = gather_groups(n, shards)
    _shuffle(comm, buf, op, groups[rotation % len(groups)], backend, None, source)


def reduce_to_root(comm: Comm, buf: Any, *, op: ReduceOp, backend: ArrayBackend, root: int = 0,
                   source: Source | None = None) -> None:
    """Shuffle-reduce ``buf`` (or ``source``, as :func:`all_reduce`) onto ``root``: every
    rank gathers one piece, then sends it to ``root`` only. Other ranks' buffers are left
    partly reduced (scratch)."""
    n = comm.Get_size()
    if _nothing_to_exchange(n, buf, source, backend):
        return
    _shuffle(comm, buf, op, list(range(n)), backend, [root], source)
