"""The job monitor process beside a plain hydra ``mpiexec`` (mpistrat/runner/sidecar.py):
finding the launcher among a rank's ancestors, telling a lost host from a job the
launcher ended itself, and the process itself, started as a rank starts it, writing into
the launcher's standard error. (tests/cluster/test_faults.py runs it across real hosts.)"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from mpistrat.runner import sidecar
from mpistrat.runner.monitor import MONITOR_ENV, JobMonitor, MonitorClient

HOSTS = ("node1", "node1", "node2", "node2")
SECRET = bytes(range(32))


def _settle(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "not seen in time"
        time.sleep(0.01)


def _proc(tmp_path, processes):
    """A fake /proc: {pid: (command name, parent pid)}."""
    for pid, (name, parent) in processes.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({name}) S {parent} 1 1 0 -1\n")
    return str(tmp_path)


def test_the_launcher_is_the_mpiexec_above_the_hydra_proxy(tmp_path):
    proc = _proc(tmp_path, {
        10: ("bash", 1), 20: ("mpiexec", 10), 30: ("sh", 20),  # ssh stand-in, or none
        40: ("hydra_pmi_proxy", 30), 50: ("python3 (rank)", 40),
        60: ("python3", 10),  # not under a proxy
        70: ("hydra_pmi_proxy", 5), 80: ("python3", 70),  # a proxy started over ssh
    })
    assert sidecar.hydra_launcher(50, proc) == 20
    assert sidecar.hydra_launcher(60, proc) is None
    assert sidecar.hydra_launcher(80, proc) is None  # its mpiexec is on another host
    assert sidecar.hydra_launcher(99, proc) is None


def _clients(address, hosts=HOSTS, secret=SECRET):
    return [MonitorClient.connect({MONITOR_ENV: address}, rank, host, secret)
            for rank, host in enumerate(hosts)]


def _vanish(monitor, client):
    client._sock.close()  # as the kernel does for a killed process: no 'end' line
    _settle(lambda: monitor.records[client.rank].closed is not None)


@pytest.fixture
def monitor():
    monitor = JobMonitor(4, secret=SECRET).start()
    yield monitor
    monitor.close()


def _joined(monitor):
    clients = _clients(sidecar.address(monitor._listener))
    _settle(lambda: len(monitor.records) == 4)
    return clients


def test_a_host_whose_ranks_vanish_together_first_is_named(monitor):
    clients = _joined(monitor)
    _vanish(monitor, clients[3])
    # hydra ends here: it lost node2's proxy
    _vanish(monitor, clients[2])  # (a big process closes its sockets late)
    time.sleep(0.05)
    for client in clients[:2]:  # hydra's proxies kill the others
        _vanish(monitor, client)
    text = sidecar.verdict(monitor)
    assert text.startswith("mpistrat run: the first ranks to end without a report were every "
                           "rank of host node2 (ranks 2, 3): rank 3 at "), text
    assert "If mpiexec says 'assert (!closed) failed' above, the job lost that host" in text


def test_a_rank_that_crashed_alone_is_no_lost_host(monitor):
    """Its host-mates are killed tens of ms later, together with the other hosts' ranks."""
    clients = _joined(monitor)
    _vanish(monitor, clients[3])
    assert sidecar.verdict(monitor) is None  # node2 is not gone whole
    time.sleep(0.05)
    for rank in (0, 2, 1):
        _vanish(monitor, clients[rank])
    assert sidecar.verdict(monitor) is None


def test_ranks_after_a_reported_failure_are_no_lost_host(monitor):
    clients = _joined(monitor)
    clients[0].end(1)  # a failure reported, then hydra ends everyone
    _settle(lambda: monitor.records[0].closed is not None)
    for rank in (2, 3, 1):
        _vanish(monitor, clients[rank])
    assert sidecar.verdict(monitor) is None


def _launcher(tmp_path):
    """A stand-in for mpiexec: a process whose standard error is a file."""
    err = open(tmp_path / "mpiexec.err", "w")  # noqa: SIM115 - the child keeps it
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             stderr=err)
    err.close()
    return child


