"""``pscpu``: shuffle (parameter-server style) all-reduce in host memory.

Steps (``n`` ranks, ``k = shards`` gather ranks):

1. the buffer is cut TensorFlow's ragged way into ``k`` pieces (``k - 1`` pieces of
   ``len // k`` elements, the remainder on the last);
2. the gather ranks are a group of ``k`` ranks chosen as TF's ``group_device_names``
   does; successive tensors (``rotation``) use successive groups, so the gather work
   moves around the ranks;
3. every rank sends piece ``j`` to gather rank ``j``, which adds the ``n`` contributions
   in rank order (deterministic) — the piece is reduced once, on one rank;
4. each gather rank sends its reduced piece back to every rank (straight into the
   destination buffer).

Out of place (``source`` given, see :mod:`.source`): the pieces go out from the tensors
as the Source's messages, and a gather rank starts its piece from its own tensors, so a
``batch_reduce`` pack is not copied whole into the output first (only the gather rank's
own piece is).

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
from ._chunks import gather_groups, ragged_bounds
from .source import Source

__all__ = ["all_reduce", "reduce_to_root"]

_TAG_GATHER, _TAG_SCATTER = 5, 6


def _shuffle(comm: Any, buf: Any, op: ReduceOp, owners: list[int], backend: Any,
             destinations: list[int] | None, source: Source | None = None) -> None:
    transport = backend.transport(comm)
    n, rank = comm.Get_size(), comm.Get_rank()
    k = len(owners)
    bounds = ragged_bounds(buf.size, k)
    raw = backend.comm_view(buf)
    size = buf.itemsize

    def piece(j: int) -> Any:
        return raw[bounds[j] * size:bounds[j + 1] * size]

    mine = [j for j in range(k) if owners[j] == rank]
    # post the receives of every contribution to the pieces this rank gathers
    incoming: dict[int, list[tuple[int, Any, Any]]] = {}
    for j in mine:
        length = bounds[j + 1] - bounds[j]
        slots = backend.scratch(f"pscpu{j}", length * (n - 1), buf.dtype)
        slots_raw = backend.comm_view(slots)
        entries = []
        for index, peer in enumerate(r for r in range(n) if r != rank):
            slot = slots[index * length:(index + 1) * length]
            if source is None:
                requests = [transport.irecv(
                    slots_raw[index * length * size:(index + 1) * length * size], peer,
                    _TAG_GATHER)]
            else:  # the peer sends the piece as its Source's messages
                requests = source.irecv(comm, slots, bounds[j], bounds[j + 1], peer,
                                        _TAG_GATHER, backend, at=index * length)
            entries.append((slot, requests))
        incoming[j] = entries
    sends = []
    for j in range(k):
        if owners[j] != rank:
            sends += [transport.isend(piece(j), owners[j], _TAG_GATHER)] if source is None \
                else source.isend(comm, bounds[j], bounds[j + 1], owners[j], _TAG_GATHER,
                                  backend)
    # reduce each owned piece, adding contributions in rank order as they arrive
    for j in mine:
        target = buf[bounds[j]:bounds[j + 1]]
        if source is not None:  # this rank's own contribution, from where it lies
            source.copy_into(buf, bounds[j], bounds[j + 1], backend=backend)
        for slot, requests in incoming[j]:
            transport.waitall(requests)
            backend.combine(op, target, slot)
    transport.waitall(sends)
    # send the reduced pieces back
    targets = range(n) if destinations is None else destinations
    requests = []
    for j in range(k):
        if owners[j] == rank:
            requests += [transport.isend(piece(j), dest, _TAG_SCATTER)
                         for dest in targets if dest != rank]
        elif rank in targets:
            requests.append(transport.irecv(piece(j), owners[j], _TAG_SCATTER))
    transport.waitall(requests)


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
