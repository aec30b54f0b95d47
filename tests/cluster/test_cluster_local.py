"""``bin/cluster-local`` itself: its commands, its refusals and that ``down`` leaves nothing.

These tests build clusters of their own — a name ``msx<4 digits>``, a subnet ``10.80.X``
and a directory of their own, unlike the session fixture's ``mst*`` cluster — so they
neither touch it nor depend on it. Like the fixture they need root and namespaces (skip,
or fail with ``MPISTRAT_CLUSTER_REQUIRED=1``); the test of the non-root refusal runs the
script as the user ``nobody``.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from _cluster import give_up, unavailable, wait_until

pytestmark = pytest.mark.cluster


CLUSTER_LOCAL = Path(__file__).resolve().parents[2] / "bin" / "cluster-local"


_FOREIGN = ("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "PMI_", "PMIX_", "OMPI_", "HYDRA_",
            "MPISTRAT_", "MPIR_CVAR_", "FI_", "CLUSTER_LOCAL_")


class Local:
    """``bin/cluster-local`` for a cluster of this module's own (name, subnet, directory)."""

    def __init__(self, parent: Path):
        self.name = f"msx{random.randint(0, 9999):04d}"
        self.subnet = f"10.80.{random.randint(1, 250)}"
        self.directory = parent / "c"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(_FOREIGN)}
        self.env.update(PATH=f"{self.env.get('PATH', '')}:/usr/sbin:/sbin",
                        CLUSTER_LOCAL_NAME=self.name, CLUSTER_LOCAL_SUBNET=self.subnet,
                        CLUSTER_LOCAL_DIR=str(self.directory))

    def __call__(self, *args, user: str | None = None, timeout=60) -> subprocess.CompletedProcess:
        script = CLUSTER_LOCAL
        if user:  # a copy the user can read wherever the checkout is; runuser keeps the
            # environment (CLUSTER_LOCAL_*)
            copy = self.directory.parent / "bin"
            copy.mkdir(mode=0o755, exist_ok=True)
            for name in ("cluster-local", "_slurm.sh"):
                shutil.copy(CLUSTER_LOCAL.with_name(name), copy / name)
                (copy / name).chmod(0o755)
            script = copy / "cluster-local"
        argv = ["bash", str(script), *map(str, args)]
        if user:
            argv = ["runuser", "-u", user, "--", *argv]
        return subprocess.run(argv, env=self.env, capture_output=True, text=True,
                              timeout=timeout, check=False)

    def ok(self, *args) -> subprocess.CompletedProcess:
        result = self(*args)
        assert result.returncode == 0, (
            f"bin/cluster-local {' '.join(map(str, args))} failed ({result.returncode}):\n"
            f"{result.stdout}{result.stderr}")
        return result

    def leftovers(self) -> list[str]:
        """Everything of this cluster that exists: namespaces and the processes in them,
        links (the bridge too), /etc/netns entries, mounts, processes naming its
        directory, the directory."""
        found = []
        netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                               check=False).stdout
        for ns in [line.split()[0] for line in netns.splitlines()
                   if line.startswith(f"{self.name}-")]:
            found.append(f"namespace {ns}")
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                  text=True, check=False).stdout.split()
            found += [f"process {pid} in {ns}" for pid in pids]
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True,
                               check=False).stdout
        found += [f"link {m}" for m in re.findall(r"^\d+: ([^:@]+)", links, re.M)
                  if m.startswith(self.name)]
        if Path("/etc/netns").is_dir():
            found += [f"/etc/netns/{p.name}" for p in Path("/etc/netns").iterdir()
                      if p.name.startswith(f"{self.name}-")]
        found += [f"mount {line.split()[1]}" for line in Path("/proc/mounts").read_text()
                  .splitlines() if str(self.directory) in line]
        for proc in Path("/proc").iterdir():
            try:
                command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except (OSError, ValueError):
                continue
            if proc.name.isdigit() and (str(self.directory) in command
                                        or f"{self.name}-node" in command):
                found.append(f"process {proc.name}: {command}")
        if self.directory.exists():
            found.append(f"directory {self.directory}")
        return found


