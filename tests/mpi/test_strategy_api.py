"""The strategy API of MultiWorkerMirroredStrategy across real MPI ranks, with G in {1, 2}
CPU replicas per rank: facts, ``run`` and how its results are regrouped, ``reduce``
(with and without ``axis``, the partial-batch MEAN), ``extended``, replica contexts
(``all_reduce`` over nests, ``all_gather``, ``merge_call``), ``gather``, the context
functions, and the errors — raised on every rank, never a hang.

Replica ``j`` (global id) holds values computed from ``j``, so every expected result is
computed on every rank from ``comm.size`` and ``G``. Results that must be the same on
every rank are compared by one ``allgather`` of their digests.
"""

from __future__ import annotations

import numpy as np
import pytest
from _checks import digest

import mpistrat as ms
from mpistrat import CommunicationOptions, Mirrored, PerReplica, ReduceOp
from mpistrat.strategy import get_cross_replica_context
from mpistrat.values import components_of, default_devices

MPI = pytest.importorskip("mpi4py.MPI")

GS = [1, 2]


def strategy_for(comm, g: int) -> ms.MultiWorkerMirroredStrategy:
    return ms.MultiWorkerMirroredStrategy(comm=comm, local_replicas=g)


def ids_of(comm, g: int) -> list[int]:
    return [comm.rank * g + i for i in range(g)]


def per_replica(comm, g: int, make) -> PerReplica:
    """A PerReplica whose component ``i`` is ``make(global id of local replica i)``."""
    return PerReplica([make(j) for j in ids_of(comm, g)], default_devices(g))


def same_everywhere(comm, *arrays) -> bool:
    mine = [digest(np.asarray(a)) for a in arrays]
    return all(theirs == mine for theirs in comm.allgather(mine))


def local(value) -> list:
    """The local components of a run() result (one value when G == 1)."""
    return list(value.values) if isinstance(value, PerReplica) else [value]


# --- facts --------------------------------------------------------------------------------


@pytest.mark.parametrize("g", GS)
def test_facts(comm, g):
    s = strategy_for(comm, g)
    assert s.num_replicas_in_sync == comm.size * g
    assert s.comm is comm
    ext = s.extended
    assert ext.worker_devices == tuple(f"/cpu:{i}" for i in range(g))
    assert ext.parameter_devices == ext.worker_devices
    assert (ext.num_workers, ext.worker_index) == (comm.size, comm.rank)
    assert ext.should_checkpoint is (comm.rank == 0)
    assert ext.should_save_summary is (comm.rank == 0)
    assert ext.experimental_between_graph is True
    assert isinstance(ext.cross_device_ops, ms.MultiWorkerAllReduce)
    assert s.communication is ms.CommunicationImplementation.RING
    assert s.cluster_resolver.task_id == comm.rank
    assert f"{comm.size} worker(s) x {g} device(s)" in repr(s)


@pytest.mark.parametrize("g", GS)
def test_replica_ids_cover_every_replica_once(comm, g):
    s = strategy_for(comm, g)

    def fn():
        ctx = ms.get_replica_context()
        return (ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync, ctx.devices,
                ctx.strategy is s, ms.get_strategy() is s, ms.has_strategy(),
                ms.in_cross_replica_context())

    results = s.experimental_local_results(s.run(fn))
    assert len(results) == g
    for i, (rid, n, devices, own, current, has, cross) in enumerate(results):
        assert rid == comm.rank * g + i
        assert n == comm.size * g
        assert devices == (f"/cpu:{i}",)
        assert own and current and has and not cross
    everyone = sorted(r for rank in comm.allgather([r[0] for r in results]) for r in rank)
    assert everyone == list(range(comm.size * g))


# --- run ----------------------------------------------------------------------------------


