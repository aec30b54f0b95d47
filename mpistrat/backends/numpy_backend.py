"""The NumPy backend: host buffers.

Algorithms do all their arithmetic and temporary allocation through a backend, so device
arrays (CuPy) can flow through the same algorithm code. Temporaries come from a scratch
pool that keeps its buffers between calls (grown by doubling, touched once when
allocated), so the hot path of a collective allocates nothing and takes no page faults.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ..ops import ReduceOp
from ..runtime._mpi import Comm
from .transport import DirectTransport

__all__ = ["NumpyBackend", "UFUNCS"]

# The ufunc of each primitive reduction (MEAN runs as SUM), for every host algorithm.
UFUNCS = {ReduceOp.SUM: np.add, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum}


class NumpyBackend:
    """Host arrays (``numpy.ndarray``)."""

    name = "numpy"
    xp = np

    def __init__(self) -> None:
        self._pool: dict[str, np.ndarray] = {}
        self._recycle: dict[tuple[int, str], list[np.ndarray]] = {}

    @staticmethod
    def owns(array: Any) -> bool:
        """True for arrays this backend handles."""
        return isinstance(array, (np.ndarray, np.generic))

    def asarray(self, value: Any) -> np.ndarray:
        """``value`` as an ndarray (no copy when it already is one)."""
        return np.asarray(value)

    def flat_copy(self, array: np.ndarray) -> np.ndarray:
        """A new C-contiguous 1-D copy of ``array`` (any layout, any shape)."""
        return np.array(array, copy=True, order="C").reshape(-1)

    def flat_view(self, array: np.ndarray) -> np.ndarray | None:
        """A 1-D view of ``array`` sharing its memory, or None if it is not C-contiguous."""
        return array.reshape(-1) if array.flags.c_contiguous else None

    def scratch(self, tag: str, count: int, dtype: Any) -> np.ndarray:
        """A reusable 1-D temporary of ``count`` elements (valid until the next call with ``tag``)."""
        dtype = np.dtype(dtype)
        nbytes = count * dtype.itemsize
        pool = self._pool.get(tag)
        if pool is None or pool.nbytes < nbytes:
            capacity = max(4096, 1 << max(nbytes - 1, 1).bit_length())
            pool = np.empty(capacity, dtype=np.uint8)
            pool.fill(0)  # fault the pages in now, not on the hot path
            self._pool[tag] = pool
        return pool[:nbytes].view(dtype)

    def recycled(self, count: int, dtype: Any) -> np.ndarray:
        """A new-to-the-caller 1-D array of ``count`` elements, reusing the memory of an
        earlier one once nothing references it any more (no views of it alive).

        Results that are views into packs keep their pack alive; once a training step
        drops them, the next step reuses the (already faulted-in) memory instead of a
        fresh allocation. Relies on CPython reference counts.
        """
        dtype = np.dtype(dtype)
        pool = self._recycle.setdefault((count, dtype.str), [])
        for buffer in pool:
            # references: the pool's list, this loop variable, getrefcount's argument
            if sys.getrefcount(buffer) == 3:
                return buffer
        buffer = np.empty(count, dtype=dtype)
        if len(pool) < 4:
            pool.append(buffer)
        return buffer

    @staticmethod
    def combine(op: ReduceOp, dst: np.ndarray, src: np.ndarray) -> None:
        """``dst = op(dst, src)`` element-wise, in place (MEAN combines as SUM)."""
        UFUNCS[op.primitive](dst, src, out=dst)

    @staticmethod
    def divide(array: np.ndarray, count: int) -> np.ndarray:
        """``array / count``: in place for inexact dtypes, a new float64 array for integers."""
        if np.issubdtype(array.dtype, np.inexact) or array.dtype.kind == "V":
            np.true_divide(array, array.dtype.type(count), out=array)
            return array
        return np.true_divide(array, count, dtype=np.float64)

    @staticmethod
    def copy(dst: np.ndarray, src: np.ndarray) -> None:
        """Copy ``src`` into ``dst`` (same shape)."""
        np.copyto(dst, src)

    @staticmethod
    def copy_many(dsts: Sequence[np.ndarray], srcs: Sequence[np.ndarray]) -> None:
        """:meth:`copy` for each pair."""
        for dst, src in zip(dsts, srcs):
            np.copyto(dst, src)

    @staticmethod
    def copy_pieces(out: np.ndarray, pieces: Iterable[tuple[np.ndarray, int, int, int]]) -> None:
        """``out[at:at + stop - start] = segment[start:stop]`` for each piece."""
        for segment, start, stop, at in pieces:
            out[at:at + stop - start] = segment[start:stop]

    @staticmethod
    def clone(array: np.ndarray) -> np.ndarray:
        """A new array equal to ``array``."""
        return np.array(array, copy=True)

    @staticmethod
    def comm_view(array: np.ndarray) -> np.ndarray:
        """The bytes of a contiguous 1-D array, as mpi4py sends and receives them."""
        return array.view(np.uint8)

    @staticmethod
    def synchronize() -> None:
        """Host arrays are always ready."""

    @staticmethod
    def transport(comm: Comm) -> Any:
        """How the algorithms move host buffers over ``comm``: straight to MPI."""
        return DirectTransport(comm)

    def release(self) -> None:
        """Drop the scratch and recycling pools."""
        self._pool.clear()
        self._recycle.clear()
