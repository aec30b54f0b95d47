"""How a large snapshot's copy is cut into a host's ranks' shares, and the board on which
the sharers post their checksums for the writer (``mpistrat.checkpoint._shares``)."""

from __future__ import annotations

import os
import random
import time

import pytest

from mpistrat.checkpoint import _shares
from mpistrat.checkpoint._shares import GRAIN, Board, shares


@pytest.mark.parametrize("seed", range(20))
def test_every_byte_is_in_one_piece_and_the_shares_are_even(seed):
    rng = random.Random(seed)
    sizes = [rng.choice([0, 3, 4096, rng.randrange(1, 1 << 22)])
             for _ in range(rng.randrange(1, 40))]
    parts = rng.randrange(1, 9)
    found = shares(sizes, parts)
    assert len(found) == parts
    covered = [[] for _ in sizes]
    for share in found:
        for piece in share:
            assert 0 <= piece.start < piece.stop <= sizes[piece.value]
            covered[piece.value].append((piece.start, piece.stop))
    for size, spans in zip(sizes, covered):
        spans.sort()
        assert [a for a, _ in spans] == [0] + [b for _, b in spans[:-1]] if size else not spans
        assert (spans[-1][1] if spans else 0) == size
    # (in order: share j's pieces follow share j-1's; cut at a grain of their value)
    flat = [(p.value, p.start) for share in found for p in share]
    assert flat == sorted(flat)
    for share in found[1:]:
        if share:
            assert share[0].start % GRAIN == 0
    total = sum(sizes)
    for share in found:
        nbytes = sum(p.stop - p.start for p in share)
        assert abs(nbytes - total / parts) <= 2 * GRAIN, (nbytes, total / parts)


def test_one_part_is_every_value_whole():
    assert shares([5, 0, 9], 1) == [[_shares.Piece(0, 0, 5), _shares.Piece(2, 0, 9)]]
    with pytest.raises(ValueError, match="parts must be >= 1, got 0"):
        shares([5], 0)


@pytest.fixture
def board(tmp_path):
    made = Board(str(tmp_path / "shares.board"), 3, 4)
    made.create()
    made.open()
    yield made
    made.close()


def test_a_posted_share_is_collected_with_its_checksums(board):
    sums = [0, 1, (1 << 192) - 1, 12345 << 130]
    board.post(1, 2, 7, sums)
    assert board.collect(1, 2, 7, time.monotonic() + 1) == sums
    # another slot, share or snapshot is not it: the writer waits, then gives up
    for slot, part, sequence in ((0, 2, 7), (1, 1, 7), (1, 2, 8)):
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=f"share {part} of snapshot {sequence} was "
                                               f"not copied within"):
            board.collect(slot, part, sequence, started + 0.05)
        assert time.monotonic() - started < 1


def test_a_withdrawn_torn_or_overlong_record_does_not_count(board, tmp_path):
    board.post(0, 1, 3, [1, 2])
    board.withdraw(0, 1)
    with pytest.raises(TimeoutError):
        board.collect(0, 1, 3, time.monotonic() + 0.02)
    board.post(0, 1, 4, [1, 2])
    board._board[0, 1, 2 + 3 * 2] = 5  # (its tail says another snapshot: being rewritten)
    with pytest.raises(TimeoutError):
        board.collect(0, 1, 4, time.monotonic() + 0.02)
    board.post(0, 1, 5, [1, 2])
    board._board[0, 1, 1] = 5  # (a count past the record's room)
    with pytest.raises(ValueError, match="share 1 of snapshot 5 posted 5 checksums, more "
                                         "than the 4 a record holds"):
        board.collect(0, 1, 5, time.monotonic() + 1)
    board.fail(0, 1, 6)
    started = time.monotonic()
    with pytest.raises(ValueError, match="share 1 of snapshot 6 could not be copied on its "
                                         "rank"):
        board.collect(0, 1, 6, started + 10)
    assert time.monotonic() - started < 1
    board.post(0, 1, 6, [1, 2])
    # (another process's view of the same file sees it)
    other = Board(board.path, 3, 4)
    other.open()
    assert other.collect(0, 1, 6, time.monotonic() + 1) == [1, 2]
    other.close()


def test_a_board_that_is_a_link_or_too_small_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_bytes(bytes(4096))
    os.symlink(target, tmp_path / "shares.board")
    with pytest.raises(OSError):
        Board(str(tmp_path / "shares.board"), 2, 4).create()
    with pytest.raises(OSError):
        Board(str(tmp_path / "shares.board"), 2, 4).open()
    small = Board(str(tmp_path / "small.board"), 2, 4)
    (tmp_path / "small.board").write_bytes(bytes(8))
    with pytest.raises(ValueError, match=r"holds 8 bytes, a board of 2 shares \d+"):
        small.open()
