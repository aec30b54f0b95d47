"""Parameter-server roles from the MPI world or a cluster resolver, and TF's errors."""

from __future__ import annotations

import pytest

from mpistrat import SimpleClusterResolver
from mpistrat.ps.roles import NUM_PS_ENV, Roles, roles_from

CLUSTER = {"chief": ["h0:1"], "ps": ["h1:1", "h2:1"], "worker": ["h3:1", "h4:1", "h5:1"]}


def test_world_roles_from_num_ps_and_from_the_environment():
    assert roles_from(None, 2, 0, 5, {}) == Roles(0, (1, 2), (3, 4))
    assert roles_from(None, None, 3, 4, {NUM_PS_ENV: "1"}) == Roles(0, (1,), (2, 3))
    roles = roles_from(None, 1, 0, 4, {NUM_PS_ENV: "3"})  # the argument wins
    assert roles.task_of(0) == ("chief", 0)
    assert roles.task_of(1) == ("ps", 0)
    assert roles.task_of(3) == ("worker", 1)


@pytest.mark.parametrize(("num_ps", "size", "message"), [
    (None, 4, "There must be at least one ps."),
    (0, 4, "There must be at least one ps."),
    (2, 3, "There must be at least one worker."),
    (1, 2, "start at least 3 ranks"),
])
def test_tf_errors_for_missing_roles(num_ps, size, message):
    with pytest.raises(ValueError, match=message):
        roles_from(None, num_ps, 0, size, {})


def test_bad_environment_value_names_the_variable():
    with pytest.raises(ValueError, match=f"{NUM_PS_ENV}='two'"):
        roles_from(None, None, 0, 4, {NUM_PS_ENV: "two"})


def test_cluster_resolver_tasks_map_to_ranks_in_order():
    for rank, task in enumerate([("chief", 0), ("ps", 0), ("ps", 1), ("worker", 0),
                                 ("worker", 1), ("worker", 2)]):
        resolver = SimpleClusterResolver(CLUSTER, task_type=task[0], task_id=task[1])
        roles = roles_from(resolver, None, rank, 6, {})
        assert roles == Roles(0, (1, 2), (3, 4, 5))
        assert roles.task_of(rank) == task


@pytest.mark.parametrize(("cluster", "task", "rank", "size", "message"), [
    ({}, None, 0, 4, "Cluster spec must be non-empty"),
    ({"chief": ["a"], "worker": ["b", "c"]}, ("chief", 0), 0, 3,
     "There must be at least one ps."),
    ({"chief": ["a"], "ps": ["b"]}, ("chief", 0), 0, 2, "There must be at least one worker."),
    ({"chief": ["a"], "ps": ["b"], "worker": ["c"], "evaluator": ["d"]}, ("chief", 0), 0, 3,
     "allowed task types are"),
    ({"ps": ["b"], "worker": ["c", "d"]}, ("ps", 0), 1, 3, "exactly one chief"),
    (CLUSTER, ("worker", 0), 0, 6, "rank 0 is task worker:0"),
    (CLUSTER, ("chief", 0), 0, 4, "has 6 tasks"),
])
def test_cluster_errors(cluster, task, rank, size, message):
    kwargs = {} if task is None else {"task_type": task[0], "task_id": task[1]}
    resolver = SimpleClusterResolver(cluster, **kwargs)
    with pytest.raises(ValueError, match=message):
        roles_from(resolver, None, rank, size, {})


def test_num_ps_must_agree_with_the_cluster():
    resolver = SimpleClusterResolver(CLUSTER, task_type="chief", task_id=0)
    with pytest.raises(ValueError, match="num_ps=1 but the cluster has 2 ps"):
        roles_from(resolver, 1, 0, 6, {})
    with pytest.raises(TypeError, match="num_ps must be an int"):
        roles_from(None, "1", 0, 6, {})


def test_tf_config_and_slurm_resolvers_give_the_roles(monkeypatch):
    """TF_CONFIG with chief/ps/worker tasks, and a Slurm step with those jobs (which TF's
    Slurm resolver assigns in sorted name order: chief, ps, worker), map onto the ranks."""
    import json

    from mpistrat import SlurmClusterResolver, TFConfigClusterResolver

    for rank, (kind, index) in enumerate([("chief", 0), ("ps", 0), ("ps", 1), ("worker", 0),
                                          ("worker", 1), ("worker", 2)]):
        monkeypatch.setenv("TF_CONFIG", json.dumps(
            {"cluster": CLUSTER, "task": {"type": kind, "index": index}}))
        assert roles_from(TFConfigClusterResolver(), None, rank, 6, {}) == \
            Roles(0, (1, 2), (3, 4, 5))
    step = {"SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    for procid in range(4):
        env = {**step, "SLURM_PROCID": str(procid)}
        for jobs in ({"chief": 1, "ps": 1, "worker": 2}, {"worker": 2, "ps": 1, "chief": 1}):
            resolver = SlurmClusterResolver(jobs, env=env)
            assert roles_from(resolver, None, procid, 4, {}) == Roles(0, (1,), (2, 3))
