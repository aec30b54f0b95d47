"""Asynchronous parameter-server training of the digits MLP (scikit-learn's bundled 8x8
digits; no download).

    mpistrat run -n 4 --num-ps 1 examples/digits_ps.py        # 1 coordinator, 1 ps, 2 workers
    mpistrat run -n 5 --num-ps 2 examples/digits_ps.py --epochs 30
    mpistrat run -n 4 --num-ps 1 examples/digits_ps.py --checkpoint-dir ckpt   # resumes

Rank 0 coordinates: it creates the model's variables, which live on the ps ranks (the
first layer's weights sharded over them), and schedules training steps. Each step runs
on whichever worker is free: it reads the current weights, computes the gradient of one
batch of its own shuffled stream, and subtracts it from the weights on the ps, without
waiting for the other workers (a slow worker holds nobody back). After each epoch's steps
the coordinator measures the test accuracy and saves a checkpoint.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from digits_mlp import init_params, load_data, loss_and_grads

import mpistrat as ms


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per step")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", default=None,
                        help="save every epoch here and resume from the last checkpoint")
    args = parser.parse_args(argv)

    # every rank constructs it; only the coordinator (rank 0) gets past this line. The
    # first layer (16 KiB) is split over up to as many ps as there are (mpistrat run
    # --num-ps sets MPISTRAT_NUM_PS), in shards of at least 8 KiB.
    num_ps = int(os.environ.get("MPISTRAT_NUM_PS", "1"))
    strategy = ms.ParameterServerStrategy(
        variable_partitioner=ms.MinSizePartitioner(min_shard_bytes=8 << 10, max_shards=num_ps))
    coordinator = ms.ClusterCoordinator(strategy)
    x_train, y_train, x_test, y_test = load_data(args.seed)
    with strategy.scope():
        params = [ms.Variable(p, name=n) for p, n in
                  zip(init_params(args.hidden, args.seed), ("w1", "b1", "w2", "b2"))]
        epoch_done = ms.Variable(np.int64(0), name="epoch", trainable=False)

    manager = preemption = None
    if args.checkpoint_dir:  # the coordinator alone saves and restores
        state = ms.Checkpoint(**{v.name: v for v in params}, epoch=epoch_done)
        manager = ms.CheckpointManager(state, args.checkpoint_dir, max_to_keep=3)
        restored = manager.restore_or_initialize()
        if restored:
            print(f"resumed from {restored} (epoch {int(epoch_done.numpy())})", flush=True)
        # SIGTERM/SIGUSR1 (a preemption warning): save at the end of the epoch, exit 42
        # (the workers and ps ignore the signal and end with the coordinator)
        preemption = ms.PreemptionCheckpointHandler(manager)

    seed, batch = args.seed, args.batch_size

    def dataset_fn():
        """Built on each worker: the training set, shuffled by a seed of its own."""
        x, y, _, _ = load_data(seed)
        worker = ms.experimental_get_current_worker_index()
        return (ms.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=seed * 100 + worker)
                .batch(batch, drop_remainder=True).repeat())

    batches = iter(coordinator.create_per_worker_dataset(dataset_fn))
    lr = args.lr

    def step(iterator):
        """One asynchronous step on a worker: read, compute, update the ps."""
        x, y = next(iterator)
        loss, correct, grads = loss_and_grads([p.numpy() for p in params], x, y)
        for p, g in zip(params, grads):
            p.assign_sub(lr / len(x) * g)
        return float(loss), float(correct)

    steps = len(x_train) // batch
    accuracy = 0.0
    for epoch in range(int(epoch_done.numpy()), args.epochs):
        started = time.perf_counter()
        results = [coordinator.schedule(step, args=(batches,)) for _ in range(steps)]
        coordinator.join()
        losses, corrects = zip(*coordinator.fetch(results))
        w1, b1, w2, b2 = (p.numpy() for p in params)
        logits = np.maximum(x_test @ w1 + b1, 0) @ w2 + b2
        accuracy = float((logits.argmax(axis=1) == y_test).mean())
        epoch_done.assign(epoch + 1)
        if manager is not None:
            manager.save()
        print(f"epoch {epoch + 1:3d}/{args.epochs}  loss {sum(losses) / (steps * batch):.4f}"
              f"  train acc {sum(corrects) / (steps * batch):.4f}  test acc {accuracy:.4f}"
              f"  ({time.perf_counter() - started:.2f} s, {strategy.num_workers} workers, "
              f"{strategy.num_ps} ps)", flush=True)
        if preemption is not None:
            preemption.save_checkpoint_if_preempted()
    print(f"final test accuracy {accuracy:.4f}", flush=True)
    return accuracy


if __name__ == "__main__":
    main()
