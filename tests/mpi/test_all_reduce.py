"""``mpistrat.all_reduce``, the public API: results, replicas, shapes, in-place, and errors
that are raised on every rank instead of leaving ranks waiting.

Replica ``g`` of rank ``r`` contributes a pattern computed from ``r`` and ``g`` (small
integers modulo 17, divided by 3 for floats); expected values are computed in float64
in closed form on every rank (and once from ``comm.allgather`` of the inputs). Tests
that loop over collectives record problems and assert only after a final ``allgather`` of
the results' sha256 (every rank must hold bitwise identical results), so that one rank's
failed assertion never leaves the others waiting in the next collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from _checks import _dtype, _eps, digest, finish, problem, spy_algorithms

import mpistrat
from mpistrat import CollectiveMismatchError, PerReplica, ReduceOp, all_reduce
from mpistrat.errors import SpecError, SpecTypeError, TopologyError, UnknownAlgorithmError
from mpistrat.runtime.topology import get_topology

# --- inputs and references -------------------------------------------------------------

PERIOD = 1021


def contribution(rank: int, shape, dtype, replica: int = 0) -> np.ndarray:
    """Replica ``replica`` of ``rank``: ``base * (rank + 1) + replica`` modulo 17, minus 8
    (divided by 3 for floats), as a fresh C-contiguous array of ``shape``."""
    dtype = np.dtype(dtype)
    j = np.arange(PERIOD)
    base = (j * 7 + (j // 17) * 3 + 3) % 17 + 1
    k = (base * (rank + 1) + replica) % 17 - 8
    one_period = k.astype(dtype) if dtype.kind in "iu" else (k / 3).astype(dtype)
    return np.resize(one_period, shape)


def reference(op: ReduceOp, values: list[np.ndarray], dtype: np.dtype):
    """(expected, tolerance, result dtype) for ``op`` over every contribution ``values``."""
    stack = np.stack([np.asarray(v, dtype=np.float64) for v in values])
    count = len(values)
    out_dtype = dtype
    if op is ReduceOp.MIN:
        return stack.min(axis=0), np.zeros(stack.shape[1:]), out_dtype
    if op is ReduceOp.MAX:
        return stack.max(axis=0), np.zeros(stack.shape[1:]), out_dtype
    ref = stack.sum(axis=0)
    tol = (count + 2) * _eps(dtype) * np.abs(stack).sum(axis=0)
    if op is ReduceOp.MEAN:
        ref, tol = ref / count, tol / count
        if dtype.kind in "iu":
            out_dtype = np.dtype(np.float64)
            tol = 4 * np.finfo(np.float64).eps * np.abs(ref)
    return ref, tol, out_dtype


def expected(op: ReduceOp, size: int, shape, dtype, replicas: int = 1, view=None):
    """Closed-form reference over every rank and replica (``view`` applied to each input)."""
    view = view or (lambda a: a)
    values = [view(contribution(r, shape, dtype, g)) for r in range(size)
              for g in range(replicas)]
    return reference(op, values, np.dtype(dtype))


def outcome(call):
    """Run ``call()``; return (result, None) or (None, exception)."""
    try:
        return call(), None
    except Exception as exc:  # noqa: BLE001 -- compared by the caller
        return None, exc


# --- what to run -----------------------------------------------------------------------


@dataclass(frozen=True)
class Algo:
    id: str
    alg: str
    ranks_per_node: int | None = None

    def pool(self, comm) -> int | None:
        """How many gather ranks ``shards`` may use, or None when shards are unbounded."""
        info = mpistrat.algorithms.get(self.alg)
        if info.pool is None:
            return None
        if info.hierarchical:
            nodes = get_topology(comm, self.ranks_per_node).num_nodes
            return None if nodes == 1 else nodes
        return comm.size

    def shards(self, comm, wanted: int = 3) -> int:
        pool = self.pool(comm)
        return wanted if pool is None else min(wanted, pool)

    def __call__(self, comm, value, op, shards: int = 1, **kwargs):
        spec = self.alg if shards == 1 else (self.alg, shards)
        return all_reduce(value, op, spec, comm, ranks_per_node=self.ranks_per_node, **kwargs)


ALGOS = [
    Algo("xring", "xring"),
    Algo("rechd", "rechd"),
    Algo("pscpu", "pscpu"),
    Algo("native", "native"),
    Algo("pscpu/pscpu@1", "pscpu/pscpu", 1),
    Algo("pscpu/pscpu@2", "pscpu/pscpu", 2),
]
ALGO_IDS = [a.id for a in ALGOS]
DTYPES = ["float16", "float32", "float64", "int32", "int64", "bfloat16"]
OPS = ["sum", "mean", "min", "max"]


# --- results ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("algo", ALGOS, ids=ALGO_IDS)
def test_every_op_dtype_and_replica_count(comm, algo, dtype_name):
    """Every op × G in {1, 2}: values, dtype (MEAN of ints is float64), shape, fresh
    outputs, untouched inputs, bitwise identical on every rank."""
    dtype = _dtype(dtype_name)
    n = comm.size
    shards = algo.shards(comm, 2)
    shape = (n + 1,)
    problems: list[str] = []
    digests: list[tuple[str, str]] = []
    for op_name in OPS:
        op = ReduceOp.parse(op_name)
        for replicas in (1, 2):
            label = f"{algo.id} {dtype_name} {op_name} G={replicas} shards={shards}"
            inputs = [contribution(comm.rank, shape, dtype, g) for g in range(replicas)]
            saved = [a.copy() for a in inputs]
            value = PerReplica(inputs) if replicas > 1 else inputs[0]
            out, exc = outcome(lambda: algo(comm, value, op_name, shards))  # noqa: B023
            if exc is not None:
                problems.append(f"{label}: raised {exc!r}")
                continue
            outs = out if replicas > 1 else [out]
            if replicas > 1 and (not isinstance(out, list) or len(out) != replicas):
                problems.append(f"{label}: expected a list of {replicas} arrays, got {out!r}")
                continue
            ref, tol, out_dtype = expected(op, n, shape, dtype, replicas)
            for g, result in enumerate(outs):
                found = problem(result, ref, tol, out_dtype, f"{label} output {g}")
                if found:
                    problems.append(found)
                if any(np.shares_memory(result, a) for a in inputs):
                    problems.append(f"{label}: output {g} shares memory with an input")
                digests.append((f"{label} output {g}", digest(result)))
            if replicas > 1 and np.shares_memory(outs[0], outs[1]):
                problems.append(f"{label}: the replicas' outputs share memory")
            for g, (now, before) in enumerate(zip(inputs, saved)):
                if now.tobytes() != before.tobytes():
                    problems.append(f"{label}: input {g} was modified")
    finish(comm, problems, digests)


def _lengths(n: int) -> list[int]:
    return sorted({0, 1, n - 1, n, n + 1, 7, 13})


@pytest.mark.parametrize("algo", ALGOS, ids=ALGO_IDS)
def test_every_length_shard_count_and_replica_count(comm, algo):
    """Lengths 0, 1, n-1, n, n+1, primes × shards 1..3 × G in {1, 2}; pscpu shards above
    the gather pool raise TopologyError on every rank."""
    n = comm.size
    pool = algo.pool(comm)
    problems: list[str] = []
    digests: list[tuple[str, str]] = []
    combos = [("sum", np.float64), ("mean", np.int32), ("max", np.float16),
              ("sum", np.int64), ("mean", np.float32)]
    index = 0
    for length in _lengths(n):
        for shards in (1, 2, 3):
            for replicas in (1, 2):
                op_name, dtype = combos[index % len(combos)]
                index += 1
                label = (f"{algo.id} length={length} shards={shards} G={replicas} "
                         f"{op_name} {np.dtype(dtype)}")
                inputs = [contribution(comm.rank, (length,), dtype, g) for g in range(replicas)]
                value = PerReplica(inputs) if replicas > 1 else inputs[0]
                out, exc = outcome(lambda: algo(comm, value, op_name, shards))  # noqa: B023
                if pool is not None and shards > pool:
                    if not isinstance(exc, TopologyError) or f"shards={shards}" not in str(exc):
                        problems.append(f"{label}: expected TopologyError naming "
                                        f"shards={shards} (pool {pool}), got {exc!r}")
                    continue
                if exc is not None:
                    problems.append(f"{label}: raised {exc!r}")
                    continue
                ref, tol, out_dtype = expected(ReduceOp.parse(op_name), n, (length,), dtype,
                                               replicas)
                for g, result in enumerate(out if replicas > 1 else [out]):
                    found = problem(result, ref, tol, out_dtype, f"{label} output {g}")
                    if found:
                        problems.append(found)
                    digests.append((f"{label} output {g}", digest(result)))
    finish(comm, problems, digests)


def test_reference_from_allgather(comm):
    """The closed-form reference agrees with one built from every rank's actual inputs."""
    shape = (3, comm.size + 2)
    mine = [contribution(comm.rank, shape, np.float32, g) for g in range(2)]
    everyone = [a for arrays in comm.allgather(mine) for a in arrays]
    out = all_reduce(PerReplica(mine), "sum", "rechd", comm)
    ref, tol, dtype = reference(ReduceOp.SUM, everyone, np.dtype(np.float32))
    closed = expected(ReduceOp.SUM, comm.size, shape, np.float32, 2)[0]
    problems = [p for p in (problem(out[0], ref, tol, dtype, "allgather reference"),
                            problem(out[1], ref, tol, dtype, "allgather reference"))
                if p]
    if not np.array_equal(ref, closed):
        problems.append("closed-form reference differs from the allgathered one")
    finish(comm, problems, [("out", digest(out[0]))])