@pytest.fixture
def local():
    reason = unavailable()
    if reason:
        give_up(reason)
    parent = Path(tempfile.mkdtemp(prefix="mpistrat-cluster-local-", dir="/tmp"))
    parent.chmod(0o755)
    control = Local(parent)
    try:
        yield control
    finally:
        control("down", timeout=120)
        shutil.rmtree(parent, ignore_errors=True)


@pytest.fixture
def up(local):
    """A cluster of 2 hosts (no Slurm: quick) of this test's own, with jumbo frames."""
    result = local("up", "--hosts", "2", "--slots", "2", "--mtu", "9000")
    if result.returncode == 2:
        give_up(f"bin/cluster-local up: {result.stderr.strip()}")
    assert result.returncode == 0, f"up failed ({result.returncode}):\n{result.stderr}"
    return local


@pytest.mark.parametrize("args, named", [
    (["up", "--hosts", "0"], "--hosts '0'"),
    (["up", "--hosts", "two"], "--hosts 'two'"),
    (["up", "--hosts"], "--hosts ''"),
    (["up", "--hosts", "2", "--link-rate", "fast"], "--link-rate 'fast'"),
    (["up", "--hosts", "2", "--slots", "0"], "--slots '0'"),
    (["up", "--hosts", "2", "--mtu", "100"], "--mtu '100'"),
    (["up", "--hosts", "2", "--mtu", "jumbo"], "--mtu 'jumbo'"),
    (["up", "--hosts", "2", "--bogus"], "'--bogus'"),
])
def test_bad_arguments_are_refused_and_build_nothing(local, args, named):
    result = local(*args)
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert named in result.stderr, f"the message does not name {named}: {result.stderr}"
    assert local.leftovers() == [], f"a refused {args} left {local.leftovers()}"


def test_a_bad_cluster_name_is_refused(local):
    local.env["CLUSTER_LOCAL_NAME"] = "Bad-Name"
    result = local("up", "--hosts", "1")
    assert result.returncode == 2 and "CLUSTER_LOCAL_NAME='Bad-Name'" in result.stderr, (
        result.returncode, result.stderr)
    assert local.leftovers() == [], local.leftovers()


def test_not_root_is_refused_with_a_clear_message(local):
    if shutil.which("runuser") is None:
        pytest.fail("runuser (util-linux) is needed to run bin/cluster-local as 'nobody'")
    for args in (["up", "--hosts", "2"], ["down"]):
        result = local(*args, user="nobody")
        assert result.returncode == 2, (args, result.returncode, result.stderr)
        assert "needs root" in result.stderr and "sudo" in result.stderr, (args, result.stderr)
    assert local.leftovers() == [], local.leftovers()


