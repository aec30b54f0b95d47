"""CrossDeviceOps over MPI (``reduce``, ``batch_reduce``, ``broadcast``): TensorFlow's
reduction matrix on 1-4 ranks x G in {1, 2} CPU replicas, packing, ResNet-50-shaped
batches, TF's shortcut, timeouts, and errors raised on every rank instead of hangs.

Replica ``d`` of rank ``r`` holds small integers computed from ``(r, d)`` (and, in a
batch, the tensor's index), so every sum is exact in every dtype, float16 included;
a MEAN is compared with the float64 reference within 2 ulp. Tests that loop over
collectives record problems and assert after one final ``allgather`` of the results'
sha256 (``_checks.finish``): every rank must hold bitwise identical results, and a
failed check on one rank never leaves the others waiting in the next collective.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from _checks import digest, finish, problem, spy_algorithms

import mpistrat
from mpistrat import (
    AllReduceCrossDeviceOps,
    BackendUnavailable,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CommunicationOptions,
    DistributedValues,
    HierarchicalCopyAllReduce,
    Mirrored,
    MultiWorkerAllReduce,
    NcclAllReduce,
    PerReplica,
    ReductionToOneDevice,
    SpecError,
    TopologyError,
)
from mpistrat.bench.shapes import resnet50_gradient_shapes
from mpistrat.runtime.agreement import _ARRIVAL_TAG, exchange
from mpistrat.values import default_devices, parse_device

MPI = pytest.importorskip("mpi4py.MPI")

F16, F32, F64, I32 = (np.dtype(t) for t in (np.float16, np.float32, np.float64, np.int32))
DTYPES = (F32, F64, I32, F16)
TWO_ENTRY = "xring:1K:pscpu"  # tensors of <= 1024 bytes (one replica's) by xring, the rest pscpu


# --- inputs and references -------------------------------------------------------------


def component(rank: int, device: int, shape, dtype, salt: int = 0) -> np.ndarray:
    """The value of ``device`` on ``rank``: integers in [-4, 4] from (rank, device, salt)."""
    j = np.arange(math.prod(shape))
    k = (j * 5 + j // 9 + rank * 3 + device * 7 + salt * 11) % 9 - 4
    return k.astype(dtype).reshape(shape)


def per_replica(rank: int, replicas: int, shape, dtype, salt: int = 0) -> PerReplica:
    """A PerReplica of ``replicas`` components on /cpu:0 .. /cpu:G-1."""
    return PerReplica([component(rank, d, shape, dtype, salt) for d in range(replicas)],
                      default_devices(replicas))


def reference(op: str, size: int, replicas: int, shape, dtype, salt: int = 0):
    """(expected float64 values, tolerance, result dtype) over every rank and replica."""
    dtype = np.dtype(dtype)
    total = np.zeros(shape)
    for r in range(size):
        for d in range(replicas):
            total += component(r, d, shape, np.float64, salt)
    if op == "sum":
        return total, np.zeros(shape), dtype
    out = F64 if dtype.kind in "iu" else dtype  # MEAN of integers is float64
    mean = total / (size * replicas)
    return mean, 2 * float(np.finfo(out).eps) * np.abs(mean), out


def outcome(call: Callable[[], Any]):
    """Run ``call()``; return (result, None) or (None, exception)."""
    try:
        return call(), None
    except Exception as exc:  # noqa: BLE001 -- the caller checks it
        return None, exc


def canonical(destinations, value: PerReplica) -> list[str]:
    """The destination device names, canonical and sorted (what the result lives on)."""
    if destinations is value:
        return sorted(value.devices)
    if isinstance(destinations, str):
        destinations = [destinations]
    return sorted(str(parse_device(d)) for d in destinations)


def on_rank(devices, rank: int | None) -> list[str]:
    """Device names with this rank's task filled in (None: as they are), sorted: TF
    compares destinations as sets of devices, so ``/cpu:0`` on rank 0 is
    ``/job:worker/task:0/device:CPU:0``."""
    if rank is None:
        return sorted(devices)
    return sorted(str(parse_device(d).on(rank)) for d in devices)


def check_mirrored(label: str, out: Any, devices: list[str], ref, tol, dtype, inputs,
                   problems: list[str], digests: list[tuple[str, str]],
                   rank: int | None = None) -> None:
    """``out`` is a Mirrored on ``devices`` (with a single destination device, the array
    itself, as TF returns the tensor) whose every component is a fresh array equal to
    ``ref`` in ``dtype``, aliasing neither another component nor an input."""
    if len(set(on_rank(devices, rank))) == 1:
        if isinstance(out, DistributedValues):
            problems.append(f"{label}: got {type(out).__name__} {out!r}, expected the array "
                            f"itself (one destination device)")
            return
        names, values = [devices[0]], [out]
    else:
        if not isinstance(out, Mirrored):
            problems.append(f"{label}: got {type(out).__name__} {out!r}, expected a Mirrored")
            return
        if on_rank(out.devices, rank) != on_rank(devices, rank):
            problems.append(f"{label}: result on {list(out.devices)}, expected {devices}")
        names, values = list(out.devices), list(out.values)
    for i, result in enumerate(values):
        found = problem(result, ref, tol, dtype, f"{label} on {names[i]}")
        if found:
            problems.append(found)
            continue
        digests.append((f"{label} on {names[i]}", digest(result)))
        if any(np.shares_memory(result, a) for a in inputs):
            problems.append(f"{label}: the result on {names[i]} aliases an input")
        if any(np.shares_memory(result, other) for other in values[i + 1:]):
            problems.append(f"{label}: the results on several devices share memory")


def snapshot(values) -> list[bytes]:
    return [np.asarray(a).tobytes() for a in values]


# --- the cross-device ops under test ---------------------------------------------------


@dataclass(frozen=True)
class Op:
    """A cross-device op to build on a communicator."""

    id: str
    make: Callable[[Any], Any]
    hierarchical_copy: bool = False  # needs an even number of devices in all

    def __call__(self, comm):
        return self.make(comm)


def _last_rank_device(comm) -> str:
    return f"/job:worker/task:{comm.Get_size() - 1}/device:CPU:0"


OPS = [
    Op("ReductionToOneDevice", lambda c: ReductionToOneDevice(comm=c)),
    Op("ReductionToOneDevice@last-rank",
       lambda c: ReductionToOneDevice(reduce_to_device=_last_rank_device(c), comm=c)),
    Op("MWAR-default-pscpu/pscpu", lambda c: MultiWorkerAllReduce(comm=c)),
    Op("MWAR-pscpu/pscpu-packs1",
       lambda c: MultiWorkerAllReduce(all_reduce_spec="pscpu/pscpu", num_packs=1, comm=c)),
    Op(f"MWAR-{TWO_ENTRY}", lambda c: MultiWorkerAllReduce(all_reduce_spec=TWO_ENTRY, comm=c)),
    Op("MWAR-rechd-packs3",
       lambda c: MultiWorkerAllReduce(all_reduce_spec="rechd", num_packs=3, comm=c)),
    Op("MWAR-xring-smallgrads",
       lambda c: MultiWorkerAllReduce(all_reduce_spec="xring", agg_small_grads_max_bytes=256,
                                      agg_small_grads_max_group=4, comm=c)),
    Op("MWAR-native-workers",
       lambda c: MultiWorkerAllReduce(
           worker_devices=[f"/job:worker/task:{t}" for t in range(c.Get_size())],
           all_reduce_spec=[("native", 1, 64), ("xring", 1, -1)], comm=c)),
    Op("AllReduceCrossDeviceOps-hierarchical_copy",
       lambda c: AllReduceCrossDeviceOps("hierarchical_copy", num_packs=0, comm=c), True),
    Op("HierarchicalCopyAllReduce", lambda c: HierarchicalCopyAllReduce(comm=c), True),
    Op("HierarchicalCopyAllReduce-packs3",
       lambda c: HierarchicalCopyAllReduce(num_packs=3, comm=c), True),
]
OP_IDS = [o.id for o in OPS]
BY_ID = {o.id: o for o in OPS}


def destinations_for(value: PerReplica, replicas: int, size: int) -> dict[str, Any]:
    """Every kind of destination: the value itself, one device string, a list of device
    strings (the value's devices, reversed and spelled differently), a device no
    component lives on, and task-qualified devices (on rank 0 and on the last rank)."""
    spelled = ["/device:CPU:1", "CPU:0"][2 - replicas:]
    kinds = {"value": value, "'/cpu:0'": "/cpu:0", "list": spelled,
             "other-device": ["/cpu:0", "/device:CPU:3"]}
    if replicas > 1 or size == 1:
        # (G = 1 on several ranks: see test_task_qualified_destination_one_replica_per_rank)
        kinds["task-qualified"] = "/job:worker/task:0/device:CPU:0"
        kinds["task-qualified-last"] = [f"/job:worker/task:{size - 1}/device:CPU:0",
                                        "/job:worker/replica:0/task:0/device:CPU:1"]
    return kinds


def expectation(op: Op, comm, replicas: int, devices: list[str], shortcut: bool = True) -> str:
    """'shortcut' (TF returns the component itself), 'topology' (hierarchical copy over
    an odd number of devices) or 'reduce'."""
    rank = comm.Get_rank()  # a device without a task is this rank's
    matches = {parse_device(d).on(rank) for d in devices} == \
        {parse_device(d).on(rank) for d in default_devices(replicas)}
    if shortcut and comm.Get_size() == 1 and replicas == 1 and matches:
        return "shortcut"
    if op.hierarchical_copy and matches and (comm.Get_size() * replicas) % 2:
        return "topology"
    return "reduce"


def check_call(label: str, kind: str, out, exc, value: PerReplica, devices: list[str], ref, tol,
               dtype, problems, digests, rank: int | None = None) -> None:
    """Check one reduce result against its expectation ``kind``."""
    if kind == "topology":
        if not isinstance(exc, TopologyError) or "even number of devices" not in str(exc):
            problems.append(f"{label}: expected TopologyError (odd device count), got "
                            f"{exc!r} / {out!r}")
        return
    if exc is not None:
        problems.append(f"{label}: raised {exc!r}")
        return
    if kind == "shortcut":
        if out is not value.values[0]:
            problems.append(f"{label}: TF's shortcut returns the component itself, got {out!r}")
        return
    check_mirrored(label, out, devices, ref, tol, dtype, value.values, problems, digests, rank)


# --- the reduction matrix --------------------------------------------------------------


@pytest.mark.parametrize("op", OPS, ids=OP_IDS)
def test_reduce_matrix(world, op):
    """Every destination kind x G in {1, 2} x SUM/MEAN x four dtypes: values, dtype (MEAN of
    int32 is float64, SUM keeps it), the destination devices, fresh non-aliased results,
    untouched inputs, bitwise identical on every rank; hierarchical copy over an odd
    number of devices raises TopologyError on every rank; TF's shortcut on one rank."""
    n = world.Get_size()
    ops = op(world)
    problems: list[str] = []
    digests: list[tuple[str, str]] = []
    for replicas in (1, 2):
        for index, dtype in enumerate(DTYPES):
            # small tensors and ones above TWO_ENTRY's 1 KiB limit, in turn
            shape = (2, n + 1) if index % 2 else (16, 20)
            value = per_replica(world.Get_rank(), replicas, shape, dtype)
            before = snapshot(value.values)
            for kind_name, dest in destinations_for(value, replicas, n).items():
                devices = canonical(dest, value)
                kind = expectation(op, world, replicas, devices)
                for reduce_op in ("sum", "mean"):
                    label = f"{op.id} G={replicas} {dtype} {reduce_op} to {kind_name}"
                    out, exc = outcome(lambda: ops.reduce(reduce_op, value, dest))  # noqa: B023
                    ref, tol, out_dtype = reference(reduce_op, n, replicas, shape, dtype)
                    check_call(label, kind, out, exc, value, devices, ref, tol, out_dtype,
                               problems, digests, world.Get_rank())
            if snapshot(value.values) != before:
                problems.append(f"{op.id} G={replicas} {dtype}: an input was modified")
    finish(world, problems, digests)


@pytest.mark.parametrize("task", ["first", "last"])
def test_task_qualified_destination_one_replica_per_rank(world, task):
    """G = 1, destination ``/job:worker/task:T/device:CPU:0``: the reduction lands on that
    device, on every rank (TF: reduce to one device, then broadcast)."""
    n, rank = world.Get_size(), world.Get_rank()
    t = 0 if task == "first" else n - 1
    dest = f"/job:worker/task:{t}/device:CPU:0"
    problems: list[str] = []
    digests: list[tuple[str, str]] = []
    for op_id in ("ReductionToOneDevice", f"MWAR-{TWO_ENTRY}", "HierarchicalCopyAllReduce"):
        ops = BY_ID[op_id](world)
        value = per_replica(rank, 1, (3,), I32)
        for reduce_op in ("sum", "mean"):
            label = f"{op_id} {reduce_op} to {dest}"
            out, exc = outcome(lambda: ops.reduce(reduce_op, value, dest))  # noqa: B023
            ref, tol, out_dtype = reference(reduce_op, n, 1, (3,), I32)
            kind = "shortcut" if n == 1 else "reduce"
            check_call(label, kind, out, exc, value, [dest], ref, tol, out_dtype, problems,
                       digests, rank)
    finish(world, problems, digests)


def test_batch_reduce_on_every_communicator(comm):
    """batch_reduce on COMM_WORLD, a Dup and a Split half: one all-reduce of two values
    whose destinations are their devices, and a batch whose destinations differ (each
    pair reduced on its own), for reduce-to-one, a two-entry spec and hierarchical copy."""
    n, rank = comm.Get_size(), comm.Get_rank()
    problems: list[str] = []
    digests: list[tuple[str, str]] = []
    for op_id in ("ReductionToOneDevice", f"MWAR-{TWO_ENTRY}", "HierarchicalCopyAllReduce"):
        op = BY_ID[op_id]
        ops = op(comm)
        for replicas in (1, 2):
            shapes = [((300,), F32), ((2, 3), I32)]
            values = [per_replica(rank, replicas, s, t, salt=i) for i, (s, t) in enumerate(shapes)]
            batches = {"matching": [(v, v) for v in values],
                       "mixed": [(values[0], values[0]), (values[1], "/device:CPU:2")]}
            for batch_name, pairs in batches.items():
                for reduce_op in ("sum", "mean"):
                    label = f"{op_id} G={replicas} {batch_name} {reduce_op}"
                    out, exc = outcome(lambda: ops.batch_reduce(reduce_op, pairs))  # noqa: B023
                    # (TF's shortcut only when every pair's destinations are its devices)
                    kinds = [expectation(op, comm, replicas, canonical(d, v),
                                         shortcut=batch_name == "matching") for v, d in pairs]
                    if "topology" in kinds:
                        check_call(label, "topology", out, exc, values[0], [], None, None,
                                   None, problems, digests)
                        continue
                    if exc is not None or not isinstance(out, list) or len(out) != len(pairs):
                        problems.append(f"{label}: expected a list of {len(pairs)} Mirrored, "
                                        f"got {out!r} / {exc!r}")
                        continue
                    for i, ((value, dest), result) in enumerate(zip(pairs, out)):
                        ref, tol, out_dtype = reference(reduce_op, n, replicas, *shapes[i],
                                                        salt=i)
                        check_call(f"{label} pair {i}", kinds[i], result, None, value,
                                   canonical(dest, value), ref, tol, out_dtype, problems,
                                   digests, rank)
    finish(comm, problems, digests)


def test_shortcut_on_one_process_returns_the_component_itself(world):
    """On a communicator of one rank (COMM_SELF, on every rank of the job) a value with one
    component whose device is the destination comes back unchanged, for SUM and MEAN
    (MEAN of one int32 value stays int32), from reduce and batch_reduce, for every op;
    another destination device, or a second component, does the arithmetic."""
    self_comm = MPI.COMM_SELF
    problems: list[str] = []
    for op in OPS:
        ops = op(self_comm)
        value = PerReplica([np.arange(4, dtype=np.int32) + world.Get_rank()])
        for dest in (value, "/cpu:0", ["CPU:0"], "/device:CPU:0",
                     "/job:worker/replica:0/task:0/device:CPU:0"):
            for reduce_op in ("sum", "mean"):
                where = dest if isinstance(dest, (str, list)) else "value"
                label = f"{op.id} {reduce_op} to {where}"
                out = ops.reduce(reduce_op, value, dest)
                if out is not value.values[0]:
                    problems.append(f"{label}: expected the component itself, got {out!r}")
                batch = ops.batch_reduce(reduce_op, [(value, dest), (value, value)])
                if len(batch) != 2 or any(b is not value.values[0] for b in batch):
                    problems.append(f"{label}: batch_reduce shortcut gave {batch!r}")
        # no shortcut: another device (reduce-to-one there), or two components
        out = ops.reduce("mean", value, "/cpu:1")
        if isinstance(out, Mirrored) or out is value.values[0] or \
                out.dtype != F64 or not np.array_equal(out, value.values[0]):
            problems.append(f"{op.id} mean to /cpu:1: expected a float64 copy, got {out!r}")
        two = per_replica(0, 2, (3,), F32)
        out, exc = outcome(lambda: ops.reduce("sum", two, two))  # noqa: B023
        if exc is not None or any(v is two.values[0] for v in out.values) or \
                not np.array_equal(out.values[0], two.values[0] + two.values[1]):
            problems.append(f"{op.id} sum of two components: got {out!r} / {exc!r}")
    finish(world, problems, [])


PLAIN = {
    # a value that is not a DistributedValues, on rank r: (make(r), its dtype)
    "ndarray": (lambda r: component(r, 0, (2, 3), I32), I32),
    "numpy scalar": (lambda r: np.float32(r - 1), F32),
    "python int": (lambda r: r + 1, np.asarray(1).dtype),
}


def test_plain_arrays_and_scalars_are_one_component_on_cpu0(world):
    """A value that is not a DistributedValues is one component on /cpu:0 (TF's
    conversion): an ndarray, a NumPy scalar or a Python number, in batch_reduce; an array
    given as destinations means its device, /cpu:0 (TF takes a tensor's device)."""
    n, rank = world.Get_size(), world.Get_rank()
    problems: list[str] = []
    digests: list[tuple[str, str]] = []
    for op_id in ("ReductionToOneDevice", f"MWAR-{TWO_ENTRY}", "HierarchicalCopyAllReduce"):
        op = BY_ID[op_id]
        ops = op(world)
        kind = expectation(op, world, 1, ["/cpu:0"])
        for label, (make, dtype) in PLAIN.items():
            value = make(rank)
            total = sum(np.asarray(make(r), np.float64) for r in range(n))
            for reduce_op in ("sum", "mean"):
                name = f"{op_id} {label} {reduce_op}"
                pairs = [(value, "/cpu:0"), (value, ["CPU:0"])]
                if label != "python int":
                    pairs.append((value, value))
                out, exc = outcome(lambda: ops.batch_reduce(reduce_op, pairs))  # noqa: B023
                if kind == "topology":
                    check_call(name, kind, out, exc, None, [], None, None, None, problems,
                               digests)
                    continue
                if exc is not None or len(out) != len(pairs):
                    problems.append(f"{name}: got {out!r} / {exc!r}")
                    continue
                for result in out:
                    if kind == "shortcut":  # the component itself (a scalar: as a 0-d array)
                        got = result
                        if (got is not value) if label == "ndarray" else (
                                got.dtype != dtype or got != value):
                            problems.append(f"{name}: the shortcut gave {result!r}")
                        continue
                    want, tol = total, np.zeros(total.shape)
                    out_dtype = dtype
                    if reduce_op == "mean":
                        out_dtype = F64 if dtype.kind in "iu" else dtype
                        want = total / n
                        tol = 2 * float(np.finfo(out_dtype).eps) * np.abs(want)
                    check_mirrored(name, result, ["/cpu:0"], want, tol, out_dtype, [value],
                                   problems, digests)
    finish(world, problems, digests)


@pytest.mark.parametrize("ranks_per_node", [1, 2])
def test_hierarchical_spec_across_virtual_nodes(world, ranks_per_node, monkeypatch):
    """MultiWorkerAllReduce's default spec ('pscpu/pscpu', 2, -1) with several (virtual)
    nodes, so its cross-node stage runs; shards above the nodes raise TopologyError on
    every rank."""
    monkeypatch.setenv("MPISTRAT_RANKS_PER_NODE", str(ranks_per_node))
    n, rank = world.Get_size(), world.Get_rank()
    nodes = -(-n // ranks_per_node)
    problems: list[str] = []
    digests: list[tuple[str, str]] = []
    value = per_replica(rank, 2, (5, n + 2), F32)
    for spec in (("pscpu/pscpu", 2, -1), ("pscpu/pscpu", nodes + 1)):
        ops = MultiWorkerAllReduce(all_reduce_spec=spec, comm=world)
        for reduce_op in ("sum", "mean"):
            label = f"{spec} over {nodes} node(s) {reduce_op}"
            out, exc = outcome(lambda: ops.reduce(reduce_op, value, value))  # noqa: B023
            if nodes > 1 and spec[1] > nodes:
                if not isinstance(exc, TopologyError):
                    problems.append(f"{label}: expected TopologyError, got {exc!r}")
                continue
            ref, tol, dtype = reference(reduce_op, n, 2, (5, n + 2), F32)
            check_call(label, "reduce", out, exc, value, ["/cpu:0", "/cpu:1"], ref, tol, dtype,
                       problems, digests)
    finish(world, problems, digests)


# --- packing, mixed dtypes, order ------------------------------------------------------

# Interleaved small and large tensors of four dtypes: TWO_ENTRY routes each by its byte
# size (one replica's) to xring (<= 1024 bytes) or pscpu (the rest).
MIXED_BATCH = [
    ((3,), F32), ((40, 30), F64), ((2, 2), I32), ((600,), F16), ((17, 33), F32),
    ((300,), I32), ((1,), F64), ((2, 3, 4), F16), ((256,), F32), ((257,), F32),
    ((128,), F64), ((1, 129), F64), ((513,), F16), ((7, 1, 5), I32), ((), F32), ((5, 0), I32),
]


@dataclass(frozen=True)
class Packing:
    id: str
    make: Callable[[Any], Any]
    options: CommunicationOptions | None = None
    hierarchical_copy: bool = False
    algorithms: frozenset = field(default_factory=frozenset)  # algorithms the batch must use


BOTH = frozenset({"xring", "pscpu"})
PACKINGS = [
    Packing("no-packing", lambda c: MultiWorkerAllReduce(all_reduce_spec=TWO_ENTRY, comm=c),
            algorithms=BOTH),
    Packing("num_packs=1", lambda c: MultiWorkerAllReduce(all_reduce_spec=TWO_ENTRY,
                                                          num_packs=1, comm=c),
            algorithms=BOTH),
    Packing("num_packs=3", lambda c: MultiWorkerAllReduce(all_reduce_spec=TWO_ENTRY,
                                                          num_packs=3, comm=c),
            algorithms=BOTH),
    Packing("small-grads-64B/2",
            lambda c: MultiWorkerAllReduce(all_reduce_spec=TWO_ENTRY, comm=c,
                                           agg_small_grads_max_bytes=64,
                                           agg_small_grads_max_group=2),
            algorithms=BOTH),
    Packing("small-grads-4K/10-pscpu/pscpu",
            lambda c: MultiWorkerAllReduce(all_reduce_spec="pscpu/pscpu", comm=c,
                                           agg_small_grads_max_bytes=4096,
                                           agg_small_grads_max_group=10)),
    Packing("bytes_per_pack=512", lambda c: MultiWorkerAllReduce(all_reduce_spec=TWO_ENTRY,
                                                                 comm=c),
            CommunicationOptions(bytes_per_pack=512), algorithms=BOTH),
    Packing("bytes_per_pack=1-over-num_packs=3",
            lambda c: MultiWorkerAllReduce(all_reduce_spec=TWO_ENTRY, num_packs=3, comm=c),
            CommunicationOptions(bytes_per_pack=1), algorithms=BOTH),
    Packing("hierarchical_copy-num_packs=0",
            lambda c: AllReduceCrossDeviceOps("hierarchical_copy", num_packs=0, comm=c),
            hierarchical_copy=True),
    Packing("hierarchical_copy-num_packs=-1",  # TF: a negative value means no packing
            lambda c: AllReduceCrossDeviceOps("hierarchical_copy", num_packs=-1, comm=c),
            hierarchical_copy=True),
    Packing("HierarchicalCopy-num_packs=3", lambda c: HierarchicalCopyAllReduce(3, comm=c),
            hierarchical_copy=True),
    Packing("HierarchicalCopy-bytes_per_pack=2048",
            lambda c: HierarchicalCopyAllReduce(comm=c),
            CommunicationOptions(bytes_per_pack=2048), hierarchical_copy=True),
    Packing("ReductionToOneDevice", lambda c: ReductionToOneDevice(comm=c)),
]


@pytest.mark.parametrize("packing", PACKINGS, ids=[p.id for p in PACKINGS])
def test_batch_reduce_packing_mixed_dtypes_keeps_order(world, packing, monkeypatch):
    """A batch of interleaved small and large float32/float64/int32/float16 tensors, every
    packing setting: results in input order, each with its input's shape, its dtype
    (float64 for a MEAN of int32) and exact values; a two-entry spec runs both entries."""
    n, rank = world.Get_size(), world.Get_rank()
    seen = spy_algorithms(monkeypatch)
    ops = packing.make(world)
    problems: list[str] = []
    digests: list[tuple[str, str]] = []
    for replicas in (1, 2):
        values = [per_replica(rank, replicas, s, t, salt=i) for i, (s, t) in enumerate(MIXED_BATCH)]
        inputs = [a for v in values for a in v.values]
        before = snapshot(inputs)
        for reduce_op in ("sum", "mean"):
            label = f"{packing.id} G={replicas} {reduce_op}"
            seen.clear()
            out, exc = outcome(lambda: ops.batch_reduce(  # noqa: B023
                reduce_op, [(v, v) for v in values], options=packing.options))  # noqa: B023
            if packing.hierarchical_copy and (n * replicas) % 2 and not (n == 1 and replicas == 1):
                check_call(label, "topology", out, exc, values[0], [], None, None, None,
                           problems, digests)
                continue
            if exc is not None or not isinstance(out, list) or len(out) != len(values):
                problems.append(f"{label}: expected {len(values)} results, got {out!r} / {exc!r}")
                continue
            if n == 1 and replicas == 1:  # TF's shortcut: the components themselves
                if any(o is not v.values[0] for o, v in zip(out, values)):
                    problems.append(f"{label}: the shortcut did not return the components")
                continue
            for i, ((shape, dtype), result) in enumerate(zip(MIXED_BATCH, out)):
                ref, tol, out_dtype = reference(reduce_op, n, replicas, shape, dtype, salt=i)
                check_mirrored(f"{label} tensor {i} {shape} {dtype}", result,
                               sorted(default_devices(replicas)), ref, tol, out_dtype, inputs,
                               problems, digests)
            if n > 1 and packing.algorithms and set(seen) != packing.algorithms:
                problems.append(f"{label}: ran {sorted(set(seen))}, expected "
                                f"{sorted(packing.algorithms)}")
        if snapshot(inputs) != before:
            problems.append(f"{packing.id} G={replicas}: an input was modified")
    finish(world, problems, digests)


def _resnet_shapes() -> list[tuple[int, ...]]:
    """ResNet-50's 161 gradient shapes, every dimension >= 16 divided by 16 (the same
    ranks, order and mix of small and large tensors; ~0.1 M elements instead of 25.6 M)."""
    return [tuple(d if d < 16 else d // 16 for d in shape) for shape in resnet50_gradient_shapes()]


RESNET = [
    ("MWAR-two-entry", lambda c: MultiWorkerAllReduce(all_reduce_spec=TWO_ENTRY, comm=c), None,
     "sum"),
    ("MWAR-pscpu/pscpu-small-grads",
     lambda c: MultiWorkerAllReduce(all_reduce_spec="pscpu/pscpu", agg_small_grads_max_bytes=1024,
                                    agg_small_grads_max_group=16, comm=c), None, "mean"),
    ("MWAR-two-entry-packs2-bytes_per_pack",
     lambda c: MultiWorkerAllReduce(all_reduce_spec=TWO_ENTRY, num_packs=2, comm=c),
     CommunicationOptions(bytes_per_pack=32 * 1024), "sum"),
    ("HierarchicalCopy-packs8", lambda c: HierarchicalCopyAllReduce(8, comm=c), None, "sum"),
    ("ReductionToOneDevice", lambda c: ReductionToOneDevice(comm=c), None, "sum"),
]


@pytest.mark.parametrize(("make", "options", "reduce_op"), [r[1:] for r in RESNET],
                         ids=[r[0] for r in RESNET])
def test_resnet50_gradient_batch(world, make, options, reduce_op):
    """A batch of 161 float32 tensors shaped like ResNet-50's gradients (scaled down),
    G = 2: 161 results in input order with their shapes and exact values."""
    n, rank = world.Get_size(), world.Get_rank()
    shapes = _resnet_shapes()
    values = [per_replica(rank, 2, shape, F32, salt=i) for i, shape in enumerate(shapes)]
    out = make(world).batch_reduce(reduce_op, [(v, v) for v in values], options=options)
    problems: list[str] = []
    digests: list[tuple[str, str]] = []
    if len(out) != len(shapes):
        problems.append(f"{len(out)} results for {len(shapes)} tensors")
    inputs = [a for v in values for a in v.values]
    for i, (shape, result) in enumerate(zip(shapes, out)):
        ref, tol, dtype = reference(reduce_op, n, 2, shape, F32, salt=i)
        check_mirrored(f"tensor {i} {shape}", result, ["/cpu:0", "/cpu:1"], ref, tol, dtype,
                       inputs, problems, digests)
    finish(world, problems, digests[::7])


# --- in place and into given arrays --------------------------------------------------

IN_PLACE_OPS = ("ReductionToOneDevice", "MWAR-pscpu/pscpu-packs1", "MWAR-xring-smallgrads",
                f"MWAR-{TWO_ENTRY}", "HierarchicalCopyAllReduce")


@pytest.mark.parametrize("op_id", IN_PLACE_OPS)
@pytest.mark.parametrize("replicas", [1, 2])
def test_batch_reduce_in_place_writes_each_result_into_its_value(world, op_id, replicas):
    """A grouped in-place reduce: every component of every value holds the result (packed
    and routed as without inplace), and the caller's arrays come back: the array itself
    for one device, a Mirrored of the components for several."""
    n, rank = world.Get_size(), world.Get_rank()
    op = BY_ID[op_id]
    if op.hierarchical_copy and (n * replicas) % 2:
        pytest.skip("hierarchical copy needs an even number of devices")
    shapes = [((300,), F32), ((2, 3), F64), ((5,), F32), ((7, 7), F16)]
    problems: list[str] = []
    digests: list[tuple[str, str]] = []
    for reduce_op in ("sum", "mean"):
        values = [per_replica(rank, replicas, s, t, salt=i) for i, (s, t) in enumerate(shapes)]
        given = [list(v.values) for v in values]
        out = op(world).batch_reduce(reduce_op, [(v, v) for v in values], inplace=True)
        for i, ((shape, dtype), result, arrays) in enumerate(zip(shapes, out, given)):
            label = f"{reduce_op} value {i}"
            handed = [result] if replicas == 1 else \
                list(result.values) if isinstance(result, Mirrored) else None
            if handed is None or any(h is not a for h, a in zip(handed, arrays)):
                problems.append(f"{label}: expected the value's own arrays back, got "
                                f"{result!r}")
                continue
            ref, tol, _ = reference(reduce_op, n, replicas, shape, dtype, salt=i)
            for d, array in enumerate(arrays):
                found = problem(array, ref, tol, dtype, f"{label} on /cpu:{d}")
                if found:
                    problems.append(found)
                else:
                    digests.append((f"{label} /cpu:{d}", digest(array)))
    finish(world, problems, digests)


def test_reduce_into_given_arrays_on_other_devices(world):
    """``out=`` takes one array per destination device (a list, or a DistributedValues),
    reduces to devices other than the value's, and returns the given arrays; the inputs
    stay untouched."""
    n, rank = world.Get_size(), world.Get_rank()
    problems: list[str] = []
    digests: list[tuple[str, str]] = []
    for op_id in ("ReductionToOneDevice", f"MWAR-{TWO_ENTRY}"):
        ops = BY_ID[op_id](world)
        value = per_replica(rank, 2, (4, 3), F32)
        before = snapshot(value.values)
        one = np.empty((4, 3), F32)
        got_one = ops.reduce("sum", value, "/cpu:0", out=one)
        many = [np.empty((4, 3), F32) for _ in range(3)]
        dest = ["/cpu:0", "/cpu:1", "/device:CPU:5"]
        got_many = ops.reduce("sum", value, dest, out=many)
        mean = [np.empty((4, 3), F32)]
        batch = ops.batch_reduce("mean", [(value, "/cpu:2")], out=[mean])
        if got_one is not one:
            problems.append(f"{op_id}: one destination: expected out itself, got {got_one!r}")
        if not isinstance(got_many, Mirrored) or \
                any(a is not b for a, b in zip(got_many.values, many)):
            problems.append(f"{op_id}: expected a Mirrored of the given arrays, got "
                            f"{got_many!r}")
        if batch[0] is not mean[0]:
            problems.append(f"{op_id}: batch out: expected out[0][0] itself, got {batch!r}")
        if snapshot(value.values) != before:
            problems.append(f"{op_id}: the input changed")
        total, _, _ = reference("sum", n, 2, (4, 3), F32)
        ref, tol, _ = reference("mean", n, 2, (4, 3), F32)
        for label, array, want, tolerance in [("one", one, total, 0 * total),
                                              *[(f"many {i}", a, total, 0 * total)
                                                for i, a in enumerate(many)],
                                              ("mean", mean[0], ref, tol)]:
            found = problem(array, want, tolerance, F32, f"{op_id} {label}")
            if found:
                problems.append(found)
            else:
                digests.append((f"{op_id} {label}", digest(array)))
    finish(world, problems, digests)


BAD_TARGETS = {
    # name: (call(ops, value, good) on rank 0, text of rank 0's error)
    "read-only": (lambda ops, v, t: ops.batch_reduce("sum", [(v, v)], out=[_read_only(t)]),
                  "read-only"),
    "shape": (lambda ops, v, t: ops.reduce("sum", v, "/cpu:0", out=np.empty(4, F32)),
              "the array to write it into (4,)"),
    "mean of integers in place": (
        lambda ops, v, t: ops.batch_reduce("mean", [(_ints(v), _ints(v))], inplace=True),
        "MEAN of integers is float64"),
    "in place to other devices": (
        lambda ops, v, t: ops.batch_reduce("sum", [(v, "/device:CPU:7")], inplace=True),
        "destinations must be the value's devices"),
    "both": (lambda ops, v, t: ops.reduce("sum", v, v, inplace=True, out=t),
             "not both"),
    "out count": (lambda ops, v, t: ops.reduce("sum", v, ["/cpu:0", "/cpu:1"], out=[t]),
                  "1 array(s) for 2 destination"),
    "out per pair": (lambda ops, v, t: ops.batch_reduce("sum", [(v, v)], out=t),
                     "one entry per pair"),
}


def _read_only(array):
    view = array.view()
    view.flags.writeable = False
    return view


def _ints(value):
    return PerReplica([np.asarray(a, np.int32) for a in value.values], value.devices)


@pytest.mark.parametrize("name", list(BAD_TARGETS))
def test_bad_target_on_one_rank_raises_on_every_rank(world, name):
    """A bad ``inplace``/``out=`` target on rank 0 alone is found before any data moves:
    rank 0 raises its own ValueError naming the problem, every other rank a
    CollectiveMismatchError, and nothing was written."""
    rank = world.Get_rank()
    call, text = BAD_TARGETS[name]
    ops = MultiWorkerAllReduce(all_reduce_spec="xring", comm=world)
    value = per_replica(rank, 1, (3,), F32)
    target = np.zeros(3, F32)
    if rank == 0:
        out, exc = outcome(lambda: call(ops, value, target))
    else:
        out, exc = outcome(lambda: ops.batch_reduce("sum", [(value, value)], out=[[target]])
                           if name.endswith("pair") or name == "read-only" else
                           ops.reduce("sum", value, value, out=[target]))
    problems = []
    if rank == 0 and (not isinstance(exc, ValueError) or text not in str(exc)):
        problems.append(f"rank 0: expected ValueError with {text!r}, got {exc!r} / {out!r}")
    if rank > 0 and not isinstance(exc, CollectiveMismatchError):
        problems.append(f"rank {rank}: expected CollectiveMismatchError, got {exc!r}")
    if np.any(target):
        problems.append(f"rank {rank}: a target was written before the error")
    everyone = world.allgather(problems)
    assert not any(everyone), everyone


def test_strategy_batch_reduce_to_in_place_and_out(world):
    """The strategy's ``extended.batch_reduce_to``/``reduce_to`` forward ``inplace`` and
    ``out`` (the default strategy too, on one process)."""
    n, rank = world.Get_size(), world.Get_rank()
    strategy = mpistrat.MultiWorkerMirroredStrategy(comm=world)
    grads = [np.full(3, rank + 1.0, F32), np.full((2, 2), 2.0)]
    values = [PerReplica([g]) for g in grads]
    got = strategy.extended.batch_reduce_to("sum", [(v, v) for v in values], inplace=True)
    out = np.empty(3, F32)
    mean = strategy.extended.reduce_to("mean", PerReplica([np.full(3, rank + 1.0, F32)]),
                                       "/cpu:0", out=out)
    default = mpistrat.get_strategy()
    alone = np.ones(2)
    solo = default.extended.batch_reduce_to("sum", [(PerReplica([alone]), "/cpu:0")],
                                            inplace=True)
    problems = []
    if [id(g) for g in got] != [id(g) for g in grads] or mean is not out or solo[0] is not alone:
        problems.append(f"not the given arrays: {got!r} {mean!r} {solo!r}")
    total = n * (n + 1) / 2
    for label, array, want in [("in place 0", grads[0], np.full(3, total)),
                               ("in place 1", grads[1], np.full((2, 2), 2.0 * n)),
                               ("out", out, np.full(3, total / n)),
                               ("solo", alone, np.ones(2))]:
        if not np.array_equal(array, want):
            problems.append(f"{label}: got {array}, expected {want}")
    finish(world, problems, [("grads", digest(grads[0])), ("out", digest(out))])


# --- broadcast -------------------------------------------------------------------------


def test_broadcast_reaches_every_destination_on_every_rank(comm):
    """Rank 0's tensor arrives on every destination device of every rank, with its shape
    and dtype, one fresh array per device; every rank's own tensor is left untouched."""
    rank = comm.Get_rank()
    problems: list[str] = []
    digests: list[tuple[str, str]] = []
    ops = ReductionToOneDevice(comm=comm)
    replica_value = per_replica(rank, 2, (2,), F32)
    destinations = {
        "'/cpu:0'": ("/cpu:0", ["/cpu:0"]),
        "list": (["/cpu:0", "/device:CPU:1", "CPU:2"], ["/cpu:0", "/cpu:1", "/cpu:2"]),
        "value": (replica_value, ["/cpu:0", "/cpu:1"]),
        "task-qualified": ("/job:worker/task:0/device:CPU:0", ["/job:worker/task:0/device:CPU:0"]),
    }
    tensors = [(3, 4), (0,), (), (5,)]
    for (name, (dest, devices)), shape, dtype in zip(destinations.items(), tensors, DTYPES):
        for current in (dtype, F64):
            mine = np.asarray(component(rank, 1, shape, current) + rank * 10)
            before = mine.copy()
            label = f"broadcast {shape} {current} to {name}"
            out, exc = outcome(lambda: ops.broadcast(mine, dest))  # noqa: B023
            if exc is not None:
                problems.append(f"{label}: raised {exc!r}")
                continue
            if len(devices) > 1 and list(out.devices) != devices:
                problems.append(f"{label}: on {list(out.devices)}, expected {devices}")
            want = component(0, 1, shape, current).astype(np.float64)
            check_mirrored(label, out, sorted(devices), want, np.zeros(shape), current, [mine],
                           problems, digests)
            if not np.array_equal(mine, before):
                problems.append(f"{label}: the input was modified")
    out = ops.broadcast(float(rank + 1), "/cpu:0")  # a Python scalar
    if isinstance(out, Mirrored) or out.shape != () or float(out) != 1.0:
        problems.append(f"broadcast of a scalar: {out!r}")
    finish(comm, problems, digests)


# --- errors: the same bad call on every rank -------------------------------------------

_A = np.ones(3, np.float32)
_V = PerReplica([np.ones(3, np.float32), np.ones(3, np.float32)])
EVERYWHERE = {
    # name: (call(ops), error, text of the message)
    "op max": (lambda o: o.reduce("max", _V, _V), ValueError,
               "`reduce_op` must be ReduceOp.SUM or ReduceOp.MEAN"),
    "op MIN enum": (lambda o: o.batch_reduce(mpistrat.ReduceOp.MIN, [(_V, _V)]), ValueError,
                    "`reduce_op` must be ReduceOp.SUM or ReduceOp.MEAN"),
    "op unknown": (lambda o: o.reduce("avg", _V, _V), ValueError, "'avg'"),
    "op 5": (lambda o: o.reduce(5, _V, _V), TypeError, "got 5"),
    "plain list": (lambda o: o.reduce("sum", [_A, _A], "/cpu:0"), ValueError,
                   "holding arrays as one tensor"),
    "tuple value": (lambda o: o.reduce("mean", (_A,), "/cpu:0"), ValueError,
                    "wrap one value per device in PerReplica"),
    "ragged components": (lambda o: o.reduce("sum", PerReplica([_A, np.ones(4, np.float32)]),
                                             "/cpu:0"), ValueError, "(4,)"),
    "dest ''": (lambda o: o.reduce("sum", _V, ""), ValueError, "destinations can not be empty"),
    "dest blank": (lambda o: o.reduce("sum", _V, "  "), ValueError,
                   "destinations can not be empty"),
    "dest []": (lambda o: o.reduce("sum", _V, []), ValueError, "destinations can not be empty"),
    "dest 5": (lambda o: o.reduce("sum", _V, 5), ValueError,
               "destinations must be one of a `DistributedValues` object"),
    "dest None": (lambda o: o.reduce("sum", _V, None), ValueError,
                  "destinations must be one of"),
    "dest [5]": (lambda o: o.reduce("sum", _V, ["/cpu:0", 5]), ValueError,
                 "destinations must be one of"),
    "dest tpu:0": (lambda o: o.reduce("sum", _V, "/tpu:0"), ValueError, "'/tpu:0'"),
    "options type": (lambda o: o.reduce("sum", _V, _V, options={"bytes_per_pack": 4}),
                     TypeError, "CommunicationOptions"),
    "pairs int": (lambda o: o.batch_reduce("sum", 5), ValueError,
                  "`value_destination_pairs` should be a list or tuple"),
    "pairs dict": (lambda o: o.batch_reduce("sum", {_V: _V}), ValueError,
                   "`value_destination_pairs` should be a list or tuple"),
    "pairs empty": (lambda o: o.batch_reduce("sum", []), ValueError, "empty"),
    "pair a list": (lambda o: o.batch_reduce("sum", [(_V, _V), [_V, _V]]), ValueError,
                    "Each element of `value_destination_pairs` should be a tuple"),
    "pair of 3": (lambda o: o.batch_reduce("sum", [(_V, _V, _V)]), ValueError,
                  "Each element of `value_destination_pairs` should be a tuple of size 2"),
    "pair of 1": (lambda o: o.batch_reduce("sum", ((_V,),)), ValueError, "tuple of size 2"),
    "pair ragged components": (lambda o: o.batch_reduce("sum", [(_A, "/cpu:0"), (
        PerReplica([_A, np.ones(4, np.float32)]), "/cpu:0")]), ValueError, "(4,)"),
    "pair plain list": (lambda o: o.batch_reduce("sum", [([_A, _A], "/cpu:0")]), ValueError,
                        "holding arrays as one tensor"),
    "pair dest ''": (lambda o: o.batch_reduce("sum", [(_V, _V), (_V, "")]), ValueError,
                     "destinations can not be empty"),
    "pair dest 5": (lambda o: o.batch_reduce("mean", [(_V, 5)]), ValueError,
                    "destinations must be one of"),
    "broadcast dest ''": (lambda o: o.broadcast(_A, ""), ValueError,
                          "destinations can not be empty"),
    "broadcast dest []": (lambda o: o.broadcast(_A, []), ValueError,
                          "destinations can not be empty"),
    "broadcast dest 5": (lambda o: o.broadcast(_A, 5), ValueError, "destinations must be one of"),
}


@pytest.mark.parametrize("name", list(EVERYWHERE))
def test_bad_call_raises_on_every_rank(world, name):
    """Every rank makes the same invalid call: every rank raises the same error (no
    hang), for three kinds of op; the communicator stays usable."""
    call, error, text = EVERYWHERE[name]
    problems: list[str] = []
    for op_id in ("ReductionToOneDevice", f"MWAR-{TWO_ENTRY}", "HierarchicalCopyAllReduce"):
        out, exc = outcome(lambda: call(BY_ID[op_id](world)))  # noqa: B023
        if type(exc) is not error or text not in str(exc):
            problems.append(f"{op_id}: expected {error.__name__} with {text!r}, got "
                            f"{exc!r} / {out!r}")
    names = world.allgather(problems)
    out = ReductionToOneDevice(comm=world).reduce("sum", _V, _V)  # still usable
    assert np.array_equal(out.values[1], np.full(3, 2.0 * world.Get_size(), np.float32))
    assert not problems, "\n".join(problems)
    assert all(not p for p in names), names


# --- errors: rank 0 differs ------------------------------------------------------------


def _rank0_differs(kind: str, rank: int):
    """(call(ops), own error of rank 0 or None): the others make a valid call."""
    v = per_replica(rank, 2, (3,), F32)
    odd = rank == 0
    calls = {
        "shape": (lambda o: o.reduce("sum", per_replica(rank, 2, (4,) if odd else (3,), F32), v),
                  None),
        "dtype": (lambda o: o.reduce("sum", per_replica(rank, 2, (3,), F64 if odd else F32),
                                     "/cpu:0"), None),
        "op": (lambda o: o.batch_reduce("mean" if odd else "sum", [(v, v)]), None),
        "replicas": (lambda o: o.reduce("sum", per_replica(rank, 1 if odd else 2, (3,), F32),
                                        "/cpu:0"), None),
        "destination matches": (lambda o: o.reduce("sum", v, "/cpu:5" if odd else v), None),
        "batch length": (lambda o: o.batch_reduce("sum", [(v, v)] * (2 if odd else 1)), None),
        # one tensor of a batch of one-component values (the agreement's cached key)
        "batch shape": (lambda o: o.batch_reduce("sum", _one_component_batch(
            rank, [(3,), (2, 2) if odd else (4,), (5,)], [F32] * 3)), None),
        "batch dtype": (lambda o: o.batch_reduce("sum", _one_component_batch(
            rank, [(3,), (4,), (5,)], [F32, F32, F64 if odd else F32])), None),
        "timeout": (lambda o: o.reduce("sum", v, v, options=CommunicationOptions(
            timeout_seconds=30.0 if odd else 60.0)), None),
        "malformed pair": (lambda o: o.batch_reduce("sum", [(v, v, v)] if odd else [(v, v)]),
                           ValueError),
        "plain list": (lambda o: o.reduce("sum", list(v.values) if odd else v, "/cpu:0"),
                       ValueError),
        "op max": (lambda o: o.reduce("max" if odd else "sum", v, v), ValueError),
        "empty destinations": (lambda o: o.reduce("sum", v, [] if odd else v), ValueError),
        "broadcast shape": (lambda o: o.broadcast(np.ones(4 if odd else 3), "/cpu:0"), None),
        "broadcast destination": (lambda o: o.broadcast(np.ones(3), 5 if odd else "/cpu:0"),
                                  ValueError),
    }
    return calls[kind]


def _one_component_batch(rank: int, shapes: list[tuple[int, ...]], dtypes: list[Any]):
    values = [PerReplica([np.full(shape, rank + 1, dtype)]) for shape, dtype in zip(shapes, dtypes)]
    return [(v, v) for v in values]


RANK0_KINDS = ["shape", "dtype", "op", "replicas", "destination matches", "batch length",
               "batch shape", "batch dtype",
               "timeout", "malformed pair", "plain list", "op max", "empty destinations",
               "broadcast shape", "broadcast destination"]


@pytest.mark.parametrize("kind", RANK0_KINDS)
def test_rank0_differs_raises_on_every_rank(comm, kind):
    """Rank 0 alone makes a different (or invalid) call: every rank raises; rank 0 its own
    error if its call was invalid, every other rank CollectiveMismatchError naming rank 0;
    the communicator stays usable."""
    if comm.Get_size() < 2:
        pytest.skip("a mismatch needs two ranks")
    rank = comm.Get_rank()
    call, own = _rank0_differs(kind, rank)
    problems: list[str] = []
    for op_id in ("ReductionToOneDevice", f"MWAR-{TWO_ENTRY}"):
        out, exc = outcome(lambda: call(BY_ID[op_id](comm)))  # noqa: B023
        if rank == 0 and own is not None:
            if type(exc) is not own:
                problems.append(f"{op_id}: rank 0 expected its own {own.__name__}, got {exc!r}")
        elif not isinstance(exc, CollectiveMismatchError):
            problems.append(f"{op_id}: expected CollectiveMismatchError, got {exc!r} / {out!r}")
        elif own is not None and "rank(s) [0]" not in str(exc):
            problems.append(f"{op_id}: the error does not name rank 0: {exc}")
        elif own is None and "rank 0:" not in str(exc):
            problems.append(f"{op_id}: the error does not describe rank 0's call: {exc}")
    everyone = comm.allgather(problems)
    v = per_replica(rank, 2, (3,), F32)
    out = MultiWorkerAllReduce(all_reduce_spec="xring", comm=comm).reduce("sum", v, v)
    ref = reference("sum", comm.Get_size(), 2, (3,), F32)[0]
    assert np.array_equal(out.values[0], ref), "the communicator is not usable afterwards"
    assert not any(everyone), everyone


# --- one small value per rank: reduced inside the agreement ----------------------------

SMALL_VALUES = [((), F64), ((3,), F32), ((2, 5), I32), ((7,), F16), ((1024,), F32)]


@pytest.mark.parametrize("reduce_op", ["sum", "mean"])
def test_small_values_travel_inside_the_agreement(comm, reduce_op, monkeypatch):
    """MultiWorkerAllReduce's reduce and batch_reduce of one-component values of at most
    FUSED_BYTES per rank (a batch: in all, mixed shapes and dtypes): no algorithm runs
    (the agreement's collective carries the data), the results are the exact reference in
    the right dtype, the same bits on every rank, and stay so as the exchange's blocks
    grow to fit (each shape three times, new data each time, up to 4 KiB); a batch over
    4 KiB runs the spec."""
    seen = spy_algorithms(monkeypatch)
    rank, size = comm.Get_rank(), comm.Get_size()
    ops = MultiWorkerAllReduce(all_reduce_spec=TWO_ENTRY, comm=comm)
    problems: list[str] = []
    digests: list[tuple[str, str]] = []
    for shape, dtype in SMALL_VALUES:
        for salt in range(3):
            value = per_replica(rank, 1, shape, dtype, salt)
            ref, tol, want = reference(reduce_op, size, 1, shape, dtype, salt)
            label = f"{reduce_op} {shape} {dtype} #{salt}"
            for how, call in (("reduce", lambda: ops.reduce(reduce_op, value, value)),  # noqa: B023
                              ("batch", lambda: ops.batch_reduce(  # noqa: B023
                                  reduce_op, [(value, value)])[0])):
                out, exc = outcome(call)
                check_call(f"{label} {how}", "shortcut" if size == 1 else "reduce", out, exc,
                           value, ["/cpu:0"], ref, tol, want, problems, digests)
    # a batch of several small values, mixed shapes and dtypes, 3 KiB in all: one exchange
    batch = [((), F64), ((3,), F32), ((2, 5), I32), ((7,), F16), ((700,), F32)]
    for salt in range(3):
        values = [per_replica(rank, 1, shape, dtype, salt + i)
                  for i, (shape, dtype) in enumerate(batch)]
        out, exc = outcome(lambda: ops.batch_reduce(reduce_op, [(v, v) for v in values]))  # noqa: B023
        if exc is not None or len(out) != len(batch):
            problems.append(f"batch of {len(batch)} #{salt}: got {out!r} / {exc!r}")
            continue
        for i, ((shape, dtype), value, result) in enumerate(zip(batch, values, out)):
            ref, tol, want = reference(reduce_op, size, 1, shape, dtype, salt + i)
            check_call(f"batch #{salt} [{i}] {shape} {dtype}",
                       "shortcut" if size == 1 else "reduce", result, None, value,
                       ["/cpu:0"], ref, tol, want, problems, digests)
    if size > 1 and seen:
        problems.append(f"small values ran algorithms {sorted(set(seen))}")
    # over 4 KiB in all: the spec's algorithms run, the results as exact
    seen.clear()
    values = [per_replica(rank, 1, (600,), F32, i) for i in range(2)]
    out, exc = outcome(lambda: ops.batch_reduce(reduce_op, [(v, v) for v in values]))
    for i, value in enumerate(values):
        ref, tol, want = reference(reduce_op, size, 1, (600,), F32, i)
        check_call(f"batch over 4 KiB [{i}]", "shortcut" if size == 1 else "reduce",
                   None if out is None else out[i], exc, value, ["/cpu:0"], ref, tol, want,
                   problems, digests)
    if size > 1 and not seen:
        problems.append("a batch over 4 KiB ran no algorithm")
    finish(comm, problems, digests)


SMALL_MISMATCHES = ["shape", "timeout", "all_reduce", "bad op", "over 4 KiB"]


@pytest.mark.parametrize("kind", SMALL_MISMATCHES)
def test_a_rank_that_calls_otherwise_than_a_small_reduce_fails_everywhere(world, kind):
    """Rank 0 calls otherwise while the others reduce a small value inside the agreement
    (another shape, a timeout, mpistrat.all_reduce of the same array, an invalid op, a
    value too large to ride along): every rank raises — rank 0 its own ValueError for the
    invalid op — and none waits; the communicator stays usable."""
    if world.Get_size() < 2:
        pytest.skip("a mismatch needs two ranks")
    dup = world.Dup()
    try:
        rank = world.Get_rank()
        ops = MultiWorkerAllReduce(all_reduce_spec=TWO_ENTRY, comm=dup)
        value = per_replica(rank, 1, (5,), F32)
        ops.reduce("sum", value, value)  # the plan exists: rank 0 deviates from a steady loop
        odd = rank == 0
        if odd and kind == "shape":
            call = lambda: ops.reduce("sum", per_replica(rank, 1, (6,), F32), value)  # noqa: E731
        elif odd and kind == "timeout":
            call = lambda: ops.reduce(  # noqa: E731
                "sum", value, value, options=CommunicationOptions(timeout_seconds=30))
        elif odd and kind == "all_reduce":
            call = lambda: mpistrat.all_reduce(value.values[0], "sum", TWO_ENTRY,  # noqa: E731
                                               comm=dup)
        elif odd and kind == "bad op":
            call = lambda: ops.reduce("max", value, value)  # noqa: E731
        elif odd and kind == "over 4 KiB":
            big = per_replica(rank, 1, (5000,), F32)
            call = lambda: ops.reduce("sum", big, big)  # noqa: E731
        else:
            call = lambda: ops.reduce("sum", value, value)  # noqa: E731
        out, exc = outcome(call)
        want = ValueError if odd and kind == "bad op" else CollectiveMismatchError
        assert type(exc) is want, f"{exc!r} / {out!r}"
        again = ops.reduce("sum", value, value)
        ref = reference("sum", world.Get_size(), 1, (5,), F32)[0]
        assert np.array_equal(again, ref), "the communicator is not usable afterwards"
    finally:
        dup.Free()


# --- errors raised after the agreement, on every rank ----------------------------------


def _bad_accumulation(parts):
    return np.stack(parts)  # wrong shape


def _failing_accumulation(parts):
    raise ArithmeticError("accumulation failed")


AFTER_AGREEMENT = {
    # name: (make(comm), error on the reduce rank, error elsewhere, text)
    "reduce_to_device task out of range": (
        lambda c: ReductionToOneDevice(f"/job:worker/task:{c.Get_size()}/device:CPU:0", comm=c),
        TopologyError, TopologyError, "names task"),
    "accumulation_fn wrong shape": (
        lambda c: ReductionToOneDevice(accumulation_fn=_bad_accumulation, comm=c),
        ValueError, ValueError, "accumulation_fn returned shape"),
    "accumulation_fn raises": (
        lambda c: ReductionToOneDevice(_last_rank_device(c), _failing_accumulation, comm=c),
        ArithmeticError, ValueError, "accumulation failed"),
    "GPU algorithm on CPU replicas": (
        lambda c: MultiWorkerAllReduce(all_reduce_spec="nccl", comm=c),
        TopologyError, TopologyError, "needs GPUs"),
    "pscpu shards above the ranks": (
        lambda c: MultiWorkerAllReduce(all_reduce_spec=("pscpu", c.Get_size() + 1), comm=c),
        TopologyError, TopologyError, "shards="),
    "worker_devices count": (
        lambda c: MultiWorkerAllReduce(["/job:worker/task:0"] * (c.Get_size() + 1), comm=c),
        TopologyError, TopologyError, "worker_devices"),
    "num_gpus_per_worker": (
        lambda c: MultiWorkerAllReduce(num_gpus_per_worker=3, comm=c),
        TopologyError, TopologyError, "num_gpus_per_worker=3"),
}


@pytest.mark.parametrize("name", list(AFTER_AGREEMENT))
def test_failure_after_agreement_raises_on_every_rank(world, name):
    """A failure that only shows once data moves (a reduce device that does not exist, an
    accumulation_fn that fails on the reduce rank, a spec that does not fit) is raised on
    every rank; the ranks stay in step."""
    make, root_error, other_error, text = AFTER_AGREEMENT[name]
    root = world.Get_size() - 1 if name == "accumulation_fn raises" else 0
    v = per_replica(world.Get_rank(), 2, (5,), F32)
    out, exc = outcome(lambda: make(world).reduce("sum", v, v))
    error = root_error if world.Get_rank() == root else other_error
    everyone = world.allgather(type(exc).__name__)
    assert isinstance(exc, error) and text in str(exc), f"{exc!r} / {out!r}"
    assert all(e != "NoneType" for e in everyone), everyone


# --- constructors ----------------------------------------------------------------------


def _gpus_usable() -> bool:
    from mpistrat.backends.capabilities import probe_gpus

    probe = probe_gpus()
    return bool(probe.usable and probe.nccl is not None)


@pytest.mark.parametrize("make", [lambda: NcclAllReduce(),
                                  lambda: NcclAllReduce(num_packs=0),
                                  lambda: AllReduceCrossDeviceOps("nccl"),
                                  lambda: AllReduceCrossDeviceOps()],
                         ids=["NcclAllReduce", "NcclAllReduce-0", "ARCDO-nccl", "ARCDO-default"])
def test_nccl_needs_gpus(world, make):
    if _gpus_usable():
        pytest.skip("this host has GPUs with NCCL")
    with pytest.raises(BackendUnavailable, match="needs CuPy with NCCL and CUDA GPUs"):
        make()


@pytest.mark.parametrize(("make", "error", "message"), [
    (lambda: NcclAllReduce(num_packs=-1), ValueError,
     "NCCL all-reduce requires num_packs >= 0, but -1 is specified"),
    (lambda: NcclAllReduce(-3), ValueError,
     "NCCL all-reduce requires num_packs >= 0, but -3 is specified"),
    (lambda: HierarchicalCopyAllReduce(-1), ValueError,
     "HierarchicalCopy requires num_packs >= 0, but -1 is specified"),
    (lambda: HierarchicalCopyAllReduce(num_packs=1.5), TypeError, "1.5"),
    (lambda: AllReduceCrossDeviceOps("ring"), ValueError, "'ring'"),
    (lambda: MultiWorkerAllReduce(num_packs=-1), ValueError, "num_packs"),
    (lambda: MultiWorkerAllReduce(agg_small_grads_max_bytes=-8), ValueError,
     "agg_small_grads_max_bytes"),
    (lambda: MultiWorkerAllReduce(all_reduce_spec="xrng"), SpecError, "'xrng'"),
    (lambda: MultiWorkerAllReduce(all_reduce_spec="xring:1K"), SpecError, ""),
    (lambda: ReductionToOneDevice(reduce_to_device="tpu:0"), ValueError, "'tpu:0'"),
], ids=["nccl-1", "nccl-3", "hc-1", "hc-float", "arcdo-ring", "mwar-packs", "mwar-agg",
        "mwar-spec", "mwar-spec-form", "rtod-device"])
def test_constructor_errors(world, make, error, message):
    """Invalid constructor arguments raise at construction, with TF's wording where TF had
    a message (NcclAllReduce / HierarchicalCopyAllReduce with num_packs < 0)."""
    with pytest.raises(error) as info:
        make()
    assert message in str(info.value)


# --- timeout ---------------------------------------------------------------------------


def test_timeout_when_every_rank_arrives(comm):
    """With timeout_seconds on every rank and every rank on time, reduce and batch_reduce
    give the same results as without."""
    n, rank = comm.Get_size(), comm.Get_rank()
    options = CommunicationOptions(timeout_seconds=60)
    problems: list[str] = []
    digests: list[tuple[str, str]] = []
    value = per_replica(rank, 2, (4,), I32)
    for op_id in ("ReductionToOneDevice", f"MWAR-{TWO_ENTRY}", "HierarchicalCopyAllReduce"):
        ops = BY_ID[op_id](comm)
        for reduce_op in ("sum", "mean"):
            ref, tol, dtype = reference(reduce_op, n, 2, (4,), I32)
            out, exc = outcome(
                lambda: ops.reduce(reduce_op, value, value, options=options))  # noqa: B023
            check_call(f"{op_id} {reduce_op}", "reduce", out, exc, value, ["/cpu:0", "/cpu:1"],
                       ref, tol, dtype, problems, digests)
            out, exc = outcome(lambda: ops.batch_reduce(  # noqa: B023
                reduce_op, [(value, value), (value, "/cpu:0")], options=options))  # noqa: B023
            pairs = (["/cpu:0", "/cpu:1"], ["/cpu:0"])
            for i, (result, devices) in enumerate(zip(out or [], pairs)):
                check_call(f"{op_id} batch {reduce_op} pair {i}", "reduce", result, exc, value,
                           devices, ref, tol, dtype, problems, digests)
            if exc is not None:
                problems.append(f"{op_id} batch {reduce_op}: raised {exc!r}")
    finish(comm, problems, digests)


@pytest.mark.timeout(20)
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["invalid on rank 0", "no timeout on rank 0"])
def test_timeout_on_some_ranks_never_hangs(world, kind):
    """Rank 0's call is invalid (or has no timeout) while the others pass timeout_seconds:
    every rank raises (rank 0 its own error / CollectiveMismatchError), none waits."""
    dup = world.Dup()
    try:
        v = per_replica(world.Get_rank(), 2, (3,), F32)
        timed = CommunicationOptions(timeout_seconds=30)
        odd = world.Get_rank() == 0
        if kind == "invalid on rank 0":
            call = lambda: ReductionToOneDevice(comm=dup).reduce(  # noqa: E731
                "sum", v, "" if odd else v, options=timed)
        else:
            call = lambda: ReductionToOneDevice(comm=dup).reduce(  # noqa: E731
                "sum", v, v, options=None if odd else timed)
        out, exc = outcome(call)
        want = ValueError if odd and kind == "invalid on rank 0" else CollectiveMismatchError
        assert type(exc) is want, f"{exc!r} / {out!r}"
    finally:
        dup.Free()



@pytest.mark.timeout(30)
@pytest.mark.mpi(min_size=2)
def test_timeout_names_the_ranks_that_did_not_arrive(world):
    """Rank 0 reduces with timeout_seconds=0.5 while the other ranks are elsewhere (asleep
    for 1.5 s): rank 0 raises CollectiveTimeoutError within about 0.5 s, naming every other
    rank. Then the others complete what rank 0 left pending on the duplicate (its agreement's
    exchange and the arrival notes), so no request is left in flight."""
    timeout = 0.5
    dup = world.Dup()
    rank, n = world.Get_rank(), world.Get_size()
    exc = elapsed = out = None
    if rank == 0:
        v = per_replica(0, 1, (3,), F64)
        started = time.monotonic()
        out, exc = outcome(lambda: ReductionToOneDevice(comm=dup).reduce(
            "sum", v, v, options=CommunicationOptions(timeout_seconds=timeout)))
        elapsed = time.monotonic() - started
        if exc is not None:
            _complete_pending_requests(exc.__traceback__)
    else:
        time.sleep(3 * timeout)
        # what rank 0's agreement started: the communicator's exchange (an Allgather of
        # one block per rank, in a thread of rank 0's) and an arrival note to every rank;
        # send ours back to it
        dup.Allgather(*exchange(dup).message)
        dup.Recv(np.zeros(1, np.int64), source=0, tag=_ARRIVAL_TAG)
        dup.Send(np.zeros(1, np.int64), dest=0, tag=_ARRIVAL_TAG)
    world.Barrier()
    dup.Free()
    if rank == 0:
        assert isinstance(exc, CollectiveTimeoutError), f"{exc!r} / {out!r}"
        assert isinstance(exc, TimeoutError)
        assert exc.missing == list(range(1, n)), exc.missing
        assert timeout <= elapsed < 3 * timeout, elapsed
        assert "did not arrive" in str(exc)


def _complete_pending_requests(tb) -> None:
    """Wait for the requests rank 0's timed-out agreement left in flight (its exchange,
    arrival notes), found in the traceback's frames, so that none is freed while active."""
    while tb is not None:
        names = tb.tb_frame.f_locals
        pending = names.get("request")
        if hasattr(pending, "gather"):  # a blocking exchange in a thread of its own
            pending.gather.join()
        for key in ("request", "receives", "sends"):
            found = names.get(key)
            requests = found if isinstance(found, list) else [found]
            for request in requests:
                if isinstance(request, MPI.Request):
                    request.Wait()
        tb = tb.tb_next


def test_nccl_implementation_on_host_values_raises_everywhere(world):
    v = per_replica(world.Get_rank(), 1, (3,), F32)
    nccl = CommunicationOptions(implementation="nccl")
    for call in (lambda: ReductionToOneDevice(comm=world).reduce("sum", v, v, options=nccl),
                 lambda: MultiWorkerAllReduce(all_reduce_spec="xring", comm=world)
                 .batch_reduce("sum", [(v, v)], options=nccl)):
        with pytest.raises(mpistrat.BackendUnavailable, match="implementation=NCCL"):
            call()
    ring = CommunicationOptions(implementation="ring")
    out = MultiWorkerAllReduce(all_reduce_spec="xring", comm=world).batch_reduce(
        "sum", [(v, v)], options=ring)
    assert out[0].shape == (3,)  # one destination device: the array itself
