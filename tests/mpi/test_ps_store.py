"""The ps variable store (``mpistrat.ps.VariableStore``): arenas in MPI windows on the ps
ranks, reached by one-sided RMA from every rank.

Roles at every ``-n``: one rank is both ps and user at ``-n 1``; otherwise ranks
``1..P`` (``P = max(1, size // 2)``) are ps and the others users; a ps waits in a
``Barrier`` (inside MPI) while users work, as the store's docstring asks.

Checked: round-robin and sharded placement (TF's div rows, consecutive ps, the same
handles on every rank); handles pickled on one rank and used on others; concurrent
``assign_add``/``assign_sub`` from every user with an exact final count; ``update``
read-modify-write from every rank with an exact result; assign/read round trips for each
dtype, scalar and empty shapes; the arena-full error and the env default; unsupported
dtypes and other misuse. Every rank collects its problems and reaches the same
collectives before ``finish`` asserts, so a failure on one rank fails the run without
leaving another waiting.
"""

from __future__ import annotations

import pickle
import warnings

import numpy as np
import pytest
from _checks import digest, finish

from mpistrat.partitioners import FixedShardsPartitioner, shard_sizes
from mpistrat.ps import (
    ARENA_ENV,
    DEFAULT_ARENA_BYTES,
    ArenaFullError,
    ShardedHandle,
    VariableHandle,
    VariableStore,
    arena_bytes_from_env,
)

MPI = pytest.importorskip("mpi4py.MPI")

DTYPES = ["float16", "float32", "float64", "int32", "int64"]


