"""A custom training loop written against the replica context: linear least squares on a
fixed synthetic data set (no download).

    mpistrat run -n 2 examples/custom_loop.py
    mpistrat run -n 3 --local-replicas 2 examples/custom_loop.py --steps 200

What it shows:

* ``ms.Variable(..., aggregation=MEAN)`` created in ``strategy.scope()``: a mirrored
  variable; ``assign_sub`` inside ``strategy.run`` averages the replicas' updates across
  every rank before applying them, so all copies stay identical;
* ``ReplicaContext.all_reduce`` on a nest (a dict) inside the step, for the global
  squared error and example count;
* ``strategy.reduce(MEAN, per_replica, axis=0)``: the mean over the actual examples, also
  for the last, partial batch (replicas then hold different numbers of examples).
"""

from __future__ import annotations

import argparse

import numpy as np

import mpistrat as ms


def make_data(n: int = 1000, features: int = 8, seed: int = 0):
    rng = np.random.default_rng(seed)
    true_w = rng.normal(size=features)
    x = rng.normal(size=(n, features))
    y = x @ true_w + 0.5 + 0.01 * rng.normal(size=n)
    return x, y, true_w


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=100, help="global batch")
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args(argv)

    strategy = ms.get_strategy() if ms.has_strategy() else ms.MultiWorkerMirroredStrategy()
    x, y, true_w = make_data()
    with strategy.scope():
        w = ms.Variable(np.zeros(x.shape[1]), aggregation=ms.VariableAggregation.MEAN)
        b = ms.Variable(0.0, aggregation=ms.VariableAggregation.MEAN)

    dataset = ms.Dataset.from_tensor_slices((x, y)).repeat().batch(args.batch_size)
    options = ms.Options()
    options.experimental_distribute.auto_shard_policy = ms.AutoShardPolicy.DATA
    batches = iter(strategy.experimental_distribute_dataset(dataset.with_options(options)))

    def step(batch):
        xb, yb = batch
        err = xb @ np.asarray(w) + float(np.asarray(b)) - yb
        n = max(len(xb), 1)
        # each replica steps along its own mean gradient; MEAN aggregation averages them
        w.assign_sub(args.lr * 2 * xb.T @ err / n)
        b.assign_sub(args.lr * 2 * err.sum() / n)
        totals = ms.get_replica_context().all_reduce(
            ms.ReduceOp.SUM, {"sq": np.sum(err ** 2), "n": np.float64(len(xb))})
        return err ** 2, totals

    mse = 0.0
    for index in range(args.steps):
        squared, totals = strategy.run(step, args=(next(batches),))
        mse = float(strategy.reduce(ms.ReduceOp.MEAN, squared, axis=0))
        total = strategy.experimental_local_results(totals)[0]
        assert np.isclose(mse, total["sq"] / total["n"])  # the two ways agree
        if strategy.extended.should_checkpoint and (index + 1) % 50 == 0:
            print(f"step {index + 1:4d}  mse {mse:.6f}", flush=True)

    distance = float(np.abs(np.asarray(w) - true_w).max())
    if strategy.extended.should_checkpoint:
        print(f"final mse {mse:.6f}; largest weight error {distance:.4f} "
              f"({strategy.num_replicas_in_sync} replicas)", flush=True)
    return mse


if __name__ == "__main__":
    main()
