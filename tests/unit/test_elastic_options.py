"""``mpistrat run -n N --min-ranks M`` (mpistrat/runner/elastic.py): the options checked
once, the decision after a launch (what was lost, on what the job goes on, or why it
stops) as a function of the monitor's records, and the relaunch loop with a stand-in
for ``mpiexec`` whose "ranks" speak to the real monitor (two hosts, which no launch test
on one machine can have). tests/launch/test_run_elastic.py runs real jobs on one host."""

from __future__ import annotations

import os
import time

import pytest
from click.testing import CliRunner

from mpistrat.cli import cli
from mpistrat.cli.run import _end_options_at_module
from mpistrat.elastic.env import JOB_ENV, LOST_ENV, RESTART_ENV, SIZES_ENV
from mpistrat.runner import elastic
from mpistrat.runner.elastic import ElasticOptions, decide, host_file_text, run_elastic
from mpistrat.runner.monitor import MONITOR_ENV, MonitorClient, RankRecord, active
from mpistrat.runner.options import RunOptions

TWO_HOSTS = ("node1", "node1", "node2", "node2")
ONE_HOST = ("node1",) * 4


def _options(**changes):
    return ElasticOptions(**{"ranks": 4, "min_ranks": 2, "timeout": 20.0, **changes})


# -- the options

@pytest.mark.parametrize("changes, words", [
    ({"min_ranks": 5}, ["--min-ranks", "got 5", "1 <= M <= 4"]),
    ({"min_ranks": 0}, ["--min-ranks", "got 0", "1 <= M <= 4"]),
    ({"timeout": None}, ["--min-ranks 2 needs --timeout", "MPISTRAT_COLLECTIVE_TIMEOUT",
                         "partition"]),
    ({"num_ps": 3}, ["-n 4 with --num-ps 3 leaves no worker", "at least 5 ranks"]),
    ({"max_restarts": -1}, ["--max-restarts", ">= 0", "got -1"]),
    ({"snapshot_every": -1}, ["--snapshot-every", ">= 1, or auto", "got -1"]),
])
def test_bad_options_are_named_with_the_fix(changes, words):
    with pytest.raises(ValueError) as error:
        _options(**changes)
    for word in words:
        assert word in str(error.value), str(error.value)


def test_good_options_and_their_defaults():
    options = _options(min_ranks=4, max_restarts=0)
    assert (options.max_restarts, options.snapshot_every) == (0, 0)  # (0: auto)
    assert _options().max_restarts == 3
    assert _options(min_ranks=1).min_ranks == 1


@pytest.mark.parametrize("argv, words", [
    (["-n", "4", "--min-ranks", "2", "x.py"], ["needs --timeout"]),
    (["-n", "4", "--min-ranks", "9", "--timeout", "5", "x.py"], ["got 9"]),
    (["-n", "3", "--min-ranks", "2", "--timeout", "5", "--num-ps", "2", "x.py"],
     ["leaves no worker"]),
    (["-n", "4", "--min-ranks", "2", "--timeout", "5", "--max-restarts", "-1", "x.py"],
     ["--max-restarts must be an integer >= 0"]),
    (["--min-ranks", "2", "--timeout", "5", "x.py"], ["--min-ranks goes with -n N"]),
    (["-n", "4", "--max-restarts", "2", "x.py"], ["--max-restarts goes with --min-ranks"]),
])
def test_the_command_line_refuses_them_as_usage_errors(argv, words, monkeypatch):
    monkeypatch.delenv("MPISTRAT_COLLECTIVE_TIMEOUT", raising=False)
    # (without -n this process would be a rank, which starts over with the heap's tunable)
    monkeypatch.setattr("mpistrat.launch.hugepages.restart_with_hugepages", lambda: None)
    result = CliRunner().invoke(cli, ["run", *argv])
    assert result.exit_code == 2, result.output
    for word in words:
        assert word in result.output, result.output


def test_the_timeout_may_come_from_the_environment(monkeypatch, tmp_path):
    """MPISTRAT_COLLECTIVE_TIMEOUT is --timeout's default: then the options pass (and the
    job is refused later only for its missing script)."""
    monkeypatch.setenv("MPISTRAT_COLLECTIVE_TIMEOUT", "5")
    result = CliRunner().invoke(cli, ["run", "-n", "4", "--min-ranks", "2", "no/such.py"])
    assert result.exit_code == 2 and "script 'no/such.py' not found" in result.output, \
        result.output


