"""``import mpistrat`` and the MPI-free CLI commands never initialise MPI nor import CuPy.

Each check runs in a fresh interpreter (``sys.executable``), since this pytest process
may already have imported ``mpi4py.MPI`` (``test_cli.py`` runs ``mpistrat info``).

A stand-in ``cupy`` package is put first on ``sys.path`` in the child: it records that
it was imported and then fails like a missing CuPy, so the test proves that nothing
*tries* to import CuPy even on machines where CuPy is not installed (and never loads a
real CuPy where it is). ``importlib.util.find_spec("cupy")`` does not execute it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from mpistrat.cli import cli

_SENTINEL_CUPY = """\
import sys
sys._mpistrat_test_cupy_imported = True
raise ImportError("stand-in cupy of test_no_mpi_init: importing CuPy was not expected")
"""

_REPORT = """
import json as _json, sys as _sys
print("@@REPORT@@" + _json.dumps({
    "mpi4py.MPI": "mpi4py.MPI" in _sys.modules,
    "cupy_imported": getattr(_sys, "_mpistrat_test_cupy_imported", False),
    "cupy_in_modules": any(m == "cupy" or m.startswith("cupy.") for m in _sys.modules),
}))
"""


@pytest.fixture(scope="module")
def sentinel_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("sentinel")
    (root / "cupy").mkdir()
    (root / "cupy" / "__init__.py").write_text(_SENTINEL_CUPY)
    return root


def _run_child(code: str, sentinel_path) -> tuple[dict, subprocess.CompletedProcess]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(sentinel_path)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    env.pop("MPISTRAT_RANKS_PER_NODE", None)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code) + _REPORT],
        capture_output=True, text=True, timeout=60, env=env,
    )
    assert proc.returncode == 0, f"child failed:\n{proc.stdout}\n{proc.stderr}"
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@REPORT@@")]
    return json.loads(line[len("@@REPORT@@"):]), proc


def test_sentinel_cupy_is_seen(sentinel_path):
    """The stand-in works: an explicit ``import cupy`` in the child is detected."""
    report, _ = _run_child(
        """
        try:
            import cupy
        except ImportError:
            pass
        """,
        sentinel_path,
    )
    assert report["cupy_imported"] is True


def test_mpi_detection_works(sentinel_path):
    """The check can see MPI being initialised (so a pass below means something)."""
    report, _ = _run_child("from mpi4py import MPI", sentinel_path)
    assert report["mpi4py.MPI"] is True


def test_import_mpistrat(sentinel_path):
    report, _ = _run_child(
        """
        import mpistrat, mpistrat.spec, mpistrat.layout, mpistrat.algorithms, mpistrat.cli
        assert mpistrat.__version__
        """,
        sentinel_path,
    )
    assert report == {"mpi4py.MPI": False, "cupy_imported": False, "cupy_in_modules": False}


_CLI_ARGS = [
    ["--help"],
    ["--version"],
    ["validate", "xring"],
    ["validate", "xring", "--workers", "2", "--json"],
    ["validate", "nccl#2:1K:pscpu/pscpu#2", "--workers", "4", "--gpus-per-worker", "2",
     "--nodes", "2"],
    ["info", "--help"],
] + [[name, "--help"] for name in sorted(cli.commands) if name != "info"]


@pytest.mark.parametrize("args", _CLI_ARGS, ids=" ".join)
def test_cli_in_process_does_not_initialise_mpi(args, sentinel_path):
    report, proc = _run_child(
        f"""
        import sys
        from mpistrat.cli import cli
        try:
            rv = cli.main(args={args!r}, prog_name="mpistrat", standalone_mode=False)
        except SystemExit as exc:
            rv = exc.code
        assert rv in (None, 0), f"exit status {{rv!r}}"
        """,
        sentinel_path,
    )
    assert proc.stdout.strip() != "", "the command printed nothing"
    assert report == {"mpi4py.MPI": False, "cupy_imported": False, "cupy_in_modules": False}
