"""The input of an out-of-place all-reduce: one logical 1-D buffer made of segments.

``batch_reduce`` packs many tensors into one buffer so that one all-reduce moves them.
Copying 100 MB of gradients into a pack costs about as much as the all-reduce itself on
one node, so algorithms that support it (``rechd``, ``xring``, ``native`` on one segment)
take the tensors where they are, as a :class:`Source`, and write the result into a
separate output buffer: the first step of the algorithm reads the segments directly —
the part a rank sends goes out from the tensors, the part it keeps is received straight
into the output and the rank's own contribution is added there (``out = src + out``:
two reads and one write, as an in-place reduction). The copy into the pack disappears.

Messages: a piece of a large segment is sent as its own message, straight from the
tensor; consecutive pieces of small segments (under ``coalesce_bytes``) are copied into a
staging buffer and sent as one message, so a batch of many biases and norms costs a few
messages, not hundreds. Both sides of an exchange compute the same message boundaries
from the segment sizes, so every rank's Source must have the same segment sizes (the
cross-device ops agree on the batch's shapes before any data moves). Messages go through
the backend's transport (:mod:`mpistrat.backends.transport`), so device segments can be staged.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ..backends.protocol import ArrayBackend
from ..ops import ReduceOp
from ..runtime import stall
from ..runtime._mpi import Comm, mpi
from ._chunks import capped

__all__ = ["Source", "COALESCE_BYTES", "JOIN_BYTES", "agreed_join"]

COALESCE_BYTES = 1 << 20  # segments below this are staged and sent together
JOIN_BYTES = 1 << 20  # from this size, ranks agree whether their Sources are one buffer


def _join(segments: list[Any]) -> Any:
    """One 1-D view over all ``segments`` when they are NumPy views that follow one
    another in one array's memory (tensors kept as views of one flat gradient buffer, in
    order), else None."""
    first = segments[0]
    if not isinstance(first, np.ndarray):
        return None
    root = _root(first)
    end = _address(first) + first.nbytes
    for segment in segments[1:]:
        if not isinstance(segment, np.ndarray) or _address(segment) != end \
                or segment.dtype != first.dtype or _root(segment) is not root:
            return None
        end += segment.nbytes
    return np.lib.stride_tricks.as_strided(first, shape=(sum(s.size for s in segments),),
                                           strides=(first.itemsize,), writeable=False)


def _address(array: Any) -> int:
    return array.__array_interface__["data"][0] if isinstance(array, np.ndarray) else -1


def _root(array: np.ndarray) -> Any:
    """The object that owns ``array``'s memory (the end of its chain of bases)."""
    while isinstance(array, np.ndarray) and array.base is not None:
        array = array.base
    return array


