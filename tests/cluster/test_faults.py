"""A host lost in the middle of training, across the two real hosts of conftest.py:

* its processes killed (all of them, as a crash or the OOM killer would), under
  ``mpistrat run -n 4`` and under ``mpiexec -n 4 mpistrat run``;
* its link pulled in the middle of a collective (a network partition), under both;
* under Slurm (``sbatch --nodes=2 slurm/cpu.sbatch``), its slurmd and processes killed,
  or its link pulled.

Each test trains with ``_fault_train.py`` (all-reduces with ``shm/rechd``, a checkpoint
every 5 steps) until two checkpoints exist, makes the fault, and measures how long each
host's ranks (and the launcher) still run. It asserts that every rank ended within
``BOUND`` seconds of the fault, on both sides of a partition; that the job failed; that
the report names the lost host and its ranks (and, on the far side of a partition, the
host it lost); that every complete checkpoint left is intact; and that a rerun resumes
from the newest one. Nothing of a job may be left on either host.

Under a plain ``mpiexec`` (hydra), killing a host's processes makes hydra fail with
``assert (!closed) failed`` and SIGKILL every other rank within a fraction of a second,
before any rank can tell which host went; the job's monitor process
(mpistrat/runner/sidecar.py), out of hydra's reach, names it instead, and ends with the
job, also when ``mpiexec`` ends it on a SIGTERM.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from _cluster import Job as _Job
from _cluster import job_fields as _job_fields
from _cluster import kill_host as _kill_host
from _cluster import leftovers, script_ranks
from _cluster import processes as _processes
from _cluster import restart_slurmd as _restart_slurmd
from _cluster import slurm as _slurm
from _cluster import slurm_env as _slurm_env
from _cluster import stop_slurmd as _stop_slurmd
from _cluster import wait_until as _wait_for

from mpistrat.checkpoint import _files

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
TRAIN = Path(__file__).resolve().parent / "_fault_train.py"
STALL, TIMEOUT = 4, 8
# From the fault to the end of every rank: --timeout, then the watchdog's tick, its probe
# (1 s), the report, MPI_Abort and the rank's own exit (measured: 2-5 s past --timeout on
# this 2-core machine shared with other jobs), with room for that load.
BOUND = TIMEOUT + 10
RUN_OPTIONS = ["--stall-check", str(STALL), "--timeout", str(TIMEOUT)]
# what both job monitors say when node2's processes are killed (mpistrat/runner/monitor.py)
NODE2_NAMED = re.compile(r"mpistrat run: the first ranks to end without a report were every "
                         r"rank of host node2 \(ranks 2, 3\): rank [23] at [\d:]+, the "
                         r"others within")


@dataclass
class Ended:
    """When (seconds after the fault) each host's ranks and the launcher were gone."""

    hosts: dict[str, float | None] = field(default_factory=dict)
    launcher: float | None = None


def _ranks(cluster, host: str) -> list[int]:
    return script_ranks(cluster, host, TRAIN.name)


def _job_leftovers(cluster) -> dict[str, list[str]]:
    return leftovers(cluster, TRAIN.name)


def _sidecars(cluster) -> list[str]:
    return [cmd for host in cluster.hosts for cmd in _processes(cluster, host).values()
            if "mpistrat.runner.sidecar" in cmd]


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as file:
        return dict(item.decode(errors="replace").split("=", 1)
                    for item in file.read().split(b"\0") if b"=" in item)


def _check_control_plane(cluster, job: _Job, launch: str) -> None:
    """The job's secret is on no process's command line on any host (only the
    environments of mpiexec, the ranks' launcher chain and the monitor hold it), and the
    monitor listens on the address the job's hosts reach, not on every interface."""
    if launch == "mpistrat run -n":
        with open(f"/proc/{job.process.pid}/task/{job.process.pid}/children") as file:
            holder = int(file.read().split()[0])  # mpiexec
        monitor = _environ(holder)["MPISTRAT_RUN_MONITOR"].split()
        subnet = cluster.control["CLUSTER_LOCAL_SUBNET"]
        assert monitor[2] == f"{subnet}.254", monitor  # the bridge: where node1, node2 are
    else:
        holders = [pid for host in cluster.hosts
                   for pid, cmd in _processes(cluster, host).items()
                   if "mpistrat.runner.sidecar" in cmd]
        assert holders, "no job monitor process beside the plain mpiexec"
        holder = holders[0]
    secret = _environ(holder)["MPISTRAT_JOB_SECRET"]
    assert len(secret) == 64
    seen = []
    for pid in filter(str.isdigit, os.listdir("/proc")):  # (one process table: every host)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as file:
                if secret.encode() in file.read():
                    seen.append(pid)
        except OSError:
            pass
    assert not seen, f"the job's secret is on the command line of processes {seen}"


