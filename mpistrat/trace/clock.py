"""Each rank's clock against rank 0's, measured over MPI (Cristian's method).

Rank 0 exchanges ping-pongs with every other rank in turn — :data:`ROUNDS`, and more (up
to :data:`MAX_ROUNDS`, for at most :data:`PATIENCE_NS` more) until one round trip is
under :data:`GOOD_TRIP_NS`, since a busy core can delay any one of them by milliseconds; the round with the shortest round trip
gives the offset (the peer's clock read at the midpoint of the round trip), uncertain by
half that round trip. The ranks waiting for their turn poll idly (sleeping between polls),
so that they leave the cores to the pair being measured. Every wait polls against a
deadline, so a rank that never comes makes the measurement fail (None), never hang.
"""

from __future__ import annotations

import time
from time import monotonic_ns
from typing import Any

import numpy as np

__all__ = ["ROUNDS", "measure"]

ROUNDS = 8
MAX_ROUNDS = 64
GOOD_TRIP_NS = 50_000
PATIENCE_NS = 20_000_000  # per rank, past the first ROUNDS: a busy machine's trips stay long
_TAG = 0x7ACE


def _wait(request: Any, deadline: float, idle: bool = False) -> bool:
    """Poll ``request`` until done (True) or the deadline (False, cancelled); ``idle``:
    between polls, give the core away (a rank waiting for its turn must not slow the
    pair being measured)."""
    while not request.Test():
        if time.monotonic() > deadline:
            request.Cancel()
            return False
        if idle:
            time.sleep(0.0002)
    return True


def measure(comm: Any, seconds: float = 10.0) -> tuple[int, int] | None:
    """``(offset_ns, round_trip_ns)`` of this rank: add ``offset_ns`` to this rank's
    ``monotonic_ns()`` to get rank 0's (0 on rank 0). Every rank of ``comm`` calls it;
    None on every rank whose partner did not answer within ``seconds``."""
    rank, size = comm.Get_rank(), comm.Get_size()
    deadline = time.monotonic() + seconds
    if size == 1:
        return 0, 0
    stamp = np.zeros(1, dtype=np.int64)
    ping = np.zeros(1, dtype=np.int64)
    result = np.zeros(2, dtype=np.int64)
    if rank == 0:
        results = np.zeros((size, 2), dtype=np.int64)
        for peer in range(1, size):
            # the peer's turn: it waits for this idly, then answers the pings at once
            if not _wait(comm.Isend(ping, dest=peer, tag=_TAG + 2), deadline):
                return None
            best = (0, 1 << 62)
            began = monotonic_ns()
            for round_ in range(MAX_ROUNDS):
                # the ping says whether another round follows (0: this is the last)
                ping[0] = 0 if round_ == MAX_ROUNDS - 1 or round_ >= ROUNDS - 1 and (
                    best[1] < GOOD_TRIP_NS or monotonic_ns() - began > PATIENCE_NS) else 1
                before = monotonic_ns()
                send = comm.Isend(ping, dest=peer, tag=_TAG)
                recv = comm.Irecv(stamp, source=peer, tag=_TAG)
                if not (_wait(send, deadline) and _wait(recv, deadline)):
                    return None
                after = monotonic_ns()
                trip = after - before
                if trip < best[1]:
                    # peer's clock minus ours; the peer adds its negation
                    best = (int(stamp[0]) - (before + after) // 2, trip)
                if not ping[0]:
                    break
            results[peer] = (-best[0], best[1])
        for peer in range(1, size):
            if not _wait(comm.Isend(results[peer], dest=peer, tag=_TAG + 1), deadline):
                return None
        return 0, 0
    more = np.ones(1, dtype=np.int64)
    if not _wait(comm.Irecv(more, source=0, tag=_TAG + 2), deadline, idle=True):
        return None
    more[0] = 1
    while more[0]:
        if not _wait(comm.Irecv(more, source=0, tag=_TAG), deadline):
            return None
        stamp[0] = monotonic_ns()
        if not _wait(comm.Isend(stamp, dest=0, tag=_TAG), deadline):
            return None
    if not _wait(comm.Irecv(result, source=0, tag=_TAG + 1), deadline, idle=True):
        return None
    return int(result[0]), int(result[1])