@pytest.mark.parametrize("algo", ALGOS[:4] + ALGOS[5:], ids=ALGO_IDS[:4] + ALGO_IDS[5:])
def test_shapes_scalars_and_non_contiguous(comm, algo):
    """Scalars, 0-d, 0-size, n-d and non-contiguous inputs: correct values, input's shape."""
    n, rank = comm.size, comm.rank
    problems: list[str] = []
    digests: list[tuple[str, str]] = []

    def check(label, value, ref, tol, dtype, shape):
        out, exc = outcome(lambda: algo(comm, value, "sum"))
        if exc is not None:
            problems.append(f"{label}: raised {exc!r}")
            return
        found = problem(np.asarray(out), ref, tol, np.dtype(dtype), label)
        if found:
            problems.append(found)
        elif np.shape(out) != shape:
            problems.append(f"{label}: shape {np.shape(out)}, expected {shape}")
        digests.append((label, digest(out)))

    total = n * (n + 1) // 2
    zero = np.zeros(())
    # Python and NumPy scalars, 0-d arrays
    check("python int", rank + 1, np.array(float(total)), zero, np.int64, ())
    check("python float", (rank + 1) / 4, np.array(total / 4), zero, np.float64, ())
    check("numpy float32", np.float32(rank + 1), np.array(float(total)), zero, np.float32, ())
    check("0-d int32", np.array(rank - 1, np.int32), np.array(float(total - 2 * n)), zero,
          np.int32, ())
    # 0-size arrays keep their shape
    for shape in ((0,), (3, 0), (0, 2, 2)):
        empty = np.zeros(shape, np.float32)
        check(f"0-size {shape}", empty, np.zeros(shape), np.zeros(shape), np.float32, shape)
    # n-d, C order
    for shape in ((2, 3, 4), (n, 1), (1, n + 2)):
        ref, tol, dtype = expected(ReduceOp.SUM, n, shape, np.float64)
        check(f"c-order {shape}", contribution(rank, shape, np.float64), ref, tol, dtype, shape)
    # non-contiguous views: strided, transposed, Fortran order, sliced, reversed
    views = {
        "a[::2]": ((11,), lambda a: a[::2]),
        "transposed": ((3, 5), lambda a: a.T),
        "fortran": ((4, 3), np.asfortranarray),
        "sliced 3-d": ((2, 5, 4), lambda a: a[:, 1::2, ::-1]),
        "reversed": ((7,), lambda a: a[::-1]),
    }
    for name, (shape, view) in views.items():
        source = contribution(rank, shape, np.int32)
        value = view(source)
        ref, tol, dtype = expected(ReduceOp.SUM, n, shape, np.int32, view=view)
        check(f"non-contiguous {name}", value, ref, tol, dtype, value.shape)
    finish(comm, problems, digests)


