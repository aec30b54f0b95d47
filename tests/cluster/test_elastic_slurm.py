"""Elastic training inside a Slurm allocation across the two real hosts of conftest.py:
``MIN_RANKS=2 sbatch --nodes=2 --no-kill slurm/cpu.sbatch`` (the template as a user
submits it), which runs ``mpistrat run -n 4 --min-ranks 2 --timeout 8`` in the batch
shell; hydra's ``mpiexec`` starts its proxies with ``srun``.

At step ``FAULT_STEP`` node2 is lost:

* ``kill``: its slurmd, slurmstepd and ranks SIGKILLed (a crashed node);
* ``link``: its link pulled (slurmd and the ranks left running, cut off).

``mpistrat run`` relaunches on node1's two ranks (``srun --nodelist node1``, overlapping the
lost launch's step, which slurmctld never sees end), and they restore the newest snapshot
from node1's ``/dev/shm``. Slurm marks node2 down about 25 s after the fault
(``SlurmdTimeout=10`` and its pings); with ``--no-kill`` it removes node2 from the job
instead of ending it, so the training runs long enough (``EPOCHS``, ``STEP_SLEEP``) for
that to happen while the relaunched ranks still train. The job must end COMPLETED with
exit code 0, with the final weights equal to one process's and every sample applied
exactly once per epoch; nothing of the job may be left on either host, and node2 is
brought back (slurmd restarted, node idle) for the tests after this one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _cluster import (
    job_fields,
    kill_host,
    leftovers,
    node_state,
    restart_slurmd,
    script_ranks,
    slurm,
    slurm_env,
    stop_slurmd,
    wait_until,
)
from _elastic_train import check_recovered, steps

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
TRAIN = Path(__file__).resolve().parent / "_elastic_train.py"
TIMEOUT = 8
FAULT_STEP = 20
# 16 steps an epoch; ~140 steps of ~0.3 s after the fault: the relaunched ranks still train
# when Slurm marks node2 down (about 25 s after the fault)
EPOCHS, STEP_SLEEP = 10, 0.3


def _training_ranks(cluster, host: str) -> list[int]:
    return script_ranks(cluster, host, TRAIN.name)


def _leftovers(cluster) -> dict[str, list[str]]:
    """The job's processes still on each host: ranks, the launcher, hydra, slurmstepd."""
    return leftovers(cluster, TRAIN.name, also=("mpiexec",))


# The link variant passes as well (first step on node1 11.3 s after the fault with
# --timeout 8), but node2's stale slurmstepd takes up to a minute to go once the link is
# back, 110 s of the suite's time in all; the partition itself is tested without Slurm
# (test_elastic.py). MPISTRAT_ELASTIC_SLURM_FAULTS=kill,link runs both.
FAULTS = os.environ.get("MPISTRAT_ELASTIC_SLURM_FAULTS", "kill").split(",")


@pytest.mark.timeout(420)
@pytest.mark.parametrize("fault", FAULTS)
def test_slurm_elastic_job_goes_on_on_the_node_left(slurm_cluster, tmp_path, fault):
    cluster = slurm_cluster
    out, result = tmp_path / "job.out", tmp_path / "result.npz"
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--nodes=2", "--ntasks=4", "--ntasks-per-node=2",
         "--cpus-per-task=1", "--no-kill", f"--output={out}", "slurm/cpu.sbatch", str(TRAIN),
         "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(result),
         "--epochs", str(EPOCHS), "--step-sleep", str(STEP_SLEEP)],
        cwd=ROOT, env={**slurm_env(cluster), "MIN_RANKS": "2", "ELASTIC_TIMEOUT": str(TIMEOUT),
                       "RUN_OPTIONS": "--stall-check 4", "SHOW_INFO": "0"},
        capture_output=True, text=True, timeout=60, check=False)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]

    def text() -> str:
        return out.read_text() if out.exists() else ""

    link_down = False
    # what Slurm did while the job ran on: node2 marked down, and removed from the job
    seen = {"node2 down": False, "job on node1 only": False}
    try:
        wait_until(lambda: any(s >= FAULT_STEP for s, _ in steps(text()))
                   or not slurm(cluster, "squeue", "-h", "-j", job_id).stdout.strip(),
                   120, f"step {FAULT_STEP}")
        assert _training_ranks(cluster, "node1") and _training_ranks(cluster, "node2"), text()
        fault_at = time.time()
        if fault == "kill":
            kill_host(cluster, "node2", keep_slurmd=False)  # slurmd, slurmstepd, the ranks
        else:
            cluster.local("link", "node2", "down")
            link_down = True
        deadline = time.monotonic() + 180
        while True:
            fields = job_fields(cluster, job_id)
            if fields.get("JobState") not in ("RUNNING", "CONFIGURING"):
                break
            if node_state(cluster, "node2").startswith("down"):
                seen["node2 down"] = True
            if fields.get("NodeList") == "node1":
                seen["job on node1 only"] = True
            if time.monotonic() > deadline:
                pytest.fail(f"job {job_id} still runs 180 s after the fault: {fields}\n"
                            f"{text()}")
            time.sleep(0.5)
        wait_until(lambda: not slurm(cluster, "squeue", "-h", "-j", job_id).stdout.strip(),
                   90, f"job {job_id} out of the queue")
    except BaseException:
        slurm(cluster, "scancel", job_id)
        for host in cluster.hosts:
            kill_host(cluster, host)
        raise
    finally:
        if link_down:
            cluster.local("link", "node2", "up")
            # the running slurmd would be seen again only at slurmctld's next ping
            stop_slurmd(cluster, "node2")
        restart_slurmd(cluster, "node2")
    fields = job_fields(cluster, job_id)
    output = text()
    assert (fields.get("JobState"), fields.get("ExitCode")) == ("COMPLETED", "0:0"), \
        (fields, output)
    assert "elastic: mpistrat run -n 4 --min-ranks 2 --timeout 8" in output, output
    assert seen == {"node2 down": True, "job on node1 only": True}, (seen, output)
    assert "step creation temporarily disabled" not in output, output
    got = check_recovered(output, fault_at, result, EPOCHS, TIMEOUT + 15)
    # node2's step never ended in slurmctld while its link was down: its slurmstepd ends
    # once its retried completion message gets through (within about a minute)
    try:
        wait_until(lambda: not _leftovers(cluster), 120, "the job's processes gone")
    except BaseException:
        for host in cluster.hosts:
            kill_host(cluster, host)
        raise
    print(f"recovered ({fault}, Slurm): first step on node1 {got.first - fault_at:.1f} s "
          f"after the fault; resumed at step {got.resumed_at} (last step before the fault: "
          f"{got.before})",
          file=sys.stderr)
