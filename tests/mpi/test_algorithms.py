"""Every all-reduce algorithm, run directly with ``dispatch.run`` / ``dispatch.compose``
on contiguous 1-D buffers, at every rank count and on every communicator.

Rank ``r`` contributes a pattern computed from ``r`` alone (small integers modulo 17, so
float16 never overflows; divided by 3 for floats, so float sums really round); the
expected result is computed in float64, in closed form, on every rank. Integers and
MIN/MAX must match exactly; float sums within ``(contributions + 2) * eps * sum(|x|)``.

A rank never asserts in the middle of a loop of collectives (the other ranks would wait
for it in the next collective): each test records its problems, gathers the sha256 of
every result once at the end (all ranks must hold bitwise identical results), and only
then asserts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from _checks import _dtype, _eps, digest, finish, problem

from mpistrat import ReduceOp, algorithms, dispatch
from mpistrat.algorithms import Implementation, halving_doubling, ring
from mpistrat.algorithms.hierarchical import hierarchical
from mpistrat.backends import get_backend
from mpistrat.runtime.topology import get_topology

# --- inputs and references -------------------------------------------------------------

PERIOD = 1021  # contributions repeat with this (prime) period, so references of huge
# buffers are computed on one period and tiled


def _pattern(rank: int, replica: int = 0) -> np.ndarray:
    j = np.arange(PERIOD)
    base = (j * 7 + (j // 17) * 3 + 3) % 17 + 1
    return (base * (rank + 1) + replica) % 17 - 8  # int64 in [-8, 8]


def contribution(rank: int, length: int, dtype: np.dtype, replica: int = 0) -> np.ndarray:
    """What ``rank`` (local replica ``replica``) contributes: a fresh contiguous array."""
    k = _pattern(rank, replica)
    one_period = k.astype(dtype) if dtype.kind in "iu" else (k / 3).astype(dtype)
    return np.resize(one_period, length)


def reference(op: ReduceOp, size: int, length: int, dtype: np.dtype,
              replicas: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(expected value, allowed absolute error), in float64, for every element."""
    m = min(length, PERIOD)
    stack = np.stack([contribution(r, m, dtype, g).astype(np.float64)
                      for r in range(size) for g in range(replicas)])
    count = size * replicas
    if op is ReduceOp.MIN:
        ref, tol = stack.min(axis=0), np.zeros(m)
    elif op is ReduceOp.MAX:
        ref, tol = stack.max(axis=0), np.zeros(m)
    else:
        ref = stack.sum(axis=0)
        tol = (count + 2) * _eps(dtype) * np.abs(stack).sum(axis=0)
        if op is ReduceOp.MEAN:
            ref, tol = ref / count, tol / count
            if dtype.kind in "iu":  # float64 result of an exact integer sum
                tol = 4 * np.finfo(np.float64).eps * np.abs(ref)
    if m < length:
        ref, tol = np.resize(ref, length), np.resize(tol, length)
    return ref, tol


def run_and_check(call, comm, buf, op: ReduceOp, dtype: np.dtype, label: str,
                  problems: list[str], digests: list[tuple[str, str]],
                  length: int | None = None) -> None:
    """Run ``call()`` (an all-reduce of ``buf``), then record a problem if it raised or
    ``buf`` is not the reduction of every rank's :func:`contribution` of ``length``
    elements (default ``buf.size``), else its digest; every rank keeps in step."""
    try:
        call()
    except Exception as exc:  # record, keep the ranks in step
        problems.append(f"{label}: raised {exc!r}")
        return
    length = buf.size if length is None else length
    found = problem(buf, *reference(op, comm.size, length, dtype), dtype, label)
    if found:
        problems.append(found)
    digests.append((label, digest(buf)))


# --- the algorithms under test ---------------------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    alg: str | tuple[str, str]  # a registered name, or (intra, inter) for compose
    ranks_per_node: int | None = None

    @property
    def inter(self) -> str:
        if isinstance(self.alg, tuple):
            return self.alg[1]
        info = algorithms.get(self.alg)
        return info.inter if info.hierarchical else self.alg

    @property
    def hierarchical(self) -> bool:
        return isinstance(self.alg, tuple) or algorithms.get(self.alg).hierarchical

    def run(self, comm, buf, op: ReduceOp, shards: int = 1, rotation: int = 0) -> None:
        backend = get_backend(buf)
        if isinstance(self.alg, tuple):
            dispatch.compose(*self.alg)(comm, buf, op=op, shards=shards, backend=backend,
                                          rotation=rotation,
                                          ranks_per_node=self.ranks_per_node)
        else:
            dispatch.run(self.alg, comm, buf, op=op, shards=shards, backend=backend,
                           rotation=rotation, ranks_per_node=self.ranks_per_node)

    def shards(self, comm) -> list[int]:
        """The shard counts 1..3 this case can run on ``comm`` (pscpu: at most the pool)."""
        if self.inter != "pscpu":
            return [1, 2, 3]
        pool = comm.size
        if self.hierarchical:
            pool = get_topology(comm, self.ranks_per_node).num_nodes
            if pool == 1:  # the cross-node stage (where shards apply) is skipped
                return [1, 2, 3]
        return list(range(1, min(3, pool) + 1))


