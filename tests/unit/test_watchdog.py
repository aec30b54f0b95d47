"""The watchdog of ``mpistrat run`` and the job monitor of ``mpistrat run -n``, in one
process: ranks in words, the liveness probe over loopback between watchdogs, a collective
that outlasts the timeout, who reports, and the monitor's account of lost hosts."""

from __future__ import annotations

import signal
import socket
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from mpistrat.runtime.stall import AGREED, STARTED, new_entry
from mpistrat.runner.failure import outcome_of
from mpistrat.runner import auth
from mpistrat.runner.monitor import JobMonitor, MonitorClient
from mpistrat.runner.reports import write_report
from mpistrat.runner.watchdog import _HEADER, _PING, _PONG, _TAG, Watchdog, name_ranks

HOSTS = ("node1", "node1", "node2", "node2")
KEY = bytes(range(32))


@pytest.mark.parametrize("ranks, words", [
    ([2, 3], "host node2 (ranks 2, 3)"),
    ([3], "rank 3 (node2)"),
    ([0, 1, 3], "host node1 (ranks 0, 1) and rank 3 (node2)"),
    ([0, 1, 2, 3], "host node1 (ranks 0, 1) and host node2 (ranks 2, 3)"),
])
def test_ranks_are_named_by_host(ranks, words):
    assert name_ranks(ranks, HOSTS) == words


class FakeWatch:
    """What a Watchdog reads of mpistrat.runtime.stall.Watch."""

    def __init__(self, timeout=None, stall_check=None):
        self.timeout, self.stall_check = timeout, stall_check
        self.active = {}
        self.diagnose = None

    def describe(self, channel):
        return "the world communicator of 4 ranks"


@pytest.fixture
def dogs():
    """Four watchdogs (ranks 0-3, 'hosts' node1 and node2) talking over loopback; the
    first has a 0.5 s timeout. ``end`` is replaced by a recorder (it would exit)."""
    socks = []
    for _ in HOSTS:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("127.0.0.1", 0))
        sock.setblocking(False)
        socks.append(sock)
    peers = [(s.getsockname()[1], ["127.0.0.1"]) for s in socks]
    made = []
    for rank, sock in enumerate(socks):
        watch = FakeWatch(timeout=0.5 if rank == 0 else None)
        dog = Watchdog(watch, rank, HOSTS, peers, sock, key=KEY, report=lambda text: None)
        dog.ended = []
        dog.end = (lambda d: lambda status, text, reporter=True:
                   d.ended.append((status, text, reporter)))(dog)
        dog.phase = "running the script"
        dog._thread.start()
        made.append(dog)
    yield made
    for dog in made:
        if not dog._stopped.is_set():
            dog.stop()


def test_every_rank_answers_the_probe_with_what_it_does(dogs):
    diagnosis = dogs[0].probe()
    assert diagnosis.unreachable == []
    assert {r: a.state for r, a in diagnosis.answers.items()} == {
        r: "running the script" for r in range(4)}


def test_ranks_that_do_not_answer_are_unreachable_and_named_by_host(dogs):
    dogs[2].stop()
    dogs[3].stop()
    started = time.monotonic()
    diagnosis = dogs[0].probe()
    assert 0.9 <= time.monotonic() - started < 3.0  # the probe's wait, not longer
    assert diagnosis.unreachable == [2, 3]
    assert diagnosis.lost == {"node2": [2, 3]}
    assert diagnosis.names() == "host node2 (ranks 2, 3)"
    text = dogs[0].explain_missing([2, 3])
    assert text.startswith("Host node2 (ranks 2, 3) does not answer mpistrat's liveness probe")
    assert "the network between node1 and node2 failed (a partition)" in text


def _stuck_in_a_collective(watch, release):
    """A thread inside a 'collective' whose data exchange never completes."""
    entry = new_entry("all_reduce", SimpleNamespace(seq=7), time.monotonic(), sys._getframe())
    entry[AGREED] = entry[STARTED]
    watch.active[threading.get_ident()] = entry
    release.wait(10)


def train_step(watch, release):
    _stuck_in_a_collective(watch, release)


