"""How a strategy hands its replicas their devices, checked without a GPU.

A GPU strategy's placement (``strategy.extended.placement``) makes each replica's device
current while it runs and moves what the replica is given onto that device. Here a
recording placement stands in for ``GpuPlacement`` on CPU replicas (``gpu = True``, its
"devices" NumPy memory): every place the strategy must call it — ``run``,
``experimental_distribute_values_from_function``, distributed datasets, variable
creation, ``all_gather``, variable updates — is checked to call it for the right
replica, and reductions of host values to go through the host ops, as on GPUs.
tests/gpu/test_strategy_gpu.py runs the same paths on CuPy.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest

import mpistrat as ms
from mpistrat import PerReplica, ReductionToOneDevice
from mpistrat.backends.interop import to_host
from mpistrat.strategy.placement import Placement

GS = [1, 2]


class Recording(Placement):
    """A placement that records its calls and which device is current in each thread."""

    gpu = True

    def __init__(self, devices) -> None:
        super().__init__(devices)
        self.current = threading.local()
        self.puts: list[int] = []
        self.clones: list[int] = []

    def on(self, index: int):
        @contextlib.contextmanager
        def entered():
            before = getattr(self.current, "index", None)
            self.current.index = index
            try:
                yield
            finally:
                self.current.index = before

        return entered()

    def put(self, value, index: int):
        self.puts.append(index)
        return np.array(to_host(value), copy=True)

    def clone(self, array, index: int):
        self.clones.append(index)
        return np.array(to_host(array), copy=True)


def recording_strategy(comm, g: int) -> tuple[ms.MultiWorkerMirroredStrategy, Recording]:
    strategy = ms.MultiWorkerMirroredStrategy(comm=comm, local_replicas=g)
    placement = Recording(strategy.extended.worker_devices)
    strategy.extended._placement = placement
    return strategy, placement


@pytest.mark.parametrize("g", GS)
def test_each_replica_runs_with_its_device_current(comm, g):
    strategy, placement = recording_strategy(comm, g)
    seen = strategy.run(lambda: placement.current.index)
    assert list(strategy.experimental_local_results(seen)) == list(range(g))
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: placement.current.index)
    assert list(values.values) == list(range(g))
    assert getattr(placement.current, "index", None) is None  # (left again)


@pytest.mark.parametrize("g", GS)
def test_dataset_batches_are_put_on_their_replica(comm, g):
    strategy, placement = recording_strategy(comm, g)
    replicas = comm.size * g
    x = np.arange(4 * replicas * 3, dtype=np.float32).reshape(-1, 3)
    options = ms.Options()
    options.experimental_distribute.auto_shard_policy = ms.AutoShardPolicy.DATA
    dataset = ms.Dataset.from_tensor_slices((x, x[:, 0])).batch(2 * replicas) \
        .with_options(options)
    batches = list(strategy.experimental_distribute_dataset(dataset))
    assert len(batches) == 2
    # two leaves per step, each put once for every local replica, in replica order
    assert placement.puts == [i for _ in range(2 * 2) for i in range(g)]
    plain = ms.MultiWorkerMirroredStrategy(comm=comm, local_replicas=g)
    for ours, theirs in zip(batches, plain.experimental_distribute_dataset(dataset)):
        for a, b in zip(strategy.experimental_local_results(ours),
                        plain.experimental_local_results(theirs)):
            assert all(np.array_equal(u, v) for u, v in zip(a, b))


@pytest.mark.parametrize("g", GS)
def test_variables_get_one_copy_per_device_and_updates_move_there(comm, g):
    strategy, placement = recording_strategy(comm, g)
    with strategy.scope():
        v = ms.Variable(np.zeros(3, np.float32), aggregation="sum")
    assert placement.clones == list(range(g))
    assert len({id(c) for c in v.values}) == g

    def step():
        ctx = ms.get_replica_context()
        v.assign_add(np.full(3, ctx.replica_id_in_sync_group + 1, np.float32))

    placement.puts.clear()
    strategy.run(step)
    assert placement.puts == list(range(g))  # each replica's part onto its device
    replicas = comm.size * g
    for copy in v.values:
        assert np.array_equal(copy, np.full(3, replicas * (replicas + 1) / 2, np.float32))


@pytest.mark.parametrize("g", GS)
def test_all_gather_gives_each_replica_its_own_copy(comm, g):
    strategy, placement = recording_strategy(comm, g)
    gathered = strategy.run(lambda: ms.get_replica_context().all_gather(
        np.array([placement.current.index], np.int64), axis=0))
    parts = strategy.experimental_local_results(gathered)
    assert len({id(p) for p in parts}) == g
    assert placement.puts[-1:] == [0] and placement.clones == list(range(1, g))
    expected = np.tile(np.arange(g), comm.size)
    assert all(np.array_equal(p, expected) for p in parts)


@pytest.mark.parametrize("g", GS)
def test_host_values_reduce_through_the_host_ops(comm, g):
    strategy, _ = recording_strategy(comm, g)
    value = PerReplica([np.float32(1 + i) for i in range(g)], strategy.extended.worker_devices)
    assert isinstance(strategy.extended._ops_for([value]), ReductionToOneDevice)
    total = strategy.reduce("sum", value, axis=None)
    assert float(total) == comm.size * g * (g + 1) / 2
