#!/usr/bin/env python
"""What an elastic job's snapshot costs a training step (docs/elastic.md).

    mpiexec -n 2 .venv/bin/python benchmarks/elastic_snapshot.py [--state digits|resnet50]

Steps run under a ``MultiWorkerMirroredStrategy``, in blocks of consecutive steps (as in
training, a background snapshot overlaps the next step; the block ends when its last
snapshot is committed), timed per step in three variants, interleaved (round robin, a
barrier before each block, its slowest rank's time; see ``benchmarks/_interleave.py``):

* ``off``: the step alone;
* ``background``: a snapshot at the step boundary, then the step (what an elastic job
  does: mpistrat's variables are copied into ``/dev/shm`` by a thread while the step
  runs; the update waits for the copy if it has not finished);
* ``sync``: the same snapshot written before the step goes on (``background=False``);
* ``auto``: ``--snapshot-every auto``'s rule: a snapshot at a boundary once the time since
  the last one is at least 1 / 3 % of what it cost.

States:

* ``digits``: ``examples/digits_mlp.py``'s model and momentum (4 + 4 variables, 37 KiB),
  its training step on one global batch of 64;
* ``resnet50``: ResNet-50's 161 parameter tensors (97.5 MiB float32) and a step that
  all-reduces a gradient of each (one batched all-reduce) and applies SGD: the
  communication and update of a ResNet-50 step without its compute, unless
  ``--compute-ms`` adds some (a background copy overlaps it, where a core is free).
* ``torch-resnet50``: the same parameters in a torch module, with ``torch.optim.SGD``'s
  momentum (195 MiB in all once it has stepped), snapshotted as the checkpoint's stateful
  leaves; a step all-reduces one flat gradient (``MPI_Allreduce``, standing for DDP's)
  and steps the optimizer.
* ``torch-resnet50-zero``: the same with ``mpistrat.torch.ZeroRedundancyOptimizer``
  (SGD with momentum): each rank of a host holds the momentum of its share of the
  parameters, the parameters are one copy in the host's shared memory.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from _interleave import interleaved  # noqa: E402

import mpistrat as ms  # noqa: E402
from mpistrat.bench.shapes import resnet50_gradient_shapes  # noqa: E402
from mpistrat.checkpoint.snapshot import SnapshotStore  # noqa: E402
from mpistrat.elastic.env import AUTO_SHARE, ElasticEnv  # noqa: E402


def digits_state(strategy: Any) -> tuple[list[Any], Any]:
    import digits_mlp as digits

    x, y, _, _ = digits.load_data(0)
    xb, yb = x[:64], y[:64]
    with strategy.scope():
        params = [ms.Variable(p) for p in digits.init_params(64, 0)]
        velocity = [ms.Variable(np.zeros_like(p.numpy())) for p in params]
    shard = slice(strategy.comm.Get_rank() * 64 // strategy.comm.Get_size(),
                  (strategy.comm.Get_rank() + 1) * 64 // strategy.comm.Get_size())

    def apply(strategy: Any, grads: tuple) -> None:
        for p, v, g in zip(params, velocity, grads):
            g = strategy.experimental_local_results(g)[0] / 64
            v.assign(0.9 * v.read_value() - 0.1 * g)
            p.assign_add(v.read_value())

    def replica_step() -> None:
        _, _, grads = digits.loss_and_grads([p.read_value() for p in params], xb[shard],
                                            yb[shard])
        ctx = ms.get_replica_context()
        ctx.merge_call(apply, args=(ctx.all_reduce(ms.ReduceOp.SUM, tuple(grads)),))

    return params + velocity, lambda: strategy.run(replica_step)


def compute(milliseconds: float) -> Any:
    """A fixed amount of work (float32 matrix products) that takes about ``milliseconds``
    on this rank alone, standing for a step's forward and backward pass: calibrated once,
    so that other work on the same cores makes it slower, as it would a real step."""
    if not milliseconds:
        return lambda: None
    a = np.random.default_rng(1).standard_normal((192, 192), np.float32)
    started, n = time.perf_counter(), 0
    while time.perf_counter() - started < 0.2:
        a @ a
        n += 1
    count = max(1, round(n * milliseconds / 1e3 / (time.perf_counter() - started)))

    def work() -> None:
        for _ in range(count):
            a @ a
    return work


def resnet50_state(strategy: Any) -> tuple[list[Any], Any]:
    rng = np.random.default_rng(0)
    with strategy.scope():
        params = [ms.Variable(rng.standard_normal(shape, np.float32) * 0.01)
                  for shape in resnet50_gradient_shapes()]
    grads = tuple(np.full(p.shape, 1e-6, np.float32) for p in params)

    def apply(strategy: Any, reduced: tuple) -> None:
        for p, g in zip(params, reduced):
            p.assign_sub(strategy.experimental_local_results(g)[0])

    def replica_step() -> None:
        ctx = ms.get_replica_context()
        ctx.merge_call(apply, args=(ctx.all_reduce(ms.ReduceOp.SUM, grads),))

    return params, lambda: strategy.run(replica_step)


def torch_resnet50_state(strategy: Any, zero: bool = False) -> tuple[list[Any], Any]:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    shapes = resnet50_gradient_shapes()
    model = torch.nn.ParameterList(
        [torch.nn.Parameter(torch.randn(*shape) * 0.01) for shape in shapes])
    if zero:
        import mpistrat.torch as mt

        optimizer = mt.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD,
                                               comm=strategy.comm, lr=0.01, momentum=0.9)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sizes = [int(np.prod(shape)) for shape in shapes]
    flat = np.full(sum(sizes), 1e-6, np.float32)
    reduced = np.empty_like(flat)
    ends = np.cumsum(sizes)
    for p, end, size, shape in zip(model, ends, sizes, shapes):
        p.grad = torch.from_numpy(reduced[end - size:end]).view(*shape)
    comm = strategy.comm

    def step() -> None:
        comm.Allreduce(flat, reduced)
        optimizer.step()
    return [model, optimizer], step


def _state_bytes(state: list[Any], comm: Any) -> int:
    """The state's bytes (collective: a ZeRO optimizer's shares are summed over the
    ranks, of one host here)."""
    if all(isinstance(v, ms.Variable) for v in state):
        return sum(np.asarray(v.numpy()).nbytes for v in state)
    from mpistrat.checkpoint._torch import nbytes

    sharded = [obj for obj in state if hasattr(obj, "consolidate_state_dict")]
    return sum(nbytes(obj) for obj in state if obj not in sharded) + comm.allreduce(
        sum(nbytes(obj.optim) for obj in sharded if obj.optim is not None))


STATES = {"digits": digits_state, "resnet50": resnet50_state,
          "torch-resnet50": torch_resnet50_state,
          "torch-resnet50-zero": lambda strategy: torch_resnet50_state(strategy, zero=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state", choices=tuple(STATES), default="digits")
    parser.add_argument("--iters", type=int, default=0, help="default: 300 digits, 30 resnet50")
    parser.add_argument("--dir", default=None, help="snapshot root (default /dev/shm)")
    parser.add_argument("--compute-ms", type=float, default=0.0,
                        help="add this much computation (calibrated matrix products) to "
                             "each step before its all-reduce, as a forward and backward "
                             "pass would be (default 0: the step's communication only)")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    strategy = ms.MultiWorkerMirroredStrategy()
    state, update = STATES[args.state](strategy)
    work = compute(args.compute_ms)

    def step() -> None:
        work()
        update()
    checkpoint = ms.Checkpoint(state=state)
    root = args.dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    stores = {mode: SnapshotStore(  # (each its own job: its own directory)
        checkpoint, ElasticEnv(comm.bcast(secrets.token_hex(16)), 0, (comm.Get_size(),)),
        b"benchmark", root=root, background=mode != "sync")
        for mode in ("background", "sync", "auto")}

    block = 10 if args.state == "digits" else 3

    last = [0.0]

    def steps(store: SnapshotStore | None, auto: bool = False) -> Any:
        def call() -> None:
            for _ in range(block):
                # auto: CheckpointManager's rule for --snapshot-every auto (rank 0 decides
                # where every rank takes every snapshot)
                due = not auto or not store.taken or \
                    (time.perf_counter() - last[0]) * AUTO_SHARE >= store.last_cost
                if auto and store.collective:
                    due = comm.bcast(due, root=0)
                if store is not None and due:
                    store.take(("benchmark", 0))
                    last[0] = time.perf_counter()
                step()
            if store is not None:
                store.wait()  # (the last snapshot's background work counts too)
        return call

    iters = args.iters or (60 if args.state == "digits" else 12)
    times = interleaved(comm, {"off": steps(None), "background": steps(stores["background"]),
                               "sync": steps(stores["sync"]),
                               "auto": steps(stores["auto"], auto=True)}, iters, warmup=2)
    times = {name: {k: v / block for k, v in t.items()} for name, t in times.items()}
    for store in stores.values():
        store.close(remove=True)
    size = _state_bytes(state, comm)
    if comm.Get_rank() == 0:
        base = times["off"]["median"]
        print(f"{args.state}: {size / 2**20:.2f} MiB of state, {comm.Get_size()} ranks, "
              f"{args.compute_ms:g} ms of computation a step, "
              f"median of {iters} blocks of {block} steps each, interleaved")
        print(f"{'variant':12} {'step ms':>9} {'p10':>8} {'p90':>8} {'x off':>7}")
        for name, t in times.items():
            print(f"{name:12} {t['median'] * 1e3:9.3f} {t['p10'] * 1e3:8.3f} "
                  f"{t['p90'] * 1e3:8.3f} {t['median'] / base:7.3f}")
        auto = stores["auto"]
        each = {m: stores[m].seconds / max(stores[m].taken, 1) * 1e3
                for m in ("sync", "background")}
        print(f"auto took {auto.taken} snapshots in {(iters + 2) * block} steps (one every "
              f"{(iters + 2) * block / max(auto.taken, 1):.1f}); one snapshot's time in "
              f"take() on rank 0: sync {each['sync']:.3f} ms, background "
              f"{each['background']:.3f} ms")


if __name__ == "__main__":
    main()
