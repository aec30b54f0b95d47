"""``Strategy`` and ``StrategyExtended``: the tf.distribute strategy API over MPI.

A strategy owns a communicator (its workers are that communicator's ranks), ``G`` local
devices per rank (CPU replicas or GPUs) and a :class:`~mpistrat.CrossDeviceOps` that
reduces across all of them. ``run`` calls a function once per local replica; ``reduce``
and the ``extended`` methods reduce across every replica of every rank; datasets are
split across workers and replicas (:mod:`mpistrat.data`). Where this differs from
TensorFlow is listed in docs/strategies.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import numpy as np

from .._nest import flatten, map_structure, pack_sequence_as
from ..backends import get_backend, is_cuda_array
from ..backends.interop import to_host, to_native
from ..communication import CommunicationOptions
from ..cross_device_ops import ReductionToOneDevice
from ..data import DistributedDataset, DistributedDatasetsFromFunction, make_numpy_dataset
from ..ops import ReduceOp
from ..runtime import recorder, stall
from ..runtime._mpi import Comm, mpi
from ..runtime.agreement import agree
from ..values import DistributedValues, Mirrored, PerReplica, components_of, regroup, select_replica
from . import context
from .placement import HostPlacement, Placement
from .replica import ReplicaContext, ValueContext, run_replicas
from .run_options import RunOptions, check_run_options
from .variables import DistributedVariable, MirroredVariable

__all__ = ["Strategy", "StrategyExtended"]

_CROSS_REPLICA_ONLY = ("Method requires being in cross-replica context, use "
                       "get_replica_context().merge_call()")


def _as_values(value: Any) -> Any:
    """A distributed variable as the DistributedValues of (copies of) its local copies,
    as TF treats it in reductions: a MirroredVariable is Mirrored, a SyncOnReadVariable
    PerReplica. Anything else unchanged."""
    if not isinstance(value, DistributedVariable):
        return value
    kind = Mirrored if isinstance(value, MirroredVariable) else PerReplica
    return kind([c.copy() for c in value.values], value.devices)


def _as_destinations(destinations: Any) -> Any:
    """A distributed variable as destinations means its devices (TF's optimizers pass
    ``(gradient, variable)`` pairs)."""
    return list(destinations.devices) if isinstance(destinations, DistributedVariable) \
        else destinations


def _in_host_memory(value: Any) -> bool:
    """True when ``value`` (or its first component) is not a CUDA array."""
    first = components_of(value)[0] if isinstance(value, DistributedValues) else value
    return is_cuda_array(first) is None


def _require_cross_replica(strategy: Strategy, what: str) -> None:
    entry = context._current()
    if entry.replica_context is not None and not getattr(entry.strategy, "_is_default", False):
        raise RuntimeError(f"{what}: {_CROSS_REPLICA_ONLY}")


class StrategyExtended:
    """The lower-level API of a strategy (``strategy.extended``)."""

    def __init__(self, strategy: Strategy, cross_device_ops: Any, devices: Sequence[str],
                 num_workers: int, worker_index: int, is_chief: bool,
                 options: CommunicationOptions | None = None,
                 placement: Placement | None = None) -> None:
        self._strategy = strategy
        self._cross_device_ops = cross_device_ops
        self._devices = tuple(devices)
        # where each local replica's arrays live (GPU replicas: its CUDA device)
        self._placement = placement if placement is not None else HostPlacement(devices)
        self._host_ops: Any = None  # GPU replicas' reductions of host values (_ops_for)
        self._num_workers = num_workers
        self._worker_index = worker_index
        self._is_chief = is_chief
        self._options = options

    # -- facts
    @property
    def worker_devices(self) -> tuple[str, ...]:
        """This rank's local devices, one per local replica."""
        return self._devices

    @property
    def placement(self) -> Placement:
        """Where the local replicas keep their arrays (host memory, or one GPU each)."""
        return self._placement

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """Where variables live: the local devices (mirrored on each)."""
        return self._devices

    @property
    def num_workers(self) -> int:
        return self._num_workers

    @property
    def worker_index(self) -> int:
        return self._worker_index

    @property
    def should_checkpoint(self) -> bool:
        """True on the chief only (rank 0 of the strategy's communicator)."""
        return self._is_chief

    @property
    def should_save_summary(self) -> bool:
        return self._is_chief

    @property
    def experimental_between_graph(self) -> bool:
        """True: each rank runs its own program (MPI's model)."""
        return True

    @property
    def experimental_require_static_shapes(self) -> bool:
        return False

    @property
    def cross_device_ops(self) -> Any:
        """The :class:`~mpistrat.CrossDeviceOps` this strategy reduces with."""
        return self._cross_device_ops

    # -- reductions
    def _with_options(self, options: Any) -> Any:
        return self._options if options is None else options

    def reduce_to(self, reduce_op: Any, value: Any, destinations: Any,
                  options: CommunicationOptions | None = None, *, inplace: bool = False,
                  out: Any = None) -> Any:
        """Reduce ``value`` (a PerReplica, Mirrored, or one array per rank) across every
        replica of every rank onto ``destinations``; a :class:`Mirrored`.

        A Mirrored value with MEAN is returned as it is (TF's rule). A plain array counts
        as one value per rank (so ``reduce_to(SUM, 1.0, ...)`` on 2 ranks is 2.0).
        ``inplace`` and ``out`` write the result into the value's components or into given
        arrays, as :meth:`CrossDeviceOps.reduce <mpistrat.CrossDeviceOps.reduce>`.
        """
        _require_cross_replica(self._strategy, "reduce_to")
        op = ReduceOp.parse(reduce_op)
        value = _as_values(value)
        if isinstance(value, Mirrored) and op is ReduceOp.MEAN and out is None:
            return value
        return self._ops_for([value]).reduce(op, value, _as_destinations(destinations),
                                             options=self._with_options(options),
                                             inplace=inplace, out=out)

    def batch_reduce_to(self, reduce_op: Any, value_destination_pairs: Any,
                        options: CommunicationOptions | None = None, *,
                        inplace: bool = False, out: Any = None) -> list[Any]:
        """Reduce several values at once (one batched all-reduce when each destination is
        its value's devices); results in the order of the pairs. ``inplace`` writes each
        result into its value (a grouped in-place reduce), ``out`` into given arrays (one
        entry per pair), as :meth:`CrossDeviceOps.batch_reduce
        <mpistrat.CrossDeviceOps.batch_reduce>`."""
        _require_cross_replica(self._strategy, "batch_reduce_to")
        if isinstance(value_destination_pairs, (list, tuple)):
            value_destination_pairs = [
                (_as_values(pair[0]), *map(_as_destinations, pair[1:]))
                if isinstance(pair, tuple) and pair else pair
                for pair in value_destination_pairs]
        # (an empty or malformed pair is left for the ops, which refuse it on every rank)
        values = [pair[0] for pair in value_destination_pairs
                  if isinstance(pair, tuple) and pair] \
            if isinstance(value_destination_pairs, list) else []
        return self._ops_for(values).batch_reduce(ReduceOp.parse(reduce_op),
                                                  value_destination_pairs,
                                                  options=self._with_options(options),
                                                  inplace=inplace, out=out)

    def _ops_for(self, values: Sequence[Any]) -> Any:
        """The strategy's ops; for GPU replicas, values held in host memory (a loss as a
        NumPy number, say) are reduced on the host by :class:`~mpistrat.
        ReductionToOneDevice` instead (NCCL reads only device memory). A rank whose values
        lie elsewhere than its peers' fails the ops' agreement on every rank."""
        if not self._placement.gpu or not values or not all(map(_in_host_memory, values)):
            return self.cross_device_ops
        if self._host_ops is None:
            self._host_ops = ReductionToOneDevice(comm=self._strategy.comm)
        return self._host_ops

    def update(self, var: Any, fn: Callable[..., Any], args: Sequence[Any] = (),
               kwargs: dict[str, Any] | None = None, group: bool = True) -> Any:
        """Run ``fn(component, *args, **kwargs)`` on each local component of the
        distributed variable ``var``, each call getting its replica's part of PerReplica
        arguments; with ``group`` the results are regrouped (a PerReplica, or the value
        itself when every component gave the same object), else a tuple."""
        _require_cross_replica(self._strategy, "update")
        kwargs = dict(kwargs or {})
        if isinstance(var, DistributedVariable):
            results = var._update_components(fn, args, kwargs)
        else:
            results = [fn(var, *select_replica(0, tuple(args)), **select_replica(0, kwargs))]
        if not group:
            return tuple(results)
        return regroup(results, self._devices[:len(results)])

    def value_container(self, value: Any) -> Any:
        """The distributed variable ``value`` is a component of, else ``value`` itself."""
        owner = DistributedVariable._owner_of(value)
        return owner if owner is not None else value

    def colocate_vars_with(self, colocate_with_variable: Any) -> contextlib.AbstractContextManager:
        """Accepted for compatibility: variables always live on every local device."""
        return contextlib.nullcontext()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({type(self._strategy).__name__}, "
                f"{len(self._devices)} device(s) x {self._num_workers} worker(s))")