def test_a_collective_past_the_timeout_is_reported_naming_the_lost_host(dogs):
    dogs[2].stop()
    dogs[3].stop()
    release = threading.Event()
    stuck = threading.Thread(target=train_step, args=(dogs[0].watch, release))
    stuck.start()
    try:
        deadline = time.monotonic() + 5.0
        while not dogs[0].ended and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        release.set()
        stuck.join()
    assert dogs[0].ended, "the watchdog did not act on a collective past its timeout"
    status, text, reporter = dogs[0].ended[0]
    assert status == 1 and reporter
    assert "mpistrat.errors.PeerLostError: lost host node2 (ranks 2, 3): rank 0 (node1)" in text
    assert "in all_reduce (collective #7 on the world communicator of 4 ranks)" in text
    assert "past --timeout 0.5 s, all ranks having arrived (exchanging data)" in text
    assert "rank 1 (node1) running the script" in text  # what the ranks that answer do
    assert "in train_step\n    _stuck_in_a_collective(watch, release)\n" in text  # where


def test_a_finished_collective_is_not_watched_any_more(dogs):
    def collective():
        entry = new_entry("all_reduce", SimpleNamespace(seq=1), time.monotonic(),
                          sys._getframe())
        dogs[0].watch.active[threading.get_ident()] = entry

    worker = threading.Thread(target=lambda: (collective(), time.sleep(1.5)))
    worker.start()  # the 'collective' returned at once; its thread runs on for 1.5 s
    worker.join()
    assert dogs[0].ended == []


def test_the_lowest_troubled_rank_reports_and_the_others_point_to_it(dogs):
    dogs[3].stop()
    dogs[0].ending = dogs[1].ending = True
    report, reporter = dogs[1].explain_failure("Traceback ...\nCollectiveTimeoutError: x",
                                               "Traceback (most recent call last):\n",
                                               symptom=True, what="CollectiveTimeoutError")
    assert not reporter
    assert report == ("mpistrat: rank 1 (node1) stops too in its collective: rank 3 (node2) "
                      "cannot be reached; rank 0 reports.")
    report, reporter = dogs[0].explain_failure("Traceback ...\nCollectiveTimeoutError: x",
                                               "Traceback (most recent call last):\n",
                                               symptom=True, what="CollectiveTimeoutError")
    assert reporter
    assert report.startswith("Traceback (most recent call last):\nmpistrat.errors."
                             "PeerLostError: lost rank 3 (node2): a collective could not "
                             "complete on rank 0 (node1) (it surfaced here as a "
                             "CollectiveTimeoutError).")
    assert "waited" not in report  # the symptom's text (which blames a local peer) is gone
    # a failure that is not a collective's keeps its traceback, the lost rank added
    report, _ = dogs[0].explain_failure("Traceback ...\nValueError: bad", "", symptom=False)
    assert report.startswith("Traceback ...\nValueError: bad\n(mpistrat: also, Rank 3 (node2)")


def test_outcome_keeps_the_location_and_whether_a_collective_failed():
    from mpistrat.errors import CollectiveTimeoutError

    try:
        raise CollectiveTimeoutError("all_reduce timed out", [1])
    except CollectiveTimeoutError as exc:
        outcome = outcome_of(exc, "train.py")
    assert outcome.symptom and outcome.what == "CollectiveTimeoutError"
    assert outcome.location.startswith("Traceback (most recent call last):\n")
    assert "CollectiveTimeoutError: all_reduce" not in outcome.location  # frames only
    assert outcome.report == outcome.location + "mpistrat.errors.CollectiveTimeoutError: " \
        "all_reduce timed out\n"
    try:
        raise ValueError("bad")
    except ValueError as exc:
        assert not outcome_of(exc, "train.py").symptom


# -- the job monitor of mpistrat run -n


def _clients(monitor, hosts=HOSTS):
    env = monitor.env()
    clients = [MonitorClient.connect(env, rank, host) for rank, host in enumerate(hosts)]
    assert all(clients)
    _settle(lambda: len(monitor.records) == len(hosts))
    return clients


