"""The elastic job's variables (``mpistrat.elastic.env``) and its step boundaries
(``mpistrat.elastic.hooks``, ``mpistrat.elastic.step``/``info``) on one process: what a
launch's environment parses to (and every malformed variable turning snapshots off rather
than raising), the round trip through ``as_env``, and the taker and resume position that
the input pipeline and the checkpoint manager share."""

from __future__ import annotations

import pytest

import mpistrat.elastic as elastic
from mpistrat.elastic import hooks
from mpistrat.elastic.env import (
    EVERY_ENV,
    JOB_ENV,
    LOST_ENV,
    RESTART_ENV,
    SIZES_ENV,
    ElasticEnv,
    elastic_env,
    job_secret,
    rank_env,
    set_job_secret,
)

JOB = "0123456789abcdef0123456789abcdef"


@pytest.fixture(autouse=True)
def _clean_hooks():
    """No taker, resume position or secret leaks into (or out of) a test."""
    hooks.reset()
    set_job_secret(None)
    yield
    hooks.reset()
    set_job_secret(None)


def _env(**overrides):
    env = {JOB_ENV: JOB, RESTART_ENV: "2", SIZES_ENV: "4,3,2", LOST_ENV: "nodeA,nodeB/3",
           EVERY_ENV: "5"}
    env.update(overrides)
    return {k: v for k, v in env.items() if v is not None}


# --- elastic_env --------------------------------------------------------------------------


def test_a_valid_launch_parses_to_every_field():
    launch = elastic_env(_env())
    assert launch == ElasticEnv(JOB, 2, (4, 3, 2), ("nodeA", "nodeB/3"), 5)
    assert launch.resumed


def test_only_the_job_id_is_required_and_the_rest_defaults():
    launch = elastic_env({JOB_ENV: JOB})
    assert launch == ElasticEnv(JOB, 0, (), (), 0)  # (snapshots: auto)
    assert not launch.resumed


def test_empty_sizes_and_lost_are_empty_tuples():
    assert elastic_env(_env(**{SIZES_ENV: "", LOST_ENV: ""})) == ElasticEnv(JOB, 2, (), (), 5)


def test_no_job_variable_is_not_an_elastic_job():
    assert elastic_env({}) is None
    assert elastic_env(_env(**{JOB_ENV: None})) is None


@pytest.mark.parametrize("job", [
    "", "0123456789abcdef0123456789abcde",  # 31 digits
    "0123456789abcdef0123456789abcdef0",  # 33
    "0123456789ABCDEF0123456789ABCDEF",  # upper case
    "0123456789abcdef0123456789abcdeg",  # not hex
    " 0123456789abcdef0123456789abcdef", "0123456789abcdef0123456789abcdef\n",
    "../../../../etc/passwd0123456789a",
])
def test_a_malformed_job_id_turns_snapshots_off(job):
    assert elastic_env(_env(**{JOB_ENV: job})) is None


@pytest.mark.parametrize("restart", ["-1", "x", "1.5", ""])
def test_a_negative_or_non_integer_restart_turns_snapshots_off(restart):
    assert elastic_env(_env(**{RESTART_ENV: restart})) is None


@pytest.mark.parametrize("sizes", ["4,0", "4,-1", "4,x", "4;3", "1.5"])
def test_bad_sizes_turn_snapshots_off(sizes):
    assert elastic_env(_env(**{SIZES_ENV: sizes})) is None


def test_a_snapshot_interval_of_0_is_auto():
    assert elastic_env(_env(**{EVERY_ENV: "0"})).snapshot_every == 0


@pytest.mark.parametrize("every", ["-1", "-3", "x", "1.5"])
def test_a_bad_snapshot_interval_turns_snapshots_off(every):
    assert elastic_env(_env(**{EVERY_ENV: every})) is None


@pytest.mark.parametrize("lost", ["node A", "nodeA,node B", "node\tA", "n\x00de", "nödeA",
                                  "a" * 256])
def test_a_lost_host_with_a_space_or_unprintable_turns_snapshots_off(lost):
    assert elastic_env(_env(**{LOST_ENV: lost})) is None


def test_a_lost_host_of_255_printable_characters_is_accepted():
    host = "a" * 254 + "~"
    assert elastic_env(_env(**{LOST_ENV: host})).lost == (host,)


def test_commas_separate_lost_hosts_and_empty_items_are_dropped():
    assert elastic_env(_env(**{LOST_ENV: ",nodeA,,nodeB/1,"})).lost == ("nodeA", "nodeB/1")


def test_the_process_environment_is_read_by_default(monkeypatch):
    for name, value in _env().items():
        monkeypatch.setenv(name, value)
    assert elastic_env() == ElasticEnv(JOB, 2, (4, 3, 2), ("nodeA", "nodeB/3"), 5)
    assert elastic.info() == elastic_env()
    monkeypatch.delenv(JOB_ENV)
    assert elastic_env() is None
    assert elastic.info() is None


