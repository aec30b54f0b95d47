"""A small input pipeline: ``Dataset``, enough of ``tf.data`` for real training scripts.

A dataset is an immutable chain of steps starting at a source (``from_tensor_slices``,
``from_tensors``, ``range``, ``from_files``); each method returns a new dataset. Iterating
it yields elements: nests (tuples, named tuples, lists, dicts) of NumPy arrays. Every
``iter()`` is a new epoch: a shuffle with ``reshuffle_each_iteration=True`` draws a new
order, deterministically from its seed, the epoch and how often it has been restarted
inside the epoch (by ``repeat``).

Pipelines that only reorder slices of arrays (``from_tensor_slices`` → ``shuffle`` /
``repeat`` / ``take`` / ``shard`` → ``batch``) move indices, not elements, and gather each
batch with one fancy index per array; any ``map`` in between falls back to element-wise
work. Both paths give the same elements in the same order.

The steps are ``Dataset``'s subclasses below it: sources (slices of arrays, a range,
files, a plain iterable) and transformations (shuffle, repeat, take, shard, map, batch).
Each implements ``_stream(run, by_index)``: its elements, or, for steps that only reorder
or select the elements of an indexable source (slices, range), indices into that source,
which ``batch`` gathers with one fancy index per array. ``Dataset``'s methods make them,
so they share this module.
"""

from __future__ import annotations

import abc
import itertools
import os
import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from .._nest import describe, flatten, map_structure
from .options import Options

__all__ = ["Dataset", "ArraySpec", "AUTOTUNE", "INFINITE_CARDINALITY", "UNKNOWN_CARDINALITY"]

AUTOTUNE = -1
INFINITE_CARDINALITY = -1
UNKNOWN_CARDINALITY = -2


@dataclass(frozen=True)
class ArraySpec:
    """The shape and dtype of one leaf of an element; ``None`` marks a dimension that
    varies (the batch dimension of a batch made without ``drop_remainder``)."""

    shape: tuple[int | None, ...]
    dtype: np.dtype


def _spec_of(element: Any) -> Any:
    return map_structure(lambda x: ArraySpec(tuple(x.shape), np.dtype(x.dtype)), element)


def _leaf(value: Any) -> Any:
    """An element's leaf: arrays (anything with shape and dtype) as they are, the rest
    (Python numbers, strings) through ``np.asarray``."""
    if isinstance(value, (np.ndarray, np.generic)):
        return value
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return value
    return np.asarray(value)


def _own(value: Any) -> Any:
    """A slice that does not share memory with the source array."""
    return value.copy() if isinstance(value, np.ndarray) else value


def _as_element(value: Any) -> Any:
    return map_structure(_leaf, value)


def _arrays(value: Any, copy: bool) -> Any:
    """Convert a ``from_tensor_slices`` argument: tuples and dicts are structure, anything
    else (lists included, as TF does) becomes one array."""
    if isinstance(value, dict):
        return type(value)((k, _arrays(v, copy)) for k, v in value.items())
    if isinstance(value, tuple):
        parts = [_arrays(v, copy) for v in value]
        return type(value)(*parts) if hasattr(type(value), "_fields") else tuple(parts)
    return np.array(value, copy=True) if copy else np.asarray(value)


def _index(value: Any, what: str, low: int) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an integer, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {value!r} "
                        f"({type(value).__name__})") from None
    if number < low:
        raise ValueError(f"{what} must be >= {low}, got {number}")
    return number


class _Run:
    """One iteration over a pipeline: the epoch, seed overrides, the file shard, and how
    many times each shuffle has started so far."""

    __slots__ = ("epoch", "seed", "salt", "file_shard", "peek", "_starts")

    def __init__(self, epoch: int = 0, seed: int | None = None, salt: int = 0,
                 file_shard: tuple[int, int] | None = None, peek: bool = False) -> None:
        self.epoch = epoch
        self.seed = seed  # replaces the seed of shuffles made with seed=None
        self.salt = salt  # mixed into those replacement seeds (e.g. the worker index)
        self.file_shard = file_shard  # (num_shards, index) applied to from_files paths
        self.peek = peek  # only the first element is wanted: shuffles pass through
        self._starts: dict[int, int] = {}

    def start(self, node: object) -> int:
        count = self._starts.get(id(node), 0)
        self._starts[id(node)] = count + 1
        return count


