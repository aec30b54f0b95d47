"""What the collectives put into a trace, at 1-4 ranks and on any communicator: each call
of ``mpistrat.all_reduce`` (unplanned, and its cached small and large plans), of a
``CrossDeviceOps``' ``reduce`` / ``batch_reduce`` (packed, and small in the exchange) /
``broadcast``, and of a hierarchical spec over two virtual nodes is exactly one
``cpu_op`` span with Kineto's collective args, holding one ``agreement`` phase of the
same ``seq`` and its other phases; ``seq`` counts up identically on every rank; a
pipelined hierarchical call records each stage once; a failed call leaves the next one
traced as usual; nothing is recorded, nor counted, while tracing is off. Every file is
read back with ``json.load``."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from _trace import inside, traced

import mpistrat as ms
from mpistrat import CollectiveMismatchError, trace
from mpistrat.algorithms.hierarchical import PIPELINE_BYTES
from mpistrat.runtime import recorder
from mpistrat.runtime._commcache import comm_cache
from mpistrat.runtime.agreement import DOORS
from mpistrat.runtime.topology import get_topology

MPI = pytest.importorskip("mpi4py.MPI")

KINETO = ("Collective name", "dtype", "In msg nelems", "Out msg nelems", "Group size")
MPISTRAT = ("algorithm", "bytes", "seq", "algbw (GB/s)", "busbw (GB/s)")
LARGE = 1 << 14  # float32 elements: 64 KiB, above the exchange's 4 KiB


def _collectives(events):
    ops = sorted((e for e in events if e["cat"] == "cpu_op"), key=lambda e: e["ts"])
    for op in ops:
        op["inner"] = [e for e in events if e is not op and e["tid"] == op["tid"]
                       and e["cat"] == "mpistrat_phase" and inside(e, op)]
    return ops


def _check_args(op, collective, size, dtype, nelems, nbytes):
    args = op["args"]
    missing = [key for key in KINETO + MPISTRAT if key not in args]
    assert not missing, (op["name"], missing)
    assert (args["Collective name"], args["Group size"], args["dtype"],
            args["In msg nelems"], args["Out msg nelems"], args["bytes"]) == \
        (collective, size, dtype, nelems, nelems, nbytes), (op["name"], args)
    assert args["algorithm"] and isinstance(args["seq"], int) and args["seq"] > 0
    # algbw: the bytes over the span's duration less its agreements' waiting (a data-
    # carrying exchange is the data's movement), all rounded; busbw: nccl-tests' factor
    waited = sum(e["dur"] for e in op["inner"] if e["name"] == "agreement"
                 and not e["args"].get("carries_data"))
    duration_ns = max((op["dur"] - waited) * 1000, 1)
    assert math.isclose(args["algbw (GB/s)"], nbytes / duration_ns, rel_tol=0.05,
                        abs_tol=2e-3), args
    factor = 2 * (size - 1) / size if "allreduce" in collective else 1.0 if size > 1 else 0
    assert math.isclose(args["busbw (GB/s)"], args["algbw (GB/s)"] * factor, rel_tol=1e-3,
                        abs_tol=2e-4), args


def _agreement(op):
    """The one agreement inside a collective (with the collective's seq)."""
    found = [e for e in op["inner"] if e["name"] == "agreement"]
    assert len(found) == 1, (op["name"], [e["name"] for e in op["inner"]])
    assert found[0]["args"]["seq"] == op["args"]["seq"]
    return found[0]


def _phases(op):
    return [e["name"] for e in sorted(op["inner"], key=lambda e: e["ts"])]


def _same_everywhere(comm, value):
    values = comm.allgather(value)
    assert all(v == values[0] for v in values), values


@pytest.mark.timeout(60)
def test_every_collective_is_one_cpu_op_holding_its_agreement_and_phases(comm, root):
    world = MPI.COMM_WORLD
    n = comm.size
    small = np.arange(8, dtype=np.float32)
    large = np.ones(LARGE, dtype=np.float32)
    batch = [np.ones(3000, np.float32), np.ones(200, np.float32), np.ones(1000, np.float32)]
    cdo = ms.MultiWorkerAllReduce(all_reduce_spec="xring", num_packs=1, comm=comm)

    def calls():
        for _ in range(2):  # (the second time: the cached plans)
            ms.all_reduce(small, comm=comm)
            ms.all_reduce(large, "mean", comm=comm)
        ms.all_reduce(batch, "sum", "xring", comm=comm)
        cdo.batch_reduce("sum", [(a, a) for a in batch])  # packed: one pack
        cdo.batch_reduce("sum", [(small, small), (small[:3], small[:3])])  # in the exchange
        cdo.reduce("mean", large, large)
        cdo.broadcast(small, small)

    ops = _collectives(traced(root, world, calls))
    names = [op["name"] for op in ops]
    assert names == ["all_reduce"] * 5 + ["MultiWorkerAllReduce.batch_reduce"] * 2 + \
        ["MultiWorkerAllReduce.reduce", "MultiWorkerAllReduce.broadcast"], names
    for op in ops:
        _agreement(op)
        assert len(op["inner"]) <= 8, (op["name"], _phases(op))
    small_1, large_1, small_2, large_2, batched, packed, fused, reduced, broadcast = ops
    for op in (small_1, small_2):
        _check_args(op, "allreduce", n, "float32", 8, 32)
    # the cached small plan: its data rode in the exchange, the agreement was the call
    assert _agreement(small_2)["args"].get("carries_data") is True
    assert small_2["args"]["algorithm"] == "exchange" and _phases(small_2) == ["agreement"]
    for op in (large_1, large_2):
        _check_args(op, "allreduce", n, "float32", LARGE, 4 * LARGE)
        want = ["agreement", "algorithm", "mean"] if n > 1 else \
            ["agreement", "local combine", "mean"]
        assert _phases(op) == want, _phases(op)
        assert op["args"]["algorithm"] == ("xring" if n > 1 else "local")
        assert "carries_data" not in _agreement(op)["args"]
    _check_args(batched, "allreduce", n, "float32", 4200, 4 * 4200)
    assert batched["args"]["tensors"] == 3
    assert {"agreement", "pack", "copy-back"} <= set(_phases(batched)), _phases(batched)
    _check_args(packed, "allreduce_coalesced", n, "float32", 4200, 4 * 4200)
    if n > 1:  # (one rank: TF's shortcut, no arithmetic)
        assert _phases(packed) == ["agreement", "pack", "algorithm", "copy-back"], \
            _phases(packed)
        assert packed["args"]["algorithm"] == "xring"
    else:
        assert _phases(packed) == ["agreement"] and packed["args"]["algorithm"] == "local"
    if 1 < n:  # small values: reduced inside their agreement
        _check_args(fused, "allreduce_coalesced", n, "float32", 11, 44)
        assert fused["args"]["algorithm"] in ("exchange", "allgather")
    _check_args(reduced, "allreduce", n, "float32", LARGE, 4 * LARGE)
    _check_args(broadcast, "broadcast", n, "float32", 8, 32)
    assert broadcast["args"]["algorithm"] == "MPI_Bcast"
    # one numbering per communicator, counting up, the same on every rank
    seqs = [op["args"]["seq"] for op in ops]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), seqs
    _same_everywhere(comm, [(op["name"], op["args"]["seq"]) for op in ops])


