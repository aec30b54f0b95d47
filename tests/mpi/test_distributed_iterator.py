"""TF's iterator API over real MPI ranks: ``iter(dist_dataset)`` is a
``DistributedIterator`` whose ``get_next_as_optional`` ends the epoch on every worker at
the same step, also when the workers hold different numbers of batches (a rank whose data
ran out gets empty batches until the others' has too); ``get_next`` then raises
``OutOfRangeError`` on every rank, and ``reduce`` folds an epoch."""

from __future__ import annotations

import numpy as np
import pytest

import mpistrat as ms
from mpistrat import Dataset
from mpistrat.errors import OutOfRangeError

MPI = pytest.importorskip("mpi4py.MPI")


@pytest.mark.parametrize("g", [1, 2])
def test_get_next_as_optional_ends_every_worker_at_the_same_step(world, g):
    strategy = ms.MultiWorkerMirroredStrategy(comm=world, local_replicas=g)
    rank = world.rank

    def dataset_fn(ctx):  # worker w holds w + 1 per-replica batches of 2 ids each
        ids = np.arange(100 * ctx.input_pipeline_id, 100 * ctx.input_pipeline_id
                        + 2 * g * (ctx.input_pipeline_id + 1))
        return Dataset.from_tensor_slices(ids).batch(2)

    dist = strategy.distribute_datasets_from_function(dataset_fn)
    assert isinstance(dist, ms.DistributedDataset)
    iterator = iter(dist)
    assert isinstance(iterator, ms.DistributedIterator) and iter(iterator) is iterator
    assert iterator.element_spec.shape == (None,)
    seen, steps = [], 0
    while True:
        optional = iterator.get_next_as_optional()
        if not optional.has_value():
            break
        steps += 1
        seen += [i for part in strategy.experimental_local_results(optional.get_value())
                 for i in np.asarray(part).tolist()]
    assert steps == world.size  # the longest worker's: every rank took as many
    assert sorted(seen) == list(range(100 * rank, 100 * rank + 2 * g * (rank + 1)))
    with pytest.raises(ValueError, match="empty Optional"):
        optional.get_value()
    with pytest.raises(OutOfRangeError, match="ended on every worker"):
        iterator.get_next()  # (no collective: the end is already agreed)
    with pytest.raises(StopIteration):
        next(iterator)
    assert sorted(sum(world.allgather(seen), [])) == sorted(
        i for w in range(world.size) for i in range(100 * w, 100 * w + 2 * g * (w + 1)))


def test_get_next_and_reduce_over_a_dataset_split_by_the_strategy(world):
    strategy = ms.MultiWorkerMirroredStrategy(comm=world)
    dataset = Dataset.from_tensor_slices(np.arange(10.0)).batch(4)  # 4, 4, 2 examples
    options = ms.Options()
    options.experimental_distribute.auto_shard_policy = ms.AutoShardPolicy.DATA
    dist = strategy.experimental_distribute_dataset(dataset.with_options(options))
    iterator = iter(dist)
    firsts = [np.asarray(iterator.get_next()) for _ in range(3)]
    with pytest.raises(OutOfRangeError):
        iterator.get_next()
    mine = float(sum(part.sum() for part in firsts))
    assert sum(world.allgather(mine)) == 45.0
    total = dist.reduce(0.0, lambda state, x: state + strategy.reduce(
        ms.ReduceOp.SUM, strategy.run(lambda v: v.sum(), args=(x,)), axis=None))
    assert total == 45.0  # the same on every rank: each step's sum over all replicas