def _mix(*values: int) -> int:
    words = np.random.SeedSequence([v % 2**64 for v in values]).generate_state(2, np.uint64)
    return int(words[0]) << 64 | int(words[1])


class Dataset(abc.ABC):
    """A sequence of elements built from arrays, files or a range (see the module doc).

    Construct with the static methods; never directly.
    """

    _parent: Dataset | None = None

    def __init__(self, options: Options | None = None) -> None:
        self._options = options if options is not None else Options()
        self._epochs = itertools.count()
        self._spec_cache: tuple[Any] | None = None

    # --- sources ------------------------------------------------------------------------

    @staticmethod
    def from_tensor_slices(tensors: Any) -> Dataset:
        """One element per row of the arrays: element ``i`` is ``tensors`` with every
        array replaced by its ``i``-th slice along the first dimension.

        Tuples, named tuples and dicts are structure; a list is converted to one array
        (so ``from_tensor_slices([1, 2, 3])`` has three scalar elements). The arrays are
        not copied: do not modify them while the dataset is in use.

        Raises:
            ValueError: no arrays, a scalar, or first dimensions of different sizes.
        """
        return _Slices(_arrays(tensors, copy=False), "from_tensor_slices")

    @staticmethod
    def from_tensors(tensors: Any) -> Dataset:
        """A dataset with the single element ``tensors`` (lists become arrays)."""
        arrays = map_structure(lambda a: a[np.newaxis], _arrays(tensors, copy=False))
        return _Slices(arrays, "from_tensors")

    @staticmethod
    def range(*args: int) -> Dataset:
        """``range(stop)``, ``range(start, stop)`` or ``range(start, stop, step)`` as
        int64 scalars."""
        if not 1 <= len(args) <= 3:
            raise TypeError(f"range takes 1 to 3 integers (stop, or start, stop[, step]), "
                            f"got {len(args)}")
        values = [_index(a, "range argument", -(2**63)) for a in args]
        if len(values) == 3 and values[2] == 0:
            raise ValueError("range step must not be 0")
        return _Range(range(*values))

    @staticmethod
    def from_files(paths: str | Sequence[Any], reader: Callable[[Any], Iterable[Any]]
                   ) -> Dataset:
        """The elements ``reader(path)`` yields, for each path in order.

        This is the dataset that FILE auto-sharding splits: worker ``w`` of ``W`` reads
        only ``paths[w::W]``.

        Args:
            paths: one path or a sequence of paths (str or path-like).
            reader: called with one path; returns an iterable of elements (nests of arrays
                or of Python numbers, which become arrays).
        """
        listed = [paths] if isinstance(paths, (str, bytes, os.PathLike)) else list(paths)
        if not listed:
            raise ValueError("from_files got no paths; pass at least one file to read")
        if not callable(reader):
            raise TypeError(f"reader must be a callable taking a path, got "
                            f"{type(reader).__name__}")
        return _Files(listed, reader)

    # --- transformations ----------------------------------------------------------------

    def shuffle(self, buffer_size: int | None, seed: int | None = None,
                reshuffle_each_iteration: bool = True) -> Dataset:
        """Shuffle with a buffer of ``buffer_size`` elements (``None``: the whole dataset).

        The buffer holds the next ``buffer_size`` elements and yields a random one,
        refilling its place with the next element, as ``tf.data`` does. With ``seed`` the
        orders are reproducible; ``seed=None`` draws one now (under MPI the strategy
        replaces it with a seed shared by every worker). ``reshuffle_each_iteration=False``
        repeats the first order in every epoch.
        """
        if buffer_size is not None:
            buffer_size = _index(buffer_size, "shuffle buffer_size", 1)
        elif self.cardinality() == INFINITE_CARDINALITY:
            raise ValueError("shuffle(buffer_size=None) shuffles the whole dataset, but this "
                             "one is infinite; pass a buffer_size, or shuffle before repeat()")
        if seed is not None:
            seed = _index(seed, "shuffle seed", -(2**63))
        return _Shuffle(self, buffer_size, seed, bool(reshuffle_each_iteration))

    def batch(self, batch_size: int, drop_remainder: bool = False,
              num_parallel_calls: int | None = None, deterministic: bool | None = None
              ) -> Dataset:
        """Stack ``batch_size`` consecutive elements into one (a new first dimension);
        the last batch is smaller unless ``drop_remainder``. ``num_parallel_calls`` and
        ``deterministic`` are accepted for TF scripts (batches are made in order)."""
        if num_parallel_calls is not None:
            _index(num_parallel_calls, "num_parallel_calls", AUTOTUNE)
        return _Batch(self, _index(batch_size, "batch_size", 1), bool(drop_remainder))

    def repeat(self, count: int | None = None) -> Dataset:
        """Repeat the dataset ``count`` times (``None`` or -1: forever)."""
        if count is not None:
            count = _index(count, "repeat count", -1)
        return _Repeat(self, None if count in (None, -1) else count)

    def map(self, map_func: Callable[..., Any], num_parallel_calls: int | None = None,
            deterministic: bool | None = None) -> Dataset:
        """Apply ``map_func`` to every element; a tuple element is passed as separate
        arguments, anything else as one. Runs in order in this process
        (``num_parallel_calls`` and ``deterministic`` are accepted for TF scripts)."""
        if not callable(map_func):
            raise TypeError(f"map_func must be callable, got {type(map_func).__name__}")
        if num_parallel_calls is not None:
            _index(num_parallel_calls, "num_parallel_calls", AUTOTUNE)
        return _Map(self, map_func)

    def take(self, count: int) -> Dataset:
        """The first ``count`` elements (-1: all)."""
        return _Take(self, _index(count, "take count", -1))

    def shard(self, num_shards: int, index: int) -> Dataset:
        """Every ``num_shards``-th element starting at ``index`` (for
        ``distribute_datasets_from_function`` with ``InputContext``)."""
        num = _index(num_shards, "shard num_shards", 1)
        idx = _index(index, "shard index", 0)
        if idx >= num:
            raise ValueError(f"shard index must be in [0, {num - 1}] for num_shards={num}, "
                             f"got {idx}")
        return _Shard(self, num, idx)

    def prefetch(self, buffer_size: int) -> Dataset:
        """Accepted for TF scripts; elements are produced on demand in this process."""
        _index(buffer_size, "prefetch buffer_size", AUTOTUNE)
        return _Pass(self, self._options, "prefetch")

    def with_options(self, options: Options) -> Dataset:
        """This dataset with ``options`` merged into its options (options set here win)."""
        return _Pass(self, self._options.merge(options), "with_options")

    def options(self) -> Options:
        """A copy of this dataset's options."""
        return Options().merge(self._options)

    # --- inspection and iteration -------------------------------------------------------

    def cardinality(self) -> int:
        """The number of elements; ``INFINITE_CARDINALITY`` (-1) or
        ``UNKNOWN_CARDINALITY`` (-2) when it is infinite or not known in advance."""
        return self._cardinality()

    def __len__(self) -> int:
        n = self.cardinality()
        if n == INFINITE_CARDINALITY:
            raise TypeError("The dataset is infinite.")
        if n == UNKNOWN_CARDINALITY:
            raise TypeError("The dataset length is unknown.")
        return n

    @property
    def element_spec(self) -> Any:
        """A nest of :class:`ArraySpec` like one element, or None for an empty dataset.

        Datasets read from files or mapped learn it from their first element (read once).
        """
        if self._spec_cache is None:
            self._spec_cache = (self._spec(),)
        return self._spec_cache[0]

    def __iter__(self) -> Iterator[Any]:
        return self._elements(_Run(epoch=next(self._epochs)))

    def as_numpy_iterator(self) -> Iterator[Any]:
        """Iterate the elements (they are NumPy already); for TF scripts."""
        return iter(self)

    def __repr__(self) -> str:
        steps = []
        node: Dataset | None = self
        while node is not None:
            steps.append(node._describe())
            node = node._parent
        return f"<Dataset {' -> '.join(reversed(steps))}>"

    # --- what each step implements ------------------------------------------------------

    def _elements(self, run: _Run) -> Iterator[Any]:
        source = self._index_source()
        if source is None:
            return self._stream(run, by_index=False)
        return map(source._element, self._stream(run, by_index=True))

    @abc.abstractmethod
    def _stream(self, run: _Run, by_index: bool) -> Iterator[Any]:
        """Elements, or (``by_index``) indices into :meth:`_index_source`."""

    def _index_source(self) -> _Slices | _Range | None:
        """The source whose indices this step reorders, or None when elements change."""
        return None

    def _cardinality(self) -> int:
        return UNKNOWN_CARDINALITY

    def _spec(self) -> Any:
        return None

    def _describe(self) -> str:
        return type(self).__name__.lstrip("_").lower()