@pytest.mark.timeout(60)
def test_a_hierarchical_spec_over_two_virtual_nodes_records_its_stages(world, root):
    n = world.size
    rpn = max(1, (n + 1) // 2)  # two nodes from 2 ranks on (1: one node, one stage)
    topology = get_topology(world, rpn)
    value = np.ones(LARGE, dtype=np.float64)

    def calls():
        ms.all_reduce(value, "sum", "pscpu/pscpu", world, ranks_per_node=rpn)

    (op,) = _collectives(traced(root, world, calls))
    _check_args(op, "allreduce", n, "float64", LARGE, 8 * LARGE)
    _agreement(op)
    assert op["args"]["algorithm"] == ("pscpu/pscpu" if n > 1 else "local")
    stages = [e for e in op["inner"] if e["name"] in ("node stage", "cross-node stage")]
    want = []
    if topology.num_nodes > 1:
        if topology.local_size > 1:
            want.append(("node stage", "reduce"))
        if topology.is_leader:
            want.append(("cross-node stage", None))
        if topology.local_size > 1:
            want.append(("node stage", "broadcast"))
    elif n > 1:
        want.append(("node stage", "all_reduce"))
    got = [(e["name"], e["args"].get("step")) for e in sorted(stages, key=lambda e: e["ts"])]
    assert got == want, (got, topology.num_nodes, topology.local_size)
    (algorithm,) = [e for e in op["inner"] if e["name"] == "algorithm"] if n > 1 else [op]
    for stage in stages:  # (the stages are the algorithm's)
        assert inside(stage, algorithm)


@pytest.mark.timeout(60)
def test_a_pipelined_hierarchical_call_records_each_stage_once(world, root):
    """Two virtual nodes with two ranks on one of them: the buffer of two pieces is
    pipelined, each stage in its own thread, recorded once over its pieces."""
    if world.size < 3:
        pytest.skip("pipelining needs a node of two ranks and a second node")
    value = np.ones(2 * PIPELINE_BYTES // 8, dtype=np.float64)
    topology = get_topology(world, 2)

    def calls():
        ms.all_reduce(value, "sum", "pscpu/pscpu", world, ranks_per_node=2)

    events = traced(root, world, calls)
    (op,) = _collectives(events)
    _agreement(op)
    stages = [e for e in events if e["name"] in ("node stage", "cross-node stage")]
    assert all(inside(e, op) for e in stages)
    assert all(e["args"]["pieces"] == 2 for e in stages), stages
    want = ["node stage"] * (2 if topology.local_size > 1 else 0)
    if topology.local_rank < min(len(r) for r in topology.node_ranks):
        want.append("cross-node stage")
    assert sorted(e["name"] for e in stages) == sorted(want)
    assert len({e["tid"] for e in stages}) == len(stages)  # (one thread per stage)


@pytest.mark.timeout(60)
def test_after_a_failed_collective_the_next_is_traced_as_usual(comm, root):
    shape = 4 + (comm.rank == comm.size - 1 and comm.size > 1)

    def calls():
        if comm.size > 1:
            with pytest.raises(CollectiveMismatchError):
                ms.all_reduce(np.ones(shape, np.float32), comm=comm)
        ms.all_reduce(np.ones(4, np.float32), comm=comm)

    ops = _collectives(traced(root, MPI.COMM_WORLD, calls))
    assert [op["cat"] for op in ops] == ["cpu_op"] * len(ops)
    assert len(ops) == (2 if comm.size > 1 else 1)
    _check_args(ops[-1], "allreduce", comm.size, "float32", 4, 16)
    assert DOORS.depth == 0 and not DOORS.direct and not DOORS.quiet
    _same_everywhere(comm, [op["args"]["seq"] for op in ops])


@pytest.mark.timeout(60)
def test_nothing_is_recorded_or_counted_while_tracing_is_off(comm, root):
    world = MPI.COMM_WORLD
    value, large = np.ones(8, np.float32), np.ones(LARGE, np.float32)
    cdo = ms.MultiWorkerAllReduce(all_reduce_spec="xring", comm=comm)

    def calls():
        for _ in range(2):
            ms.all_reduce(value, comm=comm)
            ms.all_reduce(large, "mean", comm=comm)
            cdo.batch_reduce("sum", [(large, large), (value, value)])
            cdo.broadcast(value, value)

    counted = comm_cache(comm).get("trace seq")
    # a trace whose window has not begun: a recorder, but nothing on
    path = trace.start(root, "3:4", comm=world)
    try:
        assert recorder.current() is not None and not recorder.on
        calls()
    finally:
        trace.stop()
    with open(path) as f:
        doc = json.load(f)
    kept = [e for e in doc["traceEvents"] if e.get("cat") not in ("clock", None)
            and e.get("ph") != "M"]
    assert kept == [], kept[:5]
    # stopped: no recorder at all
    calls()
    assert recorder.current() is None and recorder.begin() == 0
    assert comm_cache(comm).get("trace seq") == counted  # (seq counts traced calls only)
    assert DOORS.depth == 0
