#!/usr/bin/env python
"""Asynchronous parameter servers against synchronous all-reduce, with one slow worker.

    mpistrat run -n 2 benchmarks/ps_stragglers.py --delay 0.05             # synchronous
    mpistrat run -n 4 --num-ps 1 benchmarks/ps_stragglers.py --delay 0.05  # parameter servers

The same training step either way: the gradient of a least-squares model (``--features``
weights) on a batch of ``--batch`` examples, applied with SGD. Worker 0 sleeps ``--delay``
seconds in every step (a straggler: a slower node, a noisy neighbour). Both modes run
``--steps`` batches per worker-equivalent and print the batches trained per second and
the final loss:

* without ``--num-ps``: ``MultiWorkerMirroredStrategy`` over every rank; each step every
  rank computes its batch, the gradients are all-reduced, every rank applies the mean. A
  step takes as long as its slowest rank.
* with ``--num-ps``: ``ParameterServerStrategy``; the coordinator schedules single-batch
  steps, each worker takes the next one when it is free, reads the weights and applies
  its gradient on the ps. The fast workers keep going while worker 0 sleeps.

Rank 0 prints one line. Compare batches per second between the modes with the same number
of workers (ranks minus the coordinator and the ps), interleaved in one sitting.
"""

from __future__ import annotations

import argparse
import itertools
import os
import time

import numpy as np

import mpistrat as ms


def make_data(features: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    truth = rng.normal(size=features).astype(np.float32)
    x = rng.normal(size=(4096, features)).astype(np.float32)
    return x, x @ truth, truth


def gradient(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return (2.0 / len(x)) * (x.T @ (x @ w - y))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delay", type=float, default=0.05, help="worker 0's extra seconds")
    parser.add_argument("--steps", type=int, default=100, help="batches per worker")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args()
    x, y, truth = make_data(args.features)

    if os.environ.get("MPISTRAT_NUM_PS"):
        strategy = ms.ParameterServerStrategy()
        coordinator = ms.ClusterCoordinator(strategy)
        workers = strategy.num_workers
        with strategy.scope():
            w = ms.Variable(np.zeros(args.features, np.float32))
        delay, batch, lr, features = args.delay, args.batch, args.lr, args.features
        # the data is built on each worker (a dataset function that captured x and y
        # would carry them to every worker once; a step that captured them, every step)
        data = iter(coordinator.create_per_worker_dataset(
            lambda: itertools.repeat(make_data(features)[:2])))

        def step(i: int, data: object) -> None:
            if ms.experimental_get_current_worker_index() == 0:
                time.sleep(delay)
            x, y = next(data)  # type: ignore[call-overload]
            rows = np.arange(i * batch, (i + 1) * batch) % len(x)
            w.assign_sub(lr * gradient(w.numpy(), x[rows], y[rows]))

        total = args.steps * workers
        for _ in range(2 * workers):  # warm-up: every worker builds its data
            coordinator.schedule(step, args=(0, data))
        coordinator.join()
        start = time.perf_counter()
        for i in range(total):
            coordinator.schedule(step, args=(i, data))
        coordinator.join()
        elapsed = time.perf_counter() - start
        final = w.numpy()
        mode = f"parameter servers ({strategy.num_ps} ps)"
    else:
        strategy = ms.get_strategy() if ms.has_strategy() else ms.MultiWorkerMirroredStrategy()
        workers = strategy.extended.num_workers
        rank = strategy.extended.worker_index
        weights = np.zeros(args.features, np.float32)
        total = args.steps * workers
        start = time.perf_counter()
        for i in range(args.steps):
            if rank == 0:
                time.sleep(args.delay)
            rows = np.arange((i * workers + rank) * args.batch,
                             (i * workers + rank + 1) * args.batch) % len(x)
            g = ms.all_reduce(gradient(weights, x[rows], y[rows]), "mean", "rechd",
                              strategy.comm)
            weights -= args.lr * g
        elapsed = time.perf_counter() - start
        final = weights
        mode = "synchronous all-reduce"
        if rank != 0:
            return
    loss = float(np.mean((x @ final - y) ** 2))
    print(f"{mode}: {workers} workers, worker 0 +{args.delay * 1e3:.0f} ms a step: "
          f"{total / elapsed:,.1f} batches/s ({total} batches in {elapsed:.2f} s), "
          f"final loss {loss:.4g}, weight error {float(np.abs(final - truth).max()):.3g}",
          flush=True)


if __name__ == "__main__":
    main()
