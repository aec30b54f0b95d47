"""Small calls of ``mpistrat.all_reduce`` (one array of at most FUSED_BYTES on up to
FUSED_RANKS ranks): the data travels in the agreement's exchange, one allgather of
fixed-size blocks, and every rank reduces the gathered arrays in rank order.

Checked at 1-4 ranks on every communicator form: results against a rank-order reduction
of the gathered inputs (bitwise) and bitwise identical on every rank, with and without
``check``; no algorithm runs; every kind of mismatch at small sizes raises the same error
on every rank (shape, dtype of the same or another item size, op, spec, form, inplace,
out, one rank small and another large, one rank's bad argument); the stall check names
``all_reduce``, and a rank that never arrives makes the others time out; a fallback for
communicators above FUSED_RANKS; out-of-place results above the small size reuse their
memory while the previous result is still alive.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from _checks import digest, finish, spy_algorithms

import mpistrat
from mpistrat import CollectiveMismatchError, PerReplica, all_reduce
from mpistrat import allreduce as allreduce_module
from mpistrat.errors import CollectiveTimeoutError, UnknownAlgorithmError
from mpistrat.runtime import agreement, stall

MPI = pytest.importorskip("mpi4py.MPI")

FUSED = agreement.FUSED_BYTES


def contribution(rank: int, shape, dtype) -> np.ndarray:
    """Rank ``rank``'s input: small integers (exact in every dtype), thirds for floats."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    k = (np.arange(count) * 7 + rank * 5 + 3) % 17 - 8
    values = k.astype(dtype) if dtype.kind in "iu" else (k / 3).astype(dtype)
    return values.reshape(shape)


UFUNC = {"sum": np.add, "mean": np.add, "min": np.minimum, "max": np.maximum}


def rank_order(comm, array: np.ndarray, op: str) -> np.ndarray:
    """The documented result of a small call: every rank's array gathered, reduced in rank
    order, MEAN divided by the ranks (integers to float64)."""
    arrays = comm.allgather(np.array(array, order="C"))
    total = arrays[0].copy()
    for other in arrays[1:]:
        UFUNC[op](total, other, out=total)
    if op == "mean":
        if total.dtype.kind in "iu":
            return np.true_divide(total, comm.size, dtype=np.float64)
        np.true_divide(total, total.dtype.type(comm.size), out=total)
    return total


def outcome(call):
    try:
        return call(), None
    except Exception as exc:  # noqa: BLE001 -- compared by the caller
        return None, exc


# --- results ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "int64",
                                   "uint8", "complex64"])