@pytest.mark.parametrize("g", GS)
def test_run_regroups_results(world, g):
    s = strategy_for(world, g)
    shared = np.arange(3)
    arg = per_replica(world, g, lambda j: np.full(2, j))
    mirrored = Mirrored([np.ones(1) * 7] * g, default_devices(g))

    def fn(x, m, plain, *, key):
        rid = ms.get_replica_context().replica_id_in_sync_group
        assert plain is shared and key == "k"
        np.testing.assert_array_equal(x, np.full(2, rid))
        np.testing.assert_array_equal(m, [7.0])
        return {"same": shared, "mine": (rid, np.asarray(x) * 2), "none": None}

    for run in (s.run, s.experimental_run_v2):
        out = run(fn, args=(arg, mirrored, shared), kwargs={"key": "k"})
        assert out["same"] is shared and out["none"] is None
        rids, doubled = out["mine"]
        if g == 1:  # one replica: values come back unwrapped
            assert rids == world.rank and not isinstance(doubled, PerReplica)
        else:
            assert isinstance(rids, PerReplica) and isinstance(doubled, PerReplica)
            assert rids.devices == ("/cpu:0", "/cpu:1")
        assert list(s.experimental_local_results(rids)) == ids_of(world, g)
        for j, d in zip(ids_of(world, g), s.experimental_local_results(doubled)):
            np.testing.assert_array_equal(d, np.full(2, 2 * j))


def test_run_rejects_bad_arguments_and_structures(world):
    s = strategy_for(world, 2)
    with pytest.raises(TypeError, match="takes a function"):
        s.run(42)
    with pytest.raises(TypeError, match=r"args=\(x,\)"):
        s.run(lambda x: x, args=np.ones(2))

    def ragged():
        rid = ms.get_replica_context().replica_id_in_sync_group
        return (1,) if rid % 2 == 0 else [1]

    with pytest.raises(ValueError, match="different structures"):
        s.run(ragged)


# --- reduce -------------------------------------------------------------------------------


@pytest.mark.parametrize("g", GS)
def test_reduce_without_axis(comm, g):
    s = strategy_for(comm, g)
    n = comm.size * g
    value = per_replica(comm, g, lambda j: np.array([j, 2 * j + 1], dtype=np.float32))
    total = np.array([n * (n - 1) / 2, n * n], dtype=np.float32)
    for op in (ReduceOp.SUM, "sum", "SUM"):
        got = s.reduce(op, value, axis=None)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, total)
    for op in (ReduceOp.MEAN, "mean", "Mean"):
        np.testing.assert_allclose(s.reduce(op, value), total / n, rtol=1e-6)
    ints = per_replica(comm, g, lambda j: np.int32(j))
    mean = s.reduce("mean", ints)
    assert mean == (n - 1) / 2
    assert mean.dtype == np.float64 or n == 1  # one replica: TF's shortcut keeps the value
    # a plain value is one contribution per rank (TF's host-tensor collective)
    assert s.reduce("sum", 1.0) == comm.size
    assert s.reduce(ReduceOp.MEAN, np.full(2, comm.rank)).tolist() == [(comm.size - 1) / 2] * 2
    # a Mirrored value with MEAN comes back as it is
    mirrored = Mirrored([np.array([5.0])] * g, default_devices(g))
    assert s.reduce("mean", mirrored) is mirrored.values[0]
    assert same_everywhere(comm, s.reduce("sum", value), s.reduce("mean", value))


@pytest.mark.parametrize("g", GS)
def test_reduce_along_axis_counts_the_actual_examples(world, g):
    """Replica j holds 1 + j % 3 examples; the MEAN is over all of them (TF's rule)."""
    s = strategy_for(world, g)
    n = world.size * g
    sizes = [1 + j % 3 for j in range(n)]
    starts = np.concatenate([[0], np.cumsum(sizes)])
    rows = lambda j: np.arange(starts[j], starts[j] + sizes[j], dtype=np.float64)  # noqa: E731
    value = per_replica(world, g, rows)
    everything = np.arange(starts[-1], dtype=np.float64)
    assert s.reduce("mean", value, axis=0) == everything.mean()
    assert s.reduce("sum", value, axis=0) == everything.sum()
    assert s.reduce(ReduceOp.MEAN, value, axis=-1) == everything.mean()
    # 2-D per-replica batches of features: mean over examples, per feature
    matrix = per_replica(world, g, lambda j: np.stack([rows(j), -2 * rows(j)], axis=1))
    np.testing.assert_allclose(s.reduce("mean", matrix, axis=0),
                               [everything.mean(), -2 * everything.mean()])
    np.testing.assert_allclose(s.reduce("mean", matrix, axis=(0, 1)), -everything.mean() / 2)
    ints = per_replica(world, g, lambda j: rows(j).astype(np.int64))
    mean = s.reduce("mean", ints, axis=0)
    assert mean.dtype == np.float64 and mean == everything.mean()


