"""Tests of the ``mpistrat`` command line (click's CliRunner, in process).

Everything here except :func:`test_info_json_singleton` runs without MPI; that test
initialises MPI in this process as a singleton world of size 1 (no mpiexec). That the
other commands do not initialise MPI is proved in a fresh interpreter by
``test_no_mpi_init.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata

import pytest
from click.testing import CliRunner

import mpistrat
from mpistrat import algorithms
from mpistrat.cli import cli, main

SUBCOMMANDS = sorted(cli.commands)
NDASH = "\u2013"
INF = "\u221e"


def run(*args: str):
    """Invoke the CLI in process; return the click Result (stdout/stderr kept apart)."""
    return CliRunner().invoke(cli, list(args), prog_name="mpistrat")


def _no_traceback(result) -> None:
    """A usage error or a clean exit, never an unexpected Python exception."""
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"unexpected exception: {result.exception!r}\n{result.output}")


# ------------------------------------------------------------------ --version / --help


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version(flag):
    result = run(flag)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == f"mpistrat, version {mpistrat.__version__}"


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_top_level_help_lists_every_subcommand(flag):
    result = run(flag)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("Usage: mpistrat [OPTIONS] COMMAND [ARGS]...")
    assert "mpistrat validate 'nccl#2:1K:pscpu/pscpu#2'" in result.stdout
    for name in SUBCOMMANDS:
        assert name in result.stdout


def test_there_are_subcommands():
    # Guards the parametrisation below against an empty list.
    assert {"validate", "info"} <= set(SUBCOMMANDS)


@pytest.mark.parametrize("name", SUBCOMMANDS)
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_subcommand_help(name, flag):
    result = run(name, flag)
    _no_traceback(result)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"Usage: mpistrat {name} ")
    help_line = cli.commands[name].get_short_help_str(limit=200)
    assert help_line and help_line in result.stdout.replace("\n", " ").replace("  ", " ")


def test_validate_help_shows_spec_forms_unwrapped():
    result = run("validate", "--help")
    assert result.exit_code == 0
    # \b blocks keep the three forms on their own lines.
    assert "  xring " in result.stdout
    assert "  nccl#2:1K:pscpu/pscpu#2 " in result.stdout
    assert "  nccl:2:1024,pscpu/pscpu:2:-1 " in result.stdout
    for option in ("--json", "--workers", "--gpus-per-worker", "--local-replicas", "--nodes"):
        assert option in result.stdout


def test_main_uses_mpistrat_as_prog_name(capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(["--version"])
    assert excinfo.value.code == 0
    assert capsys.readouterr().out.strip() == f"mpistrat, version {mpistrat.__version__}"


def test_python_dash_m_version():
    proc = subprocess.run(
        [sys.executable, "-m", "mpistrat", "--version"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"mpistrat, version {mpistrat.__version__}"


def test_python_dash_m_help_names_mpistrat():
    proc = subprocess.run(
        [sys.executable, "-m", "mpistrat", "--help"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Usage: mpistrat ")


def test_console_script_entry_point():
    try:
        scripts = metadata.distribution("mpistrat").entry_points
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a bare tree
        pytest.skip("mpistrat is not installed")
    (script,) = [ep for ep in scripts if ep.group == "console_scripts" and ep.name == "mpistrat"]
    assert script.value == "mpistrat.cli:main"
    assert script.load() is main


# ------------------------------------------------------------------ validate: the plan


def _rows(stdout: str) -> list[list[str]]:
    """The table rows of ``validate``'s human output, split on runs of 2+ spaces."""
    lines = stdout.splitlines()
    rule = next(i for i, line in enumerate(lines) if line.strip().startswith("-  -"))
    rows = []
    for line in lines[rule + 1:]:
        if not line.strip():
            break
        rows.append([cell.strip() for cell in line.strip().split("  ") if cell.strip()])
    return rows


def test_validate_two_entry_plan():
    result = run("validate", "nccl#2:1K:pscpu/pscpu#2")
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    out = result.stdout
    assert "all-reduce spec nccl#2:1K:pscpu/pscpu#2" in out
    assert "comma form: nccl:2:1024,pscpu/pscpu:2:-1" in out
    header = [line for line in out.splitlines() if line.strip().startswith("#")]
    assert header and header[0].split() == ["#", "bytes", "algorithm", "shards", "hierarchical"]
    assert _rows(out) == [
        ["0", f"0 B {NDASH} 1 KiB", "nccl", "2 (ignored)", "no"],
        ["1", f"1 KiB {NDASH} {INF}", "pscpu/pscpu", "2 gather ranks",
         "yes: pscpu in node, pscpu across nodes"],
    ]
    # No layout given: no topology check is reported.
    assert "Checked for" not in out


