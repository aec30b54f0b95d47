"""TensorFlow's behaviours that mpistrat reproduces, in both forms TF users meet: one
process with K local replicas (``-n 1``, G = K) and K ranks of one replica each
(``-n K``, G = 1); under ``bin/mpitest`` every G below runs at every rank count.

Each test names the TF behaviour it pins down; the deliberate differences are listed in
docs/strategies.md and docs/cross_device_ops.md.
"""

from __future__ import annotations

import numpy as np
import pytest

import mpistrat as ms
from mpistrat import CollectiveMismatchError, Mirrored, PerReplica
from mpistrat.values import default_devices

MPI = pytest.importorskip("mpi4py.MPI")

GS = [1, 2, 3, 4]


def strategy_for(world, g):
    return ms.MultiWorkerMirroredStrategy(comm=world, local_replicas=g)


def per_replica(world, g, make):
    """Component ``i``: ``make(global id of local replica i)``."""
    return PerReplica([make(world.rank * g + i) for i in range(g)], default_devices(g))


@pytest.mark.parametrize("g", GS)
@pytest.mark.parametrize("axis", [None, 0])
def test_reduce_keeps_the_structure_of_a_nest(world, g, axis):
    """TF reduces a dict/list/tuple of per-replica values leaf by leaf and keeps the nest
    (axis=None; with an axis TF 2.21 raises a TypeError, and mpistrat reduces leaf by leaf
    along it: a difference listed in docs/strategies.md)."""
    s = strategy_for(world, g)
    n = world.size * g
    a = per_replica(world, g, lambda j: np.full(2, j, dtype=np.float64))
    b = per_replica(world, g, lambda j: np.array([1.0, 2.0]))
    out = s.reduce("SUM", {"a": a, "pair": (b, [a])}, axis=axis)
    assert set(out) == {"a", "pair"} and isinstance(out["pair"], tuple)
    assert isinstance(out["pair"][1], list)
    ids = n * (n - 1) / 2
    want_a = np.full(2, ids) if axis is None else np.asarray(2 * ids)
    want_b = np.array([n, 2.0 * n]) if axis is None else np.asarray(3.0 * n)
    np.testing.assert_array_equal(out["a"], want_a)
    np.testing.assert_array_equal(out["pair"][0], want_b)
    np.testing.assert_array_equal(out["pair"][1][0], want_a)


