"""Cluster resolvers under MPI at any world size: MPIClusterResolver's facts, TF_CONFIG and
Slurm environments that agree with the communicator, and mistakes (wrong counts, one
rank's bad TF_CONFIG, different clusters per rank, wrong types) that must raise on every
rank instead of hanging.

Each rank builds its own environment as a plain dict (never os.environ), so one rank
can be given a different, or broken, TF_CONFIG than the others.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from mpistrat.cluster import (
    ClusterInfo,
    MPIClusterResolver,
    SlurmClusterResolver,
    TFConfigClusterResolver,
    check_against_world,
    resolve_cluster,
    should_checkpoint,
)
from mpistrat.errors import CollectiveMismatchError, TopologyError

MPI = pytest.importorskip("mpi4py.MPI")


def outcome(call):
    """Run ``call()``; return (result, None) or (None, exception)."""
    try:
        return call(), None
    except Exception as exc:  # noqa: BLE001 -- the caller checks it
        return None, exc


def tf_config_env(workers: int, task_type: str, index: int, chief: bool = True,
                  host: str = "h") -> dict[str, str]:
    """A TF_CONFIG for ``workers`` workers (a chief and workers-1 workers, or all workers)."""
    cluster: dict[str, Any] = {}
    if chief:
        cluster["chief"] = [f"{host}0:2222"]
    cluster["worker"] = [f"{host}{i + int(chief)}:2222" for i in range(workers - int(chief))]
    if not cluster["worker"]:
        del cluster["worker"]
    config = {"cluster": cluster, "task": {"type": task_type, "index": index}}
    return {"TF_CONFIG": json.dumps(config)}


def task_of(rank: int, chief: bool) -> tuple[str, int]:
    """The TF task that is rank ``rank``: chief = rank 0, then worker:0, worker:1, ..."""
    if chief:
        return ("chief", 0) if rank == 0 else ("worker", rank - 1)
    return "worker", rank


def assert_raised_everywhere(comm, error, bad_ranks, own_type, own_match):
    """The ranks in ``bad_ranks`` raised ``own_type`` matching ``own_match``; every other
    rank a CollectiveMismatchError naming them."""
    assert error is not None, "no error on this rank"
    if comm.rank in bad_ranks:
        assert isinstance(error, own_type), repr(error)
        assert own_match in str(error), str(error)
    else:
        assert isinstance(error, CollectiveMismatchError), repr(error)
        assert f"rank(s) {sorted(bad_ranks)}" in str(error), str(error)


# --- MPIClusterResolver ------------------------------------------------------------------


def test_mpi_resolver_facts(comm):
    resolver = MPIClusterResolver(comm)
    rank, size = comm.rank, comm.size
    assert (resolver.task_type, resolver.task_id) == ("worker", rank)
    assert (resolver.num_workers, resolver.worker_index) == (size, rank)
    assert resolver.is_chief is (rank == 0) and should_checkpoint(resolver) is (rank == 0)
    hosts = resolver.hostnames()
    assert hosts == tuple(comm.allgather(MPI.Get_processor_name()))
    spec = resolver.cluster_spec()
    assert spec.jobs == ["worker"] and spec.num_tasks("worker") == size
    addresses = spec.job_tasks("worker")
    assert len(set(addresses)) == size, addresses
    assert all(address.startswith(f"{host}:") for address, host in zip(addresses, hosts))
    assert resolver.master() == addresses[rank]
    assert comm.allgather(repr(spec)) == [repr(spec)] * size


def test_resolve_cluster_default_is_the_communicator(comm):
    info = resolve_cluster(comm=comm)
    assert isinstance(info, ClusterInfo) and isinstance(info.resolver, MPIClusterResolver)
    assert (info.num_workers, info.worker_index, info.is_chief) == (
        comm.size, comm.rank, comm.rank == 0)
    assert (info.task_type, info.task_id) == ("worker", comm.rank)
    assert info.hostnames == tuple(comm.allgather(MPI.Get_processor_name()))


def test_mpi_resolver_on_another_communicator_is_an_error_everywhere(world):
    if world.size == 1:
        pytest.skip("needs a sub-communicator smaller than the world")
    half = world.Split(color=int(world.rank >= (world.size + 1) // 2), key=world.rank)
    try:
        _, error = outcome(lambda: resolve_cluster(MPIClusterResolver(half), world))
    finally:
        half.Free()
    assert isinstance(error, TopologyError), repr(error)
    assert f"the MPI communicator has {world.size} ranks and this is rank {world.rank}" \
        in str(error)


# --- TF_CONFIG ---------------------------------------------------------------------------


@pytest.mark.parametrize("chief", [True, False])
def test_tf_config_consistent_with_the_world_passes(comm, chief):
    task_type, index = task_of(comm.rank, chief)
    resolver = TFConfigClusterResolver(env=tf_config_env(comm.size, task_type, index, chief))
    check_against_world(resolver, comm)
    info = resolve_cluster(resolver, comm)
    assert (info.num_workers, info.worker_index, info.is_chief) == (
        comm.size, comm.rank, comm.rank == 0)
    assert (info.task_type, info.task_id, info.hostnames) == (task_type, index, None)
    assert should_checkpoint(info) is (comm.rank == 0)


def test_tf_config_with_too_many_workers_raises_on_every_rank(comm):
    task_type, index = task_of(comm.rank, True)
    resolver = TFConfigClusterResolver(env=tf_config_env(comm.size + 1, task_type, index))
    _, error = outcome(lambda: check_against_world(resolver, comm))
    assert isinstance(error, TopologyError), repr(error)
    assert f"TF_CONFIG describes {comm.size + 1} workers" in str(error)
    assert f"the MPI communicator has {comm.size} rank" in str(error)
    assert f"this is rank {comm.rank}" in str(error)


def test_one_rank_with_the_wrong_task_raises_on_every_rank(comm):
    last = comm.size - 1
    task_type, index = task_of(comm.rank, False)
    if comm.rank == last:
        index = 0 if comm.size > 1 else 1  # another rank's task, or beyond the cluster
    resolver = TFConfigClusterResolver(env=tf_config_env(comm.size, task_type, index, False))
    _, error = outcome(lambda: resolve_cluster(resolver, comm))
    expected = "task worker:0 = worker id 0" if comm.size > 1 else "task_id 1 exceeds"
    assert_raised_everywhere(comm, error, [last], TopologyError, expected)


def test_one_rank_with_a_bad_tf_config_raises_on_every_rank(comm):
    bad = comm.size // 2
    task_type, index = task_of(comm.rank, True)
    env = tf_config_env(comm.size, task_type, index)
    if comm.rank == bad:
        env = {"TF_CONFIG": env["TF_CONFIG"][:-3]}  # truncated JSON
    resolver = TFConfigClusterResolver(env=env)  # never raises here
    _, error = outcome(lambda: resolve_cluster(resolver, comm))
    assert_raised_everywhere(comm, error, [bad], TopologyError, "TF_CONFIG is not valid JSON")


def test_one_evaluator_rank_raises_on_every_rank(comm):
    last = comm.size - 1
    task_type, index = task_of(comm.rank, True)
    env = tf_config_env(comm.size, task_type, index)
    if comm.rank == last:
        config = json.loads(env["TF_CONFIG"])
        config["task"] = {"type": "evaluator", "index": 0}
        env = {"TF_CONFIG": json.dumps(config)}
    _, error = outcome(lambda: resolve_cluster(TFConfigClusterResolver(env=env), comm))
    assert_raised_everywhere(comm, error, [last], TopologyError, "an evaluator is not a worker")


def test_different_clusters_on_different_ranks_raise_on_every_rank(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks")
    task_type, index = task_of(comm.rank, True)
    host = "other" if comm.rank == comm.size - 1 else "h"
    env = tf_config_env(comm.size, task_type, index, host=host)
    _, error = outcome(lambda: resolve_cluster(TFConfigClusterResolver(env=env), comm))
    assert isinstance(error, CollectiveMismatchError), repr(error)
    assert "called with different arguments on different ranks" in str(error)
    assert "other0:2222" in str(error) and "h0:2222" in str(error)


def test_one_rank_passing_a_non_resolver_raises_on_every_rank(comm):
    resolver: Any = MPIClusterResolver(comm)
    if comm.rank == 0:
        resolver = {"worker": ["a:1"]}
    _, error = outcome(lambda: resolve_cluster(resolver, comm))
    assert_raised_everywhere(comm, error, [0], TopologyError,
                             "cluster_resolver must be an instance of mpistrat.ClusterResolver")


def test_the_communicator_is_usable_after_a_failed_check(comm):
    resolver = TFConfigClusterResolver(env={"TF_CONFIG": "{"})
    _, error = outcome(lambda: resolve_cluster(resolver, comm))
    assert isinstance(error, TopologyError)
    assert comm.allreduce(1) == comm.size
    assert resolve_cluster(comm=comm).num_workers == comm.size


# --- Slurm -------------------------------------------------------------------------------


def test_slurm_step_matching_the_world_passes(comm):
    env = {"SLURM_PROCID": str(comm.rank), "SLURM_STEP_NODELIST": "node[1-2]",
           "SLURM_STEP_TASKS_PER_NODE": f"{(comm.size + 1) // 2},{comm.size // 2}"}
    if comm.size == 1:
        env["SLURM_STEP_NODELIST"], env["SLURM_STEP_TASKS_PER_NODE"] = "node1", "1"
    info = resolve_cluster(SlurmClusterResolver(env=env), comm)
    assert (info.num_workers, info.worker_index, info.task_type) == (
        comm.size, comm.rank, "worker")


def test_slurm_batch_step_under_mpirun_raises_on_every_rank(comm):
    """Under mpirun in an allocation, every rank sees the batch step: SLURM_PROCID=0."""
    env = {"SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "node1",
           "SLURM_TASKS_PER_NODE": str(comm.size)}
    _, error = outcome(lambda: resolve_cluster(SlurmClusterResolver(env=env), comm))
    if comm.size == 1:
        assert error is None, repr(error)
        return
    bad = list(range(1, comm.size))
    assert_raised_everywhere(comm, error, bad, TopologyError,
                             "under mpirun inside an allocation")
