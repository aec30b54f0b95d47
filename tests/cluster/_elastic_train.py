"""The training run of tests/cluster/test_elastic.py: softmax regression on synthetic
data under the default ``MultiWorkerMirroredStrategy`` of ``mpistrat run``, with a
``CheckpointManager`` (a checkpoint on disk each epoch) and nothing else for elasticity.

    mpistrat run -n 4 --min-ranks 2 --timeout 8 tests/cluster/_elastic_train.py \\
        --checkpoint-dir DIR --out FILE [--epochs 3] [--step-sleep 0.05] [--ballast-mib 5]

Each step trains on one global batch of a distributed dataset (the global batch is fixed;
it is split over however many ranks there are) and also adds each sample's id to
``seen``, a per-sample counter that is part of the model: after the run, every sample
must have been applied exactly ``epochs`` times, whatever was lost and redone. With
``--ballast-mib``, a variable of that size is part of the model too, every element of it
counting the steps applied (a state large enough that each host's ranks share its
snapshot's copy).

Rank 0 prints ``launch L on N ranks: restored R at step S`` and ``launch times: script T0
restored T1`` (wall-clock times: the script's start, the restore's end) first, then
``step S at T``
after each step (S counted from the start of training, T its wall-clock time), and at the
end writes FILE (``.npz``): the
final weights, ``seen``, and the weights one process gets by training on the same global
batches in the same order with plain NumPy (the reference). :func:`check_recovered` is
what the tests assert of a run that lost a host.
"""

from __future__ import annotations

import time

STARTED = time.time()  # (the script's start: the launch, Python and MPI are up)

import argparse  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import numpy as np  # noqa: E402

import mpistrat as ms  # noqa: E402

SAMPLES, FEATURES, CLASSES = 512, 8, 4


def data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(SAMPLES, FEATURES))
    y = (x @ rng.normal(size=(FEATURES, CLASSES))).argmax(axis=1)
    return x, y