class Strategy:
    """Base class of every strategy (``tf.distribute.Strategy``)."""

    _is_default = False

    def __init__(self, extended: StrategyExtended, comm: Comm) -> None:
        self._extended = extended
        self._comm = comm
        self._scope_depth = 0
        # distributed variables created in this strategy's scope so far: the same on every
        # rank (creation is collective), unlike the process-wide counter of default names
        self._variables_created = 0

    # -- facts
    @property
    def extended(self) -> StrategyExtended:
        return self._extended

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas over all ranks: ``W * G``."""
        return self._extended.num_workers * len(self._extended.worker_devices)

    @property
    def comm(self) -> Any:
        """The MPI communicator whose ranks are this strategy's workers."""
        return self._comm

    @property
    def cluster_resolver(self) -> Any:
        return getattr(self, "_cluster_resolver", None)

    def _replica_ids(self) -> list[int]:
        g = len(self._extended.worker_devices)
        return [self._extended.worker_index * g + i for i in range(g)]

    # -- scope
    @contextlib.contextmanager
    def scope(self) -> Iterator[Strategy]:
        """Make this strategy current, in cross-replica context: variables created inside
        become distributed (mirrored or sync-on-read).

        Raises:
            RuntimeError: another strategy's scope is open (mixing strategies), or this
                is called inside ``run`` (replica context).
        """
        current = context._current()
        if self._is_default and context.has_strategy():
            raise RuntimeError(f"Must not nest tf.distribute.Strategy scopes: the default "
                               f"strategy's scope cannot be entered inside "
                               f"{current.strategy!r}'s")
        if current.strategy is not self and not getattr(current.strategy, "_is_default", False) \
                and not current.yields:
            raise RuntimeError(f"Mixing different tf.distribute.Strategy objects: {self!r} is "
                               f"not {current.strategy!r}; leave the other strategy's scope "
                               f"first")
        if current.strategy is self and current.replica_context is not None \
                and not self._is_default:
            raise RuntimeError(f"scope(): {_CROSS_REPLICA_ONLY}")
        # TF's default scope keeps the default replica context current
        replica_context = cast("_DefaultStrategy", self)._default_replica_context \
            if self._is_default else None
        with context._entered(self, replica_context):
            self._scope_depth += 1
            try:
                yield self
            finally:
                self._scope_depth -= 1

    # -- running
    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (),
            kwargs: dict[str, Any] | None = None, options: RunOptions | None = None) -> Any:
        """Call ``fn(*args, **kwargs)`` once per local replica, in a replica context.

        Each replica gets its component of every PerReplica/Mirrored argument
        (distributed variables and plain values are passed unchanged). Returns, per nest
        position, the value itself when every replica returned the same object, else a
        PerReplica; with one local replica, the value unwrapped.

        Traced (:mod:`mpistrat.trace`) as a span ``strategy.run`` holding one span per
        replica; each call is a step of the trace unless the input (a distributed
        dataset's batches) or the script marks the steps.

        ``options`` is a :class:`RunOptions` or None; its fields are about TPU
        compilation and change nothing here (see :mod:`.run_options`).
        """
        _require_cross_replica(self, "run")
        check_run_options(options)
        if not callable(fn):
            raise TypeError(f"run() takes a function, got {type(fn).__name__}")
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"run() args must be a tuple or list, got {type(args).__name__}; "
                            f"for one argument write args=(x,)")
        recorder.boundary(recorder.FROM_STRATEGY)  # (before the step's work)
        t = recorder.begin()
        try:
            with self.scope():  # as in TF: run inside another strategy's scope is an error
                results = run_replicas(self, fn, tuple(args), dict(kwargs or {}),
                                       self._replica_ids(), self._extended.worker_devices)
            return regroup(results, self._extended.worker_devices)
        finally:
            if t:
                recorder.end(t, "strategy.run", recorder.USER,
                             {"fn": getattr(fn, "__name__", type(fn).__name__),
                              "replicas": len(self._extended.worker_devices)})

    def experimental_run_v2(self, fn: Callable[..., Any], args: Sequence[Any] = (),
                            kwargs: dict[str, Any] | None = None,
                            options: RunOptions | None = None) -> Any:
        """Old name of :meth:`run`."""
        return self.run(fn, args, kwargs, options)

    def reduce(self, reduce_op: Any, value: Any, axis: int | Sequence[int] | None = None) -> Any:
        """Reduce ``value`` across every replica of every rank; the result is a plain
        array, the same on every rank.

        With ``axis``, each replica first reduces along it: SUM sums; MEAN sums and counts
        the examples, both summed across replicas, so the mean is over the actual number
        of examples (replicas holding 4 and 2 examples average over 6).

        A nest (dict, list, tuple) of values is reduced leaf by leaf and keeps its
        structure, as in TF. Integer values keep their dtype under SUM (int32 stays int32);
        MEAN along an axis divides, so it gives floats (TF's ``truediv``).

        Raises:
            RuntimeError: called in replica context (use ``merge_call``).
            ValueError: an unknown op, ``axis`` out of range, or SUM of a Mirrored value.
            TypeError: ``axis`` is not an int (or a sequence of ints).
        """
        _require_cross_replica(self, "reduce")
        op = ReduceOp.parse(reduce_op)
        if op not in (ReduceOp.SUM, ReduceOp.MEAN):
            raise TypeError(f"Expected `reduce_op` to be a `tf.distribute.ReduceOp` SUM or "
                            f"MEAN, not: {reduce_op!r}")
        if isinstance(value, (dict, list, tuple)):
            leaves = flatten(value)
            return pack_sequence_as(value, [self._reduce_leaf(op, leaf, axis)
                                            for leaf in leaves])
        return self._reduce_leaf(op, value, axis)

    def _reduce_leaf(self, op: ReduceOp, value: Any, axis: int | Sequence[int] | None) -> Any:
        value = _as_values(value)  # (a MirroredVariable becomes a Mirrored)
        if op is ReduceOp.SUM and isinstance(value, Mirrored) and self.num_replicas_in_sync > 1:
            # TF refuses too: the copies are one value, and summing them is not defined
            raise ValueError(
                "reduce(SUM, ...) got a Mirrored value (or a MirroredVariable), whose copies "
                "are the same value on every replica; summing the copies is not defined "
                "(TensorFlow refuses it too). Reduce the PerReplica values it was made "
                "from, or use MEAN")
        if axis is not None:
            return self._reduce_along(op, value, axis)
        if not isinstance(value, DistributedValues):
            # one value per rank, on /cpu:0, as the ops take a plain value (never raises: a
            # value no backend takes is refused by the ops' agreement, on every rank)
            value = PerReplica([np.asarray(value) if np.isscalar(value) else value])
        reduced = self._extended.reduce_to(op, value, value)  # (its own destinations)
        return components_of(reduced)[0]

    def _reduce_along(self, op: ReduceOp, value: Any, axis: int | Sequence[int]) -> Any:
        axes = (axis,) if not isinstance(axis, (tuple, list)) else tuple(axis)
        for a in axes:
            if isinstance(a, bool) or not isinstance(a, (int, np.integer)):
                raise TypeError(f"Expected `axis` to be an integer not: {axis!r}")
        parts = list(value.values) if isinstance(value, DistributedValues) else [value]
        signature = error = None
        try:  # the rank of the values is data: agree on it, so every rank raises alike
            parts = [to_native(p) for p in parts]
            normalised = []
            for a in axes:
                ndim = parts[0].ndim
                if not -ndim <= a < ndim:
                    raise ValueError(f"`axis` = {a!r} out of range for `value` with rank "
                                     f"{ndim}")
                normalised.append(int(a) % ndim)
            axes = tuple(normalised)
            signature = f"reduce {op.name} along {axes} of rank {parts[0].ndim}"
        except (ValueError, TypeError) as exc:
            error = exc
        if self._extended.num_workers > 1:
            agree(self._comm, signature, error, "Strategy.reduce",
                  hint="values of the same rank (number of dimensions) and the same axis")
        elif error is not None:
            raise error
        # NumPy's sum widens small integers (int32 -> int64); TF keeps the dtype (each
        # part is summed by its own library: CuPy's on a GPU replica's device)
        sums = [get_backend(p).xp.sum(p, axis=axes,
                                      dtype=p.dtype if p.dtype.kind in "iu" else None)
                for p in parts]
        devices = value.devices if isinstance(value, DistributedValues) else None
        numer = PerReplica(sums, devices)
        if op is ReduceOp.SUM:
            total = self._extended.reduce_to(ReduceOp.SUM, numer, numer)
            return components_of(total)[0]
        counts = [get_backend(p).asarray(
            np.asarray(int(np.prod([p.shape[a] for a in axes])), dtype=np.int64))
            for p in parts]
        denom = PerReplica(counts, devices)
        total, count = self._extended.batch_reduce_to(ReduceOp.SUM,
                                                      [(numer, numer), (denom, denom)])
        result = components_of(total)[0]
        dtype = result.dtype if np.issubdtype(result.dtype, np.inexact) else np.float64
        return (result / components_of(count)[0].astype(dtype)).astype(dtype)

    def experimental_distribute_values_from_function(self, value_fn: Callable[[ValueContext],
                                                                              Any]) -> Any:
        """Call ``value_fn(ValueContext)`` once for each of this rank's replicas (in local
        order, with its global replica id, its device current) and return the values as a
        :class:`PerReplica` (a nest of them when ``value_fn`` returns a nest), even with
        one replica, as TF does. No communication.

        Raises:
            TypeError: ``value_fn`` is not callable.
            ValueError: the replicas' values have different structures.
        """
        if not callable(value_fn):
            raise TypeError(f"value_fn must be a callable taking a ValueContext, got "
                            f"{type(value_fn).__name__}")
        devices = self._extended.worker_devices
        count = self.num_replicas_in_sync
        placement = self._extended.placement
        values = []
        for index, j in enumerate(self._replica_ids()):
            with placement.on(index):  # (a GPU replica's arrays are made on its GPU)
                values.append(value_fn(ValueContext(j, count)))
        try:
            return map_structure(lambda *leaves: PerReplica(list(leaves), devices), *values)
        except ValueError as exc:
            raise ValueError(f"value_fn returned values of different structures for the "
                             f"replicas: {exc}") from None

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """This rank's per-replica parts of ``value``, in local device order: the
        components of a PerReplica/Mirrored or distributed variable; for a nest holding
        such values, one nest per replica; a plain value: ``(value,)``."""
        if isinstance(value, (DistributedValues, DistributedVariable)):
            return tuple(value.values)
        if any(isinstance(leaf, DistributedValues) for leaf in flatten(value)):
            count = len(self._extended.worker_devices)
            return tuple(select_replica(i, value) for i in range(count))
        return (value,)

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenate every replica's component of ``value`` along ``axis``, in global
        replica order (cross-replica context); the same array on every rank."""
        _require_cross_replica(self, "gather")
        return self._gather(value, axis)

    def _gather(self, value: Any, axis: int) -> Any:
        """:meth:`gather` on the host; device values give the result on the first local
        replica's device."""
        local_results = self.experimental_local_results(value)
        on_device = any(is_cuda_array(p) for p in local_results)
        # (np.asarray never raises, so every rank reaches the allgather below)
        parts = [to_host(p) if is_cuda_array(p) else np.asarray(p) for p in local_results]
        everyone = self._comm.allgather([(p.shape, p.dtype.str) for p in parts]) \
            if self._extended.num_workers > 1 else [[(p.shape, p.dtype.str) for p in parts]]
        dtypes = {d for rank in everyone for _, d in rank}
        if len(dtypes) != 1:
            raise ValueError(f"gather: replicas hold different dtypes {sorted(dtypes)}")
        shapes = [tuple(shape) for rank in everyone for shape, _ in rank]
        ndim = len(shapes[0])  # checked on every rank's shapes, so every rank raises alike
        if any(len(shape) != ndim for shape in shapes) or not -ndim <= axis < ndim or len(
                {shape[:axis % ndim] + shape[axis % ndim + 1:] for shape in shapes}) != 1:
            raise ValueError(f"gather along axis {axis}: the replicas' values have shapes "
                             f"{shapes}, which must agree in every dimension but that axis")
        local = np.concatenate(parts, axis=axis) if len(parts) > 1 else parts[0]
        result = local if self._extended.num_workers == 1 else \
            np.concatenate(self._comm.allgather(local), axis=axis)
        return self._extended.placement.put(result, 0) if on_device else result

    # -- input
    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        """Split a dataset of *global* batches across workers and replicas; iterating
        yields, per step, each replica's part (a PerReplica with G > 1 local replicas).
        See docs/datasets.md for the sharding and splitting rules."""
        arguments = self._input_arguments()
        return self._built_everywhere("experimental_distribute_dataset", lambda:
                                      DistributedDataset(dataset, **arguments, options=options))

    def distribute_datasets_from_function(self, dataset_fn: Callable[..., Any],
                                          options: Any = None) -> Any:
        """Build each worker's (or, with ``InputReplicationMode.PER_REPLICA``, each
        replica's) input by calling ``dataset_fn(input_context)``; it batches per
        replica and shards itself."""
        arguments = self._input_arguments()
        return self._built_everywhere(
            "distribute_datasets_from_function",
            lambda: DistributedDatasetsFromFunction(dataset_fn, **arguments, options=options))

    def _built_everywhere(self, what: str, build: Callable[[], Any]) -> Any:
        """``build()``, agreed across the workers: when it fails on one rank (say
        ``dataset_fn`` cannot read a file there), every rank raises instead of the others
        waiting for it in the first step's collective."""
        result = error = None
        try:
            result = build()
        except Exception as exc:  # noqa: BLE001 (re-raised on this rank by agree)
            error = exc
        if self._extended.num_workers > 1:
            agree(self._comm, None if error is not None else what, error, what,
                  hint="an input every rank can build")
        elif error is not None:
            raise error
        return result

    def experimental_distribute_datasets_from_function(self, dataset_fn: Callable[..., Any],
                                                       options: Any = None) -> Any:
        """Old name of :meth:`distribute_datasets_from_function`."""
        return self.distribute_datasets_from_function(dataset_fn, options)

    def experimental_make_numpy_dataset(self, numpy_input: Any) -> Any:
        """A dataset of the slices of ``numpy_input`` (copied; lists of arrays stacked)."""
        _require_cross_replica(self, "experimental_make_numpy_dataset")
        return make_numpy_dataset(numpy_input)

    def _input_arguments(self) -> dict[str, Any]:
        devices = self._extended.worker_devices
        placement = self._extended.placement

        def wrap(parts: list[Any]) -> Any:
            if placement.gpu:  # each replica's batch onto its GPU
                parts = [placement.put_nest(part, i) for i, part in enumerate(parts)]
            return parts[0] if len(parts) == 1 else PerReplica(parts, devices)

        workers = self._extended.num_workers
        return {"num_workers": workers, "worker_index": self._extended.worker_index,
                "replicas_per_worker": len(devices), "wrap": wrap,
                "agree_any": self._agree_any if workers > 1 else None,
                "shuffle_seed": self._shuffle_seed()}

    def _agree_any(self, flag: bool) -> bool:
        """Whether any worker's input has another batch (the end of an uneven epoch).
        Watched like every collective: ``mpistrat run``'s stall check and ``--timeout``
        bound it, so a lost peer ends the wait here too."""
        flags = np.array([1 if flag else 0], dtype=np.int64)
        stall.allreduce_max(self._comm, flags, "the distributed dataset's next batch")
        return bool(flags[0])

    def _shuffle_seed(self) -> int | None:
        return None

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.num_replicas_in_sync} replica(s): "
                f"{self._extended.num_workers} worker(s) x "
                f"{len(self._extended.worker_devices)} device(s))")


