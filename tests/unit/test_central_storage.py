"""CentralStorageStrategy: one copy of each variable on the parameter device, compute on
two CPU replicas of one process, replica-context updates merged and applied once."""

from __future__ import annotations

import numpy as np
import pytest

import mpistrat as ms
from mpistrat import BackendUnavailable, PerReplica, VariableAggregation
from mpistrat.strategy import AggregatingVariable, CentralStorageStrategy, MirroredVariable

MPI = pytest.importorskip("mpi4py.MPI")


@pytest.fixture
def two():
    return ms.CentralStorageStrategy(compute_devices=["/cpu:0", "/cpu:1"])


@pytest.fixture(autouse=True)
def no_strategy_left_behind():
    yield
    ms.experimental_set_strategy(None)
    assert not ms.has_strategy()


def _variable(strategy, value, aggregation=VariableAggregation.NONE, dtype=None):
    with strategy.scope():
        return ms.Variable(value, aggregation=aggregation, dtype=dtype)


def _replica_id():
    return ms.get_replica_context().replica_id_in_sync_group


# --- construction -----------------------------------------------------------------------------


def test_facts(two):
    assert ms.CentralStorageStrategy is CentralStorageStrategy
    assert ms.experimental.CentralStorageStrategy is CentralStorageStrategy  # TF's spelling
    assert two.num_replicas_in_sync == 2
    ext = two.extended
    assert ext.worker_devices == ("/cpu:0", "/cpu:1")
    assert ext.parameter_devices == ("/cpu:0",)
    assert (ext.num_workers, ext.worker_index, ext.should_checkpoint) == (1, 0, True)
    assert isinstance(ext.cross_device_ops, ms.ReductionToOneDevice)
    assert ext.cross_device_ops.reduce_to_device == "/cpu:0"
    assert MPI.Comm.Compare(two.comm, MPI.COMM_SELF) == MPI.IDENT


def test_default_devices():
    one = ms.CentralStorageStrategy()
    assert one.extended.worker_devices == ("/cpu:0",)
    assert one.extended.parameter_devices == ("/cpu:0",)
    assert one.num_replicas_in_sync == 1
    # TF's rule: the only compute device holds the variables, else the local CPU
    assert ms.CentralStorageStrategy(["/cpu:1"]).extended.parameter_devices == ("/cpu:1",)
    spelled = ms.CentralStorageStrategy(["/device:CPU:0", "CPU:1"], parameter_device="CPU:1")
    assert spelled.extended.worker_devices == ("/cpu:0", "/cpu:1")
    assert spelled.extended.parameter_devices == ("/cpu:1",)
    assert spelled.extended.cross_device_ops.reduce_to_device == "/cpu:1"


def test_constructor_errors():
    with pytest.raises(ValueError, match="at least one compute device"):
        ms.CentralStorageStrategy(compute_devices=[])
    with pytest.raises(ValueError, match="repeat"):
        ms.CentralStorageStrategy(["/cpu:0", "/device:CPU:0"])
    with pytest.raises(ValueError, match="not a device name"):
        ms.CentralStorageStrategy(["/tpu:0"])
    with pytest.raises(ValueError, match="not a device name"):
        ms.CentralStorageStrategy(parameter_device="somewhere")
    with pytest.raises(TypeError, match="list of device names"):
        ms.CentralStorageStrategy("/cpu:0")
    with pytest.raises(TypeError, match="must be a str"):
        ms.CentralStorageStrategy(parameter_device=0)
    with pytest.raises(ValueError, match="task 1"):
        ms.CentralStorageStrategy(parameter_device="/job:worker/task:1/device:CPU:0")
    with pytest.raises(BackendUnavailable, match="GPU"):
        ms.CentralStorageStrategy(["/gpu:0", "/gpu:1"])
    with pytest.raises(BackendUnavailable, match="GPU"):
        ms.CentralStorageStrategy(parameter_device="/gpu:0")


# --- one copy ---------------------------------------------------------------------------------


def test_variable_is_one_copy_read_by_every_replica(two):
    v = _variable(two, [1.0, 2.0])
    assert isinstance(v, AggregatingVariable) and not isinstance(v, MirroredVariable)
    assert v.device == "/cpu:0" and v.distribute_strategy is two
    assert two.experimental_local_results(v) == (v,)
    assert two.extended.value_container(v) is v

    def read():
        return _replica_id(), np.asarray(v)

    ids, views = two.run(read)
    assert ids.values == (0, 1)
    views = views.values
    # both replicas read the very same array: the variable's one copy
    assert np.shares_memory(views[0], views[1])
    assert np.shares_memory(views[0], v._value)
    v.assign([5.0, 6.0])  # cross-replica: applied directly, seen by every replica
    np.testing.assert_array_equal(two.run(lambda: np.asarray(v)).values[1], [5.0, 6.0])


def test_training_step_merges_two_replicas_and_applies_once(two):
    """loss_r = 0.5 * |w - x_r|^2, so the gradient of replica r is w - x_r."""
    w = _variable(two, [1.0, 2.0], VariableAggregation.MEAN)
    data = two.experimental_distribute_values_from_function(
        lambda ctx: np.array([[0.0, 1.0], [1.0, 0.0]])[ctx.replica_id_in_sync_group])

    def step(x):
        grad = np.asarray(w) - x  # read before the (merged) update
        w.assign_sub(0.1 * grad)
        return grad, np.asarray(w).copy()

    grads, after = two.run(step, args=(data,))
    np.testing.assert_array_equal(grads.values[0], [1.0, 1.0])
    np.testing.assert_array_equal(grads.values[1], [0.0, 2.0])
    # one update of the mean gradient [0.5, 1.5]; applied twice it would be [0.9, 1.7]
    np.testing.assert_allclose(w.numpy(), [0.95, 1.85])
    # every replica resumes after the one update and sees it
    np.testing.assert_allclose(after.values[0], [0.95, 1.85])
    np.testing.assert_allclose(after.values[1], [0.95, 1.85])


