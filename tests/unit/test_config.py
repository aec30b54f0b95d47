"""Settings from MPISTRAT_* environment variables."""

from __future__ import annotations

import pytest

from mpistrat.config import Settings


def test_defaults():
    assert Settings.from_env({}) == Settings(ranks_per_node=None)


def test_ranks_per_node():
    assert Settings.from_env({"MPISTRAT_RANKS_PER_NODE": " 2 "}).ranks_per_node == 2


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_bad_value_warns_and_falls_back(value):
    with pytest.warns(RuntimeWarning, match=rf"MPISTRAT_RANKS_PER_NODE='{value}'.*positive"):
        assert Settings.from_env({"MPISTRAT_RANKS_PER_NODE": value}).ranks_per_node is None
