"""Variable partitioners (TF's ``tf.distribute.experimental.partitioners``) and the "div" split
of a variable's rows into shards.

A partitioner is called as ``partitioner(shape, dtype)`` for a variable and returns how many
shards to make along each axis, ``[k, 1, ..., 1]``: only axis 0 is ever split. The counts are
TensorFlow's, computed from the shape and the bytes per element; nothing here allocates
arrays or talks to MPI. :func:`validate_partitions` holds a partitioner's result to TF's rule
and clips ``k`` to the rows; :func:`shard_sizes` and :func:`shard_offsets` give the rows of
each shard (the first ``rows % k`` shards get one row more).
"""

from __future__ import annotations

import abc
import math
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "Partitioner",
    "FixedShardsPartitioner",
    "MinSizePartitioner",
    "MaxSizePartitioner",
    "validate_partitions",
    "shard_sizes",
    "shard_offsets",
]

Number = int | float


# --- argument checks ---------------------------------------------------------------------


def _count(owner: str, name: str, value: Any,
           fix: str = "pass 1 for one shard (an unpartitioned variable) or more") -> int:
    """A shard count: an integer >= 1."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{owner}: {name} must be an integer >= 1 (a number of shards), got "
                        f"{value!r} of type {type(value).__name__}; pass an int such as 2")
    count = operator.index(value)
    if count < 1:
        raise ValueError(f"{owner}: {name} must be an integer >= 1 (a number of shards), got "
                         f"{count}; {fix}")
    return count


def _byte_count(owner: str, name: str, value: Any) -> Number:
    """A byte count: a finite number >= 1 (TF accepts floats here, so do we)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{owner}: {name} must be a number of bytes >= 1, got {value!r} of "
                        f"type {type(value).__name__}; pass an int such as 256 << 10")
    number: Number = operator.index(value) if isinstance(value, (int, np.integer)) \
        else float(value)
    if not math.isfinite(number) or number < 1:
        raise ValueError(f"{owner}: {name} must be a number of bytes >= 1, got {value!r}; "
                         f"pass a positive byte count such as 256 << 10 (256 KiB)")
    return number


def _shape(shape: Any) -> tuple[int, ...]:
    """The shape as a tuple of ints >= 0; every dimension must be known."""
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise TypeError(f"shape must be a sequence of ints such as (1024, 64), got {shape!r}; "
                        f"for a vector of n rows pass (n,)")
    dims = tuple(shape)
    out = []
    for i, dim in enumerate(dims):
        if dim is None:
            raise ValueError(f"shape {dims!r} is not fully defined: dimension {i} is None; a "
                             f"partitioner needs the size of every dimension")
        if isinstance(dim, bool) or not hasattr(dim, "__index__"):
            raise TypeError(f"shape {dims!r} has {dim!r} as dimension {i}; every dimension "
                            f"must be an int >= 0")
        size = operator.index(dim)
        if size < 0:
            raise ValueError(f"shape {dims!r} has the negative size {size} as dimension {i}; "
                             f"every dimension must be an int >= 0")
        out.append(size)
    return tuple(out)


def _axis(axis: Any, shape: tuple[int, ...]) -> int:
    if isinstance(axis, bool) or not hasattr(axis, "__index__"):
        raise TypeError(f"axis must be an int, got {axis!r}; pass 0 (the rows)")
    index = operator.index(axis)
    if not shape:
        raise ValueError(f"cannot partition a variable of shape () along axis {index}: a "
                         f"rank-0 (scalar) variable has no axis to split; keep it whole "
                         f"(ParameterServerStrategy does not call the partitioner for it)")
    if not -len(shape) <= index < len(shape):
        raise ValueError(f"cannot partition along axis {index} when the shape is only "
                         f"{shape!r} (rank {len(shape)}); use an axis in "
                         f"[-{len(shape)}, {len(shape)}), normally 0 (the rows)")
    return index % len(shape)


def _element_bytes(dtype: Any, bytes_per_string: Number) -> Number:
    """Bytes per element: the dtype's item size, or ``bytes_per_string`` for strings of no
    fixed width (``"string"``, ``str``, ``bytes``, ``object``), as TF counts ``tf.string``."""
    if isinstance(dtype, str) and dtype.strip().lower() in ("string", "tf.string"):
        return bytes_per_string
    try:
        resolved = np.dtype(dtype)
    except (TypeError, ValueError) as error:
        raise TypeError(f"dtype must be a NumPy dtype or its name (np.float32, 'float32', "
                        f"'string' for strings), got {dtype!r}: {error}") from error
    if resolved.kind == "O" or (resolved.kind in "SU" and resolved.itemsize == 0):
        return bytes_per_string
    return resolved.itemsize


