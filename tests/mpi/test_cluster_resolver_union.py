"""``UnionResolver`` under MPI at any world size: the MPI ranks as workers joined with
parameter servers given in code, a chief and workers from two resolvers, and mistakes on one
rank (a task given twice, a broken TF_CONFIG before the collective MPIClusterResolver) that
must raise on every rank instead of hanging."""

from __future__ import annotations

import json

import pytest

import mpistrat as ms
from mpistrat.cluster import (
    MPIClusterResolver,
    SimpleClusterResolver,
    TFConfigClusterResolver,
    UnionResolver,
    resolve_cluster,
)
from mpistrat.errors import CollectiveMismatchError, TopologyError

MPI = pytest.importorskip("mpi4py.MPI")

PS = {"ps": ["ps0:2222", "ps1:2222"]}


def outcome(call):
    """Run ``call()``; return (result, None) or (None, exception)."""
    try:
        return call(), None
    except Exception as exc:  # noqa: BLE001 -- the caller checks it
        return None, exc


def assert_raised_everywhere(comm, error, bad_rank, own_type, own_match):
    """``bad_rank`` raised ``own_type`` matching ``own_match``; every other rank a
    CollectiveMismatchError naming it."""
    assert error is not None, "no error on this rank"
    if comm.rank == bad_rank:
        assert isinstance(error, own_type), repr(error)
        assert own_match in str(error), str(error)
    else:
        assert isinstance(error, CollectiveMismatchError), repr(error)
        assert f"rank(s) [{bad_rank}]" in str(error), str(error)


def test_mpi_workers_joined_with_parameter_servers(comm):
    union = UnionResolver(MPIClusterResolver(comm), SimpleClusterResolver(PS))
    info = resolve_cluster(union, comm)
    assert (info.num_workers, info.worker_index, info.is_chief) == (
        comm.size, comm.rank, comm.rank == 0)
    assert (info.task_type, info.task_id) == ("worker", comm.rank)
    spec = union.cluster_spec()
    assert spec.jobs == ["worker", "ps"] and spec.job_tasks("ps") == PS["ps"]
    assert spec.job_tasks("worker") == MPIClusterResolver(comm).cluster_spec().job_tasks("worker")


def test_a_chief_and_workers_from_two_resolvers_with_this_task_given(comm):
    hosts = [f"h{i}:2222" for i in range(comm.size)]
    task = ("chief", 0) if comm.rank == 0 else ("worker", comm.rank - 1)
    resolvers = [SimpleClusterResolver({"chief": hosts[:1]})]
    if comm.size > 1:
        resolvers.append(SimpleClusterResolver({"worker": hosts[1:]}))
    union = UnionResolver(*resolvers, task_type=task[0], task_id=task[1])
    info = resolve_cluster(union, comm)
    assert (info.num_workers, info.worker_index, info.is_chief) == (
        comm.size, comm.rank, comm.rank == 0)
    assert union.master(*task, rpc_layer="grpc") == f"grpc://{hosts[comm.rank]}"


def test_a_strategy_over_a_union(world):
    union = UnionResolver(MPIClusterResolver(world), SimpleClusterResolver(PS))
    strategy = ms.MultiWorkerMirroredStrategy(cluster_resolver=union, comm=world,
                                              local_replicas=1)
    assert strategy.cluster_resolver is union
    assert (strategy.extended.num_workers, strategy.extended.worker_index) == (
        world.size, world.rank)
    assert strategy.reduce("sum", 1.0) == world.size


def test_a_union_with_a_worker_too_many_raises_on_every_rank(comm):
    extra = SimpleClusterResolver({"worker": {comm.size: "extra:2222"}})
    _, error = outcome(lambda: resolve_cluster(UnionResolver(MPIClusterResolver(comm), extra),
                                               comm))
    assert isinstance(error, TopologyError), repr(error)
    assert f"describes {comm.size + 1} workers" in str(error), str(error)


def test_one_rank_giving_a_task_twice_raises_on_every_rank(comm):
    bad = comm.size - 1
    hosts = [f"h{i}:2222" for i in range(comm.size)]
    # sparse indices (a dense {0: ...} would count as a list and be appended)
    other = {"worker": {0: "again:2222", 99: "w99:2222"}} if comm.rank == bad else PS
    union = UnionResolver(SimpleClusterResolver({"worker": hosts}),
                          SimpleClusterResolver(other), task_type="worker", task_id=comm.rank)
    _, error = outcome(lambda: resolve_cluster(union, comm))
    assert_raised_everywhere(comm, error, bad, KeyError, "task worker:0 is given twice")


def test_a_broken_tf_config_before_the_mpi_resolver_raises_on_every_rank(comm):
    # the MPIClusterResolver's first cluster_spec is collective: the union still asks it on
    # the rank whose TF_CONFIG fails, so no rank waits for that one
    bad = comm.size // 2
    config = json.dumps({"cluster": PS})
    env = {"TF_CONFIG": config[:-2] if comm.rank == bad else config}
    union = UnionResolver(TFConfigClusterResolver(env=env), MPIClusterResolver(comm),
                          task_type="worker", task_id=comm.rank)
    _, error = outcome(lambda: resolve_cluster(union, comm))
    assert_raised_everywhere(comm, error, bad, TopologyError, "TF_CONFIG is not valid JSON")
    assert comm.allreduce(1) == comm.size