def test_non_contiguous_replicas_and_tuples(comm):
    """G = 2 non-contiguous replicas; a tuple of replicas returns a list."""
    n, rank = comm.size, comm.rank
    shape = (4, n + 3)
    view = lambda a: a[:, ::2].T  # noqa: E731
    a, b = (contribution(rank, shape, np.float64, g) for g in range(2))
    saved = a.copy(), b.copy()
    problems = []
    out = all_reduce(PerReplica((view(a), view(b))), "mean", "rechd", comm)
    ref, tol, dtype = expected(ReduceOp.MEAN, n, shape, np.float64, 2, view=view)
    if not isinstance(out, list) or len(out) != 2:
        problems.append(f"expected a list of 2, got {type(out).__name__}")
    else:
        problems += [p for p in (problem(o, ref, tol, dtype, f"replica {g}")
                                 for g, o in enumerate(out)) if p]
    if not (np.array_equal(a, saved[0]) and np.array_equal(b, saved[1])):
        problems.append("inputs were modified")
    finish(comm, problems, [("out", digest(out[0]))])


def test_mean_of_integers_is_float64_and_sum_keeps_dtype(comm):
    n = comm.size
    problems = []
    cases = [("sum", np.int32, np.int32), ("sum", np.int64, np.int64), ("max", np.int32, np.int32),
             ("mean", np.int32, np.float64), ("mean", np.int64, np.float64),
             ("mean", np.float16, np.float16), ("mean", np.float32, np.float32),
             ("sum", np.float16, np.float16)]
    for op_name, dtype, out_dtype in cases:
        for replicas in (1, 2):
            value = PerReplica([np.full(5, comm.rank + 1 + 10 * g, dtype) for g in range(replicas)])
            out = all_reduce(value, op_name, "native", comm)
            total = replicas * n * (n + 1) / 2 + 10 * n * replicas * (replicas - 1) / 2
            want = total / (n * replicas) if op_name == "mean" else total
            if op_name == "max":
                want = n + 10 * (replicas - 1)
            for result in out:
                if result.dtype != out_dtype or not np.all(result == want):
                    problems.append(f"{op_name} {np.dtype(dtype)} G={replicas}: got "
                                    f"{result!r}, expected {want} as {np.dtype(out_dtype)}")
    finish(comm, problems, [])


