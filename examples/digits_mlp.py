"""Data-parallel training of an MLP on scikit-learn's bundled digits (8x8 images, 10
classes; no download), in NumPy on CPU replicas or CuPy on GPU replicas.

    mpistrat run -n 2 examples/digits_mlp.py                 # 2 ranks, 1 replica each
    mpirun -n 4 mpistrat run examples/digits_mlp.py --epochs 30
    mpistrat run -n 2 --local-replicas 2 examples/digits_mlp.py
    mpistrat run -n 2 --gpus-per-rank 1 examples/digits_mlp.py       # CuPy, NCCL
    mpistrat run -n 2 examples/digits_mlp.py --checkpoint-dir ckpt   # resumes if restarted

Every replica computes the gradient of its part of each global batch; one batched
all-reduce sums them; every rank applies the same update. The gradient is the mean over
the global batch whatever the number of ranks, so 1, 2 or 4 ranks with the same global
batch train the same model (up to float rounding). Rank 0 prints one line per epoch.

The same code runs on both kinds of replica: on GPU replicas the strategy hands each
replica its batches and its copy of every variable as CuPy arrays on its GPU, so the
math below (written against the array's own module, ``xp``) runs there.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import mpistrat as ms


def load_data(seed: int, path: str | None = None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Digits scaled to [0, 1], split 80/20 with a fixed permutation: scikit-learn's
    bundled copy, or ``path``, a file in its format (``digits.csv.gz``: 64 pixels and the
    label per row)."""
    if path is not None:
        rows = np.loadtxt(path, delimiter=",")
        data, target = rows[:, :-1], rows[:, -1]
    else:
        try:
            from sklearn.datasets import load_digits
        except ImportError:
            sys.exit("this example reads scikit-learn's bundled digits: pip install "
                     "'mpistrat[examples]', or give --data digits.csv.gz")
        digits = load_digits()
        data, target = digits.data, digits.target
    x = (data / 16.0).astype(np.float32)
    y = target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    cut = int(0.8 * len(x))
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


def init_params(hidden: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(0, np.sqrt(2 / 64), (64, hidden)).astype(np.float32),
            np.zeros(hidden, np.float32),
            rng.normal(0, np.sqrt(1 / hidden), (hidden, 10)).astype(np.float32),
            np.zeros(10, np.float32)]


def array_module(array):
    """NumPy for host arrays, CuPy for device arrays (imported only when one is seen)."""
    return sys.modules["cupy"] if type(array).__module__.startswith("cupy") else np


def forward(params: list, x):
    xp = array_module(x)
    w1, b1, w2, b2 = params
    h = xp.maximum(x @ w1 + b1, 0)
    logits = h @ w2 + b2
    logits -= logits.max(axis=1, keepdims=True)
    p = xp.exp(logits)
    return h, p / p.sum(axis=1, keepdims=True)