@pytest.mark.parametrize("op", ["sum", "mean", "min", "max"])
def test_small_results_are_the_rank_order_reduction(comm, dtype, op, monkeypatch):
    if op in ("min", "max") and dtype.startswith("complex"):
        pytest.skip("MIN/MAX are not defined for complex")
    seen = spy_algorithms(monkeypatch)
    itemsize = np.dtype(dtype).itemsize
    problems: list[str] = []
    digests: list[tuple[str, str]] = []
    for shape in [(), (0,), (1,), (3, 5), (FUSED // itemsize,)]:
        x = contribution(comm.rank, shape, dtype)
        want = rank_order(comm, x, op)
        for check in (True, False):
            for form in ("new", "inplace", "out"):
                if form == "inplace" and op == "mean" and dtype[0] in "iu":
                    continue
                label = f"{shape} check={check} {form}"
                value = x.copy()
                if form == "new":
                    got = all_reduce(value, op, comm=comm, check=check)
                    if not np.array_equal(value, x):
                        problems.append(f"{label}: the input changed")
                elif form == "inplace":
                    got = all_reduce(value, op, comm=comm, check=check, inplace=True)
                    if got is not value:
                        problems.append(f"{label}: inplace did not return the input")
                else:
                    out = np.empty(shape, want.dtype)
                    got = all_reduce(value, op, comm=comm, check=check, out=out)
                    if got is not out:
                        problems.append(f"{label}: out= did not return out")
                if not isinstance(got, np.ndarray) or got.dtype != want.dtype \
                        or got.shape != want.shape or digest(got) != digest(want):
                    problems.append(f"{label}: got {got!r}, expected {want!r}")
                digests.append((label, digest(got)))
    if seen:
        problems.append(f"small calls ran algorithms: {sorted(set(seen))}")
    finish(comm, problems, digests)


def test_non_contiguous_and_other_libraries_inputs(comm):
    base = contribution(comm.rank, (6, 8), np.float64)
    view = base[::2, 1::3]  # not contiguous
    want = rank_order(comm, view, "sum")
    problems: list[str] = []
    got = all_reduce(view, comm=comm)
    if digest(got) != digest(want):
        problems.append(f"strided view: {got} != {want}")
    target = base.copy()
    all_reduce(target[::2, 1::3], comm=comm, inplace=True)
    if digest(target[::2, 1::3]) != digest(want) or not np.array_equal(target[1::2], base[1::2]):
        problems.append("inplace into a strided view wrote the wrong elements")
    memory = memoryview(np.ascontiguousarray(view).copy())  # the buffer protocol
    got = all_reduce(memory, comm=comm)
    if digest(np.asarray(got)) != digest(want):
        problems.append("a memoryview input")
    finish(comm, problems, [("view", digest(want))])


def test_the_small_boundary(comm, monkeypatch):
    """FUSED_BYTES exactly is small (no algorithm); one element more runs the spec."""
    seen = spy_algorithms(monkeypatch)
    small = all_reduce(np.ones(FUSED // 4, np.float32), comm=comm)
    ran_small = list(seen)
    large = all_reduce(np.ones(FUSED // 4 + 1, np.float32), comm=comm)
    assert ran_small == []
    assert seen == (["xring"] if comm.size > 1 else [])
    assert np.all(small == comm.size) and np.all(large == comm.size)


def test_small_batches_and_replicas_run_the_spec(comm, monkeypatch):
    """Only one array is reduced in the exchange: a batch and a PerReplica run the spec's
    algorithm (batch_reduce's packing, the replicas' local combination)."""
    seen = spy_algorithms(monkeypatch)
    out = all_reduce(PerReplica([np.ones(3), np.ones(3)]), "sum", "rechd", comm)
    assert all(np.all(o == 2 * comm.size) for o in out)
    out = all_reduce([np.ones(3), np.ones(2)], "sum", "rechd", comm)
    assert [o.tolist() for o in out] == [[comm.size] * 3, [comm.size] * 2]
    assert seen == (["rechd", "rechd"] if comm.size > 1 else [])


def test_topology_errors_still_raise_on_small_calls(comm):
    for check in (True, False):
        with pytest.raises(mpistrat.errors.TopologyError, match="'psgpu'"):
            all_reduce(np.ones(3), "sum", "psgpu", comm, check=check)
    with pytest.raises(mpistrat.errors.TopologyError):
        all_reduce(np.ones(3), "sum", ("pscpu", comm.size + 1), comm)
    assert np.all(all_reduce(np.ones(3), "sum", "pscpu", comm) == comm.size)


@pytest.mark.parametrize("n", [3, 3000], ids=["small", "large"])
def test_a_change_of_ranks_per_node_retires_a_plan(world, monkeypatch, n):
    """A planned shm call (small: inside the exchange; large: through the algorithm) fits
    one node; after MPISTRAT_RANKS_PER_NODE=1 makes every rank a node of its own (on every
    rank), the same call raises the topology error."""
    if world.size < 2:
        pytest.skip("one rank is one node either way")
    monkeypatch.delenv("MPISTRAT_RANKS_PER_NODE", raising=False)
    fresh = world.Dup()
    try:
        if mpistrat.runtime.topology.get_topology(fresh).num_nodes > 1:
            pytest.skip("shm runs on one node")
        for _ in range(2):
            assert np.all(all_reduce(np.ones(n), "sum", "shm", fresh) == world.size)
        monkeypatch.setenv("MPISTRAT_RANKS_PER_NODE", "1")
        with pytest.raises(mpistrat.errors.TopologyError):
            all_reduce(np.ones(n), "sum", "shm", fresh)
        monkeypatch.delenv("MPISTRAT_RANKS_PER_NODE")
        assert np.all(all_reduce(np.ones(n), "sum", "shm", fresh) == world.size)
    finally:
        fresh.Free()


# --- mismatches ------------------------------------------------------------------------


def _call(comm, kind: str) -> dict:
    """all_reduce's arguments on this rank: rank 0 differs from the others in ``kind``."""
    odd = comm.rank == 0
    n = 5
    call = {"value": contribution(comm.rank, (n,), np.float32), "op": "sum", "spec": "xring",
            "comm": comm}
    if not odd:
        return call
    x = call["value"]
    if kind == "shape":
        call["value"] = contribution(comm.rank, (n + 1,), np.float32)
    elif kind == "ndim":
        call["value"] = x.reshape(1, n)
    elif kind == "dtype itemsize":  # 5 float64 are 40 bytes, 5 float32 20
        call["value"] = x.astype(np.float64)
    elif kind == "dtype kind":  # the same item size
        call["value"] = x.astype(np.int32)
    elif kind == "dtype byte order":
        call["value"] = x.astype(">f4")
    elif kind == "op":
        call["op"] = "max"
    elif kind == "spec":
        call["spec"] = "rechd"
    elif kind == "replicas":
        call["value"] = PerReplica([x])
    elif kind == "batch":
        call["value"] = [x]
    elif kind == "inplace":
        call["inplace"] = True
    elif kind == "out":
        call["out"] = np.empty(n, np.float32)
    elif kind == "small and large":  # 4 KiB + 4 bytes: above the exchange's payload
        call["value"] = np.ones(FUSED // 4 + 1, np.float32)
    elif kind == "large and small":  # everyone else large
        call["value"] = np.ones(2, np.float32)
    return call


MISMATCHES = ["shape", "ndim", "dtype itemsize", "dtype kind", "dtype byte order", "op",
              "spec", "replicas", "batch", "inplace", "out", "small and large",
              "large and small"]


@pytest.mark.parametrize("kind", MISMATCHES)
def test_every_mismatch_raises_the_same_error_everywhere(comm, kind):
    if comm.size < 2:
        pytest.skip("a mismatch needs two ranks")
    call = _call(comm, kind)
    if kind == "large and small" and comm.rank != 0:
        call["value"] = np.ones(FUSED // 4 + 1, np.float32)
    out, exc = outcome(lambda: all_reduce(**call))
    messages = comm.allgather(None if exc is None else (type(exc).__name__, str(exc)))
    assert isinstance(exc, CollectiveMismatchError), f"got {exc!r} / {out!r}"
    assert all(m == messages[0] for m in messages), messages
    assert "different arguments" in str(exc)
    for rank in range(comm.size):
        assert f"rank {rank}:" in str(exc)
    # the communicator is still usable, for small and large calls
    x = np.ones(4)
    assert np.all(all_reduce(x, comm=comm) == comm.size)
    assert np.all(all_reduce(np.ones(FUSED), comm=comm) == comm.size)


BAD = {
    "unknown algorithm": ({"spec": "xrng"}, UnknownAlgorithmError, "'xrng'"),
    "unknown op": ({"op": "avg"}, ValueError, "'avg'"),
    "bool dtype": ({"value": np.ones(3, bool)}, TypeError, "dtype bool"),
    "min on complex": ({"value": np.ones(3, complex), "op": "min"}, TypeError, "complex128"),
    "out of another shape": ({"out": np.ones(4)}, ValueError, "out has shape (4,)"),
    "inplace on a read-only array": ({"inplace": True, "read_only": True}, ValueError,
                                     "read-only"),
}


@pytest.mark.parametrize("check_large", [False, True], ids=["small", "large"])
@pytest.mark.parametrize("kind", list(BAD))
def test_one_rank_bad_argument_raises_everywhere(comm, kind, check_large):
    bad, error, naming = BAD[kind]
    value = np.ones(FUSED if check_large else 3)
    call = {"value": value, "op": "sum", "spec": "xring", "comm": comm}
    if comm.rank == 0:
        call.update(bad)
        if call.pop("read_only", False):
            call["value"].flags.writeable = False
    out, exc = outcome(lambda: all_reduce(**call))
    names = comm.allgather(type(exc).__name__ if exc is not None else None)
    assert isinstance(exc, (ValueError, TypeError)), f"rank {comm.rank} got {out!r}: {names}"
    if comm.rank == 0:
        assert isinstance(exc, error), repr(exc)
        assert naming in str(exc)
    else:
        assert isinstance(exc, CollectiveMismatchError), repr(exc)
        assert "rank(s) [0]" in str(exc) and naming in str(exc)
    assert np.all(all_reduce(np.ones(2), comm=comm) == comm.size)


def test_planned_calls_still_check(comm):
    """A call whose plan is cached still agrees: after many matching calls, a rank that
    changes its op (or shape) is caught on every rank."""
    x = np.ones(4, np.float32)
    for _ in range(5):
        all_reduce(x, comm=comm)
    if comm.size < 2:
        return
    op = "max" if comm.rank == 1 else "sum"
    with pytest.raises(CollectiveMismatchError, match="op=MAX"):
        all_reduce(x, op, comm=comm)
    y = np.ones(4 + (comm.rank == 1), np.float32)
    with pytest.raises(CollectiveMismatchError, match=r"shape=\(5,\)"):
        all_reduce(y, comm=comm)


@pytest.mark.parametrize("steady", [False, True], ids=["first call", "planned"])
@pytest.mark.parametrize("other", ["CrossDeviceOps.reduce", "Strategy.reduce",
                                   "timed CrossDeviceOps.reduce"])
def test_a_rank_in_another_entry_point_is_a_mismatch_not_a_hang(comm, other, steady):
    """Every agreement on a communicator starts with the same exchange, so rank 0 in a
    small all_reduce (its first, or a planned one) and the others in another entry point's
    agreement (timed or not) meet in one collective and all raise."""
    if comm.size < 2:
        pytest.skip("one rank cannot disagree with another")
    x = np.ones(3, np.float32)
    strategy = mpistrat.MultiWorkerMirroredStrategy(comm=comm)  # (collective: every rank)
    if steady:
        for _ in range(3):
            all_reduce(x, comm=comm)
    if comm.rank == 0:
        call = lambda: all_reduce(x, comm=comm)  # noqa: E731
    elif other == "Strategy.reduce":
        call = lambda: strategy.reduce("sum", x, axis=None)  # noqa: E731
    else:
        options = mpistrat.CommunicationOptions(timeout_seconds=20) \
            if other.startswith("timed") else None
        ops = mpistrat.MultiWorkerAllReduce(all_reduce_spec="xring", comm=comm)
        call = lambda: ops.reduce("sum", x, "/cpu:0", options=options)  # noqa: E731
    with pytest.raises(CollectiveMismatchError, match="different arguments"):
        call()
    all_reduce(x, comm=comm)  # the communicator still works


def test_the_exchange_grows_only_on_agreed_calls(world):
    """The blocks start with no payload area and grow, identically on every rank, after
    an agreed small call that did not fit (its data then followed in a second
    allgather); a mismatch leaves them as they were; larger calls never grow them."""
    fresh = world.Dup()
    try:
        def capacity() -> int:
            found = agreement.exchange(fresh)
            assert found is not None
            return found.capacity

        assert capacity() == 0
        assert np.all(all_reduce(np.ones(FUSED + 8, np.uint8), comm=fresh) == world.size)
        assert capacity() == 0  # (a large call: headers only)
        assert np.all(all_reduce(np.ones(3), comm=fresh) == world.size)  # 24 bytes
        assert capacity() == 64
        if world.size > 1:  # rank 0's 800 bytes do not fit, the others' 24 do
            n = 100 if world.rank == 0 else 3
            with pytest.raises(CollectiveMismatchError, match="different arguments"):
                all_reduce(np.ones(n), comm=fresh)
            assert capacity() == 64
        for n in (3, FUSED // 8, 3, 1):
            assert np.all(all_reduce(np.full(n, 2.0), comm=fresh) == 2.0 * world.size)
        assert capacity() == FUSED
        assert world.allgather(capacity()) == [FUSED] * world.size
    finally:
        fresh.Free()


def test_above_fused_ranks_the_agreement_is_an_allreduce(world, monkeypatch):
    """On a communicator of more ranks than FUSED_RANKS (here: set to 0 on a fresh Dup)
    the exchange carries no data, small calls run the spec, and mismatches still raise
    on every rank."""
    monkeypatch.setattr(agreement, "FUSED_RANKS", 0)
    monkeypatch.setattr(allreduce_module, "FUSED_RANKS", 0)
    seen = spy_algorithms(monkeypatch)
    fresh = world.Dup()
    try:
        out = all_reduce(np.ones(3), comm=fresh)
        assert np.all(out == world.size)
        assert seen == (["xring"] if world.size > 1 else [])
        if world.size > 1:
            shape = (3 + (world.rank == 0),)
            with pytest.raises(CollectiveMismatchError, match="different arguments"):
                all_reduce(np.ones(shape), comm=fresh)
            bad = "xrng" if world.rank == 0 else "xring"
            with pytest.raises((CollectiveMismatchError, UnknownAlgorithmError)):
                all_reduce(np.ones(3), "sum", bad, fresh)
    finally:
        fresh.Free()


# --- memory: out-of-place results above the small size ---------------------------------


@pytest.mark.parametrize("spec", ["xring", "rechd", "native", "shm"])
def test_out_of_place_results_reuse_memory(comm, spec):
    """``y = all_reduce(x)`` in a loop, the previous ``y`` alive while the next call runs:
    the results alternate between two buffers instead of fresh memory per call."""
    if spec == "shm" and mpistrat.runtime.topology.get_topology(comm).num_nodes > 1:
        pytest.skip("shm runs on one node")
    x = np.ones((512, 1024), np.float32)  # 2 MiB: shm's results come from shared memory
    addresses = []
    y = None
    for _ in range(8):
        y = all_reduce(x, "sum", spec, comm)
        addresses.append(y.__array_interface__["data"][0])
    assert float(y[0, 0]) == comm.size
    assert len(set(addresses[2:])) <= 2, addresses


# --- the stall check and timeouts ------------------------------------------------------


@pytest.mark.timeout(30)
def test_a_late_rank_in_a_small_call_is_reported_as_all_reduce(comm, reports):
    if comm.size == 1:
        pytest.skip("one rank cannot stall")
    slow = comm.size - 1
    x = np.ones(8)
    all_reduce(x, comm=comm)
    if comm.rank == slow:
        time.sleep(0.8)
    out = all_reduce(x, comm=comm)
    assert np.all(out == comm.size)
    gathered = comm.allgather(list(reports))
    text = gathered[0][0] if gathered[0] else ""
    assert f"rank(s) [{slow}] have not arrived in all_reduce" in text, gathered
    watch = stall.current()
    entry = watch.active[threading.get_ident()]
    assert entry[stall.WHAT] == "all_reduce"
    assert entry[stall.FRAME].f_code.co_name == "all_reduce"


def _finish_pending(tb) -> None:
    """Wait for the exchange a timed-out rank left in flight (in the traceback's frames)."""
    while tb is not None:
        request = tb.tb_frame.f_locals.get("request")
        if isinstance(request, MPI.Request):
            request.Wait()
        tb = tb.tb_next


@pytest.mark.timeout(30)
def test_a_missing_rank_times_out_a_small_call_everywhere():
    """With a 0.6 s timeout and the last rank asleep for 2 s, every other rank raises
    CollectiveTimeoutError naming it; the late rank's own call then completes the
    exchange the others left in flight (the same collective, which carries the data)."""
    world = MPI.COMM_WORLD
    if world.size == 1:
        pytest.skip("one rank cannot stall")
    dup = world.Dup()
    x = np.ones(16, np.float32)
    all_reduce(x, comm=dup)  # (the exchange's blocks now have room for x: one collective)
    stall.watch(None, 0.6, report=lambda text: None)
    late = world.size - 1
    error = None
    try:
        if world.rank == late:
            time.sleep(2.0)
            out = all_reduce(x, comm=dup)
            assert np.all(out == world.size)
        else:
            try:
                all_reduce(x, comm=dup)
            except CollectiveTimeoutError as exc:
                error = exc
                _finish_pending(exc.__traceback__)
    finally:
        world.Barrier()
        stall.unwatch()
        dup.Free()
    if world.rank != late:
        assert isinstance(error, CollectiveTimeoutError), error
        assert error.missing == [late], (error.missing, str(error))
        assert "all_reduce" in str(error)
