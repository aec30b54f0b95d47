"""``mpistrat run -n 5 --num-ps 1 --min-ranks 3``: a parameter-server job that loses a
worker, its ps or its coordinator is launched again on the 4 ranks left (1 coordinator,
1 ps, 2 workers), the coordinator restores the ps variables from its snapshot in
``/dev/shm`` (here ``$MPISTRAT_ELASTIC_DIR``), and the script schedules the functions
after it again: every function's update is applied exactly once in the end state
(tests/launch/ps_scripts/elastic_train.py). The decision itself:
tests/unit/test_elastic_ps_options.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.launch

SCRIPT = Path(__file__).resolve().parent / "ps_scripts" / "elastic_train.py"
STEPS = 60
# a snapshot every 10 step boundaries, whatever the machine's load (auto's choice
# depends on it): schedule(i) is boundary i + 1 up to the first join(), boundary 11, and
# the schedule() right after a join is the same boundary, so the snapshots hold 9, 19,
# 29, ... functions, and the fault at function 35 leaves the one of 29
SNAPSHOT_EVERY = 10
RESUMED_AT = 29


def _run(mpistrat_cmd, tmp_path, mode, *options):
    shm = tmp_path / "shm"
    shm.mkdir()
    env = {**os.environ, "MPISTRAT_ELASTIC_DIR": str(shm),
           "CKPT_DIR": str(tmp_path / "ckpt")}
    result = subprocess.run(
        [*mpistrat_cmd, "run", "-n", "5", "--num-ps", "1", "--min-ranks", "3",
         "--timeout", "20", "--snapshot-every", str(SNAPSHOT_EVERY), *options, str(SCRIPT),
         mode, str(STEPS)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    out = result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    return result, out, (json.loads(lines[-1]) if lines else None), shm


def _check_exactly_once(final, out):
    assert final["progress"] == [STEPS, STEPS * (STEPS - 1) // 2], out  # each i once
    assert final["weights"] == [0.5 * STEPS] * 3, out


@pytest.mark.parametrize("mode, lost_rank", [("worker", None), ("ps", 1)])
def test_a_lost_rank_relaunches_and_restores_from_the_coordinators_snapshot(
        mpistrat_cmd, tmp_path, mode, lost_rank):
    result, out, final, shm = _run(mpistrat_cmd, tmp_path, mode)
    assert result.returncode == 0, out
    lost = re.search(r"^mpistrat run: lost rank (\d) \(\S+\); restart 1 of 3 on 4 ranks "
                     r"\(\S+:4\): 1 coordinator, 1 ps, 2 workers after \d+\.\d s$",
                     result.stderr, re.MULTILINE)
    assert lost, out
    if lost_rank is not None:
        assert int(lost.group(1)) == lost_rank, out
    else:
        assert int(lost.group(1)) in (2, 3, 4), out
    launches = re.findall(r"^@@ launch (\d): (\d) workers, resuming at (\d+) from (\S+)$",
                          result.stdout, re.MULTILINE)
    assert [(r, w) for r, w, _, _ in launches] == [("0", "3"), ("1", "2")], out
    assert launches[0][2:] == ("0", "None"), out
    assert final is not None and final["restart"] == 1 and final["workers"] == 2, out
    # restored from the snapshot in RAM, taken at a join after some functions
    assert final["restored"].startswith(str(shm / "mpistrat-elastic-")), out
    assert final["restored"].endswith((".data")), out
    assert final["start"] == RESUMED_AT and final["sequence"] == RESUMED_AT + 1, out
    _check_exactly_once(final, out)
    assert list(shm.iterdir()) == [], out  # the job ended well: its snapshots went


def test_a_lost_coordinator_restores_from_its_hosts_snapshot(mpistrat_cmd, tmp_path):
    result, out, final, shm = _run(mpistrat_cmd, tmp_path, "coordinator")
    assert result.returncode == 0, out
    assert re.search(r"^mpistrat run: lost rank 0 \(\S+\); restart 1 of 3 on 4 ranks",
                     result.stderr, re.MULTILINE), out
    assert final is not None and final["restart"] == 1, out
    assert final["restored"].startswith(str(shm)) and final["start"] == RESUMED_AT, out
    _check_exactly_once(final, out)


def test_without_a_loss_it_runs_once(mpistrat_cmd, tmp_path):
    result, out, final, shm = _run(mpistrat_cmd, tmp_path, "none")
    assert result.returncode == 0, out
    assert final is not None and final["restart"] == 0 and final["restored"] is None, out
    _check_exactly_once(final, out)
    assert "restart" not in result.stderr, out
    assert list(shm.iterdir()) == [], out


def test_the_partner_copy_restores_after_the_coordinators_host_is_lost(mpirun, tmp_path):
    """Two "hosts" on one machine (each rank's host name faked): rank 0's snapshots go to
    its partner, rank 3 (the lowest on hostB), which writes them into hostB's directory.
    The coordinator is killed mid-run; hostA's directory is deleted (its host lost); the
    relaunch, all of it on hostB, restores from the partner copy."""
    shm = tmp_path / "shm"
    shm.mkdir()
    job, secret = "ab" * 16, "cd" * 32
    env = {"MPISTRAT_ELASTIC": job, "MPISTRAT_ELASTIC_DIR": str(shm),
           "MPISTRAT_ELASTIC_SNAPSHOT_EVERY": str(SNAPSHOT_EVERY), "TEST_JOB_SECRET": secret,
           "MPISTRAT_NUM_PS": "1",
           "CKPT_DIR": str(tmp_path / "ckpt")}
    first = mpirun(5, [sys.executable, str(SCRIPT), "coordinator", str(STEPS)], env={
        **env, "MPISTRAT_ELASTIC_RESTART": "0", "MPISTRAT_ELASTIC_SIZES": "5",
        "FAKE_HOSTS": "hostA,hostA,hostA,hostB,hostB"}, timeout=120)
    out = first.stdout + first.stderr
    assert first.returncode != 0, out  # (rank 0 killed itself)
    job_dir = shm / f"mpistrat-elastic-{os.getuid()}-{job}"
    assert sorted(p.name for p in job_dir.iterdir()) == ["hostA", "hostB"], out
    assert {"layout.json"} < {p.name for p in (job_dir / "hostB").iterdir()}, out
    shutil.rmtree(job_dir / "hostA")  # (hostA is lost, and its RAM with it)
    second = mpirun(4, [sys.executable, str(SCRIPT), "coordinator", str(STEPS)], env={
        **env, "MPISTRAT_ELASTIC_RESTART": "1", "MPISTRAT_ELASTIC_SIZES": "5,4",
        "MPISTRAT_ELASTIC_LOST": "hostA", "FAKE_HOSTS": "hostB,hostB,hostB,hostB"},
        timeout=120)
    out = second.stdout + second.stderr
    assert second.returncode == 0, out
    final = json.loads([line for line in second.stdout.splitlines()
                        if line.startswith("{")][-1])
    assert final["restored"].startswith(str(job_dir / "hostB" / "slot-")), out
    assert final["start"] == RESUMED_AT, out
    _check_exactly_once(final, out)
    assert not job_dir.exists(), out  # (the job ended well: hostB's copy went)
