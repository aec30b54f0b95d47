"""ClusterSpec and TF's multi-worker rules (validate, worker_count, id_in_cluster, is_chief,
collective_leader), from plain dicts."""

from __future__ import annotations

import numpy as np
import pytest

from mpistrat.cluster import (
    ClusterSpec,
    SimpleClusterResolver,
    collective_leader,
    format_master_url,
    id_in_cluster,
    is_chief,
    normalize_cluster_spec,
    validate_cluster_spec,
    worker_count,
)
from mpistrat.errors import MpistratError

CHIEF_2W = {"chief": ["c0:2222"], "worker": ["w0:2222", "w1:2222"]}
WORKERS_3 = {"worker": ["w0:2222", "w1:2222", "w2:2222"]}
FULL = {"chief": ["c0:1"], "worker": ["w0:1", "w1:1"], "ps": ["p0:1", "p1:1"],
        "evaluator": ["e0:1"]}


# --- ClusterSpec ------------------------------------------------------------------------


def test_cluster_spec_from_lists_and_sparse_dicts():
    spec = ClusterSpec({"worker": ["a:1", "b:1"], "ps": {3: "p:1", 1: "q:1"}})
    assert spec.jobs == ["worker", "ps"]
    assert spec.num_tasks("worker") == 2 and spec.num_tasks("ps") == 2
    assert spec.task_indices("ps") == [1, 3]
    assert spec.task_address("ps", 3) == "p:1"
    assert spec.job_tasks("ps") == [None, "q:1", None, "p:1"]
    assert spec.job_tasks("worker") == ["a:1", "b:1"]
    assert spec.as_dict() == {"worker": ["a:1", "b:1"], "ps": {1: "q:1", 3: "p:1"}}


def test_cluster_spec_dense_dict_becomes_a_list_and_string_indices_are_ints():
    spec = ClusterSpec({"worker": {"1": "b:1", 0: "a:1"}})
    assert spec.as_dict() == {"worker": ["a:1", "b:1"]}


def test_cluster_spec_equality_truth_and_repr():
    spec = ClusterSpec(CHIEF_2W)
    assert spec == ClusterSpec(dict(reversed(list(CHIEF_2W.items()))))
    assert spec == CHIEF_2W and spec != WORKERS_3 and spec != 3
    assert ClusterSpec(spec) == spec and normalize_cluster_spec(spec) is spec
    assert bool(spec) and not ClusterSpec({}) and bool(ClusterSpec({"worker": []}))
    assert repr(spec) == f"ClusterSpec({CHIEF_2W!r})"
    assert ClusterSpec({"worker": []}).as_dict() == {"worker": []}


@pytest.mark.parametrize("cluster, match", [
    (["a:1"], "must be a dict mapping job names"),
    ({1: ["a:1"]}, "job name 1 must be a string"),
    ({"worker": "a:1"}, "tasks of job 'worker' must be a list"),
    ({"worker": [1234]}, "address 1234 of task worker:0 must be a string"),
    ({"worker": {"x": "a:1"}}, "task index 'x' of job 'worker' must be an integer"),
    ({"worker": {-1: "a:1"}}, "task index -1 of job 'worker' must be >= 0"),
])
def test_cluster_spec_rejects_bad_types(cluster, match):
    with pytest.raises(TypeError, match=match):
        ClusterSpec(cluster)


def test_cluster_spec_lookup_errors_name_what_exists():
    spec = ClusterSpec(CHIEF_2W)
    with pytest.raises(ValueError,
                       match=r"no job 'ps' in the cluster; its jobs are \['chief', 'worker'\]"):
        spec.num_tasks("ps")
    with pytest.raises(ValueError, match=r"no task with index 2 in job 'worker'.*\[0, 1\]"):
        spec.task_address("worker", 2)


def test_format_master_url():
    assert format_master_url("h:1", "grpc") == "grpc://h:1"
    assert format_master_url("h:1") == "h:1" and format_master_url("h:1", "") == "h:1"


# --- multi-worker rules -------------------------------------------------------------------


@pytest.mark.parametrize("cluster, task_type, task_id, count, index, chief", [
    (CHIEF_2W, "chief", 0, 3, 0, True),
    (CHIEF_2W, "worker", 0, 3, 1, False),
    (CHIEF_2W, "worker", 1, 3, 2, False),
    (WORKERS_3, "worker", 0, 3, 0, True),
    (WORKERS_3, "worker", 2, 3, 2, False),
    (FULL, "evaluator", 0, 1, 0, True),
    (CHIEF_2W, "evaluator", 0, 1, 0, True),  # the evaluator may be absent from the cluster
    ({}, None, None, 1, 0, True),  # local mode
    ({}, "worker", 5, 1, 0, True),  # local mode ignores the task
])
def test_worker_facts(cluster, task_type, task_id, count, index, chief):
    assert worker_count(cluster, task_type) == count
    assert id_in_cluster(cluster, task_type, task_id) == index
    assert is_chief(cluster, task_type, task_id) is chief


