"""Input through the strategy across real MPI ranks, G in {1, 2} replicas per rank:
``experimental_distribute_dataset`` under every sharding policy (DATA, FILE, OFF, AUTO)
with partial last batches and a dataset read from files in a shared temporary directory,
``distribute_datasets_from_function`` with its ``InputContext`` (PER_WORKER and
PER_REPLICA), ``experimental_make_numpy_dataset`` and plain iterables.

Each test feeds the batches to ``strategy.run``, records which element ids every replica
saw, and checks over all ranks (one ``allgather``) that every element was consumed
exactly once (OFF: once per worker) and that every rank took the same number of steps.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings

import numpy as np
import pytest

import mpistrat as ms
from mpistrat import AutoShardPolicy, Dataset, InputOptions, InputReplicationMode, PerReplica
from mpistrat.data import AutoShardWarning, Options

MPI = pytest.importorskip("mpi4py.MPI")

GS = [1, 2]


def strategy_for(comm, g):
    return ms.MultiWorkerMirroredStrategy(comm=comm, local_replicas=g)


def with_policy(dataset, policy):
    options = Options()
    options.experimental_distribute.auto_shard_policy = policy
    return dataset.with_options(options)


def consume(s, dist):
    """Run every step; return every rank's list of steps, each a list of
    (global replica id, ids seen) in local order, plus each step's MEAN over examples."""
    steps, means = [], []
    for batch in dist:
        def fn(x):
            return ms.get_replica_context().replica_id_in_sync_group, np.asarray(x)

        steps.append([(j, ids.tolist()) for j, ids in
                      s.experimental_local_results(s.run(fn, args=(batch,)))])
        with np.errstate(invalid="ignore"):  # a step may hold no example at all (FILE)
            means.append(float(s.reduce("mean", batch, axis=0)))
    return s.comm.allgather(steps), means


def all_ids(everyone) -> list[int]:
    return sorted(i for steps in everyone for step in steps for _, ids in step for i in ids)


def same_step_count(everyone) -> bool:
    return len({len(steps) for steps in everyone}) == 1


@pytest.fixture
def shared_dir(world):
    """A temporary directory every rank can see (rank 0 makes it, then broadcasts it)."""
    path = tempfile.mkdtemp(prefix="mpistrat-strategy-") if world.rank == 0 else None
    path = world.bcast(path, root=0)
    yield path
    world.Barrier()
    if world.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def write_files(world, directory, sizes) -> list[str]:
    """File k holds the consecutive ids after those of files 0..k-1 (``sizes[k]`` of them)."""
    paths = [os.path.join(directory, f"part-{k:02d}.npy") for k in range(len(sizes))]
    if world.rank == 0:
        start = 0
        for path, size in zip(paths, sizes):
            np.save(path, np.arange(start, start + size, dtype=np.int64))
            start += size
    world.Barrier()
    return paths


def read_ids(path):
    return iter(np.load(path))


# --- DATA ---------------------------------------------------------------------------------


@pytest.mark.parametrize("g", GS)
def test_data_sharding_gives_replica_j_the_jth_piece(comm, g):
    s = strategy_for(comm, g)
    n = comm.size * g
    batch = 2 * n + 1  # per-replica sizes 2 and 3
    total = 3 * batch + max(n - 1, 1)  # a short last batch: one replica gets nothing
    dataset = with_policy(Dataset.range(total).batch(batch), AutoShardPolicy.DATA)
    dist = s.experimental_distribute_dataset(dataset)
    assert dist.auto_shard_policy is (AutoShardPolicy.DATA if comm.size > 1 else None)
    assert len(dist) == 4
    everyone, means = consume(s, dist)
    assert same_step_count(everyone) and len(everyone[0]) == 4
    for t in range(4):
        pieces = sorted(piece for steps in everyone for piece in steps[t])
        assert [j for j, _ in pieces] == list(range(n))
        flat = [i for _, ids in pieces for i in ids]  # global replica order = batch order
        assert flat == list(range(t * batch, min((t + 1) * batch, total)))
        sizes = [len(ids) for _, ids in pieces]
        assert max(sizes) - min(sizes) <= 1
        assert means[t] == np.mean(flat)  # TF's MEAN over the actual examples
    last = sorted(piece for steps in everyone for piece in steps[-1])
    assert (n == 1) or [] in [ids for _, ids in last]  # a replica with an empty batch


