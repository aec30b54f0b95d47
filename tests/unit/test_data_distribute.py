"""Distributed input in one process: W workers are W DistributedDatasets (worker_index
0..W-1) stepped in lock-step by threads whose ``agree_any`` meets at a barrier, as the
strategy's MPI allreduce would. ``wrap=list`` keeps each leaf as the list of its R
per-replica arrays, so tests see exactly what every replica gets."""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest

from mpistrat.data import (
    ArraySpec,
    AutoShardPolicy,
    AutoShardWarning,
    Dataset,
    DistributedDataset,
    DistributedDatasetsFromFunction,
    InputContext,
    InputOptions,
    InputReplicationMode,
    Options,
    batch_sizes_for_worker,
)

pytestmark = pytest.mark.filterwarnings("ignore::mpistrat.data.AutoShardWarning")

PER_REPLICA = InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA)


class Collective:
    """A one-process stand-in for the strategy's ``comm.allreduce(flag, op=LOR)``."""

    def __init__(self, workers: int) -> None:
        self.flags = [False] * workers
        self.calls = [0] * workers
        self.barrier = threading.Barrier(workers, timeout=10)

    def agree_for(self, worker: int):
        def agree_any(flag: bool) -> bool:
            self.calls[worker] += 1
            self.flags[worker] = bool(flag)
            self.barrier.wait()
            result = any(self.flags)
            self.barrier.wait()
            return result

        return agree_any


