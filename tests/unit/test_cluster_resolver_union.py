"""``UnionResolver`` merges clusters as TF's does (lists concatenated, sparse indices kept,
a task given twice an error naming it), takes this task from its keywords or its first
resolver, and works where any resolver does (a strategy); TF's GCE, Kubernetes and TPU
resolvers exist for isinstance but raise ``UnsupportedError`` naming what to use."""

from __future__ import annotations

import pytest

import mpistrat as ms
from mpistrat.cluster import (
    ClusterResolver,
    ClusterSpec,
    GCEClusterResolver,
    KubernetesClusterResolver,
    SimpleClusterResolver,
    TPUClusterResolver,
    UnionResolver,
)
from mpistrat.errors import UnsupportedError


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


def test_a_task_given_twice_names_the_task_both_addresses_and_the_fix():
    union = UnionResolver(simple({"worker": ["a:1", "b:1"]}), simple({"worker": {1: "c:1"}}))
    with pytest.raises(ValueError, match=r"task worker:1 is given twice.*\(b:1\).*\(c:1\)"):
        union.cluster_spec()


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


@pytest.mark.parametrize("args,kwargs,error,match", [
    ((), {}, ValueError, "at least one ClusterResolver"),
    (("worker",), {}, TypeError, "argument 0 is a str, not a ClusterResolver"),
    ((None,), {"task_type": "worker", "job": 1}, ValueError, r"unexpected keyword.*'job'"),
])
def test_bad_arguments(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        UnionResolver(*args, **kwargs)


def test_a_strategy_takes_a_union_that_matches_the_world():
    pytest.importorskip("mpi4py.MPI")
    union = UnionResolver(simple({"worker": ["localhost:1"]}, task_type="worker", task_id=0))
    strategy = ms.MultiWorkerMirroredStrategy(cluster_resolver=union)
    assert strategy.num_replicas_in_sync == 1
    assert strategy.cluster_resolver is union


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
