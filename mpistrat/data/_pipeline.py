"""The steps of a ``Dataset`` pipeline: sources (slices of arrays, a range, files, a plain
iterable) and transformations (shuffle, repeat, take, shard, map, batch).

Each step implements ``_stream(run, by_index)``: its elements, or, for steps that only
reorder or select the elements of an indexable source (slices, range), indices into that
source, which ``batch`` gathers with one fancy index per array.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import numpy as np

from .._nest import describe, flatten, map_structure
from .dataset import (
    INFINITE_CARDINALITY,
    UNKNOWN_CARDINALITY,
    ArraySpec,
    Dataset,
    _as_element,
    _chain,
    _mix,
    _own,
    _Run,
    _spec_of,
)
from .options import Options

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
