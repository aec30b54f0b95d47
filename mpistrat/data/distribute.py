"""Distributed input: one worker's view of a dataset split across ``W`` workers of ``R``
replicas (``N = W * R``), as ``experimental_distribute_dataset`` and
``distribute_datasets_from_function`` give it.

Iterating a :class:`DistributedDataset` or :class:`DistributedDatasetsFromFunction` gives a
:class:`~.iterator.DistributedIterator`, which yields one value per global step: a nest
shaped like one element whose leaves are ``wrap([replica 0's array, ..., replica R-1's
array])``. Each ``iter()`` is a new epoch.

Workers step in lock-step through ``agree_any(local_has_data) -> bool``, a collective
"does any worker still have data", called exactly once per step on every worker and once
more at the end (the step where every worker reports False). A worker that ran out before
the others gives each of its replicas an empty batch (first dimension 0, same dtypes) so
the others can finish: TF's ``get_next_as_optional`` behaviour.
"""

from __future__ import annotations

import abc
import hashlib
import itertools
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from .._nest import map_structure
from ..elastic.hooks import iteration_ended, iteration_started, step_boundary, take_resume
from ..runtime import recorder
from .dataset import (
    UNKNOWN_CARDINALITY,
    ArraySpec,
    Dataset,
    _arrays,
    _Batch,
    _chain,
    _Files,
    _Iterable,
    _Run,
    _Shuffle,
)
from .input_context import InputContext
from .iterator import DistributedIterator
from .options import AutoShardPolicy, AutoShardWarning, InputOptions, InputReplicationMode
from .rebatch import (
    _count,
    batch_sizes_for_worker,
    cut_stream,
    empty_like,
    split_global_batch,
)

__all__ = ["DistributedDataset", "DistributedDatasetsFromFunction", "batch_sizes_for_worker",
           "make_numpy_dataset"]

_AUTO_FALLBACK = (
    "AUTO sharding found no Dataset.from_files source to split by file, so it falls back "
    "to DATA sharding: every worker runs the whole input pipeline and keeps its share of "
    "each global batch. To silence this warning set "
    "options.experimental_distribute.auto_shard_policy = AutoShardPolicy.DATA (or OFF) "
    "and pass the options to dataset.with_options(options)."
)


_END = object()  # (a sentinel: the iterator's end)


def make_numpy_dataset(numpy_input: Any) -> Dataset:
    """``Dataset.from_tensor_slices`` over copies of the arrays in ``numpy_input`` (a nest
    of tuples and dicts; a list of arrays is stacked into one array)."""
    return Dataset.from_tensor_slices(_arrays(numpy_input, copy=True))


def _as_dataset(value: Any, what: str) -> Dataset:
    if isinstance(value, Dataset):
        return value
    if isinstance(value, (str, bytes, dict, np.ndarray)) or not isinstance(value, Iterable):
        raise TypeError(
            f"{what} must be a Dataset or an iterable of batches, got "
            f"{type(value).__name__}; wrap arrays as "
            f"Dataset.from_tensor_slices(arrays).batch(global_batch_size)"
        )
    return _Iterable(value)


def _any_batch_size(spec: Any) -> Any:
    """``spec`` (a nest of ``ArraySpec``, or None) with the batch dimension None: what a
    replica receives, whose batches may be smaller or empty at the end."""
    if spec is None:
        return None
    return map_structure(
        lambda s: ArraySpec((None, *s.shape[1:]) if s.shape else s.shape, s.dtype), spec)


def _template_from_spec(spec: Any) -> Any:
    def empty(s: ArraySpec) -> np.ndarray:
        trailing = tuple(d or 0 for d in s.shape[1:])
        return np.zeros((0, *trailing), dtype=s.dtype)

    return None if spec is None else map_structure(empty, spec)