def test_commands_of_a_running_cluster(up):
    # a second up is refused and leaves the first alone
    again = up("up", "--hosts", "3")
    assert again.returncode == 2 and "already up" in again.stderr, (again.returncode,
                                                                     again.stderr)
    status = up.ok("status").stdout
    assert (f"2 host(s), 2 slot(s) each, links unshaped, MTU 9000; bridge {up.name}br"
            in status), status
    # --mtu: both ends of every link and the bridge
    assert "mtu 9000" in subprocess.run(["ip", "link", "show", f"{up.name}br"],
                                        capture_output=True, text=True).stdout
    for i in (1, 2):
        assert "mtu 9000" in subprocess.run(["ip", "link", "show", f"{up.name}v{i}"],
                                            capture_output=True, text=True).stdout, i
        assert "mtu 9000" in up.ok("exec", f"node{i}", "ip", "link", "show", "eth0").stdout
    for i in (1, 2):
        assert re.search(rf"^node{i} +{re.escape(up.subnet)}\.{i} +{up.name}-node{i} +up ",
                         status, re.M), status

    env = up.ok("env").stdout
    for expected in (f"HYDRA_LAUNCHER_EXEC={up.directory}/bin/ssh",
                     f"HYDRA_HOST_FILE={up.directory}/hostfile",
                     "MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp", "MPISTRAT_LINK_MTU=9000"):
        assert expected in env, env
    assert "SLURM_CONF" not in env, env  # no --slurm
    assert (up.directory / "hostfile").read_text().split() == ["node1:2", "node2:2"]

    for host in ("node2", f"{up.subnet}.2", "2"):
        assert up.ok("exec", host, "hostname").stdout.strip() == "node2", host
    assert up.ok("exec", "node1", "hostname").stdout.strip() == "node1"
    unknown = up("exec", "node3", "hostname")
    assert unknown.returncode == 2 and "unknown host 'node3'" in unknown.stderr, (
        unknown.returncode, unknown.stderr)
    # hydra's ssh stand-in: options skipped, the command string run on the host
    assert up.ok("ssh", "-x", "-o", "BatchMode=yes", "node2", "hostname; echo $((6 * 7))"
                 ).stdout.split() == ["node2", "42"]

    def reach() -> str:  # node1 -> node2: a closed port answers at once while the link is up
        probe = ("import socket\ntry:\n socket.create_connection(('%s.2', 9), timeout=1)\n"
                 "except ConnectionRefusedError: print('refused')\n"
                 "except OSError as e: print(type(e).__name__)" % up.subnet)
        return up.ok("exec", "node1", sys.executable, "-c", probe).stdout.strip()

    assert reach() == "refused"
    up.ok("link", "node2", "down")
    assert re.search(r"^node2 .* down ", up.ok("status").stdout, re.M)
    assert reach() != "refused", "node2 answered with its link down"
    up.ok("link", "node2", "up")
    assert re.search(r"^node2 .* up ", up.ok("status").stdout, re.M)
    wait_until(lambda: reach() == "refused", 10, "node2 answers again after link up")
    bad = up("link", "node2", "sideways")
    assert bad.returncode == 2 and "sideways" in bad.stderr, (bad.returncode, bad.stderr)

    up.ok("shape", "500mbit")
    for dev in (f"{up.name}v1", f"{up.name}v2"):
        qdisc = subprocess.run(["tc", "qdisc", "show", "dev", dev], capture_output=True,
                               text=True, check=True).stdout
        assert "tbf" in qdisc and "rate 500Mbit" in qdisc, (dev, qdisc)
    assert "links 500mbit" in up.ok("status").stdout
    up.ok("shape", "off")
    qdisc = subprocess.run(["tc", "qdisc", "show", "dev", f"{up.name}v1"],
                           capture_output=True, text=True, check=True).stdout
    assert "tbf" not in qdisc, qdisc
    assert "links unshaped" in up.ok("status").stdout
    bad = up("shape", "fast")
    assert bad.returncode == 2 and "'fast'" in bad.stderr, (bad.returncode, bad.stderr)


def test_down_twice_leaves_nothing(up):
    """Also a process still running in a host (a rank of a killed job, say) ends."""
    # `exec` execs nsenter, unshare, sh and sleep in turn: one process, sleeper.pid
    sleeper = subprocess.Popen(["bash", str(CLUSTER_LOCAL), "exec", "node2", "sleep", "300"],
                               env=up.env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until(lambda: f"process {sleeper.pid} in {up.name}-node2" in up.leftovers()
                   or sleeper.poll() is not None, 10, "a process running in node2")
        assert sleeper.poll() is None, f"the process in node2 ended ({sleeper.returncode})"
        first = up("down")
        assert first.returncode == 0, first.stderr
        assert sleeper.wait(timeout=10) == -9, "down did not kill the process in node2"
        assert up.leftovers() == [], f"after down: {up.leftovers()}"
        second = up("down")
        assert second.returncode == 0, f"a second down failed: {second.stderr}"
        assert up.leftovers() == [], f"after a second down: {up.leftovers()}"
        status = up("status")
        assert status.returncode == 2 and "no cluster is up" in status.stderr, (
            status.returncode, status.stderr)
    finally:
        if sleeper.poll() is None:
            os.killpg(sleeper.pid, 9)
            sleeper.wait()
