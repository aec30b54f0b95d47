"""Every CPU all-reduce algorithm across the hosts of the cluster, in one MPI job.

Run by tests/cluster/test_algorithms.py under ``mpiexec`` (one job per layout: each launch
costs seconds). Every rank runs the same list of cases — every CPU algorithm name of
``mpistrat.algorithms.registry`` (flat and hierarchical) plus shard variants, each with
G = 1 and 2 local replicas, SUM and MEAN, float32, float64 and int32, lengths 0, 1, 7,
1031, 65537, and one large one per algorithm (16 MiB and more, so the pipelined and
multi-message paths run; its dtype, G and op rotate, ``python _check_allreduce.py K``
shifts the rotation) — through
``mpistrat.all_reduce(mpistrat.PerReplica(G_arrays), op=..., spec=..., comm=...)``.

Inputs are small integers (``[-5, 5]``), so every sum is exact in every dtype and every
MEAN divides by a power of two (2 or 4 ranks, 1 or 2 replicas): the expected value of
each element is exact, and the result must equal it bit for bit, on every replica of
every rank. A rank never stops in the middle: it records what was wrong (with the case's
label) and goes on, and at the end one allgather compares every case's sha256 digest
across ranks.

An algorithm that only works inside one node (``shm``) must, on a layout of several
hosts, raise :class:`mpistrat.TopologyError` on every rank naming the hierarchical forms
(and leave the communicator usable for the next case); that is checked too. (An empty
tensor is the exception: ``all_reduce`` returns it without running any algorithm.)

Rank 0 prints one line ``RESULT {json}``: the ranks' hosts, the node groups, the number
of cases, the problems (``[]`` when all is well) and rank 0's seconds per spec. Before
each case every rank writes the case's label to ``$CHECK_PROGRESS_DIR/rank-R`` (when
set), so a job that hangs tells the test where.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys

import numpy as np
from mpi4py import MPI

import mpistrat
from mpistrat.algorithms import registry
from mpistrat.errors import TopologyError
from mpistrat.runtime.topology import get_topology

SHARD_VARIANTS = ("xring#2", "pscpu#2", "pscpu/pscpu#2")
DTYPES = ("float32", "float64", "int32")
SMALL_LENGTHS = (0, 1, 7, 1031, 65537)  # 1031 (odd, prime): above rechd's 2 KiB cut
LARGE_BYTES = 16 << 20  # above 2 x the 4 MiB pieces of pscpu, rechd and the hierarchical


def specs() -> list[str]:
    """Every registered algorithm that runs on host buffers, then the shard variants."""
    names = [n for n in registry.names() if not registry.get(n).needs_gpu]
    return names + [s for s in SHARD_VARIANTS if s not in names]


def _position(length: int) -> np.ndarray:
    """Per element a value in 0..10 that is not periodic over any short distance, so a
    piece written to the wrong place shows."""
    i = np.arange(length, dtype=np.int64)
    return (i * 7 + (i >> 10) * 3 + (i >> 16) * 5) % 11


def contribution(position: np.ndarray, rank: int, replica: int, dtype: np.dtype) -> np.ndarray:
    """What ``rank``'s local replica ``replica`` contributes: integers in [-5, 5]."""
    table = (np.arange(11) + 3 * rank + 5 * replica) % 11 - 5
    return table[position].astype(dtype)


def expected(position: np.ndarray, size: int, replicas: int, op: str,
             dtype: np.dtype) -> np.ndarray:
    """The exact reduction (the sum is exact; MEAN divides by a power of two)."""
    table = sum((np.arange(11) + 3 * r + 5 * g) % 11 - 5
                for r in range(size) for g in range(replicas))
    if op == "mean":
        out_dtype = np.dtype(np.float64) if dtype.kind in "iu" else dtype
        return (table[position] / (size * replicas)).astype(out_dtype)
    return table[position].astype(dtype)


def digest(arrays: list[np.ndarray]) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


LARGE_VARIANTS = (("float32", 1, "sum"), ("float64", 2, "mean"), ("int32", 2, "sum"),
                  ("float32", 2, "mean"))