def loss_and_grads(params: list, x, y):
    """Sums over this replica's examples: (loss, correct, gradients), arrays of x's kind."""
    xp = array_module(x)
    w1, _, w2, _ = params
    h, p = forward(params, x)
    n = len(x)
    loss = -xp.log(p[xp.arange(n), y] + 1e-12).sum()
    correct = (p.argmax(axis=1) == y).sum().astype(np.float32)
    d = p.copy()
    d[xp.arange(n), y] -= 1
    dh = (d @ w2.T) * (h > 0)
    grads = [x.T @ dh, dh.sum(axis=0), h.T @ d, d.sum(axis=0)]
    return loss.astype(np.float32), correct, [g.astype(np.float32) for g in grads]


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", default=None,
                        help="save every epoch here and resume from the last checkpoint")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--data", default=None,
                        help="digits in scikit-learn's digits.csv.gz format, instead of "
                             "scikit-learn's own copy")
    args = parser.parse_args(argv)

    strategy = ms.get_strategy() if ms.has_strategy() else ms.MultiWorkerMirroredStrategy()
    chief = strategy.extended.should_checkpoint
    x_train, y_train, x_test, y_test = load_data(args.seed, args.data)

    with strategy.scope():
        params = [ms.Variable(p, name=n) for p, n in
                  zip(init_params(args.hidden, args.seed), ("w1", "b1", "w2", "b2"))]
        velocity = [ms.Variable(np.zeros_like(p.numpy()), name=f"v_{p.name}", trainable=False)
                    for p in params]
        epoch_done = ms.Variable(0, name="epoch", trainable=False)

    manager = preemption = None
    if args.checkpoint_dir:  # resume from the last complete checkpoint, if there is one
        state = ms.Checkpoint(comm=strategy.comm, **{v.name: v for v in params + velocity},
                              epoch=epoch_done)
        manager = ms.CheckpointManager(state, args.checkpoint_dir, max_to_keep=3)
        restored = manager.restore_or_initialize()
        if restored and chief:
            print(f"resumed from {restored} (epoch {int(epoch_done.numpy())})", flush=True)
        # SIGTERM/SIGUSR1 (Slurm's warning before preemption or the time limit): every rank
        # saves at the same epoch boundary and exits with status 42, "requeue me"
        preemption = ms.PreemptionCheckpointHandler(manager)

    options = ms.Options()
    options.experimental_distribute.auto_shard_policy = ms.AutoShardPolicy.DATA

    def epoch_batches(epoch: int):
        """Epoch ``epoch``'s global batches, in an order fixed by the epoch number, so a
        resumed run sees exactly the batches an uninterrupted one would."""
        dataset = (ms.Dataset.from_tensor_slices((x_train, y_train))
                   .shuffle(len(x_train), seed=args.seed * 1000 + epoch)
                   .batch(args.batch_size).with_options(options))
        return strategy.experimental_distribute_dataset(dataset)

    def apply_gradients(strategy: ms.Strategy, grads: tuple) -> None:
        """Cross-replica: the same summed gradients on every rank -> the same update
        (read_value(): the first replica's copy, where it lives; assigning updates every
        replica's copy)."""
        for p, v, g in zip(params, velocity, grads):
            g = strategy.experimental_local_results(g)[0] / args.batch_size
            v.assign(args.momentum * v.read_value() - args.lr * g)
            p.assign_add(v.read_value())

    def train_step(batch: tuple) -> tuple:
        x, y = batch  # this replica's part of the global batch, on its device
        loss, correct, grads = loss_and_grads([p.read_value() for p in params], x, y)
        ctx = ms.get_replica_context()
        grads = ctx.all_reduce(ms.ReduceOp.SUM, tuple(grads))  # one batched all-reduce
        ctx.merge_call(apply_gradients, args=(grads,))
        return loss, correct

    # the test set where the first replica computes (its GPU for GPU replicas)
    placement = strategy.extended.placement
    x_eval, y_eval = placement.put(x_test, 0), placement.put(y_test, 0)
    epochs = range(int(epoch_done.numpy()), args.epochs)
    progress = _progress(epochs, chief and not args.no_progress)
    accuracy = 0.0
    for epoch in progress:
        started = time.perf_counter()
        loss_sum = correct_sum = 0.0
        for batch in epoch_batches(epoch):
            loss, correct = strategy.run(train_step, args=(batch,))
            loss_sum += float(strategy.reduce(ms.ReduceOp.SUM, loss))
            correct_sum += float(strategy.reduce(ms.ReduceOp.SUM, correct))
        with placement.on(0):
            _, p = forward([v.read_value() for v in params], x_eval)
            accuracy = float((p.argmax(axis=1) == y_eval).mean())
        epoch_done.assign(epoch + 1)
        if manager is not None:
            manager.save()
        if chief:
            _print(progress, f"epoch {epoch + 1:3d}/{args.epochs}  loss {loss_sum / len(x_train):.4f}"
                   f"  train acc {correct_sum / len(x_train):.4f}  test acc {accuracy:.4f}"
                   f"  ({time.perf_counter() - started:.2f} s, {strategy.num_replicas_in_sync}"
                   f" replicas)")
        if preemption is not None:
            preemption.save_checkpoint_if_preempted()
    if chief:
        print(f"final test accuracy {accuracy:.4f}", flush=True)
    return accuracy


def _progress(epochs: range, show: bool):
    if show:
        try:
            from tqdm import tqdm

            return tqdm(epochs, desc="epochs", unit="epoch", leave=False)
        except ImportError:
            pass
    return epochs


def _print(progress, line: str) -> None:
    if hasattr(progress, "write"):
        progress.write(line)
    else:
        print(line, flush=True)


if __name__ == "__main__":
    main()