class _DistributedInput(abc.ABC):
    """The lock-step iteration shared by both distributed inputs."""

    def __init__(self, *, num_workers: int, worker_index: int, replicas_per_worker: int,
                 wrap: Callable[[list[Any]], Any],
                 agree_any: Callable[[bool], bool] | None,
                 options: InputOptions | None, shuffle_seed: int | None) -> None:
        self._workers = _count(num_workers, "num_workers", 1)
        self._worker = _count(worker_index, "worker_index", 0)
        self._replicas = _count(replicas_per_worker, "replicas_per_worker", 1)
        if self._worker >= self._workers:
            raise ValueError(f"worker_index must be in [0, {self._workers - 1}] for "
                             f"num_workers={self._workers}, got {self._worker}")
        if not callable(wrap):
            raise TypeError(f"wrap must be callable, got {type(wrap).__name__}")
        if agree_any is not None and not callable(agree_any):
            raise TypeError(f"agree_any must be callable or None, got "
                            f"{type(agree_any).__name__}")
        if options is None:
            options = InputOptions()
        if not isinstance(options, InputOptions):
            raise TypeError(f"options must be an InputOptions, got {type(options).__name__}")
        if shuffle_seed is not None:
            shuffle_seed = _count(shuffle_seed, "shuffle_seed", -(2**63)) % 2**64
        self._wrap = wrap
        self._agree_any = agree_any
        self._options = options
        self._shuffle_seed = shuffle_seed
        self._epochs = itertools.count()
        self._template: Any = None

    @property
    def options(self) -> InputOptions:
        """The :class:`InputOptions` this input was made with."""
        return self._options

    @property
    def num_replicas_in_sync(self) -> int:
        """``W * R``."""
        return self._workers * self._replicas

    @abc.abstractmethod
    def _local_steps(self, epoch: int) -> Iterator[list[Any]]:
        """This worker's steps: lists of ``R`` per-replica elements."""

    @abc.abstractmethod
    def _spec_template(self) -> Any:
        """An empty per-replica batch made from the element spec, or None if unknown."""

    def __iter__(self) -> DistributedIterator:
        """A new epoch: a :class:`DistributedIterator` (``next``, ``get_next``,
        ``get_next_as_optional``)."""
        return DistributedIterator(self._positioned(self._iterate(next(self._epochs))),
                                   lambda: self.element_spec)

    @property
    @abc.abstractmethod
    def element_spec(self) -> Any:
        """The spec of one replica's part of an element: a nest of ``ArraySpec`` with the
        batch dimension None, or None when it is not known before the first element."""

    def reduce(self, initial_state: Any, reduce_func: Callable[[Any, Any], Any]) -> Any:
        """``reduce_func(state, element)`` over one epoch's steps, from ``initial_state``
        (TF's ``DistributedDataset.reduce``); ``element`` holds every local replica's part,
        as in a loop over the dataset. Collective, like iterating."""
        if not callable(reduce_func):
            raise TypeError(f"reduce_func must be callable (state, element) -> state, got "
                            f"{type(reduce_func).__name__}")
        state = initial_state
        for element in self:
            state = reduce_func(state, element)
        return state

    def _positioned(self, batches: Iterator[Any]) -> Iterator[Any]:
        """``batches``, each handed out at a step boundary of an elastic job
        (:mod:`mpistrat.elastic.hooks`): after a restart, the first iterator of this kind
        skips the global batches the restored snapshot had trained on already.

        Each ``next`` is also a step of the trace (:mod:`mpistrat.trace`), marked before
        the wait for the batch (``input wait``: the pipeline's work and the workers'
        agreement that one of them still has data), which thus belongs to the step it
        feeds; the wait that finds the end opens a step too (the epoch's end)."""
        kind = self._kind()
        skip = take_resume(kind)
        iteration_started(kind)
        count = 0
        while count < skip:  # (trained on before the restore: no step of this launch)
            if next(batches, _END) is _END:
                iteration_ended(kind, count)
                return
            count += 1
        while True:
            recorder.boundary(recorder.FROM_INPUT)
            t = recorder.begin()
            batch = next(batches, _END)
            if t:
                recorder.end(t, "input wait", recorder.INPUT,
                             {"batch": count} if batch is not _END
                             else {"batch": count, "end": True})
            if batch is _END:
                break
            count += 1
            step_boundary((kind, count - 1), traced=True)
            yield batch
        iteration_ended(kind, count)

    def _kind(self) -> str:
        """What tells this input's iterators apart across a restart, whatever the number
        of ranks: the class, the number of global steps (``?``: not known) and a digest
        of what the input is made from (:meth:`_source`: a pipeline's steps, with their
        sizes and shuffle seeds), so that only an iterator of the same input resumes."""
        try:
            steps: object = len(self)  # type: ignore[arg-type]
        except TypeError:
            steps = "?"
        digest = hashlib.blake2b(self._source().encode(), digest_size=8).hexdigest()
        return f"{type(self).__name__}/{steps}/{digest}"

    def _source(self) -> str:
        """A description of the input that is the same in every process that builds it
        alike (no object addresses)."""
        return type(self).__name__

    def _iterate(self, epoch: int) -> Iterator[Any]:
        steps = self._local_steps(epoch)
        parts: list[Any] | None
        if self._agree_any is None:
            for parts in steps:
                yield self._combine(parts)
            return
        parts = []
        while True:
            parts = None if parts is None else next(steps, None)
            if not self._agree_any(parts is not None):
                return
            yield self._combine(parts if parts is not None else self._empties())

    def _combine(self, parts: list[Any]) -> Any:
        if self._template is None:
            self._template = empty_like(parts[0])
        return map_structure(lambda *leaves: self._wrap(list(leaves)), *parts)

    def _empties(self) -> list[Any]:
        template = self._template if self._template is not None else self._spec_template()
        if template is None:
            raise RuntimeError(
                f"worker {self._worker} has no input at all and cannot tell the shape of "
                f"an empty batch for the workers that still have data; give every worker "
                f"at least one batch (FILE sharding: files with data for each worker)"
            )
        self._template = template
        return [template] * self._replicas