def lockstep(make, workers: int, replicas: int, collective: bool = True):
    """Iterate one epoch on every worker; returns (steps per worker, agree_any calls).

    ``make(worker_index, agree_any)`` builds worker w's distributed input. Each step is
    the yielded nest with leaves = lists of R arrays.
    """
    group = Collective(workers) if collective else None
    inputs = [make(w, group.agree_for(w) if group else None) for w in range(workers)]
    results: list = [None] * workers
    errors: list = []

    def run(w):
        try:
            results[w] = list(inputs[w])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            if group:
                group.barrier.abort()  # release the other workers

    threads = [threading.Thread(target=run, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    if errors:
        raise errors[0]
    return results, (group.calls if group else None)


def distribute(dataset, workers, replicas, policy=None, **kwargs):
    if policy is not None:
        options = Options()
        options.experimental_distribute.auto_shard_policy = policy
        dataset = dataset.with_options(options)
    return lockstep(
        lambda w, agree: DistributedDataset(dataset, num_workers=workers, worker_index=w,
                                            replicas_per_worker=replicas, wrap=list,
                                            agree_any=agree, **kwargs),
        workers, replicas)


def as_lists(steps):
    """[[per-replica list of ints] for each step] from single-leaf steps."""
    return [[piece.tolist() for piece in step] for step in steps]


# --- the split rule ------------------------------------------------------------------------


def test_batch_sizes_for_worker_examples():
    assert batch_sizes_for_worker(7, 2, 2, 0) == [2, 2, 2, 1]
    assert batch_sizes_for_worker(7, 2, 2, 1) == [2, 1, 2, 2]
    assert batch_sizes_for_worker(7, 1, 2, 0) == [4, 3]
    assert batch_sizes_for_worker(2, 2, 2, 1) == [0, 0, 1, 1]


@pytest.mark.parametrize("workers,replicas", [(1, 1), (1, 3), (2, 2), (3, 2), (4, 1), (2, 3)])
def test_batch_sizes_for_worker_balance_every_step(workers, replicas):
    n = workers * replicas
    for batch in range(0, 3 * n + 2):
        lists = [batch_sizes_for_worker(batch, workers, replicas, w) for w in range(workers)]
        assert all(len(sizes) == n for sizes in lists)
        for step in range(workers):  # every step consumes exactly one global batch
            sizes = [lists[w][(step * replicas + r) % n] for w in range(workers)
                     for r in range(replicas)]
            assert sum(sizes) == batch and max(sizes) - min(sizes) <= 1


def test_batch_sizes_for_worker_errors():
    with pytest.raises(ValueError, match=r"worker_index must be in \[0, 1\]"):
        batch_sizes_for_worker(8, 2, 1, 2)
    with pytest.raises(ValueError, match="num_workers must be an integer >= 1"):
        batch_sizes_for_worker(8, 0, 1, 0)


def test_data_split_of_seven_over_two_workers_of_two():
    steps, calls = distribute(Dataset.range(14).batch(7), 2, 2)
    w0, w1 = (as_lists(s) for s in steps)
    assert w0 == [[[0, 1], [2, 3]], [[7, 8], [9]]]
    assert w1 == [[[4, 5], [6]], [[10, 11], [12, 13]]]
    assert calls == [3, 3]  # two steps, then the step where everyone reports False


def test_single_worker_split_of_seven_over_two_replicas():
    dd = DistributedDataset(Dataset.range(7).batch(7), num_workers=1, worker_index=0,
                            replicas_per_worker=2, wrap=list)
    assert as_lists(dd) == [[[0, 1, 2, 3], [4, 5, 6]]]
    assert dd.auto_shard_policy is None


def test_partial_last_batch_is_split_evenly():
    steps, _ = distribute(Dataset.range(14).batch(8), 2, 1)
    assert as_lists(steps[0]) == [[[0, 1, 2, 3]], [[8, 9, 10]]]
    assert as_lists(steps[1]) == [[[4, 5, 6, 7]], [[11, 12, 13]]]


@pytest.mark.parametrize("workers,replicas", [(2, 1), (2, 2), (3, 2), (4, 1), (1, 3)])
@pytest.mark.parametrize("n,batch,drop", [(23, 5, False), (23, 5, True), (3, 4, False),
                                          (24, 6, False), (1, 1, False)])
def test_data_sharding_consumes_every_element_once(workers, replicas, n, batch, drop):
    x = np.arange(n * 2, dtype=np.float32).reshape(n, 2)
    dataset = Dataset.from_tensor_slices({"x": x, "i": np.arange(n)}).batch(batch, drop)
    steps, calls = distribute(dataset, workers, replicas, AutoShardPolicy.DATA)
    assert len(set(map(len, steps))) == 1 and len(set(calls)) == 1
    seen = []
    for step in range(len(steps[0])):
        pieces = [steps[w][step]["i"][r] for w in range(workers) for r in range(replicas)]
        sizes = [len(p) for p in pieces]
        assert max(sizes) - min(sizes) <= 1
        flat = np.concatenate(pieces).tolist()
        assert flat == sorted(flat) and len(flat) == (batch if (step + 1) * batch <= n
                                                      else n % batch)
        for w in range(workers):
            for r in range(replicas):
                np.testing.assert_array_equal(steps[w][step]["x"][r],
                                              x[steps[w][step]["i"][r]])
        seen += flat
    assert seen == list(range(n // batch * batch if drop else n))


def test_leftover_replicas_get_empty_batches_of_the_right_dtype_and_shape():
    images = np.ones((3, 4, 5), dtype=np.float32)
    dataset = Dataset.from_tensor_slices((images, np.arange(3, dtype=np.int16))).batch(3)
    steps, _ = distribute(dataset, 2, 2, AutoShardPolicy.DATA)
    (last_images, last_labels), = steps[1]
    assert last_images[0].shape == (1, 4, 5)
    assert last_images[1].shape == (0, 4, 5) and last_images[1].dtype == np.float32
    assert last_labels[1].shape == (0,) and last_labels[1].dtype == np.int16


def test_not_batched_is_tf_error_and_one_replica_passes_elements_through():
    with pytest.raises(ValueError, match="Call the `batch` method .* across 4 replicas"):
        DistributedDataset(Dataset.range(8), num_workers=2, worker_index=0,
                           replicas_per_worker=2, wrap=list)
    dd = DistributedDataset(Dataset.range(3), num_workers=1, worker_index=0,
                            replicas_per_worker=1, wrap=lambda parts: parts[0])
    assert [int(v) for v in dd] == [0, 1, 2]
    assert len(dd) == 3


# --- policies ---------------------------------------------------------------------------------


def write_files(tmp_path, counts):
    """One raw int64 file per count, holding consecutive integers; returns (paths, all
    values). Raw, not .npy: the workers of lockstep() are threads, and np.load parses
    the .npy header with ast.literal_eval, whose AST construction CPython 3.11 does not
    make thread-safe ('SystemError: AST constructor recursion depth mismatch', CPython
    gh-106905; it failed this test once in CI)."""
    paths, start = [], 0
    for i, count in enumerate(counts):
        path = tmp_path / f"part-{i:02d}.bin"
        np.arange(start, start + count, dtype=np.int64).tofile(path)
        paths.append(str(path))
        start += count
    return paths, list(range(start))


def read_rows(path):
    yield from np.fromfile(path, dtype=np.int64)


def test_auto_uses_file_sharding_for_files_and_balances_unequal_workers(tmp_path):
    paths, everything = write_files(tmp_path, [5, 1, 6, 2, 4])  # w0: 15 rows, w1: 3 rows
    dataset = Dataset.from_files(paths, read_rows).batch(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AutoShardWarning)
        steps, calls = distribute(dataset, 2, 2)
    assert len(steps[0]) == len(steps[1]) and calls[0] == calls[1] == len(steps[0]) + 1
    w0 = [np.concatenate(s).tolist() for s in steps[0]]
    w1 = [np.concatenate(s).tolist() for s in steps[1]]
    assert sorted(sum(w0, [])) == [v for v in everything if v < 5 or 6 <= v < 12 or v >= 14]
    assert sorted(sum(w1, [])) == [5, 12, 13]
    # worker 1 ran out: its replicas get empty int64 batches while worker 0 goes on
    tail = steps[1][-1]
    assert [p.shape for p in tail] == [(0,), (0,)] and tail[0].dtype == np.int64
    # each worker cuts its own stream into B / N = 1 element per replica and step
    assert [[len(p) for p in s] for s in steps[0]] == [[1, 1]] * 7 + [[1, 0]]
    assert [[len(p) for p in s] for s in steps[1]] == [[1, 1], [1, 0]] + [[0, 0]] * 6


def test_file_sharding_gives_worker_w_files_w_plus_k_times_w(tmp_path):
    paths, _ = write_files(tmp_path, [2] * 7)
    dataset = Dataset.from_files(paths, read_rows).batch(3)
    steps, _ = distribute(dataset, 3, 1, AutoShardPolicy.FILE)
    for w in range(3):
        got = sorted(np.concatenate([s[0] for s in steps[w]]).tolist())
        want = sorted(v for f in range(w, 7, 3) for v in (2 * f, 2 * f + 1))
        assert got == want


def test_file_sharding_with_fewer_files_than_workers_is_an_error(tmp_path):
    paths, _ = write_files(tmp_path, [3, 3])
    dataset = Dataset.from_files(paths, read_rows).batch(2)
    for policy in (None, AutoShardPolicy.FILE):
        with pytest.raises(ValueError, match=r"got 2 file\(s\) for 3 workers.*DATA"):
            distribute(dataset, 3, 1, policy)


def test_file_sharding_of_a_non_file_dataset_is_an_error():
    with pytest.raises(ValueError, match="FILE splits the files.*from_tensor_slices"):
        distribute(Dataset.from_tensor_slices(np.arange(8)).batch(2), 2, 1,
                   AutoShardPolicy.FILE)


def test_auto_falls_back_to_data_with_one_warning_from_worker_zero():
    dataset = Dataset.range(8).batch(4)
    for worker, expected in ((0, 1), (1, 0)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dd = DistributedDataset(dataset, num_workers=2, worker_index=worker,
                                    replicas_per_worker=1, wrap=list)
        assert [w.category for w in caught] == [AutoShardWarning] * expected
        assert dd.auto_shard_policy is AutoShardPolicy.DATA
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DistributedDataset(dataset, num_workers=1, worker_index=0, replicas_per_worker=2,
                           wrap=list)


def test_off_gives_every_worker_everything_at_its_share_per_step():
    steps, calls = distribute(Dataset.range(10).batch(4), 2, 1, AutoShardPolicy.OFF)
    for w in range(2):
        assert as_lists(steps[w]) == [[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]], [[8, 9]]]
    assert calls == [6, 6]


def test_stream_end_is_shared_evenly_or_dropped():
    steps, _ = distribute(Dataset.range(11).batch(8), 2, 2, AutoShardPolicy.OFF)
    assert [[len(p) for p in s] for s in steps[0]] == [[2, 2], [2, 2], [2, 1]]
    steps, _ = distribute(Dataset.range(11).batch(4, drop_remainder=True), 2, 2,
                          AutoShardPolicy.OFF)
    assert [[len(p) for p in s] for s in steps[0]] == [[1, 1]] * 4


def test_data_sharding_needs_identical_shuffles():
    dataset = Dataset.range(20).shuffle(20).batch(4)  # unseeded
    with pytest.raises(ValueError, match="shuffle\\(seed=None\\).*shuffle_seed"):
        distribute(dataset, 2, 1, AutoShardPolicy.DATA)
    for seed_kwargs, source in (({"shuffle_seed": 99}, dataset),
                                ({}, Dataset.range(20).shuffle(20, seed=5).batch(4))):
        epochs = []
        group = Collective(2)
        inputs = [DistributedDataset(source.with_options(Options()), num_workers=2,
                                     worker_index=w, replicas_per_worker=1, wrap=list,
                                     agree_any=group.agree_for(w), **seed_kwargs)
                  for w in range(2)]
        for _ in range(2):  # two epochs: each a permutation, the second reshuffled
            out = [None, None]
            threads = [threading.Thread(target=lambda w=w: out.__setitem__(w, list(inputs[w])))
                       for w in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(10)
            flat = [v for w in range(2) for s in out[w] for v in s[0].tolist()]
            assert sorted(flat) == list(range(20))
            epochs.append(flat)
        assert epochs[0] != epochs[1]


def test_off_with_a_shuffle_seed_shuffles_differently_per_worker():
    dataset = Dataset.range(30).shuffle(30).batch(6)
    steps, _ = distribute(dataset, 2, 1, AutoShardPolicy.OFF, shuffle_seed=4)
    orders = [[v for s in steps[w] for v in s[0].tolist()] for w in range(2)]
    assert sorted(orders[0]) == sorted(orders[1]) == list(range(30))
    assert orders[0] != orders[1]


# --- nests, plain iterables, wrap, iteration contract -----------------------------------------


def test_nests_keep_their_structure_and_wrap_sees_each_leaf():
    n = 8
    data = {"pair": (np.arange(n), np.arange(n) * 2.0), "names": np.arange(n) % 3}
    calls = []

    def wrap(parts):
        calls.append(len(parts))
        return tuple(parts)

    dd = DistributedDataset(Dataset.from_tensor_slices(data).batch(n).map(
        lambda d: {"pair": d["pair"], "names": [d["names"]]}),
        num_workers=1, worker_index=0, replicas_per_worker=2, wrap=wrap)
    step, = list(dd)
    assert set(step) == {"pair", "names"} and isinstance(step["names"], list)
    assert [p.tolist() for p in step["pair"][1]] == [[0, 2, 4, 6], [8, 10, 12, 14]]
    assert calls == [2, 2, 2]


def test_plain_iterables_of_global_batches_are_split_by_their_length():
    batches = [(np.arange(5), np.arange(5) * 10), (np.arange(5, 8), np.arange(5, 8) * 10)]
    steps, calls = distribute(batches, 2, 2)
    w0 = [[p.tolist() for p in s[0]] for s in steps[0]]
    w1 = [[p.tolist() for p in s[0]] for s in steps[1]]
    # sizes for global replicas 0..3: step 0 [2, 1, 1, 1]; step 1 the cycle moved on by
    # R = 2 positions, so the short piece is replica 1's: [1, 0, 1, 1]
    assert w0 == [[[0, 1], [2]], [[5], []]]
    assert w1 == [[[3], [4]], [[6], [7]]]
    assert steps[0][1][1][1].shape == (0,)
    dd = DistributedDataset(iter(batches), num_workers=1, worker_index=0,
                            replicas_per_worker=2, wrap=list)
    assert len(list(dd)) == 2 and list(dd) == []  # a one-shot iterator: second epoch empty
    assert len(DistributedDataset(batches, num_workers=2, worker_index=1,
                                  replicas_per_worker=1, wrap=list)) == 2


def test_plain_iterables_need_equal_batch_dimensions():
    bad = [(np.arange(4), np.arange(3))]
    with pytest.raises(ValueError, match="same first \\(batch\\) dimension"):
        list(DistributedDataset(bad, num_workers=1, worker_index=0, replicas_per_worker=2,
                                wrap=list))


@pytest.mark.parametrize("bad", [np.arange(4), "abc", {"x": 1}, 3])
def test_things_that_are_not_datasets_are_rejected(bad):
    with pytest.raises(TypeError, match="must be a Dataset or an iterable of batches"):
        DistributedDataset(bad, num_workers=1, worker_index=0, replicas_per_worker=1,
                           wrap=list)


def test_reiteration_is_a_new_epoch_and_len_and_spec_are_known():
    dataset = Dataset.from_tensor_slices(np.zeros((10, 3), np.float32)).shuffle(10, seed=1)
    dd = DistributedDataset(dataset.batch(4), num_workers=1, worker_index=0,
                            replicas_per_worker=2, wrap=list)
    assert len(dd) == 3 and len(list(dd)) == 3 and len(list(dd)) == 3
    assert dd.element_spec == ArraySpec((None, 3), np.dtype(np.float32))
    assert dd.num_replicas_in_sync == 2
    assert "sharding none" in repr(dd)


def test_agree_any_is_called_once_per_step_plus_once():
    calls = []

    def agree_any(flag):
        calls.append(flag)
        return flag

    dd = DistributedDataset(Dataset.range(6).batch(2), num_workers=1, worker_index=0,
                            replicas_per_worker=2, wrap=list, agree_any=agree_any)
    assert len(list(dd)) == 3 and calls == [True, True, True, False]


def test_a_worker_without_any_input_still_builds_empty_batches(tmp_path):
    paths, _ = write_files(tmp_path, [6, 0])
    dataset = Dataset.from_files(paths, read_rows).map(lambda v: (v, np.float32(v))).batch(2)
    steps, calls = distribute(dataset, 2, 1, AutoShardPolicy.FILE)
    assert calls == [7, 7] and len(steps[1]) == 6  # worker 0: 1 element (B / W) per step
    (values,), (floats,) = steps[1][0]
    assert values.shape == (0,) and values.dtype == np.int64 and floats.dtype == np.float32


def test_argument_errors():
    with pytest.raises(ValueError, match=r"worker_index must be in \[0, 1\]"):
        DistributedDataset([], num_workers=2, worker_index=2, replicas_per_worker=1, wrap=list)
    with pytest.raises(TypeError, match="wrap must be callable"):
        DistributedDataset([], num_workers=1, worker_index=0, replicas_per_worker=1, wrap=3)
    with pytest.raises(TypeError, match="options must be an InputOptions"):
        DistributedDataset([], num_workers=1, worker_index=0, replicas_per_worker=1,
                           wrap=list, options=Options())
    with pytest.raises(ValueError, match="PER_REPLICA is only supported by "
                                         "distribute_datasets_from_function"):
        DistributedDataset([], num_workers=1, worker_index=0, replicas_per_worker=1,
                           wrap=list, options=PER_REPLICA)


# --- distribute_datasets_from_function --------------------------------------------------------


def test_per_worker_function_gets_the_worker_context_and_replicas_take_consecutive_elements():
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        per_replica = ctx.get_per_replica_batch_size(8)
        return Dataset.range(20).shard(ctx.num_input_pipelines,
                                       ctx.input_pipeline_id).batch(per_replica)

    steps, calls = lockstep(
        lambda w, agree: DistributedDatasetsFromFunction(
            dataset_fn, num_workers=2, worker_index=w, replicas_per_worker=2, wrap=list,
            agree_any=agree), 2, 2)
    assert sorted(contexts, key=lambda c: c.input_pipeline_id) == [InputContext(2, 0, 4),
                                                                   InputContext(2, 1, 4)]
    assert as_lists(steps[0]) == [[[0, 2], [4, 6]], [[8, 10], [12, 14]], [[16, 18], []]]
    assert as_lists(steps[1]) == [[[1, 3], [5, 7]], [[9, 11], [13, 15]], [[17, 19], []]]
    assert calls == [4, 4]


def test_per_replica_function_runs_once_per_replica_with_its_global_id():
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        return Dataset.range(ctx.input_pipeline_id + 1).map(lambda i: np.full(2, i)).batch(1)

    steps, calls = lockstep(
        lambda w, agree: DistributedDatasetsFromFunction(
            dataset_fn, num_workers=2, worker_index=w, replicas_per_worker=2, wrap=list,
            agree_any=agree, options=PER_REPLICA), 2, 2)
    assert sorted(c.input_pipeline_id for c in contexts) == [0, 1, 2, 3]
    assert all(c.num_input_pipelines == 4 and c.num_replicas_in_sync == 4 for c in contexts)
    # replica j has j + 1 batches: 4 steps everywhere, shorter pipelines padded with empties
    assert calls == [5, 5] and len(steps[0]) == len(steps[1]) == 4
    assert [[p.shape for p in s] for s in steps[0]] == [[(1, 2), (1, 2)]] + \
        [[(0, 2), (1, 2)]] + [[(0, 2), (0, 2)]] * 2
    assert [[p.shape[0] for p in s] for s in steps[1]] == [[1, 1], [1, 1], [1, 1], [0, 1]]


def test_from_function_errors():
    with pytest.raises(TypeError, match="dataset_fn must be callable"):
        DistributedDatasetsFromFunction(None, num_workers=1, worker_index=0,
                                        replicas_per_worker=1, wrap=list)
    with pytest.raises(TypeError, match=r"dataset_fn\(InputContext.*\) result must be a "
                                        r"Dataset"):
        DistributedDatasetsFromFunction(lambda ctx: 5, num_workers=1, worker_index=0,
                                        replicas_per_worker=1, wrap=list)


def test_from_function_shuffle_seed_differs_per_pipeline_but_is_reproducible():
    def make():
        return DistributedDatasetsFromFunction(
            lambda ctx: Dataset.range(16).shuffle(16).batch(16), num_workers=1,
            worker_index=0, replicas_per_worker=2, wrap=list, options=PER_REPLICA,
            shuffle_seed=3)

    first = [p.tolist() for p in next(iter(make()))]
    again = [p.tolist() for p in next(iter(make()))]
    assert first == again and first[0] != first[1]
    assert make().datasets[0].cardinality() == 1