def _chain(dataset: Dataset) -> Iterator[Dataset]:
    """The steps of ``dataset`` from the last one back to its source."""
    node: Dataset | None = dataset
    while node is not None:
        yield node
        node = node._parent



# --- sources ----------------------------------------------------------------------------


class _Slices(Dataset):
    def __init__(self, arrays: Any, how: str) -> None:
        super().__init__()
        leaves = flatten(arrays)
        if not leaves:
            raise ValueError(f"{how} got no arrays ({arrays!r}); pass an array or a "
                             f"tuple/dict of arrays")
        if any(a.ndim == 0 for a in leaves):
            raise ValueError(f"{how} needs arrays with a first dimension to slice, got "
                             f"{describe(arrays)}; use from_tensors for a single element")
        sizes = {a.shape[0] for a in leaves}
        if len(sizes) > 1:
            raise ValueError(f"{how} needs every array to have the same size in its first "
                             f"dimension, got {describe(arrays)}")
        self._arrays = arrays
        self._n = sizes.pop()
        self._how = how

    def _stream(self, run: _Run, by_index: bool) -> Iterator[Any]:
        return iter(range(self._n)) if by_index else map(self._element, range(self._n))

    def _index_source(self) -> _Slices:
        return self

    def _element(self, i: int) -> Any:
        return map_structure(lambda a: _own(a[i]), self._arrays)

    def _gather(self, indices: np.ndarray) -> Any:
        return map_structure(lambda a: a[indices], self._arrays)

    def _cardinality(self) -> int:
        return self._n

    def _spec(self) -> Any:
        return map_structure(lambda a: ArraySpec(tuple(a.shape[1:]), a.dtype), self._arrays)

    def _describe(self) -> str:
        return f"{self._how}({self._n})"


