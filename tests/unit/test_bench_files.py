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


SWEEP_META = {**META, "mpistrat": "0", "options": {
    **META["options"], "size_range": "64 B .. 4 MiB (x1024)", "warmup": 1, "iters": 3,
    "check": "one iteration per point", "entries": ["native", "rechd"]}}

FIT = {"label": "rechd", "alg": "rechd", "shards": 1, "alpha_in_s": 1e-5,
       "beta_in_s_per_byte": 1e-10, "alpha_net_s": 1e-5, "beta_net_s_per_byte": 1e-10}


def _set(path: str, value):
    """A change to a valid document: ``value`` put at ``path`` (``a.b.0.c``; ``...``
    deletes the field)."""
    def change(document):
        *parents, last = path.split(".")
        node = document
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if value is ...:
            del node[int(last) if isinstance(node, list) else last]
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return change


MALFORMED = [
    # (change, what the message names)
    (_set("results.0.samples", ...), "results[0].samples is missing"),
    (_set("results.1.label", ...), "results[1].label is missing"),
    (_set("results", "x"), "results must be a list, got 'x'"),
    (_set("results.1", 3), "results[1] must be an object, got 3"),
    (_set("results.1.samples", []), "results[1].samples must be a list of at least 1 item"),
    (_set("results.0.samples", [1e-5, "x"]), "results[0].samples[1] must be a finite number"),
    (_set("results.0.samples", [-1.0]), "results[0].samples[0] must be a finite number >= 0"),
    (_set("results.0.shards", "2"), "results[0].shards must be an integer >= 1, got '2'"),
    (_set("results.0.nbytes", True), "results[0].nbytes must be an integer >= 0, got True"),
    (_set("results.0.alg", 5), "results[0].alg must be a string or null, got 5"),
    (_set("results.0.per_rank_median", None), "results[0].per_rank_median must be a list"),
    (_set("meta", []), "meta must be an object, got []"),
    (_set("meta.options", "x"), "meta.options must be an object, got 'x'"),
    (_set("meta.options.entries", ...), "meta.options.entries is missing"),
    (_set("meta.options.entries", "native"), "meta.options.entries must be a list"),
    (_set("meta.mpistrat", ...), "meta.mpistrat is missing"),
    (_set("meta.hosts", ["vm", 2]), "meta.hosts[1] must be a string, got 2"),
    (_set("meta.ranks", "2"), "meta.ranks must be an integer >= 1, got '2'"),
    (_set("meta.nodes", 3), "meta.nodes must be at most meta.ranks (2), got 3"),
    (_set("meta.mpi_env", ["A=1"]), "meta.mpi_env must be an object"),
    (_set("meta.host_layout", {"count": 1, "names": ["vm"]}),
     "meta.host_layout.ranks_per_host is missing"),
    (_set("meta.network", {"transport": "tcp"}), "meta.network.transport must be an object"),
    (_set("meta.virtual_ranks_per_node", 0), "meta.virtual_ranks_per_node must be an integer"),
    (_set("runs", []), "runs must be an object or null, got []"),
    (_set("runs", {"x": {}}), "runs key 'x' must be a byte count"),
    (_set("runs", {"64": 5}), "runs.64 must be an object, got 5"),
    (_set("cost_model", "x"), "cost_model must be an object or null, got 'x'"),
    (_set("cost_model.fits.0.alpha_in_s", ...), "cost_model.fits[0].alpha_in_s is missing"),
    (_set("cost_model.fits.0.shards", 0), "cost_model.fits[0].shards must be an integer >= 1"),
    (_set("cost_model.layouts.0.host_of_rank", []),
     "cost_model.layouts[0].host_of_rank must be a list of at least 1 item"),
]


@pytest.mark.parametrize("change, naming", MALFORMED, ids=[n for _, n in MALFORMED])
def test_read_json_names_the_malformed_field(tmp_path, change, naming):
    """A damaged or hand-edited result file is one ValueError that names the bad field and
    says what it should hold, never a KeyError or AttributeError in an analysis."""
    path = tmp_path / "sweep.json"
    model = {"model": "two-level alpha-beta", "fits": [FIT], "skipped": [],
             "layouts": [{"name": "", "host_of_rank": [0, 0], "node_of_rank": None}]}
    files.write_json(path, SWEEP_META, POINTS, complete=True,
                     extra={"runs": {"64": {"iters": 3}}, "cost_model": model})
    files.read_json(path)  # valid as written
    document = json.loads(path.read_text())
    change(document)
    path.write_text(json.dumps(document))
    with pytest.raises(ValueError) as info:
        files.read_json(path)
    message = str(info.value)
    assert message.startswith(f"{path}: {naming}") and "\n" not in message, message
    assert "mpistrat bench --json" in message


def test_read_json_unreadable_files_are_value_errors(tmp_path):
    """A missing file, a number Python will not convert, nesting deeper than the parser
    recurses: one ValueError naming the file, like other files that are no result."""
    with pytest.raises(ValueError, match=r"nothere\.json: cannot read it \(No such file"):
        files.read_json(tmp_path / "nothere.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "mpistrat-bench/1", "results": [' + "1" * 5000 + "]}")
    with pytest.raises(ValueError, match=r"bad\.json is not JSON \(ValueError: Exceeds"):
        files.read_json(bad)
    bad.write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(ValueError, match=r"bad\.json is not JSON \(RecursionError"):
        files.read_json(bad)


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
    # not text, or endless: a one-line SpecError, not a UnicodeDecodeError or a hang
    binary = tmp_path / "binary.spec"
    binary.write_bytes(b"xring\xff\xfe\n")
    with pytest.raises(SpecError, match="binary.spec' is not UTF-8 text"):
        read_spec_file(binary)
    with pytest.raises(SpecError, match="is larger than a spec file"):
        read_spec_file("/dev/zero")


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
