"""``UnionResolver`` merges clusters as TF's does (lists concatenated, sparse indices kept,
a task given twice TF's KeyError naming it), takes this task from its keywords or its
first resolver, and is checked against the MPI world like any resolver (a strategy takes
it); TF's GCE, Kubernetes and TPU resolvers exist for isinstance but raise
``UnsupportedError`` naming what to use, whatever TF arguments they are given."""

from __future__ import annotations

import json

import pytest

import mpistrat as ms
from mpistrat.cluster import (
    ClusterResolver,
    ClusterSpec,
    GCEClusterResolver,
    KubernetesClusterResolver,
    SimpleClusterResolver,
    TFConfigClusterResolver,
    TPUClusterResolver,
    UnionResolver,
    match_world,
    resolve_cluster,
)
from mpistrat.errors import MpistratError, TopologyError, UnsupportedError


def simple(cluster, **kwargs):
    return SimpleClusterResolver(ClusterSpec(cluster), **kwargs)


def test_lists_are_concatenated_in_order_and_jobs_joined():
    union = UnionResolver(simple({"worker": ["h0:1", "h1:1"]}),
                          simple({"worker": ["h2:1"], "ps": ["p0:1", "p1:1"]}))
    assert union.cluster_spec() == {"worker": ["h0:1", "h1:1", "h2:1"],
                                    "ps": ["p0:1", "p1:1"]}


def test_sparse_indices_are_kept_and_a_list_counts_from_zero():
    union = UnionResolver(simple({"worker": {3: "w3:1"}}), simple({"worker": ["w0:1", "w1:1"]}))
    assert union.cluster_spec().as_dict() == {"worker": {0: "w0:1", 1: "w1:1", 3: "w3:1"}}


def test_a_dict_job_given_first_stays_a_dict_and_dense_dicts_count_as_lists():
    # any resolver giving a job sparsely makes the whole job index-merged, whatever the order
    union = UnionResolver(simple({"worker": {1: "w1:1"}}), simple({"worker": ["w0:1"]}))
    assert union.cluster_spec() == {"worker": ["w0:1", "w1:1"]}
    # {0: a, 1: b} is tasks 0..1, a list: concatenated like one
    union = UnionResolver(simple({"worker": {0: "a:1", 1: "b:1"}}), simple({"worker": ["c:1"]}))
    assert union.cluster_spec() == {"worker": ["a:1", "b:1", "c:1"]}


def test_three_resolvers_concatenate_in_order_and_jobs_keep_first_seen_order():
    union = UnionResolver(simple({"ps": ["p0:1"]}), simple({"worker": ["w0:1"]}),
                          simple({"worker": ["w1:1"], "ps": ["p1:1"], "chief": ["c:1"]}))
    spec = union.cluster_spec()
    assert spec.jobs == ["ps", "worker", "chief"]
    assert spec == {"ps": ["p0:1", "p1:1"], "worker": ["w0:1", "w1:1"], "chief": ["c:1"]}


def test_a_task_given_twice_is_tfs_key_error_naming_the_task_addresses_and_resolvers():
    union = UnionResolver(simple({"worker": ["a:1", "b:1"]}), simple({"ps": ["p:1"]}),
                          simple({"worker": {1: "c:1"}}))
    with pytest.raises(KeyError, match=r"task worker:1 is given twice, as b:1 by resolver 0 "
                                       r"\(SimpleClusterResolver\) and as c:1 by resolver 2 "
                                       r"\(SimpleClusterResolver\); give each task") as info:
        union.cluster_spec()
    assert isinstance(info.value, ValueError)  # (and a KeyError, as TF's)
    assert str(info.value).startswith("UnionResolver: task")  # (not quoted as KeyError's)
    # the same under resolve_cluster (checked collectively, so every rank raises it)
    MPI = pytest.importorskip("mpi4py.MPI")
    first = simple({"worker": ["a:1", "b:1"]}, task_type="worker", task_id=0)
    with pytest.raises(KeyError, match="task worker:1 is given twice"):
        resolve_cluster(UnionResolver(first, simple({"worker": {1: "c:1"}})), MPI.COMM_SELF)


def test_task_and_rpc_layer_from_keywords_else_from_the_first_resolver():
    first = simple({"worker": ["h0:1", "h1:1"]}, task_type="worker", task_id=1,
                   rpc_layer="grpc", environment="google", num_accelerators={"GPU": 2})
    union = UnionResolver(first, simple({"ps": ["p0:1"]}))
    assert (union.task_type, union.task_id, union.rpc_layer) == ("worker", 1, "grpc")
    assert union.environment == "google" and union.num_accelerators() == {"GPU": 2}
    assert union.master("ps", 0) == "grpc://p0:1"
    assert union.num_workers == 2 and union.worker_index == 1
    chosen = UnionResolver(first, task_type="worker", task_id=0, rpc_layer="grpc+verbs")
    assert (chosen.task_type, chosen.task_id, chosen.rpc_layer) == ("worker", 0, "grpc+verbs")
    assert chosen.master("worker", 0) == "grpc+verbs://h0:1"
    chosen.task_id = 1  # settable, as on every resolver
    assert chosen.task_id == 1
    assert UnionResolver(first, task_id="0").task_id == 0  # TF_CONFIG-style digits
    with pytest.raises(ValueError, match="task_id must be a non-negative integer.*'w0'"):
        UnionResolver(first, task_id="w0")


