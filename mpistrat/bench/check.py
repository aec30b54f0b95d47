"""Inputs whose reduction is exact, the reference result, and counting wrong elements.

The input is small integers 1..15, different on every rank and replica and with a long
period, so every sum is exact in any order (every correct algorithm gives bitwise the
reference) and a misplaced or missing piece shows up as wrong elements.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..algorithms import native
from ..backends.protocol import ArrayBackend
from ..ops import ReduceOp
from ..runtime._mpi import Comm

__all__ = ["fill_pattern", "reference", "count_wrong"]

_BLOCK = 1 << 22


def fill_pattern(buf: np.ndarray, seed: int) -> None:
    """Fill the 1-D ``buf`` with integers 1..15 that depend on the index and ``seed``
    (the rank's global replica id)."""
    for start in range(0, buf.size, _BLOCK):
        index = np.arange(start, min(start + _BLOCK, buf.size), dtype=np.int64)
        values = (index * 40503 + seed * 7919) % 65521 % 15 + 1
        buf[start:start + index.size] = values.astype(buf.dtype)


def reference(comm: Comm, inputs: Sequence[np.ndarray], op: ReduceOp, backend: ArrayBackend,
              participants: int) -> np.ndarray:
    """The all-reduce of every rank's ``inputs`` (its replicas) by ``MPI_Allreduce``.

    Collective over ``comm``. Dtypes without an MPI type (bfloat16) go through
    ``native``'s user-defined op. MEAN divides the SUM by ``participants``.
    """
    ref = inputs[0].copy()
    for other in inputs[1:]:
        backend.combine(op, ref, other)
    native.all_reduce(comm, ref, op=op.primitive, backend=backend)
    if op is ReduceOp.MEAN:
        ref = backend.divide(ref, participants)
    return ref


def count_wrong(outputs: Sequence[Any], ref: np.ndarray) -> int:
    """Elements of ``outputs`` (one array per replica) that differ from ``ref``; an
    output of the wrong size or dtype counts entirely as wrong."""
    wrong = 0
    for out in outputs:
        out = (out.get() if type(out).__module__.startswith("cupy") else np.asarray(out))
        out = out.reshape(-1)
        if out.shape != ref.shape or out.dtype != ref.dtype:
            wrong += ref.size
            continue
        wrong += int(np.count_nonzero(out != ref))
    return wrong
