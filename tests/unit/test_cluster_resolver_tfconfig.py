"""TFConfigClusterResolver: TF_CONFIG parsing, TF's task rules and master(), from plain dicts."""

from __future__ import annotations

import json

import pytest

from mpistrat.cluster import TFConfigClusterResolver, parse_tf_config
from mpistrat.errors import MpistratError

CLUSTER = {"chief": ["c0:2222"], "worker": ["w0:2222", "w1:2222"], "ps": ["p0:2222"]}


def env_of(**config):
    return {"TF_CONFIG": json.dumps(config)}


def resolver_for(**config):
    return TFConfigClusterResolver(env=env_of(**config))


@pytest.mark.parametrize("env", [{}, {"TF_CONFIG": ""}, {"TF_CONFIG": "  \n"},
                                 {"TF_CONFIG": "{}"}, {"OTHER": "1"}])
def test_no_tf_config_is_local_mode(env):
    resolver = TFConfigClusterResolver(env=env)
    assert not resolver.cluster_spec()
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == (None, None, None)
    assert resolver.master() == ""
    assert (resolver.num_workers, resolver.worker_index, resolver.is_chief) == (1, 0, True)
    resolver.validate()


@pytest.mark.parametrize("task, worker_index, chief", [
    ({"type": "chief", "index": 0}, 0, True),
    ({"type": "worker", "index": 0}, 1, False),
    ({"type": "worker", "index": 1}, 2, False),
])
def test_chief_and_workers(task, worker_index, chief):
    resolver = resolver_for(cluster=CLUSTER, task=task)
    assert resolver.cluster_spec() == CLUSTER
    assert (resolver.task_type, resolver.task_id) == (task["type"], task["index"])
    assert resolver.num_workers == 3
    assert resolver.worker_index == worker_index
    assert resolver.is_chief is chief


def test_workers_only_worker_zero_is_chief():
    cluster = {"worker": ["a:1", "b:1"]}
    assert resolver_for(cluster=cluster, task={"type": "worker", "index": 0}).is_chief
    assert not resolver_for(cluster=cluster, task={"type": "worker", "index": 1}).is_chief


def test_evaluator_outside_the_cluster_is_its_own_chief():
    resolver = resolver_for(cluster=CLUSTER, task={"type": "evaluator", "index": 0})
    resolver.validate()
    assert (resolver.num_workers, resolver.worker_index, resolver.is_chief) == (1, 0, True)


def test_ps_task_is_valid_but_has_no_worker_count():
    resolver = resolver_for(cluster=CLUSTER, task={"type": "ps", "index": 0})
    resolver.validate()
    assert not resolver.is_chief
    with pytest.raises(ValueError, match="unexpected task_type 'ps'"):
        resolver.num_workers


def test_index_as_string_and_type_as_number_are_coerced_like_tf():
    resolver = resolver_for(cluster=CLUSTER, task={"type": "worker", "index": "1"})
    assert resolver.task_id == 1 and resolver.worker_index == 2
    odd = resolver_for(cluster=CLUSTER, task={"type": 123456, "index": 0})
    assert odd.task_type == "123456"
    with pytest.raises(ValueError, match=r"unrecognized task_type '123456' \(from TF_CONFIG\)"):
        odd.validate()


@pytest.mark.parametrize("config, match", [
    ({"cluster": CLUSTER}, "a cluster is given .* but no task"),
    ({"cluster": CLUSTER, "task": {"type": "worker"}}, "task_id=None"),
    ({"cluster": {"worker": ["a:1"]}, "task": {"type": "chief", "index": 0}},
     r"task_type 'chief' not found in the cluster \(from TF_CONFIG\), whose jobs are"),
    ({"cluster": CLUSTER, "task": {"type": "worker", "index": 2}},
     r"task_id 2 exceeds the maximum id of 'worker'.*ids 0..1"),
    ({"cluster": {"chief": ["a:1", "b:1"]}, "task": {"type": "chief", "index": 0}},
     "there must be at most one 'chief' task"),
])
def test_invalid_tasks_raise_on_validation_not_construction(config, match):
    resolver = resolver_for(**config)
    resolver.cluster_spec()  # parsing succeeded
    with pytest.raises(ValueError, match=match) as info:
        resolver.validate()
    assert isinstance(info.value, MpistratError)
    with pytest.raises(ValueError, match=match):
        resolver.is_chief


