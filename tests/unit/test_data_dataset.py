"""Dataset: sources, transformations, shuffling determinism, nests, cardinality, errors."""

from __future__ import annotations

import collections
import itertools

import numpy as np
import pytest

from mpistrat.data import (
    INFINITE_CARDINALITY,
    UNKNOWN_CARDINALITY,
    ArraySpec,
    Dataset,
    make_numpy_dataset,
)

Pair = collections.namedtuple("Pair", ["image", "label"])


def values(dataset):
    """Elements as plain Python (lists of ints), for comparisons."""
    out = []
    for element in dataset:
        out.append(np.asarray(element).tolist())
    return out


# --- sources ---------------------------------------------------------------------------------


def test_from_tensor_slices_nest_of_arrays():
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    y = np.arange(6, dtype=np.int32)
    ds = Dataset.from_tensor_slices((x, {"label": y}))
    elements = list(ds)
    assert len(elements) == 6 == len(ds)
    image, labels = elements[4]
    np.testing.assert_array_equal(image, [8.0, 9.0])
    assert image.dtype == np.float32 and labels["label"] == 4
    assert ds.element_spec == (ArraySpec((2,), np.dtype(np.float32)),
                               {"label": ArraySpec((), np.dtype(np.int32))})


def test_from_tensor_slices_list_is_one_array_as_in_tf():
    assert values(Dataset.from_tensor_slices([1, 2, 3])) == [1, 2, 3]
    assert values(Dataset.from_tensor_slices([[1, 2], [3, 4]])) == [[1, 2], [3, 4]]


def test_from_tensor_slices_elements_do_not_alias_the_source():
    x = np.zeros((3, 2))
    first = next(iter(Dataset.from_tensor_slices(x)))
    first += 5
    assert not x.any()


def test_from_tensor_slices_errors_name_the_shapes():
    with pytest.raises(ValueError, match=r"same size in its first dimension.*\(3,\).*\(4,\)"):
        Dataset.from_tensor_slices((np.zeros(3), np.zeros(4)))
    with pytest.raises(ValueError, match="first dimension to slice.*from_tensors"):
        Dataset.from_tensor_slices(np.float32(1.0))
    with pytest.raises(ValueError, match="no arrays"):
        Dataset.from_tensor_slices(())


def test_from_tensors_is_one_element():
    ds = Dataset.from_tensors(([1.0, 2.0], 3))
    (a, b), = list(ds)
    np.testing.assert_array_equal(a, [1.0, 2.0])
    assert b == 3 and len(ds) == 1


def test_range_forms_and_dtype():
    assert values(Dataset.range(4)) == [0, 1, 2, 3]
    assert values(Dataset.range(2, 5)) == [2, 3, 4]
    assert values(Dataset.range(10, 0, -3)) == [10, 7, 4, 1]
    assert next(iter(Dataset.range(3))).dtype == np.int64
    assert values(Dataset.range(10, 0, -3).batch(3)) == [[10, 7, 4], [1]]
    with pytest.raises(ValueError, match="step must not be 0"):
        Dataset.range(0, 5, 0)
    with pytest.raises(TypeError, match="1 to 3"):
        Dataset.range()


def test_from_files_reads_each_file_in_order(tmp_path):
    paths = []
    for i, rows in enumerate([3, 0, 2]):
        path = tmp_path / f"part{i}.npy"
        np.save(path, np.arange(rows) + 10 * i)
        paths.append(str(path))

    def reader(path):
        for row in np.load(path):
            yield row, 2.5  # a Python float becomes an array

    elements = list(Dataset.from_files(paths, reader))
    assert [int(a) for a, _ in elements] == [0, 1, 2, 20, 21]
    assert all(isinstance(b, np.ndarray) and b.dtype == np.float64 for _, b in elements)
    assert Dataset.from_files(paths, reader).cardinality() == UNKNOWN_CARDINALITY
    assert Dataset.from_files(paths, reader).element_spec == (
        ArraySpec((), np.dtype(np.int64)), ArraySpec((), np.dtype(np.float64)))
    single = Dataset.from_files(paths[0], lambda p: [(p,)])
    assert [e[0].item() for e in single] == [paths[0]]


def test_from_files_errors():
    with pytest.raises(ValueError, match="no paths"):
        Dataset.from_files([], lambda p: [])
    with pytest.raises(TypeError, match="reader must be a callable"):
        Dataset.from_files(["a"], "not callable")
    ds = Dataset.from_files(["a.bin"], lambda p: 42)
    with pytest.raises(TypeError, match=r"reader\('a.bin'\) returned int, which is not iterable"):
        list(ds)