@pytest.mark.parametrize("g", GS)
def test_unseeded_shuffle_is_consumed_once_under_data_sharding(world, g):
    s = strategy_for(world, g)
    dataset = with_policy(Dataset.range(23).shuffle(None).batch(5), AutoShardPolicy.DATA)
    everyone, _ = consume(s, s.experimental_distribute_dataset(dataset))
    assert all_ids(everyone) == list(range(23))  # the strategy broadcast one seed


@pytest.mark.parametrize("g", GS)
def test_auto_sharding_falls_back_to_data_with_a_warning_on_rank_zero(world, g):
    s = strategy_for(world, g)
    dataset = Dataset.from_tensor_slices(np.arange(13)).batch(4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = s.experimental_distribute_dataset(dataset)
    auto = [w for w in caught if issubclass(w.category, AutoShardWarning)]
    assert len(auto) == (1 if world.size > 1 and world.rank == 0 else 0)
    assert dist.auto_shard_policy is (AutoShardPolicy.DATA if world.size > 1 else None)
    everyone, _ = consume(s, dist)
    assert all_ids(everyone) == list(range(13))


# --- FILE, OFF, AUTO over files -----------------------------------------------------------


@pytest.mark.parametrize("g", GS)
def test_file_sharding_reads_every_file_once(world, shared_dir, g):
    s = strategy_for(world, g)
    sizes = [5 + k for k in range(world.size + 1)]  # worker 0 reads two files: more data
    paths = write_files(world, shared_dir, sizes)
    for policy in (AutoShardPolicy.FILE, AutoShardPolicy.AUTO):
        dataset = with_policy(Dataset.from_files(paths, read_ids).batch(2 * world.size + 1),
                              policy)
        with warnings.catch_warnings():
            warnings.simplefilter("error", AutoShardWarning)  # AUTO finds the files
            dist = s.experimental_distribute_dataset(dataset)
        assert dist.auto_shard_policy is (AutoShardPolicy.FILE if world.size > 1 else None)
        everyone, _ = consume(s, dist)
        assert same_step_count(everyone)
        assert all_ids(everyone) == list(range(sum(sizes)))
        if world.size > 1:  # worker w read files w, w + W, ...
            file_of = np.repeat(np.arange(len(sizes)), sizes)
            for rank, steps in enumerate(everyone):
                files = {int(file_of[i]) for step in steps for _, ids in step for i in ids}
                assert files == set(range(rank, len(sizes), world.size))


def test_file_sharding_with_fewer_files_than_workers_fails_on_every_rank(world, shared_dir):
    s = strategy_for(world, 2)
    paths = write_files(world, shared_dir, [4] * max(world.size - 1, 1))
    dataset = with_policy(Dataset.from_files(paths, read_ids).batch(2), AutoShardPolicy.FILE)
    if world.size == 1:  # one worker: nothing to shard
        assert all_ids(consume(s, s.experimental_distribute_dataset(dataset))[0]) \
            == list(range(4))
        return
    with pytest.raises(ValueError, match="FILE sharding needs at least as many files as "
                                         "workers"):
        s.experimental_distribute_dataset(dataset)
    not_files = with_policy(Dataset.range(4).batch(2), AutoShardPolicy.FILE)
    with pytest.raises(ValueError, match="Dataset.from_files source"):
        s.experimental_distribute_dataset(not_files)


@pytest.mark.parametrize("g", GS)
def test_off_gives_every_worker_everything(world, g):
    s = strategy_for(world, g)
    dataset = with_policy(Dataset.range(11).batch(4), AutoShardPolicy.OFF)
    dist = s.experimental_distribute_dataset(dataset)
    everyone, _ = consume(s, dist)
    assert same_step_count(everyone)
    for steps in everyone:
        assert sorted(i for step in steps for _, ids in step for i in ids) == list(range(11))


# --- other inputs -------------------------------------------------------------------------


@pytest.mark.parametrize("g", GS)
def test_plain_iterable_of_global_batches(world, g):
    s = strategy_for(world, g)
    batches = [np.arange(start, min(start + 6, 15)) for start in range(0, 15, 6)]
    everyone, means = consume(s, s.experimental_distribute_dataset(batches))
    assert all_ids(everyone) == list(range(15))
    assert means == [float(np.mean(b)) for b in batches]


@pytest.mark.parametrize("g", GS)
def test_experimental_make_numpy_dataset_copies(world, g):
    s = strategy_for(world, g)
    x = np.arange(10)
    dataset = s.experimental_make_numpy_dataset(x)
    x[:] = -1  # later changes to the caller's array do not reach the dataset
    dist = s.experimental_distribute_dataset(
        with_policy(dataset.batch(4), AutoShardPolicy.DATA))
    assert all_ids(consume(s, dist)[0]) == list(range(10))
    stacked = s.experimental_make_numpy_dataset([np.zeros(2), np.ones(2)])
    assert [e.tolist() for e in stacked] == [[0.0, 0.0], [1.0, 1.0]]
    pairs = s.experimental_make_numpy_dataset((np.arange(3), {"y": np.arange(3) * 2}))
    assert [(int(a), int(b["y"])) for a, b in pairs] == [(0, 0), (1, 2), (2, 4)]


@pytest.mark.parametrize("g", GS)
def test_distribute_datasets_from_function_per_worker(world, g):
    s = strategy_for(world, g)
    n = world.size * g
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        per_replica = ctx.get_per_replica_batch_size(3 * n)
        return (Dataset.range(40).shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
                .batch(per_replica))

    dist = s.distribute_datasets_from_function(dataset_fn)
    assert len(contexts) == 1
    ctx = contexts[0]
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == \
        (world.size, world.rank, n)
    assert ctx.get_per_replica_batch_size(3 * n) == 3
    if n > 1:
        with pytest.raises(ValueError, match="not divisible by"):
            ctx.get_per_replica_batch_size(3 * n + 1)
    everyone, _ = consume(s, dist)
    assert same_step_count(everyone)
    assert all_ids(everyone) == list(range(40))
    for rank, steps in enumerate(everyone):  # each worker read its own shard
        assert all(i % world.size == rank for step in steps for _, ids in step for i in ids)
    assert s.experimental_distribute_datasets_from_function(dataset_fn) is not None


@pytest.mark.parametrize("g", GS)
def test_distribute_datasets_from_function_per_replica(world, g):
    s = strategy_for(world, g)
    n = world.size * g
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        return Dataset.range(30).shard(ctx.num_input_pipelines, ctx.input_pipeline_id).batch(2)

    options = InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA,
                           experimental_prefetch_to_device=False)
    dist = s.distribute_datasets_from_function(dataset_fn, options)
    assert [(c.num_input_pipelines, c.input_pipeline_id, c.num_replicas_in_sync)
            for c in contexts] == [(n, world.rank * g + i, n) for i in range(g)]
    everyone, _ = consume(s, dist)
    assert same_step_count(everyone)
    assert all_ids(everyone) == list(range(30))
    for steps in everyone:  # replica j read the j-th shard
        assert all(i % n == j for step in steps for j, ids in step for i in ids)
    with pytest.raises(ValueError, match="PER_REPLICA"):
        s.experimental_distribute_dataset(Dataset.range(4).batch(2), options)