CASES = [
    Case("xring", "xring"),
    Case("rechd", "rechd"),
    Case("pscpu", "pscpu"),
    Case("native", "native"),
    Case("pscpu/pscpu", "pscpu/pscpu"),  # physical nodes: one here, intra stage only
    Case("pscpu/pscpu@1", "pscpu/pscpu", 1),  # every rank a node: cross-node stage only
    Case("pscpu/pscpu@2", "pscpu/pscpu", 2),  # both stages
    Case("xring/rechd@2", ("xring", "rechd"), 2),
    Case("rechd/pscpu@2", ("rechd", "pscpu"), 2),
    Case("native/xring@2", ("native", "xring"), 2),
    Case("pscpu/native@3", ("pscpu", "native"), 3),
    Case("shm", "shm"),
    Case("shm/xring", "shm/xring"),  # one physical node: the intra stage and the broadcast
    Case("shm/xring@1", "shm/xring", 1),
    Case("shm/rechd@2", "shm/rechd", 2),
    Case("shm/pscpu@2", "shm/pscpu", 2),
    Case("shm/native@3", ("shm", "native"), 3),
]
CASE_IDS = [c.id for c in CASES]

DTYPES = ["float16", "float32", "float64", "int32", "int64", "bfloat16"]


def _lengths(n: int) -> list[int]:
    # 0, 1, n-1, n, n+1; primes; 1031 is prime and above rechd's 2 KiB recursive-doubling
    # cut for every dtype but int8, so rechd's halving-doubling path runs too
    return sorted({0, 1, n - 1, n, n + 1, 2 * n + 1, 7, 13, 1031})


# --- tests -----------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_every_length_and_shard_count(comm, case):
    """Lengths 0, 1, n-1, n, n+1, primes; shards 1..3; exact int64 SUM and float32 MAX."""
    n = comm.size
    problems: list[str] = []
    digests: list[tuple[str, str]] = []
    combos = [(ReduceOp.SUM, np.dtype(np.int64)), (ReduceOp.MAX, np.dtype(np.float32)),
              (ReduceOp.SUM, np.dtype(np.float64))]
    rotation = 0
    for length in _lengths(n):
        for shards in case.shards(comm):
            op, dtype = combos[rotation % len(combos)]
            rotation += 1
            label = f"{case.id} length={length} shards={shards} {op} {dtype}"
            buf = contribution(comm.rank, length, dtype)
            run_and_check(lambda: case.run(comm, buf, op, shards, rotation), comm, buf, op,
                          dtype, label, problems, digests)
    finish(comm, problems, digests)


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_every_dtype_and_op(comm, case, dtype_name):
    """Every op (MEAN runs as SUM inside an algorithm) for every dtype, on a few lengths."""
    dtype = _dtype(dtype_name)
    n = comm.size
    shards = max(case.shards(comm))
    problems: list[str] = []
    digests: list[tuple[str, str]] = []
    for op, length in ((ReduceOp.SUM, n + 1), (ReduceOp.SUM, 1031), (ReduceOp.MIN, 1031),
                       (ReduceOp.MAX, n + 1), (ReduceOp.MEAN, 13)):
        label = f"{case.id} {dtype_name} {op} length={length} shards={shards}"
        buf = contribution(comm.rank, length, dtype)
        try:
            case.run(comm, buf, op, shards, rotation=length)
        except Exception as exc:
            problems.append(f"{label}: raised {exc!r}")
            continue
        expect = ReduceOp.SUM if op is ReduceOp.MEAN else op  # the caller divides
        found = problem(buf, *reference(expect, n, length, dtype), dtype, label)
        if found:
            problems.append(found)
        digests.append((label, digest(buf)))
    finish(comm, problems, digests)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_rotation_moves_gather_ranks(comm, case):
    """Successive rotations pick other gather groups; every one gives the same result."""
    n = comm.size
    shards = max(case.shards(comm))
    dtype = np.dtype(np.int32)
    problems: list[str] = []
    digests: list[tuple[str, str]] = []
    ref = reference(ReduceOp.SUM, n, 2 * n + 3, dtype)
    for rotation in range(min(n, 3) + 1):
        buf = contribution(comm.rank, 2 * n + 3, dtype)
        case.run(comm, buf, ReduceOp.SUM, shards, rotation)
        found = problem(buf, *ref, dtype, f"{case.id} rotation={rotation}")
        if found:
            problems.append(found)
        digests.append((f"rotation={rotation}", digest(buf)))
    finish(comm, problems, digests)