# --- transformations -------------------------------------------------------------------------


def test_batch_stacks_and_keeps_or_drops_the_remainder():
    assert values(Dataset.range(7).batch(3)) == [[0, 1, 2], [3, 4, 5], [6]]
    assert values(Dataset.range(7).batch(3, drop_remainder=True)) == [[0, 1, 2], [3, 4, 5]]
    assert len(Dataset.range(7).batch(3)) == 3
    assert len(Dataset.range(7).batch(3, drop_remainder=True)) == 2
    spec = Dataset.from_tensor_slices(np.zeros((5, 2), np.float32)).batch(2).element_spec
    assert spec == ArraySpec((None, 2), np.dtype(np.float32))
    assert Dataset.range(5).batch(2, True).element_spec == ArraySpec((2,), np.dtype(np.int64))
    assert values(Dataset.range(3).batch(2, num_parallel_calls=-1, deterministic=False)) == [
        [0, 1], [2]]
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        Dataset.range(3).batch(0)


def test_batch_of_nests_keeps_the_structure():
    x = np.arange(8).reshape(4, 2)
    ds = Dataset.from_tensor_slices({"pair": Pair(x, np.arange(4)), "w": np.ones(4)})
    for through_map in (False, True):
        d = ds.map(lambda e: e) if through_map else ds
        first = next(iter(d.batch(3)))
        assert set(first) == {"pair", "w"} and isinstance(first["pair"], Pair)
        np.testing.assert_array_equal(first["pair"].image, x[:3])
        assert first["w"].shape == (3,)


def test_batch_of_different_shapes_is_a_clear_error():
    ds = Dataset.range(3).map(lambda i: np.zeros(int(i) + 1))
    with pytest.raises(ValueError, match=r"element 0 .* shape \(1,\) and element 1 .* \(2,\)"):
        list(ds.batch(3))


def test_map_unpacks_tuples_only():
    pairs = Dataset.from_tensor_slices((np.arange(3), np.arange(3) * 10))
    assert values(pairs.map(lambda a, b: a + b)) == [0, 11, 22]
    dicts = Dataset.from_tensor_slices({"a": np.arange(3)})
    assert values(dicts.map(lambda d: d["a"] * 2)) == [0, 2, 4]
    named = Dataset.from_tensor_slices(Pair(np.arange(2), np.arange(2)))
    assert values(named.map(lambda p: p.image + p.label)) == [0, 2]
    lists = Dataset.range(2).map(lambda i: [i, float(i) / 2])
    assert [type(e) for e in lists] == [list, list]
    with pytest.raises(TypeError, match="callable"):
        Dataset.range(2).map(3)


def test_map_accepts_tf_parallelism_arguments():
    ds = Dataset.range(4).map(lambda i: i * i, num_parallel_calls=-1, deterministic=True)
    assert values(ds.prefetch(-1)) == [0, 1, 4, 9]


def test_repeat_take_shard_and_cardinality():
    assert values(Dataset.range(3).repeat(2)) == [0, 1, 2, 0, 1, 2]
    assert values(Dataset.range(3).repeat().take(7)) == [0, 1, 2, 0, 1, 2, 0]
    assert Dataset.range(3).repeat().cardinality() == INFINITE_CARDINALITY
    assert Dataset.range(3).repeat(-1).take(5).cardinality() == 5
    assert values(Dataset.range(0).repeat()) == []  # never loops on an empty dataset
    assert Dataset.range(0).repeat().cardinality() == 0
    assert values(Dataset.range(10).shard(3, 1)) == [1, 4, 7]
    assert Dataset.range(10).shard(3, 1).cardinality() == 3
    assert Dataset.range(10).shard(3, 2).cardinality() == 3
    assert Dataset.range(2).shard(3, 2).cardinality() == 0
    assert values(Dataset.range(5).take(-1)) == [0, 1, 2, 3, 4]
    assert Dataset.range(5).take(9).cardinality() == 5
    files = Dataset.from_files(["f"], lambda p: [1, 2])
    assert files.repeat(3).cardinality() == UNKNOWN_CARDINALITY
    assert files.repeat().cardinality() == INFINITE_CARDINALITY
    with pytest.raises(TypeError, match="infinite"):
        len(Dataset.range(2).repeat())
    with pytest.raises(TypeError, match="unknown"):
        len(files)


