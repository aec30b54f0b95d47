"""Agree across ranks that a collective call is valid and identical everywhere.

Before any data moves, every rank contributes (did my arguments fail?, a hash of what I
was asked to do) to one 24-byte ``Allreduce``. If some rank failed or the hashes differ,
the ranks exchange descriptions (error path only) and every rank raises: the rank whose
arguments were bad raises its own error, the others a :class:`CollectiveMismatchError`
naming each rank's call. So a mistake on one rank is an error everywhere, never a hang.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import numpy as np

from ._mpi import mpi
from ._commcache import comm_cache
from .errors import CollectiveMismatchError, CollectiveTimeoutError

__all__ = ["agree"]


def agree(comm: Any, signature: str | None, error: BaseException | None, what: str,
          hint: str = "the same call", timeout: float | None = None) -> None:
    """Raise on every rank unless every rank prepared the same ``signature`` without error.

    Args:
        comm: the communicator of the collective about to run.
        signature: a description of this rank's call (None when ``error`` is set).
        error: the exception this rank's argument checks raised, if any.
        what: the collective's name for messages (``"all_reduce"``).
        hint: what every rank must pass identically, for the mismatch message.
        timeout: seconds to wait for the other ranks; past it, raise
            :class:`CollectiveTimeoutError` naming the ranks that have not arrived.
    """
    MPI = mpi()
    code = 0
    if signature is not None:
        digest = hashlib.blake2b(signature.encode(), digest_size=8).digest()
        code = int.from_bytes(digest, "little") >> 2  # fits in int64, and so does -code
    flags = np.array([1 if error is not None else 0, code, -code], dtype=np.int64)
    if timeout is None:
        # Non-blocking even without a timeout: blocking and non-blocking collectives do
        # not match each other in MPI, and ranks may disagree on the timeout.
        comm.Iallreduce(MPI.IN_PLACE, flags, op=MPI.MAX).Wait()
    else:
        _allreduce_within(comm, flags, timeout, what)
    failed, high, negated_low = (int(x) for x in flags)
    if not failed and high == -negated_low:
        return
    mine = f"{type(error).__name__}: {error}" if error is not None else signature
    everyone = comm.allgather((error is not None, mine))
    detail = "; ".join(f"rank {rank}: {text}" for rank, (_, text) in enumerate(everyone))
    if error is not None:
        raise error
    if failed:
        bad = [rank for rank, (erred, _) in enumerate(everyone) if erred]
        raise CollectiveMismatchError(
            f"{what} failed on rank(s) {bad} before communicating ({detail}); fix the "
            f"arguments there: every rank must pass a valid, identical call"
        )
    raise CollectiveMismatchError(
        f"{what} called with different arguments on different ranks ({detail}); every "
        f"rank must pass {hint}"
    )


_ARRIVAL_TAG = 0x5A7  # point-to-point tag of the arrival notes of timed agreements


class _Sequence:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0


def _allreduce_within(comm: Any, flags: np.ndarray, timeout: float, what: str) -> None:
    """The agreement Allreduce, given up after ``timeout`` seconds.

    Each arriving rank also sends a one-byte arrival note to every other rank, so that on
    a timeout a rank can name the ranks it never heard from. After a timeout the
    communicator still has a collective in flight and must not be used again: end the
    job (``mpistrat run`` aborts it) or create a new communicator.
    """
    MPI = mpi()
    rank, size = comm.Get_rank(), comm.Get_size()
    sequence = comm_cache(comm).setdefault("timed_agreements", _Sequence())
    sequence.value += 1
    note = np.array([sequence.value], dtype=np.int64)
    others = [r for r in range(size) if r != rank]
    notes_in = [np.zeros(1, dtype=np.int64) for _ in others]
    receives = [comm.Irecv(buf, source, tag=_ARRIVAL_TAG) for buf, source in zip(notes_in, others)]
    sends = [comm.Isend(note, dest, tag=_ARRIVAL_TAG) for dest in others]
    request = comm.Iallreduce(MPI.IN_PLACE, flags, op=MPI.MAX)
    deadline = time.monotonic() + timeout
    pause = 1e-5
    while not request.Test():
        if time.monotonic() >= deadline:
            missing = [source for source, r in zip(others, receives) if not r.Test()]
            raise CollectiveTimeoutError(
                f"{what} timed out after {timeout:g} s on rank {rank} of {size}: rank(s) "
                f"{missing} did not arrive; they are stuck elsewhere or have taken another "
                f"code path (every rank must call {what} the same number of times); this "
                f"communicator cannot be used after the timeout",
                missing,
            )
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)
    MPI.Request.Waitall(receives)
    MPI.Request.Waitall(sends)