def test_the_options_take_values_before_the_script():
    args = ["--min-ranks", "2", "--max-restarts", "1", "--snapshot-every", "5", "-m", "pkg",
            "-x"]
    assert _end_options_at_module(args) == [*args[:-1], "--", "-x"]


def test_help_names_the_options_and_the_example():
    text = CliRunner().invoke(cli, ["run", "--help"]).output
    for word in ("--min-ranks M", "--max-restarts R", "[default: 3]", "--snapshot-every K",
                 "--min-ranks 2 --timeout 30 train.py"):
        assert word in text, text


# -- the decision: records as the monitor leaves them

class _Job:
    """Builds a monitor's records event by event (ends announced, connections closed)."""

    def __init__(self, hosts):
        self.records = {r: RankRecord(r, host, 1000 + r) for r, host in enumerate(hosts)}
        self.size = len(hosts)
        self.events = 0
        self.now = 1000.0

    def vanish(self, *ranks):
        for rank in ranks:
            record = self.records[rank]
            record.closed, record.order = self.now, self.events
            self.events += 1
            self.now += 0.01
        return self

    def end(self, rank, status):
        record = self.records[rank]
        record.status, record.ended = status, self.events
        self.events += 1
        return self.vanish(rank)

    def decide(self, status=7, **kw):
        kw.setdefault("options", _options())
        return decide(self.records, self.size, status, **kw)


def test_a_lost_host_restarts_on_the_other_hosts():
    # node2's ranks die together; hydra then kills the others
    decision = _Job(TWO_HOSTS).vanish(3, 2, 0, 1).decide()
    assert decision.action == "restart" and decision.reason == "lost"
    assert decision.lost_hosts == ("node2",) and decision.lost == ("node2",)
    assert decision.lost_ranks == (2, 3)
    assert decision.survivors == (("node1", 2),) and decision.size == 2
    assert decision.message == ("mpistrat run: lost host node2 (ranks 2, 3); restart 1 of 3 "
                                "on 2 ranks (node1:2)")


def test_a_killed_rank_on_one_host_costs_that_rank_only():
    decision = _Job(ONE_HOST).vanish(3, 0, 2, 1).decide()
    assert decision.restart
    assert decision.lost_ranks == (3,) and decision.lost == ("node1/3",)
    assert decision.lost_hosts == ()
    assert decision.survivors == (("node1", 3),)
    assert decision.message.startswith("mpistrat run: lost rank 3 (node1); restart 1 of 3 on "
                                       "3 ranks (node1:3)")


def test_a_killed_rank_across_hosts_costs_its_host():
    """Across hosts the unit is the host: its host-mates are ended by hydra's proxy."""
    decision = _Job(TWO_HOSTS).vanish(1, 0, 2, 3).decide()
    assert decision.lost_hosts == ("node1",) and decision.survivors == (("node2", 2),)


def test_a_partition_loses_the_silent_side():
    """The launcher's side times out (status 1, announced); the far side never says how
    it ended and its connections stay open."""
    job = _Job(("node1", "node1", "node2", "node2", "node3", "node3"))
    job.end(0, 1).end(1, 1).end(4, 1).end(5, 1)
    decision = job.decide(status=1, options=_options(ranks=6))
    assert decision.restart
    assert decision.lost_hosts == ("node2",) and decision.lost_ranks == (2, 3)
    assert decision.survivors == (("node1", 2), ("node3", 2))
    assert "(node1:2, node3:2)" in decision.message


def test_a_vanished_host_and_a_silent_one_are_both_lost():
    job = _Job(("a", "b", "c", "d"))
    job.vanish(1)  # b's only rank dies; then d is cut off (never heard of again)
    job.end(0, 1).end(2, 1)
    decision = job.decide(options=_options(min_ranks=1))
    assert decision.lost_hosts == ("b", "d") and decision.survivors == (("a", 1), ("c", 1))


