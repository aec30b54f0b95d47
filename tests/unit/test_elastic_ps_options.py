"""``mpistrat run -n N --num-ps P --min-ranks M``: a parameter-server job is elastic too
(mpistrat/runner/elastic.py): every launch keeps the P ps ranks, so a relaunch needs at
least P + 2 ranks (the coordinator, the ps, a worker) and has fewer workers; below that it
stops, naming why. (tests/launch/test_run_elastic_ps.py runs such jobs.)"""

from __future__ import annotations

import pytest

from mpistrat.runner.elastic import ElasticOptions, decide
from mpistrat.runner.monitor import RankRecord


def _options(**changes):
    return ElasticOptions(**{"ranks": 5, "min_ranks": 3, "timeout": 20.0, "num_ps": 1,
                             **changes})


def _lost(hosts, *ranks):
    """The records of a launch on ``hosts`` (one per rank) whose ``ranks`` vanished, in
    that order (then the launcher ended the others)."""
    records = {r: RankRecord(r, host, 1000 + r) for r, host in enumerate(hosts)}
    order = [*ranks, *(r for r in records if r not in ranks)]
    for event, rank in enumerate(order):
        records[rank].closed, records[rank].order = 1000.0 + event / 100, event
    return records


def test_num_ps_goes_with_min_ranks():
    options = _options()
    assert (options.num_ps, options.min_ranks) == (1, 3)
    assert _options(ranks=4, num_ps=2).num_ps == 2


@pytest.mark.parametrize("changes, words", [
    ({"ranks": 3, "num_ps": 2, "min_ranks": 2},
     ["-n 3 with --num-ps 2 leaves no worker", "at least 4 ranks", "give -n 4 or more"]),
    ({"num_ps": 0}, ["--num-ps must be a number of ps ranks >= 1", "got 0"]),
    ({"num_ps": True}, ["--num-ps must be a number of ps ranks >= 1"]),
])
def test_too_few_ranks_for_the_ps_are_refused_with_the_fix(changes, words):
    with pytest.raises(ValueError) as error:
        _options(**changes)
    for word in words:
        assert word in str(error.value), str(error.value)


def test_a_lost_worker_relaunches_with_one_worker_fewer():
    decision = decide(_lost(("node1",) * 5, 3), 5, 9, options=_options())
    assert decision.restart and decision.lost_ranks == (3,) and decision.size == 4
    assert decision.message == ("mpistrat run: lost rank 3 (node1); restart 1 of 3 on 4 "
                                "ranks (node1:4): 1 coordinator, 1 ps, 2 workers")


def test_a_lost_ps_relaunches_with_the_ps_kept_and_a_worker_fewer():
    """The ps ranks are the relaunch's ranks 1..P again (their variables come back from
    the coordinator's snapshot): the launch is short of a worker, not of a ps."""
    decision = decide(_lost(("node1",) * 5, 1), 5, 9, options=_options())
    assert decision.restart and decision.lost_ranks == (1,)
    assert decision.message.endswith("on 4 ranks (node1:4): 1 coordinator, 1 ps, 2 workers")


def test_without_a_worker_left_it_stops_naming_the_ps_minimum():
    """--min-ranks 1 would allow 2 ranks, but 1 coordinator + 1 ps leave no worker."""
    decision = decide(_lost(("node1",) * 3, 2), 3, 9,
                      options=_options(ranks=3, min_ranks=1))
    assert decision.action == "stop" and decision.reason == "ps-ranks"
    assert decision.message.startswith(
        "mpistrat run: lost rank 2 (node1); not launching again: 2 ranks would be left, "
        "fewer than the 3 a parameter-server job with --num-ps 1 needs (the coordinator, "
        "1 ps, a worker; launch sizes so far: 3).")
    assert "newest complete checkpoint" in decision.message


def test_min_ranks_still_counts_above_the_ps_minimum():
    decision = decide(_lost(("node1",) * 5, 4), 5, 9, options=_options(min_ranks=5))
    assert decision.action == "stop" and decision.reason == "min-ranks"
    assert "below --min-ranks 5" in decision.message


def test_a_lost_host_takes_its_workers_and_the_relaunch_keeps_the_ps():
    decision = decide(_lost(("a", "a", "a", "b", "b", "b"), 4), 6, 9,
                      options=_options(ranks=6))
    assert decision.restart and decision.lost_hosts == ("b",)
    assert decision.message.endswith("on 3 ranks (a:3): 1 coordinator, 1 ps, 1 worker")