def _settle(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "the monitor did not see it"
        time.sleep(0.02)


def _vanish(monitor, client):
    client._sock.close()  # as the kernel does for a killed process: no 'end' line
    _settle(lambda: monitor.records[client.rank].closed is not None)


def test_the_host_whose_ranks_vanish_first_is_named(monkeypatch):
    monkeypatch.delenv("MPISTRAT_RUN_MONITOR", raising=False)
    with JobMonitor(4) as monitor:
        clients = _clients(monitor)
        for rank in (3, 2, 0, 1):  # node2 dies; then the launcher kills node1's ranks
            _vanish(monitor, clients[rank])
        text = monitor.summary(255)
    # the order the closes came in: rank 3 first
    assert text.startswith("mpistrat run: the first ranks to end without a report were every "
                           "rank of host node2 (ranks 2, 3): rank 3 at ")
    assert "the launcher then ended host node1 (ranks 0, 1). mpiexec exited with status 255" \
        in text
    assert "If mpiexec says 'assert (!closed) failed' above, the job lost that host" in text


def test_one_killed_rank_of_a_one_host_job_is_named_not_a_lost_host(monkeypatch):
    """Every rank of the only host vanishes (the launcher ends the others): the first is
    named, and no host is said to be lost."""
    monkeypatch.delenv("MPISTRAT_RUN_MONITOR", raising=False)
    with JobMonitor(4) as monitor:
        clients = _clients(monitor, ("vm",) * 4)
        for rank in (2, 0, 1, 3):
            _vanish(monitor, clients[rank])
        text = monitor.summary(9)
    assert text.startswith("mpistrat run: the first ranks to end without a report were every "
                           "rank of host vm (ranks 0, 1, 2, 3): rank 2 at "), text
    assert ". mpiexec exited with status 9. Rank 2 was killed or crashed, and the launcher " \
        "ended the others." in text
    assert "lost" not in text


def test_ranks_a_forwarded_signal_ended_are_not_lost(monkeypatch):
    monkeypatch.delenv("MPISTRAT_RUN_MONITOR", raising=False)
    with JobMonitor(4) as monitor:
        clients = _clients(monitor)
        monitor.forwarded(signal.SIGTERM)  # as self_launch does, then mpiexec ends them
        for rank in (2, 3, 0, 1):
            _vanish(monitor, clients[rank])
        text = monitor.summary(143)
    assert text == ("mpistrat run: this launcher passed SIGTERM on to mpiexec, which ended "
                    "the job's ranks; mpiexec exited with status 143."), text


def test_ranks_ended_by_the_launcher_after_a_reported_failure_are_not_lost(monkeypatch):
    monkeypatch.delenv("MPISTRAT_RUN_MONITOR", raising=False)
    with JobMonitor(4) as monitor:
        clients = _clients(monitor)
        clients[0].end(1)
        _settle(lambda: monitor.records[0].closed is not None)
        for rank in (1, 2, 3):
            _vanish(monitor, clients[rank])
        assert monitor.summary(1) is None
        assert monitor.summary(0) is None


def test_ranks_cut_off_from_the_launcher_are_named_with_their_reports(tmp_path, monkeypatch):
    monkeypatch.delenv("MPISTRAT_RUN_MONITOR", raising=False)
    with JobMonitor(4, report_dir=str(tmp_path)) as monitor:
        import os

        write_report(str(tmp_path / "rank-2.txt"), "PeerLostError: lost host node1 (ranks 0, "
                     "1)\n", monitor.secret, 2, "node2")

        assert os.environ["MPISTRAT_RUN_MONITOR"] == monitor.env()["MPISTRAT_RUN_MONITOR"]
        clients = _clients(monitor)
        clients[0].end(1)
        clients[1].end(1)
        _settle(lambda: monitor.records[1].closed is not None)
        text = monitor.summary(1, str(tmp_path))  # ranks 2 and 3 stay connected, silent
        for client in clients[2:]:
            client.end(0)
    assert "MPISTRAT_RUN_MONITOR" not in os.environ
    assert text.startswith("mpistrat run: host node2 (ranks 2, 3) never reported how they "
                           "ended: this launcher cannot reach them")
    assert f"rank 2's report ({tmp_path}/rank-2.txt):\n  PeerLostError: lost host node1" in text


def test_no_monitor_variable_means_no_client():
    assert MonitorClient.connect({}, 0, "node1", KEY) is None
    assert MonitorClient.connect({"MPISTRAT_RUN_MONITOR": "1 127.0.0.1"}, 0, "n", KEY) is None
    # another host's monitor: no loopback (it would reach whatever listens here)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        assert MonitorClient.connect({"MPISTRAT_RUN_MONITOR": f"{port} elsewhere -"},
                                     0, "n", KEY) is None
        # and no secret, no connection
        here = f"{port} {socket.gethostname()} 127.0.0.1"
        assert MonitorClient.connect({"MPISTRAT_RUN_MONITOR": here}, 0, "n") is None


