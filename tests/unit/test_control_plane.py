"""The job's control plane as an attacker sees it (docs/security.md): the job monitor fed
forged, replayed, malformed and oversized lines and thousands of connections; report
files from earlier jobs, from strangers and behind links; the secret kept off every
command line. Each of these changed a healthy job's outcome, or stopped the monitor,
before. (The liveness probe's attacks are in test_watchdog.py, beside its fixture.)"""

from __future__ import annotations

import os
import re
import resource
import socket
import subprocess
import sys
import time

import pytest

from mpistrat.launch.mpiexec import Launcher
from mpistrat.runner import auth
from mpistrat.runner.launch import job_hosts, launch_command
from mpistrat.runner.monitor import (MAX_LINE, MAX_PENDING, MONITOR_ENV, JobMonitor,
                                     MonitorClient, bind_address)
from mpistrat.runner.options import RunOptions
from mpistrat.runner.reports import read_report, write_report

HOSTS = ("node1", "node1", "node2", "node2")
KEY = bytes(range(32))


def _settle(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "not seen in time"
        time.sleep(0.01)


def _port(monitor):
    return int(monitor.env()[MONITOR_ENV].split()[0])


def _forger(monitor, lines, read_greeting=True):
    """Connect as an attacker would, send ``lines`` (bytes), and return the socket."""
    sock = socket.create_connection(("127.0.0.1", _port(monitor)), timeout=5)
    if read_greeting:
        sock.recv(64)
    for line in lines:
        sock.sendall(line)
    return sock


def _closed_by_peer(sock, timeout=5.0):
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True


@pytest.fixture
def monitor():
    monitor = JobMonitor(2, secret=KEY).start()
    yield monitor
    monitor.close()


@pytest.mark.parametrize("line", [
    b"hello 1 node1 999\n",  # the old protocol: no authentication at all
    b"hello 1 node1 999 " + b"0" * 64 + b"\n",  # a made-up tag
    "hello ² h 1\n".encode(),  # str.isdigit() accepts it, int() does not
    b"hello 7 node1 999 " + b"0" * 64 + b"\n",
    b"end 1\n",
    b"\xff\xfe garbage \x00\n",
])
def test_a_forged_or_malformed_line_is_refused_and_changes_nothing(monitor, line):
    sock = _forger(monitor, [line])
    assert _closed_by_peer(sock)
    sock.close()
    _settle(lambda: monitor.refused == 1)
    assert monitor.records == {}
    # the monitor still works: the real ranks are accepted and their end recorded
    env = {MONITOR_ENV: monitor.env()[MONITOR_ENV]}
    clients = [MonitorClient.connect(env, rank, "node1", KEY) for rank in range(2)]
    _settle(lambda: len(monitor.records) == 2)
    for client in clients:
        client.end(0)
    _settle(monitor.settled)
    assert not monitor.troubled()
    assert monitor.first_refusal.startswith("from 127.0.0.1:")


def test_a_hello_with_the_right_tag_but_a_rank_outside_the_job_is_refused(monitor):
    """A rank >= size (the old monitor took it, and its summary ended in an IndexError):
    here even a correctly authenticated one is refused."""
    sock = _forger(monitor, [], read_greeting=False)
    challenge = sock.recv(64).split()[-1].decode()
    mac = auth.tag(KEY, "hello", challenge, 7, "node1", 999).hex()
    sock.sendall(f"hello 7 node1 999 {mac}\n".encode())
    assert _closed_by_peer(sock)
    sock.close()
    _settle(lambda: monitor.refused == 1)
    assert "rank 7 is not one of the job's 2" in monitor.first_refusal
    assert monitor.records == {}
    assert monitor.summary(1) is None  # (no traceback)


def test_a_hello_recorded_on_one_connection_is_worth_nothing_on_another(monitor):
    """A replay: the bytes a real rank sent, sent again on a new connection (whose
    challenge differs), and a second hello of an accepted rank."""
    env = {MONITOR_ENV: monitor.env()[MONITOR_ENV]}
    client = MonitorClient.connect(env, 0, "node1", KEY)
    _settle(lambda: 0 in monitor.records)
    recorded = f"hello 0 node1 {os.getpid()} " + auth.tag(
        KEY, "hello", client._challenge, 0, "node1", os.getpid()).hex() + "\n"
    sock = _forger(monitor, [recorded.encode()])
    assert _closed_by_peer(sock)
    sock.close()
    _settle(lambda: monitor.refused == 1)
    assert "without this job's authentication" in monitor.first_refusal
    again = MonitorClient.connect(env, 0, "elsewhere", KEY)  # with the secret, even
    _settle(lambda: monitor.refused == 2)
    assert monitor.records[0].host == "node1"
    again.end(1)
    client.end(0)
    _settle(lambda: monitor.records[0].status is not None)
    assert monitor.records[0].status == 0


def test_a_forged_end_on_a_real_ranks_connection_is_not_taken():
    """An 'end' line needs the tag of the connection's challenge (only the rank itself
    can send on its connection; this checks the line is authenticated anyway)."""
    with JobMonitor(1, secret=KEY) as monitor:
        client = MonitorClient.connect(monitor.env(), 0, "node1")
        _settle(lambda: 0 in monitor.records)
        client._sock.sendall(b"end 1 " + b"a" * 64 + b"\n")
        _settle(lambda: monitor.refused == 1)
        assert monitor.records[0].status is None
        client.end(0)
        _settle(lambda: monitor.records[0].status == 0)


def test_a_megabyte_line_is_cut_off_without_holding_it(monitor):
    sock = _forger(monitor, [])
    try:
        sock.sendall(b"x" * (1 << 20))  # no newline
    except OSError:
        pass  # (closed while sending: the point)
    assert _closed_by_peer(sock)
    sock.close()
    _settle(lambda: monitor.refused == 1)
    assert f"a line longer than {MAX_LINE} bytes" in monitor.first_refusal


def test_two_thousand_connections_do_not_lock_the_ranks_out(monitor):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    held = []
    try:
        for _ in range(2000):
            held.append(socket.create_connection(("127.0.0.1", _port(monitor)), timeout=5))
        # at most MAX_PENDING of them are kept; the ranks still get in at once
        env = {MONITOR_ENV: monitor.env()[MONITOR_ENV]}
        clients = [MonitorClient.connect(env, rank, "node1", KEY) for rank in range(2)]
        assert all(clients)
        _settle(lambda: len(monitor.records) == 2)
        assert len(monitor._pending) <= MAX_PENDING
        assert monitor.refused >= 2000 - MAX_PENDING
    finally:
        for sock in held:
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


_EXHAUSTED = """
import resource, socket, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))
from mpistrat.runner.monitor import JobMonitor, MONITOR_ENV
monitor = JobMonitor(2, secret=bytes(range(32))).start()
print(monitor.env()[MONITOR_ENV], flush=True)
sys.stdin.readline()                           # connections flood in here
start = time.process_time()
time.sleep(2.0)
print(round(time.process_time() - start, 3), len(monitor.records), monitor.refused, flush=True)
"""


def test_a_monitor_out_of_file_descriptors_neither_spins_nor_stops():
    """With every descriptor taken, accept() fails; the listener stays readable, and the
    old accept loop spun a core on it. Now it frees the oldest pending connection, or
    pauses accepting."""
    child = subprocess.Popen([sys.executable, "-c", _EXHAUSTED], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    held = []
    try:
        address = child.stdout.readline().strip()
        port = int(address.split()[0])
        for _ in range(100):
            try:
                held.append(socket.create_connection(("127.0.0.1", port), timeout=1))
            except OSError:
                break
        child.stdin.write("\n")
        child.stdin.flush()
        time.sleep(0.5)
        # a real rank still gets in, in the middle of the flood
        env = {MONITOR_ENV: address}
        client = MonitorClient.connect(env, 0, "node1", KEY)
        assert client is not None
        cpu, records, refused = child.stdout.readline().split()
        client.end(0)
    finally:
        for sock in held:
            sock.close()
        child.kill()
        child.wait()
    assert int(records) == 1
    assert int(refused) > 0
    assert float(cpu) < 1.0, f"the monitor used {cpu} s of CPU in 2 s: it spins"


def test_host_names_reach_the_terminal_as_printable_text(monitor):
    env = {MONITOR_ENV: monitor.env()[MONITOR_ENV]}
    client = MonitorClient.connect(env, 0, "evil\x1b[2J\x1b]0;pwned\x07host", KEY)
    _settle(lambda: 0 in monitor.records)
    assert monitor.records[0].host == "evil?[2J?]0;pwned?host"
    client._sock.close()
    _settle(lambda: monitor.records[0].closed is not None)
    text = monitor.summary(1)
    assert "\x1b" not in text and "\x07" not in text


# -- where it listens, and where the secret travels


def test_a_job_on_this_host_alone_is_monitored_on_the_loopback(monkeypatch):
    for name in ("HYDRA_HOST_FILE", "SLURM_JOB_NODELIST", "SLURM_NODELIST", "PBS_NODEFILE"):
        monkeypatch.delenv(name, raising=False)
    assert job_hosts() == [socket.gethostname()]
    assert bind_address(job_hosts()) == "127.0.0.1"
    with JobMonitor(2, bind=bind_address(job_hosts())) as monitor:
        assert monitor._listener.getsockname()[0] == "127.0.0.1"
        assert monitor.env()[MONITOR_ENV].split()[2] == "127.0.0.1"


def test_the_hosts_of_a_host_file_or_an_allocation(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("# the cluster\nnode1:2\nnode2 slots=2\n\n")
    assert job_hosts({"HYDRA_HOST_FILE": str(hosts)}) == ["node1", "node2"]
    assert job_hosts({"SLURM_JOB_NODELIST": "gpu[01-03]"}) == ["gpu01", "gpu02", "gpu03"]
    assert job_hosts({"PBS_NODEFILE": "/x"}) is None  # not read here: every address
    assert bind_address(None) == ""
    assert bind_address(["localhost", socket.gethostname()]) == "127.0.0.1"
    # hydra's HYDRA_IFACE: the interface its proxies call back on (bin/cluster-local's
    # bridge); a host name this host cannot resolve: every address (still authenticated)
    assert bind_address(["node1", "node2"], "lo") == "127.0.0.1"
    assert bind_address(["no-such-host.invalid"]) == ""


def test_the_secret_reaches_the_ranks_by_environment_never_the_command_line(monkeypatch):
    monkeypatch.setattr("mpistrat.launch.selflaunch.find_launcher",
                        lambda *a: Launcher("/x/mpiexec", flavour))
    options = RunOptions(target="train.py")
    for flavour in ("mpich", "openmpi"):
        with JobMonitor(2) as monitor:
            argv = launch_command(options, 2, rank_env={})
            secret = auth.encode(monitor.secret)
            assert os.environ[auth.SECRET_ENV] == secret  # (mpiexec and the ranks inherit)
            assert not any(secret in arg for arg in argv), argv
            assert not any(monitor.env()[MONITOR_ENV] in arg for arg in argv), argv
            if flavour == "openmpi":  # (Open MPI passes only what it is told to)
                assert ["-x", auth.SECRET_ENV] == argv[argv.index(auth.SECRET_ENV) - 1:][:2]
        assert auth.SECRET_ENV not in os.environ


def test_a_rank_takes_the_secret_out_of_its_environment(monkeypatch):
    secret = auth.new_secret()
    monkeypatch.setenv(auth.SECRET_ENV, auth.encode(secret))
    assert auth.take_secret() == secret
    assert auth.SECRET_ENV not in os.environ  # (the script's children do not get it)
    assert auth.take_secret() == secret
    assert auth.decode("zz" * 32) is None and auth.decode("ab") is None


# -- report files


def test_a_report_left_by_an_earlier_job_is_not_shown(tmp_path, monkeypatch):
    monkeypatch.delenv(MONITOR_ENV, raising=False)
    (tmp_path / "rank-1.txt").write_text("PeerLostError: lost host node9 (last week)\n")
    earlier = auth.new_secret()
    write_report(str(tmp_path / "rank-2.txt"), "STALE-REPORT", earlier, 2, "node2")
    (tmp_path / "rank-3.txt").symlink_to("/etc/passwd")
    with JobMonitor(4, report_dir=str(tmp_path)) as monitor:
        clients = [MonitorClient.connect(monitor.env(), r, h) for r, h in enumerate(HOSTS)]
        _settle(lambda: len(monitor.records) == 4)
        clients[0].end(1)
        _settle(lambda: monitor.records[0].closed is not None)
        monitor_text = monitor.summary(1, str(tmp_path))  # ranks 1-3 silent
        for client in clients[1:]:
            client.end(0)
    assert "node9" not in monitor_text and "STALE-REPORT" not in monitor_text
    assert "root:" not in monitor_text
    assert re.search(r"rank-1\.txt is ignored: it was not written by this job", monitor_text)
    assert re.search(r"rank-2\.txt is ignored: it was not written by this job", monitor_text)
    assert re.search(r"rank-3\.txt is ignored: it cannot be opened", monitor_text)


def test_a_report_of_this_job_is_read_back_printable(tmp_path):
    path = str(tmp_path / "rank-2.txt")
    write_report(path, "PeerLostError: \x1b[31mlost\x1b[0m host node1\n", KEY, 2, "node2")
    text, why = read_report(path, KEY, 2)
    assert why is None and text == "PeerLostError: ?[31mlost?[0m host node1"
    assert read_report(path, KEY, 3)[0] is None  # another rank's name for it
    with open(path, "a") as file:
        file.write("appended by someone else\n")
    assert read_report(path, KEY, 2)[0] is None
    assert read_report(str(tmp_path / "none.txt"), KEY, 2) == (None, None)


def test_a_report_is_never_written_through_a_planted_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / "rank-0.txt").symlink_to(victim)
    for name in ("rank-0.txt.tmp", "rank-0.txt.%d.tmp" % os.getpid()):
        (tmp_path / name).symlink_to(victim)  # the old fixed temporary names
    write_report(str(tmp_path / "rank-0.txt"), "the report", KEY, 0, "node1")
    assert victim.read_text() == "precious\n"
    assert not (tmp_path / "rank-0.txt").is_symlink()
    assert read_report(str(tmp_path / "rank-0.txt"), KEY, 0)[0] == "the report"
