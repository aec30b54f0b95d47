"""A real single-node Slurm for the tests in this directory.

The session fixture ``slurm`` starts one with ``bin/slurm-local`` (Debian's slurm-wlm and
munge; munged, slurmctld and slurmd as plain processes) under a fresh directory in /tmp, on
free ports and with its own munge socket, so it neither needs nor disturbs any other Slurm
on the machine; it declares two placeholder GPUs (character devices that behave like
/dev/null) so the GPU options can be checked without GPUs. It stops the daemons after the
session. The fixture never installs packages: ``bin/slurm-local install`` (as root) does,
and ``.ci/run`` runs it.

The tests skip, with the reason, when Slurm is not installed, when not root (slurmd starts
jobs as their user), when ``MPISTRAT_SLURM_UNAVAILABLE`` gives a reason (``.ci/run`` sets it
when installing failed) or when the cluster does not start. With
``MPISTRAT_SLURM_REQUIRED=1`` (``.ci/run`` sets it once the packages are installed) they
fail instead of skipping.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SLURM_LOCAL = ROOT / "bin" / "slurm-local"
COMMANDS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol",
            "scancel")
# The outer environment must not leak into the test cluster's jobs: a test run inside a
# real Slurm job or under a launcher would otherwise point srun at that job.
_FOREIGN = ("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "PMI_", "PMIX_", "OMPI_", "HYDRA_",
            "MPISTRAT_")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slurm: submits jobs to a real single-node Slurm (skipped without one)")


@dataclass(repr=False)
class Job:
    """A finished job: ``scontrol show job`` fields and its output file's text."""

    id: str
    fields: dict[str, str]
    output: str

    @property
    def state(self) -> str:
        return self.fields.get("JobState", "?")

    @property
    def exit_code(self) -> str:
        """``STATUS:SIGNAL`` of the batch script, as Slurm records it."""
        return self.fields.get("ExitCode", "?")

    def __repr__(self) -> str:  # what a failed assertion shows
        return (f"job {self.id}: {self.state} ExitCode={self.exit_code} "
                f"Restarts={self.fields.get('Restarts')}\n--- output ---\n{self.output}")


class SlurmCluster:
    """The running test cluster: its directory, the environment for its commands, helpers."""

    def __init__(self, directory: Path, env: dict[str, str], gpus: int, gpu_note: str):
        self.directory = directory
        self.env = env
        self.gpus = gpus
        self.gpu_note = gpu_note

    def run(self, argv, *, env=None, timeout=60, cwd=ROOT) -> subprocess.CompletedProcess:
        """Run a command (srun, scontrol, ...) against this cluster."""
        return subprocess.run([str(a) for a in argv], cwd=cwd, env={**self.env, **(env or {})},
                              capture_output=True, text=True, timeout=timeout, check=False)

    def sbatch(self, template, *args, output: Path, env=None, options=()) -> str:
        """Submit ``slurm/TEMPLATE`` from the checkout (as a user does); return the job id."""
        result = self.run(["sbatch", "--parsable", f"--output={output}", *options,
                           ROOT / "slurm" / template, *args], env=env)
        assert result.returncode == 0, f"sbatch failed: {result.stderr}"
        return result.stdout.strip().split(";")[0]

    def fields(self, job_id: str) -> dict[str, str]:
        text = self.run(["scontrol", "show", "job", "-o", job_id]).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, job_id: str, output: Path, timeout: float = 60) -> Job:
        """Wait until the job has left the queue (a requeued job stays in it meanwhile)."""
        deadline = time.monotonic() + timeout
        while self.run(["squeue", "-h", "-j", job_id, "-o", "%T"]).stdout.strip():
            if time.monotonic() > deadline:
                self.run(["scancel", job_id])
                text = output.read_text() if output.exists() else ""
                pytest.fail(f"job {job_id} still in the queue after {timeout} s; "
                            f"{self.fields(job_id)}\n{text}")
            time.sleep(0.2)
        return Job(job_id, self.fields(job_id), output.read_text() if output.exists() else "")

    def wait_for_output(self, output: Path, text: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not (output.exists() and text in output.read_text()):
            if time.monotonic() > deadline:
                pytest.fail(f"{text!r} not in {output} after {timeout} s:\n"
                            + (output.read_text() if output.exists() else "(no file)"))
            time.sleep(0.1)


def _unavailable() -> str | None:
    if not sys.platform.startswith("linux"):
        return f"bin/slurm-local runs Slurm on Linux only, not {sys.platform}"
    if os.environ.get("MPISTRAT_SLURM_UNAVAILABLE"):
        return os.environ["MPISTRAT_SLURM_UNAVAILABLE"]
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    missing = [c for c in COMMANDS if shutil.which(c, path=path) is None]
    if missing:
        return (f"Slurm is not installed (no {', '.join(missing)}); install it with "
                f"'sudo bin/slurm-local install' (Debian/Ubuntu; .ci/run does this)")
    if os.geteuid() != 0:
        return "needs root: slurmd starts jobs as their user (run the tests as root, as CI does)"
    return None


def _free_port_pair() -> int:
    """A port p with p and p+1 free (slurmctld, slurmd)."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        if port >= 65535:
            continue
        try:
            with socket.socket() as s1, socket.socket() as s2:
                s1.bind(("", port))
                s2.bind(("", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free TCP ports")


def _give_up(reason: str):
    if os.environ.get("MPISTRAT_SLURM_REQUIRED") == "1":
        pytest.fail(f"Slurm tests required (MPISTRAT_SLURM_REQUIRED=1) but: {reason}",
                    pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm():
    """Start a single-node Slurm for the session (see the module docstring)."""
    reason = _unavailable()
    if reason:
        _give_up(reason)
    directory = Path(tempfile.mkdtemp(prefix="mpistrat-slurm-", dir="/tmp"))
    directory.chmod(0o755)  # munged's socket must be reachable through every parent
    venv_bin = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith(_FOREIGN)}
    env["PATH"] = f"{venv_bin}:{env.get('PATH', '')}:/usr/sbin:/sbin"
    control = {**env, "SLURM_LOCAL_DIR": str(directory), "SLURM_LOCAL_INSTALL": "0",
               "SLURM_LOCAL_REQUEUE_DELAY": "5"}

    def local(command, gpus=None):
        extra = {} if gpus is None else {"SLURM_LOCAL_GPUS": str(gpus)}
        return subprocess.run(["bash", str(SLURM_LOCAL), command], env={**control, **extra},
                              capture_output=True, text=True, timeout=120, check=False)

    gpus, gpu_note = 2, ""
    control["SLURM_LOCAL_PORT"] = str(_free_port_pair())
    started = local("start", gpus)
    if started.returncode != 0 and "mknod" in started.stderr:
        gpus, gpu_note = 0, started.stderr.strip().splitlines()[-1]
        started = local("start", gpus)
    if started.returncode != 0:
        local("stop")
        shutil.rmtree(directory, ignore_errors=True)
        tail = "\n".join((started.stdout + started.stderr).strip().splitlines()[-15:])
        _give_up(f"the single-node Slurm did not start (bin/slurm-local start): {tail}")
    env["SLURM_CONF"] = str(directory / "etc" / "slurm.conf")
    env["VENV"] = sys.prefix if sys.prefix != sys.base_prefix else "none"
    try:
        yield SlurmCluster(directory, env, gpus, gpu_note)
    finally:
        local("stop")
        shutil.rmtree(directory, ignore_errors=True)