def test_master_without_a_task_is_the_first_resolvers_with_the_rpc_layer_override():
    first = simple({"worker": ["h0:1"]}, master="m0:1", rpc_layer="grpc")
    assert UnionResolver(first, simple({"ps": ["p0:1"]})).master() == "grpc://m0:1"
    assert UnionResolver(first, rpc_layer="grpc+verbs").master() == "grpc+verbs://m0:1"
    assert UnionResolver(first).master(rpc_layer="http") == "http://m0:1"
    with pytest.raises(ValueError, match="no task with index 3 in job 'worker'"):
        UnionResolver(first).master("worker", 3)


@pytest.mark.parametrize("args,kwargs,error,match", [
    ((), {}, ValueError, "at least one ClusterResolver"),
    (("worker",), {}, TypeError, "argument 0 is a str, not a ClusterResolver"),
    ((None,), {"task_type": "worker", "job": 1}, ValueError, r"unexpected keyword.*'job'"),
])
def test_bad_arguments(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        UnionResolver(*args, **kwargs)


def test_a_strategy_takes_a_union_that_matches_the_world():
    MPI = pytest.importorskip("mpi4py.MPI")
    union = UnionResolver(simple({"worker": ["localhost:1"]}, task_type="worker", task_id=0),
                          simple({"ps": ["ps0:1"]}))
    strategy = ms.MultiWorkerMirroredStrategy(cluster_resolver=union, comm=MPI.COMM_SELF,
                                              local_replicas=1)
    assert strategy.num_replicas_in_sync == 1
    assert strategy.cluster_resolver is union
    assert strategy.reduce("sum", 2.0) == 2.0


def test_a_union_that_does_not_match_the_world_is_checked_like_any_resolver():
    MPI = pytest.importorskip("mpi4py.MPI")
    two = UnionResolver(simple({"chief": ["c:1"]}, task_type="chief", task_id=0),
                        simple({"worker": ["w0:1"]}))
    assert two.num_workers == 2 and two.is_chief
    with pytest.raises(TopologyError, match=r"the union of SimpleClusterResolver, "
                                            r"SimpleClusterResolver describes 2 workers "
                                            r"\(1 chief \+ 1 worker\).*has 1 rank"):
        ms.MultiWorkerMirroredStrategy(cluster_resolver=two, comm=MPI.COMM_SELF)


def test_tfs_gpu_override_example_lists_the_workers_twice_an_empty_cluster_does_not():
    # TF's docs override num_accelerators with a resolver over the same cluster; lists are
    # concatenated, so the union has every worker twice and the world check says so
    config = TFConfigClusterResolver(env={"TF_CONFIG": json.dumps(
        {"cluster": {"worker": ["w0:1"]}, "task": {"type": "worker", "index": 0}})})
    doubled = UnionResolver(simple(config.cluster_spec(), num_accelerators={"GPU": 1}), config)
    assert doubled.cluster_spec() == {"worker": ["w0:1", "w0:1"]}
    with pytest.raises(TopologyError, match="describes 2 workers .* has 1 rank"):
        match_world(UnionResolver(doubled, task_type="worker", task_id=0), 0, 1)
    override = simple({}, num_accelerators={"GPU": 1})
    union = UnionResolver(override, config, task_type=config.task_type, task_id=config.task_id)
    assert union.cluster_spec() == {"worker": ["w0:1"]}
    assert union.num_accelerators() == {"GPU": 1}
    info = match_world(union, 0, 1)
    assert (info.num_workers, info.worker_index, info.task_type) == (1, 0, "worker")


@pytest.mark.parametrize("cls,match", [
    (GCEClusterResolver, "mpirun --hostfile or Slurm"),
    (KubernetesClusterResolver, "MPI Operator.*TF_CONFIG"),
    (TPUClusterResolver, "no TPUs over MPI.*MultiWorkerMirroredStrategy"),
])
def test_resolvers_of_other_services_are_named_but_say_what_to_use(cls, match):
    assert issubclass(cls, ClusterResolver)
    assert not isinstance(SimpleClusterResolver({}), cls)
    with pytest.raises(UnsupportedError, match=match):
        cls()
    with pytest.raises(UnsupportedError, match="MPIClusterResolver"):
        cls("name-or-project")  # TF's first positional argument: still the clear error


@pytest.mark.parametrize("make", [
    lambda: GCEClusterResolver("my-project", "us-central1-a", "workers", 2222,
                               task_type="worker", task_id=1, rpc_layer="grpc",
                               credentials="default", service=None),
    lambda: KubernetesClusterResolver({"worker": ["job-name=worker-pool"]},
                                      tf_server_port=8470, rpc_layer="grpc",
                                      override_client=None),
    lambda: TPUClusterResolver(tpu="grpc://10.0.0.2:8470", zone="us-central1-b",
                               project="p", job_name="worker", coordinator_name="coordinator",
                               coordinator_address="10.0.0.1:8470", credentials="default",
                               service=None, discovery_url=None),
    lambda: TPUClusterResolver.connect(),
    lambda: TPUClusterResolver.connect(tpu="my-tpu", zone="us-central1-b", project="p"),
], ids=["gce", "kubernetes", "tpu", "tpu-connect", "tpu-connect-args"])
def test_tfs_constructor_arguments_give_the_clear_error_not_a_type_error(make):
    with pytest.raises(UnsupportedError, match="which an MPI job does not use; use ") as info:
        make()
    assert isinstance(info.value, MpistratError)