def test_reduce_partial_batch_mean_of_tf_example(world):
    """TF's example: replicas holding [0, 1, 2, 3] and [4, 5] average to 15 / 6 = 2.5."""
    s = strategy_for(world, 2)
    value = PerReplica([np.arange(4.0), np.arange(4.0, 6.0)])
    assert s.reduce("mean", value, axis=0) == 2.5
    assert s.reduce("sum", value, axis=0) == 15.0 * world.size


def test_reduce_errors(world):
    s = strategy_for(world, 2)
    value = PerReplica([np.arange(4.0), np.arange(2.0)])
    for axis in (1.0, "0", True, [0.5]):
        with pytest.raises(TypeError, match="Expected `axis` to be an integer"):
            s.reduce("mean", value, axis=axis)
    for axis in (1, -2, 5):
        with pytest.raises(ValueError, match=f"`axis` = {axis} out of range"):
            s.reduce("sum", value, axis=axis)
    with pytest.raises(ValueError, match="unknown reduce op"):
        s.reduce("average", value)
    with pytest.raises(TypeError, match="Expected `reduce_op`"):
        s.reduce("max", value, axis=0)

    if world.size > 1:  # the last rank's values have another rank: every rank raises
        odd = world.rank == world.size - 1
        ragged = PerReplica([np.ones((2, 2)) if odd else np.ones(2)] * 2)
        with pytest.raises(ValueError, match="out of range|Strategy.reduce"):
            s.reduce("mean", ragged, axis=-2 if odd else 0)  # -2 is out of range for 1-D
        with pytest.raises(ValueError, match="Strategy.reduce|out of range"):
            s.reduce("mean", ragged, axis=1)
        with pytest.raises(ValueError, match="gather along axis 0"):
            s.gather(PerReplica([np.ones((1, 3)) if odd else np.ones((1, 2))] * 2), axis=0)

    def inside():
        s.reduce("sum", 1.0)

    with pytest.raises(RuntimeError, match="requires being in cross-replica context"):
        s.run(inside)
    assert s.reduce("sum", value, axis=0) == 7.0 * world.size  # still in step


# --- extended -----------------------------------------------------------------------------


@pytest.mark.parametrize("g", GS)
def test_extended_reduce_to_and_batch_reduce_to(comm, g):
    s = strategy_for(comm, g)
    ext = s.extended
    n = comm.size * g
    a = per_replica(comm, g, lambda j: np.array([j, 1.0]))
    b = per_replica(comm, g, lambda j: np.int32(2 * j))
    out = ext.reduce_to("sum", a, a)
    if g > 1:
        assert isinstance(out, Mirrored) and out.devices == a.devices
    else:  # one destination device: the array itself, as in TF
        assert isinstance(out, np.ndarray)
    for component in components_of(out):
        np.testing.assert_array_equal(component, [n * (n - 1) / 2, n])
    one = ext.reduce_to(ReduceOp.MEAN, a, "/cpu:0",
                        options=CommunicationOptions(timeout_seconds=60))
    assert isinstance(one, np.ndarray)
    np.testing.assert_allclose(one, [(n - 1) / 2, 1.0])
    first, second = ext.batch_reduce_to("sum", [(a, a), (b, b)])
    np.testing.assert_array_equal(components_of(first)[-1], [n * (n - 1) / 2, n])
    second_value = components_of(second)[0]
    assert second_value == n * (n - 1) and second_value.dtype == np.int32
    mirrored = Mirrored([np.ones(2)] * g, default_devices(g))
    assert ext.reduce_to("mean", mirrored, mirrored) is mirrored
    assert ext.reduce_to("sum", 2.0, "/cpu:0") == 2.0 * comm.size
    assert same_everywhere(comm, *components_of(out), one, *components_of(second))