@pytest.mark.parametrize("algo", ALGOS, ids=ALGO_IDS)
def test_inplace_writes_into_the_inputs(comm, algo):
    n = comm.size
    shards = algo.shards(comm, 2)
    problems: list[str] = []
    digests: list[tuple[str, str]] = []
    for op_name, dtype in (("sum", np.float32), ("mean", np.float64), ("max", np.int64)):
        for replicas in (1, 2):
            label = f"{algo.id} inplace {op_name} {np.dtype(dtype)} G={replicas}"
            inputs = [contribution(comm.rank, (2, n + 1), dtype, g) for g in range(replicas)]
            value = PerReplica(inputs) if replicas > 1 else inputs[0]
            out, exc = outcome(
                lambda: algo(comm, value, op_name, shards, inplace=True))  # noqa: B023
            if exc is not None:
                problems.append(f"{label}: raised {exc!r}")
                continue
            outs = out if replicas > 1 else [out]
            if any(o is not i for o, i in zip(outs, inputs)):
                problems.append(f"{label}: the results are not the input arrays")
            ref, tol, out_dtype = expected(ReduceOp.parse(op_name), n, (2, n + 1), dtype,
                                           replicas)
            for g, array in enumerate(inputs):
                found = problem(array, ref, tol, out_dtype, f"{label} input {g}")
                if found:
                    problems.append(found)
                digests.append((f"{label} {g}", digest(array)))
    finish(comm, problems, digests)


@pytest.mark.parametrize(
    ("make", "op", "error", "match"),
    [
        (lambda r: _read_only(np.arange(3.0)), "sum", ValueError, "writeable"),
        (lambda r: np.arange(4), "mean", TypeError, "MEAN of integers"),
    ],
    ids=["read-only", "mean-int"],
)
def test_inplace_refusals_on_every_rank(comm, make, op, error, match):
    value = make(comm.rank)
    before = np.array(value, copy=True)
    with pytest.raises(error, match=match):
        all_reduce(value, op, "xring", comm, inplace=True)
    assert np.array_equal(value, before)


@pytest.mark.parametrize("layout", ["strided", "transposed"])
def test_inplace_into_views_that_are_not_contiguous(comm, layout):
    """In place needs writeable arrays, not contiguous ones: the result is written back
    through the view, and the memory around it is left alone."""
    base = np.arange(12.0) + comm.rank
    view = base[::2] if layout == "strided" else base.reshape(3, 4).T
    around = base[1::2].copy() if layout == "strided" else None
    got = all_reduce(view, "sum", "rechd", comm, inplace=True)
    want = (np.arange(12.0) * comm.size + comm.size * (comm.size - 1) / 2)
    want = want[::2] if layout == "strided" else want.reshape(3, 4).T
    problems = [] if got is view and np.array_equal(view, want) else [f"got {got!r}"]
    if around is not None and not np.array_equal(base[1::2], around):
        problems.append("the elements between the strided view's changed")
    finish(comm, problems, [(layout, digest(np.ascontiguousarray(view)))])


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


# --- errors: mismatches and bad arguments ----------------------------------------------


def _differs(comm, kind: str):
    """(value, op, spec) for this rank: rank 0 differs from the others in ``kind``."""
    odd = comm.rank == 0
    n = comm.size
    shape = (n + 2,) if odd and kind == "shape" else (n + 1,)
    dtype = np.float32 if odd and kind == "dtype" else np.float64
    op = "max" if odd and kind == "op" else "sum"
    spec = "native" if odd and kind == "spec" else "rechd"
    value = contribution(comm.rank, shape, dtype)
    if kind == "G" and odd:
        value = PerReplica([value, value.copy()])
    if kind == "length-0" and odd:
        value = np.zeros(0)
    if kind == "ndim" and odd:
        value = value.reshape(1, -1)
    return value, op, spec


MISMATCHES = ["shape", "dtype", "op", "spec", "G", "length-0", "ndim"]