class _DefaultStrategy(Strategy):
    """The strategy current outside any scope: one replica, no communication."""

    _is_default = True

    def __init__(self) -> None:
        # MPI starts only if a reduction needs the (one-rank) communicator
        self._ops_factory = lambda: ReductionToOneDevice(comm=mpi().COMM_SELF)
        # no communicator: the default strategy never communicates across ranks
        super().__init__(_DefaultExtended(self), cast("Comm", None))
        self._default_replica_context = ReplicaContext(self, 0, 0)

    @property
    def comm(self) -> Any:
        return mpi().COMM_SELF


class _DefaultExtended(StrategyExtended):
    _strategy: _DefaultStrategy

    def __init__(self, strategy: _DefaultStrategy) -> None:
        super().__init__(strategy, None, ("/cpu:0",), 1, 0, True)

    @property
    def cross_device_ops(self) -> Any:
        if self._cross_device_ops is None:
            self._cross_device_ops = self._strategy._ops_factory()
        return self._cross_device_ops

    def reduce_to(self, reduce_op: Any, value: Any, destinations: Any,
                  options: CommunicationOptions | None = None, *, inplace: bool = False,
                  out: Any = None) -> Any:
        op = ReduceOp.parse(reduce_op)
        if not isinstance(value, DistributedValues) and not inplace and out is None:
            return np.asarray(value)  # one device: the value itself
        if isinstance(value, Mirrored) and op is ReduceOp.MEAN and out is None:
            return value
        return self.cross_device_ops.reduce(op, value, destinations, options=options,
                                            inplace=inplace, out=out)

    def batch_reduce_to(self, reduce_op: Any, value_destination_pairs: Any,
                        options: CommunicationOptions | None = None, *,
                        inplace: bool = False, out: Any = None) -> list[Any]:
        if not inplace and out is None:
            return [self.reduce_to(reduce_op, v, d, options)
                    for v, d in value_destination_pairs]
        return self.cross_device_ops.batch_reduce(reduce_op, value_destination_pairs,
                                                  options=options, inplace=inplace, out=out)


context.install(Strategy, _DefaultStrategy)