class DistributedDataset(_DistributedInput):
    """A dataset split across workers and replicas (``experimental_distribute_dataset``).

    Args:
        dataset: a :class:`Dataset` batched with the global batch size, or an iterable of
            global batches (always DATA-sharded: every worker must see the same batches).
        num_workers, worker_index, replicas_per_worker: the topology (``W``, ``w``, ``R``).
        wrap: combines the ``R`` per-replica arrays of one leaf into one value.
        agree_any: the collective "does any worker still have data" (None: one worker).
        options: :class:`InputOptions` (PER_WORKER only).
        shuffle_seed: replaces the seed of shuffles made with ``seed=None``, so that every
            worker shuffles alike (the strategy broadcasts one from rank 0).

    Raises:
        ValueError: ``N > 1`` and the dataset is not batched; FILE sharding of a dataset
            not read from files or with fewer files than workers; DATA sharding over
            several workers of a shuffle without a seed; PER_REPLICA options.
    """

    def __init__(self, dataset: Any, *, num_workers: int, worker_index: int,
                 replicas_per_worker: int, wrap: Callable[[list[Any]], Any],
                 agree_any: Callable[[bool], bool] | None = None,
                 options: InputOptions | None = None,
                 shuffle_seed: int | None = None) -> None:
        super().__init__(num_workers=num_workers, worker_index=worker_index,
                         replicas_per_worker=replicas_per_worker, wrap=wrap,
                         agree_any=agree_any, options=options, shuffle_seed=shuffle_seed)
        if self._options.experimental_replication_mode is InputReplicationMode.PER_REPLICA:
            raise ValueError(
                "InputReplicationMode.PER_REPLICA is only supported by "
                "distribute_datasets_from_function; use PER_WORKER here, or build one "
                "dataset per replica with distribute_datasets_from_function"
            )
        self._dataset = _as_dataset(dataset, "dataset")
        self._mode, self._policy = self._plan()
        self._file_shard = ((self._workers, self._worker)
                            if self._policy is AutoShardPolicy.FILE else None)
        salted = self._policy in (AutoShardPolicy.FILE, AutoShardPolicy.OFF)
        self._salt = self._worker if salted else 0

    def _plan(self) -> tuple[str, AutoShardPolicy | None]:
        """("pass" | "split" | "stream", the sharding policy applied or None)."""
        n = self.num_replicas_in_sync
        if n == 1:
            return "pass", None
        dataset = self._dataset
        batch = next((s for s in _chain(dataset) if isinstance(s, _Batch)), None)
        plain = isinstance(dataset, _Iterable)
        if batch is None and not plain:
            raise ValueError(
                f"Call the `batch` method on the input Dataset in order to be able to split "
                f"your input across {n} replicas: dataset.batch(global_batch_size) "
                f"(got {dataset!r})"
            )
        if self._workers == 1 or plain:
            return "split", None if self._workers == 1 else AutoShardPolicy.DATA
        policy = dataset.options().experimental_distribute.auto_shard_policy
        source = list(_chain(dataset))[-1]
        if policy is AutoShardPolicy.AUTO:
            policy = AutoShardPolicy.FILE if isinstance(source, _Files) else AutoShardPolicy.DATA
            if policy is AutoShardPolicy.DATA and self._worker == 0:
                warnings.warn(_AUTO_FALLBACK, AutoShardWarning, stacklevel=3)
        if policy is AutoShardPolicy.FILE:
            self._check_files(source)
        if policy is AutoShardPolicy.DATA:
            self._check_seeds()
            return "split", policy
        return "stream", policy

    def _check_files(self, source: Dataset) -> None:
        if not isinstance(source, _Files):
            raise ValueError(
                f"auto_shard_policy FILE splits the files of a Dataset.from_files source, "
                f"but this dataset starts at {source!r}; use AutoShardPolicy.DATA (each "
                f"worker keeps its share of every batch) or OFF"
            )
        if len(source.paths) < self._workers:
            raise ValueError(
                f"FILE sharding needs at least as many files as workers: got "
                f"{len(source.paths)} file(s) for {self._workers} workers; split the data "
                f"into at least {self._workers} files, or set auto_shard_policy to "
                f"AutoShardPolicy.DATA"
            )

    def _check_seeds(self) -> None:
        unseeded = [s for s in _chain(self._dataset) if isinstance(s, _Shuffle) and not s.seeded]
        if unseeded and self._shuffle_seed is None:
            raise ValueError(
                f"DATA sharding across {self._workers} workers needs every worker to shuffle "
                f"in the same order, but the dataset has shuffle(seed=None); pass a seed to "
                f"Dataset.shuffle, or shuffle_seed= (the same on every worker) here"
            )

    @property
    def auto_shard_policy(self) -> AutoShardPolicy | None:
        """The sharding applied (FILE, DATA or OFF), None with a single worker."""
        return self._policy

    @property
    def element_spec(self) -> Any:
        """The per-replica element spec (batch dimension None), or None if unknown."""
        spec = self._dataset.element_spec
        return spec if self._mode == "pass" else _any_batch_size(spec)

    def __len__(self) -> int:
        """The number of global steps, when it is known in advance."""
        n = self._dataset.cardinality() if self._mode != "stream" else UNKNOWN_CARDINALITY
        if n < 0:
            raise TypeError(f"the number of steps of this distributed dataset is unknown "
                            f"({'infinite' if n == -1 else 'not known in advance'})")
        return n

    def _local_steps(self, epoch: int) -> Iterator[list[Any]]:
        run = _Run(epoch=epoch, seed=self._shuffle_seed, salt=self._salt,
                   file_shard=self._file_shard)
        elements = self._dataset._elements(run)
        if self._mode == "pass":
            return ([element] for element in elements)
        if self._mode == "split":
            return (split_global_batch(batch, self._workers, self._replicas, self._worker,
                                       step) for step, batch in enumerate(elements))
        batch = next(s for s in _chain(self._dataset) if isinstance(s, _Batch))
        sizes = batch_sizes_for_worker(batch.batch_size, self._workers, self._replicas,
                                       self._worker)
        return cut_stream(elements, sizes, self._replicas, batch.drop_remainder)

    def _spec_template(self) -> Any:
        return _template_from_spec(self._dataset.element_spec)

    def _source(self) -> str:
        return repr(self._dataset)

    def __repr__(self) -> str:
        policy = self._policy.name if self._policy is not None else "none"
        return (f"<DistributedDataset worker {self._worker}/{self._workers} x "
                f"{self._replicas} replicas, sharding {policy}: {self._dataset!r}>")