@pytest.mark.parametrize("kind", MISMATCHES)
def test_mismatch_raises_the_same_error_on_every_rank(comm, kind):
    if comm.size < 2:
        pytest.skip("a mismatch needs two ranks")
    value, op, spec = _differs(comm, kind)
    out, exc = outcome(lambda: all_reduce(value, op, spec, comm))
    messages = comm.allgather(None if exc is None else (type(exc).__name__, str(exc)))
    assert isinstance(exc, CollectiveMismatchError), f"got {exc!r} / {out!r}"
    assert isinstance(exc, ValueError)
    assert all(m == messages[0] for m in messages), messages
    text = str(exc)
    assert "different arguments" in text
    for rank in range(comm.size):
        assert f"rank {rank}:" in text
    # the description names what differs
    detail = {"shape": f"({comm.size + 2},)", "dtype": "<f4", "op": "op=MAX",
              "spec": "spec=native", "G": "G=2", "length-0": "shape=(0,)",
              "ndim": f"(1, {comm.size + 1})"}[kind]
    assert detail in text


def test_mismatch_check_survives_and_next_call_works(comm):
    """After a caught mismatch, the communicator is still usable."""
    if comm.size < 2:
        pytest.skip("a mismatch needs two ranks")
    value = np.ones(comm.size + 1 + (comm.rank == 0))
    with pytest.raises(CollectiveMismatchError):
        all_reduce(value, "sum", "xring", comm)
    out = all_reduce(np.ones(3), "sum", "pscpu", comm)
    assert np.array_equal(out, np.full(3, float(comm.size)))


@pytest.mark.parametrize("inplace", [False, True])
def test_repeated_large_calls_run_planned_and_still_check(comm, inplace):
    """Above the small size a repeated call runs from its plan (parsed and signed once):
    each call gives the exact result in the caller's memory or a new array, and a rank
    that then changes its op or shape is caught on every rank, after which the
    communicator works."""
    n = 3000  # 12 KB of float32: above the small size
    x = np.empty(n, np.float32)
    for step in range(4):
        x[:] = np.arange(n, dtype=np.float32) % 7 + comm.rank + step
        got = all_reduce(x, "sum", "xring", comm, inplace=inplace)
        assert (got is x) == inplace
        want = (np.arange(n) % 7 * comm.size + comm.size * (comm.size - 1) / 2
                + comm.size * step).astype(np.float32)
        assert np.array_equal(got, want)
    if comm.size < 2:
        return
    op = "max" if comm.rank == 1 else "sum"
    with pytest.raises(CollectiveMismatchError, match="op=MAX"):
        all_reduce(x, op, "xring", comm, inplace=inplace)
    y = np.ones(n + (comm.rank == 1), np.float32)
    with pytest.raises(CollectiveMismatchError, match=rf"shape=\({n + 1},\)"):
        all_reduce(y, "sum", "xring", comm, inplace=inplace)
    assert np.array_equal(all_reduce(np.ones(n, np.float32), "sum", "xring", comm),
                          np.full(n, comm.size, np.float32))


