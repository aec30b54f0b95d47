"""Distributed input across real MPI ranks: every rank builds its DistributedDataset with
``agree_any`` = ``comm.allreduce(flag, op=MPI.LOR)``, iterates, and the ranks check (by
allgather) that every element was seen exactly once, that every rank took the same number
of steps and called the collective the same number of times. Pass at any ``-n``."""

from __future__ import annotations

import numpy as np
import pytest

from mpistrat.data import (
    AutoShardPolicy,
    Dataset,
    DistributedDataset,
    DistributedDatasetsFromFunction,
    Options,
)

MPI = pytest.importorskip("mpi4py.MPI")


def run(comm, make):
    """Iterate ``make(agree_any)`` for one epoch; gather (steps, calls, ids) of every rank."""
    calls = [0]

    def agree_any(flag):
        calls[0] += 1
        return comm.allreduce(bool(flag), op=MPI.LOR)

    steps = list(make(agree_any))
    ids = [int(v) for step in steps for piece in step for v in np.asarray(piece).ravel()]
    sizes = [[len(piece) for piece in step] for step in steps]
    return comm.allgather((len(steps), calls[0], ids, sizes))


def check_once(everyone, expected):
    """Same step and call counts everywhere; every expected id seen exactly once."""
    counts = {(n, calls) for n, calls, _, _ in everyone}
    assert len(counts) == 1, f"ranks disagree on (steps, agree_any calls): {everyone}"
    (n, calls), = counts
    assert calls == n + 1
    seen = sorted(v for _, _, ids, _ in everyone for v in ids)
    assert seen == sorted(expected)


def with_policy(dataset, policy):
    options = Options()
    options.experimental_distribute.auto_shard_policy = policy
    return dataset.with_options(options)


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("n,batch", [(29, 6), (5, 8)])
def test_data_sharding_sees_every_element_once(comm, replicas, n, batch):
    dataset = with_policy(Dataset.range(n).shuffle(n, seed=11).batch(batch),
                          AutoShardPolicy.DATA)
    everyone = run(comm, lambda agree: DistributedDataset(
        dataset, num_workers=comm.size, worker_index=comm.rank, replicas_per_worker=replicas,
        wrap=list, agree_any=agree))
    check_once(everyone, range(n))
    steps = everyone[0][0]
    for step in range(steps):
        sizes = [s for _, _, _, per_step in everyone for s in per_step[step]]
        assert max(sizes) - min(sizes) <= 1
        assert sum(sizes) == min(batch, n - step * batch)


def test_unseeded_shuffle_with_a_broadcast_seed(comm):
    seed = comm.bcast(int(np.random.SeedSequence().entropy % 2**63), root=0)
    dataset = with_policy(Dataset.range(40).shuffle(40).batch(7), AutoShardPolicy.DATA)
    everyone = run(comm, lambda agree: DistributedDataset(
        dataset, num_workers=comm.size, worker_index=comm.rank, replicas_per_worker=2,
        wrap=list, agree_any=agree, shuffle_seed=seed))
    check_once(everyone, range(40))


def file_rows(path):
    """A 'file' named part-<k> holds k % 4 rows: 100*k, 100*k + 1, ..."""
    k = int(path.split("-")[1])
    return [np.int64(100 * k + i) for i in range(k % 4)]


@pytest.mark.parametrize("replicas", [1, 2])
def test_file_sharding_with_unequal_workers_finishes_together(comm, replicas):
    paths = [f"part-{k}" for k in range(2 * comm.size + 1)]
    expected = [v for p in paths for v in file_rows(p)]
    dataset = Dataset.from_files(paths, file_rows).batch(3)
    everyone = run(comm, lambda agree: DistributedDataset(
        dataset, num_workers=comm.size, worker_index=comm.rank, replicas_per_worker=replicas,
        wrap=list, agree_any=agree))
    check_once(everyone, expected)
    mine = sorted(everyone[comm.rank][2])
    assert mine == sorted(v for p in paths[comm.rank::comm.size] for v in file_rows(p))


def test_off_gives_every_rank_everything(comm):
    dataset = with_policy(Dataset.range(12).batch(4), AutoShardPolicy.OFF)
    everyone = run(comm, lambda agree: DistributedDataset(
        dataset, num_workers=comm.size, worker_index=comm.rank, replicas_per_worker=1,
        wrap=list, agree_any=agree))
    assert all(sorted(ids) == list(range(12)) for _, _, ids, _ in everyone)


def test_datasets_from_function_shard_by_input_context(comm):
    def dataset_fn(ctx):
        per_replica = ctx.get_per_replica_batch_size(2 * ctx.num_replicas_in_sync)
        return Dataset.range(23).shard(ctx.num_input_pipelines,
                                       ctx.input_pipeline_id).batch(per_replica)

    everyone = run(comm, lambda agree: DistributedDatasetsFromFunction(
        dataset_fn, num_workers=comm.size, worker_index=comm.rank, replicas_per_worker=2,
        wrap=list, agree_any=agree))
    check_once(everyone, range(23))
