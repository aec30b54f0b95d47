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


@pytest.mark.parametrize(("value", "expected"), [
    ("1", True), ("on", True), (" TRUE ", True), ("yes", True),
    ("0", False), ("off", False), ("False", False), ("no", False),
    ("auto", None), ("AUTO", None), ("", None),
])
def test_cuda_aware_mpi(value, expected):
    assert Settings.from_env({"MPISTRAT_CUDA_AWARE_MPI": value}).cuda_aware_mpi is expected


def test_cuda_aware_mpi_default_detects():
    assert Settings.from_env({}).cuda_aware_mpi is None


def test_cuda_aware_mpi_bad_value_warns():
    with pytest.warns(RuntimeWarning, match=r"MPISTRAT_CUDA_AWARE_MPI='maybe'.*1, 0 or auto"):
        assert Settings.from_env({"MPISTRAT_CUDA_AWARE_MPI": "maybe"}).cuda_aware_mpi is None
