"""What an array backend offers the algorithms: :class:`ArrayBackend`, the one interface
:class:`~mpistrat.backends.numpy_backend.NumpyBackend` (host arrays) and
:class:`~mpistrat.backends.cupy_backend.CupyBackend` (one CUDA device's arrays) implement.

The algorithms see buffers only through it: they ask for scratch and result memory,
combine and divide element-wise, and move bytes through the backend's
:meth:`~ArrayBackend.transport` (:mod:`mpistrat.backends.transport`), so the same
algorithm code runs on host and device buffers.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

from ..ops import ReduceOp
from ..runtime._mpi import Comm

__all__ = ["ArrayBackend"]


@runtime_checkable
class ArrayBackend(Protocol):
    """The array operations every all-reduce algorithm is written against.

    Attributes:
        name: ``"numpy"`` or ``"cupy"`` (checked where an algorithm needs one kind,
            e.g. NCCL needs device buffers).
        xp: the array module (``numpy`` or ``cupy``), for ``empty`` and friends.
    """

    name: str
    xp: Any

    def owns(self, array: Any) -> bool:
        """True for arrays this backend handles."""

    def asarray(self, value: Any) -> Any:
        """``value`` as this backend's array (no copy when it already is one)."""

    def flat_copy(self, array: Any) -> Any:
        """A new C-contiguous 1-D copy of ``array`` (any layout, any shape)."""

    def flat_view(self, array: Any) -> Any | None:
        """A 1-D view of ``array`` sharing its memory, or None if it is not C-contiguous."""

    def scratch(self, tag: str, count: int, dtype: Any) -> Any:
        """A reusable 1-D temporary of ``count`` elements, valid until the next call with
        the same ``tag``."""

    def recycled(self, count: int, dtype: Any) -> Any:
        """A 1-D array of ``count`` elements that is new to the caller, reusing the memory
        of an earlier one nothing references any more."""

    def combine(self, op: ReduceOp, dst: Any, src: Any) -> None:
        """``dst = op(dst, src)`` element-wise, in place (MEAN combines as SUM)."""

    def divide(self, array: Any, count: int) -> Any:
        """``array / count``: in place for inexact dtypes, a new float64 array for
        integers."""

    def copy(self, dst: Any, src: Any) -> None:
        """Copy ``src`` into ``dst`` (same shape)."""

    def copy_many(self, dsts: Sequence[Any], srcs: Sequence[Any]) -> None:
        """:meth:`copy` for each pair (a device backend launches one kernel for all)."""

    def copy_pieces(self, out: Any, pieces: Iterable[tuple[Any, int, int, int]]) -> None:
        """``out[at:at + stop - start] = segment[start:stop]`` for each
        ``(segment, start, stop, at)`` (1-D arrays of ``out``'s dtype): a batch's tensors
        gathered into one buffer without a view per piece."""

    def clone(self, array: Any) -> Any:
        """A new array on this backend's device equal to ``array`` (from anywhere)."""

    def comm_view(self, array: Any) -> Any:
        """The bytes of a contiguous 1-D array, as the transport sends and receives them."""

    def synchronize(self) -> None:
        """Wait until the work queued on this backend's arrays is done (host: nothing)."""

    def transport(self, comm: Comm) -> Any:
        """How the algorithms move this backend's buffers over ``comm``
        (:class:`~mpistrat.backends.transport.DirectTransport` or
        :class:`~mpistrat.backends.transport.StagedTransport`)."""

    def release(self) -> None:
        """Drop cached scratch and result memory."""