def cases(rotate: int = 0) -> list[tuple[str, int, str, str, int]]:
    """(spec, G, op, dtype, length) in the order every rank runs them. One large buffer
    per spec (a launch of the whole sweep must stay short); which dtype, G and op it has
    rotates over the specs, shifted by ``rotate`` (the tests give each layout its own)."""
    out = []
    for index, spec in enumerate(specs()):
        for replicas in (1, 2):
            for dtype in DTYPES:
                for k, length in enumerate(SMALL_LENGTHS):
                    op = ("sum", "mean")[(k + replicas) % 2]
                    out.append((spec, replicas, op, dtype, length))
        dtype, replicas, op = LARGE_VARIANTS[(index + rotate) % len(LARGE_VARIANTS)]
        out.append((spec, replicas, op, dtype, LARGE_BYTES // np.dtype(dtype).itemsize + 3))
    return out


def main() -> int:
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    topology = get_topology(comm)
    nodes = topology.num_nodes
    progress = os.environ.get("CHECK_PROGRESS_DIR")
    problems: list[str] = []
    digests: list[tuple[str, str]] = []
    positions: dict[int, np.ndarray] = {}
    todo = cases(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    seconds: dict[str, float] = {}  # per spec and size class, to see where a job's time goes
    for spec, replicas, op, dtype_name, length in todo:
        started = MPI.Wtime()
        dtype = np.dtype(dtype_name)
        label = (f"{spec} G={replicas} {op} {dtype_name} length={length} "
                 f"({size} ranks on {nodes} hosts)")
        if progress:
            with open(os.path.join(progress, f"rank-{rank}"), "w") as f:
                f.write(label)
        position = positions.get(length)
        if position is None:
            position = positions[length] = _position(length)
        inputs = [contribution(position, rank, g, dtype) for g in range(replicas)]
        alg = spec.split("#")[0]
        single_node = registry.get(alg).single_node and nodes > 1
        try:
            result = mpistrat.all_reduce(mpistrat.PerReplica(inputs), op=op, spec=spec,
                                         comm=comm)
        except TopologyError as exc:
            if not single_node:
                problems.append(f"{label}: raised {exc!r}")
            elif "inside one node" not in str(exc) or f"{alg}/" not in str(exc):
                problems.append(f"{label}: the TopologyError does not say that {alg} works "
                                f"inside one node and name its hierarchical forms: {exc}")
            digests.append((label, f"TopologyError {exc}"))
            continue
        except Exception as exc:  # record it, keep in step with the other ranks
            problems.append(f"{label}: raised {exc!r}")
            digests.append((label, f"raised {type(exc).__name__}"))
            continue
        if single_node and length:  # (nothing to reduce: all_reduce returns at once)
            problems.append(f"{label}: ran across {nodes} hosts; expected a TopologyError "
                            f"(it works inside one node only)")
        want = expected(position, size, replicas, op, dtype)
        if not isinstance(result, list) or len(result) != replicas:
            problems.append(f"{label}: returned {type(result).__name__} of "
                            f"{len(result) if isinstance(result, list) else '?'} arrays, "
                            f"expected a list of {replicas}")
            digests.append((label, "malformed"))
            continue
        for g, got in enumerate(result):
            if got.dtype != want.dtype or got.shape != want.shape:
                problems.append(f"{label}: replica {g} is {got.dtype}{got.shape}, expected "
                                f"{want.dtype}{want.shape}")
            elif not np.array_equal(got, want):
                bad = np.flatnonzero(got != want)
                problems.append(f"{label}: replica {g}: {bad.size} of {length} elements "
                                f"wrong, first at {bad[0]}: got {got[bad[0]]!r}, expected "
                                f"{want[bad[0]]!r}")
        if len({digest([r]) for r in result}) != 1:
            problems.append(f"{label}: the {replicas} replicas of one rank differ")
        digests.append((label, digest(result[:1])))
        key = f"{spec} {'large' if length * dtype.itemsize >= LARGE_BYTES else 'small'}"
        seconds[key] = seconds.get(key, 0.0) + MPI.Wtime() - started
    everyone = comm.allgather(digests)
    for other, theirs in enumerate(everyone):
        if len(theirs) != len(digests):
            problems.append(f"rank {other} ran {len(theirs)} cases, rank {rank} {len(digests)}")
            continue
        differ = [label for (label, mine), (_, them) in zip(digests, theirs) if mine != them]
        if differ:
            problems.append(f"results differ bitwise between rank {rank} and rank {other} in "
                            f"{len(differ)} case(s): {differ[:5]}")
    all_problems = comm.gather([f"[rank {rank}] {p}" for p in problems])
    hosts = comm.gather(socket.gethostname())
    if rank == 0:
        flat = [p for mine in all_problems for p in mine]
        print("RESULT " + json.dumps({
            "hosts": hosts, "node_of_rank": list(topology.node_of_rank),
            "nodes": nodes, "cases": len(todo), "specs": specs(), "problems": flat,
            "seconds": {k: round(v, 3) for k, v in seconds.items()}}),
            flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