def test_ps_is_valid_but_is_not_a_worker():
    validate_cluster_spec(FULL, "ps", 1)
    assert not is_chief(FULL, "ps", 0)
    with pytest.raises(ValueError, match="unexpected task_type 'ps'"):
        worker_count(FULL, "ps")
    with pytest.raises(ValueError, match="no worker id for task_type 'ps'"):
        id_in_cluster(FULL, "ps", 0)


@pytest.mark.parametrize("cluster, task_type, task_id, leader", [
    (CHIEF_2W, "worker", 1, "/job:chief/replica:0/task:0"),
    (WORKERS_3, "worker", 1, "/job:worker/replica:0/task:0"),
    (FULL, "evaluator", 0, ""),
    ({}, None, None, ""),
])
def test_collective_leader(cluster, task_type, task_id, leader):
    assert collective_leader(cluster, task_type, task_id) == leader


@pytest.mark.parametrize("cluster, task_type, task_id, match", [
    (WORKERS_3, None, None,
     r"a cluster is given .*from the cluster spec\) but no task \(task_type=None, task_id=None\)"),
    (WORKERS_3, "worker", None, "task_type and task_id must be given too"),
    (WORKERS_3, "master", 0,
     "unrecognized task_type 'master'.*'chief', 'worker', 'evaluator' and 'ps'"),
    (WORKERS_3, "123456", 0, "unrecognized task_type '123456'"),
    (WORKERS_3, "chief", 0,
     r"task_type 'chief' not found in the cluster \(from the cluster spec\), whose jobs are "
     r"\['worker'\]"),
    (WORKERS_3, "worker", 3,
     r"task_id 3 exceeds the maximum id of 'worker'.*3 worker task\(s\), ids 0..2"),
    (WORKERS_3, "worker", -1, "task_id must be an integer >= 0, got -1"),
    (WORKERS_3, "worker", True, "task_id must be an integer >= 0, got True"),
    ({"chief": ["a:1", "b:1"], "worker": ["c:1"]}, "worker", 0,
     r"at most one 'chief' task, but the cluster \(from the cluster spec\) has 2: "
     r"\['a:1', 'b:1'\]"),
    ({"worker": ["c:1"], "evaluator": ["a:1", "b:1"]}, "worker", 0,
     "at most one 'evaluator' task"),
    ({"worker": {0: "a:1", 2: "b:1"}}, "worker", 0,
     r"task indices \[0, 2\]; workers need indices 0..n-1"),
])
def test_validation_errors_name_the_values_and_fix(cluster, task_type, task_id, match):
    with pytest.raises(ValueError, match=match) as info:
        validate_cluster_spec(cluster, task_type, task_id)
    assert isinstance(info.value, MpistratError)


def test_validation_names_its_source():
    match = r"task_type 'chief' not found in the cluster \(from TF_CONFIG\)"
    with pytest.raises(ValueError, match=match):
        validate_cluster_spec(WORKERS_3, "chief", 0, source="TF_CONFIG")


# --- SimpleClusterResolver and the base class ---------------------------------------------


def test_simple_resolver_gives_back_what_it_was_given():
    resolver = SimpleClusterResolver(CHIEF_2W, master="m:1", task_type="worker", task_id="1",
                                     num_accelerators={"GPU": 2}, rpc_layer="grpc")
    assert resolver.cluster_spec() == CHIEF_2W
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)
    assert resolver.master() == "grpc://m:1"
    assert resolver.master("chief", 0) == "grpc://c0:2222"
    assert resolver.master("chief", 0, rpc_layer="http") == "http://c0:2222"
    assert resolver.num_accelerators() == {"GPU": 2}
    assert (resolver.num_workers, resolver.worker_index, resolver.is_chief) == (3, 2, False)
    assert resolver.environment == ""
    resolver.task_type, resolver.task_id = "chief", 0
    assert resolver.is_chief and resolver.worker_index == 0


def test_base_num_accelerators_counts_local_gpus_for_this_task_only(monkeypatch):
    monkeypatch.setattr("mpistrat.cluster.base.local_gpu_count", lambda: 3)
    resolver = SimpleClusterResolver(WORKERS_3, task_type="worker", task_id=1)
    assert resolver.num_accelerators() == {"GPU": 3}
    assert resolver.num_accelerators("worker", 1) == {"GPU": 3}
    with pytest.raises(ValueError,
                       match=r"only answer for this task \(worker:1\), not for worker:2"):
        resolver.num_accelerators("worker", 2)
    monkeypatch.setattr("mpistrat.cluster.base.local_gpu_count", lambda: 0)
    assert resolver.num_accelerators() == {}


@pytest.mark.parametrize("value", [1.5, "x", -2, True, "-1"])
def test_task_id_setter_rejects_non_indices(value):
    resolver = SimpleClusterResolver(WORKERS_3)
    with pytest.raises(ValueError, match="task_id must be a non-negative integer"):
        resolver.task_id = value


def test_task_id_setter_takes_any_integer_type():
    assert SimpleClusterResolver(WORKERS_3, task_id=np.int64(2)).task_id == 2
    assert SimpleClusterResolver(WORKERS_3, task_id=" 1 ").task_id == 1


def test_task_type_setter_turns_values_into_strings():
    resolver = SimpleClusterResolver(WORKERS_3, task_type=7)
    assert resolver.task_type == "7"
    resolver.task_type = None
    assert resolver.task_type is None