@pytest.mark.parametrize("launch", [
    ElasticEnv(JOB),
    ElasticEnv(JOB, 3, (8, 6, 4, 2), ("h1", "h2/0", "h3.example.org"), 10),
    ElasticEnv(JOB, 1, (1,), (), 1),
])
def test_as_env_round_trips(launch):
    env = launch.as_env()
    assert set(env) == {JOB_ENV, RESTART_ENV, SIZES_ENV, LOST_ENV, EVERY_ENV}
    assert all(isinstance(v, str) for v in env.values())
    assert elastic_env(env) == launch
    assert rank_env(launch) == env


@pytest.mark.parametrize("lost", [("node A",), ("a,b",), ("",)])
def test_as_env_refuses_a_lost_host_that_would_not_read_back(lost):
    with pytest.raises(ValueError, match="lost host"):
        ElasticEnv(JOB, 1, (2,), lost).as_env()


def test_the_job_secret_is_kept_and_cleared():
    assert job_secret() is None
    set_job_secret(b"secret")
    assert job_secret() == b"secret"
    set_job_secret(b"")  # an empty secret is none
    assert job_secret() is None
    set_job_secret(b"again")
    set_job_secret(None)
    assert job_secret() is None


# --- hooks --------------------------------------------------------------------------------


def test_a_boundary_without_a_taker_does_nothing():
    assert hooks.taker() is None
    hooks.step_boundary(("DistributedDataset/3", 1))  # no error, nothing to call
    elastic.step()


def test_a_boundary_calls_the_taker_with_its_position():
    seen = []
    hooks.set_taker(seen.append)
    assert hooks.taker() == seen.append
    hooks.step_boundary(("DistributedDataset/3", 0))
    hooks.step_boundary(("DistributedDataset/3", 1))
    elastic.step()  # a boundary the script marks: no position
    assert seen == [("DistributedDataset/3", 0), ("DistributedDataset/3", 1), None]
    hooks.set_taker(None)
    assert hooks.taker() is None
    hooks.step_boundary(("DistributedDataset/3", 2))
    elastic.step()
    assert len(seen) == 3


def test_a_new_taker_replaces_the_old():
    first, second = [], []
    hooks.set_taker(first.append)
    hooks.set_taker(second.append)
    elastic.step()
    assert first == [] and second == [None]


def test_the_resume_position_goes_to_its_kind_only_and_only_once():
    hooks.set_resume(("DistributedDataset/6", 4))
    assert hooks.take_resume("DistributedDatasetsFromFunction/6") == 0
    assert hooks.take_resume("DistributedDataset/7") == 0
    assert hooks.take_resume("DistributedDataset/6") == 4
    assert hooks.take_resume("DistributedDataset/6") == 0  # the next iterator starts at 0


def test_no_resume_position_skips_nothing():
    assert hooks.take_resume("DistributedDataset/6") == 0
    hooks.set_resume(("DistributedDataset/6", 2))
    hooks.set_resume(None)  # cleared
    assert hooks.take_resume("DistributedDataset/6") == 0


def test_a_new_resume_position_replaces_the_old():
    hooks.set_resume(("A/1", 1))
    hooks.set_resume(("B/2", 2))
    assert hooks.take_resume("A/1") == 0
    assert hooks.take_resume("B/2") == 2


def test_before_write_waits_on_the_fence_until_it_is_lifted():
    waits = []
    hooks.before_write()  # no fence: nothing to wait for
    hooks.set_fence(lambda: waits.append("waited"))
    hooks.before_write()
    hooks.before_write()
    assert waits == ["waited", "waited"]
    hooks.set_fence(None)
    hooks.before_write()
    assert waits == ["waited", "waited"]


def test_iterators_that_ended_skip_whole_until_the_snapshots_own_starts():
    hooks.iteration_started("train-0")
    hooks.iteration_ended("train-0", 4)
    hooks.iteration_started("eval")
    assert hooks.finished() == (("train-0", 4),)
    hooks.set_resume(("eval", 1), hooks.finished())
    assert hooks.take_resume("train-0") == 4  # (the relaunch replays the epoch: skip it)
    assert hooks.take_resume("eval") == 1
    assert hooks.take_resume("train-0") == 0  # (after the snapshot's own: all new)


def test_an_ended_iterator_is_forgotten_once_the_snapshots_own_has_started():
    hooks.set_resume(("train-1", 2), (("eval", 3),))
    assert hooks.take_resume("train-1") == 2
    assert hooks.take_resume("eval") == 0  # (this epoch's evaluation: a new one)


def test_ended_iterators_are_bounded_and_restarted_ones_dropped():
    for i in range(3 * hooks.MAX_FINISHED):
        hooks.iteration_ended(f"k{i}", i)
    assert len(hooks.finished()) == hooks.MAX_FINISHED
    assert hooks.finished()[-1] == (f"k{3 * hooks.MAX_FINISHED - 1}", 3 * hooks.MAX_FINISHED - 1)
    hooks.iteration_started(f"k{3 * hooks.MAX_FINISHED - 1}")
    assert len(hooks.finished()) == hooks.MAX_FINISHED - 1
