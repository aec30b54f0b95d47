"""Distributed variables across real MPI ranks with G in {1, 2} CPU replicas per rank:
creation (rank 0's initial value everywhere), every aggregation mode of mirrored
(ON_WRITE/AUTO) and sync-on-read (ON_READ) variables in replica and cross-replica
context, assign/assign_add/assign_sub, NumPy interop, and TF's errors, raised on every
rank.

Replica ``j`` (global id) updates with values computed from ``j``, so every expected
value is computed from ``comm.size`` and ``G`` on every rank; copies that must be
identical everywhere are compared by one ``allgather`` of their digests.
"""

from __future__ import annotations

import numpy as np
import pytest
from _checks import digest

import mpistrat as ms
from mpistrat import CollectiveMismatchError, PerReplica
from mpistrat.strategy import MirroredVariable, SyncOnReadVariable
from mpistrat.values import components_of, default_devices

MPI = pytest.importorskip("mpi4py.MPI")

GS = [1, 2]
KINDS = ["assign", "assign_add", "assign_sub"]


def strategy_for(comm, g):
    return ms.MultiWorkerMirroredStrategy(comm=comm, local_replicas=g)


def copies_everywhere(comm, var) -> list[str]:
    """Every rank's digests of every local copy of ``var``."""
    return [d for rank in comm.allgather([digest(c) for c in var.values]) for d in rank]


def identical_everywhere(comm, var) -> bool:
    return len(set(copies_everywhere(comm, var))) == 1


def expected_update(kind, start, delta):
    return {"assign": delta, "assign_add": start + delta, "assign_sub": start - delta}[kind]


# --- creation -----------------------------------------------------------------------------


@pytest.mark.parametrize("g", GS)
def test_creation_broadcasts_rank_zeros_initial_value(comm, g):
    s = strategy_for(comm, g)
    rng = np.random.default_rng(1000 + comm.rank)  # every rank seeded differently
    with s.scope():
        weights = ms.Variable(rng.normal(size=(3, 2)).astype(np.float32), name="w")
        counter = ms.Variable(lambda: comm.rank + 1, aggregation="only_first_replica")
        total = ms.Variable(np.zeros(2), synchronization=ms.VariableSynchronization.ON_READ,
                            aggregation=ms.VariableAggregation.SUM)
        cast = ms.Variable([comm.rank, 2], dtype=np.float16,
                           synchronization="ON_WRITE", aggregation="mean")
    assert type(weights) is MirroredVariable and type(counter) is MirroredVariable
    assert type(total) is SyncOnReadVariable and type(cast) is MirroredVariable
    assert isinstance(weights, ms.Variable)
    assert weights.name == "w" and weights.shape == (3, 2) and weights.dtype == np.float32
    assert weights.trainable and not total.trainable
    assert weights.synchronization is ms.VariableSynchronization.ON_WRITE  # AUTO resolves, as in TF
    assert weights.aggregation is ms.VariableAggregation.NONE
    assert cast.dtype == np.float16 and cast.numpy().tolist() == [0.0, 2.0]
    assert counter.numpy() == 1 and weights.distribute_strategy is s
    assert weights.devices == tuple(f"/cpu:{i}" for i in range(g)) and len(weights.values) == g
    for var in (weights, counter, total, cast):
        assert identical_everywhere(comm, var)
    np.testing.assert_array_equal(
        weights.numpy(), np.random.default_rng(1000).normal(size=(3, 2)).astype(np.float32))
    assert weights.values[0] is not weights.values[-1] or g == 1  # separate copies


def test_creation_errors_are_raised_on_every_rank(world):
    s = strategy_for(world, 2)
    with s.scope():
        with pytest.raises(ValueError, match="`NONE` variable synchronization mode is not "
                                             "supported"):
            ms.Variable(1.0, synchronization=ms.VariableSynchronization.NONE)
        with pytest.raises(ValueError, match="Invalid variable aggregation mode"):
            ms.Variable(1.0, aggregation="average")
        with pytest.raises(ValueError, match="initial_value must be given"):
            ms.Variable()
        if world.size > 1:
            shape = (2,) if world.rank == 0 else (3,)  # ranks disagree on the shape
            with pytest.raises(CollectiveMismatchError, match="Variable creation"):
                ms.Variable(np.zeros(shape))
            bad = None if world.rank == world.size - 1 else 1.0  # one rank's value is bad
            with pytest.raises(ValueError, match="initial_value must be given|failed on"):
                ms.Variable(bad)
        ok = ms.Variable(np.arange(3.0))  # the ranks are still in step
    assert identical_everywhere(world, ok)

    def create_in_run():
        ms.Variable(1.0)

    with pytest.raises(RuntimeError, match="created in its scope"):
        s.run(create_in_run)