LARGE = (16 << 20) // 4 + 3  # float32 elements: a little over 16 MiB, odd length


@pytest.mark.parametrize(
    ("case", "shards"),
    [(Case("xring", "xring"), 2), (Case("rechd", "rechd"), 1), (Case("pscpu", "pscpu"), 3),
     (Case("native", "native"), 1), (Case("pscpu/pscpu@2", "pscpu/pscpu", 2), 2),
     (Case("shm", "shm"), 1), (Case("shm/xring@2", "shm/xring", 2), 2)],
    ids=lambda value: value.id if isinstance(value, Case) else f"shards{value}",
)
def test_large_buffer(world, case, shards):
    """A buffer above 16 MiB, float32 SUM, each algorithm once (COMM_WORLD only)."""
    shards = min(shards, max(case.shards(world)))
    dtype = np.dtype(np.float32)
    buf = contribution(world.rank, LARGE, dtype)
    assert buf.nbytes >= 16 << 20
    case.run(world, buf, ReduceOp.SUM, shards)
    found = problem(buf, *reference(ReduceOp.SUM, world.size, LARGE, dtype), dtype,
                    f"{case.id} large")
    finish(world, [found] if found else [], [(case.id, digest(buf))])


def test_complex_sum(comm):
    """Complex buffers reduce as pairs of floats (SUM), with every flat algorithm."""
    n = comm.size
    problems: list[str] = []
    digests: list[tuple[str, str]] = []
    expected = sum(contribution(r, 11, np.dtype(np.float64)) * (1 - 2j) for r in range(n))
    for name in ("xring", "rechd", "pscpu", "native", "shm"):
        buf = contribution(comm.rank, 11, np.dtype(np.float64)) * (1 - 2j)
        dispatch.run(name, comm, buf, op=ReduceOp.SUM, backend=get_backend(buf))
        if not np.allclose(buf, expected, rtol=1e-12, atol=1e-12):
            problems.append(f"{name}: got {buf}, expected {expected}")
        digests.append((name, digest(buf)))
    finish(comm, problems, digests)


class _Spy:
    """An ``Implementation`` stage that records on which communicator size it ran."""

    def __init__(self, function):
        self.calls: list[int] = []
        self.function = function

    def __call__(self, comm, buf, **kwargs):
        self.calls.append(comm.Get_size())
        self.function(comm, buf, **kwargs)


