"""``mpistrat bench`` options and offline analysis (CliRunner, in process, no MPI).

Runs under mpiexec are in ``tests/launch/test_bench_launch.py``. That ``bench --help``
never initialises MPI is checked by ``test_no_mpi_init.py`` (it covers every command).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from mpistrat.bench import files
from mpistrat.bench.recommend import read_spec_file
from mpistrat.bench.results import Point
from mpistrat.cli import cli

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture(autouse=True)
def _stay_in_this_process(monkeypatch):
    """``bench`` restarts its process with malloc on huge pages before MPI starts; in
    process that would replace pytest (its output then goes to pytest's capture file)."""
    monkeypatch.setattr("mpistrat.launch.hugepages.restart_with_hugepages", lambda: None)


def run(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(cli, ["bench", *args], prog_name="mpistrat", env=env)


def test_help_names_the_nccl_tests_options():
    result = run("--help")
    assert result.exit_code == 0, result.output
    for option in ("-b, --minbytes", "-e, --maxbytes", "-f, --stepfactor", "-i, --stepbytes",
                   "-w, --warmup", "-n, --iters", "-c, --check", "-d, --dtype", "-o, --op",
                   "--algorithms", "--shards", "--spec", "--batch", "--recommend", "--save",
                   "--plot", "--json", "--csv", "--compare", "--transport", "--predict-ranks",
                   "-np, --np"):
        assert option in result.output, option


def test_help_says_compare_torch_measures_both_backends():
    result = run("--help")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())  # (click wraps the help)
    assert "torch.distributed over gloo and over the 'mpistrat' backend (torch-gloo, " \
           "torch-mpistrat)" in text, result.output


@pytest.mark.parametrize("args, message", [
    (["-b", "1M", "-e", "1K"], "below --minbytes"),
    (["-b", "1.5K"], "--minbytes must be a byte count"),
    (["-i", "0"], "--stepbytes must be a byte count"),
    (["-d", "floaty"], "unknown dtype 'floaty'"),
    (["-o", "mean", "-d", "int32"], "mean of integer dtype"),
    (["--num-packs", "1,2"], "--num-packs: used only with --batch"),
    (["--batch", "resnet50", "--algorithms", "xring"], "--batch does not use --algorithms"),
    (["--batch", "resnet50", "--spec", "xring", "--spec", "rechd"], "give --spec once"),
    (["--batch", "nosuch.json"], "'resnet50' or a JSON file"),
    (["--batch", "resnet50", "--compare", "torch", "--local-replicas", "2"],
     "--compare torch measures one buffer per rank"),
    (["--batch", "resnet50", "--compare", "horovod"], "'horovod' is not 'torch'"),
    (["--from-json", "x.json", "-n", "5"], "leave out --iters"),
    (["--mpiexec", "/bin/true"], "--mpiexec only applies with --np"),
    (["--spec", "@/nonexistent/allreduce.spec"], "cannot read spec file"),
    (["--shards", "0"], "--shards values must be >= 1"),
    (["--shards", "1,2000"], "--shards values must be at most 1024, got 2000"),
    (["-i", "1", "-e", "1G"], "--stepbytes 1 from 4 B to 1 GiB gives 1073741821 sizes, more "
                              "than the 4096 a sweep measures; give -i 262209 or more"),
    (["--mpi-env", "NOVALUE"], "KEY=VALUE"),
    (["--plugin", "mpistrat_no_such_plugin"], "--plugin mpistrat_no_such_plugin"),
    (["--tolerance", "-1"], "--tolerance"),
])
def test_usage_errors_come_before_mpi(args, message):
    result = run(*args)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_np_refuses_to_nest_inside_a_launcher():
    result = run("--np", "2", env={"PMI_SIZE": "2", "PMI_RANK": "0"})
    assert result.exit_code == 2
    assert "already running under MPICH Hydra / PMI with 2 ranks" in result.output


def test_only_rank_zero_prints_usage_errors():
    result = run("-b", "1M", "-e", "1K", env={"PMI_SIZE": "2", "PMI_RANK": "1"})
    assert result.exit_code == 2 and result.output == ""


# ------------------------------------------------------------------ --from-json


def _points() -> list[Point]:
    out = []
    sizes = [4, 256, 16 * KiB, MiB, 16 * MiB]
    times = {"native": [10e-6, 12e-6, 40e-6, 900e-6, 12e-3],
             "rechd": [8e-6, 9e-6, 38e-6, 800e-6, 9e-3],
             "xring#2": [25e-6, 26e-6, 45e-6, 700e-6, 6e-3]}
    for i, n in enumerate(sizes):
        for label, ts in times.items():
            alg, _, shards = label.partition("#")
            out.append(Point(n, n // 4, "float32", "sum", label, "algorithm", alg,
                             int(shards or 1), 2, (ts[i], ts[i] * 1.1, ts[i] * 0.95)))
    return out


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "sweep.json"
    meta = {"ranks": 2, "nodes": 1, "hosts": ["vm"], "mpi_library": "MPICH Version: 5.0.2",
            "mpistrat": "0", "date": "today", "argv": ["mpistrat", "bench"],
            "options": {"dtype": "float32", "op": "sum", "replicas_per_rank": 1,
                        "size_range": "4 B .. 16 MiB (x64)", "warmup": 1, "iters": 3,
                        "check": "one iteration per point",
                        "entries": ["native", "rechd", "xring#2"]}}
    files.write_json(path, meta, _points(), complete=True)
    return path


def test_from_json_recommends_models_and_writes_files(saved, tmp_path):
    spec_path, csv_path = tmp_path / "a.spec", tmp_path / "a.csv"
    md_path = tmp_path / "a.md"
    result = run("--from-json", str(saved), "--save", str(spec_path), "--model",
                 "--predict-ranks", "64", "--ranks-per-node", "8", "--csv", str(csv_path),
                 "--markdown", str(md_path))
    assert result.exit_code == 0, result.output
    out = result.output
    assert "# mpistrat bench 0: all-reduce, 2 rank(s)" in out
    assert "16777216" in out and "xring#2" in out
    assert "spec: rechd:128K:xring#2" in out
    assert "a_in(us)" in out and "a_net(us)" in out
    assert "Predicted time (us) at 64 ranks, 8 per host (8 hosts x 8)" in out
    assert str(read_spec_file(spec_path)) == "rechd:128K:xring#2"
    assert csv_path.read_text().count("\n") > 5 * 3 * 3
    assert "| 16 MiB |" in md_path.read_text()
    validate = CliRunner().invoke(cli, ["validate", f"{read_spec_file(spec_path)}",
                                        "--workers", "2"])
    assert validate.exit_code == 0, validate.output


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib is not installed")
def test_from_json_plots(saved, tmp_path):
    png = tmp_path / "sweep.png"
    result = run("--from-json", str(saved), "--plot", str(png))
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_plot_without_matplotlib_is_a_clear_error(saved, tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    result = run("--from-json", str(saved), "--plot", str(tmp_path / "x.png"))
    assert result.exit_code == 2
    assert "--plot needs matplotlib" in result.output and "pip install matplotlib" in result.output


def test_from_json_rejects_other_json(tmp_path):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"hello": 1}))
    result = run("--from-json", str(other))
    assert result.exit_code == 2 and "not an mpistrat bench result" in result.output


