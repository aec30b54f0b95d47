"""Agree across ranks that a collective call is valid and identical everywhere.

Before any data moves, every rank contributes (did my arguments fail?, a hash of what I
was asked to do) to one 24-byte ``Allreduce``. If some rank failed or the hashes differ,
the ranks exchange descriptions (error path only) and every rank raises: the rank whose
arguments were bad raises its own error, the others a :class:`CollectiveMismatchError`
naming each rank's call. So a mistake on one rank is an error everywhere, never a hang.

A rank that never arrives is caught by the stall check of :mod:`mpistrat.runtime.stall` (when
one is on, e.g. under ``mpistrat run``) or by a call's own ``timeout``.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import numpy as np

from ..errors import CollectiveMismatchError, CollectiveTimeoutError
from . import stall
from ._mpi import Comm, mpi

__all__ = ["agree"]


def agree(comm: Comm, signature: str | None, error: BaseException | None, what: str,
          hint: str = "the same call", timeout: float | None = None) -> None:
    """Raise on every rank unless every rank prepared the same ``signature`` without error.

    Args:
        comm: the communicator of the collective about to run.
        signature: a description of this rank's call (None when ``error`` is set).
        error: the exception this rank's argument checks raised, if any.
        what: the collective's name for messages (``"all_reduce"``).
        hint: what every rank must pass identically, for the mismatch message.
        timeout: seconds to wait for the other ranks; past it, raise
            :class:`CollectiveTimeoutError` naming the ranks that have not arrived. Part
            of the agreed call: ranks that pass different timeouts get a mismatch error.
            None: the process-wide stall check and timeout of :func:`mpistrat.runtime.stall.watch`
            apply, if any.
    """
    MPI = mpi()
    code = 0
    if signature is not None:
        text = f"{signature} timeout={timeout}"
        digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
        code = int.from_bytes(digest, "little") >> 2  # fits in int64, and so does -code
    flags = np.array([1 if error is not None else 0, code, -code], dtype=np.int64)
    notes = None
    if timeout is None:
        # Non-blocking even without a timeout: blocking and non-blocking collectives do
        # not match each other in MPI, and ranks may disagree on the timeout.
        watch = stall.current()
        if watch is None:
            comm.Iallreduce(MPI.IN_PLACE, flags, op=MPI.MAX).Wait()
        else:
            watch.allreduce(comm, flags, what)
    else:
        notes = _allreduce_within(comm, flags, timeout, what)
    failed, high, negated_low = (int(x) for x in flags)
    if not failed and high == -negated_low:
        if notes is not None:  # every rank agreed on this timeout, so every rank sent one
            notes.finish(range(comm.Get_size()))
        return
    mine = f"{type(error).__name__}: {error}" if error is not None else signature
    everyone = comm.allgather((error is not None, mine, timeout is not None))
    timed = [rank for rank, (_, _, has_timeout) in enumerate(everyone) if has_timeout]
    if notes is not None:
        notes.finish(timed)
    else:  # take the arrival notes the timed ranks sent us, so none is left behind
        for source in timed:
            comm.Recv(np.zeros(1, dtype=np.int64), source, tag=_ARRIVAL_TAG)
    detail = "; ".join(f"rank {rank}: {text}" for rank, (_, text, _) in enumerate(everyone))
    if error is not None:
        raise error
    if failed:
        bad = [rank for rank, (erred, _, _) in enumerate(everyone) if erred]
        raise CollectiveMismatchError(
            f"{what} failed on rank(s) {bad} before communicating ({detail}); fix the "
            f"arguments there: every rank must pass a valid, identical call"
        )
    raise CollectiveMismatchError(
        f"{what} called with different arguments on different ranks ({detail}); every "
        f"rank must pass {hint}"
    )


_ARRIVAL_TAG = 0x5A7  # point-to-point tag of the arrival notes of timed agreements


class _Notes:
    """The arrival notes of one timed agreement: one sent to, one expected from, each rank."""

    def __init__(self, comm: Comm) -> None:
        rank = comm.Get_rank()
        self.others = [r for r in range(comm.Get_size()) if r != rank]
        self._note = np.ones(1, dtype=np.int64)
        self._inbox = [np.zeros(1, dtype=np.int64) for _ in self.others]
        self.receives = [comm.Irecv(buf, source, tag=_ARRIVAL_TAG)
                         for buf, source in zip(self._inbox, self.others)]
        self.sends = [comm.Isend(self._note, dest, tag=_ARRIVAL_TAG) for dest in self.others]

    def missing(self) -> list[int]:
        """The ranks whose note has not come."""
        return [source for source, r in zip(self.others, self.receives) if not r.Test()]

    def finish(self, senders: Any) -> None:
        """Complete the exchange: wait for the notes of ``senders``, cancel the others."""
        MPI = mpi()
        senders = set(senders)
        for source, receive in zip(self.others, self.receives):
            if source not in senders and not receive.Test():
                receive.Cancel()
            receive.Wait()
        MPI.Request.Waitall(self.sends)  # every rank takes the notes sent to it


def _allreduce_within(comm: Comm, flags: np.ndarray, timeout: float, what: str) -> _Notes:
    """The agreement Allreduce, given up after ``timeout`` seconds.

    Each arriving rank also sends a one-word arrival note to every other rank, so that on
    a timeout a rank can name the ranks it never heard from. After a timeout the
    communicator still has a collective in flight and must not be used again: end the
    job (``mpistrat run`` aborts it) or create a new communicator.
    """
    MPI = mpi()
    rank, size = comm.Get_rank(), comm.Get_size()
    notes = _Notes(comm)
    request = comm.Iallreduce(MPI.IN_PLACE, flags, op=MPI.MAX)
    deadline = time.monotonic() + timeout
    pause = 1e-5
    while not request.Test():
        if time.monotonic() >= deadline:
            missing = notes.missing()
            raise CollectiveTimeoutError(
                f"{what} timed out after {timeout:g} s on rank {rank} of {size}: rank(s) "
                f"{missing} did not arrive; they are stuck elsewhere or have taken another "
                f"code path (every rank must call {what} the same number of times); this "
                f"communicator cannot be used after the timeout",
                missing,
            )
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)
    return notes