@pytest.mark.parametrize("g", GS)
def test_extended_update_and_value_container(world, g):
    s = strategy_for(world, g)
    with s.scope():
        v = ms.Variable(np.zeros(2), aggregation="sum")
    seen = []

    def fn(component, delta, scale=1):
        assert s.extended.value_container(component) is v
        seen.append(component)
        component.assign_add(np.asarray(delta) * scale)
        return "done"

    delta = per_replica(world, g, lambda j: np.full(2, j + 1.0))
    assert s.extended.update(v, fn, args=(delta,), kwargs={"scale": 2}) == "done"
    for j, component in zip(ids_of(world, g), v.values):  # each copy got its replica's part
        np.testing.assert_array_equal(component, np.full(2, 2 * (j + 1.0)))
    grouped = s.extended.update(v, lambda c: c)
    assert isinstance(grouped, PerReplica) == (g > 1)
    assert all(s.extended.value_container(c) is v
               for c in s.experimental_local_results(grouped))
    ungrouped = s.extended.update(v, lambda c: 1, group=False)
    assert ungrouped == (1,) * g
    assert s.extended.value_container(v) is v
    assert s.extended.value_container(v.values[-1]) is v
    plain = np.ones(3)
    assert s.extended.value_container(plain) is plain

    def inside():
        s.extended.update(v, lambda c: None)

    with pytest.raises(RuntimeError, match="cross-replica"):
        s.run(inside)


def test_extended_methods_need_cross_replica_context(world):
    s = strategy_for(world, 2)
    value = PerReplica([np.ones(1), np.ones(1)])
    calls = {
        "reduce_to": lambda: s.extended.reduce_to("sum", value, value),
        "batch_reduce_to": lambda: s.extended.batch_reduce_to("sum", [(value, value)]),
        "gather": lambda: s.gather(value, 0),
        "experimental_make_numpy_dataset": lambda: s.experimental_make_numpy_dataset(
            np.ones(3)),
        "run": lambda: s.run(lambda: None),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=f"{name}: Method requires being in "
                                               f"cross-replica context"):
            s.run(call)


# --- replica context -----------------------------------------------------------------------


