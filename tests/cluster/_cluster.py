"""What the tests of this directory share besides the fixtures: whether this process may
build clusters, and polling with a bound. (Imported as ``_cluster``: a helper module of its
own, since ``from conftest import`` could find another directory's conftest.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def unavailable() -> str | None:
    """Why no cluster can be built here, or None."""
    if not sys.platform.startswith("linux"):
        return f"bin/cluster-local needs Linux namespaces, not {sys.platform}"
    if os.environ.get("MPISTRAT_CLUSTER_UNAVAILABLE"):
        return os.environ["MPISTRAT_CLUSTER_UNAVAILABLE"]
    if os.geteuid() != 0:
        return "needs root to create network namespaces (run the tests as root, as CI does)"
    return None


def give_up(reason: str):
    """Skip with the reason, or fail with MPISTRAT_CLUSTER_REQUIRED=1 (CI as root)."""
    if os.environ.get("MPISTRAT_CLUSTER_REQUIRED") == "1":
        pytest.fail(f"multi-host tests required (MPISTRAT_CLUSTER_REQUIRED=1) but: {reason}",
                    pytrace=False)
    pytest.skip(reason)


def wait_until(predicate, timeout: float, what: str, interval: float = 0.1):
    """Poll ``predicate`` until it is true; fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not after {timeout} s")
        time.sleep(interval)


def processes(cluster, host: str) -> dict[int, str]:
    """pid -> command line of every process on ``host`` (its network namespace)."""
    namespace = f"{cluster.control['CLUSTER_LOCAL_NAME']}-{host}"
    listed = subprocess.run(["ip", "netns", "pids", namespace],
                            capture_output=True, text=True, timeout=30, check=False)
    found = {}
    for pid in map(int, listed.stdout.split()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as file:
                found[pid] = file.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
    return found


def kill_host(cluster, host: str, keep_slurmd: bool = True) -> None:
    """SIGKILL every process of ``host`` (but its slurmd, which the Slurm tests need,
    unless ``keep_slurmd`` is False)."""
    for pid, cmd in processes(cluster, host).items():
        if keep_slurmd and cmd.startswith("slurmd "):
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Job:
    """A job under a launcher, its output to files (no pipe can fill up), run from
    ``cwd`` with the cluster's environment."""

    def __init__(self, cluster, argv, tmp_path: Path, cwd: Path | None = None) -> None:
        self.out, self.err = tmp_path / "job.out", tmp_path / "job.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.process = subprocess.Popen(
                [str(a) for a in argv], cwd=cwd or Path(__file__).resolve().parents[2],
                env=cluster.env, stdout=out, stderr=err, start_new_session=True)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)

    @property
    def output(self) -> str:
        return self.out.read_text() + self.err.read_text()
