"""The shared-memory all-reduce (``shm``, ``shm/<b>``) and shared arrays (``shared_empty``).

Beyond the property tests every algorithm gets in test_algorithms.py (small lengths:
the one-step path), these cover the chunked path (lengths around the small limit, the
chunk size and the slice boundaries), zero-copy and mixed buffers, out-of-place calls,
windows on several communicators at once, communicators freed and re-created, sizes
growing across calls, mismatched calls, and a rank that raises inside the reduction.

As elsewhere, ranks record problems and assert only after a final agreement.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from _checks import digest, finish, problem
from mpi4py import MPI
from test_algorithms import contribution, reference, run_and_check

import mpistrat
from mpistrat import ReduceOp, dispatch
from mpistrat.algorithms import Source, shm
from mpistrat.backends import get_backend
from mpistrat.errors import CollectiveAbortedError, CollectiveMismatchError, TopologyError
from mpistrat.runtime import shared
from mpistrat.values import components_of

BACKEND = get_backend(np.zeros(1))


def _lengths(n: int, dtype: np.dtype) -> list[int]:
    """Element counts around the small limit, one chunk per slice, and several chunks."""
    item = dtype.itemsize
    small = shm.small_limit(n) // item
    chunk = shm.CHUNK_BYTES // item
    return sorted({small, small + 1, n * chunk - 1, n * chunk + 1, 3 * n * chunk + 17,
                   n * (2 * chunk + 5) + 3})


def _run_and_check(comm, alg, buf, op, dtype, label, problems, digests, *,
                   ranks_per_node=None, source=None, expected_length=None):
    run_and_check(lambda: dispatch.run(alg, comm, buf, op=op, backend=BACKEND,
                                         ranks_per_node=ranks_per_node, source=source),
                  comm, buf, op, dtype, label, problems, digests, expected_length)


@pytest.mark.parametrize("dtype_name", ["float32", "float64", "int32", "float16"])
def test_chunked_path_every_length_and_op(comm, dtype_name):
    dtype = np.dtype(dtype_name)
    problems, digests = [], []
    for i, length in enumerate(_lengths(comm.size, dtype)):
        op = (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN)[i % 3]
        buf = contribution(comm.rank, length, dtype)
        _run_and_check(comm, "shm", buf, op, dtype, f"shm {dtype} {op} length={length}",
                       problems, digests)
    finish(comm, problems, digests)


@pytest.mark.parametrize("layout", ["all", "rank0", "odd"])
def test_zero_copy_and_mixed_buffers(comm, layout):
    """Inputs in shared windows are read in place; ranks may mix shared and private."""
    dtype = np.dtype(np.float64)
    problems, digests = [], []
    spied = []
    for length in _lengths(comm.size, dtype)[1:4]:
        share = {"all": True, "rank0": comm.rank == 0, "odd": comm.rank % 2 == 1}[layout]
        buf = mpistrat.shared_empty(length, dtype, comm)  # collective: every rank makes one
        values = contribution(comm.rank, length, dtype)
        if share:
            buf[:] = values
            target = buf
        else:
            target = values.copy()
        spied.append(shm._location(shm._node(comm), target)[0] != 0)
        _run_and_check(comm, "shm", target, ReduceOp.SUM, dtype,
                       f"shm {layout} length={length}", problems, digests)
        mpistrat.free_shared(buf)
    if spied != [share] * len(spied):
        problems.append(f"rank {comm.rank}: shared buffer located {spied}, expected {share}")
    finish(comm, problems, digests)


def test_a_slow_rank_still_fills_every_output(world, monkeypatch):
    """With every output shared, each rank writes its reduced slice into every output:
    a fast rank must not return before a slow peer has written its slice there."""
    dtype = np.dtype(np.float32)
    problems, digests = [], []
    length = _lengths(world.size, dtype)[4]  # three chunks per slice
    if world.rank == world.size - 1 and world.size > 1:
        reduce_into = shm._reduce_into

        def slow(ufunc, inputs, dst):
            time.sleep(0.02)
            reduce_into(ufunc, inputs, dst)

        monkeypatch.setattr(shm, "_reduce_into", slow)
    for out_of_place in (False, True):
        buf = mpistrat.shared_empty(length, dtype, world)
        values = contribution(world.rank, length, dtype)
        if out_of_place:
            _run_and_check(world, "shm", buf, ReduceOp.SUM, dtype, "slow rank, out of place",
                           problems, digests, source=Source.of(values))
        else:
            buf[:] = values
            _run_and_check(world, "shm", buf, ReduceOp.SUM, dtype, "slow rank, in place",
                           problems, digests)
        mpistrat.free_shared(buf)
    finish(world, problems, digests)


def test_out_of_place_from_a_source(comm):
    """A one-segment Source is reduced into a separate output; the input is untouched."""
    dtype = np.dtype(np.float32)
    problems, digests = [], []
    for length in (5, _lengths(comm.size, dtype)[3]):
        values = contribution(comm.rank, length, dtype)
        before = values.copy()
        out = np.empty(length, dtype)
        _run_and_check(comm, "shm", out, ReduceOp.SUM, dtype, f"source length={length}",
                       problems, digests, source=Source.of(values))
        if not np.array_equal(values, before):
            problems.append(f"length={length}: the source was modified")
    finish(comm, problems, digests)


def _cut(values: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    out, at = [], 0
    for size in sizes:
        out.append(values[at:at + size])
        at += size
    return out


def _tensor_sizes(length: int) -> list[int]:
    """Tensor sizes of a pack: small ones, empty ones and large ones, cut anywhere by the
    slices and chunks."""
    sizes = [3, 0, length // 7, 1, length // 3, 5, 0, length // 4 + 1, 1]
    return sizes + [length - sum(sizes)]


@pytest.mark.parametrize("layout", ["scattered", "one-buffer", "shared", "gapped", "mixed"])
def test_pack_of_tensors(world, layout):
    """A pack given as tensors (a multi-segment Source): copied straight into the window
    (scattered), or read as the one array they are views of — in place when it is shared
    (shared_arrays), or in place tensor by tensor when they lie in one shared block with
    gaps, alike on every rank (gapped); ranks may differ (mixed). Results equal the reduction of the
    concatenation; the tensors are untouched; flat shm and shm/rechd on virtual nodes."""
    dtype = np.dtype(np.float32)
    problems, digests = [], []
    lengths = [40, shm.SMALL_BYTES // 4 + 3] + _lengths(world.size, dtype)[2:4]
    for alg, ranks_per_node in (("shm", None), ("shm/rechd", 2), ("shm/xring", 3)):
        for length in lengths:
            sizes = _tensor_sizes(length)
            values = contribution(world.rank, length, dtype)
            mode = layout if layout != "mixed" else \
                ("scattered", "gapped", "one-buffer", "shared")[world.rank % 4]
            # collective, on every rank alike; every other gapped array is a gap (where
            # another pack's tensor would sit)
            plain = mpistrat.shared_arrays(sizes, dtype, world, ranks_per_node)
            gapped = mpistrat.shared_arrays([d for size in sizes for d in (3, size)], dtype,
                                            world, ranks_per_node)
            if mode in ("shared", "gapped"):
                tensors = plain if mode == "shared" else gapped[1::2]  # (not at offset 0)
                for tensor, piece in zip(tensors, _cut(values, sizes)):
                    tensor[...] = piece
            elif mode == "one-buffer":
                tensors = _cut(values.copy(), sizes)
            else:
                tensors = [piece.copy() for piece in _cut(values, sizes)]
            source = Source(tensors)
            if (source.joined() is not None) != (mode in ("one-buffer", "shared")):
                problems.append(f"{mode}: joined() is {source.joined()}")
            if mode == "shared" and not mpistrat.is_shared(source.joined()):
                problems.append("the views of shared_arrays do not join into shared memory")
            before = [t.copy() for t in tensors]
            out = np.full(length, 7, dtype)
            _run_and_check(world, alg, out, ReduceOp.SUM, dtype,
                           f"{alg}@{ranks_per_node} {layout} length={length}", problems, digests,
                           ranks_per_node=ranks_per_node, source=source)
            if not all(np.array_equal(a, b) for a, b in zip(tensors, before)):
                problems.append(f"{alg} {mode} length={length}: the tensors were modified")
            mpistrat.free_shared(gapped[0])
            mpistrat.free_shared(plain[0])
    finish(world, problems, digests)


@pytest.mark.parametrize("spec", ["shm", "rechd:16K:shm"])
def test_batch_reduce_of_shared_gradients(world, spec, monkeypatch):
    """Gradients kept in shared_arrays: MultiWorkerAllReduce reads them in place — as one
    buffer (spec shm), or tensor by tensor when the small ones go elsewhere and leave gaps
    (the AUTO spec's routing) — and gives the sum."""
    from mpistrat import MultiWorkerAllReduce, PerReplica

    shapes = [(64, 300), (300,), (300, 1000), (1000,)]
    grads = mpistrat.shared_arrays(shapes, np.float32, world)
    rng = np.random.default_rng(world.rank)
    for g in grads:
        g[...] = rng.integers(-8, 8, g.shape)
    expected = [np.sum(world.allgather(g), axis=0) for g in grads]
    seen = []
    original = shm._reduce

    def spy(node, x, out, op, root, src=None):
        seen.append("one buffer" if x is not None and mpistrat.is_shared(x) else
                    "tensors in place" if src is not None and shm._layout(node, src) else
                    "copied")
        return original(node, x, out, op, root, src)

    monkeypatch.setattr(shm, "_reduce", spy)
    ops = MultiWorkerAllReduce(all_reduce_spec=spec, num_packs=1, comm=world)
    values = [PerReplica([g]) for g in grads]
    results = ops.batch_reduce("sum", [(v, v) for v in values])
    problems = []
    for i, (got, want) in enumerate(zip(results, expected)):
        if not np.array_equal(components_of(got)[0], want):
            problems.append(f"gradient {i}: wrong sum")
    want = ["one buffer" if spec == "shm" else "tensors in place"] if world.size > 1 else []
    if seen != want:
        problems.append(f"shm read the gradients as {seen}, expected {want}")
    mpistrat.free_shared(grads[0])
    finish(world, problems, [("grads", digest(np.concatenate([components_of(r)[0].ravel()
                                                              for r in results])))])


def test_shared_result_pool(world):
    """shared.recycled: a slot is reused only when no rank holds a view of it; a rank that
    still holds one keeps it busy for the whole node group; with every slot busy, every
    rank gets None; the slots are the same on every rank."""
    problems = []
    count = 1000
    first = shared.recycled(world, count, np.float32)
    first[:] = world.rank
    uid = shared.locate(first)[0].uid
    keep = first if world.rank == 0 else None  # only rank 0 still holds its result
    del first
    second = shared.recycled(world, count, np.float32)
    if shared.locate(second)[0].uid == uid and world.size > 1:
        problems.append("a slot rank 0 still holds was handed out again")
    held = [second]
    for _ in range(shared.POOL_SLOTS):
        held.append(shared.recycled(world, count, np.float32))
    if held[-1] is not None:
        problems.append(f"{shared.POOL_SLOTS + 1} results alive but the pool gave a slot")
    if keep is not None and not np.array_equal(keep, np.zeros(count, np.float32)):
        problems.append("a held result was overwritten")
    del keep, held, second
    again = shared.recycled(world, 3 * count, np.float64)  # every slot free again: reused
    uids = world.allgather(shared.locate(again)[0].uid)
    if len(set(uids)) != 1:
        problems.append(f"ranks got different slots: {uids}")
    finish(world, problems, [])


def test_results_in_shared_memory_survive_later_calls(world):
    """batch_reduce through shm hands out results in shared memory; results a caller
    keeps are never overwritten by later calls (on any rank)."""
    from mpistrat import MultiWorkerAllReduce, PerReplica

    ops = MultiWorkerAllReduce(all_reduce_spec="shm", num_packs=1, comm=world)
    length = (1 << 20) // 4 + 5  # above SHARED_RESULT_BYTES
    kept, problems = [], []
    for step in range(shared.POOL_SLOTS + 2):
        values = [PerReplica([np.full(length // 2, step + world.rank, np.float32)]),
                  PerReplica([np.full(length - length // 2, -step, np.float32)])]
        results = ops.batch_reduce("sum", [(v, v) for v in values])
        first = components_of(results[0])[0]
        if world.size > 1 and step == 0 and not mpistrat.is_shared(first):
            problems.append("the result of a large shm pack is not in shared memory")
        if world.rank % 2 == 0 or step % 2 == 0:  # ranks keep different results alive
            kept.append((step, results))
    n = world.size
    for step, results in kept:
        a, b = (components_of(r)[0] for r in results)
        if not (np.all(a == n * step + n * (n - 1) // 2) and np.all(b == -n * step)):
            problems.append(f"the result of step {step} changed")
    finish(world, problems, [])


@pytest.mark.parametrize("alg,ranks_per_node", [("shm/xring", 1), ("shm/rechd", 2),
                                                ("shm/pscpu", 2), ("shm/xring", 3),
                                                ("shm/rechd", None)])
def test_hierarchical_forms_cross_virtual_nodes(world, alg, ranks_per_node):
    dtype = np.dtype(np.float32)
    problems, digests = [], []
    for length in (7, _lengths(world.size, dtype)[2], _lengths(world.size, dtype)[-1]):
        for zero_copy in (False, True):
            values = contribution(world.rank, length, dtype)
            if zero_copy:
                buf = mpistrat.shared_empty(length, dtype, world, ranks_per_node)
                buf[:] = values
            else:
                buf = values
            _run_and_check(world, alg, buf, ReduceOp.SUM, dtype,
                           f"{alg}@{ranks_per_node} length={length} zero-copy={zero_copy}",
                           problems, digests, ranks_per_node=ranks_per_node)
            if zero_copy:
                mpistrat.free_shared(buf)
    finish(world, problems, digests)


def test_all_reduce_with_local_replicas_and_mean(comm):
    """The public all_reduce with G=2 local replicas and MEAN, through shm."""
    n = comm.size
    problems = []
    for length in (3, 3 * shm.CHUNK_BYTES // 8 + 1):
        a = contribution(comm.rank, length, np.dtype(np.float64), 0)
        b = contribution(comm.rank, length, np.dtype(np.float64), 1)
        out = mpistrat.all_reduce(mpistrat.PerReplica([a, b]), "mean", "shm", comm)
        ref, tol = reference(ReduceOp.MEAN, n, length, np.dtype(np.float64), replicas=2)
        for g, result in enumerate(out):
            found = problem(result, ref, tol, np.dtype(np.float64), f"replica {g} {length}")
            if found:
                problems.append(found)
    finish(comm, problems, [("all_reduce", digest(out[0]))])


def test_two_communicators_interleaved(world):
    """Windows of two communicators in use at the same time do not interfere."""
    dup = world.Dup()
    half = world.Split(world.rank % 2, world.rank)
    problems, digests, half_digests = [], [], []
    try:
        dtype = np.dtype(np.int64)
        for step in range(4):
            length = (5, 40_000, 9, 70_001)[step]
            for name, comm in (("dup", dup), ("half", half), ("world", world)):
                buf = contribution(comm.rank, length, dtype)
                _run_and_check(comm, "shm", buf, ReduceOp.SUM, dtype, f"{name} step={step}",
                               problems, half_digests if comm is half else digests)
        finish(half, [], half_digests)  # (the halves reduce different things)
        finish(world, problems, digests)
    finally:
        half.Free()
        dup.Free()


def test_freed_and_recreated_communicators_do_not_leak(world):
    """Each communicator's windows are freed with it; sizes growing across calls replace
    the scratch window instead of adding one."""
    before = len(shared._BLOCKS)
    problems, digests = [], []
    dtype = np.dtype(np.float32)
    for round_ in range(3):
        comm = world.Dup()
        try:
            scratch_sizes = []
            for length in (1 << 10, 1 << 16, 1 << 19, (1 << 21) + 3):
                buf = contribution(comm.rank, length, dtype)
                _run_and_check(comm, "shm", buf, ReduceOp.SUM, dtype,
                               f"round {round_} length={length}", problems, digests)
                node = shm._node(comm)
                scratch_sizes.append(node.scratch.nbytes if node.scratch else 0)
            if world.size > 1 and (scratch_sizes != sorted(scratch_sizes)
                                   or scratch_sizes[-1] < (1 << 23)):
                problems.append(f"scratch sizes {scratch_sizes}: expected growth to 8 MiB")
            live = len(shared._BLOCKS) - before
            if world.size > 1 and live != 2:  # the control window and one scratch window
                problems.append(f"round {round_}: {live} blocks alive, expected 2")
        finally:
            comm.Free()
        if len(shared._BLOCKS) != before:
            problems.append(f"round {round_}: {len(shared._BLOCKS) - before} blocks leaked")
    finish(world, problems, digests)


def _outcome(call):
    """Run ``call``; return None or the exception (recorded, not raised mid-test)."""
    try:
        call()
    except Exception as exc:
        return exc
    return None


@pytest.mark.parametrize("length", [4, 100_000])
def test_mismatched_calls_raise_on_every_rank(world, length):
    """Ranks passing different sizes all raise CollectiveMismatchError; the windows stay
    usable afterwards."""
    if world.size == 1:
        pytest.skip("needs two ranks")
    comm = world.Dup()
    problems = []
    try:
        buf = np.ones(length + (world.rank == 1), np.float32)
        got = _outcome(lambda: shm.all_reduce(comm, buf, op=ReduceOp.SUM, backend=BACKEND))
        if not (isinstance(got, CollectiveMismatchError)
                and "asked for different calls" in str(got)):
            problems.append(f"rank {world.rank}: mismatched call gave {got!r}")
        again = np.ones(length, np.float32)
        got = _outcome(lambda: shm.all_reduce(comm, again, op=ReduceOp.SUM, backend=BACKEND))
        if got is not None or not np.all(again == world.size):
            problems.append(f"rank {world.rank}: the next call gave {got!r}, {again[:3]}")
    finally:
        comm.Free()
    finish(world, problems, [])


@pytest.mark.parametrize("length", [4, 100_000])
def test_a_rank_raising_inside_the_reduction_does_not_hang_the_others(world, monkeypatch,
                                                                       length):
    """The failing rank raises its own error; its peers raise CollectiveAbortedError (the
    chunked path waits for the failing rank's slice) or — in the one-step path, where they
    may need nothing more from it — finish and raise at their next call. After that every
    call on the communicator raises on every rank; a fresh communicator works."""
    if world.size == 1:
        pytest.skip("needs two ranks")
    comm = world.Dup()
    failing = world.size - 1
    problems = []

    def broken(*args, **kwargs):
        raise RuntimeError("injected failure")

    def call(target):
        return _outcome(lambda: shm.all_reduce(target, np.ones(length, np.float32),
                                               op=ReduceOp.SUM, backend=BACKEND))

    try:
        call(comm)
        if world.rank == failing:
            monkeypatch.setattr(shm, "_reduce_into", broken)
        got = call(comm)
        monkeypatch.undo()
        if world.rank == failing:
            if not (isinstance(got, RuntimeError) and "injected" in str(got)):
                problems.append(f"failing rank got {got!r}")
        elif isinstance(got, CollectiveAbortedError):
            if failing not in got.failed:
                problems.append(f"rank {world.rank}: {got.failed} named, not {failing}")
        elif got is not None or length * 4 > shm.small_limit(world.size):
            problems.append(f"rank {world.rank}: the failed call gave {got!r}")
        got = call(comm)
        if not (isinstance(got, CollectiveAbortedError) and "fresh communicator" in str(got)):
            problems.append(f"rank {world.rank}: the call after the failure gave {got!r}")
        fresh = world.Dup()
        try:
            ok = np.ones(length, np.float32)
            got = _outcome(lambda: shm.all_reduce(fresh, ok, op=ReduceOp.SUM,
                                                  backend=BACKEND))
            if got is not None or not np.all(ok == world.size):
                problems.append(f"rank {world.rank}: a fresh communicator gave {got!r}")
        finally:
            fresh.Free()
    finally:
        comm.Free()
    finish(world, problems, [])


def test_plain_shm_across_virtual_nodes_is_an_error_everywhere(world):
    if world.size == 1:
        pytest.skip("one rank is one node")
    buf = np.ones(8, np.float32)
    with pytest.raises(TopologyError, match="shm/xring"):
        dispatch.run("shm", world, buf, op=ReduceOp.SUM, backend=BACKEND, ranks_per_node=1)


def test_broadcast_from_any_root(comm):
    problems = []
    for length in (3, 100_003):
        for root in range(comm.size):
            buf = np.full(length, comm.rank, np.int32)
            if comm.rank == root:
                buf[:] = np.arange(length)
            shm.broadcast(comm, buf, backend=BACKEND, root=root)
            if not np.array_equal(buf, np.arange(length, dtype=np.int32)):
                problems.append(f"length={length} root={root}: wrong values")
    finish(comm, problems, [])


def test_shared_arrays(comm):
    a = mpistrat.shared_zeros((3, 5), np.float32, comm)
    b = mpistrat.shared_empty(7, "int16", comm)
    problems = []
    if a.shape != (3, 5) or a.dtype != np.float32 or a.any():
        problems.append(f"shared_zeros gave {a.shape} {a.dtype} {a}")
    if not (mpistrat.is_shared(a) and mpistrat.is_shared(b[2:]) and a.flags.c_contiguous):
        problems.append("shared arrays not recognised as shared")
    if mpistrat.is_shared(np.zeros(3)):
        problems.append("a private array recognised as shared")
    with pytest.raises(ValueError, match="returned by mpistrat.shared_empty"):
        mpistrat.free_shared(b[1:])
    mpistrat.free_shared(b)
    mpistrat.free_shared(a)
    if mpistrat.is_shared(a):
        problems.append("a freed array still recognised as shared")
    finish(comm, problems, [])


def test_shm_refuses_device_buffers():
    class FakeBackend:
        name = "cupy"

    with pytest.raises(mpistrat.BackendUnavailable, match="host memory"):
        shm.all_reduce(MPI.COMM_WORLD if MPI.COMM_WORLD.size > 1 else MPI.COMM_SELF,
                       np.ones(3), op=ReduceOp.SUM, backend=FakeBackend())


@pytest.mark.parametrize("ranks_per_node", [None, 1])
def test_node_arrays_are_one_copy_per_node_group(comm, ranks_per_node):
    """``node_empty``: every rank of a node group sees the same memory (the group's last
    rank stores, every rank loads after a barrier), the all-reduce does not take it for a
    rank's own shared buffer, and ``free_shared`` frees it (collective)."""
    from mpistrat.runtime.topology import get_topology

    node = get_topology(comm, ranks_per_node).node_comm
    array = shared.node_empty((3, 5), np.float64, comm, ranks_per_node)
    problems: list[str] = []
    if node.Get_rank() == node.Get_size() - 1:
        array[...] = np.arange(15).reshape(3, 5) + comm.rank
    node.Barrier()
    last = node.bcast(comm.rank, root=node.Get_size() - 1)
    if not np.array_equal(array, np.arange(15).reshape(3, 5) + last):
        problems.append(f"rank {comm.rank} does not see what rank {last} stored")
    if node.Get_rank() and shared.is_shared(array):
        problems.append("another rank's node array counts as this rank's own shared buffer")
    mine = array.copy()
    node.Barrier()  # nobody stores into the node array while others still read it
    result = mpistrat.all_reduce(mine, "sum", "shm", comm=node)
    if not np.array_equal(result, mine * node.Get_size()):
        problems.append("shm of a copy of the node array went wrong")
    mpistrat.free_shared(array)
    finish(comm, problems, [])
