"""``batch_reduce`` of ResNet-50's gradient batch across the hosts of the cluster.

Run by tests/cluster/test_training.py under ``mpiexec``. The batch is ResNet-50 v1's 161
gradient shapes (``mpistrat.bench.shapes.resnet50_gradient_shapes``, 25.5 M float32 elements,
97.5 MiB per replica), as ``mpistrat bench --batch resnet50`` builds it: one
``PerReplica`` of G local CPU replicas per tensor, each pair ``(value, value)``, through
``MultiWorkerAllReduce(...).batch_reduce`` (docs/cross_device_ops.md).

Every element is a small integer (``[-5, 5]``, depending on its place in the batch, the
rank and the replica), so the expected SUM and MEAN (a division by a power of two) are
exact: every replica of every tensor must equal it bit for bit, the inputs must be left
alone, and the sha256 of all results must be the same on every rank.

``python _check_batch.py NAME=SPEC,PACKS,G,OP ...`` runs one configuration per argument;
rank 0 prints ``RESULT {json}`` with the problems of every configuration (``[]``: none).
"""

from __future__ import annotations

import hashlib
import json
import socket
import sys

import numpy as np
from mpi4py import MPI

import mpistrat as ms
from mpistrat.bench.shapes import resnet50_gradient_shapes
from mpistrat.values import components_of


def _position(length: int) -> np.ndarray:
    i = np.arange(length, dtype=np.int64)
    return (i * 7 + (i >> 10) * 3 + (i >> 16) * 5) % 11


def _table(rank: int, replica: int) -> np.ndarray:
    return (np.arange(11) + 3 * rank + 5 * replica) % 11 - 5


def check(comm, name: str, spec: str, packs: int, replicas: int, op: str,
          shapes, sizes, offsets, position) -> tuple[list[str], str]:
    """One configuration: (problems, sha256 of every result in order)."""
    rank, size = comm.rank, comm.size
    flats = [_table(rank, g)[position].astype(np.float32) for g in range(replicas)]
    inputs = [[flat[o:o + n].reshape(s) for o, n, s in zip(offsets, sizes, shapes)]
              for flat in flats]
    pairs = [(v, v) for v in (ms.PerReplica([inputs[g][i] for g in range(replicas)])
                              for i in range(len(shapes)))]
    total = sum(_table(r, g) for r in range(size) for g in range(replicas))
    want = total[position].astype(np.float64)
    if op == "mean":
        want /= size * replicas
    want = want.astype(np.float32)
    ops = ms.MultiWorkerAllReduce(**({} if spec == "default" else {"all_reduce_spec": spec}),
                                  num_packs=packs, comm=comm)
    problems: list[str] = []
    label = f"{name} (spec {spec}, num_packs={packs}, G={replicas}, {op})"
    try:
        result = ops.batch_reduce(op, pairs)
    except Exception as exc:  # keep in step with the other ranks
        return [f"{label}: raised {exc!r}"], "raised"
    h = hashlib.sha256()
    if not isinstance(result, list) or len(result) != len(shapes):
        return [f"{label}: returned {type(result).__name__}, expected a list of "
                f"{len(shapes)} Mirrored values"], "malformed"
    wrong_tensors = []
    for i, (mirrored, o, n, s) in enumerate(zip(result, offsets, sizes, shapes)):
        values = [np.asarray(v) for v in components_of(mirrored)]
        if len(values) != replicas:
            problems.append(f"{label}: tensor {i} {s} has {len(values)} values, expected "
                            f"{replicas}")
            continue
        expect = want[o:o + n].reshape(s)
        for g, v in enumerate(values):
            if v.shape != tuple(s) or v.dtype != np.float32:
                problems.append(f"{label}: tensor {i} replica {g} is {v.dtype}{v.shape}, "
                                f"expected float32{s}")
            elif not np.array_equal(v, expect):
                bad = np.flatnonzero(v != expect)
                wrong_tensors.append(f"tensor {i} {s} replica {g}: {bad.size} of {n} wrong, "
                                     f"first at {bad[0]}: got {v.reshape(-1)[bad[0]]}, "
                                     f"expected {expect.reshape(-1)[bad[0]]}")
        h.update(np.ascontiguousarray(values[0]).tobytes())
    if wrong_tensors:
        problems.append(f"{label}: {len(wrong_tensors)} wrong: {wrong_tensors[:5]}")
    for g, flat in enumerate(flats):
        if not np.array_equal(flat, _table(rank, g)[position].astype(np.float32)):
            problems.append(f"{label}: batch_reduce changed replica {g}'s inputs")
    return problems, h.hexdigest()


def main() -> int:
    comm = MPI.COMM_WORLD
    shapes = resnet50_gradient_shapes()
    sizes = [int(np.prod(s)) for s in shapes]
    offsets = np.concatenate([[0], np.cumsum(sizes)])[:-1].tolist()
    position = _position(sum(sizes))
    problems, digests = [], []
    for arg in sys.argv[1:]:
        name, _, rest = arg.partition("=")
        spec, packs, replicas, op = rest.split(",")
        found, digest = check(comm, name, spec, int(packs), int(replicas), op, shapes, sizes,
                              offsets, position)
        problems += [f"[rank {comm.rank}] {p}" for p in found]
        digests.append((name, digest))
    everyone = comm.allgather(digests)
    differ = sorted({name for theirs in everyone
                     for (name, mine), (_, them) in zip(digests, theirs) if mine != them})
    if differ:
        problems.append(f"[rank {comm.rank}] results differ bitwise between ranks: {differ}")
    gathered = comm.gather(problems)
    hosts = comm.gather(socket.gethostname())
    if comm.rank == 0:
        print("RESULT " + json.dumps({
            "hosts": hosts, "tensors": len(shapes), "elements": sum(sizes),
            "configurations": [a.partition("=")[0] for a in sys.argv[1:]],
            "problems": [p for mine in gathered for p in mine]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
