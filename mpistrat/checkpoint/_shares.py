"""A large snapshot's copy shared by the ranks of a host (:mod:`.snapshot`).

In synchronous data-parallel training every rank of a host holds the same state, so the
host's ranks (its first :data:`MAX_SHARERS`) each copy one share of it into the slot,
side by side, instead of one rank copying everything while the others wait for it in the
next collective: the values' bytes (and a torch module's and optimizer's arrays, which
every rank expands from its own replica) are cut into as many contiguous shares, of
nearly equal size (:func:`shares`), each a list of pieces of values.

Each sharer computes its pieces' checksums as it copies them and posts them on the host's
board (:class:`Board`: a small file beside the slots, one record per slot and sharer).
The host's writer copies share 0, waits for every other share's record of the same
snapshot (at most :data:`WAIT_S` seconds), and commits the slot with every checksum in
its authenticated record. A board record is input like any file: it counts only when it
is the snapshot's, whole and of the expected length; a wrong checksum posted there makes
the restore skip that snapshot (its data does not match), never restore it. A sharer that
cannot copy its share says so (:meth:`Board.fail`), and the writer gives the snapshot up
at once.
"""

from __future__ import annotations

import bisect
import mmap
import os
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["SHARE_BYTES", "MAX_SHARERS", "GRAIN", "WAIT_S", "Piece", "shares", "Board"]

SHARE_BYTES = 4 << 20  # states of at least this much are shared by a host's ranks
MAX_SHARERS = 64  # ranks of a host that share a snapshot (the others only count it)
GRAIN = 4096  # shares are cut at multiples of this within a value
WAIT_S = 60.0  # how long the writer waits for the other shares before giving up on one
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_WORD = (1 << 64) - 1
_FAILED = _WORD  # a record's count when its share could not be copied


@dataclass(frozen=True)
class Piece:
    """Bytes ``start:stop`` of value ``value`` (its index among the layout's values)."""

    value: int
    start: int
    stop: int


def shares(sizes: Sequence[int], parts: int) -> list[list[Piece]]:
    """The bytes of values of ``sizes`` bytes (in order) cut into ``parts`` contiguous
    shares of nearly equal size: share ``j`` starts at about ``j / parts`` of the total,
    moved back to a multiple of :data:`GRAIN` from its value's start. Every byte is in
    exactly one piece; a share may be empty when the values are small."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    starts = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64))).tolist()
    total = starts[-1]
    cuts = [0]
    for j in range(1, parts):
        at = total * j // parts
        if sizes:  # (back to a grain of the value it falls in)
            i = min(bisect.bisect_right(starts, at), len(sizes)) - 1
            at = starts[i] + (at - starts[i]) // GRAIN * GRAIN
        cuts.append(max(at, cuts[-1]))
    cuts.append(total)
    out: list[list[Piece]] = []
    for low, high in zip(cuts, cuts[1:]):
        pieces = []
        for i, size in enumerate(sizes):
            a, b = max(low, starts[i]), min(high, starts[i] + size)
            if a < b:
                pieces.append(Piece(i, a - starts[i], b - starts[i]))
        out.append(pieces)
    return out


class Board:
    """The host's board: for each of the two slots and each sharer, a record of the
    checksums of its share of the snapshot last written there: ``[sequence, count,
    checksums (three 64-bit words each)..., sequence]``. The writer creates it
    (:meth:`create`); every sharer maps it.

    Args:
        path: the file (in the host's private snapshot directory).
        parts: the host's sharers.
        pieces: the most pieces a share has.
    """

    def __init__(self, path: str, parts: int, pieces: int) -> None:
        self.path = path
        self.parts = parts
        self.room = pieces  # checksums a record holds
        self._words = 3 + 3 * pieces  # (a record's)
        self.nbytes = 2 * parts * self._words * 8
        self._map: mmap.mmap | None = None
        self._board: np.ndarray | None = None

    def create(self) -> None:
        """Create the file, or empty the one a previous launch left (the writer's)."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o600)
        try:
            self._check(fd)
            os.ftruncate(fd, 0)
            os.ftruncate(fd, self.nbytes)
        finally:
            os.close(fd)

    def open(self) -> None:
        """Map the file (every sharer, once the writer created it)."""
        fd = os.open(self.path, os.O_RDWR | _NOFOLLOW)
        try:
            self._check(fd)
            if os.fstat(fd).st_size < self.nbytes:
                raise ValueError(f"{self.path} holds {os.fstat(fd).st_size} bytes, a board "
                                 f"of {self.parts} shares {self.nbytes}")
            self._map = mmap.mmap(fd, self.nbytes)
        finally:
            os.close(fd)
        self._board = np.frombuffer(self._map, np.uint64).reshape(2, self.parts, self._words)

    def _check(self, fd: int) -> None:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise PermissionError(f"{self.path} is not a regular file of this user's")

    def withdraw(self, slot: int, part: int) -> None:
        """Share ``part`` of ``slot`` is being rewritten: its record no longer counts."""
        assert self._board is not None
        self._board[slot, part, 0] = 0

    def post(self, slot: int, part: int, sequence: int, sums: Sequence[int]) -> None:
        """Share ``part`` of snapshot ``sequence`` is in ``slot``, with checksums
        ``sums``: its record, the sequence at its head last."""
        assert self._board is not None
        if len(sums) > self.room:
            raise ValueError(f"share {part} has {len(sums)} checksums, more than the "
                             f"{self.room} its record on the board holds")
        record = self._board[slot, part]
        record[0] = 0
        record[1] = len(sums)
        for k, value in enumerate(sums):
            record[2 + 3 * k:5 + 3 * k] = (value >> 128 & _WORD, value >> 64 & _WORD,
                                           value & _WORD)
        record[2 + 3 * len(sums)] = sequence
        record[0] = sequence

    def fail(self, slot: int, part: int, sequence: int) -> None:
        """Share ``part`` of snapshot ``sequence`` could not be copied: the writer gives
        that snapshot up at once instead of waiting for it."""
        assert self._board is not None
        record = self._board[slot, part]
        record[0] = 0
        record[1] = _FAILED
        record[0] = sequence

    def collect(self, slot: int, part: int, sequence: int, deadline: float) -> list[int]:
        """The checksums share ``part`` posted for snapshot ``sequence`` in ``slot``,
        once it has (the wait backs off from 50 µs to 1 ms a look).

        Raises:
            TimeoutError: not posted by ``deadline`` (``time.monotonic()``).
            ValueError: posted with more checksums than a record holds, or as failed
                (:meth:`fail`).
        """
        assert self._board is not None
        record = self._board[slot, part]
        room = self.room
        pause = 5e-5
        while True:
            if int(record[0]) == sequence:
                count = int(record[1])
                if count == _FAILED:
                    raise ValueError(f"share {part} of snapshot {sequence} could not be "
                                     f"copied on its rank (it warned why)")
                if count > room:
                    raise ValueError(f"share {part} of snapshot {sequence} posted {count} "
                                     f"checksums, more than the {room} a record holds")
                words = record[2:2 + 3 * count].tolist()
                if int(record[2 + 3 * count]) == sequence and int(record[0]) == sequence:
                    return [words[k] << 128 | words[k + 1] << 64 | words[k + 2]
                            for k in range(0, 3 * count, 3)]
            if time.monotonic() > deadline:
                raise TimeoutError(f"share {part} of snapshot {sequence} was not copied "
                                   f"within {WAIT_S:g} s (its rank did not take the "
                                   f"snapshot, or was too slow)")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def close(self) -> None:
        self._board = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass
            self._map = None
