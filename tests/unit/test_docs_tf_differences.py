"""The tables "Where mpistrat differs from TensorFlow" list what mpistrat does where TF
2.21 does otherwise; each row checked here is also run, so the table says what the code
does (one process, one replica)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import mpistrat as ms

pytest.importorskip("mpi4py.MPI")

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _differences(name: str) -> list[str]:
    """The rows of the differences table of ``docs/<name>``."""
    text = (DOCS / name).read_text(encoding="utf-8")
    section = text.split("## Where mpistrat differs from TensorFlow", 1)[1].split("\n## ")[0]
    return [line for line in section.splitlines() if line.startswith("| ")]


def test_strategy_reduce_of_a_nest_with_an_axis_is_listed_and_is_what_mpistrat_does():
    rows = [r for r in _differences("strategies.md")
            if "strategy.reduce(op, nest, axis=...)" in r]
    assert len(rows) == 1 and "`TypeError` (TF 2.21)" in rows[0], rows
    assert "each leaf reduced along `axis`, the structure kept" in rows[0]
    kept = (DOCS / "strategies.md").read_text(encoding="utf-8").split(
        "## TensorFlow 2.21's behaviours kept")[1].split("\n## ")[0]
    assert "with `axis=None` and with an axis" not in kept  # (TF raises with an axis)
    out = ms.OneDeviceStrategy("/cpu:0").reduce(
        "SUM", {"a": np.arange(3.0), "b": (np.ones(2),)}, axis=0)
    assert set(out) == {"a", "b"} and isinstance(out["b"], tuple)
    assert out["a"] == 3.0 and out["b"][0] == 2.0


def test_reduce_of_python_numbers_is_listed_and_is_what_mpistrat_does():
    rows = [r for r in _differences("cross_device_ops.md") if "Python list of numbers" in r]
    assert len(rows) == 1, rows
    assert "float32 (int32 for integers)" in rows[0]
    assert "float64 (int64 for integers), in every `CrossDeviceOps` class" in rows[0]
    for ops in (ms.ReductionToOneDevice(), ms.MultiWorkerAllReduce(),
                ms.HierarchicalCopyAllReduce()):
        assert ops.reduce("SUM", [1.0, 2.0], destinations="/cpu:0").dtype == np.float64
        assert ops.reduce("SUM", [1, 2], destinations="/cpu:0").dtype == np.int64
        assert ops.reduce("SUM", 1.5, destinations="/cpu:0").dtype == np.float64