@pytest.mark.parametrize(
    ("spec", "rows"),
    [
        ("xring", [["0", f"0 B {NDASH} {INF}", "xring", "1 pipeline", "no"]]),
        ("xring#3", [["0", f"0 B {NDASH} {INF}", "xring", "3 pipelines", "no"]]),
        ("rechd", [["0", f"0 B {NDASH} {INF}", "rechd", "1", "no"]]),
        ("pscpu#1", [["0", f"0 B {NDASH} {INF}", "pscpu", "1 gather rank", "no"]]),
        ("nccl/xring#2", [["0", f"0 B {NDASH} {INF}", "nccl/xring", "2 pipelines",
                           "yes: nccl in node, xring across nodes"]]),
        # The comma form gives the same plan as the '#' form.
        ("pscpu:2:1024,xring", [
            ["0", f"0 B {NDASH} 1 KiB", "pscpu", "2 gather ranks", "no"],
            ["1", f"1 KiB {NDASH} {INF}", "xring", "1 pipeline", "no"],
        ]),
        ("native:1536:rechd:4M:xring#2", [
            ["0", f"0 B {NDASH} 1536 B", "native", "1", "no"],
            ["1", f"1536 B {NDASH} 4 MiB", "rechd", "1", "no"],
            ["2", f"4 MiB {NDASH} {INF}", "xring", "2 pipelines", "no"],
        ]),
    ],
)
def test_validate_plan_rows(spec, rows):
    result = run("validate", spec)
    assert result.exit_code == 0, result.output
    assert _rows(result.stdout) == rows


def test_validate_normalises_the_spec():
    # The comma form is printed back in the '#' form and vice versa.
    result = run("validate", " pscpu:2:1024 , xring:1:-1 ")
    assert result.exit_code == 0, result.output
    assert "all-reduce spec pscpu#2:1K:xring " in result.stdout
    assert "comma form: pscpu:2:1024,xring:1:-1" in result.stdout


ENTRY_KEYS = {"algorithm", "shards", "min_bytes", "max_bytes", "hierarchical", "range"}


def test_validate_json():
    result = run("validate", "nccl#2:1K:pscpu/pscpu#2", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["spec"] == "nccl#2:1K:pscpu/pscpu#2"
    assert data["comma_form"] == "nccl:2:1024,pscpu/pscpu:2:-1"
    assert data["layout"] is None
    assert data["findings"] == []
    assert data["ok"] is True
    first, second = data["entries"]
    assert ENTRY_KEYS <= set(first) and ENTRY_KEYS <= set(second)
    assert {k: first[k] for k in ENTRY_KEYS} == {
        "algorithm": "nccl", "shards": 2, "min_bytes": 0, "max_bytes": 1024,
        "hierarchical": False, "range": f"0 B {NDASH} 1 KiB",
    }
    assert {k: second[k] for k in ENTRY_KEYS} == {
        "algorithm": "pscpu/pscpu", "shards": 2, "min_bytes": 1025, "max_bytes": None,
        "hierarchical": True, "range": f"1 KiB {NDASH} {INF}",
    }
    assert second["intra"] == second["inter"] == "pscpu"


@pytest.mark.parametrize("spec", ["xring", "nccl#2:1K:pscpu/pscpu#2", "pscpu:2:1024,xring",
                                  "native:1536:rechd:4M:xring#2"])
def test_validate_json_matches_text_and_round_trips(spec):
    text = run("validate", spec)
    data = json.loads(run("validate", spec, "--json").stdout)
    # The JSON and the table describe the same plan.
    assert [[str(e["index"]), e["range"], e["algorithm"]] for e in data["entries"]] == [
        row[:3] for row in _rows(text.stdout)
    ]
    # Both printed forms parse back to the same plan.
    for form in (data["spec"], data["comma_form"]):
        again = json.loads(run("validate", form, "--json").stdout)
        assert again["entries"] == data["entries"]
        assert again["spec"] == data["spec"]


# ------------------------------------------------------------------ validate: bad specs


def test_validate_unknown_algorithm_lists_every_valid_name():
    result = run("validate", "bogus")
    _no_traceback(result)
    assert result.exit_code == 2
    assert "Usage: mpistrat validate" in result.stderr
    assert "bogus" in result.stderr
    names = algorithms.names()
    assert len(names) >= 10
    for name in names:
        assert name in result.stderr
    assert result.stdout == ""


def test_validate_unknown_algorithm_suggests_a_close_name():
    result = run("validate", "xrin")
    assert result.exit_code == 2
    assert "did you mean 'xring'" in result.stderr


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "empty all-reduce spec"),
        ("   ", "empty all-reduce spec"),
        ("xring#0", "shards must be an integer >= 1, got 0"),
        ("pscpu:0:-1", "shards must be an integer >= 1, got 0"),
        ("xring#", "'#' must be followed by the number of shards"),
        ("xring:2K:pscpu:1K:rechd", "limits must strictly increase"),
        ("xring:1K:pscpu:1K:rechd", "limits must strictly increase"),
        ("xring:1X:pscpu", "byte count '1X' is not a whole number of bytes"),
        ("xring:1KX:pscpu", "is not a whole number of bytes"),
        ("xring:-1", "ends with ':-1'"),
        ("xring:1K", "is not well formed"),
        ("xring,,pscpu", "empty entry in the comma form"),
        ("xring:1:-1,pscpu:1:2048", "limit -1"),
        ("pscpu#2,xring", "'#shards' belongs to the other form"),
        ("NCCL", "unknown all-reduce algorithm 'NCCL'"),
    ],
)
def test_validate_spec_errors_are_usage_errors(spec, message):
    result = run("validate", spec)
    _no_traceback(result)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert "Usage: mpistrat validate [OPTIONS] SPEC" in result.stderr
    assert "Invalid value for SPEC" in result.stderr
    assert message in result.stderr


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (f"xring:{'9' * 5000}:pscpu", "(5000 characters) is too large: at most "
                                      "9223372036854775807 bytes"),
        (f"xring#{'9' * 5000}", "shards must be an integer from 1 to 1024"),
        ("xring#100000000000", "shards must be at most 1024, got 100000000000"),
        ("pscpu:1025:-1", "shards must be at most 1024, got 1025"),
    ],
    ids=["limit-5000-digits", "shards-5000-digits", "shards-1e11", "shards-1025"],
)
def test_validate_huge_numbers_are_one_line_usage_errors(spec, message):
    """A limit or a shard count past its bound (also one of more digits than Python
    converts) is a one-line usage error, exit status 2, not a traceback."""
    result = run("validate", spec)
    _no_traceback(result)
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert len(errors[0]) < 400, errors[0]


