"""Single-process strategies: MirroredStrategy over two CPU replicas, OneDeviceStrategy,
the default strategy, and the replica threads' lock-step (one process, COMM_SELF)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import mpistrat as ms
from mpistrat import (
    AutoShardPolicy,
    BackendUnavailable,
    Dataset,
    InputOptions,
    InputReplicationMode,
    PerReplica,
    ReductionToOneDevice,
)
from mpistrat.strategy import MirroredVariable, SyncOnReadVariable

MPI = pytest.importorskip("mpi4py.MPI")


@pytest.fixture
def two():
    return ms.MirroredStrategy(devices=["/cpu:0", "/cpu:1"])


@pytest.fixture(autouse=True)
def no_strategy_left_behind():
    yield
    ms.experimental_set_strategy(None)
    assert not ms.has_strategy()


# --- MirroredStrategy ------------------------------------------------------------------------


def test_mirrored_strategy_facts(two):
    assert two.num_replicas_in_sync == 2
    ext = two.extended
    assert ext.worker_devices == ("/cpu:0", "/cpu:1")
    assert (ext.num_workers, ext.worker_index, ext.should_checkpoint) == (1, 0, True)
    assert isinstance(ext.cross_device_ops, ReductionToOneDevice)
    assert MPI.Comm.Compare(two.comm, MPI.COMM_SELF) == MPI.IDENT
    assert ms.MirroredStrategy().extended.worker_devices == ("/cpu:0",)
    spelled = ms.MirroredStrategy(["/device:CPU:0", "CPU:1"])
    assert spelled.extended.worker_devices == ("/cpu:0", "/cpu:1")


def test_mirrored_strategy_errors():
    with pytest.raises(ValueError, match="at least one device"):
        ms.MirroredStrategy(devices=[])
    with pytest.raises(ValueError, match="repeat"):
        ms.MirroredStrategy(devices=["/cpu:0", "/device:CPU:0"])
    with pytest.raises(ValueError, match="not a device name"):
        ms.MirroredStrategy(devices=["/tpu:0"])
    with pytest.raises(BackendUnavailable, match="GPU"):
        ms.MirroredStrategy(devices=["/gpu:0", "/gpu:1"])
    with pytest.raises(ValueError, match="cross_device_ops must be a CrossDeviceOps"):
        ms.MirroredStrategy(cross_device_ops="nccl")


def test_mirrored_run_reduce_and_replica_context(two):
    def fn(x):
        ctx = ms.get_replica_context()
        j = ctx.replica_id_in_sync_group
        summed = ctx.all_reduce("sum", {"x": x.sum(), "j": np.float64(j)})
        return j, summed

    ids, summed = two.run(fn, args=(PerReplica([np.arange(4.0), np.arange(4.0, 6.0)]),))
    assert list(ids.values) == [0, 1]
    assert [float(v) for v in summed["j"].values] == [1.0, 1.0]
    assert [float(v) for v in summed["x"].values] == [15.0, 15.0]
    value = PerReplica([np.arange(4.0), np.arange(4.0, 6.0)])
    assert two.reduce("mean", value, axis=0) == 2.5  # TF's partial-batch example
    assert two.reduce("sum", value, axis=0) == 15.0
    assert two.reduce("sum", PerReplica([np.ones(2), np.ones(2)])).tolist() == [2.0, 2.0]
    assert two.reduce("sum", 3.0) == 3.0  # one process: one contribution
    assert two.gather(value, axis=0).tolist() == list(range(6))
    assert two.experimental_local_results(value) == value.values


def test_mirrored_variables(two):
    with two.scope():
        mean = ms.Variable(np.zeros(2), aggregation="mean")
        count = ms.Variable(0, aggregation="only_first_replica")
        local = ms.Variable(0.0, synchronization="on_read", aggregation="sum")
    assert isinstance(mean, MirroredVariable) and isinstance(local, SyncOnReadVariable)

    def step():
        j = ms.get_replica_context().replica_id_in_sync_group
        mean.assign_add(np.full(2, 2.0 * j))
        count.assign_add(1)
        local.assign_add(j + 1.0)

    two.run(step)
    assert mean.numpy().tolist() == [1.0, 1.0] and count.numpy() == 1
    assert [float(c) for c in local.values] == [1.0, 2.0] and local.numpy() == 3.0
    for var in (mean, count):
        assert all(np.array_equal(c, var.values[0]) for c in var.values)


def test_mirrored_input(two):
    dist = two.experimental_distribute_dataset(Dataset.range(14).batch(7))
    steps = [[part.tolist() for part in batch.values] for batch in dist]
    assert steps == [[[0, 1, 2, 3], [4, 5, 6]], [[7, 8, 9, 10], [11, 12, 13]]]
    contexts = []

    def dataset_fn(ctx):
        contexts.append((ctx.num_input_pipelines, ctx.input_pipeline_id,
                         ctx.num_replicas_in_sync, ctx.get_per_replica_batch_size(4)))
        return Dataset.range(8).batch(ctx.get_per_replica_batch_size(4))

    steps = [[part.tolist() for part in b.values]
             for b in two.distribute_datasets_from_function(dataset_fn)]
    assert contexts == [(1, 0, 2, 2)]
    assert steps == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    contexts.clear()
    per_replica = InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA)
    steps = [[part.tolist() for part in b.values]
             for b in two.distribute_datasets_from_function(dataset_fn, per_replica)]
    assert contexts == [(2, 0, 2, 2), (2, 1, 2, 2)]
    assert steps == [[[0, 1], [0, 1]], [[2, 3], [2, 3]], [[4, 5], [4, 5]], [[6, 7], [6, 7]]]
    numpy_dataset = two.experimental_make_numpy_dataset(np.arange(3))
    assert [int(e) for e in numpy_dataset] == [0, 1, 2]


# --- OneDeviceStrategy ---------------------------------------------------------------------


def test_one_device_strategy():
    s = ms.OneDeviceStrategy("/cpu:0")
    assert s.num_replicas_in_sync == 1 and s.extended.worker_devices == ("/cpu:0",)
    out = s.run(lambda x: (ms.get_replica_context().replica_id_in_sync_group, x * 2),
                args=(np.arange(3),))
    assert out[0] == 0 and out[1].tolist() == [0, 2, 4]  # one replica: unwrapped
    assert s.reduce("sum", np.arange(3.0), axis=0) == 3.0
    assert s.reduce("mean", np.arange(3.0)).tolist() == [0.0, 1.0, 2.0]
    with s.scope():
        v = ms.Variable(1.0, aggregation="sum")
    s.run(lambda: v.assign_add(2.0))
    assert isinstance(v, MirroredVariable) and v.numpy() == 3.0 and len(v.values) == 1
    batches = [b.tolist() for b in s.experimental_distribute_dataset(Dataset.range(5).batch(2))]
    assert batches == [[0, 1], [2, 3], [4]]  # one replica: batches pass unchanged
    with pytest.raises(TypeError, match="takes one device name"):
        ms.OneDeviceStrategy(["/cpu:0"])
    with pytest.raises(BackendUnavailable):
        ms.OneDeviceStrategy("/gpu:0")


# --- the default strategy ---------------------------------------------------------------------


def test_default_strategy():
    default = ms.get_strategy()
    assert not ms.has_strategy() and default.num_replicas_in_sync == 1
    assert default.run(lambda: ms.get_replica_context().replica_id_in_sync_group) == 0
    assert default.reduce("sum", np.arange(3.0)).tolist() == [0.0, 1.0, 2.0]
    assert default.reduce("mean", np.arange(4.0), axis=0) == 1.5
    ctx = ms.get_replica_context()
    assert ctx.all_reduce("sum", {"a": np.ones(2)})["a"].tolist() == [1.0, 1.0]
    assert ctx.merge_call(lambda strategy, x: (strategy is default, x), args=(5,)) == (True, 5)
    reduced = default.extended.reduce_to("sum", 2.0, "/cpu:0")
    assert isinstance(reduced, np.ndarray) and reduced == 2.0  # one device: the value
    with default.scope():
        v = ms.Variable(np.zeros(2))
    assert type(v) is ms.Variable  # the default strategy makes plain variables
    assert default is ms.get_strategy()


def test_experimental_set_strategy_with_mirrored(two):
    ms.experimental_set_strategy(two)
    assert ms.get_strategy() is two and ms.in_cross_replica_context()
    v = ms.Variable(1.0, aggregation="mean")  # created "in" the strategy
    assert isinstance(v, MirroredVariable)
    ms.experimental_set_strategy(None)
    assert not ms.has_strategy()
    with pytest.raises(TypeError):
        ms.experimental_set_strategy(object())


# --- replica threads ------------------------------------------------------------------------


def test_replicas_run_in_lock_step_one_at_a_time():
    s = ms.MirroredStrategy([f"/cpu:{i}" for i in range(3)])
    running = []
    overlaps = []
    lock = threading.Lock()

    def fn():
        ctx = ms.get_replica_context()
        for round_ in range(3):
            with lock:
                running.append(ctx.replica_id_in_sync_group)
                if len(running) > 1:
                    overlaps.append(list(running))
            threading.Event().wait(0.002)  # give another replica the chance to overlap
            with lock:
                running.remove(ctx.replica_id_in_sync_group)
            ctx.merge_call(lambda strategy: round_)
        return threading.current_thread() is not threading.main_thread()

    out = s.run(fn)
    assert not overlaps
    assert out is True  # every replica ran in a thread of its own (G > 1)


def test_failures_leave_no_thread_behind(two):
    before = threading.active_count()

    def unequal():
        ctx = ms.get_replica_context()
        for _ in range(ctx.replica_id_in_sync_group + 1):
            ctx.merge_call(lambda strategy: None)

    with pytest.raises(RuntimeError, match="different number of replica_context"):
        two.run(unequal)

    def one_fails():
        ctx = ms.get_replica_context()
        if ctx.replica_id_in_sync_group == 0:
            raise ZeroDivisionError("replica 0")
        ctx.merge_call(lambda strategy: None)

    with pytest.raises(ZeroDivisionError, match="replica 0"):
        two.run(one_fails)

    def bad_merge(strategy):
        raise LookupError("merge")

    with pytest.raises(LookupError, match="merge"):
        two.run(lambda: ms.get_replica_context().merge_call(bad_merge))
    with pytest.raises(RuntimeError, match="different keyword arguments"):
        two.run(lambda: ms.get_replica_context().merge_call(
            lambda strategy, **kw: None,
            kwargs={f"k{ms.get_replica_context().replica_id_in_sync_group}": 1}))
    assert threading.active_count() == before
    assert two.run(lambda: 7) == 7  # still usable


# --- the environment at the edge ---------------------------------------------------------------


def test_local_replicas_from_the_environment(monkeypatch):
    monkeypatch.setenv("MPISTRAT_LOCAL_REPLICAS", "3")
    s = ms.MultiWorkerMirroredStrategy(comm=MPI.COMM_SELF)
    assert s.num_replicas_in_sync == 3
    assert ms.MultiWorkerMirroredStrategy(comm=MPI.COMM_SELF,
                                          local_replicas=1).num_replicas_in_sync == 1
    monkeypatch.setenv("MPISTRAT_LOCAL_REPLICAS", "two")
    with pytest.raises(ValueError, match="MPISTRAT_LOCAL_REPLICAS='two'"):
        ms.MultiWorkerMirroredStrategy(comm=MPI.COMM_SELF)
    monkeypatch.setenv("MPISTRAT_LOCAL_REPLICAS", "0")
    with pytest.raises(ValueError, match="at least 1"):
        ms.MultiWorkerMirroredStrategy(comm=MPI.COMM_SELF)


def test_distribute_policy_is_ignored_with_one_worker(two):
    options = ms.Options()
    options.experimental_distribute.auto_shard_policy = AutoShardPolicy.FILE
    dist = two.experimental_distribute_dataset(Dataset.range(4).batch(4).with_options(options))
    assert dist.auto_shard_policy is None
    assert [[p.tolist() for p in b.values] for b in dist] == [[[0, 1], [2, 3]]]


def test_the_launchers_strategy_gives_way_to_a_scripts_own_scope_and_a_set_one_does_not():
    from mpistrat.strategy.context import set_launcher_strategy

    launcher, own = ms.OneDeviceStrategy("/cpu:0"), ms.OneDeviceStrategy("/cpu:0")
    try:
        set_launcher_strategy(launcher)
        assert ms.get_strategy() is launcher
        with own.scope():  # what `mpistrat run` gives a TF script that builds its own
            assert ms.get_strategy() is own and ms.in_cross_replica_context()
            assert own.run(lambda: ms.get_replica_context().num_replicas_in_sync) == 1
        assert ms.get_strategy() is launcher
        ms.experimental_set_strategy(launcher)  # the user's own call: TF's rule holds
        with pytest.raises(RuntimeError, match="Mixing different"):
            with own.scope():
                pass
    finally:
        ms.experimental_set_strategy(None)
    assert not ms.has_strategy()
