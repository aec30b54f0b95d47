"""How algorithms cut a buffer into pieces (offsets in elements, any length, any count)."""

from __future__ import annotations

__all__ = ["even_bounds", "ragged_bounds", "gather_groups", "capped"]


def even_bounds(count: int, parts: int) -> list[int]:
    """``parts + 1`` offsets cutting ``count`` elements into near-equal contiguous pieces.

    The first ``count % parts`` pieces are one element longer; pieces may be empty when
    ``count < parts``. Used by the ring and halving-doubling, where balance matters.
    """
    base, extra = divmod(count, parts)
    bounds = [0]
    for index in range(parts):
        bounds.append(bounds[-1] + base + (1 if index < extra else 0))
    return bounds


def capped(lo: int, hi: int, most: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut into the fewest near-equal pieces of at most ``most`` elements
    (one piece, possibly empty, when it fits): how pipelined messages are cut, alike on
    both sides of an exchange."""
    count = max(1, -(-(hi - lo) // max(1, most)))
    cuts = [lo + (hi - lo) * i // count for i in range(count + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def ragged_bounds(count: int, parts: int) -> list[int]:
    """TensorFlow's ragged split for shuffles: ``parts - 1`` pieces of ``count // parts``
    elements and the remainder on the last piece (10 into 3 → 3, 3, 4; 1 into 2 → 0, 1)."""
    base = count // parts
    return [base * index for index in range(parts)] + [count]


def gather_groups(members: int, group_size: int) -> list[list[int]]:
    """TensorFlow's ``group_device_names`` over member indices ``0..members-1``.

    ``ceil(members / group_size)`` groups of exactly ``group_size`` members; member
    ``j mod members`` goes to group ``j mod n_groups`` for ``j < n_groups * group_size``,
    so when ``members`` is not a multiple some members serve two groups (3 members,
    groups of 2 → [[0, 2], [1, 0]]). Successive tensors use successive groups, which
    spreads the gather work.
    """
    if not 1 <= group_size <= members:
        raise ValueError(
            f"group size {group_size} must be between 1 and the {members} available members"
        )
    n_groups = -(-members // group_size)
    groups: list[list[int]] = [[] for _ in range(n_groups)]
    for j in range(n_groups * group_size):
        groups[j % n_groups].append(j % members)
    return groups
