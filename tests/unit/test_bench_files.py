"""``mpistrat bench`` result files, plots, spec files and batch shapes (pure: no MPI)."""

from __future__ import annotations

import csv
import importlib.util
import json

import pytest

from mpistrat.bench import files, plot
from mpistrat.bench.batch import load_shapes
from mpistrat.bench.recommend import (
    read_spec_file,
    recommend,
    resolve_spec,
    write_spec_file,
)
from mpistrat.errors import BackendUnavailable, SpecError, UnknownAlgorithmError

from test_bench_analysis import point, sweep

META = {"ranks": 2, "nodes": 1, "mpi_library": "MPICH Version: 5.0.2", "date": "today",
        "options": {"dtype": "float32", "op": "sum", "replicas_per_rank": 1},
        "hosts": ["vm"], "argv": ["mpistrat", "bench"]}

POINTS = sweep({"native": [1e-5, 2e-4, 3e-3], "rechd": [8e-6, 1.5e-4, 2e-3]},
               [64, 64 << 10, 4 << 20])


def test_json_round_trip(tmp_path):
    path = tmp_path / "out" / "sweep.json"
    files.write_json(path, META, POINTS, complete=True, extra={"recommendation": None})
    meta, points, document = files.read_json(path)
    assert meta == META and points == POINTS and document["complete"] is True
    record = document["results"][1]
    assert record["label"] == "rechd" and record["speedup_over_native"] == pytest.approx(1.25)
    assert not list(tmp_path.glob("out/.*.tmp"))  # written through a renamed temporary


def test_read_json_rejects_other_files(tmp_path):
    other = tmp_path / "x.json"
    other.write_text(json.dumps({"results": []}))
    with pytest.raises(ValueError, match="not an mpistrat bench result"):
        files.read_json(other)
    other.write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        files.read_json(other)


def test_csv_has_one_row_per_sample_and_the_metadata(tmp_path):
    path = tmp_path / "sweep.csv"
    files.write_csv(path, META, POINTS)
    lines = path.read_text().splitlines()
    comments = [ln for ln in lines if ln.startswith("#")]
    assert "# mpi_library: MPICH Version: 5.0.2" in comments
    rows = list(csv.DictReader(ln for ln in lines if not ln.startswith("#")))
    assert len(rows) == sum(len(p.samples) for p in POINTS)
    assert rows[0].keys() == set(files.CSV_FIELDS)
    assert {r["algorithm"] for r in rows} == {"native", "rechd"}
    assert float(rows[0]["time_s"]) == POINTS[0].samples[0]


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib is not installed")
def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "plots" / "sweep.png"
    plot.plot(POINTS + [point("corrupt", 64, 1e-6, wrong=2)], path, META)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(BackendUnavailable, match="pip install matplotlib"):
        plot.plot(POINTS, tmp_path / "x.png")


def test_spec_file_round_trip(tmp_path):
    rec = recommend(POINTS)
    path = tmp_path / "allreduce.spec"
    write_spec_file(path, rec, ["2 ranks on vm"])
    text = path.read_text()
    assert text.startswith("# mpistrat all-reduce spec") and "# 2 ranks on vm" in text
    assert text.splitlines()[-1] == str(rec.spec)
    assert read_spec_file(path) == rec.spec
    assert resolve_spec(f"@{path}") == rec.spec
    assert str(resolve_spec("xring#2:1K:rechd")) == "xring#2:1K:rechd"


def test_spec_file_errors(tmp_path):
    with pytest.raises(SpecError, match="cannot read spec file"):
        read_spec_file(tmp_path / "missing.spec")
    two = tmp_path / "two.spec"
    two.write_text("# c\nxring\nrechd\n")
    with pytest.raises(SpecError, match="exactly one spec line .* found 2"):
        read_spec_file(two)
    bad = tmp_path / "bad.spec"
    bad.write_text("xrng\n")
    with pytest.raises(UnknownAlgorithmError, match="bad.spec.*did you mean 'xring'"):
        resolve_spec(f"@{bad}")


def test_batch_shapes(tmp_path):
    name, shapes = load_shapes("resnet50")
    assert name == "resnet50" and len(shapes) == 161
    listed = tmp_path / "model.json"
    listed.write_text("[[3, 3], [10], []]")
    assert load_shapes(str(listed)) == ("model.json", ((3, 3), (10,), ()))
    listed.write_text(json.dumps({"shapes": [[4]]}))
    assert load_shapes(str(listed))[1] == ((4,),)
    for text, message in (("[]", "non-empty list"), ("[[1, -2]]", "shape 0"),
                          ("[1]", "shape 0"), ("{", "as JSON")):
        listed.write_text(text)
        with pytest.raises(ValueError, match=message):
            load_shapes(str(listed))
    with pytest.raises(ValueError, match="'resnet50' or a JSON file"):
        load_shapes(str(tmp_path / "nope.json"))
