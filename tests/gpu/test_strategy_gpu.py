"""The strategies with GPU replicas: ``MultiWorkerMirroredStrategy(gpus_per_rank=1)`` and
``MirroredStrategy(["/gpu:N"])`` end to end on CuPy arrays.

Each replica runs with its GPU current; distributed datasets, variables and the results
of ``ReplicaContext.all_reduce`` and ``strategy.reduce`` are CuPy arrays on the
replica's GPU, equal to what the same steps give on CPU replicas, and the same on every
rank. Runs on COMM_WORLD of whatever launch started pytest (``bin/gputest``: 1 process,
and 2 ranks sharing one GPU, where AUTO must fall back from NCCL to the ring).
"""

from __future__ import annotations

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.runtime._mpi import world

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")


def _ordinal(array) -> int:
    return int(array.device.id)


def _current() -> int:
    return int(cupy.cuda.Device().id)


@pytest.fixture(scope="module")
def strategy():
    return ms.MultiWorkerMirroredStrategy(gpus_per_rank=1)


def _rank_gpu(strategy) -> int:
    placement = strategy.extended.placement
    assert placement.gpu and len(placement.ordinals) == 1
    return placement.ordinals[0]


def test_devices_and_communication(strategy):
    comm = world()
    gpu = _rank_gpu(strategy)
    assert strategy.extended.worker_devices == (f"/gpu:{gpu}",)
    assert strategy.num_replicas_in_sync == comm.Get_size()
    from mpistrat.runtime.topology import get_topology

    shared = get_topology(comm).local_size > cupy.cuda.runtime.getDeviceCount()
    expected = ms.CommunicationImplementation.RING if shared \
        else ms.CommunicationImplementation.NCCL
    assert strategy.communication is expected
    spec = strategy.extended.cross_device_ops.spec
    assert (spec[0][0] == "nccl") == (expected is ms.CommunicationImplementation.NCCL)


def test_run_makes_arrays_on_the_replica_gpu(strategy):
    gpu = _rank_gpu(strategy)

    def fn():
        assert _current() == gpu
        return cupy.arange(4, dtype=cupy.float32)

    result = strategy.run(fn)
    assert isinstance(result, cupy.ndarray) and _ordinal(result) == gpu


def test_all_reduce_in_replica_context(strategy):
    comm, gpu = world(), _rank_gpu(strategy)
    size, rank = comm.Get_size(), comm.Get_rank()

    def step():
        ctx = ms.get_replica_context()
        grads = (cupy.full((3, 5), rank + 1, dtype=cupy.float32),
                 cupy.arange(7, dtype=cupy.float64) * (rank + 1))
        return ctx.all_reduce("sum", grads)

    first, second = strategy.run(step)
    total = size * (size + 1) / 2
    for result in (first, second):
        assert isinstance(result, cupy.ndarray) and _ordinal(result) == gpu
    assert np.array_equal(cupy.asnumpy(first), np.full((3, 5), total, np.float32))
    assert np.array_equal(cupy.asnumpy(second), np.arange(7) * total)


def test_reduce_device_and_host_values(strategy):
    comm, gpu = world(), _rank_gpu(strategy)
    size, rank = comm.Get_size(), comm.Get_rank()
    loss = strategy.run(lambda: cupy.asarray(np.float32(rank + 1)))
    total = strategy.reduce("sum", loss, axis=None)
    assert isinstance(total, cupy.ndarray) and _ordinal(total) == gpu
    assert float(total) == size * (size + 1) / 2
    # a host number reduces on the host (NCCL reads only device memory)
    assert float(strategy.reduce("sum", np.float32(rank + 1))) == size * (size + 1) / 2
    # MEAN along an axis counts examples on the device
    per = strategy.run(lambda: cupy.ones((rank + 2, 3), dtype=cupy.float32) * (rank + 1))
    mean = strategy.reduce("mean", per, axis=0)
    weights = [(r + 2) * (r + 1) for r in range(size)]
    expected = sum(weights) / sum(r + 2 for r in range(size))
    assert np.allclose(cupy.asnumpy(mean), np.full(3, expected))


def test_dataset_batches_land_on_the_replica_gpu(strategy):
    comm, gpu = world(), _rank_gpu(strategy)
    size = comm.Get_size()
    x = np.arange(8 * size * 2, dtype=np.float32).reshape(-1, 2)
    y = np.arange(len(x), dtype=np.int64)
    options = ms.Options()
    options.experimental_distribute.auto_shard_policy = ms.AutoShardPolicy.DATA
    dataset = ms.Dataset.from_tensor_slices((x, y)).batch(4 * size).with_options(options)
    host = ms.MultiWorkerMirroredStrategy()  # the same split on CPU replicas
    expected = [(np.asarray(a), np.asarray(b))
                for a, b in host.experimental_distribute_dataset(dataset)]
    seen = list(strategy.experimental_distribute_dataset(dataset))
    assert len(seen) == len(expected) > 0
    for (bx, by), (ex, ey) in zip(seen, expected):
        for array in (bx, by):
            assert isinstance(array, cupy.ndarray) and _ordinal(array) == gpu
        assert np.array_equal(cupy.asnumpy(bx), ex) and np.array_equal(cupy.asnumpy(by), ey)


def test_mirrored_variable_copies_live_on_the_gpu(strategy):
    comm, gpu = world(), _rank_gpu(strategy)
    size, rank = comm.Get_size(), comm.Get_rank()
    with strategy.scope():
        v = ms.Variable(np.zeros(4, np.float32), aggregation="mean")
        steps = ms.Variable(0, aggregation="only_first_replica")
    (copy,) = v.values
    assert isinstance(copy, cupy.ndarray) and _ordinal(copy) == gpu

    def step():
        v.assign_add(cupy.full(4, rank + 1, dtype=cupy.float32))  # MEAN across replicas
        steps.assign_add(1)
        value = v.read_value()
        assert isinstance(value, cupy.ndarray) and _ordinal(value) == gpu
        return value

    strategy.run(step)
    mean = (size + 1) / 2
    assert np.array_equal(v.numpy(), np.full(4, mean, np.float32))
    assert isinstance(v.numpy(), np.ndarray) and int(steps.numpy()) == 1
    v.assign(np.ones(4, np.float32))  # cross-replica: a host value onto every copy
    assert np.array_equal(cupy.asnumpy(v.values[0]), np.ones(4, np.float32))
    digest = v.numpy().tobytes()
    assert comm.allgather(digest) == [digest] * size


def test_sync_on_read_variable_aggregates_device_copies(strategy):
    comm = world()
    size, rank = comm.Get_size(), comm.Get_rank()
    with strategy.scope():
        metric = ms.Variable(0.0, synchronization="on_read", aggregation="sum")
    strategy.run(lambda: metric.assign_add(cupy.asarray(float(rank + 1))))
    assert float(metric.numpy()) == size * (size + 1) / 2


def test_mirrored_strategy_on_one_gpu():
    gpu = int(cupy.cuda.Device().id)
    strategy = ms.MirroredStrategy([f"/gpu:{gpu}"])
    assert strategy.extended.placement.gpu
    with strategy.scope():
        w = ms.Variable(np.ones(3, np.float32))
    out = strategy.run(lambda: w.read_value() * 2)
    assert isinstance(out, cupy.ndarray) and _ordinal(out) == gpu
    assert np.array_equal(cupy.asnumpy(out), np.full(3, 2, np.float32))
    total = strategy.reduce("sum", strategy.run(lambda: cupy.ones(2)), axis=None)
    assert np.array_equal(cupy.asnumpy(total), np.ones(2))