def _watch_until_ended(cluster, launcher: subprocess.Popen | None, fault_at: float,
                       limit: float) -> Ended:
    """Poll until every rank on every host (and the launcher) has ended, or ``limit``
    seconds after the fault."""
    ended = Ended({host: None for host in cluster.hosts})
    while time.monotonic() - fault_at < limit:
        now = time.monotonic() - fault_at
        for host in cluster.hosts:
            if ended.hosts[host] is None and not _ranks(cluster, host):
                ended.hosts[host] = now
        if launcher is not None and ended.launcher is None and launcher.poll() is not None:
            ended.launcher = now
        if all(t is not None for t in ended.hosts.values()) and \
                (launcher is None or ended.launcher is not None):
            break
        time.sleep(0.05)
    return ended


def _check_checkpoints(directory: Path) -> tuple[str, int]:
    """Every complete checkpoint reads back, checksum verified, with weights equal to its
    step in every element (none torn or mixed); returns the newest (path, step)."""
    found = _files.scan(str(directory), "ckpt")
    assert found, f"no complete checkpoint in {directory}: {os.listdir(directory)}"
    newest = None
    for _, path in found:
        manifest, arrays = _files.read(path)  # raises on a torn or changed file
        keys = {e["name"]: e.get("key") for e in manifest["entries"]}
        step = int(arrays[keys["step"]])
        assert np.array_equal(arrays[keys["weights"]],
                              np.full(arrays[keys["weights"]].shape, step, np.float32)), path
        newest = (path, step)
    assert newest is not None
    return newest


