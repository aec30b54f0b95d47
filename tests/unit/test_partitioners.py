"""The variable partitioners (TF's ``tf.distribute.experimental.partitioners``) and the div
split of rows into shards: TF's docstring examples, its formulas on edge cases, argument
checks and the rule that only axis 0 is split."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

import mpistrat
from mpistrat.partitioners import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    Partitioner,
    shard_offsets,
    shard_sizes,
    validate_partitions,
)

# --- TF's docstring examples -------------------------------------------------------------


def test_fixed_shards_tf_example():
    assert FixedShardsPartitioner(num_shards=2)([10, 3], np.float32) == [2, 1]


@pytest.mark.parametrize(("max_shards", "expected"), [(2, [2, 1]), (10, [6, 1])])
def test_min_size_tf_examples(max_shards, expected):
    partitioner = MinSizePartitioner(min_shard_bytes=4, max_shards=max_shards)
    assert partitioner([6, 1], np.float32) == expected


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [({"max_shard_bytes": 4}, [6, 1]),
     ({"max_shard_bytes": 4, "max_shards": 2}, [2, 1]),
     ({"max_shard_bytes": 1024}, [1, 1])],
)
def test_max_size_tf_examples(kwargs, expected):
    assert MaxSizePartitioner(**kwargs)([6, 1], np.float32) == expected


def test_the_classes_are_exported_at_the_top_level():
    for name in ("Partitioner", "FixedShardsPartitioner", "MinSizePartitioner",
                 "MaxSizePartitioner"):
        assert name in mpistrat.__all__
    assert mpistrat.MinSizePartitioner is MinSizePartitioner
    assert issubclass(mpistrat.FixedShardsPartitioner, mpistrat.Partitioner)


def test_importing_the_package_still_starts_no_mpi():
    code = "import sys, mpistrat, mpistrat.partitioners; assert 'mpi4py.MPI' not in sys.modules"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-3000:]


# --- FixedShardsPartitioner --------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_shards", "shape", "expected"),
    [(3, (10,), [3]), (3, (2, 5), [2, 1]), (1, (7, 4, 2), [1, 1, 1]), (4, (1, 8), [1, 1]),
     (4, (0, 8), [0, 1]), (5, (5, 2), [5, 1])],
)
def test_fixed_shards_clips_to_the_rows(num_shards, shape, expected):
    assert FixedShardsPartitioner(num_shards)(shape, np.float32) == expected


def test_fixed_shards_along_another_axis_and_ignores_dtype():
    partitioner = FixedShardsPartitioner(4)
    assert partitioner((10, 3), "string", axis=1) == [1, 3]
    assert partitioner((10, 3), None, axis=-1) == [1, 3]
    assert partitioner.num_shards == 4
    assert repr(partitioner) == "FixedShardsPartitioner(num_shards=4)"


# --- MinSizePartitioner ------------------------------------------------------------------


def test_min_size_defaults_are_tfs():
    partitioner = MinSizePartitioner()
    assert (partitioner.min_shard_bytes, partitioner.max_shards,
            partitioner.bytes_per_string) == (256 << 10, 1, 16)
    # the default max_shards=1 never splits
    assert partitioner((1 << 20, 64), np.float64) == [1, 1]


@pytest.mark.parametrize(
    ("shape", "dtype", "min_bytes", "max_shards", "expected"),
    [
        # TF's own example: 1024 x 1024 float32 = 4 MiB over 256 KiB -> 16
        ((1024, 1024), np.float32, 256 << 10, 100, [16, 1]),
        ((1024, 1024), np.float32, 256 << 10, 8, [8, 1]),
        # ceil(total / min): 10 rows of 4 B, min 6 B -> ceil(40 / 6) = 7 (TF's formula, not
        # ceil(rows / ceil(min / row_bytes)) = 5)
        ((10, 1), np.float32, 6, 100, [7, 1]),
        # fewer bytes than one shard's minimum: one shard
        ((100,), np.int8, 1000, 4, [1]),
        # clipped to the rows
        ((3, 1000), np.float64, 1, 64, [3, 1]),
        ((1, 1000), np.float64, 1, 64, [1, 1]),
        # no rows, no elements: at least one shard
        ((0, 5), np.float32, 1, 8, [1, 1]),
        ((5, 0), np.float32, 1, 8, [1, 1]),
        # float byte counts work as in TF
        ((6, 1), np.float32, 4.0, 10, [6, 1]),
        ((6, 1), np.float32, 8.5, 10, [3, 1]),
    ],
)
def test_min_size_counts(shape, dtype, min_bytes, max_shards, expected):
    assert MinSizePartitioner(min_bytes, max_shards)(shape, dtype) == expected


def test_min_size_along_axis_1():
    assert MinSizePartitioner(4, 10)((2, 6), np.float32, axis=1) == [1, 6]


@pytest.mark.parametrize("dtype", ["string", "tf.string", str, bytes, object, np.object_])
def test_strings_count_bytes_per_string(dtype):
    # 10 strings: 160 B at the default 16 B each, 40 B at 4 B each
    assert MinSizePartitioner(40, 100)((10,), dtype) == [4]
    assert MinSizePartitioner(40, 100, bytes_per_string=4)((10,), dtype) == [1]
    assert MaxSizePartitioner(32)((10,), dtype) == [5]
    assert MaxSizePartitioner(32, bytes_per_string=8)((10,), dtype) == [3]


def test_fixed_width_strings_count_their_item_size():
    # 'S8' is 8 bytes an element, 'U3' 12: their real size, not bytes_per_string
    assert MinSizePartitioner(8, 100)((10,), "S8") == [10]
    assert MinSizePartitioner(24, 100)((10,), "U3") == [5]


@pytest.mark.parametrize(("dtype", "size"), [(np.float16, 2), ("float64", 8), (np.complex128, 16),
                                             ("int8", 1), (np.dtype("i4"), 4), (bool, 1)])
def test_numeric_dtypes_count_their_item_size(dtype, size):
    assert MinSizePartitioner(size, 1000)((10, 1), dtype) == [10, 1]
    assert MinSizePartitioner(2 * size, 1000)((10, 1), dtype) == [5, 1]


# --- MaxSizePartitioner ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "dtype", "max_bytes", "max_shards", "expected"),
    [
        # rows of 3 x 4 B = 12 B; 40 B holds 3 rows; 10 rows -> 4 shards
        ((10, 3), np.float32, 40, None, [4, 1]),
        ((10, 3), np.float32, 40, 3, [3, 1]),
        # max_shards above what the size asks for changes nothing
        ((10, 3), np.float32, 40, 100, [4, 1]),
        # a row larger than the maximum still makes one shard per row
        ((5, 100), np.float64, 16, None, [5, 1]),
        ((5, 100), np.float64, 16, 2, [2, 1]),
        # everything fits
        ((1, 10), np.float32, 1 << 20, None, [1, 1]),
        # no rows, or rows of no bytes: one shard (TF divides by zero)
        ((0, 10), np.float32, 4, None, [1, 1]),
        ((7, 0), np.float32, 4, None, [1, 1]),
        # (64 << 20) - 1, TF's suggested size, on a 100 MiB float32 matrix
        ((25600, 1024), np.float32, (64 << 20) - 1, None, [2, 1]),
    ],
)
def test_max_size_counts(shape, dtype, max_bytes, max_shards, expected):
    assert MaxSizePartitioner(max_bytes, max_shards)(shape, dtype) == expected


def test_max_size_along_axis_1_and_0_shards_means_no_limit():
    assert MaxSizePartitioner(4)((1, 6), np.float32, axis=1) == [1, 6]
    # TF's check is ``if max_shards and max_shards < 1``: 0 passes and means no limit
    partitioner = MaxSizePartitioner(4, max_shards=0)
    assert partitioner.max_shards is None
    assert partitioner((6, 1), np.float32) == [6, 1]


def test_max_size_shards_stay_under_the_maximum():
    for rows in range(1, 40):
        for max_bytes in (4, 12, 13, 50):
            k = MaxSizePartitioner(max_bytes)((rows, 3), np.float32)[0]
            largest = shard_sizes(rows, k)[0] * 12
            assert largest <= max(max_bytes, 12), (rows, max_bytes, k)
            # and as few as that allows
            if k > 1:
                assert math.ceil(rows / (k - 1)) * 12 > max_bytes


def test_repr_shows_the_arguments():
    assert repr(MinSizePartitioner(4, 2)) == (
        "MinSizePartitioner(min_shard_bytes=4, max_shards=2, bytes_per_string=16)")
    assert repr(MaxSizePartitioner(4, 2, 8)) == (
        "MaxSizePartitioner(max_shard_bytes=4, max_shards=2, bytes_per_string=8)")


# --- argument checks ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "pattern"),
    [
        (lambda: FixedShardsPartitioner(0), r"num_shards must be an integer >= 1.*got 0; pass 1"),
        (lambda: FixedShardsPartitioner(-3), r"num_shards .* got -3"),
        (lambda: MinSizePartitioner(0), r"min_shard_bytes must be a number of bytes >= 1, "
                                        r"got 0; pass a positive byte count"),
        (lambda: MinSizePartitioner(4, 0), r"max_shards must be an integer >= 1.*got 0"),
        (lambda: MinSizePartitioner(4, 1, 0), r"bytes_per_string must be .* got 0"),
        (lambda: MinSizePartitioner(float("inf")), r"min_shard_bytes .* got inf"),
        (lambda: MaxSizePartitioner(0), r"max_shard_bytes must be a number of bytes >= 1, got 0"),
        (lambda: MaxSizePartitioner(4, -1), r"max_shards .* got -1; pass None for no limit"),
        (lambda: MaxSizePartitioner(4, None, -2), r"bytes_per_string .* got -2"),
    ],
)
def test_bad_arguments_are_value_errors_naming_the_value(make, pattern):
    with pytest.raises(ValueError, match=pattern):
        make()


@pytest.mark.parametrize(
    "make",
    [lambda: FixedShardsPartitioner(2.5), lambda: FixedShardsPartitioner(True),
     lambda: MinSizePartitioner("256K"), lambda: MinSizePartitioner(4, None),
     lambda: MaxSizePartitioner(None), lambda: MaxSizePartitioner(4, 2.0)],
)
def test_arguments_of_the_wrong_type_are_type_errors(make):
    with pytest.raises(TypeError, match=r"must be (an integer|a number of bytes) >= 1"):
        make()


def test_numpy_scalars_are_accepted_as_arguments():
    assert FixedShardsPartitioner(np.int64(2))((10, 3), np.float32) == [2, 1]
    assert MinSizePartitioner(np.int32(4), np.int64(2))((6, 1), np.float32) == [2, 1]
    assert MaxSizePartitioner(np.float32(1024))(np.array([6, 1]), np.float32) == [1, 1]


@pytest.mark.parametrize(
    "partitioner",
    [FixedShardsPartitioner(2), MinSizePartitioner(4, 2), MaxSizePartitioner(4)],
    ids=["fixed", "min", "max"],
)
def test_rank_0_shapes_and_bad_axes_are_refused(partitioner):
    with pytest.raises(ValueError, match=r"shape \(\) along axis 0: a rank-0 \(scalar\)"):
        partitioner((), np.float32)
    with pytest.raises(ValueError, match=r"axis 2 when the shape is only \(6, 1\) \(rank 2\); "
                                         r"use an axis in \[-2, 2\)"):
        partitioner((6, 1), np.float32, axis=2)
    with pytest.raises(ValueError, match=r"not fully defined: dimension 0 is None"):
        partitioner((None, 3), np.float32)
    with pytest.raises(ValueError, match=r"negative size -1 as dimension 1"):
        partitioner((3, -1), np.float32)
    with pytest.raises(TypeError, match=r"shape must be a sequence of ints.*got 10; for a "
                                        r"vector of n rows pass \(n,\)"):
        partitioner(10, np.float32)
    with pytest.raises(TypeError, match=r"has 2.5 as dimension 1"):
        partitioner((3, 2.5), np.float32)


def test_an_unknown_dtype_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match=r"dtype must be a NumPy dtype .* got 'floot32'"):
        MinSizePartitioner()((4,), "floot32")
    with pytest.raises(TypeError, match=r"got 'floot32'"):
        MaxSizePartitioner(4)((4,), "floot32")


def test_the_base_class_must_be_subclassed():
    with pytest.raises(TypeError, match=r"abstract method"):
        Partitioner()

    class Halves(Partitioner):
        def __call__(self, shape, dtype, axis=0):
            return [max(1, shape[0] // 2)] + [1] * (len(shape) - 1)

    assert validate_partitions(Halves()((9, 2), np.float32), (9, 2)) == 4


# --- validate_partitions -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("result", "shape", "k"),
    [([1, 1], (10, 3), 1), ([3, 1], (10, 3), 3), ((3, 1), (10, 3), 3), ([3], (10,), 3),
     ([12, 1], (10, 3), 10), ([2, 1, 1], (1, 4, 4), 1), ([np.int64(4), 1], (10, 3), 4),
     # rank 0: never partitioned, the result is not looked at
     ([5], (), 1), (None, (), 1),
     # no rows: one ordinary variable (FixedShardsPartitioner gives [0, ...] there)
     ([0, 1], (0, 3), 1), ([4, 1], (0, 3), 1)],
)
def test_validate_partitions_clips_k_to_the_rows(result, shape, k):
    assert validate_partitions(result, shape) == k


@pytest.mark.parametrize(
    "result",
    [[2, 2], [1, 3], [3, 1, 2], [0, 1], [-1, 1], [], None, 3, "21", [2.0, 1], [True, 1],
     np.array([2, 1])],
)
def test_validate_partitions_refuses_anything_but_k_then_ones(result):
    with pytest.raises(ValueError) as info:
        validate_partitions(result, (10, 4))
    message = str(info.value)
    assert message.startswith(
        "variable_partitioner must return a list/tuple whose elements are 1 besides the first "
        f"element (non-zero), got: {result!r}")
    assert "shape (10, 4)" in message
    assert "only axis 0 can be split, so return [k] + [1] * (rank - 1) with k >= 1" in message


def test_every_partitioner_result_passes_validation():
    shapes = [(13, 2), (1, 7), (0, 3), (100,), (6, 1)]
    partitioners = [FixedShardsPartitioner(5), MinSizePartitioner(4, 4), MaxSizePartitioner(8)]
    for partitioner in partitioners:
        for shape in shapes:
            k = validate_partitions(partitioner(shape, np.float32), shape)
            assert 1 <= k <= max(shape[0], 1)
            assert sum(shard_sizes(shape[0], k)) == shape[0]


# --- shard_sizes and shard_offsets -------------------------------------------------------


@pytest.mark.parametrize(
    ("rows", "k", "sizes", "offsets"),
    [(13, 5, [3, 3, 3, 2, 2], [0, 3, 6, 9, 11, 13]),
     (10, 4, [3, 3, 2, 2], [0, 3, 6, 8, 10]),
     (12, 4, [3, 3, 3, 3], [0, 3, 6, 9, 12]),
     (7, 1, [7], [0, 7]),
     (5, 5, [1, 1, 1, 1, 1], [0, 1, 2, 3, 4, 5]),
     (1, 1, [1], [0, 1]),
     (0, 1, [0], [0, 0])],
)
def test_div_partitioning(rows, k, sizes, offsets):
    assert shard_sizes(rows, k) == sizes
    assert shard_offsets(rows, k) == offsets


def test_div_partitioning_slices_the_rows_like_tf():
    rows = list(range(13))
    offsets = shard_offsets(13, 5)
    shards = [rows[offsets[i]:offsets[i + 1]] for i in range(5)]
    assert shards == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10], [11, 12]]


def test_div_partitioning_sizes_differ_by_at_most_one():
    for rows in range(0, 60):
        for k in range(1, max(rows, 1) + 1):
            sizes = shard_sizes(rows, k)
            assert len(sizes) == k and sum(sizes) == rows
            assert max(sizes) - min(sizes) <= 1
            assert sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize(
    ("rows", "k", "pattern"),
    [(3, 5, r"5 shards over 3 rows would leave empty shards; clip the shard count"),
     (0, 2, r"2 shards over 0 rows"),
     (-1, 1, r"rows must be an int >= 0 .* got -1"),
     (4, 0, r"num_shards must be an integer >= 1.*got 0")],
)
def test_div_partitioning_refuses_bad_counts(rows, k, pattern):
    with pytest.raises(ValueError, match=pattern):
        shard_sizes(rows, k)
    with pytest.raises(ValueError, match=pattern):
        shard_offsets(rows, k)


@pytest.mark.parametrize(("rows", "k"), [(4.0, 2), ("4", 2), (4, 2.0), (True, 1)])
def test_div_partitioning_wants_ints(rows, k):
    with pytest.raises(TypeError, match=r"must be an int"):
        shard_sizes(rows, k)