@pytest.mark.parametrize("text, match", [
    ('{"cluster": ', r"TF_CONFIG is not valid JSON \(Expecting value at line 1 column 13\)"),
    ("cluster=a", "TF_CONFIG is not valid JSON"),
    ("[1, 2]", "TF_CONFIG must be a JSON object, got a JSON list"),
    ('{"cluster": ["a:1"]}', "TF_CONFIG's \"cluster\" must be a JSON object, got \\[\"a:1\"\\]"),
    ('{"task": "worker"}', "TF_CONFIG's \"task\" must be a JSON object"),
    ('{"rpc_layer": 3}', "TF_CONFIG's \"rpc_layer\" must be a string, got 3"),
    ('{"cluster": {"worker": [1]}}', "TF_CONFIG has a bad \"cluster\": address 1 of task worker:0"),
    ('{"cluster": {"worker": "a:1"}}', "tasks of job 'worker' must be a list"),
    ('{"task": {"type": "worker", "index": "one"}}',
     "TF_CONFIG: task.index must be a non-negative integer .* 'one'"),
    ('{"task": {"type": "worker", "index": -1}}', "task.index must be a non-negative integer"),
    ('{"task": {"type": "worker", "index": 1.5}}', "task.index must be a non-negative integer"),
])
def test_malformed_tf_config_is_a_clear_error_on_first_use(text, match):
    resolver = TFConfigClusterResolver(env={"TF_CONFIG": text})  # does not raise here
    for use in (resolver.cluster_spec, lambda: resolver.task_type, lambda: resolver.task_id,
                resolver.master, resolver.validate):
        with pytest.raises(ValueError, match=match):
            use()
    with pytest.raises(ValueError, match=match):
        parse_tf_config(text)


def test_long_bad_tf_config_is_clipped_in_the_message():
    with pytest.raises(ValueError) as info:
        parse_tf_config("{" + "x" * 1000)
    assert len(str(info.value)) < 500 and "..." in str(info.value)


def test_constructor_task_overrides_tf_config_and_setters_override_both():
    env = env_of(cluster=CLUSTER, task={"type": "worker", "index": 1})
    resolver = TFConfigClusterResolver(task_type="chief", task_id=0, env=env)
    assert (resolver.task_type, resolver.task_id, resolver.is_chief) == ("chief", 0, True)
    resolver.task_type, resolver.task_id = "worker", "0"
    assert (resolver.task_type, resolver.task_id, resolver.worker_index) == ("worker", 0, 1)
    with pytest.raises(ValueError, match="task_id must be a non-negative integer"):
        TFConfigClusterResolver(task_id="x", env=env)


def test_tf_config_is_read_once_at_construction(monkeypatch):
    env = env_of(cluster=CLUSTER, task={"type": "worker", "index": 1})
    resolver = TFConfigClusterResolver(env=env)
    env["TF_CONFIG"] = "{}"
    assert resolver.task_id == 1
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["x:1", "y:1"]},
                                                "task": {"type": "worker", "index": 1}}))
    from_os = TFConfigClusterResolver()
    monkeypatch.delenv("TF_CONFIG")
    assert from_os.cluster_spec() == {"worker": ["x:1", "y:1"]} and from_os.task_id == 1


def test_rpc_layer_precedence():
    env = env_of(cluster=CLUSTER, task={"type": "worker", "index": 1}, rpc_layer="grpc")
    resolver = TFConfigClusterResolver(env=env)
    assert resolver.rpc_layer == "grpc"
    assert resolver.master() == "grpc://w1:2222"
    assert TFConfigClusterResolver(rpc_layer="grpc+verbs", env=env).rpc_layer == "grpc+verbs"
    resolver.rpc_layer = "http"
    assert resolver.master() == "http://w1:2222"


def test_master_rules():
    task = {"type": "worker", "index": 0}
    assert resolver_for(cluster=CLUSTER, task=task).master() == "w0:2222"
    assert resolver_for(cluster=CLUSTER, task=task).master("ps", 0) == "p0:2222"
    assert resolver_for(cluster=CLUSTER, task=task).master("chief", 0, "grpc") == "grpc://c0:2222"
    # a single job with a single task, or no job at all: nothing to connect to
    assert resolver_for(cluster={"worker": ["w0:1"]}, task=task, rpc_layer="grpc").master() == ""
    assert resolver_for(task=task).master() == ""
    # session_master wins
    with_master = resolver_for(cluster=CLUSTER, task=task, session_master="sm:1")
    assert with_master.master() == "sm:1"
    # a cluster but no task: no master
    assert resolver_for(cluster=CLUSTER).master() == ""
    with pytest.raises(ValueError, match="no job 'evaluator' in the cluster"):
        resolver_for(cluster=CLUSTER, task={"type": "evaluator", "index": 0}).master()


def test_environment_and_num_accelerators(monkeypatch):
    monkeypatch.setattr("mpistrat.cluster.base.local_gpu_count", lambda: 2)
    resolver = TFConfigClusterResolver(environment="google",
                                       env=env_of(cluster=CLUSTER,
                                                  task={"type": "worker", "index": 1}))
    assert resolver.environment == "google"
    assert resolver.num_accelerators() == {"GPU": 2}
    assert resolver.num_accelerators("worker", 1, config_proxy=object()) == {"GPU": 2}
    with pytest.raises(ValueError, match="only answer for this task"):
        resolver.num_accelerators("chief", 0)
    assert TFConfigClusterResolver(env={}).environment == ""