def test_a_failure_the_script_raised_is_not_restarted():
    # rank 1 announced its failure first; hydra then ended everyone
    decision = _Job(TWO_HOSTS).end(1, 1).vanish(0, 2, 3).decide(status=1)
    assert decision.action == "stop" and decision.reason == "failure"
    assert decision.message is None and decision.lost == ()


def test_a_launch_that_ended_before_every_rank_started_stops_saying_so():
    """A relaunch whose rank died while it started (before its hello): nothing vanished
    or went silent among the ranks known, none failed; what was lost is not known."""
    decision = decide({}, 2, 9, sizes=(4, 2), options=_options(min_ranks=1))
    assert decision.action == "stop" and decision.reason == "unknown"
    assert decision.message.startswith(
        "mpistrat run: the launch on 2 ranks ended (status 9) before rank(s) [0, 1] "
        "reached this launcher's monitor")
    assert "(launch sizes so far: 4, 2)" in decision.message
    assert "newest complete checkpoint on disk" in decision.message


def test_a_signal_passed_on_is_never_restarted():
    decision = _Job(TWO_HOSTS).vanish(3, 2, 0, 1).decide(status=130,
                                                         signals=[(2, time.time())])
    assert decision.action == "stop" and decision.reason == "signal"


def test_below_the_minimum_it_stops_naming_it():
    decision = _Job(TWO_HOSTS).vanish(3, 2, 0, 1).decide(options=_options(min_ranks=3))
    assert decision.action == "stop" and decision.reason == "min-ranks"
    assert decision.message.startswith(
        "mpistrat run: lost host node2 (ranks 2, 3); not launching again: 2 ranks would be "
        "left, below --min-ranks 3 (launch sizes so far: 4).")
    assert "newest complete checkpoint" in decision.message


def test_with_the_restarts_spent_it_stops_naming_the_budget():
    job = _Job(("node1",) * 3).vanish(2, 0, 1)
    decision = job.decide(sizes=(4, 3), options=_options(max_restarts=1))
    assert decision.action == "stop" and decision.reason == "max-restarts"
    assert "--max-restarts 1 spent (1 restart so far; launch sizes so far: 4, 3)" in \
        decision.message
    assert _Job(ONE_HOST).vanish(3).decide(
        options=_options(max_restarts=0)).reason == "max-restarts"
    assert _Job(ONE_HOST).vanish(3).decide(sizes=(4,), options=_options(max_restarts=1)).restart


def test_a_finished_job_is_done_and_an_unknown_placement_stops():
    job = _Job(ONE_HOST)
    for rank in range(4):
        job.end(rank, 0)
    assert job.decide(status=0).action == "done"
    partial = _Job(ONE_HOST)
    del partial.records[2]  # never reached the monitor
    decision = partial.vanish(3).decide()
    assert decision.reason == "unknown" and "rank(s) [2] never reached" in decision.message
    # a first launcher that failed by itself (nothing vanished, nobody silent) is not
    # restarted, and hydra says why
    failed = decide({}, 4, 1, options=_options())
    assert failed.reason == "failure" and failed.message is None


def test_the_host_file_keeps_the_order():
    assert host_file_text((("node3", 2), ("node1", 4))) == "node3:2\nnode1:4\n"


# -- the loop, with a stand-in launcher whose ranks speak to the real monitor

def _stand_in(plan, seen):
    """A launcher: connects one client per rank on the hosts ``plan`` gives for this
    launch, then plays what ``plan`` says (``"lose HOST"`` or ``"finish"``)."""

    def launch(argv):
        restart = len(seen)
        path = os.environ.get("HYDRA_HOST_FILE")
        seen.append({"argv": argv, "host_file": _read(path), "host_file_path": path,
                     "modes": (os.stat(path).st_mode & 0o777,
                               os.stat(os.path.dirname(path)).st_mode & 0o777)
                     if path else None})
        hosts, action = plan[restart]
        monitor = active()
        clients = [MonitorClient.connect({MONITOR_ENV: os.environ[MONITOR_ENV]}, r, h,
                                         monitor.secret) for r, h in enumerate(hosts)]
        _until(lambda: len(monitor.records) == len(hosts))
        if action == "finish":
            for client in clients:
                client.end(0)
            return 0
        lost = action.split()[1]
        order = [c for c in clients if hosts[c.rank] == lost] + \
                [c for c in clients if hosts[c.rank] != lost]
        for client in order:  # the lost host's ranks die first; hydra kills the rest
            client._sock.close()
            _until(lambda c=client: monitor.records[c.rank].closed is not None)
        return 7

    return launch