# -- the liveness probe as an attacker sees it (docs/security.md)


def _pong(key, nonce, rank, text=b"\x00running the script"):
    datagram = _HEADER.pack(_PONG, nonce, rank) + text
    return datagram + auth.tag(key, _PONG, nonce, rank, text, size=_TAG)


class _Answering:
    """Answers every probe sent to a stopped rank's port as that rank, with ``key`` and
    the probe's own number (``replay``: with an old number instead)."""

    def __init__(self, port, rank, key, replay=None):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", port))
        self.sock.settimeout(0.1)
        self.rank, self.key, self.replay = rank, key, replay
        self.seen: list[int] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            try:
                data, source = self.sock.recvfrom(4096)
            except OSError:
                continue
            kind, nonce, _ = _HEADER.unpack_from(data)
            if kind != _PING:
                continue
            self.seen.append(nonce)
            self.sock.sendto(_pong(self.key, self.replay if self.replay is not None
                                   else nonce, self.rank), source)

    def close(self):
        self.stop.set()
        self.thread.join()
        self.sock.close()


def test_a_dead_rank_cannot_be_faked_alive_without_the_secret(dogs):
    port = dogs[3]._sock.getsockname()[1]
    dogs[3].stop()
    forger = _Answering(port, 3, key=b"\x00" * 32)  # sees the probes, lacks the key
    try:
        diagnosis = dogs[0].probe()
    finally:
        forger.close()
    assert forger.seen, "the probes did not reach the forger"
    assert diagnosis.unreachable == [3]


def test_an_answer_recorded_from_an_earlier_probe_does_not_count(dogs):
    port = dogs[3]._sock.getsockname()[1]
    dogs[3].stop()
    # an answer rank 3 really gave (the key is right) to an earlier probe's number
    replayer = _Answering(port, 3, key=KEY, replay=12345)
    try:
        diagnosis = dogs[0].probe()
    finally:
        replayer.close()
    assert replayer.seen and 12345 not in replayer.seen
    assert diagnosis.unreachable == [3]


def test_a_forged_probe_gets_no_answer_and_a_real_one_none_at_a_strangers_address(dogs):
    stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    stranger.bind(("127.0.0.1", 0))
    stranger.settimeout(0.5)
    try:
        target = ("127.0.0.1", dogs[1]._sock.getsockname()[1])
        forged = _HEADER.pack(_PING, 7, 0) + b"\x00" * _TAG
        stranger.sendto(forged, target)
        # an authentic probe of rank 0's (recorded), sent from the stranger's address:
        # answered at rank 0's own address, not the stranger's (no reflection)
        recorded = _HEADER.pack(_PING, 7, 0) + auth.tag(KEY, _PING, 7, 0, b"", size=_TAG)
        stranger.sendto(recorded, target)
        with pytest.raises(socket.timeout):
            stranger.recvfrom(4096)
    finally:
        stranger.close()


def test_a_flood_of_datagrams_does_not_keep_the_watchdog_from_its_timeout(dogs):
    """The old drain read until the socket was empty: a flood starved the --timeout
    check. A collective past rank 0's 0.5 s timeout is acted on while junk pours in."""
    stop = threading.Event()
    target = ("127.0.0.1", dogs[0]._sock.getsockname()[1])

    def flood():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            junk = _HEADER.pack(_PONG, 1, 1) + b"x" * 200
            while not stop.is_set():
                for _ in range(200):
                    try:
                        sock.sendto(junk, target)
                    except OSError:
                        pass

    flooders = [threading.Thread(target=flood, daemon=True) for _ in range(2)]
    for thread in flooders:
        thread.start()
    release = threading.Event()

    def stuck():
        entry = new_entry("all_reduce", SimpleNamespace(seq=3), time.monotonic(),
                          sys._getframe())
        entry[AGREED] = entry[STARTED]
        dogs[0].watch.active[threading.get_ident()] = entry
        release.wait(30)

    worker = threading.Thread(target=stuck)
    worker.start()
    try:
        deadline = time.monotonic() + 20.0
        while not dogs[0].ended and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        release.set()
        worker.join()
        for thread in flooders:
            thread.join()
    assert dogs[0].ended, "the flood kept the watchdog from acting on the timeout"
    status, text, _ = dogs[0].ended[0]
    assert status == 1 and "past --timeout 0.5 s" in text