def _sidecar_pids():
    out = subprocess.run(["pgrep", "-f", "from mpistrat.runner.sidecar import main"],
                         capture_output=True, text=True, check=False).stdout
    return {int(p) for p in out.split()}


def test_the_monitor_process_writes_the_lost_host_into_the_launchers_stderr(tmp_path):
    launcher = _launcher(tmp_path)
    try:
        before = _sidecar_pids()
        address = sidecar._spawn(launcher.pid, 4, SECRET, "127.0.0.1")
        assert address is not None
        child = sidecar._CHILD[-1]
        clients = _clients(address)
        assert all(clients)
        time.sleep(0.5)  # the hellos are read
        # it imports the standard library only (a quick start): no NumPy mapped
        assert "numpy" not in open(f"/proc/{child.pid}/maps").read()
        for client in clients[2:]:
            client._sock.close()
        time.sleep(0.1)
        launcher.kill()
        launcher.wait()
        time.sleep(0.01)
        for client in clients[:2]:
            client._sock.close()
        assert child.wait(10) == 0
    finally:
        if launcher.poll() is None:
            launcher.kill()
    text = (tmp_path / "mpiexec.err").read_text()
    assert re.match(r"mpistrat run: the first ranks to end without a report were every rank "
                    r"of host node2 \(ranks 2, 3\): rank [23] at [\d:]+, the others within",
                    text), text
    assert _sidecar_pids() <= before


def test_the_monitor_process_ends_with_a_job_that_ends_well(tmp_path):
    launcher = _launcher(tmp_path)
    try:
        address = sidecar._spawn(launcher.pid, 4, SECRET, "127.0.0.1")
        child = sidecar._CHILD[-1]
        for client in _clients(address):
            client.end(0)
        assert child.wait(10) == 0  # at once, the launcher still running
        assert launcher.poll() is None
    finally:
        launcher.kill()
        launcher.wait()
    assert (tmp_path / "mpiexec.err").read_text() == ""


def test_forged_lines_write_no_verdict_into_the_launchers_stderr(tmp_path):
    """Someone who finds the monitor's port forges the hellos of node2's ranks and closes
    (the old monitor took them as node2's ranks vanishing, and wrote a false lost host
    into mpiexec's stderr once mpiexec ended). Here node2's real ranks stay connected
    and silent; nothing is written."""
    import socket

    launcher = _launcher(tmp_path)
    clients = []
    try:
        address = sidecar._spawn(launcher.pid, 4, SECRET, "127.0.0.1")
        child = sidecar._CHILD[-1]
        clients = _clients(address)
        assert all(clients)
        time.sleep(0.5)  # the hellos are read
        port = int(address.split()[0])
        for line in (b"hello 2 node2 999\n", b"hello 3 node2 999\n"):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(line)
        time.sleep(0.2)
        for client in clients[:2]:
            client.end(0)
        launcher.kill()
        launcher.wait()
        assert child.wait(10) == 0
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for client in clients[2:]:
            client._sock.close()
    assert (tmp_path / "mpiexec.err").read_text() == ""


def test_no_launcher_to_report_to_starts_nothing():
    assert sidecar._spawn(2 ** 22 + 12345, 4, SECRET, "") is None  # no such process


class _Comm:
    """One rank's view of a job whose ranks all report the same (allgather, bcast)."""

    def __init__(self, hosts):
        self.hosts = hosts

    def allgather(self, value):
        return [(host, value[1]) for host in self.hosts]

    def bcast(self, value, root):
        return value

    def Get_size(self):
        return len(self.hosts)


def test_a_job_on_one_host_or_not_under_hydra_starts_nothing(monkeypatch):
    monkeypatch.setattr(sidecar, "_spawn", lambda *a: pytest.fail("started"))
    monkeypatch.setattr(sidecar, "hydra_launcher", lambda: 1234)
    assert sidecar.start(_Comm(["a", "a"]), 0, "a", SECRET) is None  # one host
    monkeypatch.setattr(sidecar, "hydra_launcher", lambda: None)
    assert sidecar.start(_Comm(["a", "b"]), 0, "a", SECRET) is None  # srun, Open MPI, ssh'd

