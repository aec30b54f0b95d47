"""Agree across ranks that a collective call is valid and identical everywhere.

Before any data moves, every rank contributes (did my arguments fail?, a hash of what I
was asked to do) to one 24-byte ``Allreduce``. If some rank failed or the hashes differ,
the ranks exchange descriptions (error path only) and every rank raises: the rank whose
arguments were bad raises its own error, the others a :class:`CollectiveMismatchError`
naming each rank's call. So a mistake on one rank is an error everywhere, never a hang.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from ._mpi import mpi
from .errors import CollectiveMismatchError

__all__ = ["agree"]


def agree(comm: Any, signature: str | None, error: BaseException | None, what: str,
          hint: str = "the same call") -> None:
    """Raise on every rank unless every rank prepared the same ``signature`` without error.

    Args:
        comm: the communicator of the collective about to run.
        signature: a description of this rank's call (None when ``error`` is set).
        error: the exception this rank's argument checks raised, if any.
        what: the collective's name for messages (``"all_reduce"``).
        hint: what every rank must pass identically, for the mismatch message.
    """
    MPI = mpi()
    code = 0
    if signature is not None:
        digest = hashlib.blake2b(signature.encode(), digest_size=8).digest()
        code = int.from_bytes(digest, "little") >> 2  # fits in int64, and so does -code
    flags = np.array([1 if error is not None else 0, code, -code], dtype=np.int64)
    comm.Allreduce(MPI.IN_PLACE, flags, op=MPI.MAX)
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
