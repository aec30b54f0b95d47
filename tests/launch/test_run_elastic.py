"""``mpistrat run -n N --min-ranks M`` on one host: a rank killed costs that rank, and the
job is launched again on the others with the same job id, until it finishes, falls below
``--min-ranks`` or spends ``--max-restarts``; a failure the script raises is never
restarted. (tests/unit/test_elastic_options.py: the decision, and the loop across hosts.)"""

from __future__ import annotations

import os
import re
import subprocess
import textwrap
import time

import pytest

pytestmark = pytest.mark.launch

# Rank 0 says which launch this is; after two all-reduces, the last rank kills itself
# (SIGKILL: no report, no announced end) in the launches the mode says, or rank 1 raises.
SCRIPT = textwrap.dedent("""\
    import os, signal, sys
    import numpy as np
    import mpistrat
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    restart = int(os.environ["MPISTRAT_ELASTIC_RESTART"])
    mode = sys.argv[1]
    # snapshots of a step counter (in MPISTRAT_ELASTIC_DIR): the job must leave none
    steps = mpistrat.checkpoint.Scalar(0)
    manager = mpistrat.CheckpointManager(mpistrat.Checkpoint(steps=steps), "ckpt")
    manager.restore_or_initialize()
    if comm.rank == 0:
        print(f"@@ restart={restart} size={comm.size} "
              f"sizes={os.environ['MPISTRAT_ELASTIC_SIZES']} "
              f"lost={os.environ['MPISTRAT_ELASTIC_LOST']} "
              f"job={os.environ['MPISTRAT_ELASTIC']}", flush=True)
    for step in range(4):
        mpistrat.elastic.step()
        steps.assign_add(1)
        total = mpistrat.all_reduce(np.ones(3), comm=comm)
        assert total[0] == comm.size
        if step == 2 and comm.rank == comm.size - 1 and (
                mode == "kill-always" or (mode == "kill-first" and restart == 0)):
            os.kill(os.getpid(), signal.SIGKILL)
        if step == 2 and comm.rank == 1 and mode == "raise":
            raise ValueError("rank 1 fails on purpose")
    print(f"rank {comm.rank} of {comm.size} done", flush=True)
    """)

LAUNCH = re.compile(r"^@@ restart=(\d+) size=(\d+) sizes=(\S*) lost=(\S*) job=([0-9a-f]{32})$",
                    re.MULTILINE)


@pytest.fixture
def elastic(mpistrat_cmd, tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)

    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)

    def run(mode, *options, n=4, timeout=60):
        started = time.monotonic()
        result = subprocess.run(
            [*mpistrat_cmd, "run", "-n", str(n), *options, str(script), mode],
            cwd=tmp_path, capture_output=True, text=True, timeout=timeout, check=False,
            env={**os.environ, "MPISTRAT_ELASTIC_DIR": str(shm)})
        # however the job ended, its snapshots are gone (mpistrat run's, and the ranks')
        assert not list(shm.iterdir()), (list(shm.iterdir()), result.stderr)
        launches = [(int(r), int(s), sizes, lost, job)
                    for r, s, sizes, lost, job in LAUNCH.findall(result.stdout)]
        return result, launches, time.monotonic() - started

    return run


def test_a_killed_rank_is_left_out_and_the_job_finishes_on_the_others(elastic):
    result, launches, elapsed = elastic("kill-first", "--min-ranks", "2", "--timeout", "20")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert [launch[:4] for launch in launches] == [
        (0, 4, "4", ""), (1, 3, "4,3", f"{_host(out)}/3")], out
    assert len({launch[4] for launch in launches}) == 1  # one job id for every launch
    assert re.search(r"^mpistrat run: lost rank 3 \(\S+\); restart 1 of 3 on 3 ranks "
                     r"\(\S+:3\) after \d+\.\d s$", result.stderr, re.MULTILINE), out
    # the monitor's summary of the failed launch is still printed
    assert "the first ranks to end without a report were" in result.stderr, out
    assert sorted(re.findall(r"rank (\d) of 3 done", result.stdout)) == ["0", "1", "2"], out
    assert "of 4 done" not in result.stdout
    assert elapsed < 30


def test_a_kill_in_every_launch_spends_the_restarts(elastic):
    result, launches, elapsed = elastic("kill-always", "--min-ranks", "2", "--max-restarts",
                                        "1", "--timeout", "20")
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert [launch[1] for launch in launches] == [4, 3], out
    assert "restart 1 of 1 on 3 ranks" in result.stderr, out
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("mpistrat run: lost rank 2 (") and \
        "not launching again: --max-restarts 1 spent" in last and \
        "launch sizes so far: 4, 3" in last and "newest complete checkpoint" in last, out
    assert "done" not in result.stdout
    assert elapsed < 30


def test_a_loss_below_the_minimum_ends_the_job_naming_it(elastic):
    result, launches, elapsed = elastic("kill-first", "--min-ranks", "4", "--timeout", "20")
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert [launch[0] for launch in launches] == [0], out
    assert "restart" not in result.stderr
    assert "not launching again: 3 ranks would be left, below --min-ranks 4 (launch sizes " \
           "so far: 4)" in result.stderr, out
    assert elapsed < 30


def test_an_exception_in_the_script_is_not_restarted(elastic):
    result, launches, elapsed = elastic("raise", "--min-ranks", "2", "--timeout", "20")
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert [launch[0] for launch in launches] == [0], out
    assert "[1] ValueError: rank 1 fails on purpose" in result.stderr, out
    assert "restart" not in result.stderr and "not launching again" not in result.stderr, out
    assert elapsed < 30


def test_without_a_timeout_it_is_a_usage_error_naming_the_fix(elastic, monkeypatch):
    monkeypatch.delenv("MPISTRAT_COLLECTIVE_TIMEOUT", raising=False)
    result, launches, _ = elastic("kill-first", "--min-ranks", "2")
    assert result.returncode == 2 and launches == []
    assert "--min-ranks 2 needs --timeout SECONDS (or MPISTRAT_COLLECTIVE_TIMEOUT)" in \
        result.stderr, result.stderr


def _host(out: str) -> str:
    found = re.search(r"lost rank 3 \((\S+)\)", out)
    assert found, out
    return found.group(1)