@pytest.mark.parametrize("extra", [[], ["--json"], ["--workers", "4"]])
def test_validate_spec_error_wins_over_other_options(extra):
    result = run("validate", "xring#0", *extra)
    assert result.exit_code == 2
    assert result.stdout == ""
    assert "shards must be an integer >= 1" in result.stderr


def test_validate_without_spec():
    result = run("validate")
    assert result.exit_code == 2
    assert "Missing argument 'SPEC'" in result.stderr


# ------------------------------------------------------------------ validate: layouts


@pytest.mark.parametrize(
    ("argv", "exit_code", "message"),
    [
        # errors
        (["nccl", "--workers", "2"], 2, "entry 0 'nccl' needs GPUs"),
        (["nccl", "--workers", "2", "--gpus-per-worker", "0"], 2, "needs GPUs"),
        (["nccl:1K:xring", "-w", "2", "--local-replicas", "2"], 2, "needs GPUs"),
        (["psgpu", "--workers", "2"], 2, "entry 0 'psgpu' needs GPUs"),
        (["pscpu#5", "--workers", "4"], 2,
         "entry 0 'pscpu' has shards=5 but its gather pool (ranks) has only 4"),
        (["pscpu/pscpu#3", "--workers", "4", "--nodes", "2"], 2,
         "'pscpu/pscpu' has shards=3 but its gather pool (node leaders) has only 2"),
        (["nccl/pscpu#3", "-w", "4", "-g", "2", "--nodes", "2"], 2,
         "'nccl/pscpu' has shards=3 but its gather pool (node leaders) has only 2"),
        (["psgpu#5", "--workers", "2", "--gpus-per-worker", "2"], 2,
         "'psgpu' has shards=5 but its gather pool (GPUs) has only 4"),
        # warnings
        (["nccl#2", "--workers", "2", "--gpus-per-worker", "2"], 0,
         "warning: entry 0 'nccl' ignores shards (got 2)"),
        (["pscpu/pscpu#3", "--workers", "4", "--nodes", "1"], 0,
         "warning: entry 0 'pscpu/pscpu' is hierarchical but the job has one node"),
        (["xring", "--workers", "1"], 0, "warning: the job has a single replica"),
        # clean
        (["xring", "--workers", "2"], 0, "0 error(s), 0 warning(s)"),
        (["pscpu#4", "--workers", "4"], 0, "0 error(s), 0 warning(s)"),
        (["psgpu#4", "--workers", "2", "--gpus-per-worker", "2"], 0,
         "0 error(s), 0 warning(s)"),
        (["pscpu/pscpu#2", "--workers", "4", "--nodes", "2"], 0, "0 error(s), 0 warning(s)"),
        (["xring", "--workers", "1", "--local-replicas", "2"], 0, "0 error(s), 0 warning(s)"),
    ],
)
def test_validate_layout_checks(argv, exit_code, message):
    result = run("validate", *argv)
    _no_traceback(result)
    assert result.exit_code == exit_code, result.output
    # The plan is printed either way.
    assert "all-reduce spec " in result.stdout
    assert "Checked for " in result.stdout
    if exit_code:
        assert message in result.stderr  # errors go to stderr
        assert "1 error(s)" in result.stdout
    else:
        assert message in result.stdout  # warnings and the summary go to stdout
        assert result.stderr == ""