class _Range(Dataset):
    def __init__(self, values: range) -> None:
        super().__init__()
        self._range = values

    def _stream(self, run: _Run, by_index: bool) -> Iterator[Any]:
        n = len(self._range)
        return iter(range(n)) if by_index else map(self._element, range(n))

    def _index_source(self) -> _Range:
        return self

    def _element(self, i: int) -> Any:
        return np.int64(self._range[i])

    def _gather(self, indices: np.ndarray) -> Any:
        return (self._range.start + self._range.step * indices).astype(np.int64)

    def _cardinality(self) -> int:
        return len(self._range)

    def _spec(self) -> Any:
        return ArraySpec((), np.dtype(np.int64))

    def _describe(self) -> str:
        r = self._range
        return f"range({r.start}, {r.stop}, {r.step})"


class _Files(Dataset):
    def __init__(self, paths: list[Any], reader: Callable[[Any], Iterable[Any]]) -> None:
        super().__init__()
        self.paths = paths
        self._reader = reader

    def _stream(self, run: _Run, by_index: bool) -> Iterator[Any]:
        paths = self.paths
        if run.file_shard is not None:
            num, index = run.file_shard
            paths = paths[index::num]
        for path in paths:
            produced = self._reader(path)
            try:
                elements = iter(produced)
            except TypeError:
                raise TypeError(f"reader({path!r}) returned {type(produced).__name__}, which "
                                f"is not iterable; the reader must yield the file's "
                                f"elements") from None
            for element in elements:
                yield _as_element(element)

    def _spec(self) -> Any:
        first = next(self._stream(_Run(peek=True), False), None)
        return None if first is None else _spec_of(first)

    def _describe(self) -> str:
        return f"from_files({len(self.paths)} files)"


