"""Building a MultiWorkerMirroredStrategy across real MPI ranks: ``communication`` (AUTO,
RING, strings, NCCL on a host without GPUs), ``cross_device_ops``,
``communication_options``, ``cluster_resolver`` (a consistent and an inconsistent
TF_CONFIG), ``local_replicas`` — and every mistake raised on every rank (construction is
collective), never a hang. After each error the ranks build a strategy and reduce, to
show they are still in step.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from _checks import spy_algorithms

import mpistrat as ms
from mpistrat.strategy import mirrored
from mpistrat import (
    BackendUnavailable,
    CollectiveCommunication,
    CommunicationImplementation,
    CommunicationOptions,
    MultiWorkerAllReduce,
    PerReplica,
    TFConfigClusterResolver,
    parse_spec,
)

MPI = pytest.importorskip("mpi4py.MPI")


def still_in_step(comm):
    s = ms.MultiWorkerMirroredStrategy(comm=comm, local_replicas=1)
    assert s.reduce("sum", 1.0) == comm.size


def test_communication_choices(world):
    for communication in (CollectiveCommunication.AUTO, CollectiveCommunication.RING,
                          CommunicationImplementation.RING, "auto", "ring", "RING"):
        s = ms.MultiWorkerMirroredStrategy(communication, comm=world, local_replicas=2)
        assert s.communication is CommunicationImplementation.RING
        assert s.reduce("sum", PerReplica([np.ones(2), np.ones(2)]), axis=0) == \
            4.0 * world.size
    options = CommunicationOptions(implementation=CommunicationImplementation.RING,
                                   timeout_seconds=60)
    assert ms.MultiWorkerMirroredStrategy().comm is MPI.COMM_WORLD  # the default
    s = ms.MultiWorkerMirroredStrategy(comm=world, communication_options=options)
    assert s.communication is CommunicationImplementation.RING
    assert s.extended._options is options  # the default options of every reduction
    assert s.reduce("mean", np.arange(3.0)).tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("ranks_per_node", [None, 1, 2])
def test_auto_picks_shared_memory_by_topology(world, monkeypatch, ranks_per_node):
    """AUTO on host replicas: shm on one node, shm/rechd across nodes of several ranks,
    RING's spec otherwise; RING keeps its ring. Results are the same."""
    if ranks_per_node is None:
        monkeypatch.delenv("MPISTRAT_RANKS_PER_NODE", raising=False)
    else:
        monkeypatch.setenv("MPISTRAT_RANKS_PER_NODE", str(ranks_per_node))
    comm = world.Dup()  # a fresh topology for this setting
    try:
        auto = ms.MultiWorkerMirroredStrategy("auto", comm=comm)
        ring = ms.MultiWorkerMirroredStrategy("ring", comm=comm)
        nodes = -(-world.size // (ranks_per_node or world.size))
        if world.size == 1:
            expected = mirrored.RING_SPEC
        elif nodes == 1:
            expected = mirrored.AUTO_SPEC_ONE_NODE
        elif ranks_per_node and ranks_per_node > 1:
            expected = mirrored.AUTO_SPEC_NODES
        else:
            expected = mirrored.RING_SPEC
        assert str(auto.extended.cross_device_ops.spec) == str(parse_spec(expected))
        assert str(ring.extended.cross_device_ops.spec) == str(parse_spec(mirrored.RING_SPEC))
        for n in (3, 40_000):  # the one-step and the chunked shared-memory paths
            value = np.arange(n, dtype=np.float64) * (world.rank + 1)
            total = np.arange(n, dtype=np.float64) * world.size * (world.size + 1) / 2
            for strategy in (auto, ring):
                assert np.array_equal(strategy.reduce("sum", value, axis=None), total)
    finally:
        comm.Free()


def test_nccl_without_gpus_is_a_clear_error_on_every_rank(world):
    for kwargs in ({"communication": CollectiveCommunication.NCCL},
                   {"communication": "nccl"},
                   {"communication_options": CommunicationOptions(
                       implementation=CommunicationImplementation.NCCL)}):
        with pytest.raises(BackendUnavailable, match="NCCL needs GPU replicas"):
            ms.MultiWorkerMirroredStrategy(comm=world, **kwargs)
    if world.size > 1:  # one rank asks for NCCL: every rank raises
        mine = "nccl" if world.rank == world.size - 1 else "ring"
        with pytest.raises((BackendUnavailable, ms.CollectiveMismatchError)):
            ms.MultiWorkerMirroredStrategy(mine, comm=world)
    still_in_step(world)


def test_bad_arguments_raise_on_every_rank(world):
    cases = [
        ({"communication": "carrier-pigeon"}, ValueError),
        ({"communication_options": {"implementation": "RING"}},
         "communication_options must be an instance of CommunicationOptions"),
        ({"cluster_resolver": {"worker": ["a:1"]}},
         "cluster_resolver must be an instance of ClusterResolver"),
        ({"cross_device_ops": "xring"}, "cross_device_ops must be a CrossDeviceOps"),
        ({"local_replicas": 0}, "local_replicas must be an integer >= 1"),
        ({"local_replicas": True}, "local_replicas must be an integer >= 1"),
        ({"gpus_per_rank": 1}, "GPU replica"),
        ({"gpus_per_rank": 1, "local_replicas": 2}, "exclude each other"),
        ({"gpus_per_rank": -1}, "gpus_per_rank must be an integer >= 1"),
        ({"communication": "nccl"}, "communication=NCCL needs GPU replicas"),
        ({"communication": TFConfigClusterResolver(env={})}, "pass it by keyword"),
    ]
    for kwargs, match in cases:
        error = match if isinstance(match, type) else (ValueError, BackendUnavailable)
        with pytest.raises(error) as info:
            ms.MultiWorkerMirroredStrategy(comm=world, **kwargs)
        if isinstance(match, str):
            assert match in str(info.value)
    if world.size > 1:  # one rank's mistake
        bad = {"local_replicas": 0} if world.rank == 0 else {}
        with pytest.raises(ValueError):
            ms.MultiWorkerMirroredStrategy(comm=world, **bad)
    still_in_step(world)


def test_different_local_replicas_on_different_ranks_raise_everywhere(world):
    if world.size == 1:
        pytest.skip("needs two ranks")
    with pytest.raises(ms.CollectiveMismatchError,
                       match="the same number and kind of local replicas"):
        ms.MultiWorkerMirroredStrategy(comm=world, local_replicas=1 + world.rank % 2)
    still_in_step(world)


def test_gpu_replicas_asked_for_on_one_rank_raise_everywhere(world):
    """Rank 0 asks for GPU replicas, the others for CPU replicas: every rank raises (on a
    host without GPUs rank 0's own error, on a GPU host the mismatch), none waits."""
    if world.size == 1:
        pytest.skip("needs two ranks")
    kwargs = {"gpus_per_rank": 1} if world.rank == 0 else {}
    with pytest.raises((ms.CollectiveMismatchError, BackendUnavailable, ValueError)):
        ms.MultiWorkerMirroredStrategy(comm=world, **kwargs)
    still_in_step(world)


def test_cross_device_ops(comm, monkeypatch):
    op = MultiWorkerAllReduce(all_reduce_spec="xring", num_packs=1, comm=comm)
    s = ms.MultiWorkerMirroredStrategy(cross_device_ops=op, comm=comm, local_replicas=2)
    assert s.extended.cross_device_ops is op
    seen = spy_algorithms(monkeypatch)
    value = PerReplica([np.full(3, float(comm.rank)), np.ones(3)])
    assert s.reduce("sum", value).tolist() == [comm.size * (comm.size - 1) / 2 + comm.size] * 3
    assert seen == ["xring"] or comm.size == 1
    if comm.size > 1:  # an op over another communicator: every rank raises
        self_op = MultiWorkerAllReduce(comm=MPI.COMM_SELF)
        with pytest.raises(ms.TopologyError, match="not the strategy's"):
            ms.MultiWorkerMirroredStrategy(cross_device_ops=self_op, comm=comm)
        mixed = self_op if comm.rank == 0 else None  # ... even when only one rank errs
        with pytest.raises(ValueError):
            ms.MultiWorkerMirroredStrategy(cross_device_ops=mixed, comm=comm)
    still_in_step(comm)


def tf_config(cluster, task_type, index) -> dict[str, str]:
    return {"TF_CONFIG": json.dumps({"cluster": cluster,
                                     "task": {"type": task_type, "index": index}})}


def test_tf_config_cluster_resolver(world):
    hosts = [f"host{i}:2222" for i in range(world.size)]
    plain = TFConfigClusterResolver(env=tf_config({"worker": hosts}, "worker", world.rank))
    s = ms.MultiWorkerMirroredStrategy(cluster_resolver=plain, comm=world, local_replicas=2)
    assert s.cluster_resolver is plain
    assert (s.extended.num_workers, s.extended.worker_index) == (world.size, world.rank)
    assert s.extended.should_checkpoint is (world.rank == 0)
    ids = s.run(lambda: ms.get_replica_context().replica_id_in_sync_group)
    assert list(ids.values) == [2 * world.rank, 2 * world.rank + 1]
    # with a chief: the chief is rank 0, worker i is rank i + 1
    cluster = {"chief": hosts[:1], "worker": hosts[1:]} if world.size > 1 else {"chief": hosts}
    task = ("chief", 0) if world.rank == 0 else ("worker", world.rank - 1)
    chief = TFConfigClusterResolver(env=tf_config(cluster, *task))
    s = ms.MultiWorkerMirroredStrategy(cluster_resolver=chief, comm=world)
    assert s.extended.worker_index == world.rank
    assert s.extended.should_checkpoint is (world.rank == 0)
    assert s.reduce("sum", 1.0) == world.size


def test_inconsistent_tf_config_raises_on_every_rank(world):
    hosts = [f"host{i}:2222" for i in range(world.size + 1)]  # one worker too many
    wrong = TFConfigClusterResolver(env=tf_config({"worker": hosts}, "worker", world.rank))
    with pytest.raises(ValueError, match="TF_CONFIG|failed on rank"):
        ms.MultiWorkerMirroredStrategy(cluster_resolver=wrong, comm=world)
    if world.size > 1:  # only the last rank's TF_CONFIG is wrong (an index out of place)
        index = 0 if world.rank == world.size - 1 else world.rank
        one = TFConfigClusterResolver(env=tf_config({"worker": hosts[:-1]}, "worker", index))
        with pytest.raises(ValueError):
            ms.MultiWorkerMirroredStrategy(cluster_resolver=one, comm=world)
    still_in_step(world)