@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize("which", ["all-read-only", "rank0-read-only"])
@pytest.mark.parametrize("count", [3, 3000], ids=["small", "large"])
def test_read_only_inplace_after_a_plan_raises_on_every_rank(comm, count, which, check):
    """A plan is cached by a call on writeable arrays; the next call's array is read-only
    (on every rank, or on rank 0 only) with inplace=True: it raises as the unplanned call
    does, on every rank, before anything is written or sent (checked: the read-only ranks
    their own ValueError, the others a CollectiveMismatchError naming them), and the plan
    still serves the next writeable call."""
    if not check and which == "rank0-read-only" and comm.size > 1:
        pytest.skip("unchecked, the writeable ranks would wait for rank 0 (check=False's "
                    "contract: every rank passes the same call)")
    x = np.full(count, comm.rank + 1, np.float32)
    all_reduce(x, "sum", "xring", comm, inplace=True, check=check)  # cached
    x[:] = comm.rank + 1
    read_only = which == "all-read-only" or comm.rank == 0
    x.flags.writeable = not read_only
    out, exc = outcome(lambda: all_reduce(x, "sum", "xring", comm, inplace=True,
                                          check=check))
    names = comm.allgather(type(exc).__name__ if exc is not None else None)
    problems = []
    if read_only and not (isinstance(exc, ValueError)
                          and "inplace=True needs writeable arrays" in str(exc)):
        problems.append(f"rank {comm.rank} (read-only): got {exc!r} / {out!r}")
    if not read_only and not (isinstance(exc, CollectiveMismatchError)
                              and "rank(s) [0]" in str(exc) and "read-only" in str(exc)):
        problems.append(f"rank {comm.rank}: got {exc!r} / {out!r}")
    if not np.array_equal(x, np.full(count, comm.rank + 1, np.float32)):
        problems.append(f"rank {comm.rank}: the array changed")
    x.flags.writeable = True
    got = all_reduce(x, "sum", "xring", comm, inplace=True, check=check)
    want = np.full(count, comm.size * (comm.size + 1) // 2, np.float32)
    if got is not x or not np.array_equal(x, want):
        problems.append(f"rank {comm.rank}: the next call gave {got!r}")
    assert not problems, f"{problems} (every rank: {names})"
    finish(comm, problems, [("after", digest(x))])


@pytest.mark.parametrize("count", [3, 3000], ids=["small", "large"])
def test_tuple_specs_are_planned(comm, monkeypatch, count):
    """A tuple spec (TF's form) is planned as its string is: calls after the first, with
    the same tuple or an equal new one, run from the plan; a tuple that only compares
    equal (a bool for the shards) does not find that plan and raises on every rank."""
    from mpistrat import allreduce
    from mpistrat.runtime._commcache import comm_cache

    unplanned = []
    original = allreduce._unplanned

    def counting(*args, **kwargs):
        unplanned.append(args[5])  # (the spec)
        return original(*args, **kwargs)

    monkeypatch.setattr(allreduce, "_unplanned", counting)
    x = np.full(count, comm.rank + 1.0)
    want = np.full(count, comm.size * (comm.size + 1) / 2)
    for spec in [("xring", 1, -1), ("xring", 1, -1), tuple(["xring", 1, -1]),
                 tuple(["xring", 1, "-1"]), tuple(["xring", 1, "-1"]), ("pscpu",)]:
        assert np.array_equal(all_reduce(x, "sum", spec, comm), want), spec
    assert unplanned == [("xring", 1, -1), ("xring", 1, "-1"), ("pscpu",)]
    door = comm_cache(comm)["all_reduce"]
    assert ((count,), x.dtype, "sum", ("xring", 1, -1), False, True) in door.plans
    with pytest.raises(SpecTypeError, match="shards must be an integer"):
        all_reduce(x, "sum", ("xring", True, -1), comm)
    assert len(unplanned) == 4


@pytest.mark.parametrize(
    ("spec_a", "spec_b"),
    [("rechd", ("rechd",)), ("pscpu:1:-1", ("pscpu", 1, -1)), ("native", "native#1")],
)
def test_equivalent_spec_forms_agree(comm, spec_a, spec_b):
    """Different spellings of one spec are the same call."""
    spec = spec_a if comm.rank % 2 else spec_b
    out = all_reduce(np.full(4, comm.rank, np.int64), "sum", spec, comm)
    assert np.array_equal(out, np.full(4, comm.size * (comm.size - 1) // 2))


ONE_RANK_BAD = {
    # kind: (keyword arguments for rank 0, its own error, text naming the value)
    "unknown algorithm": ({"spec": "xrng"}, UnknownAlgorithmError, "'xrng'"),
    "shards 0": ({"spec": ("xring", 0)}, SpecError, "got 0"),
    "unknown op": ({"op": "avg"}, ValueError, "'avg'"),
    "op type": ({"op": 2}, TypeError, "got 2"),
    "bool dtype": ({"value": np.ones(3, bool)}, TypeError, "dtype bool"),
    "string value": ({"value": "abc"}, TypeError, "<U3"),
    "min on complex": ({"value": np.ones(3, complex), "op": "min"}, TypeError, "complex128"),
    "ragged replicas": ({"value": PerReplica([np.ones(3), np.ones(4)])}, ValueError, "(4,)"),
    "inplace on a read-only array": ({"value": _read_only(np.ones(3)),
                                      "inplace": True}, ValueError, "read-only"),
    "out of another shape": ({"out": np.ones(4)}, ValueError, "out has shape (4,)"),
    "not an array": ({"value": object()}, TypeError, "value of type object"),
}


@pytest.mark.parametrize("kind", list(ONE_RANK_BAD))
def test_bad_argument_on_one_rank_raises_on_every_rank(comm, kind):
    bad, error, naming = ONE_RANK_BAD[kind]
    call = {"value": np.ones(3), "op": "sum", "spec": "rechd", "comm": comm}
    if comm.rank == 0:
        call.update(bad)
    out, exc = outcome(lambda: all_reduce(**call))
    names = comm.allgather(type(exc).__name__ if exc is not None else None)
    assert isinstance(exc, (ValueError, TypeError)), f"rank {comm.rank} got {out!r}: {names}"
    if comm.rank == 0:
        assert isinstance(exc, error), repr(exc)
        assert naming in str(exc)
    else:
        assert isinstance(exc, CollectiveMismatchError), repr(exc)
        assert "rank(s) [0]" in str(exc) and naming in str(exc)


BAD_EVERYWHERE = [
    # (value, op, spec, error, text naming the value)
    (np.ones(3), "sum", "xrng", UnknownAlgorithmError, "'xrng'"),
    (np.ones(3), "sum", ("xring", 0), SpecError, "got 0"),
    (np.ones(3), "sum", "pscpu#0", SpecError, "got 0"),
    (np.ones(3), "sum", ("pscpu", -2), SpecError, "got -2"),
    (np.ones(3), "sum", None, SpecTypeError, "None"),
    (np.ones(3), "sum", {"xring": 1}, SpecTypeError, "dict"),
    (np.ones(3), "sum", "psgpu", TopologyError, "'psgpu'"),
    (np.ones(3), "average", "xring", ValueError, "'average'"),
    (np.ones(3), None, "xring", TypeError, "None"),
    (np.ones(3), 1.5, "xring", TypeError, "1.5"),
    ("abc", "sum", "xring", TypeError, "<U3"),
    (np.array(["a", "b"]), "sum", "xring", TypeError, "<U1"),
    (np.ones(3, bool), "sum", "xring", TypeError, "dtype bool"),
    (True, "sum", "xring", TypeError, "dtype bool"),
    (np.array([1, "x"], dtype=object), "sum", "xring", TypeError, "dtype object"),
    (np.ones(3, complex), "min", "xring", TypeError, "complex128"),
    (np.ones(3, np.complex64), "MAX", "xring", TypeError, "complex64"),
    ({"a": 1}, "sum", "xring", TypeError, "dict"),
    (PerReplica([np.ones(3), np.ones(3, np.float32)]), "sum", "xring", ValueError, "float32"),
    (PerReplica([np.ones(3), np.ones((3, 1))]), "sum", "xring", ValueError, "(3, 1)"),
    ([np.ones(3), np.ones(3, bool)], "sum", "xring", TypeError, "dtype bool"),
    ([np.ones(3), object()], "sum", "xring", TypeError, "value of type object"),
]


@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize(
    ("value", "op", "spec", "error", "naming"), BAD_EVERYWHERE,
    ids=[f"{i}-{e.__name__}" for i, (*_, e, _n) in enumerate(BAD_EVERYWHERE)],
)
def test_bad_arguments_raise_naming_the_value(comm, value, op, spec, error, naming, check):
    with pytest.raises(error) as info:
        all_reduce(value, op, spec, comm, check=check)
    assert naming in str(info.value)
    assert isinstance(info.value, (ValueError, TypeError))


def test_shards_above_the_ranks_raise_topology_error(comm):
    """pscpu's shards may not exceed the ranks (pscpu/pscpu's: the nodes), on every rank."""
    n = comm.size
    outcomes = []
    for rpn in (None, 1, 2):
        # gather ranks: the ranks for pscpu, the (virtual) nodes for pscpu/pscpu
        pool = n if rpn is None else get_topology(comm, rpn).num_nodes
        spec = ("pscpu" if rpn is None else "pscpu/pscpu", pool + 1)
        out, exc = outcome(lambda: all_reduce(np.ones(5), "sum", spec, comm,  # noqa: B023
                                              ranks_per_node=rpn))  # noqa: B023
        # on a single node a hierarchical algorithm skips the stage where shards apply
        outcomes.append((spec, rpn, rpn is None or pool > 1, exc))
    names = comm.allgather([type(e).__name__ if e else None for *_, e in outcomes])
    # at the limit it works
    out = all_reduce(np.ones(5), "sum", ("pscpu", n), comm)
    assert np.array_equal(out, np.full(5, float(n)))
    assert all(x == names[0] for x in names), names
    for spec, rpn, fails, exc in outcomes:
        if not fails:
            assert exc is None, f"{spec} ranks_per_node={rpn}: {exc!r}"
            continue
        assert isinstance(exc, TopologyError), f"{spec} ranks_per_node={rpn}: {exc!r}"
        assert f"shards={spec[1]}" in str(exc)


@pytest.mark.parametrize("ranks_per_node", [0, -1, "2", 1.5, True])
def test_invalid_ranks_per_node_raises_naming_it(comm, ranks_per_node):
    with pytest.raises(TopologyError, match="ranks_per_node") as info:
        all_reduce(np.ones(3), "sum", "pscpu/pscpu", comm, ranks_per_node=ranks_per_node)
    assert repr(ranks_per_node) in str(info.value)


def test_spec_routes_each_tensor_by_its_byte_size(comm, monkeypatch):
    """The first entry whose limit >= the tensor's bytes (one replica's) reduces it."""
    seen = spy_algorithms(monkeypatch)
    spec = "native:1:1024,rechd:1:4096,pscpu:1:-1"
    n = comm.size
    problems: list[str] = []
    digests: list[tuple[str, str]] = []
    for elements, replicas, alg in ((256, 1, "native"), (256, 2, "native"), (257, 1, "rechd"),
                                    (1024, 2, "rechd"), (1025, 1, "pscpu")):
        seen.clear()
        value = PerReplica([contribution(comm.rank, (elements,), np.float32, g)
                           for g in range(replicas)])
        out = all_reduce(value, "sum", spec, comm)
        if seen != ([alg] if n > 1 else []):
            problems.append(f"{elements} float32 x G={replicas}: ran {seen}, expected {alg}")
        ref, tol, dtype = expected(ReduceOp.SUM, n, (elements,), np.float32, replicas)
        found = problem(out[-1], ref, tol, dtype, f"{elements} via {alg}")
        if found:
            problems.append(found)
        digests.append((alg, digest(out[0])))
    finish(comm, problems, digests)


def test_ranks_per_node_mismatch_raises_on_every_rank(world):
    """Ranks that disagree on the virtual node size (first use of a communicator) all
    raise the same error, naming ranks_per_node."""
    if world.size < 2:
        pytest.skip("a mismatch needs two ranks")
    fresh = world.Dup()
    try:
        rpn = 1 if world.rank == 0 else 2
        out, exc = outcome(lambda: all_reduce(np.ones(3), "sum", "pscpu/pscpu", fresh,
                                              ranks_per_node=rpn))
        assert isinstance(exc, CollectiveMismatchError), repr(exc)
        assert "ranks_per_node=1" in str(exc) and "ranks_per_node=2" in str(exc)
    finally:
        fresh.Free()


@pytest.mark.parametrize("algo", ALGOS, ids=ALGO_IDS)
def test_check_false_when_arguments_match(comm, algo):
    n = comm.size
    shards = algo.shards(comm, 2)
    problems: list[str] = []
    digests: list[tuple[str, str]] = []
    for op_name, replicas in (("sum", 1), ("mean", 2), ("min", 2)):
        inputs = [contribution(comm.rank, (n + 3,), np.float32, g) for g in range(replicas)]
        out = algo(comm, PerReplica(inputs), op_name, shards, check=False)
        ref, tol, dtype = expected(ReduceOp.parse(op_name), n, (n + 3,), np.float32, replicas)
        for g, result in enumerate(out):
            found = problem(result, ref, tol, dtype, f"check=False {op_name} G={replicas}")
            if found:
                problems.append(found)
            digests.append((f"{op_name} {g}", digest(result)))
    finish(comm, problems, digests)


@pytest.mark.parametrize("ranks_per_node", [1, 2])
def test_hierarchical_virtual_nodes_really_cross_nodes(comm, ranks_per_node):
    """With ``ranks_per_node`` the job has several (virtual) nodes, so pscpu/pscpu's
    cross-node stage runs; the result is the same as a flat algorithm's, bitwise on
    every rank."""
    topology = get_topology(comm, ranks_per_node)
    problems = []
    if len(set(topology.hostnames)) == 1 and \
            topology.num_nodes != -(-comm.size // ranks_per_node):
        problems.append(f"{topology.num_nodes} nodes of {ranks_per_node} out of {comm.size}")
    value = PerReplica([contribution(comm.rank, (5, 7), np.int64, g) for g in range(2)])
    out = all_reduce(value, "sum", "pscpu/pscpu", comm, ranks_per_node=ranks_per_node)
    flat = all_reduce(value, "sum", "native", comm)
    if not (np.array_equal(out[0], flat[0]) and np.array_equal(out[1], flat[1])):
        problems.append(f"pscpu/pscpu gave {out}, native {flat}")
    finish(comm, problems, [("hier", digest(out[0]))])


@pytest.mark.mpi(min_size=2)
def test_ranks_per_node_disagreement_after_cached_topology_raises_everywhere(world):
    # Regression: a topology cached from an earlier call used to let some ranks skip the
    # agreement that the others waited in.
    dup = world.Dup()
    try:
        x = np.ones(5)
        mpistrat.all_reduce(x, spec="pscpu/pscpu", comm=dup, ranks_per_node=2)
        with pytest.raises(mpistrat.CollectiveMismatchError, match="ranks_per_node"):
            mpistrat.all_reduce(x, spec="pscpu/pscpu", comm=dup,
                                ranks_per_node=1 if world.rank == 0 else 2)
    finally:
        dup.Free()


def test_inplace_rejects_scalars(world):
    with pytest.raises(ValueError, match="inplace=True needs arrays"):
        mpistrat.all_reduce(np.float64(1.0), comm=world, inplace=True)


def test_invalid_ranks_per_node_rejected_for_flat_algorithms(world):
    with pytest.raises(mpistrat.TopologyError, match="ranks_per_node must be a positive int"):
        mpistrat.all_reduce(np.ones(3), spec="xring", comm=world, ranks_per_node=0)