def test_dataset_fn_failing_on_one_rank_raises_on_every_rank(world):
    s = strategy_for(world, 1)

    def dataset_fn(ctx):
        if ctx.input_pipeline_id == world.size - 1:
            raise FileNotFoundError("shard missing on the last worker")
        return Dataset.range(4).batch(2)

    with pytest.raises((FileNotFoundError, ms.CollectiveMismatchError),
                       match="shard missing on the last worker"):
        s.distribute_datasets_from_function(dataset_fn)
    dataset = with_policy(Dataset.range(4).batch(2), AutoShardPolicy.DATA)
    everyone, _ = consume(s, s.experimental_distribute_dataset(dataset))
    assert all_ids(everyone) == [0, 1, 2, 3]  # the ranks are still in step


def test_unbatched_dataset_is_an_error_with_several_replicas(world):
    s = strategy_for(world, 2)
    with pytest.raises(ValueError, match="Call the `batch` method"):
        s.experimental_distribute_dataset(Dataset.range(4))


def test_per_replica_batches_are_per_replica_values(world):
    s = strategy_for(world, 2)
    dist = s.experimental_distribute_dataset(
        with_policy(Dataset.from_tensor_slices((np.arange(40.0), np.arange(40))).batch(
            4 * world.size), AutoShardPolicy.DATA))
    x, y = next(iter(dist))
    assert isinstance(x, PerReplica) and x.devices == ("/cpu:0", "/cpu:1")
    assert [len(part) for part in x.values] == [2, 2]
    assert y.values[0].dtype == np.int64