def test_optimizer_path_reduce_to_the_variable_then_update(two):
    w = _variable(two, [1.0, 2.0])
    grads = two.run(lambda: np.full(2, float(_replica_id() + 1)))
    mean = two.extended.reduce_to("MEAN", grads, w)  # destinations: the variable's device
    np.testing.assert_array_equal(mean, [1.5, 1.5])
    calls = []

    def apply(var, g):
        calls.append(var)
        var.assign_sub(g)

    two.extended.update(w, apply, args=(mean,))
    assert calls == [w]  # once, on the one copy
    np.testing.assert_array_equal(w.numpy(), [-0.5, 0.5])


# --- aggregation ------------------------------------------------------------------------------


def test_aggregation_none_in_replica_context_is_an_error(two):
    v = _variable(two, 0.0)
    with pytest.raises(ValueError, match="You must specify an aggregation method"):
        two.run(lambda: v.assign_add(1.0))
    assert float(v) == 0.0
    one = ms.CentralStorageStrategy()  # one replica: nothing to merge, applied directly
    u = _variable(one, 0.0)
    one.run(lambda: u.assign_add(2.0))
    assert float(u) == 2.0


def test_sum_mean_and_only_first_replica(two):
    total = _variable(two, 10.0, VariableAggregation.SUM)
    two.run(lambda: total.assign_add(float(_replica_id() + 1)))
    assert float(total) == 13.0  # 10 + (1 + 2), once
    mean = _variable(two, 0.0, VariableAggregation.MEAN)
    two.run(lambda: mean.assign([2.0, 4.0][_replica_id()]))
    assert float(mean) == 3.0
    first = _variable(two, [0, 0], VariableAggregation.ONLY_FIRST_REPLICA, dtype=np.int32)
    two.run(lambda: first.assign([[7, 8], [70, 80]][_replica_id()]))
    np.testing.assert_array_equal(first.numpy(), [7, 8])
    assert first.dtype == np.int32
    first.assign_sub([1, 1])  # cross-replica: directly
    np.testing.assert_array_equal(first.numpy(), [6, 7])


def test_update_errors(two):
    ints = _variable(two, [1, 2], VariableAggregation.MEAN, dtype=np.int64)
    with pytest.raises(ValueError, match="non-float"):
        two.run(lambda: ints.assign([3, 4]))
    v = _variable(two, 0.0, VariableAggregation.SUM)
    with pytest.raises(ValueError, match="PerReplica"):
        v.assign(PerReplica([np.float64(1.0), np.float64(2.0)]))
    with pytest.raises(ValueError, match="Invalid variable aggregation"):
        _variable(two, 0.0, "bogus")


# --- reductions -------------------------------------------------------------------------------


def test_reduce_per_replica(two):
    value = PerReplica([np.array([1.0, 2.0]), np.array([3.0, 6.0])])
    np.testing.assert_array_equal(two.reduce("SUM", value, axis=None), [4.0, 8.0])
    np.testing.assert_array_equal(two.reduce("MEAN", value, axis=None), [2.0, 4.0])
    assert two.reduce("SUM", value, axis=0) == 12.0
    assert two.reduce("MEAN", value, axis=0) == 3.0
    per_replica = two.run(lambda: np.float64(_replica_id() + 1))
    assert two.reduce(ms.ReduceOp.SUM, per_replica, axis=None) == 3.0
    # onto the parameter device: one array
    onto = ms.CentralStorageStrategy(["/cpu:0", "/cpu:1"], parameter_device="/cpu:1")
    reduced = onto.extended.reduce_to("SUM", value, "/cpu:1")
    np.testing.assert_array_equal(reduced, [4.0, 8.0])
    a, b = onto.extended.batch_reduce_to("MEAN", [(value, "/cpu:1"), (value, value)])
    np.testing.assert_array_equal(a, [2.0, 4.0])
    assert isinstance(b, ms.Mirrored) and len(b.values) == 2
    np.testing.assert_array_equal(b.values[1], [2.0, 4.0])
    w = _variable(onto, [0.0, 0.0])
    (c,) = onto.extended.batch_reduce_to("SUM", [(value, w)])
    np.testing.assert_array_equal(c, [4.0, 8.0])
    with pytest.raises(RuntimeError, match="cross-replica context"):
        two.run(lambda: two.reduce("SUM", 1.0, axis=None))


# --- scope rules ------------------------------------------------------------------------------


def test_scope_rules(two):
    mirrored = ms.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with two.scope():
        assert ms.get_strategy() is two and ms.in_cross_replica_context()
        with pytest.raises(RuntimeError, match="Mixing different"):
            with mirrored.scope():
                pass
        with pytest.raises(RuntimeError, match="Mixing different"):
            mirrored.run(lambda: None)
        with two.scope():  # the same strategy nests
            pass
    with mirrored.scope():
        with pytest.raises(RuntimeError, match="Mixing different"):
            two.run(lambda: None)
    with pytest.raises(RuntimeError, match="created in its scope"):
        two.run(lambda: ms.Variable(1.0))
    with pytest.raises(RuntimeError, match="cross-replica context"):
        two.run(lambda: two.scope().__enter__())
    outside = ms.Variable(1.0)  # outside any scope: a plain variable
    assert type(outside) is ms.Variable
    ms.experimental_set_strategy(two)
    assert isinstance(ms.Variable(1.0), AggregatingVariable)
