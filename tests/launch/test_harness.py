"""The MPI test harness itself: a failure on any rank fails the run, a deadlock cannot hang it.

Each case writes a small test module next to a copy of tests/mpi/conftest.py and runs
``bin/mpitest`` on it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run_harness(tmp_path: Path, source: str, *args: str, timeout: float = 180):
    shutil.copy(ROOT / "tests" / "mpi" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_case.py").write_text(source)
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(ROOT / "bin" / "mpitest"), "--tests", str(tmp_path), *args],
        capture_output=True, text=True, timeout=timeout, check=False, cwd=ROOT,
    )
    return result, time.monotonic() - started


def test_failure_on_one_rank_fails_every_rank(tmp_path):
    result, _ = _run_harness(tmp_path, (
        "def test_ok(world):\n    world.Barrier()\n"
        "def test_rank1(world):\n    assert world.rank != 1, 'rank 1 says no'\n"
        "def test_still_in_step(world):\n    assert world.allreduce(1) == world.size\n"
    ), "-n", "2", "-n", "3")
    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout
    assert out.count("failed on rank(s) [1] of 2") >= 1
    assert out.count("failed on rank(s) [1] of 3") >= 1
    assert "rank 1 says no" in out  # rank 0 shows the other rank's traceback
    assert "-n 2: 2 passed, 1 failed" in out and "-n 3: 2 passed, 1 failed" in out
    assert out.rstrip().splitlines()[-1] == "mpitest: 4 passed, 2 failed, 0 skipped"


def test_deadlock_fails_within_the_timeout(tmp_path):
    result, elapsed = _run_harness(tmp_path, (
        "def test_deadlock(world):\n"
        "    if world.rank == 0:\n"
        "        raise RuntimeError('rank 0 leaves before the collective')\n"
        "    world.Barrier()\n"
    ), "-n", "2", "--test-timeout", "3", "--timeout", "60")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Timeout" in result.stdout  # the stuck rank's stack dump is shown
    assert elapsed < 60


def test_passing_run(tmp_path):
    result, _ = _run_harness(tmp_path, (
        "import pytest\n"
        "def test_sum(comm):\n    assert comm.allreduce(comm.rank) == comm.size * (comm.size - 1) // 2\n"
        "@pytest.mark.mpi(min_size=3)\ndef test_big(world):\n    assert world.size >= 3\n"
    ), "-n", "1", "-n", "3")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.rstrip().splitlines()[-1] == "mpitest: 7 passed, 0 failed, 1 skipped"


def test_terminating_the_harness_kills_its_job(tmp_path):
    """A harness stopped from outside (CI cancel, ``timeout``) leaves no rank running."""
    marker = tmp_path / "pids"
    marker.mkdir()
    shutil.copy(ROOT / "tests" / "mpi" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_case.py").write_text(
        "import os, time, pathlib\n"
        "def test_sleeps(world):\n"
        f"    pathlib.Path({str(marker)!r}, str(os.getpid())).touch()\n"
        "    time.sleep(600)\n"
    )
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "bin" / "mpitest"), "--tests", str(tmp_path), "-n", "2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    deadline = time.monotonic() + 60
    while len(list(marker.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    pids = [int(p.name) for p in marker.iterdir()]
    assert len(pids) == 2, "the ranks did not start"
    process.terminate()
    process.wait(timeout=30)
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in pids if Path(f"/proc/{pid}").exists()
                 and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]]
        time.sleep(0.1)
    assert not alive, f"ranks {alive} outlived the terminated harness"