def gradient(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The summed cross-entropy gradient of ``x``'s rows."""
    logits = x @ w
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1
    return x.T @ p


def batches(x: np.ndarray, y: np.ndarray, epoch: int, batch: int) -> ms.Dataset:
    ids = np.arange(len(x))
    return ms.Dataset.from_tensor_slices((x, y, ids)).shuffle(len(x), seed=epoch).batch(batch)


def reference(x: np.ndarray, y: np.ndarray, epochs: int, batch: int, lr: float) -> np.ndarray:
    """The same training in one process: every global batch once, in order."""
    w = np.zeros((FEATURES, CLASSES))
    for epoch in range(epochs):
        for xb, yb, _ in batches(x, y, epoch, batch):
            w -= lr * gradient(w, xb, yb) / batch
    return w


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32, help="global batch")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument("--ballast-mib", type=float, default=0.0)
    args = parser.parse_args()

    strategy = ms.get_strategy()
    rank = strategy.comm.Get_rank()
    x, y = data()
    options = ms.Options()
    options.experimental_distribute.auto_shard_policy = ms.AutoShardPolicy.DATA
    with strategy.scope():
        w = ms.Variable(np.zeros((FEATURES, CLASSES)), name="w")
        seen = ms.Variable(np.zeros(SAMPLES), name="seen", trainable=False)
        epoch_done = ms.Variable(0, name="epoch", trainable=False)
        step = ms.Variable(0, name="step", trainable=False)
        ballast = ms.Variable(np.zeros(int(args.ballast_mib * 2**20) // 8), name="ballast",
                              trainable=False)
    state = {"w": w, "seen": seen, "epoch": epoch_done, "step": step}
    if args.ballast_mib:
        state["ballast"] = ballast
    one = np.ones(ballast.shape)
    manager = ms.CheckpointManager(ms.Checkpoint(**state), args.checkpoint_dir, max_to_keep=2)
    restored = manager.restore_or_initialize()
    launch = ms.elastic.info()
    if rank == 0:
        print(f"launch {launch.restart if launch else 0} on {strategy.comm.Get_size()} ranks: "
              f"restored {restored} at step {int(step.numpy())}", flush=True)
        print(f"launch times: script {STARTED:.3f} restored {time.time():.3f}", flush=True)

    def train_step(batch: tuple) -> None:
        xb, yb, ids = batch
        counts = np.zeros(SAMPLES)
        np.add.at(counts, ids, 1)
        ctx = ms.get_replica_context()
        grad, counts = ctx.all_reduce(ms.ReduceOp.SUM, (gradient(w.read_value(), xb, yb),
                                                         counts))

        def apply(strategy: ms.Strategy, grad: object, counts: object) -> None:
            w.assign_sub(args.lr * strategy.experimental_local_results(grad)[0] / args.batch)
            seen.assign_add(strategy.experimental_local_results(counts)[0])
            step.assign_add(1)
            if args.ballast_mib:
                ballast.assign_add(one)

        ctx.merge_call(apply, args=(grad, counts))

    for epoch in range(int(epoch_done.numpy()), args.epochs):
        dataset = batches(x, y, epoch, args.batch).with_options(options)
        for batch in strategy.experimental_distribute_dataset(dataset):
            strategy.run(train_step, args=(batch,))
            if rank == 0:
                print(f"step {int(step.numpy())} at {time.time():.3f}", flush=True)
            time.sleep(args.step_sleep)
        epoch_done.assign(epoch + 1)
        manager.save()
    if rank == 0:
        np.savez(args.out, w=w.numpy(), seen=seen.numpy(),
                 reference=reference(x, y, args.epochs, args.batch, args.lr),
                 sizes=np.array(launch.sizes if launch else [strategy.comm.Get_size()]),
                 steps=int(step.numpy()), ballast=ballast.numpy())
        print("finished", flush=True)
    return 0


# -- what the tests check of a run that lost node2 (test_elastic.py, test_elastic_slurm.py)

STEP = re.compile(r"^step (\d+) at ([\d.]+)$", re.M)
TIMES = re.compile(r"^launch times: script ([\d.]+) restored ([\d.]+)$", re.M)
LAUNCH = re.compile(r"^launch (\d+) on (\d+) ranks: restored (\S+) at step (\d+)$", re.M)


def steps(output: str) -> list[tuple[int, float]]:
    """``(step, wall-clock time)`` of every ``step S at T`` line of rank 0."""
    return [(int(s), float(t)) for s, t in STEP.findall(output)]


@dataclass
class Recovery:
    """When a run that lost a host went on (wall-clock times)."""

    before: int  # the last step done before the fault
    resumed_at: int  # the step the relaunch restored
    first: float  # when the survivors' first step was done
    started: float  # when the relaunched script started
    restored: float  # when its restore returned


def check_recovered(output: str, fault_at: float, result: str | os.PathLike[str],
                    epochs: int, bound: float) -> Recovery:
    """Assert what a run under ``mpistrat run -n 4 --min-ranks 2`` that lost node2 (2 of
    its 4 ranks) must show: relaunched once on node1's 2 ranks from a snapshot in
    /dev/shm, at most one step redone, the first step on the survivors within ``bound``
    seconds of the fault, the final weights those of one process, every sample applied
    ``epochs`` times."""
    assert re.search(r"mpistrat run: lost host node2 \(ranks 2, 3\); restart 1 of \d+ on 2 "
                     r"ranks \(node1:2\)", output), output
    launches = LAUNCH.findall(output)
    assert [(int(n), int(r)) for n, r, _, _ in launches] == [(0, 4), (1, 2)], output
    restored, resumed_at = launches[1][2], int(launches[1][3])
    assert "/dev/shm/mpistrat-elastic-" in restored, output  # a snapshot, not the disk
    done = steps(output)
    before = max(s for s, t in done if t < fault_at)
    # at most one step redone: the snapshot is the state after the last step taken or
    # the one before it (the fault can land between a step's end and the next boundary)
    assert before - 1 <= resumed_at <= before, (before, resumed_at, output)
    first = min(t for s, t in done if t > fault_at and s == resumed_at + 1)
    assert first - fault_at <= bound, (first - fault_at, output)
    started, restored_at = (float(t) for t in TIMES.findall(output)[1])
    saved = np.load(result)
    assert list(saved["sizes"]) == [4, 2]
    np.testing.assert_allclose(saved["w"], saved["reference"], rtol=1e-9, atol=1e-12)
    assert np.array_equal(saved["seen"], np.full(len(saved["seen"]), float(epochs))), \
        f"samples not applied exactly {epochs} times: {np.unique(saved['seen'])}"
    assert np.array_equal(saved["ballast"], np.full(len(saved["ballast"]),
                                                    float(saved["steps"]))), \
        f"the ballast counts {np.unique(saved['ballast'])} steps, not {saved['steps']}"
    return Recovery(before, resumed_at, first, started, restored_at)

if __name__ == "__main__":
    sys.exit(main())