def _until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "not seen in time"
        time.sleep(0.01)


def _read(path):
    if not path:
        return None
    with open(path) as file:
        return file.read()


def _genv(argv, name):
    """The value of ``name`` passed with hydra's ``-genv NAME VALUE`` (Open MPI's
    ``-x NAME=VALUE``)."""
    for i, arg in enumerate(argv[:-1]):
        if arg == "-genv" and argv[i + 1] == name:
            return argv[i + 2]
        if arg == "-x" and argv[i + 1].startswith(name + "="):
            return argv[i + 1].split("=", 1)[1]
    raise AssertionError(f"{name} not passed in {argv}")


def test_the_loop_relaunches_on_the_hosts_left_with_a_host_file_of_their_own(
        monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("HYDRA_HOST_FILE", str(tmp_path / "mine"))
    (tmp_path / "mine").write_text("node1:2\nnode2:2\nnode3:2\n")
    plan = [(("node1", "node1", "node2", "node2", "node3", "node3"), "lose node2"),
            (("node1", "node1", "node3", "node3"), "lose node1"),
            (("node3", "node3"), "finish")]
    seen = []
    result = run_elastic(RunOptions(target="train.py", timeout=5.0),
                         ElasticOptions(6, 2, timeout=5.0), launch=_stand_in(plan, seen),
                         job_hosts=lambda: None)
    assert result.status == 0 and result.sizes == (6, 4, 2)
    assert [launch.lost for launch in result.launches] == [("node2",), ("node1",), ()]
    assert [s["host_file"] for s in seen] == [
        "node1:2\nnode2:2\nnode3:2\n", "node1:2\nnode3:2\n", "node3:2\n"]
    assert seen[1]["modes"] == (0o600, 0o700)  # private to this user
    private = os.path.dirname(seen[1]["host_file_path"])
    assert seen[2]["host_file_path"] == seen[1]["host_file_path"]
    assert not os.path.exists(private)  # removed at the end
    assert os.environ["HYDRA_HOST_FILE"] == str(tmp_path / "mine")  # restored
    # every launch: one job id, its restart number, the sizes and losses so far
    assert len({_genv(s["argv"], JOB_ENV) for s in seen}) == 1
    assert [_genv(s["argv"], RESTART_ENV) for s in seen] == ["0", "1", "2"]
    assert [_genv(s["argv"], SIZES_ENV) for s in seen] == ["6", "6,4", "6,4,2"]
    assert [_genv(s["argv"], LOST_ENV) for s in seen] == ["", "node2", "node2,node1"]
    err = capsys.readouterr().err
    assert "mpistrat run: lost host node2 (ranks 2, 3); restart 1 of 3 on 4 ranks " \
           "(node1:2, node3:2) after " in err
    assert "mpistrat run: lost host node1 (ranks 0, 1); restart 2 of 3 on 2 ranks " \
           "(node3:2) after " in err
    assert "the first ranks to end without a report" in err  # the monitor's summary
    first, second, last = result.launches
    assert first.started <= first.lost_at <= first.ended <= first.relaunched
    assert first.relaunched == second.started and last.relaunched is None
    assert 0 <= first.recovery_s < 5 and last.recovery_s is None
    assert first.hosts == (("node1", 2), ("node2", 2), ("node3", 2))


def test_the_loop_stops_below_the_minimum_with_the_launchers_status(monkeypatch, capsys):
    monkeypatch.delenv("HYDRA_HOST_FILE", raising=False)
    plan = [(("node1", "node1", "node2", "node2"), "lose node1")]
    seen = []
    result = run_elastic(RunOptions(target="train.py", timeout=5.0),
                         ElasticOptions(4, 3, timeout=5.0), launch=_stand_in(plan, seen),
                         job_hosts=lambda: None)
    assert result.status == 7 and result.sizes == (4,)
    assert result.launches[0].decision.reason == "min-ranks"
    assert "below --min-ranks 3" in capsys.readouterr().err
    assert "HYDRA_HOST_FILE" not in os.environ


def test_the_monitor_secret_is_the_jobs_for_every_launch(monkeypatch):
    """Snapshots are authenticated with the job's secret: every launch's monitor (and so
    every launch's ranks) holds the same one."""
    monkeypatch.delenv("HYDRA_HOST_FILE", raising=False)
    secrets_seen = []
    plan = [(ONE_HOST, "lose node1"), (ONE_HOST[:3], "finish")]
    inner = _stand_in(plan, [])

    def launch(argv):
        secrets_seen.append(active().secret)
        return inner(argv)

    result = run_elastic(RunOptions(target="train.py", timeout=5.0),
                         ElasticOptions(4, 2, timeout=5.0), launch=launch,
                         job_hosts=lambda: None)
    assert result.status == 0 and result.sizes == (4, 3)
    assert len(set(secrets_seen)) == 1 and len(secrets_seen) == 2
    assert result.launches[0].lost == ("node1/0",)
    assert elastic.DEFAULT_MAX_RESTARTS == 3


# -- growing back into a host file's free slots


def test_a_relaunch_grows_into_the_free_slots_of_the_hosts_left():
    """-n 3 over node1:2, node2:2 (hydra: ranks 0, 1 on node1, rank 2 on node2): node1
    lost, node2 has a free slot, so the relaunch has 2 ranks, not 1, and --min-ranks 2
    holds."""
    job = _Job(("node1", "node1", "node2"))
    decision = job.vanish(0, 1, 2).decide(options=_options(ranks=3, min_ranks=2),
                                          capacity=[("node1", 2), ("node2", 2)])
    assert decision.restart and decision.lost_hosts == ("node1",)
    assert decision.survivors == (("node2", 2),) and decision.size == 2
    assert "restart 1 of 3 on 2 ranks (node2:2)" in decision.message
    # without the host file's slots, one rank would be left: below the minimum
    assert _Job(("node1", "node1", "node2")).vanish(0, 1, 2).decide(
        options=_options(ranks=3, min_ranks=2)).reason == "min-ranks"


def test_a_relaunch_grows_onto_spare_hosts_never_onto_lost_ones():
    """-n 4 over node1:2, node2:2, node3:2, node4:2 (node3 and node4 spare): node2 lost;
    the relaunch takes node1's 2 and node3's 2 (the first spare), back to 4 ranks; a host
    lost earlier (node3, say) is never taken again."""
    capacity = [("node1", 2), ("node2", 2), ("node3", 2), ("node4", 2)]
    job = _Job(TWO_HOSTS).vanish(2, 3, 0, 1)
    decision = job.decide(capacity=capacity)
    assert decision.survivors == (("node1", 2), ("node3", 2)) and decision.size == 4
    again = _Job(TWO_HOSTS).vanish(2, 3, 0, 1).decide(capacity=capacity,
                                                     excluded=["node3"])
    assert again.survivors == (("node1", 2), ("node4", 2))


def test_the_host_file_capacity_is_read_as_hydra_reads_it(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("node1:2\n# a comment\nnode2\n\nnode3:4  # more\n")
    assert elastic.host_file_capacity(str(path)) == [("node1", 2), ("node2", 1),
                                                     ("node3", 4)]
    path.write_text("node1:x\n")
    assert elastic.host_file_capacity(str(path)) is None
    assert elastic.host_file_capacity(str(tmp_path / "none")) is None
    assert elastic.host_file_capacity(None) is None


# -- taking back a host lost earlier that answers again


class _Prober:
    """A stand-in for mpistrat.runner.probe.HostProber: the hosts it says answer."""

    def __init__(self, answering=()):
        self.answers = list(answering)
        self.calls = []

    def answering(self):
        return list(self.answers)

    def watch(self, hosts):
        self.calls.append(("watch", tuple(hosts)))

    def forget(self, hosts):
        self.calls.append(("forget", tuple(hosts)))

    def close(self):
        self.calls.append(("close",))


def test_a_host_lost_earlier_that_answers_again_is_taken_back(monkeypatch, capsys,
                                                              tmp_path):
    """-n 4 over node1:2, node2:2: node2 lost (restart 1 on node1's 2 ranks, node2
    probed from then on); node2 answers again, and when a rank of node1 is lost the
    relaunch takes node2 back: 4 ranks again, not 1."""
    monkeypatch.setenv("HYDRA_HOST_FILE", str(tmp_path / "mine"))
    (tmp_path / "mine").write_text("node1:2\nnode2:2\n")
    prober = _Prober()
    plan = [(TWO_HOSTS, "lose node2"), (("node1", "node1"), "lose node1"),
            (TWO_HOSTS, "finish")]
    seen = []
    inner = _stand_in(plan, seen)

    def launch(argv):
        if len(seen) == 1:  # (node2 answers while the job runs on node1)
            prober.answers = ["node2"]
        return inner(argv)

    result = run_elastic(RunOptions(target="train.py", timeout=5.0),
                         ElasticOptions(4, 2, timeout=5.0), launch=launch,
                         job_hosts=lambda: None, prober=prober)
    assert result.status == 0 and result.sizes == (4, 2, 4)
    assert [s["host_file"] for s in seen] == [
        "node1:2\nnode2:2\n", "node1:2\n", "node1:2\nnode2:2\n"]
    assert [_genv(s["argv"], LOST_ENV) for s in seen] == ["", "node2", "node1/0"]
    err = capsys.readouterr().err
    assert "mpistrat run: node2, lost before, answers again: taken back\n" \
           "mpistrat run: lost rank 0 (node1); restart 2 of 3 on 4 ranks " \
           "(node1:2, node2:2) after " in err, err
    assert prober.calls == [("forget", ()), ("watch", ("node2",)),
                            ("forget", ("node2",)), ("watch", ()), ("close",)]


def test_a_host_lost_earlier_that_does_not_answer_stays_out(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("HYDRA_HOST_FILE", str(tmp_path / "mine"))
    (tmp_path / "mine").write_text("node1:2\nnode2:2\n")
    plan = [(TWO_HOSTS, "lose node2"), (("node1", "node1"), "lose node1"),
            (("node1", "node1"), "finish")]
    result = run_elastic(RunOptions(target="train.py", timeout=5.0),
                         ElasticOptions(4, 1, timeout=5.0), launch=_stand_in(plan, []),
                         job_hosts=lambda: None, prober=_Prober())
    assert result.sizes == (4, 2, 2)  # (node1's free slot taken again; node2 never)
    assert "taken back" not in capsys.readouterr().err


def test_the_prober_probes_in_the_background_and_kills_a_probe_past_its_timeout():
    from mpistrat.runner.probe import HostProber

    commands = {"up": ["true"], "down": ["false"], "hung": ["sleep", "30"]}
    prober = HostProber(lambda host: commands[host], every=0.05, timeout=0.3)
    try:
        started = time.monotonic()
        assert not prober.probe("hung") and time.monotonic() - started < 5
        assert prober.probe("up") and not prober.probe("down")
        assert prober.answering() == []
        prober.watch(["down", "up"])
        assert prober.answering() == []  # (none answers before its first probe)
        _until(lambda: prober.answering() == ["up"])
        commands["up"] = ["false"]  # it fails again
        _until(lambda: prober.answering() == [])
        prober.forget(["up", "down"])
    finally:
        prober.close()
    # the job's end never waits for a probe of a host that does not answer
    hung = HostProber(lambda host: commands[host], every=0.01, timeout=60)
    hung.watch(["hung"])
    _until(lambda: hung._running is not None)
    started = time.monotonic()
    hung.close()
    assert time.monotonic() - started < 3 and hung._running is None


@pytest.mark.parametrize("text, seconds", [("", 15.0), ("2.5", 2.5), ("0", None),
                                           ("-1", None), ("soon", None), ("inf", None)])
def test_the_probe_interval_comes_from_the_environment(text, seconds):
    from mpistrat.runner.probe import PROBE_EVERY_ENV, probe_every

    if seconds is not None:
        assert probe_every({PROBE_EVERY_ENV: text}) == seconds
    else:
        with pytest.raises(ValueError, match=f"{PROBE_EVERY_ENV}=.*a number > 0"):
            probe_every({PROBE_EVERY_ENV: text})
