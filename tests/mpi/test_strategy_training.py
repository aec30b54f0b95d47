"""End to end: logistic regression in NumPy trained with MultiWorkerMirroredStrategy (every
rank x G in {1, 2} replicas, a distributed dataset of shuffled global batches with a
partial last batch, per-replica gradients) reaches the parameters of the same model
trained in one process on the global batches, and after every step every replica of
every rank holds bitwise identical parameters (one allgather of digests per step).

Two ways to combine the gradients, as training scripts do:

* ``ReplicaContext.all_reduce(SUM, (gradient sum, example count))`` then an
  ONLY_FIRST_REPLICA update (the all-reduced step is identical on every replica);
* a MEAN-aggregated MirroredVariable update of each replica's scaled step.
"""

from __future__ import annotations

import numpy as np
import pytest
from _checks import digest

import mpistrat as ms
from mpistrat import AutoShardPolicy, Dataset
from mpistrat.data import Options

MPI = pytest.importorskip("mpi4py.MPI")

FEATURES, EXAMPLES, BATCH, EPOCHS, LR = 4, 45, 8, 2, 0.5


def make_data():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(EXAMPLES, FEATURES))
    x = np.concatenate([x, np.ones((EXAMPLES, 1))], axis=1)  # a bias column
    truth = rng.normal(size=FEATURES + 1)
    y = (x @ truth + 0.5 * rng.normal(size=EXAMPLES) > 0).astype(np.float64)
    return x, y


def make_dataset(x, y):
    options = Options()
    options.experimental_distribute.auto_shard_policy = AutoShardPolicy.DATA
    return (Dataset.from_tensor_slices((x, y)).shuffle(EXAMPLES, seed=5).batch(BATCH)
            .repeat(EPOCHS).with_options(options))


def gradient_sum(theta, x, y):
    """Sum over the examples of the log-loss gradient (an empty batch gives zeros)."""
    p = 1.0 / (1.0 + np.exp(-(x @ theta)))
    return x.T @ (p - y)


def reference(dataset):
    theta = np.zeros(FEATURES + 1)
    for x, y in dataset:
        theta = theta - LR * gradient_sum(theta, x, y) / len(y)
    return theta


@pytest.mark.parametrize("g", [1, 2])
@pytest.mark.parametrize("combine", ["all_reduce", "mean_update"])
def test_training_matches_one_process_and_replicas_stay_identical(world, g, combine):
    x, y = make_data()
    dataset = make_dataset(x, y)
    expected = reference(dataset)
    s = ms.MultiWorkerMirroredStrategy(comm=world, local_replicas=g)
    n = s.num_replicas_in_sync
    start = np.random.default_rng(world.rank).normal(size=FEATURES + 1)  # rank 0's wins
    with s.scope():
        aggregation = "only_first_replica" if combine == "all_reduce" else "mean"
        theta = ms.Variable(start, aggregation=aggregation, name="theta")
    theta.assign(np.zeros(FEATURES + 1))  # cross-replica: every copy, on every rank

    def step(xb, yb):
        ctx = ms.get_replica_context()
        local = gradient_sum(theta.numpy(), xb, yb)
        if combine == "all_reduce":
            total, count = ctx.all_reduce("sum", (local, np.float64(len(yb))))
            theta.assign_sub(LR * total / count)
        else:  # every replica's share, so that the MEAN over N replicas is the step
            count = ctx.all_reduce("sum", np.float64(len(yb)))
            theta.assign_sub(LR * local * n / count)
        return np.float64(len(yb))

    steps = 0
    problems = []
    for xb, yb in s.experimental_distribute_dataset(dataset):
        counts = s.run(step, args=(xb, yb))
        steps += 1
        if s.reduce("sum", counts) == 0:
            problems.append(f"step {steps} had no examples")
        digests = world.allgather([digest(c) for c in theta.values])
        if len({d for rank in digests for d in rank}) != 1:
            problems.append(f"step {steps}: replicas differ: {digests}")
    assert not problems
    assert steps == EPOCHS * -(-EXAMPLES // BATCH)
    assert not np.array_equal(theta.numpy(), np.zeros(FEATURES + 1))
    np.testing.assert_allclose(theta.numpy(), expected, rtol=1e-12, atol=1e-12)
