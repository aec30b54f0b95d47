"""``mpistrat run`` under mpiexec and self-launched: the script runs as ``__main__`` on
every rank with its arguments, in the default strategy; output options; modules."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.launch

REPORT = textwrap.dedent("""\
    import json, os, sys
    import numpy as np
    import mpistrat
    from mpistrat.strategy import get_strategy
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    s = get_strategy()
    total = mpistrat.all_reduce(np.array([comm.rank + 1.0]), comm=comm)
    print("@@" + json.dumps({
        "rank": comm.rank, "size": comm.size, "argv": sys.argv, "name": __name__,
        "path0": sys.path[0], "strategy": type(s).__name__,
        "replicas": s.num_replicas_in_sync, "total": float(total[0]),
    }))
    print(f"second line of rank {comm.rank}")
    """)


def _records(stdout: str) -> list[dict]:
    found = []
    for line in stdout.splitlines():
        head, sep, tail = line.partition("@@")
        if sep:
            found.append({**json.loads(tail), "prefix": head})
    return sorted(found, key=lambda r: r["rank"])


def test_script_runs_on_every_rank_in_the_default_strategy(mpirun, mpistrat_cmd, tmp_path):
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    result = mpirun(2, [*mpistrat_cmd, "run", "--local-replicas", "2", "--tag-output",
                        str(script), "--epochs", "3", "-n", "5"], timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    records = _records(result.stdout)
    assert [r["rank"] for r in records] == [0, 1]
    for r in records:
        assert r["argv"] == [str(script), "--epochs", "3", "-n", "5"]
        assert r["name"] == "__main__" and r["path0"] == str(tmp_path)
        assert r["strategy"] == "MultiWorkerMirroredStrategy" and r["replicas"] == 4
        assert r["total"] == 3.0 and r["prefix"] == f"[{r['rank']}] "
    lines = result.stdout.splitlines()
    assert "[1] second line of rank 1" in lines and "[0] second line of rank 0" in lines


def test_self_launch_module_quiet_ranks_and_spec(tmp_path):
    """``mpistrat run -n 3 -m pkg.mod``: mpistrat starts mpiexec; only rank 0 prints; the
    module gets every argument after its name; the job's exit status comes back."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "mod.py").write_text(REPORT + textwrap.dedent("""\
        from mpistrat.strategy import get_strategy
        ops = get_strategy().extended.cross_device_ops
        print(f"spec {ops.spec} packs {ops.num_packs}" if comm.rank == 0 else "")
        raise SystemExit(int(sys.argv[-1]))
        """))
    result = subprocess.run(
        [sys.executable, "-m", "mpistrat", "run", "-n", "3", "--quiet-ranks",
         "--spec", "xring", "--num-packs", "2", "-m", "pkg.mod", "--lr", "0.1", "0"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    records = _records(result.stdout)
    assert [r["rank"] for r in records] == [0]  # --quiet-ranks
    assert records[0]["argv"][1:] == ["--lr", "0.1", "0"]
    assert records[0]["argv"][0].endswith("mod.py") and records[0]["size"] == 3
    assert records[0]["total"] == 6.0 and records[0]["path0"] == str(tmp_path)
    assert "spec xring packs 2" in result.stdout


def test_self_launch_passes_the_exit_status(tmp_path):
    script = tmp_path / "exit.py"
    script.write_text("import sys\nsys.exit(5)\n")
    result = subprocess.run(
        [sys.executable, "-m", "mpistrat", "run", "-n", "2", str(script)],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 5, result.stdout + result.stderr
    assert result.stderr.count("exited with status 5") == 1
    assert "[0-1] mpistrat run: " in result.stderr  # both ranks ended alike: one line


TUNABLES = textwrap.dedent("""\
    import json, os, sys
    from mpi4py import MPI
    print("@@" + json.dumps({"rank": MPI.COMM_WORLD.rank, "argv": sys.argv,
                             "tunables": os.environ.get("GLIBC_TUNABLES")}))
    """)


@pytest.mark.parametrize("setting", ["auto", "0"])
def test_ranks_restart_with_the_heap_on_huge_pages(mpirun, mpistrat_cmd, tmp_path, setting):
    """Where glibc and the kernel allow it, every rank runs the script with glibc's malloc
    on transparent huge pages (the same command line, restarted once before MPI starts);
    MPISTRAT_MALLOC_HUGEPAGES=0 keeps the process as started."""
    from mpistrat.launch.hugepages import malloc_hugepages_env

    env = {"MPISTRAT_MALLOC_HUGEPAGES": setting, "GLIBC_TUNABLES": ""}
    wanted = malloc_hugepages_env(env)
    if setting == "auto" and wanted is None:
        pytest.skip("this machine has no glibc 2.35+ with THP in madvise mode")
    script = tmp_path / "tunables.py"
    script.write_text(TUNABLES)
    result = mpirun(2, [*mpistrat_cmd, "run", "--tag-output", str(script), "two words",
                        "--x=1"], env=env, timeout=60)  # (whole lines)
    assert result.returncode == 0, result.stdout + result.stderr
    records = _records(result.stdout)
    assert [r["rank"] for r in records] == [0, 1]
    for r in records:
        assert r["argv"] == [str(script), "two words", "--x=1"]
        assert r["tunables"] == (wanted["GLIBC_TUNABLES"] if wanted else "")


@pytest.mark.parametrize("setting", ["auto", "0"])
def test_self_launched_ranks_start_with_the_heap_on_huge_pages(tmp_path, setting):
    """``mpistrat run -n`` hands its ranks glibc's huge-page tunable (so no rank starts
    twice); MPISTRAT_MALLOC_HUGEPAGES=0 keeps it out."""
    import os

    from mpistrat.launch.hugepages import malloc_hugepages_env

    env = {**os.environ, "MPISTRAT_MALLOC_HUGEPAGES": setting, "GLIBC_TUNABLES": ""}
    wanted = malloc_hugepages_env(env)
    if setting == "auto" and wanted is None:
        pytest.skip("this machine has no glibc 2.35+ with THP in madvise mode")
    script = tmp_path / "tunables.py"
    script.write_text(TUNABLES)
    result = subprocess.run(
        [sys.executable, "-m", "mpistrat", "run", "-n", "2", "--tag-output", str(script), "x"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False)  # (lines)
    assert result.returncode == 0, result.stdout + result.stderr
    records = _records(result.stdout)
    assert sorted(r["rank"] for r in records) == [0, 1]
    for r in records:
        assert r["argv"] == [str(script), "x"]
        assert r["tunables"] == (wanted["GLIBC_TUNABLES"] if wanted else "")
