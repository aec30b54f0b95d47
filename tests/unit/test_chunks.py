"""How algorithms cut buffers: ``even_bounds``, ``ragged_bounds`` and ``gather_groups``."""

from __future__ import annotations

import pytest

from mpistrat.algorithms._chunks import capped, even_bounds, gather_groups, ragged_bounds


def _pieces(bounds: list[int]) -> list[int]:
    return [hi - lo for lo, hi in zip(bounds, bounds[1:])]


# --- even_bounds -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("count", "parts", "expected"),
    [
        (10, 3, [0, 4, 7, 10]),  # the first count % parts pieces are one longer
        (9, 3, [0, 3, 6, 9]),
        (7, 1, [0, 7]),
        (2, 4, [0, 1, 2, 2, 2]),  # fewer elements than pieces: trailing empty pieces
        (0, 3, [0, 0, 0, 0]),
        (1, 1, [0, 1]),
    ],
)
def test_even_bounds_examples(count, parts, expected):
    assert even_bounds(count, parts) == expected


def test_even_bounds_invariants():
    for count in range(0, 40):
        for parts in range(1, 12):
            bounds = even_bounds(count, parts)
            pieces = _pieces(bounds)
            assert len(bounds) == parts + 1
            assert bounds[0] == 0 and bounds[-1] == count
            assert all(p >= 0 for p in pieces)
            assert max(pieces) - min(pieces) <= 1, (count, parts, pieces)
            # longer pieces come first: exactly count % parts of them
            assert pieces == sorted(pieces, reverse=True)
            if count % parts:
                assert pieces.count(count // parts + 1) == count % parts


# --- ragged_bounds (TensorFlow's split for shuffles) -----------------------------------


@pytest.mark.parametrize(
    ("count", "parts", "pieces"),
    [
        (10, 3, [3, 3, 4]),
        (1, 2, [0, 1]),
        (7, 1, [7]),
        (0, 2, [0, 0]),
        (5, 5, [1, 1, 1, 1, 1]),
        (3, 4, [0, 0, 0, 3]),
        (11, 4, [2, 2, 2, 5]),
    ],
)
def test_ragged_bounds_examples(count, parts, pieces):
    bounds = ragged_bounds(count, parts)
    assert bounds[0] == 0 and bounds[-1] == count
    assert _pieces(bounds) == pieces


def test_ragged_bounds_invariants():
    for count in range(0, 40):
        for parts in range(1, 12):
            bounds = ragged_bounds(count, parts)
            pieces = _pieces(bounds)
            assert len(bounds) == parts + 1
            assert bounds[0] == 0 and bounds[-1] == count
            # parts - 1 pieces of count // parts, the remainder on the last
            assert pieces[:-1] == [count // parts] * (parts - 1)
            assert pieces[-1] == count // parts + count % parts


# --- gather_groups (TensorFlow's group_device_names) -----------------------------------


@pytest.mark.parametrize(
    ("members", "size", "groups"),
    [
        (3, 2, [[0, 2], [1, 0]]),
        (2, 2, [[0, 1]]),
        (2, 1, [[0], [1]]),
        (1, 1, [[0]]),
        (4, 2, [[0, 2], [1, 3]]),
        (4, 4, [[0, 1, 2, 3]]),
        (4, 3, [[0, 2, 0], [1, 3, 1]]),  # TF reuses members when the groups wrap around
        (5, 2, [[0, 3], [1, 4], [2, 0]]),
    ],
)
def test_gather_groups_examples(members, size, groups):
    assert gather_groups(members, size) == groups


def _tf_group_device_names(devices: list, group_size: int) -> list[list]:
    """TensorFlow's ``group_device_names`` (all_reduce/python/all_reduce.py), verbatim logic."""
    num_devices = len(devices)
    if group_size > num_devices:
        raise ValueError("only %d devices, but group_size=%d" % (num_devices, group_size))
    num_groups = num_devices // group_size + (1 if (num_devices % group_size != 0) else 0)
    groups: list[list] = [[] for _ in range(num_groups)]
    for i in range(num_groups * group_size):
        groups[i % num_groups].append(devices[i % num_devices])
    return groups


def test_gather_groups_matches_tensorflow():
    for members in range(1, 13):
        for size in range(1, members + 1):
            groups = gather_groups(members, size)
            assert groups == _tf_group_device_names(list(range(members)), size)
            assert len(groups) == -(-members // size)
            assert all(len(g) == size for g in groups)
            # every member serves in some group
            assert set().union(*map(set, groups)) == set(range(members))


@pytest.mark.parametrize(("members", "size"), [(2, 3), (1, 2), (3, 0), (3, -1), (0, 1), (0, 0)])
def test_gather_groups_rejects_bad_sizes(members, size):
    with pytest.raises(ValueError, match=rf"group size {size} must be between 1 and the "
                                         rf"{members} available members"):
        gather_groups(members, size)


@pytest.mark.parametrize("lo, hi, most, expected", [
    (0, 10, 4, [(0, 3), (3, 6), (6, 10)]),  # the fewest pieces, near-equal
    (5, 9, 4, [(5, 9)]),  # fits: one piece
    (7, 7, 4, [(7, 7)]),  # empty: one empty piece
    (0, 3, 1, [(0, 1), (1, 2), (2, 3)]),
    (0, 3, 0, [(0, 1), (1, 2), (2, 3)]),  # (at least one element a piece)
])
def test_capped_examples(lo, hi, most, expected):
    assert capped(lo, hi, most) == expected


def test_capped_invariants():
    for lo, hi, most in [(0, 1001, 7), (13, 4000, 1000), (0, 1 << 20, 1 << 18)]:
        pieces = capped(lo, hi, most)
        assert pieces[0][0] == lo and pieces[-1][1] == hi
        assert all(b == c for (_, b), (c, _) in zip(pieces, pieces[1:]))
        assert all(0 < b - a <= most for a, b in pieces)
        assert len(pieces) == -(-(hi - lo) // most)
