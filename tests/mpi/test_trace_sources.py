"""What mpistrat's layers put into a trace, at 1-4 ranks: a strategy loop over a
distributed dataset gives one ``ProfilerStep`` per batch (not one more per
``strategy.run``), each starting with its input wait, with the replicas' spans inside
``strategy.run``; a checkpoint save is a span; a plain loop's ``trace.step()`` (or
``mpistrat.elastic.step()``) takes over from the strategy's steps; steps outside
``--trace-steps`` leave nothing; a parameter-server job's closures are spans on the
workers that ran them and instants on the coordinator; a stall report is a failure
instant naming the late rank. Every file is read back with ``json.load``."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

import mpistrat as ms
from mpistrat import trace
from mpistrat.checkpoint import Checkpoint, CheckpointManager, Scalar
from mpistrat.data import Options
from mpistrat.runtime.agreement import agree

MPI = pytest.importorskip("mpi4py.MPI")

G = 2  # replicas per rank
BATCHES = 5
_SLACK = 0.002  # µs: ts and dur are written with 3 decimals


def _load(path):
    with open(path) as f:
        return json.load(f)


def _spans(doc, name=None, cat=None):
    return [e for e in doc["traceEvents"] if e.get("ph") == "X"
            and (name is None or e["name"] == name) and (cat is None or e["cat"] == cat)]


def _instants(doc, name):
    return [e for e in doc["traceEvents"] if e.get("ph") == "i" and e["name"] == name]


def _steps(doc):
    """The step spans, by number (each number once; not the zero-length mark of the step
    after the window)."""
    marks = [e for e in _spans(doc, cat="user_annotation")
             if e["name"].startswith("ProfilerStep#")
             and not (e["dur"] == 0 and e["args"].get("partial"))]
    numbers = [int(e["name"].split("#")[1]) for e in marks]
    assert len(numbers) == len(set(numbers)), sorted(numbers)
    return dict(zip(numbers, marks))


def _inside(event, outer):
    return (outer["ts"] - _SLACK <= event["ts"]
            and event["ts"] + event.get("dur", 0) <= outer["ts"] + outer["dur"] + _SLACK)


def _in_step(events, step):
    return [e for e in events if _inside(e, step)]


def _strategy(world):
    return ms.MultiWorkerMirroredStrategy(comm=world, local_replicas=G)


def _dataset(strategy, batches):
    n = strategy.num_replicas_in_sync
    data = ms.Dataset.from_tensor_slices(np.arange(batches * 2 * n, dtype=np.float32))
    options = Options()
    options.experimental_distribute.auto_shard_policy = ms.AutoShardPolicy.DATA
    return strategy.experimental_distribute_dataset(data.batch(2 * n).with_options(options))


def double(x):
    return np.asarray(x) * 2.0


@pytest.mark.timeout(60)
def test_a_strategy_loop_has_a_step_per_batch_with_its_input_wait_replicas_and_a_save(
        world, root):
    strategy = _strategy(world)
    dist = _dataset(strategy, BATCHES)
    path = trace.start(os.path.join(root, "traces"), "0:100")
    for batch in dist:
        total = strategy.reduce("sum", strategy.run(double, args=(batch,)), axis=0)
        assert np.isfinite(total)
    manager = CheckpointManager(Checkpoint(step=Scalar(3), weights=np.ones(64)),
                                os.path.join(root, "ckpt"))
    saved = manager.save()
    assert trace.stop() == path
    doc = _load(path)

    steps = _steps(doc)
    # step 0 before the first batch, one per batch, one from the wait that found the end
    assert sorted(steps) == list(range(BATCHES + 2))
    waits = _spans(doc, "input wait", "input")
    runs = _spans(doc, "strategy.run", "user_annotation")
    replicas = _spans(doc, "replica double", "user_annotation")
    assert len(waits) == BATCHES + 1 and len(runs) == BATCHES
    assert len(replicas) == G * BATCHES
    mine = list(range(world.rank * G, (world.rank + 1) * G))
    for number in range(1, BATCHES + 1):
        step = steps[number]
        (wait,) = _in_step(waits, step)
        (run,) = _in_step(runs, step)
        assert wait["args"] == {"batch": number - 1}
        assert wait["ts"] <= run["ts"]  # the step starts with its wait
        assert wait["tid"] == step["tid"]  # on the training thread (the classification's)
        inner = _in_step(replicas, run)
        assert sorted(e["args"]["replica"] for e in inner) == mine
        assert run["args"] == {"fn": "double", "replicas": G}
    last = steps[BATCHES + 1]
    (end,) = _in_step(waits, last)
    assert end["args"] == {"batch": BATCHES, "end": True}
    (save,) = _spans(doc, "checkpoint save", "checkpoint")
    assert _inside(save, last)
    assert save["args"]["path"] == saved
    assert save["args"]["call"] == "CheckpointManager.save"
    # the chief (rank 0) wrote the arrays: the scalar and the 64 float64 weights
    assert save["args"].get("bytes") == (8 * 64 + np.asarray(3).nbytes
                                         if world.rank == 0 else None)
    # every step is classified (the writer's kernel events), the input as waiting
    kernels = [e for e in doc["traceEvents"] if e.get("cat") == "kernel"]
    assert {e["args"]["step"] for e in kernels} == set(range(BATCHES + 2))
    assert any(e["name"] == "input Sync" for e in kernels)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mark", ["trace", "elastic"])
def test_a_plain_loop_marks_its_own_steps_over_the_strategys(world, root, mark):
    strategy = _strategy(world)
    step = ms.trace.step if mark == "trace" else ms.elastic.step
    path = trace.start(os.path.join(root, "traces"))
    strategy.run(double, args=(np.ones(3),))  # a warm-up: the strategy's step 1
    for _ in range(4):
        step()
        strategy.run(double, args=(np.ones(3),))
        strategy.run(double, args=(np.ones(3),))  # (two runs, one step)
    trace.stop()
    doc = _load(path)
    steps = _steps(doc)
    assert sorted(steps) == list(range(6))
    runs = _spans(doc, "strategy.run")
    assert len(_in_step(runs, steps[1])) == 1
    for number in range(2, 6):
        assert len(_in_step(runs, steps[number])) == 2


@pytest.mark.timeout(60)
def test_steps_outside_the_window_leave_nothing(world, root):
    strategy = _strategy(world)
    dist = _dataset(strategy, 6)
    path = trace.start(os.path.join(root, "traces"), "2:4")
    for batch in dist:
        strategy.run(double, args=(batch,))
    trace.stop()
    doc = _load(path)
    assert sorted(_steps(doc)) == [2, 3]
    waits = _spans(doc, "input wait")
    assert sorted(e["args"]["batch"] for e in waits) == [1, 2]  # steps 2, 3: batches 1, 2
    assert len(_spans(doc, "strategy.run")) == 2
    assert len(_spans(doc, "replica double")) == 2 * G
    kernels = [e for e in doc["traceEvents"] if e.get("cat") == "kernel"]
    assert {e["args"]["step"] for e in kernels} == {2, 3}


def add_one(variable):
    variable.assign_add(np.ones(2))
    return 1


@pytest.mark.timeout(90)
def test_a_parameter_server_job_traces_its_closures_on_the_workers(world, root):
    if world.size < 3:
        pytest.skip("a parameter-server job needs a coordinator, a ps and a worker")
    from mpistrat.ps.strategy import shutdown_all

    path = trace.start(os.path.join(root, "traces"))
    closures = 6
    try:
        strategy = ms.ParameterServerStrategy(num_ps=1, comm=world)
    except SystemExit as exc:  # a worker or the ps: served until the coordinator ended
        assert exc.code == 0
        strategy = None
    if strategy is not None:
        try:
            coordinator = ms.ClusterCoordinator(strategy)
            with strategy.scope():
                v = ms.Variable(np.zeros(2))
            values = [coordinator.schedule(add_one, args=(v,)) for _ in range(closures)]
            coordinator.join()
            assert [value.fetch() for value in values] == [1] * closures
            assert v.numpy().tolist() == [closures, closures]
        finally:
            assert shutdown_all()
    trace.stop()
    doc = _load(path)
    ran = _spans(doc, "closure add_one", "ps")
    everyone = world.allgather(sorted(e["args"]["id"] for e in ran))
    assert sorted(i for ids in everyone for i in ids) == list(range(closures))
    workers = list(range(2, world.size))  # ranks 0: coordinator, 1: ps
    if world.rank in workers:
        for event in ran:
            assert event["args"]["rank"] == world.rank
            assert event["args"]["worker"] == world.rank - 2
            assert event["args"]["outcome"] == "ok"
        steps = _steps(doc)
        for event in ran:  # a worker's steps are its closures: one in each
            (step,) = [s for s in steps.values() if _inside(event, s)]
            assert len(_in_step(ran, step)) == 1
            assert step["ts"] > steps[0]["ts"]  # (step 0: the setup)
            # (the step begins with the wait for the closure, on the worker's thread)
            (wait,) = [w for w in _in_step(_spans(doc, "closure wait", "input"), step)]
            assert wait["args"] == {"id": event["args"]["id"]}
            assert wait["ts"] + wait["dur"] <= event["ts"] + _SLACK
    else:
        assert ran == []
    if world.rank == 0:
        scheduled = _instants(doc, "closure scheduled")
        assert [e["args"] for e in scheduled] == [{"id": i, "fn": "add_one"}
                                                  for i in range(closures)]
        done = _instants(doc, "closure done")
        assert sorted(e["args"]["id"] for e in done) == list(range(closures))
        assert {e["args"]["worker"] for e in done} <= {r - 2 for r in workers}
        assert all(e["args"]["outcome"] == "ok" for e in done)
        assert len(_spans(doc, "join", "ps")) == 1
        assert sorted(e["args"]["id"] for e in _spans(doc, "fetch", "ps")) == \
            list(range(closures))


@pytest.mark.timeout(30)
def test_a_stall_report_is_a_failure_instant_naming_the_late_rank(world, root, reports):
    if world.size == 1:
        pytest.skip("one rank cannot stall")
    path = trace.start(os.path.join(root, "traces"))
    late = world.size - 1
    if world.rank == late:
        time.sleep(0.8)  # past the 0.3 s stall check of the reports fixture
    agree(world, "same call", None, "test_collective")
    trace.stop()
    doc = _load(path)
    stalls = _instants(doc, "stall")
    assert [e["cat"] for e in stalls] == ["failure"] * len(stalls)
    assert len(stalls) == len(reports)  # every report printed is in the trace
    if world.rank == 0:  # the monitor that waited reports
        assert stalls, "rank 0 reported no stall"
        args = stalls[0]["args"]
        assert args["ranks"] == [late]
        assert args["collective"] == "test_collective"
        assert args["report"] == reports[0]
        assert f"rank(s) [{late}] have not arrived" in args["report"]
    else:
        assert stalls == []


@pytest.mark.timeout(60)
def test_snapshots_and_restores_are_checkpoint_spans(world, root):
    import uuid

    from mpistrat.checkpoint import snapshot as snapshot_module
    from mpistrat.elastic.env import ElasticEnv

    strategy = _strategy(world)
    n = snapshot_module.BACKGROUND_BYTES // 4 + 1024  # (copied in the background)
    with strategy.scope():
        big = ms.Variable(np.zeros(n, np.float32))
    checkpoint = Checkpoint(comm=world, big=big, step=Scalar(1))
    job = world.bcast(uuid.uuid4().hex if world.rank == 0 else None)
    store = snapshot_module.SnapshotStore(checkpoint, ElasticEnv(job, 0, (world.size,)),
                                          b"the job's secret, 32 bytes long!", comm=world,
                                          root=root)
    path = trace.start(os.path.join(root, "traces"))
    try:
        store.take(("X/4", 1))
        big.assign(np.ones(n, np.float32))  # (waits for the copy, if it still runs)
        info = store.restore()
        saved = checkpoint.write(os.path.join(root, "ckpt", "one"))
        checkpoint.restore(saved)
    finally:
        trace.stop()
        store.close(remove=True)
    assert info is not None and info.sequence == 1
    doc = _load(path)
    (taken,) = _spans(doc, "snapshot", "checkpoint")
    assert taken["args"]["sequence"] == 1
    assert taken["args"]["writer"] == store.writer  # (rank 0: the one host's writer)
    assert (taken["args"]["bytes"] >= 4 * n) == store.writer
    assert taken["args"]["background"] == store.writer
    copies = _spans(doc, "snapshot copy", "checkpoint")
    commits = _spans(doc, "snapshot commit", "checkpoint")
    if store.writer:  # on the snapshot's own thread, after take() began
        (copy,) = copies
        (commit,) = commits
        assert copy["args"] == {"sequence": 1, "bytes": 4 * n}
        assert copy["tid"] != taken["tid"] and commit["tid"] == copy["tid"]
        assert copy["ts"] >= taken["ts"] and commit["ts"] >= copy["ts"] + copy["dur"]
    else:
        assert copies == [] and commits == []
    (restored,) = _spans(doc, "snapshot restore", "checkpoint")
    assert restored["args"] == {"sequence": 1, "skipped": 0}
    (written,) = _spans(doc, "checkpoint save", "checkpoint")
    assert written["args"]["path"] == saved and written["args"]["call"] == "Checkpoint.write"
    (read,) = _spans(doc, "checkpoint restore", "checkpoint")
    assert read["args"] == {"path": saved}
    assert read["ts"] >= written["ts"] + written["dur"]