class _Iterable(Dataset):
    """A plain Python iterable of (already batched) elements, for DistributedDataset."""

    def __init__(self, iterable: Iterable[Any]) -> None:
        super().__init__()
        self._iterable = iterable

    def _stream(self, run: _Run, by_index: bool) -> Iterator[Any]:
        return map(_as_element, self._iterable)

    def _cardinality(self) -> int:
        try:
            return len(self._iterable)  # type: ignore[arg-type]
        except TypeError:
            return UNKNOWN_CARDINALITY

    def _describe(self) -> str:
        return f"iterable({type(self._iterable).__name__})"


# --- steps that reorder or select elements (indices when the source allows) -------------


class _Step(Dataset):
    def __init__(self, parent: Dataset, options: Options | None = None) -> None:
        super().__init__(parent._options if options is None else options)
        self._parent = parent
        self._up = parent

    def _index_source(self) -> _Slices | _Range | None:
        return self._up._index_source()

    def _cardinality(self) -> int:
        return self._up.cardinality()

    def _spec(self) -> Any:
        return self._up.element_spec


class _Pass(_Step):
    def __init__(self, parent: Dataset, options: Options, name: str) -> None:
        super().__init__(parent, options)
        self._name = name

    def _stream(self, run: _Run, by_index: bool) -> Iterator[Any]:
        return self._up._stream(run, by_index)

    def _describe(self) -> str:
        return self._name


class _Shuffle(_Step):
    def __init__(self, parent: Dataset, buffer_size: int | None, seed: int | None,
                 reshuffle: bool) -> None:
        super().__init__(parent)
        self.seeded = seed is not None
        self._seed = seed if seed is not None else int(cast(int, np.random.SeedSequence().entropy))
        self._buffer = buffer_size
        self._reshuffle = reshuffle
        self._depth = sum(1 for _ in _chain(self))

    def _stream(self, run: _Run, by_index: bool) -> Iterator[Any]:
        items = self._up._stream(run, by_index)
        if run.peek:
            return items
        seed = self._seed
        if not self.seeded and run.seed is not None:
            seed = _mix(run.seed, run.salt, self._depth)
        entropy = [seed, run.epoch, run.start(self)] if self._reshuffle else [seed]
        rng = np.random.default_rng([v % 2**64 for v in entropy])
        return _shuffled(items, self._buffer, rng)

    def _describe(self) -> str:
        size = "all" if self._buffer is None else self._buffer
        return f"shuffle({size}, seed={self._seed if self.seeded else None})"


def _shuffled(items: Iterator[Any], buffer_size: int | None, rng: np.random.Generator
              ) -> Iterator[Any]:
    if buffer_size is None:
        pool = list(items)
        for i in rng.permutation(len(pool)):
            yield pool[i]
        return
    buffer = list(itertools.islice(items, buffer_size))
    draws: Iterator[float] = iter(())
    while buffer:
        u = next(draws, None)
        if u is None:
            draws = iter(rng.random(1024).tolist())
            u = next(draws)
        i = int(u * len(buffer))
        yield buffer[i]
        for item in items:
            buffer[i] = item
            break
        else:
            buffer[i] = buffer[-1]
            buffer.pop()


class _Repeat(_Step):
    def __init__(self, parent: Dataset, count: int | None) -> None:
        super().__init__(parent)
        self._count = count

    def _stream(self, run: _Run, by_index: bool) -> Iterator[Any]:
        done = 0
        while self._count is None or done < self._count:
            produced = False
            for item in self._up._stream(run, by_index):
                produced = True
                yield item
            if not produced:
                return
            done += 1

    def _cardinality(self) -> int:
        n = self._up.cardinality()
        if n == 0 or self._count == 0:
            return 0
        if self._count is None or n == INFINITE_CARDINALITY:
            return INFINITE_CARDINALITY
        return n if n == UNKNOWN_CARDINALITY else n * self._count

    def _describe(self) -> str:
        return f"repeat({self._count})"