@pytest.mark.parametrize("g", GS)
def test_all_reduce_over_nests(comm, g):
    s = strategy_for(comm, g)
    n = comm.size * g
    CONSTANT = np.ones(3, dtype=np.float32)

    def fn():
        ctx = ms.get_replica_context()
        j = ctx.replica_id_in_sync_group
        nest = {"a": np.float64(j), "b": [np.full(2, j, np.int32), (np.arange(3.0) * j,)],
                "c": CONSTANT}
        summed = ctx.all_reduce("sum", nest)
        mean = ctx.all_reduce(ReduceOp.MEAN, [np.float32(j), (np.int64(j), {"x": 2.0})])
        once = ctx.all_reduce("sum", 1.0)  # the same object from every replica
        empty = ctx.all_reduce("sum", {"nothing": []})
        return summed, mean, once, empty

    summed, mean, once, empty = s.run(fn)
    for i in range(g):
        pick = (lambda x: x.values[i]) if g > 1 else (lambda x: x)
        assert pick(summed["a"]) == n * (n - 1) / 2
        assert pick(summed["b"][0]).dtype == np.int32
        np.testing.assert_array_equal(pick(summed["b"][0]), [n * (n - 1) // 2] * 2)
        np.testing.assert_array_equal(pick(summed["b"][1][0]), np.arange(3.0) * n * (n - 1) / 2)
        np.testing.assert_array_equal(pick(summed["c"]), np.full(3, n, np.float32))
        assert pick(mean[0]) == np.float32((n - 1) / 2)
        assert pick(mean[1][0]) == (n - 1) / 2
        assert pick(mean[1][0]).dtype == np.float64 or n == 1
        assert pick(mean[1][1]["x"]) == 2.0
        assert pick(once) == n
    assert empty == {"nothing": []}
    assert same_everywhere(comm, *s.experimental_local_results(summed["b"][1][0]))


@pytest.mark.parametrize("g", GS)
def test_all_gather_and_gather(comm, g):
    s = strategy_for(comm, g)
    n = comm.size * g
    rows = lambda j: np.full((j % 2 + 1, 2), j)  # noqa: E731 (ragged along axis 0)
    expected = np.concatenate([rows(j) for j in range(n)])
    SHARED = np.array([[9, 9]])

    def fn():
        ctx = ms.get_replica_context()
        j = ctx.replica_id_in_sync_group
        return ctx.all_gather({"rows": rows(j), "cols": (np.full((1, 1), j),),
                               "shared": SHARED}, axis=0)

    out = s.run(fn)
    for result in s.experimental_local_results(out):
        np.testing.assert_array_equal(result["rows"], expected)
        np.testing.assert_array_equal(result["cols"][0], np.arange(n).reshape(n, 1))
        np.testing.assert_array_equal(result["shared"], np.full((n, 2), 9))
    gathered = s.gather(per_replica(comm, g, rows), axis=0)
    np.testing.assert_array_equal(gathered, expected)
    np.testing.assert_array_equal(s.gather(per_replica(comm, g, lambda j: np.full((2, 1), j)),
                                           axis=1), np.repeat(np.arange(n)[None], 2, axis=0))


@pytest.mark.parametrize("g", GS)
def test_merge_call_regroups_arguments_and_splits_results(world, g):
    s = strategy_for(world, g)
    shared = object()
    calls = []

    def merge_fn(strategy, mine, same, *, key):
        assert strategy is s
        assert ms.get_replica_context() is None and ms.in_cross_replica_context()
        assert get_cross_replica_context() is s
        calls.append(mine)
        assert same is shared and key == "k"
        ids = list(s.experimental_local_results(mine))
        assert ids == ids_of(world, g)
        assert isinstance(mine, PerReplica) == (g > 1)
        total = s.reduce("sum", mine)  # collectives are allowed in merge_fn
        back = PerReplica([10 * j for j in ids]) if g > 1 else 10 * ids[0]
        return back, total

    def fn():
        ctx = ms.get_replica_context()
        j = ctx.replica_id_in_sync_group
        first = ctx.merge_call(merge_fn, args=(j, shared), kwargs={"key": "k"})
        second = ctx.merge_call(merge_fn, args=(j + 0, shared), kwargs={"key": "k"})
        return first, second

    first, second = s.run(fn)
    assert len(calls) == 2  # merge_fn runs once per merge_call, not once per replica
    n = world.size * g
    for result in (first, second):
        back, total = result
        assert list(s.experimental_local_results(back)) == [10 * j for j in ids_of(world, g)]
        assert total == n * (n - 1) / 2  # the same object for every replica: unwrapped


def test_unequal_merge_call_counts_raise_instead_of_hanging(world):
    s = strategy_for(world, 2)

    def fn():
        ctx = ms.get_replica_context()
        ctx.all_reduce("sum", np.ones(1))
        if ctx.replica_id_in_sync_group % 2 == 1:
            ctx.all_reduce("sum", np.ones(1))  # local replica 1 makes one more

    with pytest.raises(RuntimeError, match="different number of replica_context"):
        s.run(fn)

    def fewer():
        ctx = ms.get_replica_context()
        if ctx.replica_id_in_sync_group % 2 == 0:
            ctx.merge_call(lambda strategy: None)

    with pytest.raises(RuntimeError, match="merge_call"):
        s.run(fewer)
    # nothing is left behind: the strategy still runs and reduces
    out = s.run(lambda: ms.get_replica_context().all_reduce("sum", np.ones(1)))
    assert [x.tolist() for x in out.values] == [[2.0 * world.size]] * 2


@pytest.mark.parametrize("g", GS)
def test_exceptions_in_fn_and_merge_fn_propagate(world, g):
    s = strategy_for(world, g)

    class Boom(Exception):
        pass

    def raises():
        raise Boom("in fn")

    with pytest.raises(Boom, match="in fn"):
        s.run(raises)

    def bad_merge_fn(strategy):
        raise KeyError("in merge_fn")

    def merge_raises():
        ms.get_replica_context().merge_call(bad_merge_fn)

    with pytest.raises(KeyError, match="in merge_fn"):
        s.run(merge_raises)

    def one_raises_while_other_waits():
        ctx = ms.get_replica_context()
        if ctx.replica_id_in_sync_group % g == g - 1:
            raise Boom("late replica")
        ctx.all_reduce("sum", np.ones(1))

    with pytest.raises(Boom, match="late replica"):
        s.run(one_raises_while_other_waits)
    assert s.reduce("sum", 1.0) == world.size  # still in step


@pytest.mark.parametrize("g", GS)
def test_experimental_local_results(world, g):
    s = strategy_for(world, g)
    value = per_replica(world, g, lambda j: np.array([j]))
    assert [x.item() for x in s.experimental_local_results(value)] == ids_of(world, g)
    plain = np.ones(2)
    assert s.experimental_local_results(plain) == (plain,)
    nest = {"v": value, "c": 3}
    parts = s.experimental_local_results(nest)
    assert [(p["v"].item(), p["c"]) for p in parts] == [(j, 3) for j in ids_of(world, g)]
    with s.scope():
        var = ms.Variable(np.arange(2.0), aggregation="mean")
    assert len(s.experimental_local_results(var)) == g
    for component in s.experimental_local_results(var):
        np.testing.assert_array_equal(component, [0.0, 1.0])


# --- context functions ----------------------------------------------------------------------


@pytest.mark.parametrize("g", GS)
def test_context_functions_follow_tf_rules(world, g):
    s = strategy_for(world, g)
    default = ms.get_strategy()
    assert default is not s and not ms.has_strategy() and not ms.in_cross_replica_context()
    assert default.num_replicas_in_sync == 1
    ctx = ms.get_replica_context()
    assert ctx is not None and ctx.replica_id_in_sync_group == 0
    assert ctx.num_replicas_in_sync == 1
    with default.scope():  # TF: the default scope keeps the default replica context
        assert ms.get_strategy() is default and not ms.has_strategy()
        assert ms.get_replica_context() is ctx and not ms.in_cross_replica_context()
    with s.scope() as entered:
        assert entered is s and ms.get_strategy() is s and ms.has_strategy()
        assert ms.get_replica_context() is None and ms.in_cross_replica_context()
        with s.scope():  # re-entering the same scope is allowed
            assert ms.get_strategy() is s
        inside = s.run(lambda: (ms.get_replica_context() is not None,
                                ms.in_cross_replica_context()))
        assert inside == (True, False)  # the same objects from every replica: unwrapped
        assert ms.get_strategy() is s and ms.in_cross_replica_context()
    assert ms.get_strategy() is default and not ms.has_strategy()


def test_mixing_strategies_is_an_error(world):
    s = strategy_for(world, 2)
    other = strategy_for(world, 1)
    default = ms.get_strategy()
    with s.scope():
        with pytest.raises(RuntimeError, match="Mixing different tf.distribute.Strategy"):
            with other.scope():
                pass
        with pytest.raises(RuntimeError, match="Mixing different tf.distribute.Strategy"):
            other.run(lambda: None)
        with pytest.raises(RuntimeError, match="Must not nest"):
            with default.scope():
                pass
        assert ms.get_strategy() is s

    def enter_scope_in_run():
        with s.scope():
            pass

    with pytest.raises(RuntimeError, match="cross-replica context"):
        s.run(enter_scope_in_run)

    def enter_other_scope_in_run():
        with other.scope():
            pass

    with pytest.raises(RuntimeError, match="Mixing"):
        s.run(enter_other_scope_in_run)
    assert not ms.has_strategy()


def test_experimental_set_strategy(world):
    s = strategy_for(world, 2)
    other = strategy_for(world, 1)
    try:
        ms.experimental_set_strategy(s)
        assert ms.get_strategy() is s and ms.has_strategy()
        assert ms.in_cross_replica_context() and ms.get_replica_context() is None
        with s.scope():
            assert ms.get_strategy() is s
            with pytest.raises(RuntimeError, match="experimental_set_strategy"):
                ms.experimental_set_strategy(other)
        with pytest.raises(RuntimeError, match="Mixing"):
            with other.scope():
                pass
        ids = s.run(lambda: ms.get_replica_context().replica_id_in_sync_group)
        assert list(ids.values) == ids_of(world, 2)
        with pytest.raises(TypeError, match="Strategy or None"):
            ms.experimental_set_strategy("mirrored")
        ms.experimental_set_strategy(other)
        assert ms.get_strategy() is other
    finally:
        ms.experimental_set_strategy(None)
    assert not ms.has_strategy() and not ms.in_cross_replica_context()
    assert ms.get_replica_context().replica_id_in_sync_group == 0