def test_validate_layout_description():
    result = run("validate", "nccl", "--workers", "4", "--gpus-per-worker", "2", "--nodes", "2")
    assert result.exit_code == 0, result.output
    assert "Checked for 4 worker(s) x 2 GPUs on 2 node(s): 0 error(s), 0 warning(s)." \
        in result.stdout
    # --nodes defaults to one worker per node.
    result = run("validate", "xring", "--workers", "3", "--local-replicas", "2")
    assert "Checked for 3 worker(s) x 2 CPU replicas on 3 node(s)" in result.stdout


def test_validate_reports_every_finding():
    result = run("validate", "nccl#2:1K:pscpu#9", "--workers", "4")
    assert result.exit_code == 2
    assert "2 error(s), 1 warning(s)" in result.stdout
    assert "error: entry 0 'nccl' needs GPUs" in result.stderr
    assert "error: entry 1 'pscpu' has shards=9" in result.stderr
    assert "warning: entry 0 'nccl' ignores shards" in result.stdout


def test_validate_json_with_error_findings():
    result = run("validate", "pscpu/pscpu#3", "--workers", "4", "--nodes", "2", "--json")
    assert result.exit_code == 2
    data = json.loads(result.stdout)
    assert data["ok"] is False
    assert data["layout"] == {"workers": 4, "devices_per_worker": 1, "gpus": False, "nodes": 2}
    (finding,) = data["findings"]
    assert finding["level"] == "error"
    assert finding["entry"] == 0
    assert "gather pool (node leaders) has only 2" in finding["message"]


def test_validate_json_with_warning_findings():
    result = run("validate", "nccl#2:1K:xring", "-w", "2", "-g", "2", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["ok"] is True
    assert data["layout"] == {"workers": 2, "devices_per_worker": 2, "gpus": True, "nodes": 2}
    assert data["findings"] == [{
        "level": "warning", "entry": 0,
        "message": "entry 0 'nccl' ignores shards (got 2); write it without '#2'",
    }]
    assert result.stderr == ""


def test_validate_json_mixed_findings_errors_first():
    result = run("validate", "nccl#2:1K:pscpu#9", "--workers", "4", "--json")
    assert result.exit_code == 2
    data = json.loads(result.stdout)
    assert data["ok"] is False
    assert [(f["level"], f["entry"]) for f in data["findings"]] == [
        ("error", 0), ("error", 1), ("warning", 0),
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gpus-per-worker", "2"], "--gpus-per-worker needs --workers"),
        (["-g", "0"], "--gpus-per-worker needs --workers"),
        (["--local-replicas", "2"], "--local-replicas needs --workers"),
        (["--nodes", "2"], "--nodes needs --workers"),
        (["--workers", "2", "--gpus-per-worker", "2", "--local-replicas", "2"],
         "--gpus-per-worker and --local-replicas exclude each other"),
        (["--workers", "2", "--nodes", "3"], "nodes (3) cannot exceed workers (2)"),
        (["--workers", "0"], "0 is not in the range x>=1"),
        (["--workers", "two"], "'two' is not a valid integer"),
        (["--workers", "2", "--nodes", "0"], "0 is not in the range x>=1"),
        (["--workers", "2", "--gpus-per-worker", "-1"], "-1 is not in the range x>=0"),
        (["--workers", "2", "--local-replicas", "0"], "0 is not in the range x>=1"),
    ],
)
@pytest.mark.parametrize("as_json", [False, True])
def test_validate_option_misuse(argv, message, as_json):
    result = run("validate", "xring", *argv, *(["--json"] if as_json else []))
    _no_traceback(result)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert "Usage: mpistrat validate" in result.stderr
    assert message in result.stderr


# ------------------------------------------------------------------ info (singleton MPI)


def test_info_json_singleton(monkeypatch):
    """``mpistrat info --json`` without a launcher: MPI starts as a world of size 1."""
    monkeypatch.delenv("MPISTRAT_RANKS_PER_NODE", raising=False)
    result = run("info", "--json")
    _no_traceback(result)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["mpistrat"] == mpistrat.__version__
    assert data["world_size"] == 1
    assert data["nodes"] == 1
    assert data["ranks_per_node"] == [1]
    (rank,) = data["ranks"]
    assert rank["rank"] == 0
    assert rank["pid"] == os.getpid()
    assert rank["local_rank"] == 0 and rank["local_size"] == 1
    assert rank["leader"] is True
    assert data["warnings"] == []