def _ceil_div(a: Number, b: Number) -> int:
    if isinstance(a, int) and isinstance(b, int):
        return -(-a // b)
    return math.ceil(a / b)


def _floor_div(a: Number, b: Number) -> int:
    if isinstance(a, int) and isinstance(b, int):
        return a // b
    return math.floor(a / b)


# --- partitioners ------------------------------------------------------------------------


class Partitioner(abc.ABC):
    """Base class of the partitioners: a callable ``(shape, dtype, axis=0) -> list[int]``.

    A subclass returns, for a variable of ``shape`` and ``dtype``, the number of shards on
    each axis; ParameterServerStrategy accepts only ``[k, 1, ..., 1]``
    (see :func:`validate_partitions`).
    """

    @abc.abstractmethod
    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        """Return the number of shards on each axis of a variable.

        Args:
            shape: the variable's shape, a sequence of ints.
            dtype: its dtype: anything ``numpy.dtype`` accepts, or ``"string"``.
            axis: the axis to split (default 0, the rows).

        Returns:
            One count per axis: ``k`` on ``axis`` and 1 elsewhere.
        """


class FixedShardsPartitioner(Partitioner):
    """A fixed number of shards: ``min(num_shards, shape[axis])``.

    ``FixedShardsPartitioner(num_shards=2)((10, 3), np.float32)`` is ``[2, 1]``. As in TF, a
    variable with 0 rows gets ``[0, ...]``, and the dtype is not looked at.

    Args:
        num_shards: the number of shards, an int >= 1.
    """

    def __init__(self, num_shards: int) -> None:
        self._num_shards = _count("FixedShardsPartitioner", "num_shards", num_shards)

    @property
    def num_shards(self) -> int:
        return self._num_shards

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        dims = _shape(shape)
        index = _axis(axis, dims)
        result = [1] * len(dims)
        result[index] = min(self._num_shards, dims[index])
        return result

    def __repr__(self) -> str:
        return f"FixedShardsPartitioner(num_shards={self._num_shards})"


class MinSizePartitioner(Partitioner):
    """As many shards as the bytes allow, each of about ``min_shard_bytes`` or more, at most
    ``max_shards`` (TF's ``min_max_variable_partitioner``).

    ``k = ceil(total_bytes / min_shard_bytes)``, clipped to ``max_shards`` and to
    ``shape[axis]``, and at least 1. Shape ``(6, 1)`` float32 (24 bytes) with
    ``min_shard_bytes=4``: ``[2, 1]`` with ``max_shards=2``, ``[6, 1]`` with ``max_shards=10``.
    The recommended setting for parameter servers is
    ``MinSizePartitioner(256 << 10, max_shards=num_ps)``.

    Args:
        min_shard_bytes: the least bytes per shard (default 256 KiB), a number >= 1.
        max_shards: the most shards (default 1), an int >= 1.
        bytes_per_string: the bytes one string element is counted as (default 16).
    """

    def __init__(self, min_shard_bytes: Number = 256 << 10, max_shards: int = 1,
                 bytes_per_string: Number = 16) -> None:
        owner = "MinSizePartitioner"
        self._min_shard_bytes = _byte_count(owner, "min_shard_bytes", min_shard_bytes)
        self._max_shards = _count(owner, "max_shards", max_shards)
        self._bytes_per_string = _byte_count(owner, "bytes_per_string", bytes_per_string)

    @property
    def min_shard_bytes(self) -> Number:
        return self._min_shard_bytes

    @property
    def max_shards(self) -> int:
        return self._max_shards

    @property
    def bytes_per_string(self) -> Number:
        return self._bytes_per_string

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        dims = _shape(shape)
        index = _axis(axis, dims)
        total_bytes = math.prod(dims) * _element_bytes(dtype, self._bytes_per_string)
        wanted = _ceil_div(total_bytes, self._min_shard_bytes)
        result = [1] * len(dims)
        result[index] = max(1, min(dims[index], self._max_shards, wanted))
        return result

    def __repr__(self) -> str:
        return (f"MinSizePartitioner(min_shard_bytes={self._min_shard_bytes}, "
                f"max_shards={self._max_shards}, bytes_per_string={self._bytes_per_string})")


class MaxSizePartitioner(Partitioner):
    """As few shards as keep each at ``max_shard_bytes`` or less (TF's
    ``variable_axis_size_partitioner``); ``max_shards`` wins over the size.

    Each shard holds ``max(1, floor(max_shard_bytes / bytes_per_row))`` rows, so
    ``k = ceil(rows / rows_per_shard)``, then clipped to ``max_shards``. A row larger than
    ``max_shard_bytes`` still makes one shard. Shape ``(6, 1)`` float32: ``[6, 1]`` with
    ``max_shard_bytes=4``, ``[2, 1]`` with ``max_shards=2`` as well, ``[1, 1]`` with
    ``max_shard_bytes=1024``.

    Args:
        max_shard_bytes: the most bytes per shard, a number >= 1.
        max_shards: the most shards, an int >= 1; None (or 0, as in TF) for no limit.
        bytes_per_string: the bytes one string element is counted as (default 16).
    """

    def __init__(self, max_shard_bytes: Number, max_shards: int | None = None,
                 bytes_per_string: Number = 16) -> None:
        owner = "MaxSizePartitioner"
        self._max_shard_bytes = _byte_count(owner, "max_shard_bytes", max_shard_bytes)
        # TF tests ``if max_shards and max_shards < 1``: 0 passes and means no limit
        no_limit = max_shards is None or (not isinstance(max_shards, bool) and max_shards == 0)
        self._max_shards = None if no_limit else _count(
            owner, "max_shards", max_shards, fix="pass None for no limit, or a count >= 1")
        self._bytes_per_string = _byte_count(owner, "bytes_per_string", bytes_per_string)

    @property
    def max_shard_bytes(self) -> Number:
        return self._max_shard_bytes

    @property
    def max_shards(self) -> int | None:
        return self._max_shards

    @property
    def bytes_per_string(self) -> Number:
        return self._bytes_per_string

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        dims = _shape(shape)
        index = _axis(axis, dims)
        element_bytes = _element_bytes(dtype, self._bytes_per_string)
        rows = dims[index]
        row_bytes = math.prod(dims[:index] + dims[index + 1:]) * element_bytes
        result = [1] * len(dims)
        if rows == 0 or row_bytes == 0:
            # nothing to split (TF divides by zero here)
            return result
        rows_per_shard = max(1, _floor_div(self._max_shard_bytes, row_bytes))
        shards = _ceil_div(rows, rows_per_shard)
        if self._max_shards is not None:
            shards = min(self._max_shards, shards)
        result[index] = shards
        return result

    def __repr__(self) -> str:
        return (f"MaxSizePartitioner(max_shard_bytes={self._max_shard_bytes}, "
                f"max_shards={self._max_shards}, bytes_per_string={self._bytes_per_string})")


# --- what a strategy does with a partitioner's result ------------------------------------


def validate_partitions(result: Any, shape: Sequence[int]) -> int:
    """Check a partitioner's ``result`` for a variable of ``shape`` and return the number of
    shards along axis 0: ``result[0]`` clipped to ``shape[0]``; 1 means an ordinary variable.

    As in TF's ParameterServerStrategy, only axis 0 may be split: ``result`` must be a
    list or tuple ``[k, 1, ..., 1]`` with ``k >= 1``. A rank-0 variable is never partitioned
    (TF does not call the partitioner for it), so its result is not looked at. A variable
    with no rows stays whole (TF fails on it with a ZeroDivisionError or, for ``k = 0``,
    with the error below).

    Raises:
        ValueError: ``result`` is not ``[k, 1, ..., 1]`` with ``k >= 1``.
    """
    dims = _shape(shape)
    if not dims:
        return 1
    counts: list[int] = []
    if isinstance(result, (list, tuple)) and all(
            not isinstance(v, bool) and hasattr(v, "__index__") for v in result):
        counts = [operator.index(v) for v in result]
    # k = 0 on a variable with no rows is FixedShardsPartitioner's min(num_shards, 0)
    if not counts or (counts[0] < 1 and not (counts[0] == 0 and dims[0] == 0)) \
            or any(v != 1 for v in counts[1:]):
        raise ValueError(
            f"variable_partitioner must return a list/tuple whose elements are 1 besides the "
            f"first element (non-zero), got: {result!r} for a variable of shape {dims!r}; "
            f"only axis 0 can be split, so return [k] + [1] * (rank - 1) with k >= 1 shards "
            f"along axis 0 (the partitioners of mpistrat.partitioners do)")
    return max(1, min(counts[0], dims[0]))


def shard_sizes(rows: int, num_shards: int) -> list[int]:
    """The rows of each shard under TF's "div" partitioning: sizes differ by at most one and
    the first ``rows % num_shards`` shards get the extra row (13 rows over 5 shards:
    ``[3, 3, 3, 2, 2]``).

    Raises:
        ValueError: ``rows < 0``, ``num_shards < 1``, or more shards than rows (an empty
            shard; clip with :func:`validate_partitions` first).
        TypeError: ``rows`` or ``num_shards`` is not an int.
    """
    if isinstance(rows, bool) or not hasattr(rows, "__index__"):
        raise TypeError(f"rows must be an int >= 0 (the variable's shape[0]), got {rows!r} of "
                        f"type {type(rows).__name__}")
    rows = operator.index(rows)
    if rows < 0:
        raise ValueError(f"rows must be an int >= 0 (the variable's shape[0]), got {rows}")
    shards = _count("shard_sizes", "num_shards", num_shards)
    if shards > max(rows, 1):
        raise ValueError(f"{shards} shards over {rows} rows would leave empty shards; clip the "
                         f"shard count to the rows first (validate_partitions does)")
    base, extra = divmod(rows, shards)
    return [base + 1] * extra + [base] * (shards - extra)


def shard_offsets(rows: int, num_shards: int) -> list[int]:
    """The first row of each shard, then ``rows``: shard ``i`` is rows
    ``offsets[i]:offsets[i + 1]`` (10 rows over 4 shards: ``[0, 3, 6, 8, 10]``).

    Raises:
        ValueError, TypeError: as :func:`shard_sizes`.
    """
    offsets = [0]
    for size in shard_sizes(rows, num_shards):
        offsets.append(offsets[-1] + size)
    return offsets
