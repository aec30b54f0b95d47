"""What tells a distributed input's iterators apart across an elastic relaunch
(``_DistributedInput._kind``): the same input built alike in another process, on any
number of workers, is the same kind; another pipeline (another shuffle seed: another
epoch) or another dataset function is not."""

from __future__ import annotations

import numpy as np

from mpistrat.data import (
    AutoShardPolicy,
    Dataset,
    DistributedDataset,
    DistributedDatasetsFromFunction,
    Options,
)

_DATA = Options()
_DATA.experimental_distribute.auto_shard_policy = AutoShardPolicy.DATA


def _distributed(dataset, workers=2, worker=0):
    return DistributedDataset(dataset.with_options(_DATA), num_workers=workers,
                              worker_index=worker,
                              replicas_per_worker=1, wrap=lambda parts: parts[0])


def _epoch(seed: int) -> Dataset:
    return Dataset.from_tensor_slices(np.arange(40)).shuffle(40, seed=seed).batch(8)


def test_the_same_pipeline_is_the_same_kind_on_every_worker_and_world_size():
    kinds = {_distributed(_epoch(3), w, i)._kind() for w in (1, 2, 3, 4) for i in range(w)}
    assert len(kinds) == 1, kinds
    (kind,) = kinds
    assert kind.startswith("DistributedDataset/5/"), kind  # (5 global batches)


def test_another_epoch_or_pipeline_is_another_kind():
    kinds = {_distributed(_epoch(3))._kind(), _distributed(_epoch(4))._kind(),
             _distributed(Dataset.from_tensor_slices(np.arange(40)).batch(8))._kind()}
    assert len(kinds) == 3, kinds


def _train_fn(ctx):
    return Dataset.from_tensor_slices(np.arange(40)).shard(
        ctx.num_input_pipelines, ctx.input_pipeline_id).batch(4)


def _eval_fn(ctx):
    return _train_fn(ctx)


def test_a_dataset_function_is_its_kind_whatever_the_worker():
    def built(fn, workers, worker):
        return DistributedDatasetsFromFunction(fn, num_workers=workers, worker_index=worker,
                                               replicas_per_worker=1,
                                               wrap=lambda parts: parts[0])._kind()

    train = {built(_train_fn, w, i) for w in (1, 2, 4) for i in range(w)}
    assert len(train) == 1, train
    assert train != {built(_eval_fn, 2, 0)}