def test_argument_errors_name_the_value():
    with pytest.raises(ValueError, match=r"shard index must be in \[0, 2\].*got 3"):
        Dataset.range(5).shard(3, 3)
    with pytest.raises(ValueError, match="num_shards must be >= 1"):
        Dataset.range(5).shard(0, 0)
    with pytest.raises(ValueError, match="repeat count must be >= -1"):
        Dataset.range(5).repeat(-2)
    with pytest.raises(TypeError, match="batch_size must be an integer"):
        Dataset.range(5).batch(2.5)
    with pytest.raises(TypeError, match="must be an integer"):
        Dataset.range(5).take(True)


def test_iteration_paths_agree():
    """The index path (slices → reorder → batch) and the element path (a map in between)
    produce the same batches."""
    x = np.arange(40).reshape(20, 2)
    base = Dataset.from_tensor_slices((x, np.arange(20)))

    def pipeline(ds):
        return ds.shuffle(7, seed=3).repeat(2).shard(2, 1).take(17).batch(4)

    fast = list(pipeline(base))
    slow = list(pipeline(base.map(lambda a, b: (a, b))))
    assert len(fast) == len(slow) == 5
    for (a1, b1), (a2, b2) in zip(fast, slow):
        np.testing.assert_array_equal(a1, a2)
        np.testing.assert_array_equal(b1, b2)


# --- shuffle ---------------------------------------------------------------------------------


def test_shuffle_is_a_permutation_and_seeded_orders_repeat():
    a = Dataset.range(50).shuffle(10, seed=7)
    b = Dataset.range(50).shuffle(10, seed=7)
    first_a, first_b = values(a), values(b)
    assert sorted(first_a) == list(range(50)) and first_a != list(range(50))
    assert first_a == first_b
    assert values(a) == values(b)  # second epochs agree too
    assert values(Dataset.range(50).shuffle(10, seed=8)) != first_a


def test_shuffle_reshuffles_each_epoch_unless_told_not_to():
    ds = Dataset.range(30).shuffle(None, seed=1)
    epochs = [values(ds) for _ in range(3)]
    assert all(sorted(e) == list(range(30)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    fixed = Dataset.range(30).shuffle(None, seed=1, reshuffle_each_iteration=False)
    assert values(fixed) == values(fixed)


def test_shuffle_then_repeat_reshuffles_every_repetition():
    out = values(Dataset.range(20).shuffle(20, seed=2).repeat(3))
    parts = [out[i * 20:(i + 1) * 20] for i in range(3)]
    assert all(sorted(p) == list(range(20)) for p in parts)
    assert parts[0] != parts[1] != parts[2]
    same = values(Dataset.range(20).shuffle(20, seed=2, reshuffle_each_iteration=False).repeat(2))
    assert same[:20] == same[20:]


def test_shuffle_buffer_bounds_how_far_an_element_moves():
    assert values(Dataset.range(10).shuffle(1, seed=0)) == list(range(10))
    out = values(Dataset.range(100).shuffle(5, seed=0))
    assert sorted(out) == list(range(100))
    # element i can be emitted only after elements up to i - buffer_size were read
    assert all(position >= value - 4 for position, value in enumerate(out))


def test_unseeded_shuffles_differ_between_datasets():
    a = values(Dataset.range(40).shuffle(40))
    b = values(Dataset.range(40).shuffle(40))
    assert a != b and sorted(a) == sorted(b)


def test_shuffle_errors():
    with pytest.raises(ValueError, match="infinite"):
        Dataset.range(3).repeat().shuffle(None)
    with pytest.raises(ValueError, match="buffer_size must be >= 1"):
        Dataset.range(3).shuffle(0)


# --- options, repr, numpy datasets -----------------------------------------------------------


def test_repr_lists_the_steps():
    ds = Dataset.range(5).shuffle(3, seed=1).map(abs).batch(2, drop_remainder=True)
    assert repr(ds) == ("<Dataset range(0, 5, 1) -> shuffle(3, seed=1) -> map(abs) -> "
                        "batch(2, drop_remainder=True)>")


def test_make_numpy_dataset_copies_and_stacks_lists():
    x = np.arange(6).reshape(3, 2)
    ds = make_numpy_dataset({"x": x, "y": [np.zeros(2), np.ones(2), np.ones(2)]})
    x[:] = -1
    elements = list(ds)
    assert [e["x"].tolist() for e in elements] == [[0, 1], [2, 3], [4, 5]]
    assert [e["y"].tolist() for e in elements] == [[0, 0], [1, 1], [1, 1]]


def test_iterating_twice_gives_independent_iterators():
    ds = Dataset.range(4)
    a, b = iter(ds), iter(ds)
    assert next(a) == 0 and next(a) == 1 and next(b) == 0
    assert list(itertools.islice(ds.as_numpy_iterator(), 2)) == [0, 1]