class DistributedDatasetsFromFunction(_DistributedInput):
    """Input pipelines built by ``dataset_fn(InputContext)`` (``distribute_datasets_from_function``).

    PER_WORKER: ``dataset_fn`` runs once with ``InputContext(W, worker_index, N)``; the
    worker's replicas take consecutive elements, each a per-replica batch. PER_REPLICA:
    it runs once per local replica with ``InputContext(N, global replica id, N)``. No
    sharding or rebatching is done: the function shards (``dataset.shard``) and batches
    with ``ctx.get_per_replica_batch_size(global_batch_size)`` itself.

    Arguments as for :class:`DistributedDataset`; ``shuffle_seed`` is mixed with the
    pipeline id, so unseeded shuffles differ between pipelines but not between runs.
    """

    def __init__(self, dataset_fn: Callable[[InputContext], Any], *, num_workers: int,
                 worker_index: int, replicas_per_worker: int,
                 wrap: Callable[[list[Any]], Any],
                 agree_any: Callable[[bool], bool] | None = None,
                 options: InputOptions | None = None,
                 shuffle_seed: int | None = None) -> None:
        super().__init__(num_workers=num_workers, worker_index=worker_index,
                         replicas_per_worker=replicas_per_worker, wrap=wrap,
                         agree_any=agree_any, options=options, shuffle_seed=shuffle_seed)
        if not callable(dataset_fn):
            raise TypeError(f"dataset_fn must be callable, got {type(dataset_fn).__name__}")
        # (the function, not its datasets: those differ from worker to worker)
        self._function = (f"{getattr(dataset_fn, '__module__', '?')}."
                          f"{getattr(dataset_fn, '__qualname__', type(dataset_fn).__name__)}")
        n = self.num_replicas_in_sync
        if self._options.experimental_replication_mode is InputReplicationMode.PER_WORKER:
            contexts = [InputContext(self._workers, self._worker, n)]
        else:
            first = self._worker * self._replicas
            contexts = [InputContext(n, first + r, n) for r in range(self._replicas)]
        self._pipelines = [
            (ctx.input_pipeline_id,
             _as_dataset(dataset_fn(ctx), f"dataset_fn({ctx!r}) result"))
            for ctx in contexts
        ]

    def _source(self) -> str:
        return self._function

    @property
    def datasets(self) -> list[Dataset]:
        """The datasets ``dataset_fn`` returned (one per worker, or one per replica)."""
        return [dataset for _, dataset in self._pipelines]

    def _local_steps(self, epoch: int) -> Iterator[list[Any]]:
        streams = [dataset._elements(_Run(epoch=epoch, seed=self._shuffle_seed, salt=pid))
                   for pid, dataset in self._pipelines]
        if len(streams) == 1:
            return self._consecutive(streams[0])
        return self._side_by_side(streams)

    def _consecutive(self, stream: Iterator[Any]) -> Iterator[list[Any]]:
        while True:
            group = list(itertools.islice(stream, self._replicas))
            if not group:
                return
            if len(group) < self._replicas:
                group += [empty_like(group[0])] * (self._replicas - len(group))
            yield group

    def _side_by_side(self, streams: list[Iterator[Any]]) -> Iterator[list[Any]]:
        end = object()
        while True:
            group = [next(stream, end) for stream in streams]
            present = [element for element in group if element is not end]
            if not present:
                return
            empty = empty_like(present[0])
            yield [empty if element is end else element for element in group]

    @property
    def element_spec(self) -> Any:
        """The spec of the per-replica batches ``dataset_fn`` made (batch dimension None:
        a worker whose pipelines ended before the others' gets empty batches), or None
        if unknown."""
        specs = (dataset.element_spec for _, dataset in self._pipelines)
        return _any_batch_size(next((spec for spec in specs if spec is not None), None))

    def _spec_template(self) -> Any:
        for _, dataset in self._pipelines:
            template = _template_from_spec(dataset.element_spec)
            if template is not None:
                return template
        return None

    def __repr__(self) -> str:
        mode = self._options.experimental_replication_mode.name
        return (f"<DistributedDatasetsFromFunction worker {self._worker}/{self._workers} x "
                f"{self._replicas} replicas, {mode}>")


# TF's tf.distribute.DistributedDataset is the interface of both kinds of distributed input
DistributedDataset.register(DistributedDatasetsFromFunction)