def test_variable_outside_any_scope_is_plain():
    v = ms.Variable(np.arange(3), name="plain")
    assert type(v) is ms.Variable and v.name == "plain"
    v.assign_add(1)
    v.assign_sub([1, 0, 0])
    assert v.numpy().tolist() == [0, 2, 3]
    v.assign(7)
    assert v.numpy().tolist() == [7, 7, 7]
    with pytest.raises(ValueError, match="cannot assign a value of shape"):
        v.assign(np.ones(2))


# --- mirrored, replica context ------------------------------------------------------------


@pytest.mark.parametrize("g", GS)
def test_mirrored_updates_in_replica_context(world, g):
    s = strategy_for(world, g)
    for kind in KINDS:
        check_mirrored_updates(world, s, g, kind)


def check_mirrored_updates(comm, s, g, kind):
    n = comm.size * g
    start = np.array([10.0, -4.0])
    with s.scope():
        sums = ms.Variable(start, aggregation="sum")
        means = ms.Variable(start, aggregation=ms.VariableAggregation.MEAN)
        firsts = ms.Variable(start, aggregation="only_first_replica")
        steps = ms.Variable(np.int64(5), aggregation="only_first_replica")
        int_sums = ms.Variable(np.int32(5), aggregation="sum")

    def delta(j):
        return np.array([j + 1.0, 2.0 * j])

    def step():
        j = ms.get_replica_context().replica_id_in_sync_group
        for var in (sums, means, firsts):
            assert getattr(var, kind)(delta(j)) is var
        getattr(steps, kind)(1)  # the global-step pattern
        getattr(int_sums, kind)(np.int32(j))
        return sums.numpy(), means.numpy()  # reads inside run see the updated copies

    seen = s.run(step)
    total = sum(delta(j) for j in range(n))
    np.testing.assert_array_equal(sums.numpy(), expected_update(kind, start, total))
    np.testing.assert_allclose(means.numpy(), expected_update(kind, start, total / n))
    np.testing.assert_array_equal(firsts.numpy(), expected_update(kind, start, delta(0)))
    assert steps.numpy() == expected_update(kind, 5, 1)
    assert int_sums.numpy() == expected_update(kind, 5, n * (n - 1) // 2)
    assert int_sums.dtype == np.int32
    for read in s.experimental_local_results(seen):
        np.testing.assert_array_equal(read[0], sums.numpy())
    for var in (sums, means, firsts, steps, int_sums):
        assert identical_everywhere(comm, var)


@pytest.mark.parametrize("g", GS)
def test_mirrored_same_object_from_every_replica_counts_every_replica(world, g):
    """A value passed as the same object by every replica: each replica contributed it
    (TF raised for SUM; see the module docstring of mpistrat.strategy.variables)."""
    s = strategy_for(world, g)
    n = world.size * g
    with s.scope():
        sums = ms.Variable(0.0, aggregation="sum")
        means = ms.Variable(0.0, aggregation="mean")
    shared = np.float64(3.0)

    def step():
        sums.assign_add(shared)
        means.assign_add(shared)

    s.run(step)
    assert sums.numpy() == 3.0 * n and means.numpy() == 3.0


@pytest.mark.parametrize("g", GS)
def test_mirrored_replica_context_errors(world, g):
    s = strategy_for(world, g)
    with s.scope():
        unaggregated = ms.Variable(np.zeros(2))
        with pytest.raises(ValueError, match="aggregation MEAN needs a float variable"):
            ms.Variable(np.int64(1), aggregation="mean")  # TF refuses it at creation
        fine = ms.Variable(np.zeros(2), aggregation="sum")
    for kind in KINDS:
        with pytest.raises(ValueError, match="You must specify an aggregation method"):
            s.run(lambda: getattr(unaggregated, kind)(np.ones(2)))
    s.run(lambda: fine.assign_add(np.ones(2)))  # the ranks are still in step
    assert fine.numpy().tolist() == [world.size * g] * 2
    assert unaggregated.numpy().tolist() == [0.0, 0.0]


# --- mirrored, cross-replica context --------------------------------------------------------


@pytest.mark.parametrize("g", GS)
def test_mirrored_updates_in_cross_replica_context(world, g):
    s = strategy_for(world, g)
    aggregations = ["none", "sum", "mean", "only_first_replica"]
    with s.scope():
        variables = [ms.Variable(np.array([1.0, 2.0]), aggregation=a) for a in aggregations]
        for var in variables:  # inside the scope ...
            var.assign([5.0, 6.0])
    for var in variables:  # ... and outside: applied to every local copy, no communication
        var.assign_add(np.array([1.0, 1.0]))
        var.assign_sub(0.5)
        for copy in var.values:
            np.testing.assert_array_equal(copy, [5.5, 6.5])
        with pytest.raises(ValueError, match="PerReplica value"):
            var.assign(PerReplica([np.ones(2)] * g, default_devices(g)))
    # a Mirrored value (e.g. reduce_to's result) is one value: every copy gets it
    grads = PerReplica([np.full(2, world.rank * g + i, np.float64) for i in range(g)],
                       default_devices(g))
    mean = s.extended.reduce_to("mean", grads, grads)
    for var in variables:
        var.assign(mean)
        for copy in var.values:
            np.testing.assert_allclose(copy, [(world.size * g - 1) / 2] * 2)
    # the update is local to the rank: each rank may assign its own value
    variables[1].assign(np.full(2, world.rank))
    assert variables[1].numpy().tolist() == [world.rank] * 2

    def in_merge_fn():  # merge_fn runs in cross-replica context: assign applies as given
        ms.get_replica_context().merge_call(lambda strategy: variables[0].assign([9.0, 9.0]))

    s.run(in_merge_fn)
    assert identical_everywhere(world, variables[0])
    assert variables[0].numpy().tolist() == [9.0, 9.0]


# --- sync-on-read -------------------------------------------------------------------------


@pytest.mark.parametrize("g", GS)
def test_sync_on_read_updates_locally_and_aggregates_on_read(world, g):
    comm = world
    s = strategy_for(comm, g)
    n = comm.size * g
    with s.scope():
        sums = ms.Variable(0.0, synchronization="on_read", aggregation="sum")
        means = ms.Variable(np.zeros(2), synchronization="on_read", aggregation="mean")
        firsts = ms.Variable(0.0, synchronization="on_read", aggregation="only_first_replica")
        int_sums = ms.Variable(np.int32(0), synchronization="on_read", aggregation="sum")
        unaggregated = ms.Variable(1.0, synchronization="on_read")

    def step():
        j = ms.get_replica_context().replica_id_in_sync_group
        sums.assign_add(j + 1.0)
        means.assign(np.array([j, -j], dtype=np.float64))
        means.assign_sub(1.0)
        firsts.assign_add(10.0 * (j + 1))
        int_sums.assign_add(np.int32(j))
        unaggregated.assign(float(j))
        return sums.numpy(), unaggregated.numpy()  # replica context: the local copy

    local_reads = s.experimental_local_results(s.run(step))
    mine = [comm.rank * g + i for i in range(g)]
    assert [(float(a), float(b)) for a, b in local_reads] == [(j + 1.0, float(j)) for j in mine]
    assert [float(c) for c in sums.values] == [j + 1.0 for j in mine]  # no communication
    # cross-replica reads aggregate over every replica of every rank (collectively)
    assert sums.numpy() == n * (n + 1) / 2
    assert float(sums) == n * (n + 1) / 2 and sums.read_value() == n * (n + 1) / 2
    np.testing.assert_allclose(means.numpy(), [(n - 1) / 2 - 1, -(n - 1) / 2 - 1])
    np.testing.assert_allclose(np.asarray(means), means.numpy())
    assert firsts.numpy() == 10.0
    assert int_sums.numpy() == n * (n - 1) // 2 and int_sums.numpy().dtype == np.int32
    # describing a variable never communicates (only rank 0 asks here)
    if comm.rank == 0:
        assert unaggregated.shape == () and unaggregated.dtype == np.float64
        assert "SyncOnReadVariable" in repr(firsts) and firsts.shape == ()
    with pytest.raises(ValueError, match="Could not convert from `tf.VariableAggregation`"):
        unaggregated.numpy()
    assert sums.numpy() == n * (n + 1) / 2  # still in step


@pytest.mark.parametrize("g", GS)
def test_sync_on_read_cross_replica_writes(world, g):
    s = strategy_for(world, g)
    n = world.size * g
    with s.scope():
        sums = ms.Variable(np.zeros(2), synchronization="on_read", aggregation="sum")
        int_sums = ms.Variable(np.int64(0), synchronization="on_read", aggregation="sum")
        means = ms.Variable(0.0, synchronization="on_read", aggregation="mean")
        firsts = ms.Variable(0.0, synchronization="on_read", aggregation="only_first_replica")
    sums.assign(np.array([n * 3.0, 1.0]))  # each copy gets value / N, so the read is value
    np.testing.assert_allclose(sums.values[0], [3.0, 1.0 / n])
    np.testing.assert_allclose(sums.numpy(), [n * 3.0, 1.0])
    int_sums.assign(2 * n)
    assert int_sums.values[-1] == 2 and int_sums.numpy() == 2 * n
    for kind in ("assign_add", "assign_sub"):
        with pytest.raises(ValueError, match=f"does not support `{kind}` in cross-replica "
                                             f"context when aggregation is set to "
                                             f"`tf.VariableAggregation.SUM`"):
            getattr(sums, kind)(1.0)
    mirrored = ms.Mirrored([np.float64(7.0)] * g, default_devices(g))
    means.assign(mirrored)
    assert means.numpy() == 7.0
    for var in (means, firsts):  # other aggregations: applied to every copy
        var.assign(4.0)
        var.assign_add(2.0)
        var.assign_sub(1.0)
        assert [float(c) for c in var.values] == [5.0] * g
        assert var.numpy() == 5.0


# --- NumPy interop ---------------------------------------------------------------------------


def test_numpy_interop(world):
    s = strategy_for(world, 2)
    with s.scope():
        v = ms.Variable(np.arange(4.0).reshape(2, 2), aggregation="mean")
    view = np.asarray(v)
    assert not view.flags.writeable  # np.asarray never lets the copies diverge
    with pytest.raises(ValueError):
        view[0, 0] = 1.0
    copy = v.numpy()
    copy[0, 0] = 100.0
    assert v.numpy()[0, 0] == 0.0
    np.testing.assert_array_equal(np.array(v, dtype=np.float32), np.arange(4.0).reshape(2, 2))
    assert (v + 1).tolist() == [[1.0, 2.0], [3.0, 4.0]]
    assert (2 * v)[1].tolist() == [4.0, 6.0]
    assert (v @ np.ones(2)).tolist() == [1.0, 5.0] and len(v) == 2
    assert np.sum(v) == 6.0 and v[1, 1] == 3.0
    assert "MirroredVariable" in repr(v)


# --- variables in reductions ------------------------------------------------------------------


@pytest.mark.parametrize("g", GS)
def test_variables_in_reductions(world, g):
    """TF treats a distributed variable as a DistributedValues: reduce and all_reduce read
    its copies; ``(gradient, variable)`` pairs reduce onto the variable's devices."""
    s = strategy_for(world, g)
    n = world.size * g
    with s.scope():
        weights = ms.Variable(np.array([1.0, 2.0]), aggregation="mean")
        metric = ms.Variable(0.0, synchronization="on_read", aggregation="sum")
    s.run(lambda: metric.assign_add(1.0 + ms.get_replica_context().replica_id_in_sync_group))
    assert s.reduce("sum", metric) == n * (n + 1) / 2
    if n > 1:  # the copies are one value: TF refuses to sum them, and so does mpistrat
        with pytest.raises(ValueError, match="MirroredVariable"):
            s.reduce("sum", weights)
    mean = s.reduce("mean", weights)  # a mirrored value's MEAN is itself ...
    mean[0] = -1.0  # ... but never the variable's storage
    assert weights.numpy().tolist() == [1.0, 2.0]
    grads = PerReplica([np.full(2, world.rank * g + i, np.float64) for i in range(g)],
                       default_devices(g))
    on_weights, on_metric = s.extended.batch_reduce_to(
        "mean", [(grads, weights), (PerReplica([np.float64(1.0)] * g, default_devices(g)),
                                    metric)])
    if g > 1:  # (one destination device: the array itself, as in TF)
        assert on_weights.devices == weights.devices
    np.testing.assert_allclose(components_of(on_weights)[-1], [(n - 1) / 2] * 2)
    assert components_of(on_metric)[0] == 1.0
    np.testing.assert_allclose(components_of(s.extended.reduce_to("sum", grads, weights))[0],
                               [n * (n - 1) / 2] * 2)

    def step():
        ctx = ms.get_replica_context()
        return ctx.all_reduce("sum", {"w": weights, "m": metric})

    out = s.run(step)
    for i in range(g):
        pick = (lambda x: x.values[i]) if g > 1 else (lambda x: x)
        assert pick(out["w"]).tolist() == [n * 1.0, n * 2.0]
        assert pick(out["m"]) == n * (n + 1) / 2  # each replica's own copy