def _rerun_resumes(cluster, directory: Path) -> None:
    """A new job resumes from the newest checkpoint and finishes."""
    path, step = _check_checkpoints(directory)
    result = cluster.run([VENV_BIN / "mpistrat", "run", "-n", "4", *RUN_OPTIONS, TRAIN,
                          "--checkpoint-dir", directory, "--more-steps", "3"], timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"resumed from {path} at step {step}" in result.stdout, result.stdout
    assert f"finished at step {step + 3}" in result.stdout, result.stdout


def _fault_run(cluster, tmp_path: Path, launch: str, fault: str):
    """Train under ``launch`` ('mpistrat run -n' or 'mpiexec'), make ``fault`` ('kill':
    every process of node2; 'link': node2's link down; 'term': SIGTERM to the launcher)
    once two checkpoints exist, and
    measure the end. Returns (job, ended, the report directory, the checkpoint dir)."""
    ckpt, reports = tmp_path / "ckpt", tmp_path / "reports"
    options = [*RUN_OPTIONS, "--report-dir", reports, TRAIN, "--checkpoint-dir", ckpt]
    if launch == "mpistrat run -n":
        argv = [VENV_BIN / "mpistrat", "run", "-n", "4", *options]
    else:
        argv = [VENV_BIN / "mpiexec", "-n", "4", sys.executable, "-m", "mpistrat", "run",
                *options]
    job = _Job(cluster, argv, tmp_path)
    try:
        _wait_for(lambda: (ckpt / "ckpt-2.json").exists() or job.process.poll() is not None,
                  90, "two checkpoints")
        assert job.process.poll() is None, job.output
        assert _ranks(cluster, "node1") and _ranks(cluster, "node2"), job.output
        if fault != "term":
            _check_control_plane(cluster, job, launch)
        fault_at = time.monotonic()
        if fault == "kill":
            _kill_host(cluster, "node2")
        elif fault == "term":
            job.process.send_signal(signal.SIGTERM)
        else:
            cluster.local("link", "node2", "down")
        try:
            ended = _watch_until_ended(cluster, job.process, fault_at, BOUND + 30)
        finally:
            if fault == "link":
                cluster.local("link", "node2", "up")
        job.process.wait(30)
    finally:
        job.stop()
    left = _job_leftovers(cluster)
    for host in left:
        _kill_host(cluster, host)
    assert not left, f"processes left after the job: {left}"
    # the job's monitor process (under a plain mpiexec) ends with the job
    _wait_for(lambda: not _sidecars(cluster), 5, "the job's monitor process to end")
    return job, ended, reports, ckpt


def _record(scenario: str, ended: Ended, status: int | None, output: str) -> None:
    """With MPISTRAT_FAULT_FIGURES=FILE, append what was measured (for docs/run.md)."""
    path = os.environ.get("MPISTRAT_FAULT_FIGURES")
    if not path:
        return
    lines = [line for line in output.splitlines()
             if re.search(r"PeerLostError|first ranks? to end|never reported|assert \(!closed\)",
                          line)]
    with open(path, "a") as file:
        file.write(json.dumps({"scenario": scenario, "ended": ended.hosts,
                               "launcher": ended.launcher, "status": status,
                               "messages": lines}) + "\n")


def _assert_bound(ended: Ended, output: str) -> None:
    late = {h: t for h, t in ended.hosts.items() if t is None or t > BOUND}
    assert not late, f"ranks still ran past {BOUND} s after the fault: {ended}\n{output}"
    assert ended.launcher is not None and ended.launcher <= BOUND + 5, (ended, output)


@pytest.mark.timeout(240)
def test_killed_host_is_named_by_mpistrat_run_n(cluster, tmp_path):
    job, ended, _, ckpt = _fault_run(cluster, tmp_path, "mpistrat run -n", "kill")
    output = job.output
    _record("kill, mpistrat run -n", ended, job.process.returncode, output)
    _assert_bound(ended, output)
    assert ended.hosts["node1"] < 5, ended  # hydra ends the survivors at once
    assert job.process.returncode != 0, output
    assert NODE2_NAMED.search(output), output
    _rerun_resumes(cluster, ckpt)


@pytest.mark.timeout(240)
def test_killed_host_ends_every_rank_under_mpiexec(cluster, tmp_path):
    """Under a plain hydra the survivors are SIGKILLed at once by hydra itself, whose
    only message is its assertion; the job's monitor process (mpistrat/runner/sidecar.py),
    out of hydra's reach, names the lost host in mpiexec's standard error. Every rank
    ends, the job fails, the checkpoint is intact."""
    job, ended, _, ckpt = _fault_run(cluster, tmp_path, "mpiexec", "kill")
    output = job.output
    _record("kill, mpiexec", ended, job.process.returncode, output)
    _assert_bound(ended, output)
    assert ended.hosts["node1"] < 5, ended
    assert job.process.returncode == 255, output
    assert "assert (!closed) failed" in output, output
    assert NODE2_NAMED.search(output), output
    _rerun_resumes(cluster, ckpt)


@pytest.mark.timeout(240)
def test_a_job_mpiexec_ends_on_sigterm_leaves_nothing(cluster, tmp_path):
    """SIGTERM to a plain mpiexec: hydra forwards it and ends the job; every rank and the
    job's monitor process end (_fault_run checks that nothing is left)."""
    job, ended, _, ckpt = _fault_run(cluster, tmp_path, "mpiexec", "term")
    _assert_bound(ended, job.output)
    assert job.process.returncode != 0, job.output
    _rerun_resumes(cluster, ckpt)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("launch", ["mpistrat run -n", "mpiexec"])
def test_partition_ends_both_sides_and_names_the_other_host(cluster, tmp_path, launch):
    job, ended, reports, ckpt = _fault_run(cluster, tmp_path, launch, "link")
    output = job.output
    far = (reports / "rank-2.txt").read_text() if (reports / "rank-2.txt").exists() else ""
    _record(f"link, {launch}", ended, job.process.returncode, output + "\n" + far)
    _assert_bound(ended, output)
    assert ended.hosts["node1"] >= TIMEOUT - 1 and ended.hosts["node2"] >= TIMEOUT - 1, ended
    assert job.process.returncode != 0, output
    # node1's side: its report names node2 and its ranks, not node1's own ranks
    assert re.search(r"\[0\] mpistrat\.errors\.PeerLostError: lost host node2 \(ranks 2, 3\): ",
                     output), output
    assert "Host node2 (ranks 2, 3) does not answer mpistrat's liveness probe" in output
    # node2's side, cut off from the launcher: its report went to --report-dir
    assert "mpistrat.errors.PeerLostError: lost host node1 (ranks 0, 1): " in far, far
    assert "rank 3 (node2) stops too" in (reports / "rank-3.txt").read_text()
    if launch == "mpistrat run -n":  # it says who never reported, and shows their reports
        assert ("mpistrat run: host node2 (ranks 2, 3) never reported how they ended"
                in output), output
        assert "rank 2's report (" in output and "lost host node1 (ranks 0, 1)" in output
    _rerun_resumes(cluster, ckpt)


# -- Slurm


def _wait_job_stopped(cluster, job_id: str, timeout: float) -> dict[str, str]:
    """Wait until the job no longer runs: ended, or requeued (PENDING)."""
    deadline = time.monotonic() + timeout
    while True:
        fields = _job_fields(cluster, job_id)
        if fields.get("JobState") not in ("RUNNING", "COMPLETING", "CONFIGURING"):
            return fields
        if time.monotonic() > deadline:
            pytest.fail(f"job {job_id} still runs {timeout} s after its node was lost: "
                        f"{fields}")
        time.sleep(0.2)


def _wait_job_done(cluster, job_id: str, timeout: float) -> dict[str, str]:
    """Wait until the job has ended (or was requeued: then until it ran again and ended)."""
    deadline = time.monotonic() + timeout
    while _slurm(cluster, "squeue", "-h", "-j", job_id, "-o", "%T").stdout.strip():
        if time.monotonic() > deadline:
            _slurm(cluster, "scancel", job_id)
            pytest.fail(f"job {job_id} still queued after {timeout} s: "
                        f"{_job_fields(cluster, job_id)}")
        time.sleep(0.2)
    return _job_fields(cluster, job_id)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", ["kill", "link"])
def test_slurm_node_lost_fails_the_job_and_the_next_run_resumes(slurm_cluster, tmp_path, fault):
    """``kill``: node2's slurmd, slurmstepd and ranks SIGKILLed; ``link``: node2's link
    pulled, slurmd and the ranks left running on the far side of the partition."""
    cluster = slurm_cluster
    ckpt, reports, out = tmp_path / "ckpt", tmp_path / "reports", tmp_path / "job.out"
    options = " ".join([*RUN_OPTIONS, "--report-dir", str(reports)])

    def submit(output: Path) -> str:
        result = subprocess.run(
            ["sbatch", "--parsable", "--nodes=2", "--ntasks=4", "--ntasks-per-node=2",
             "--cpus-per-task=1", f"--output={output}", "slurm/cpu.sbatch", str(TRAIN),
             "--checkpoint-dir", str(ckpt), "--steps", "150", "--step-sleep", "0.02"],
            cwd=ROOT, env={**_slurm_env(cluster), "SHOW_INFO": "0", "RUN_OPTIONS": options},
            capture_output=True, text=True, timeout=60, check=False)
        assert result.returncode == 0, result.stderr
        return result.stdout.strip().split(";")[0]

    job_id = submit(out)
    link_down = False
    try:
        _wait_for(lambda: (ckpt / "ckpt-2.json").exists(), 120, "two checkpoints")
        fault_at = time.monotonic()
        if fault == "kill":
            _kill_host(cluster, "node2", keep_slurmd=False)  # slurmd, slurmstepd, the ranks
        else:
            cluster.local("link", "node2", "down")
            link_down = True
        ended = _watch_until_ended(cluster, None, fault_at, BOUND + 30)
        late = {h: t for h, t in ended.hosts.items() if t is None or t > BOUND}
        assert not late, (ended, out.read_text())
    finally:
        # node2 comes back as soon as the ranks are gone (as a rebooted node would), so
        # that Slurm need not wait for SlurmdTimeout and its pings (about 20 s) to end
        # the job: the job fails because its ranks did, not because Slurm saw the node go.
        if link_down:
            cluster.local("link", "node2", "up")
            # a restarted slurmd registers at once; the running one waits for slurmctld's
            # next ping to be seen again (about 12 s more)
            _stop_slurmd(cluster, "node2")
        _restart_slurmd(cluster, "node2")
    fields = _wait_job_stopped(cluster, job_id, 120)
    _record(f"{fault}, Slurm (srun): job {fields.get('JobState')} "
            f"{fields.get('ExitCode')}", ended, None, out.read_text())
    output = out.read_text()
    assert re.search(r"\[0\] mpistrat\.errors\.PeerLostError: lost host node2 \(ranks 2, 3\): ",
                     output), output
    if fault == "link":  # the far side's report, written to --report-dir
        far = (reports / "rank-2.txt").read_text()
        assert "mpistrat.errors.PeerLostError: lost host node1 (ranks 0, 1): " in far, far
    assert fields.get("JobState") in ("FAILED", "NODE_FAIL", "PENDING"), fields
    _wait_for(lambda: not _job_leftovers(cluster), 60, "the job's processes gone")
    path, step = _check_checkpoints(ckpt)
    if fields.get("JobState") == "PENDING":  # requeued (node failure): it runs again itself
        rerun_id, rerun_out = job_id, out
    else:  # failed: the next submission resumes
        rerun_id, rerun_out = submit(tmp_path / "rerun.out"), tmp_path / "rerun.out"
    fields = _wait_job_done(cluster, rerun_id, 180)
    text = rerun_out.read_text()
    assert fields.get("JobState") == "COMPLETED", (fields, text)
    assert f"resumed from {path} at step {step}" in text, text
    assert "finished at step 150" in text, text