@pytest.mark.parametrize("option", ["--from-json", "--model-with", "--model-from"])
@pytest.mark.parametrize(("field", "value", "naming"), [
    ("results", [{"nbytes": 4}], "results[0].count is missing"),
    ("meta", {"options": {"size_range": "4 B .. 16 MiB"}}, "meta.options.replicas_per_rank "
                                                           "is missing"),
    ("meta", [], "meta must be an object, got []"),
    ("runs", "x", "runs must be an object or null, got 'x'"),
])
def test_malformed_saved_runs_are_one_line_usage_errors(saved, tmp_path, option, field, value,
                                                        naming):
    """A saved run with a missing or mistyped field exits with status 2 and one line that
    names the file and the field, whichever option reads it; not a traceback."""
    document = json.loads(saved.read_text())
    document[field] = value
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(document))
    args = ["--from-json", str(bad)] if option == "--from-json" else \
        ["--from-json", str(saved), option, str(bad), "--model"]
    result = run(*args)
    assert result.exit_code == 2, result.output
    assert not isinstance(result.exception, (KeyError, AttributeError, TypeError))
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    named = "" if option == "--from-json" else f"{option} "
    assert errors == [f"Error: {named}{bad}: {naming}; give a file written by mpistrat bench "
                      f"--json "
                      f"(or {'add' if 'missing' in naming else 'correct'} that field)"], \
        result.output


def test_from_json_of_a_missing_file_is_a_usage_error(tmp_path):
    result = run("--from-json", str(tmp_path / "nothere.json"))
    assert result.exit_code == 2, result.output
    assert "nothere.json: cannot read it (No such file or directory)" in result.output


def test_from_json_does_not_initialise_mpi(saved):
    code = textwrap.dedent(f"""
        import sys
        from mpistrat.cli import cli
        try:
            cli.main(args=["bench", "--from-json", {str(saved)!r}, "--recommend"],
                     prog_name="mpistrat", standalone_mode=False)
        except SystemExit:
            pass
        print("MPI" if "mpi4py.MPI" in sys.modules else "NO MPI")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env={**os.environ})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("NO MPI") and "spec: " in proc.stdout
