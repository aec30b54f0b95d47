"""Real hosts on this machine for the tests in this directory: ``bin/cluster-local``.

The session fixture ``cluster`` brings up 2 hosts (``node1``, ``node2``: network and UTS
namespaces joined by veth links to a bridge) under a private name, subnet and directory, so
it neither needs nor disturbs another cluster on the machine, with a Slurm of one slurmd
per host when Slurm is installed. Every MPI run goes through hydra's ssh stand-in with
``MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp``, so the bytes between hosts cross the links;
a test checks the link counters (:meth:`Cluster.bytes`) to prove it. The cluster is torn
down after the session (``bin/cluster-local down``).

The tests skip, with the reason, when not root, when namespaces cannot be made, or when
``MPISTRAT_CLUSTER_UNAVAILABLE`` gives a reason; with ``MPISTRAT_CLUSTER_REQUIRED=1``
(``.ci/run`` sets it as root) they fail instead of skipping. The Slurm tests skip when
Slurm is not installed, as in tests/slurm (``MPISTRAT_SLURM_REQUIRED=1`` fails instead).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from _cluster import give_up, unavailable

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_LOCAL = ROOT / "bin" / "cluster-local"
VENV_BIN = str(Path(sys.executable).parent)
# Nothing of an outer launcher or job may leak into the cluster's runs.
_FOREIGN = ("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "PMI_", "PMIX_", "OMPI_", "HYDRA_",
            "MPISTRAT_", "MPIR_CVAR_", "FI_")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cluster: runs across the hosts of bin/cluster-local (skipped without them)")


@dataclass
class Cluster:
    """The running cluster: its environment and helpers to run across its hosts.

    Attributes:
        directory: CLUSTER_LOCAL_DIR of this cluster.
        env: the environment of a command launched across the hosts (``bin/cluster-local
            env`` applied: hydra's launcher shim and host file, the ofi/tcp transport, and
            ``SLURM_CONF`` when it has Slurm).
        control: the environment of ``bin/cluster-local`` itself for this cluster.
        hosts: the host names.
        slurm: None when the cluster runs Slurm, else why not.
    """

    directory: Path
    env: dict[str, str]
    control: dict[str, str]
    hosts: tuple[str, ...]
    slurm: str | None = None
    _log: list[str] = field(default_factory=list)

    def local(self, *args, timeout=120, check=True) -> subprocess.CompletedProcess:
        """Run ``bin/cluster-local ARGS`` for this cluster."""
        result = subprocess.run(["bash", str(CLUSTER_LOCAL), *map(str, args)], env=self.control,
                                capture_output=True, text=True, timeout=timeout, check=False)
        if check and result.returncode != 0:
            pytest.fail(f"bin/cluster-local {' '.join(map(str, args))} failed "
                        f"({result.returncode}):\n{result.stdout}{result.stderr}")
        return result

    def mpiexec(self, hosts: str, argv, *, env=None, timeout=120,
                options=()) -> subprocess.CompletedProcess:
        """``mpiexec -hosts HOSTS -n N ARGV`` from the root namespace, N from HOSTS
        (``node1:2,node2:2``: two ranks on each host, block placement)."""
        n = sum(int(part.split(":")[1]) for part in hosts.split(","))
        command = [str(Path(VENV_BIN) / "mpiexec"), "-hosts", hosts, *options, "-n", str(n),
                   *map(str, argv)]
        return self.run(command, env=env, timeout=timeout)

    def run(self, argv, *, env=None, timeout=120, cwd=ROOT) -> subprocess.CompletedProcess:
        """Run a command (mpiexec, mpistrat run -n, srun, sbatch ...) with the cluster's
        environment; a hang past ``timeout`` fails the test (the process group is killed)."""
        process = subprocess.Popen([str(a) for a in argv], cwd=cwd,
                                   env={**self.env, **(env or {})}, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            out, err = process.communicate()
            pytest.fail(f"{' '.join(map(str, argv))} still ran after {timeout} s:\n{out}{err}")
        return subprocess.CompletedProcess(process.args, process.returncode, out, err)

    def bytes(self) -> dict[str, tuple[int, int]]:
        """Per host: (bytes sent, bytes received) over its link since it came up."""
        text = self.local("bytes").stdout
        return {h: (int(s), int(r)) for h, s, r in re.findall(r"(\S+) (\d+) (\d+)", text)}

    def moved(self, before: dict[str, tuple[int, int]]) -> dict[str, int]:
        """Per host: bytes it sent over its link since ``before`` (from :meth:`bytes`)."""
        after = self.bytes()
        return {h: after[h][0] - before[h][0] for h in after}


def _free_port_pair() -> int:
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        try:
            with socket.socket() as s1, socket.socket() as s2:
                s1.bind(("", port))
                s2.bind(("", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free TCP ports")


def _slurm_missing() -> str | None:
    if os.environ.get("MPISTRAT_SLURM_UNAVAILABLE"):
        return os.environ["MPISTRAT_SLURM_UNAVAILABLE"]
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    missing = [c for c in ("munged", "slurmctld", "slurmd", "sbatch", "srun")
               if shutil.which(c, path=path) is None]
    if missing:
        return f"Slurm is not installed (no {', '.join(missing)}); sudo bin/slurm-local install"
    return None


@pytest.fixture(scope="session")
def cluster():
    """Two hosts of two slots each, with Slurm when it is installed (module docstring)."""
    reason = unavailable()
    if reason:
        give_up(reason)
    directory = Path(tempfile.mkdtemp(prefix="mpistrat-cluster-", dir="/tmp"))
    directory.chmod(0o755)  # munged's socket must be reachable through every parent
    base = {k: v for k, v in os.environ.items() if not k.startswith(_FOREIGN)}
    base["PATH"] = f"{VENV_BIN}:{base.get('PATH', '')}:/usr/sbin:/sbin"
    tag = f"{os.getpid() % 10000:04d}"
    control = {**base, "CLUSTER_LOCAL_DIR": str(directory / "c"),
               "CLUSTER_LOCAL_NAME": f"mst{tag}",
               "CLUSTER_LOCAL_SUBNET": f"10.79.{random.randint(1, 250)}",
               "CLUSTER_LOCAL_PORT": str(_free_port_pair()),
               "CLUSTER_LOCAL_REQUEUE_DELAY": "5"}
    slurm = _slurm_missing()
    args = ["up", "--hosts", "2", "--slots", "2"] + ([] if slurm else ["--slurm"])
    started = subprocess.run(["bash", str(CLUSTER_LOCAL), *args], env=control,
                             capture_output=True, text=True, timeout=120, check=False)

    def down():
        subprocess.run(["bash", str(CLUSTER_LOCAL), "down"], env=control, capture_output=True,
                       text=True, timeout=120, check=False)
        shutil.rmtree(directory, ignore_errors=True)

    if started.returncode != 0:
        down()
        tail = "\n".join((started.stdout + started.stderr).strip().splitlines()[-15:])
        if started.returncode == 2:   # a precondition: no namespaces, not root, ...
            give_up(f"bin/cluster-local up: {tail}")
        pytest.fail(f"bin/cluster-local {' '.join(args)} failed ({started.returncode}):\n{tail}")
    printed = subprocess.run(["bash", str(CLUSTER_LOCAL), "env"], env=control,
                             capture_output=True, text=True, timeout=30, check=True).stdout
    env = dict(base)
    for name, value in re.findall(r"(\w+)=(\S+)", printed):
        env[name] = value
    env["VENV"] = sys.prefix if sys.prefix != sys.base_prefix else "none"
    try:
        yield Cluster(directory / "c", env, control, ("node1", "node2"), slurm)
    finally:
        down()


@pytest.fixture
def slurm_cluster(cluster):
    """The cluster, when it runs Slurm (else skip, or fail with MPISTRAT_SLURM_REQUIRED=1)."""
    if cluster.slurm:
        if os.environ.get("MPISTRAT_SLURM_REQUIRED") == "1":
            pytest.fail(f"Slurm tests required but: {cluster.slurm}", pytrace=False)
        pytest.skip(cluster.slurm)
    return cluster

