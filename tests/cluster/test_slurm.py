"""The Slurm templates across two real hosts: ``slurm/cpu.sbatch`` with ``--nodes=2``
(through ``srun``, the default, and through ``mpiexec``), and ``srun --mpi=pmi2 -N2 -n4``
directly, against the cluster's Slurm (one slurmd per host, conftest.py).

Each job runs a tiny script on 4 ranks that all-reduces 4 MiB and prints, in one line per
rank, its rank, host and the result; the test reads the job's output file and
``scontrol show job`` (no slurmdbd, so no ``sacct``), as tests/slurm does, and checks the
link counters: the ranks' bytes must have crossed the links.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]

REPORT = textwrap.dedent('''
    """Every rank all-reduces 4 MiB (so bytes cross the links) and says where it ran."""
    import socket
    import sys

    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    a = np.full(1 << 20, comm.rank + 1, dtype=np.float32)
    comm.Allreduce(MPI.IN_PLACE, a)
    ok = bool(np.all(a == comm.size * (comm.size + 1) // 2))
    sys.stdout.write(f"report rank {comm.rank} of {comm.size} on {socket.gethostname()} "
                     f"sum {a[0]:g} exact {ok} args {sys.argv[1:]}\\n")  # one write per rank
    sys.stdout.flush()
''')

# ranks 0, 1 on node1 and 2, 3 on node2: Slurm's block distribution of 4 tasks on 2 nodes
EXPECTED = [f"report rank {r} of 4 on node{r // 2 + 1} sum 10 exact True args {{args}}"
            for r in range(4)]


def _env(cluster) -> dict[str, str]:
    """The cluster's environment without hydra's ssh stand-in and host file: inside a
    Slurm job, mpiexec must find the hosts and start its proxies through Slurm, as on a
    real cluster. The ofi/tcp transport and SLURM_CONF stay."""
    env = {k: v for k, v in cluster.env.items() if not k.startswith("HYDRA_")}
    assert "SLURM_CONF" in env and env.get("MPIR_CVAR_CH4_NETMOD") == "ofi", sorted(env)
    return env


def _run(env, argv, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def _fields(env, job_id: str) -> dict[str, str]:
    text = _run(env, ["scontrol", "show", "job", "-o", job_id]).stdout
    return dict(re.findall(r"(\w+)=(\S*)", text))


def _wait(env, job_id: str, output: Path, timeout: float = 90) -> tuple[dict, str]:
    """Wait until the job has left the queue: (scontrol's fields, its output)."""
    deadline = time.monotonic() + timeout
    while _run(env, ["squeue", "-h", "-j", job_id, "-o", "%T"]).stdout.strip():
        if time.monotonic() > deadline:
            _run(env, ["scancel", job_id])
            text = output.read_text() if output.exists() else "(no output file)"
            pytest.fail(f"job {job_id} still in the queue after {timeout} s; "
                        f"{_fields(env, job_id)}\n{text}")
        time.sleep(0.2)
    return _fields(env, job_id), output.read_text() if output.exists() else ""


def _reports(output: str) -> list[str]:
    return sorted(re.findall(r"report rank .*", output))


@pytest.mark.parametrize("launch", ["srun", "mpiexec"])
def test_cpu_template_on_two_nodes(slurm_cluster, tmp_path, launch):
    env = _env(slurm_cluster)
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    out = tmp_path / "job.out"
    before = slurm_cluster.bytes()
    submitted = _run({**env, "LAUNCH": launch, "SHOW_INFO": "1" if launch == "srun" else "0"},
                     ["sbatch", "--parsable", f"--output={out}", "--nodes=2", "--ntasks=4",
                      "--cpus-per-task=1", ROOT / "slurm" / "cpu.sbatch", script,
                      "--epochs", "2"])
    assert submitted.returncode == 0, f"sbatch failed: {submitted.stderr}"
    job_id = submitted.stdout.strip().split(";")[0]
    fields, output = _wait(env, job_id, out)
    moved = slurm_cluster.moved(before)
    job = f"job {job_id}: {fields.get('JobState')} ExitCode={fields.get('ExitCode')}\n{output}"
    assert (fields.get("JobState"), fields.get("ExitCode")) == ("COMPLETED", "0:0"), job
    assert fields.get("NodeList") == "node[1-2]", job
    assert _reports(output) == [e.format(args=["--epochs", "2"]) for e in EXPECTED], job
    expected = "srun --mpi=pmi2" if launch == "srun" else "mpiexec -n 4"
    assert f"nodes node[1-2], 4 task(s) x 1 CPU(s), launch: {expected}" in output, job
    if launch == "srun":  # mpistrat info's table: every rank on its Slurm node and host
        rows = re.findall(r"^(\d) +(node\d) +(\d) .*?(node\d) +(\d) +(\d) ", output, re.M)
        assert [(r[0], r[1], r[3], r[4]) for r in rows] == [
            ("0", "node1", "node1", "0"), ("1", "node1", "node1", "1"),
            ("2", "node2", "node2", "2"), ("3", "node2", "node2", "3")], job
    assert all(sent > 2 << 20 for sent in moved.values()), (
        f"bytes sent over each host's link during the job: {moved}; expected > 2 MiB each\n"
        f"{job}")


def test_srun_pmi2_across_two_nodes(slurm_cluster, tmp_path):
    env = _env(slurm_cluster)
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    before = slurm_cluster.bytes()
    result = _run(env, ["srun", "--mpi=pmi2", "-N2", "-n4", "--cpus-per-task=1",
                        sys.executable, script, "x"],
                  timeout=90)
    moved = slurm_cluster.moved(before)
    assert result.returncode == 0, f"srun failed ({result.returncode}):\n{result.stderr}"
    assert _reports(result.stdout) == [e.format(args=["x"]) for e in EXPECTED], (
        result.stdout + result.stderr)
    assert all(sent > 2 << 20 for sent in moved.values()), (
        f"bytes sent over each host's link during srun: {moved}; expected > 2 MiB each")