@pytest.mark.parametrize("g", GS)
@pytest.mark.parametrize("axis", [None, 0])
def test_sum_keeps_integer_dtypes(world, g, axis):
    """TF's SUM of int32 values is int32 (NumPy's sum alone would widen it to int64)."""
    s = strategy_for(world, g)
    value = per_replica(world, g, lambda j: np.array([j, 1], dtype=np.int32))
    out = s.reduce(ms.ReduceOp.SUM, value, axis=axis)
    assert out.dtype == np.int32
    n = world.size * g
    want = np.array([n * (n - 1) // 2, n]) if axis is None else n * (n - 1) // 2 + n
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("g", GS)
def test_sum_of_a_mirrored_value_is_refused_and_mean_returns_it(world, g):
    """TF refuses SUM of a Mirrored value (its copies are one value); MEAN gives it back."""
    s = strategy_for(world, g)
    mirrored = Mirrored([np.full(3, 7.0) for _ in range(g)], default_devices(g))
    np.testing.assert_array_equal(s.reduce("MEAN", mirrored), np.full(3, 7.0))
    if s.num_replicas_in_sync == 1:
        np.testing.assert_array_equal(s.reduce("SUM", mirrored), np.full(3, 7.0))
        return
    with pytest.raises(ValueError, match="Mirrored value"):
        s.reduce("SUM", mirrored)


@pytest.mark.parametrize("g", GS)
def test_all_gather_gives_each_replica_its_own_result(world, g):
    """TF's all_gather result is a tensor per device, so run() returns a PerReplica."""
    s = strategy_for(world, g)

    def fn():
        ctx = ms.get_replica_context()
        return ctx.all_gather(np.array([ctx.replica_id_in_sync_group]), axis=0)

    out = s.run(fn)
    want = np.arange(world.size * g)
    if g == 1:
        np.testing.assert_array_equal(out, want)
        return
    assert isinstance(out, PerReplica) and len(out.values) == g
    for part in out.values:
        np.testing.assert_array_equal(part, want)
    assert len({id(part) for part in out.values}) == g


@pytest.mark.parametrize("g", GS)
def test_variables_report_the_resolved_synchronization(world, g):
    """TF resolves AUTO to ON_WRITE for mirrored variables; sync-on-read report ON_READ."""
    s = strategy_for(world, g)
    with s.scope():
        auto = ms.Variable(1.0)
        on_read = ms.Variable(1.0, synchronization="ON_READ", aggregation="SUM")
    assert auto.synchronization is ms.VariableSynchronization.ON_WRITE
    assert on_read.synchronization is ms.VariableSynchronization.ON_READ


@pytest.mark.parametrize("g", GS)
@pytest.mark.parametrize("synchronization", ["ON_WRITE", "ON_READ"])
def test_integer_variables_with_mean_are_refused_at_creation(world, g, synchronization):
    """TF refuses an integer variable with aggregation MEAN when it is created, on every
    rank (here even when only one rank's initial value is an integer)."""
    s = strategy_for(world, g)
    dtype = np.int32 if world.rank == world.size - 1 else np.float32
    with s.scope():
        with pytest.raises((ValueError, CollectiveMismatchError)) as info:
            ms.Variable(np.zeros(2, dtype=dtype), synchronization=synchronization,
                        aggregation="MEAN")
    if world.rank == world.size - 1:
        assert isinstance(info.value, ValueError) and "needs a float variable" in str(info.value)


@pytest.mark.parametrize("g", GS)
def test_first_replica_updates_ignore_variables_made_outside_the_strategy(world, g):
    """A rank that made more plain variables beforehand (so its default names count
    further) still agrees on an ONLY_FIRST_REPLICA update: agreement keys come from the
    strategy's own creation order."""
    for _ in range(world.rank):
        ms.Variable(0.0)  # rank-local, outside any strategy
    s = strategy_for(world, g)
    with s.scope():
        step = ms.Variable(0, aggregation="ONLY_FIRST_REPLICA")

    def fn():
        ctx = ms.get_replica_context()
        step.assign(10 + ctx.replica_id_in_sync_group)

    s.run(fn)
    assert [int(c) for c in step.values] == [10] * g


OPS = {
    "ReductionToOneDevice": lambda world: ms.ReductionToOneDevice(comm=world),
    "MultiWorkerAllReduce": lambda world: ms.MultiWorkerAllReduce(comm=world),
}


@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("g", GS)
def test_one_destination_device_gives_the_array_itself(world, name, g):
    """TF returns the tensor, not a one-component Mirrored, for a single destination
    device: reduce, batch_reduce and broadcast alike; several devices give a Mirrored."""
    ops = OPS[name](world)
    n = world.size * g
    value = per_replica(world, g, lambda j: np.full(3, float(j)))
    one = ops.reduce("sum", value, "/cpu:0")
    assert isinstance(one, np.ndarray)
    np.testing.assert_array_equal(one, np.full(3, n * (n - 1) / 2))
    batch = ops.batch_reduce("mean", [(value, "/cpu:0"), (value, value)])
    assert isinstance(batch[0], np.ndarray)
    assert isinstance(batch[1], Mirrored if g > 1 else np.ndarray)
    cast = ops.broadcast(np.float32(world.rank + 5), "/cpu:0")
    assert isinstance(cast, np.ndarray) and cast == 5
    many = ops.broadcast(np.float32(world.rank + 5), ["/cpu:0", "/cpu:1"])
    assert isinstance(many, Mirrored) and [float(v) for v in many.values] == [5.0, 5.0]


@pytest.mark.parametrize("g", GS)
def test_lists_of_numbers_and_generators_of_pairs_are_accepted(world, g):
    """TF 2.21 converts a Python list given to reduce into one tensor, and takes a
    generator of (value, destinations) pairs."""
    ops = ms.MultiWorkerAllReduce(comm=world)
    summed = ops.reduce("sum", [1.0, 2.0], "/cpu:0")  # one value per rank
    np.testing.assert_array_equal(summed, [world.size, 2.0 * world.size])
    value = per_replica(world, g, lambda j: np.ones(2))
    out = ops.batch_reduce("sum", ((value, value) for _ in range(3)))
    assert len(out) == 3
    n = world.size * g
    for result in out:
        for part in (result.values if isinstance(result, Mirrored) else (result,)):
            np.testing.assert_array_equal(part, np.full(2, float(n)))


@pytest.mark.parametrize("g", GS)
def test_distribute_values_from_function(world, g):
    """value_fn(ValueContext) once per local replica, with the global replica id; the
    result is a PerReplica even with one replica (TF's always_wrap), nests kept."""
    s = strategy_for(world, g)
    seen = []

    def value_fn(ctx):
        seen.append((ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync))
        return {"x": np.full(2, float(ctx.replica_id_in_sync_group))}

    out = s.experimental_distribute_values_from_function(value_fn)
    n = world.size * g
    assert seen == [(world.rank * g + i, n) for i in range(g)]
    assert isinstance(out["x"], PerReplica) and len(out["x"].values) == g
    total = s.reduce("sum", s.run(lambda v: v["x"] * 2, args=(out,)))
    np.testing.assert_array_equal(total, np.full(2, float(n * (n - 1))))
    with pytest.raises(TypeError, match="callable"):
        s.experimental_distribute_values_from_function(5)