def roles(comm) -> tuple[list[int], list[int]]:
    """(ps ranks, user ranks) of ``comm``."""
    if comm.size == 1:
        return [0], [0]
    ps = list(range(1, 1 + max(1, comm.size // 2)))
    return ps, [r for r in range(comm.size) if r not in ps]


def attempt(problems: list[str], label: str, call):
    """Run ``call``; a failure becomes a problem on this rank instead of an exception, so
    the rank still reaches the collectives that follow."""
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 -- reported by finish
        problems.append(f"rank {MPI.COMM_WORLD.rank}: {label}: {type(exc).__name__}: {exc}")
        return None


def expect_error(problems: list[str], label: str, error, call, *words: str) -> None:
    """``call`` must raise ``error`` with every one of ``words`` in its message."""
    try:
        call()
    except error as exc:
        missing = [w for w in words if w not in str(exc)]
        if missing:
            problems.append(f"{label}: the message lacks {missing}: {exc}")
        return
    except Exception as exc:  # noqa: BLE001 -- the wrong error is a problem
        problems.append(f"{label}: raised {type(exc).__name__} ({exc}), expected "
                        f"{error.__name__}")
        return
    problems.append(f"{label}: raised nothing, expected {error.__name__}")


# --- placement ---------------------------------------------------------------------------


def test_round_robin_and_sharded_placement_as_tf(comm):
    ps, _ = roles(comm)
    P = len(ps)
    problems: list[str] = []
    digests: list[tuple[str, str]] = []
    with VariableStore(ps, 1 << 16, comm=comm) as store:
        plain = [store.allocate((3, 2), "float32", name=f"v{i}") for i in range(5)]
        if [h.ps for h in plain] != [ps[i % P] for i in range(5)]:
            problems.append(f"round robin: {[h.ps for h in plain]}, expected "
                            f"{[ps[i % P] for i in range(5)]}")
        slot = store.allocate((3, 2), "float32", ps=plain[1].ps, name="slot")
        after = store.allocate((1,), "int64", name="after")
        if slot.ps != plain[1].ps or after.ps != ps[5 % P]:
            problems.append(f"colocated placement advanced the round robin: slot on "
                            f"{slot.ps}, next on {after.ps}, expected {ps[5 % P]}")
        # 13 rows over 5 shards: 3, 3, 3, 2, 2 rows, on the next five round-robin slots
        emb = store.allocate_sharded((13, 4), "float32", [5, 1], name="emb")
        assert isinstance(emb, ShardedHandle)
        rows = [h.shape[0] for h in emb.shards]
        if rows != [3, 3, 3, 2, 2] or rows != shard_sizes(13, 5):
            problems.append(f"shard rows {rows}, expected [3, 3, 3, 2, 2]")
        if [h.ps for h in emb.shards] != [ps[(6 + i) % P] for i in range(5)]:
            problems.append(f"shards on ps {[h.ps for h in emb.shards]}, expected "
                            f"consecutive ps from {ps[6 % P]}")
        if list(emb.row_offsets) != [0, 3, 6, 9, 11, 13]:
            problems.append(f"row offsets {emb.row_offsets}")
        if [h.name for h in emb.shards] != [f"emb/part_{i}" for i in range(5)]:
            problems.append(f"shard names {[h.name for h in emb.shards]}")
        clipped = store.allocate_sharded((3,), "int32", FixedShardsPartitioner(20)((3,),
                                                                                   "int32"))
        if not isinstance(clipped, ShardedHandle) or len(clipped.shards) != 3:
            problems.append(f"20 shards of 3 rows should clip to 3: {clipped}")
        whole = store.allocate_sharded((8, 2), "float64", [1, 1])
        if not isinstance(whole, VariableHandle):
            problems.append(f"one shard should give a plain handle, got {whole}")
        expect_error(problems, "partition on axis 1", ValueError,
                     lambda: store.allocate_sharded((4, 4), "float32", [2, 2]),
                     "variable_partitioner must return")
        offsets = [(h.ps, h.offset) for h in plain + [slot, after] + list(emb.shards)]
        if len(set(offsets)) != len(offsets) or any(o % 64 for _, o in offsets):
            problems.append(f"overlapping or unaligned offsets: {offsets}")
        # values follow the shards' row ranges
        full = np.arange(52, dtype=np.float32).reshape(13, 4)
        if comm.rank == 0:
            attempt(problems, "assign sharded", lambda: store.assign(emb, full))
        comm.Barrier()
        got = attempt(problems, "read sharded", lambda: store.read(emb))
        if got is not None and not np.array_equal(got, full):
            problems.append(f"sharded read {got.tolist()}")
        for i, shard in enumerate(emb.shards):
            part = attempt(problems, "read shard", lambda shard=shard: store.read(shard))
            lo, hi = emb.row_offsets[i], emb.row_offsets[i + 1]
            if part is not None and not np.array_equal(part, full[lo:hi]):
                problems.append(f"shard {i} holds {part.tolist()}, expected rows {lo}:{hi}")
        comm.Barrier()
        digests.append(("handles", digest(np.frombuffer(
            pickle.dumps((plain, slot, after, emb, clipped, whole)), np.uint8))))
    finish(comm, problems, digests)


def test_handles_travel_to_other_ranks(world):
    """Only rank 0 places variables (as the coordinator will); the others get the handles
    pickled and update and read through them."""
    ps, _ = roles(world)
    problems: list[str] = []
    digests: list[tuple[str, str]] = []
    with VariableStore(ps, 1 << 16, comm=world) as store:
        blob = None
        if world.rank == 0:
            handles = (store.allocate((world.size,), "int64", name="slots"),
                       store.allocate_sharded((7, 3), "float64", [3, 1], name="table"))
            blob = pickle.dumps(handles)
        slots, table = pickle.loads(world.bcast(blob, root=0))
        # rank r writes slot r, then adds r + 1 to row r % 7 of the sharded table
        mine = np.zeros(world.size, np.int64)
        mine[world.rank] = 10 + world.rank
        attempt(problems, "add slot", lambda: store.assign_add(slots, mine))
        row = np.zeros((7, 3))
        row[world.rank % 7] = world.rank + 1
        attempt(problems, "add row", lambda: store.assign_add(table, row))
        world.Barrier()
        got = attempt(problems, "read slots", lambda: store.read(slots))
        if got is not None and got.tolist() != [10 + r for r in range(world.size)]:
            problems.append(f"slots {got.tolist()}")
        expected = np.zeros((7, 3))
        for r in range(world.size):
            expected[r % 7] += r + 1
        got = attempt(problems, "read table", lambda: store.read(table))
        if got is not None and not np.array_equal(got, expected):
            problems.append(f"table {got.tolist()}, expected {expected.tolist()}")
        world.Barrier()
        digests.append(("handles", digest(np.frombuffer(pickle.dumps((slots, table)),
                                                        np.uint8))))
    finish(world, problems, digests)


# --- concurrency -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_concurrent_adds_from_every_user_lose_nothing(world, dtype):
    ps, users = roles(world)
    rounds = 60
    problems: list[str] = []
    with VariableStore(ps, 1 << 20, comm=world) as store:
        counter = store.allocate((1000,), dtype, name="counter")
        down = store.allocate((5,), dtype, name="down")
        spread = store.allocate_sharded((2 * len(ps) + 1, 10), dtype, [2 * len(ps) + 1, 1],
                                        name="spread")
        world.Barrier()
        if world.rank in users:  # a ps that is not a user waits in the Barrier below
            def hammer():
                for _ in range(rounds):
                    store.assign_add(counter, 1)
                    store.assign_sub(down, 1)
                    store.assign_add(spread, np.ones(spread.shape, dtype))
            attempt(problems, "hammer", hammer)
        world.Barrier()
        total = len(users) * rounds
        for label, handle, want in (("counter", counter, total), ("down", down, -total),
                                    ("spread", spread, total)):
            got = attempt(problems, f"read {label}", lambda h=handle: store.read(h))
            if got is None:
                continue
            if got.dtype != np.dtype(dtype) or not np.all(got == want):
                problems.append(f"{label}: {np.unique(got).tolist()[:5]} ({got.dtype}), "
                                f"expected all {want} after {len(users)} users x {rounds}")
        world.Barrier()
    finish(world, problems, [])


def test_update_is_an_atomic_read_modify_write_from_every_rank(world):
    ps, _ = roles(world)
    rounds = 40
    problems: list[str] = []
    with VariableStore(ps, 1 << 16, comm=world) as store:
        # [number of updates, sum of the updaters' ranks]: a lost update shows in both
        state = store.allocate((2,), "int64", name="state")
        # an Adam-like moment on a sharded variable: m <- 0.5 m + 1 is not commutative
        # with a lost write, and the count rides along in column 1
        moment = store.allocate_sharded((3, 2), "float64", [3, 1], name="m")
        world.Barrier()

        def step(value):
            value[:, 0] = 0.5 * value[:, 0] + 1
            value[:, 1] += 1
            return value

        def work():
            for _ in range(rounds):
                store.update(state, lambda v: v + np.array([1, world.rank]))
                store.update(moment, step)
        attempt(problems, "update", work)  # every rank, the ps ones too
        world.Barrier()
        n = world.size * rounds
        got = attempt(problems, "read state", lambda: store.read(state))
        want = [n, rounds * sum(range(world.size))]
        if got is not None and got.tolist() != want:
            problems.append(f"state {got.tolist()}, expected {want}")
        got = attempt(problems, "read m", lambda: store.read(moment))
        m = 0.0
        for _ in range(n):
            m = 0.5 * m + 1
        if got is not None and (not np.all(got[:, 1] == n) or not np.allclose(got[:, 0], m)):
            problems.append(f"moment {got.tolist()}, expected [{m}, {n}] per row")
        expect_error(problems, "fn using the store", RuntimeError,
                     lambda: store.update(state, lambda v: store.read(state)),
                     "inside update()")
        world.Barrier()
    finish(world, problems, [])


# --- values and dtypes -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_assign_then_read_round_trips(world, dtype):
    ps, _ = roles(world)
    problems: list[str] = []
    digests: list[tuple[str, str]] = []
    shapes = [(), (0, 3), (5,), (4, 3, 2)]
    with VariableStore(ps, 1 << 16, comm=world) as store:
        per_rank = [[store.allocate(s, dtype, name=f"r{r}{s}") for s in shapes]
                    for r in range(world.size)]
        fresh = attempt(problems, "fresh read", lambda: store.read(per_rank[0][2]))
        if fresh is not None and not np.all(fresh == 0):
            problems.append(f"a fresh variable reads {fresh.tolist()}, expected zeros")
        world.Barrier()  # nobody assigns before every rank has read the fresh value

        def value(rank, shape):
            k = (np.arange(int(np.prod(shape, dtype=np.int64))) * 7 + rank * 3) % 23 - 11
            v = k / 4 if np.dtype(dtype).kind == "f" else k * 100003
            return np.asarray(v, dtype).reshape(shape)

        for shape, handle in zip(shapes, per_rank[world.rank]):
            attempt(problems, f"assign {shape}",
                    lambda h=handle, s=shape: store.assign(h, value(world.rank, s)))
        world.Barrier()
        for rank in range(world.size):
            for shape, handle in zip(shapes, per_rank[rank]):
                got = attempt(problems, f"read {shape}", lambda h=handle: store.read(h))
                if got is None:
                    continue
                want = value(rank, shape)
                if got.dtype != want.dtype or got.shape != want.shape \
                        or not np.array_equal(got, want):
                    problems.append(f"rank {rank}'s {shape} {dtype}: got {got!r}")
                digests.append((f"{rank}{shape}", digest(got)))
        world.Barrier()
    finish(world, problems, digests)


def test_unsupported_dtypes_and_misuse_raise_clear_errors(world):
    ps, _ = roles(world)
    problems: list[str] = []
    with VariableStore(ps, 1 << 12, comm=world) as store:
        for bad in ("complex64", "uint8", "bool", ">f4", "string"):
            expect_error(problems, f"dtype {bad}", TypeError,
                         lambda b=bad: store.allocate((2,), b), "float32", "int64")
        ints = store.allocate((2,), "int32")
        expect_error(problems, "float into int", TypeError,
                     lambda: store.assign(ints, [0.5, 1.5]), "int32")
        expect_error(problems, "wrong shape", ValueError,
                     lambda: store.assign(ints, [1, 2, 3]), "(2,)")
        expect_error(problems, "unknown ps", ValueError,
                     lambda: store.allocate((1,), "float32", ps=world.size + 5), "ps")
        expect_error(problems, "not a handle", TypeError, lambda: store.read((0, 0)))
        with VariableStore(ps, 1 << 12, comm=world) as other:
            alien = other.allocate((2,), "int32")
            expect_error(problems, "handle of another store", ValueError,
                         lambda: store.read(alien), "store")
        world.Barrier()
    expect_error(problems, "use after free", RuntimeError, lambda: store.read(ints), "freed")
    # ranks that disagree on the arena fail together
    if world.size > 1:
        expect_error(problems, "disagreeing ranks", ValueError,
                     lambda: VariableStore(ps, 4096 + (world.rank % 2) * 64, comm=world),
                     "cannot create", "disagree")
    expect_error(problems, "empty ps list", ValueError, lambda: VariableStore([], 64,
                                                                              comm=world))
    finish(world, problems, [])


# --- the arena ---------------------------------------------------------------------------


def test_full_arena_names_the_sizes_and_the_fix(world, monkeypatch):
    ps, _ = roles(world)
    problems: list[str] = []
    with VariableStore(ps[:1], 1024, comm=world) as store:
        store.allocate((250,), "float32", name="big")  # 1000 bytes, 1024 aligned
        expect_error(problems, "full", ArenaFullError,
                     lambda: store.allocate((3,), "float64", name="late"),
                     "'late'", "24 bytes", "1024 bytes", "0 free", ARENA_ENV)
        if not isinstance(ArenaFullError("x"), MemoryError):
            problems.append("ArenaFullError should be a MemoryError")
        if store.used != {ps[0]: 1024}:
            problems.append(f"a failed placement changed the bookkeeping: {store.used}")
        zero = attempt(problems, "empty variable", lambda: store.allocate((0,), "int64"))
        if zero is not None and store.read(zero).shape != (0,):
            problems.append("an empty variable should fit in a full arena")
    with VariableStore(ps, 1024, comm=world) as store:
        store.allocate((200,), "float32")  # 800 of ps[0]'s 1024 bytes
        expect_error(problems, "sharded", ArenaFullError,
                     lambda: store.allocate_sharded((2 * len(ps), 64), "float32",
                                                    [2 * len(ps), 1], name="emb"),
                     "'emb'", "1024 bytes", ARENA_ENV)
        if store.used[ps[0]] != 832 or any(store.used[p] for p in ps[1:]):
            problems.append(f"a failed sharded placement placed shards: {store.used}")
        nxt = store.allocate((1,), "int32")
        if nxt.ps != ps[1 % len(ps)]:
            problems.append(f"a failed placement advanced the round robin: next on {nxt.ps}")
    monkeypatch.setenv(ARENA_ENV, "4096")
    with VariableStore(ps, comm=world) as store:
        if store.arena_bytes != 4096:
            problems.append(f"{ARENA_ENV}=4096 gave an arena of {store.arena_bytes}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = arena_bytes_from_env({ARENA_ENV: "lots"})
    if got != DEFAULT_ARENA_BYTES or not any(ARENA_ENV in str(w.message) for w in caught):
        problems.append(f"a bad {ARENA_ENV} should warn and give the default: {got}")
    if arena_bytes_from_env({}) != 256 << 20:
        problems.append("the default arena should be 256 MiB")
    finish(world, problems, [])
