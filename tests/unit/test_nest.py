"""Nests: dicts are walked in sorted key order, so ranks that build the same dict in
different orders flatten it the same way (what all_reduce of a dict relies on)."""

from __future__ import annotations

from mpistrat._nest import flatten, map_structure, pack_sequence_as


def test_dict_leaves_follow_sorted_keys_whatever_the_insertion_order():
    assert flatten({"b": 2, "a": 1}) == flatten({"a": 1, "b": 2}) == [1, 2]


def test_pack_sequence_as_round_trips_nests():
    nest = {"w": [1, (2, 3)], "b": 4}
    assert pack_sequence_as(nest, flatten(nest)) == nest
    assert map_structure(lambda x: x * 10, nest) == {"b": 40, "w": [10, (20, 30)]}


def test_unsortable_keys_keep_insertion_order():
    assert flatten({1: "x", "a": "y"}) == ["x", "y"]