class Source:
    """Segments (contiguous 1-D arrays of one dtype) read as one buffer, in order.

    Args:
        segments: the pieces; empty ones are dropped.
        coalesce_bytes: segments smaller than this are sent together through a staging
            buffer.
    """

    __slots__ = ("segments", "offsets", "size", "dtype", "_small", "_stage_at", "_stage_size")

    def __init__(self, segments: Sequence[Any], coalesce_bytes: int = COALESCE_BYTES) -> None:
        self.segments = [s for s in segments if s.size]
        if not self.segments and segments:
            self.segments = [segments[0]]
        dtypes = {s.dtype for s in self.segments}
        if len(dtypes) > 1:
            raise ValueError(f"a Source's segments must share one dtype, got "
                             f"{sorted(map(str, dtypes))}")
        sizes = [s.size for s in self.segments]
        self.offsets = [0, *itertools.accumulate(sizes)]
        self.size = self.offsets[-1]
        # the segments' dtype (NumPy's or a device library's), None without segments
        self.dtype: Any = self.segments[0].dtype if self.segments else None
        several = len(self.segments) > 1
        small = [several and s.nbytes < coalesce_bytes for s in self.segments]
        self._small = small
        # where each small segment sits in the staging buffer (the small ones, packed)
        self._stage_at = [0, *itertools.accumulate(n if s else 0 for n, s in zip(sizes, small))]
        self._stage_size = self._stage_at.pop()

    @classmethod
    def of(cls, array: Any) -> Source:
        """A Source over one contiguous 1-D array (what ``cls([array])`` builds, without
        its general bookkeeping: every out-of-place call makes one)."""
        source = cls.__new__(cls)
        source.segments = [array]
        source.offsets = [0, array.size]
        source.size = array.size
        source.dtype = array.dtype
        source._small = [False]
        source._stage_at = [0]
        source._stage_size = 0
        return source

    @property
    def contiguous(self) -> bool:
        """True when the Source is one segment (one array)."""
        return len(self.segments) == 1

    def joined(self) -> Any:
        """This rank's segments as one 1-D read-only view when they lie one after another
        in one array's memory, else None. Depends on this rank's memory only: algorithms
        whose peers compute message boundaries from the Source must agree before using
        it (:func:`mpistrat.dispatch.run` does)."""
        if len(self.segments) == 1:
            return self.segments[0]
        return _join(self.segments) if self.segments else None

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize if self.dtype is not None else 0

    def pieces(self, lo: int, hi: int) -> Iterator[tuple[int, int, int, int]]:
        """``(segment index, start, stop, position)`` of each piece of ``[lo, hi)``:
        elements ``start:stop`` of that segment sit at ``position`` of the logical buffer."""
        if lo >= hi:
            return
        index = bisect.bisect_right(self.offsets, lo) - 1
        offsets = self.offsets
        while lo < hi:
            base = offsets[index]
            stop = min(hi, offsets[index + 1])
            if stop > lo:
                yield index, lo - base, stop - base, lo
            lo = stop
            index += 1

    def messages(self, lo: int, hi: int, max_bytes: int = 0) -> list[tuple[int, int, bool]]:
        """How ``[lo, hi)`` travels: ``(start, stop, staged)`` per message, in order; with
        ``max_bytes``, a longer message is cut into near-equal ones of at most that size
        (so a receiver can start on the first while the rest are on their way)."""
        if max_bytes > 0 and (hi - lo) * self.dtype.itemsize > max_bytes:
            most = max_bytes // self.dtype.itemsize
            return [(x, y, staged) for a, b, staged in self.messages(lo, hi)
                    for x, y in capped(a, b, most)]
        if self.contiguous or lo >= hi:
            return [(lo, hi, False)] if hi > lo else []
        out: list[tuple[int, int, bool]] = []
        run = None
        for index, start, stop, position in self.pieces(lo, hi):
            end = position + stop - start
            if self._small[index]:
                run = (run[0], end) if run is not None else (position, end)
                continue
            if run is not None:
                out.append((run[0], run[1], True))
                run = None
            out.append((position, end, False))
        if run is not None:
            out.append((run[0], run[1], True))
        return out

    def isend(self, comm: Comm, lo: int, hi: int, dest: int, tag: int, backend: ArrayBackend,
              data: Any = None, max_bytes: int = 0) -> list[Any]:
        """Start sending elements ``[lo, hi)`` to ``dest``; the requests to wait on.

        With ``data`` (a contiguous buffer indexed like the Source), send ``data[lo:hi]``
        instead, cut into the same messages, so a rank whose contribution already sits in
        its output can exchange with a peer that still sends from its Source. Staged
        pieces are copied into a scratch buffer that stays valid until the next call of
        any algorithm on this backend, so wait before returning from one. ``max_bytes``
        as in :meth:`messages` (the receiver must pass the same).
        """
        transport = backend.transport(comm)
        requests = []
        stage = None
        for start, stop, staged in self.messages(lo, hi, max_bytes):
            if data is not None:
                view = backend.comm_view(data[start:stop])
                requests.append(transport.isend(view, dest, tag))
                continue
            if not staged:
                index, a, b, _ = next(self.pieces(start, stop))
                view = backend.comm_view(self.segments[index][a:b])
                requests.append(transport.isend(view, dest, tag))
                continue
            if stage is None:
                stage = backend.scratch("source-stage", self._stage_size, self.dtype)
            pieces = [(self.segments[index], a, b, self._stage_at[index] + a)
                      for index, a, b, _ in self.pieces(start, stop)]
            assert pieces  # a staged message has at least one piece
            backend.copy_pieces(stage, pieces)
            first = pieces[0][3]
            view = backend.comm_view(stage[first:first + stop - start])
            requests.append(transport.isend(view, dest, tag))
        return requests

    def irecv(self, comm: Comm, out: Any, lo: int, hi: int, source: int, tag: int,
              backend: ArrayBackend, at: int | None = None) -> list[Any]:
        """Start receiving a peer's elements ``[lo, hi)`` (sent by its :meth:`isend`) into
        ``out[at:at + hi - lo]`` (``at`` defaults to ``lo``)."""
        transport = backend.transport(comm)
        shift = (lo if at is None else at) - lo
        raw = backend.comm_view(out)
        size = out.itemsize
        return [transport.irecv(raw[(a + shift) * size:(b + shift) * size], source, tag)
                for a, b, _ in self.messages(lo, hi)]

    def receive_and_combine(self, op: ReduceOp, requests: list[Any], out: Any, lo: int,
                            hi: int, backend: ArrayBackend) -> None:
        """Wait for the messages of :meth:`irecv` ``[lo, hi)`` into ``out`` in order, adding
        this Source's piece to each as it lands (while it is still in cache)."""
        for request, (a, b, _) in zip(requests, self.messages(lo, hi)):
            request.Wait()
            self.combine_into(op, out, a, b, backend)

    def combine_into(self, op: ReduceOp, out: Any, lo: int, hi: int, backend: ArrayBackend) -> None:
        """``out[lo:hi] = op(out[lo:hi], self[lo:hi])`` (``out`` indexed like the Source)."""
        for index, a, b, position in self.pieces(lo, hi):
            backend.combine(op, out[position:position + b - a], self.segments[index][a:b])

    def copy_into(self, out: Any, lo: int = 0, hi: int | None = None, *,
                  backend: ArrayBackend) -> None:
        """``out[lo:hi] = self[lo:hi]``."""
        hi = self.size if hi is None else hi
        segments = self.segments
        backend.copy_pieces(out, [(segments[index], a, b, position)
                                  for index, a, b, position in self.pieces(lo, hi)])

    def __repr__(self) -> str:
        return f"Source({len(self.segments)} segment(s), {self.size} x {self.dtype})"


def agreed_join(comm: Comm, source: Source, backend: ArrayBackend) -> Source:
    """``source`` as one contiguous Source when every rank's segments are views of one
    buffer in order (:meth:`Source.joined`), else ``source`` unchanged.

    Algorithms that exchange pieces of the Source compute message boundaries from its
    segments, so the ranks must make the same choice: from :data:`JOIN_BYTES` up they
    agree with one small all-reduce (cheap next to the all-reduce of a MiB or more);
    below it, or for a Source of one segment, nothing is exchanged.
    """
    if source.contiguous or source.nbytes < JOIN_BYTES \
            or getattr(backend, "name", None) != "numpy":
        return source
    joined = source.joined()
    flag = np.array([0 if joined is not None else 1], dtype=np.int64)
    if comm.Get_size() > 1:
        watch = stall.current()
        if watch is None:
            comm.Iallreduce(mpi().IN_PLACE, flag, op=mpi().MAX).Wait()
        else:
            watch.allreduce(comm, flag, "the layout of a batch_reduce pack")
    return Source.of(joined) if not flag[0] else source