class _Take(_Step):
    def __init__(self, parent: Dataset, count: int) -> None:
        super().__init__(parent)
        self._count = count

    def _stream(self, run: _Run, by_index: bool) -> Iterator[Any]:
        items = self._up._stream(run, by_index)
        return items if self._count < 0 else itertools.islice(items, self._count)

    def _cardinality(self) -> int:
        n = self._up.cardinality()
        if self._count < 0 or n == UNKNOWN_CARDINALITY:
            return n
        return self._count if n == INFINITE_CARDINALITY else min(n, self._count)

    def _describe(self) -> str:
        return f"take({self._count})"


class _Shard(_Step):
    def __init__(self, parent: Dataset, num: int, index: int) -> None:
        super().__init__(parent)
        self._num = num
        self._at = index

    def _stream(self, run: _Run, by_index: bool) -> Iterator[Any]:
        items = self._up._stream(run, by_index)
        return itertools.islice(items, self._at, None, self._num)

    def _cardinality(self) -> int:
        n = self._up.cardinality()
        if n < 0:
            return n
        return max(0, -(-(n - self._at) // self._num))

    def _describe(self) -> str:
        return f"shard({self._num}, {self._at})"


# --- steps that make new elements ---------------------------------------------------------


class _Map(_Step):
    def __init__(self, parent: Dataset, fn: Callable[..., Any]) -> None:
        super().__init__(parent)
        self._fn = fn

    def _index_source(self) -> None:
        return None

    def _apply(self, element: Any) -> Any:
        out = self._fn(*element) if type(element) is tuple else self._fn(element)
        return _as_element(out)

    def _stream(self, run: _Run, by_index: bool) -> Iterator[Any]:
        return map(self._apply, self._up._elements(run))

    def _spec(self) -> Any:
        first = next(self._up._elements(_Run(peek=True)), None)
        return None if first is None else _spec_of(self._apply(first))

    def _describe(self) -> str:
        return f"map({getattr(self._fn, '__name__', type(self._fn).__name__)})"


class _Batch(_Step):
    def __init__(self, parent: Dataset, batch_size: int, drop_remainder: bool) -> None:
        super().__init__(parent)
        self.batch_size = batch_size
        self.drop_remainder = drop_remainder

    def _index_source(self) -> None:
        return None

    def _stream(self, run: _Run, by_index: bool) -> Iterator[Any]:
        parent = self._up
        size = self.batch_size
        source = parent._index_source()
        if source is not None:
            indices = parent._stream(run, by_index=True)
            while True:
                chunk = np.fromiter(itertools.islice(indices, size), dtype=np.intp)
                if not len(chunk) or (self.drop_remainder and len(chunk) < size):
                    return
                yield source._gather(chunk)
        elements = parent._elements(run)
        while True:
            group = list(itertools.islice(elements, size))
            if not group or (self.drop_remainder and len(group) < size):
                return
            yield map_structure(lambda *leaves: _stack(leaves), *group)

    def _cardinality(self) -> int:
        n = self._up.cardinality()
        if n < 0:
            return n
        return n // self.batch_size if self.drop_remainder else -(-n // self.batch_size)

    def _spec(self) -> Any:
        inner = self._up.element_spec
        size = self.batch_size if self.drop_remainder else None
        return None if inner is None else map_structure(
            lambda s: ArraySpec((size, *s.shape), s.dtype), inner)

    def _describe(self) -> str:
        extra = ", drop_remainder=True" if self.drop_remainder else ""
        return f"batch({self.batch_size}{extra})"


def _stack(leaves: tuple[Any, ...]) -> np.ndarray:
    try:
        return np.stack(leaves)
    except ValueError:
        first = np.shape(leaves[0])
        for i, leaf in enumerate(leaves):
            if np.shape(leaf) != first:
                raise ValueError(
                    f"cannot batch elements with different shapes: element 0 of the batch "
                    f"has shape {first} and element {i} has shape {np.shape(leaf)}; make "
                    f"them equal in map() (pad or crop) before batch()"
                ) from None
        raise