@pytest.mark.parametrize("ranks_per_node", [1, 2, 3])
def test_hierarchical_runs_the_cross_node_stage(comm, ranks_per_node):
    """With virtual nodes, leaders run the inter stage over one rank per node."""
    topology = get_topology(comm, ranks_per_node)
    n, k = comm.size, ranks_per_node
    problems = []
    if len(set(topology.hostnames)) == 1 and topology.num_nodes != -(-n // k):
        problems.append(f"{topology.num_nodes} virtual nodes of {k} ranks out of {n}")
    intra, inter = _Spy(ring.all_reduce), _Spy(halving_doubling.all_reduce)
    dtype = np.dtype(np.int64)
    buf = contribution(comm.rank, 2 * n + 5, dtype)
    hierarchical(comm, buf, op=ReduceOp.SUM, shards=1, backend=get_backend(buf), rotation=0,
                 intra=Implementation(intra), inter=Implementation(inter),
                 ranks_per_node=ranks_per_node)
    found = problem(buf, *reference(ReduceOp.SUM, n, 2 * n + 5, dtype), dtype, "spy")
    if found:
        problems.append(found)
    expected_intra = [topology.local_size] if topology.local_size > 1 else []
    if intra.calls != expected_intra:
        problems.append(f"intra stage calls {intra.calls}, expected {expected_intra}")
    expected_inter = ([topology.num_nodes] if topology.is_leader and topology.num_nodes > 1
                      else [])
    if inter.calls != expected_inter:
        problems.append(f"inter stage calls {inter.calls}, expected {expected_inter}")
    finish(comm, problems, [("spy", digest(buf))])


@pytest.mark.parametrize("ranks_per_node", [None, 1, 2])
def test_one_node_runs_the_node_stage_as_one_all_reduce(comm, ranks_per_node):
    """On a single node ``a/b`` is ``a``'s all-reduce over the node (every rank gathering
    a piece for a shuffle), not a reduce onto the leader and a broadcast; across nodes
    the reduce-to-root runs."""
    from mpistrat.algorithms import shuffle

    topology = get_topology(comm, ranks_per_node)
    shards_seen: list[int] = []

    def all_reduce(node_comm, buf, **kwargs):
        shards_seen.append(kwargs["shards"])
        shuffle.all_reduce(node_comm, buf, **kwargs)

    roots = _Spy(shuffle.reduce_to_root)
    dtype = np.dtype(np.int64)
    buf = contribution(comm.rank, 3 * comm.size + 1, dtype)
    hierarchical(comm, buf, op=ReduceOp.SUM, shards=1, backend=get_backend(buf), rotation=0,
                 intra=Implementation(all_reduce, roots), node_shards=True,
                 inter=Implementation(halving_doubling.all_reduce),
                 ranks_per_node=ranks_per_node)
    problems = []
    found = problem(buf, *reference(ReduceOp.SUM, comm.size, 3 * comm.size + 1, dtype),
                    dtype, "one node")
    if found:
        problems.append(found)
    single = topology.num_nodes == 1 and topology.local_size > 1
    expected = ([topology.local_size], []) if single else \
        ([], [topology.local_size] if topology.local_size > 1 else [])
    if (shards_seen, roots.calls) != expected:
        problems.append(f"{topology.num_nodes} node(s): all-reduce shards {shards_seen}, "
                        f"reduce-to-root calls {roots.calls}; expected {expected}")
    finish(comm, problems, [("one node", digest(buf))])


@pytest.mark.parametrize("alg", [("shm", "rechd"), ("pscpu", "pscpu"), ("xring", "xring"),
                                 ("native", "pscpu")], ids="/".join)
def test_multi_node_buffers_run_pipelined_piece_by_piece(comm, alg):
    """Across virtual nodes of 2 ranks, a buffer of several PIPELINE_BYTES pieces goes
    across nodes piece by piece, each piece once per node, the pieces taking turns among
    the local ranks every node has (at 4 ranks: pieces 0 and 2 from the leaders, 1 from
    local rank 1; at 3 ranks the node of one rank leaves it all to the leaders), and
    every rank ends exact and identical."""
    from mpistrat.algorithms.hierarchical import PIPELINE_BYTES

    topology = get_topology(comm, 2)
    intra, inter = dispatch.implementation(alg[0]), dispatch.implementation(alg[1])
    sizes: list[int] = []

    def far_all_reduce(peers, buf, **kwargs):
        sizes.append(buf.size)
        inter.all_reduce(peers, buf, **kwargs)

    dtype = np.dtype(np.float32)
    length = (5 * PIPELINE_BYTES) // dtype.itemsize // 2 + 3  # 2.5 pieces -> 3
    buf = contribution(comm.rank, length, dtype)
    hierarchical(comm, buf, op=ReduceOp.SUM, shards=1, backend=get_backend(buf), rotation=0,
                 intra=intra, inter=Implementation(far_all_reduce), ranks_per_node=2)
    problems = []
    found = problem(buf, *reference(ReduceOp.SUM, comm.size, length, dtype), dtype, "pipe")
    if found:
        problems.append(found)
    seen = comm.allgather((topology.node, topology.local_rank, sizes))
    if topology.num_nodes > 1:
        owners = min(len(ranks) for ranks in topology.node_ranks)
        for node in range(topology.num_nodes):
            by_rank = {local: s for n, local, s in seen if n == node}
            counts = {local: len(s) for local, s in by_rank.items()}
            want = {local: (len(range(local, 3, owners)) if local < owners else 0)
                    for local in by_rank}
            if counts != want or sum(map(sum, by_rank.values())) != length:
                problems.append(f"node {node}: pieces across nodes by local rank {by_rank}, "
                                f"expected counts {want} covering {length} elements")
    finish(comm, problems, [("pipe", digest(buf))])


def test_compose_is_cached_and_rejects_gpu_and_unknown_stages():
    assert dispatch.compose("xring", "rechd") is dispatch.compose("xring", "rechd")
    from mpistrat.errors import BackendUnavailable, UnknownAlgorithmError

    with pytest.raises(BackendUnavailable, match="'nccl'"):
        dispatch.compose("nccl", "xring")
    with pytest.raises(UnknownAlgorithmError, match="'xrng'"):
        dispatch.compose("xring", "xrng")
    with pytest.raises(UnknownAlgorithmError, match="'ring'"):
        dispatch.implementation("ring")
