"""Variables: plain ones, and the distributed ones a strategy's ``scope()`` creates.

``mpistrat.Variable(initial_value, ...)`` outside any strategy is a plain variable (one
NumPy array with ``assign``/``assign_add``/``assign_sub``/``numpy``). Inside a strategy's
scope it becomes, by ``synchronization``:

* :class:`MirroredVariable` (ON_WRITE, AUTO) — one copy per local replica, identical on
  every replica of every rank. In replica context an update is aggregated across all
  replicas first (SUM, MEAN, or ONLY_FIRST_REPLICA: global replica 0's value), then
  applied to every copy; with aggregation NONE an update in replica context is an error
  (TensorFlow let the copies silently diverge). In cross-replica context an update
  applies the given value to every local copy (no communication: give every rank the
  same value).
* :class:`SyncOnReadVariable` (ON_READ) — each replica updates its own copy without
  communicating; reading in cross-replica context aggregates the copies of every rank
  (SUM, MEAN, ONLY_FIRST_REPLICA), so such a read is collective.

Creation is collective over the strategy's ranks: the initial value is broadcast from
rank 0, so every replica starts identical even when ranks were seeded differently.
"""

from __future__ import annotations

import enum
import itertools
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from ..backends import get_backend
from ..backends.interop import to_host, to_native
from ..elastic.hooks import before_write
from ..ops import ReduceOp
from ..runtime.agreement import agree
from ..values import Mirrored, PerReplica, components_of, select_replica
from . import context

__all__ = ["VariableSynchronization", "VariableAggregation", "Variable", "DistributedVariable",
           "MirroredVariable", "SyncOnReadVariable"]


class VariableSynchronization(enum.Enum):
    """When a distributed variable's copies are made consistent."""

    AUTO = 0
    NONE = 1
    ON_WRITE = 2
    ON_READ = 3


class VariableAggregation(enum.Enum):
    """How per-replica updates (ON_WRITE) or reads (ON_READ) are combined."""

    NONE = 0
    SUM = 1
    MEAN = 2
    ONLY_FIRST_REPLICA = 3


def _parse(enum_type: type[enum.Enum], value: Any, what: str) -> Any:
    if isinstance(value, enum_type):
        return value
    if isinstance(value, str) and value.strip().upper() in enum_type.__members__:
        return enum_type[value.strip().upper()]
    raise ValueError(f"Invalid variable {what} mode: {value!r}; expected one of "
                     f"{', '.join(f'{enum_type.__name__}.{m}' for m in enum_type.__members__)}")


_names = itertools.count()


class _VariableMeta(type):
    """``Variable(...)`` inside a strategy's scope builds that strategy's distributed
    variable instead of a plain one."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is Variable and context.has_strategy():
            return _create_distributed(*args, **kwargs)
        return super().__call__(*args, **kwargs)


class Variable(metaclass=_VariableMeta):
    """A mutable array (``tf.Variable``); distributed inside a strategy's ``scope()``.

    Args:
        initial_value: an array-like, or a function returning one.
        trainable: recorded for the user (there is no autodiff here).
        name: a name (default ``Variable_<n>``).
        dtype: cast the initial value to this dtype.
        synchronization: ON_WRITE/AUTO (mirrored) or ON_READ (sync-on-read); NONE is an
            error inside a strategy scope.
        aggregation: NONE, SUM, MEAN or ONLY_FIRST_REPLICA.
    """

    def __init__(self, initial_value: Any = None, trainable: bool = True, name: str | None = None,
                 dtype: Any = None, synchronization: Any = VariableSynchronization.AUTO,
                 aggregation: Any = VariableAggregation.NONE, shape: Any = None) -> None:
        self._value = _initial(initial_value, dtype)
        self._init_common(name, trainable, synchronization, aggregation)

    def _init_common(self, name: str | None, trainable: bool, synchronization: Any,
                     aggregation: Any) -> None:
        self._name = name if name is not None else f"Variable_{next(_names)}"
        self._trainable = bool(trainable)
        self._synchronization = _parse(VariableSynchronization, synchronization,
                                       "synchronization")
        self._aggregation = _parse(VariableAggregation, aggregation, "aggregation")

    # -- facts
    @property
    def name(self) -> str:
        return self._name

    @property
    def trainable(self) -> bool:
        return self._trainable

    @property
    def synchronization(self) -> VariableSynchronization:
        return self._synchronization

    @property
    def aggregation(self) -> VariableAggregation:
        return self._aggregation

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._read_array().shape)

    @property
    def dtype(self) -> np.dtype:
        return self._read_array().dtype

    # -- reading
    def _read_array(self) -> np.ndarray:
        return self._value

    def numpy(self) -> np.ndarray:
        """A copy of the current value, as a NumPy array (in host memory)."""
        return np.array(to_host(self._read_array()), copy=True)

    def read_value(self) -> Any:
        """A copy of the current value where it lives: a NumPy array, or a CuPy array on
        the replica's GPU for GPU replicas."""
        return self._read_array().copy()

    def value(self) -> Any:
        """As :meth:`read_value`."""
        return self.read_value()

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        array = self._read_array()
        if copy or not isinstance(array, np.ndarray):  # a device copy: read to the host
            return np.array(to_host(array), dtype=dtype, copy=True)
        view = array.view()
        view.flags.writeable = False  # never modify a variable through np.asarray(v)
        return view if dtype is None else view.astype(dtype, copy=False)

    def _operand(self) -> Any:
        """The value as an operand of arithmetic: a read-only NumPy view, or the device
        array itself (whose operations make new arrays)."""
        array = self._read_array()
        return np.asarray(self) if isinstance(array, np.ndarray) else array

    # -- writing
    def assign(self, value: Any, use_locking: bool = False, name: Any = None,
               read_value: bool = True) -> Any:
        self._set(self._value, value)
        return self

    def assign_add(self, delta: Any, use_locking: bool = False, name: Any = None,
                   read_value: bool = True) -> Any:
        self._add(self._value, delta, +1)
        return self

    def assign_sub(self, delta: Any, use_locking: bool = False, name: Any = None,
                   read_value: bool = True) -> Any:
        self._add(self._value, delta, -1)
        return self

    def _set(self, target: Any, value: Any) -> None:
        """Write ``value`` into the copy ``target`` (moved to where ``target`` lives)."""
        before_write()  # (an elastic job's snapshot may still be copying the old value)
        backend = get_backend(target)
        source = _beside(target, _as_array(value))
        backend.xp.copyto(target, self._shaped(source, tuple(target.shape), backend.xp),
                          casting="unsafe")

    def _add(self, target: Any, delta: Any, sign: int) -> None:
        """``target += sign * delta`` (``delta`` moved to where ``target`` lives)."""
        delta = _beside(target, _as_array(delta))
        self._set(target, target + delta if sign > 0 else target - delta)

    def _shaped(self, array: Any, shape: tuple[int, ...], xp: Any = np) -> Any:
        """``array`` broadcast to the variable's ``shape``; ValueError naming both."""
        if tuple(array.shape) == shape:
            return array
        try:
            return xp.broadcast_to(array, shape)
        except ValueError:
            raise ValueError(f"cannot assign a value of shape {tuple(array.shape)} to "
                             f"variable {self._name!r} of shape {shape}") from None

    # -- arithmetic reads the value
    def __add__(self, other: Any) -> Any: return self._operand() + other
    def __radd__(self, other: Any) -> Any: return other + self._operand()
    def __sub__(self, other: Any) -> Any: return self._operand() - other
    def __rsub__(self, other: Any) -> Any: return other - self._operand()
    def __mul__(self, other: Any) -> Any: return self._operand() * other
    def __rmul__(self, other: Any) -> Any: return other * self._operand()
    def __truediv__(self, other: Any) -> Any: return self._operand() / other
    def __rtruediv__(self, other: Any) -> Any: return other / self._operand()
    def __matmul__(self, other: Any) -> Any: return self._operand() @ other
    def __rmatmul__(self, other: Any) -> Any: return other @ self._operand()
    def __neg__(self) -> Any: return -self._operand()
    def __len__(self) -> int: return len(self._read_array())
    def __float__(self) -> float: return float(self._read_array())
    def __int__(self) -> int: return int(self._read_array())

    def __getitem__(self, key: Any) -> Any:
        part = self._operand()[key]
        return part if isinstance(part, (np.ndarray, np.generic)) else part.copy()

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} {self._name!r} shape={self.shape} dtype={self.dtype} "
                f"numpy={np.array2string(to_host(self._read_array()), threshold=6)}>")


def _merge_op(variable: Variable) -> ReduceOp:
    """How the replicas' values of an update in replica context combine (SUM or MEAN
    aggregation); MEAN of a non-float variable is TF's error."""
    if variable.aggregation is VariableAggregation.SUM:
        return ReduceOp.SUM
    if not np.issubdtype(variable.dtype, np.inexact):
        raise ValueError(
            f"Cannot update non-float variables with VariableAggregation.MEAN "
            f"aggregation in replica context: {variable.name!r} is {variable.dtype}; use "
            f"SUM or ONLY_FIRST_REPLICA, or a float variable")
    return ReduceOp.MEAN


def _as_array(value: Any) -> Any:
    """``value`` as a NumPy or CuPy array (a variable: a copy of its value where it lives)."""
    if isinstance(value, Mirrored):  # e.g. a reduce_to result: every copy is the same
        value = value.primary
    if isinstance(value, Variable):
        return value.read_value()
    if isinstance(value, np.ndarray) or np.isscalar(value) or isinstance(value, (list, tuple)):
        return np.asarray(value)
    return to_native(value, "use as a variable's value")  # other libraries' arrays


def _beside(target: Any, array: Any) -> Any:
    """``array`` where the copy ``target`` lives: host values onto its GPU, values of
    another GPU copied over, device values read to the host for a host copy."""
    if isinstance(target, np.ndarray):
        return to_host(array)
    return get_backend(target).asarray(array)


def _placed(parts: list[Any], strategy: Any) -> list[Any]:
    """Each replica's part of an update on that replica's device, to be reduced there."""
    placement = strategy.extended.placement
    if not placement.gpu:
        return [np.asarray(p) if isinstance(p, np.generic) else p for p in parts]
    return [placement.put(p, i) for i, p in enumerate(parts)]


def _initial(initial_value: Any, dtype: Any) -> np.ndarray:
    """The initial value as a new host array (device values are read to the host: a
    distributed variable places its copies itself)."""
    if initial_value is None:
        raise ValueError("initial_value must be given (an array-like or a function returning "
                         "one)")
    value = initial_value() if callable(initial_value) else initial_value
    return np.array(to_host(_as_array(value)), dtype=dtype, copy=True, order="C")


class _Component:
    """One local copy of a distributed variable, as ``extended.update`` hands it to ``fn``."""

    def __init__(self, owner: DistributedVariable, index: int) -> None:
        self._owner, self._index = owner, index

    @property
    def _array(self) -> Any:
        return self._owner._components[self._index]

    def numpy(self) -> np.ndarray:
        return np.array(to_host(self._array), copy=True)

    def read_value(self) -> Any:
        return self._array.copy()

    value = read_value

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        return np.array(to_host(self._array), dtype=dtype, copy=True)

    def assign(self, value: Any, *args: Any, **kwargs: Any) -> _Component:
        self._owner._set(self._array, value)
        return self

    def assign_add(self, delta: Any, *args: Any, **kwargs: Any) -> _Component:
        self._owner._add(self._array, delta, +1)
        return self

    def assign_sub(self, delta: Any, *args: Any, **kwargs: Any) -> _Component:
        self._owner._add(self._array, delta, -1)
        return self


class DistributedVariable(Variable):
    """A variable with one copy per local replica of a strategy."""

    _registry: dict[int, weakref.ref] = {}

    def __init__(self, strategy: Any, initial: np.ndarray, name: str | None, trainable: bool,
                 synchronization: Any, aggregation: Any) -> None:
        self._strategy = strategy
        placement = strategy.extended.placement
        count = len(strategy.extended.worker_devices)
        if placement.gpu:  # one copy on each replica's GPU
            self._components = [placement.clone(initial, i) for i in range(count)]
        else:
            self._components = [initial] + [initial.copy() for _ in range(count - 1)]
        self._init_common(name, trainable, synchronization, aggregation)
        # the same on every rank (creation is collective), unlike default names
        self._creation_index = strategy._variables_created
        strategy._variables_created += 1
        for component in self._components:
            DistributedVariable._registry[id(component)] = weakref.ref(self)

    @classmethod
    def _owner_of(cls, value: Any) -> DistributedVariable | None:
        if isinstance(value, _Component):
            return value._owner
        ref = cls._registry.get(id(value))
        owner = ref() if ref is not None else None
        if owner is not None and any(c is value for c in owner._components):
            return owner
        return None

    @property
    def values(self) -> tuple[np.ndarray, ...]:
        """The local copies, in device order."""
        return tuple(self._components)

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(self._strategy.extended.worker_devices)

    @property
    def primary(self) -> np.ndarray:
        return self._components[0]

    @property
    def shape(self) -> tuple[int, ...]:
        """Every copy's shape (reading it never communicates)."""
        return tuple(self._components[0].shape)

    @property
    def dtype(self) -> np.dtype:
        return self._components[0].dtype

    @property
    def distribute_strategy(self) -> Any:
        return self._strategy

    def _replica_index(self) -> int | None:
        """This replica's local index inside ``run`` of our strategy, else None."""
        entry = context._current()
        if entry.replica_context is not None and entry.strategy is self._strategy:
            return entry.replica_context._local_index
        return None

    def _read_array(self) -> np.ndarray:
        index = self._replica_index()
        return self._components[0 if index is None else index]

    def _update_components(self, fn: Callable[..., Any], args: Any, kwargs: dict) -> list[Any]:
        return [fn(_Component(self, i), *select_replica(i, tuple(args)),
                   **select_replica(i, kwargs)) for i in range(len(self._components))]

    def _set_all(self, value: Any) -> None:
        for component in self._components:
            self._set(component, value)

    def _first_replica_value(self, value: Any) -> np.ndarray:
        """Global replica 0's value (rank 0's first local replica), on every rank."""
        local = np.array(to_host(_as_array(value.values[0] if isinstance(value, PerReplica)
                                           else value)),
                         dtype=self.dtype, copy=True, order="C")
        comm = self._strategy.comm
        if comm.Get_size() == 1:
            return local
        # keyed by creation order in the strategy, not by the name: a default name counts
        # every variable the process made, strategy or not, so it can differ between ranks
        agree(comm, f"variable #{self._creation_index} {local.shape} {local.dtype.str}", None,
              f"variable {self._name!r} ONLY_FIRST_REPLICA update",
              hint="values of the variable's shape")
        comm.Bcast(local.reshape(-1).view(np.uint8), root=0)
        return local

    def __repr__(self) -> str:
        parts = ", ".join(f"{d}: {np.array2string(to_host(c), threshold=6)}"
                          for d, c in zip(self.devices, self._components))
        return f"<{type(self).__name__} {self._name!r} shape={self.shape} {{{parts}}}>"


class MirroredVariable(DistributedVariable):
    """Identical copies on every replica; see the module docstring for update rules."""

    def assign(self, value: Any, use_locking: bool = False, name: Any = None,
               read_value: bool = True) -> Any:
        return self._update("assign", value)

    def assign_add(self, delta: Any, use_locking: bool = False, name: Any = None,
                   read_value: bool = True) -> Any:
        return self._update("assign_add", delta)

    def assign_sub(self, delta: Any, use_locking: bool = False, name: Any = None,
                   read_value: bool = True) -> Any:
        return self._update("assign_sub", delta)

    def _update(self, kind: str, value: Any) -> Any:
        ctx = context.get_replica_context()
        if ctx is None or self._replica_index() is None:  # cross-replica context
            if isinstance(value, PerReplica):
                raise ValueError(
                    f"{kind} of MirroredVariable {self._name!r} in cross-replica context got a "
                    f"PerReplica value, which would make its copies differ; reduce it first "
                    f"(strategy.reduce) or update inside strategy.run")
            self._apply(kind, _as_array(value))
            return self
        if self._aggregation is VariableAggregation.NONE:
            raise ValueError(
                f"You must specify an aggregation method to update a MirroredVariable in "
                f"Replica Context: {kind} of {self._name!r} has aggregation NONE, and "
                f"TensorFlow's later behaviour (each copy updated alone) would let the "
                f"replicas diverge; create it with aggregation=VariableAggregation.SUM, MEAN "
                f"or ONLY_FIRST_REPLICA")
        ctx.merge_call(self._merge_update, args=(kind, value))
        return self

    def _merge_update(self, strategy: Any, kind: Any, value: Any) -> None:
        kind = kind if isinstance(kind, str) else kind.values[0]
        devices = self.devices
        parts = list(value.values) if isinstance(value, PerReplica) else [value] * len(devices)
        parts = _placed([_as_array(p) for p in parts], strategy)
        aggregation = self._aggregation
        if aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
            reduced = self._first_replica_value(parts[0])
        else:
            op = _merge_op(self)
            per_replica = PerReplica(parts, devices)
            reduced = components_of(strategy.extended.reduce_to(op, per_replica, per_replica))[0]
        self._apply(kind, reduced)

    def _apply(self, kind: str, value: Any) -> None:
        if kind == "assign":
            self._set_all(value)
        else:
            for component in self._components:
                self._add(component, value, +1 if kind == "assign_add" else -1)


class SyncOnReadVariable(DistributedVariable):
    """Each replica updates its own copy; cross-replica reads aggregate (collectively)."""

    def _read_array(self) -> np.ndarray:
        index = self._replica_index()
        if index is not None:
            return self._components[index]
        return self._aggregated()

    def _aggregated(self) -> np.ndarray:
        aggregation = self._aggregation
        if aggregation is VariableAggregation.NONE:
            raise ValueError(
                f"Could not convert from `tf.VariableAggregation` {aggregation} to "
                f"`tf.distribute.ReduceOp` type: reading sync-on-read variable "
                f"{self._name!r} in cross-replica context needs aggregation SUM, MEAN or "
                f"ONLY_FIRST_REPLICA")
        if aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
            return self._first_replica_value(self._components[0])
        op = ReduceOp.SUM if aggregation is VariableAggregation.SUM else ReduceOp.MEAN
        per_replica = PerReplica(list(self._components), self.devices)
        return components_of(self._strategy.extended.reduce_to(op, per_replica, per_replica))[0]

    def assign(self, value: Any, use_locking: bool = False, name: Any = None,
               read_value: bool = True) -> Any:
        index = self._replica_index()
        if index is not None:
            self._set(self._components[index], value)
        elif self._aggregation is VariableAggregation.SUM:
            share = _as_array(value) / self._strategy.num_replicas_in_sync
            self._set_all(share.astype(self.dtype))
        else:
            self._set_all(value)
        return self

    def assign_add(self, delta: Any, use_locking: bool = False, name: Any = None,
                   read_value: bool = True) -> Any:
        return self._delta("assign_add", delta, +1)

    def assign_sub(self, delta: Any, use_locking: bool = False, name: Any = None,
                   read_value: bool = True) -> Any:
        return self._delta("assign_sub", delta, -1)

    def _delta(self, kind: str, delta: Any, sign: int) -> Any:
        index = self._replica_index()
        targets = [index] if index is not None else range(len(self._components))
        if index is None and self._aggregation is VariableAggregation.SUM:
            raise ValueError(
                f"SyncOnReadVariable does not support `{kind}` in cross-replica context when "
                f"aggregation is set to `tf.VariableAggregation.SUM`: use assign, or "
                f"{kind} inside strategy.run")
        for i in targets:
            self._add(self._components[i], delta, sign)
        return self


class OneCopyVariable(Variable):
    """A variable held once (not per replica) that every replica of its strategy reads:
    TF's ``AggregatingVariable`` rules for updates.

    In replica context (inside ``strategy.run``, with more than one replica)
    ``assign``/``assign_add``/``assign_sub`` merge the replicas' values by the aggregation
    and apply the result once: SUM adds them, MEAN averages them, ONLY_FIRST_REPLICA takes
    replica 0's; NONE raises ``ValueError``. With one replica, or in cross-replica
    context, an update applies its value directly.

    Subclasses set ``_strategy`` and define ``_apply`` and ``_merge_device``.
    """

    _strategy: Any
    # apply one update (kind: assign, assign_add or assign_sub) to the copy
    _apply: Callable[[str, np.ndarray, bool], None]
    # the device the replicas' values are reduced onto
    _merge_device: Callable[[], str]

    def assign(self, value: Any, use_locking: bool = False, name: Any = None,
               read_value: bool = True) -> Any:
        return self._update("assign", value, use_locking)

    def assign_add(self, delta: Any, use_locking: bool = False, name: Any = None,
                   read_value: bool = True) -> Any:
        return self._update("assign_add", delta, use_locking)

    def assign_sub(self, delta: Any, use_locking: bool = False, name: Any = None,
                   read_value: bool = True) -> Any:
        return self._update("assign_sub", delta, use_locking)

    def _update(self, kind: str, value: Any, use_locking: bool) -> Any:
        entry = context._current()
        strategy = self._strategy
        replicas = len(strategy.extended.worker_devices)
        if entry.replica_context is None or entry.strategy is not strategy or replicas == 1:
            if isinstance(value, PerReplica):
                raise ValueError(
                    f"{kind} of {type(self).__name__} {self._name!r} in cross-replica "
                    f"context got a PerReplica value; reduce it first (strategy.reduce) or "
                    f"update inside strategy.run")
            self._apply(kind, _as_array(value), use_locking)
            return self
        if self._aggregation is VariableAggregation.NONE:
            raise ValueError(
                f"You must specify an aggregation method to update a AggregatingVariable in "
                f"Replica Context: {kind} of {self._name!r} has aggregation NONE and the "
                f"strategy has {replicas} replicas, whose values would have to be merged; "
                f"create it with aggregation=VariableAggregation.SUM, MEAN or "
                f"ONLY_FIRST_REPLICA, or update it in cross-replica context "
                f"(merge_call, then strategy.extended.update)")
        entry.replica_context.merge_call(self._merge_update, args=(kind, value, use_locking))
        return self

    def _merge_update(self, strategy: Any, kind: Any, value: Any, use_locking: Any) -> None:
        """Merge the replicas' values (cross-replica context) and apply the result once."""
        kind = kind if isinstance(kind, str) else kind.values[0]
        use_locking = bool(components_of(use_locking)[0])
        devices = strategy.extended.worker_devices
        # each replica's part; a list of numbers comes regrouped as a list of PerReplica
        parts = _placed([_as_array(select_replica(i, value)) for i in range(len(devices))],
                        strategy)
        aggregation = self._aggregation
        if aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
            self._apply(kind, parts[0], use_locking)
            return
        op = _merge_op(self)
        reduced = strategy.extended.reduce_to(op, PerReplica(parts, devices),
                                              self._merge_device())
        self._apply(kind, components_of(reduced)[0], use_locking)


def _create_distributed(initial_value: Any = None, trainable: bool | None = None,
                        name: str | None = None, dtype: Any = None,
                        synchronization: Any = VariableSynchronization.AUTO,
                        aggregation: Any = VariableAggregation.NONE, shape: Any = None) -> Any:
    strategy = context.get_strategy()
    create = getattr(strategy, "_create_variable", None)
    if create is not None:  # a strategy that places its variables itself (parameter servers)
        return create(initial_value=initial_value, trainable=trainable, name=name, dtype=dtype,
                      synchronization=synchronization, aggregation=aggregation, shape=shape)
    if not context.in_cross_replica_context():
        raise RuntimeError(
            f"variables of {type(strategy).__name__} are created in its scope(), not inside "
            f"strategy.run: create them before the training loop")
    synchronization = _parse(VariableSynchronization, synchronization, "synchronization")
    aggregation = _parse(VariableAggregation, aggregation, "aggregation")
    if synchronization is VariableSynchronization.AUTO:
        synchronization = VariableSynchronization.ON_WRITE  # what TF resolves AUTO to
    if synchronization is VariableSynchronization.NONE:
        raise ValueError(
            "`NONE` variable synchronization mode is not supported with `Mirrored` "
            "distribution strategy. Please change the `synchronization` for variable: "
            f"{name or 'Variable'}")
    comm = strategy.comm
    signature = error = None
    initial = None
    try:
        initial = _initial(initial_value, dtype)
        if aggregation is VariableAggregation.MEAN and not np.issubdtype(initial.dtype,
                                                                        np.inexact):
            raise ValueError(
                f"aggregation MEAN needs a float variable, got dtype {initial.dtype} for "
                f"{name or 'Variable'!r}: the mean of integers is not an integer (TensorFlow "
                f"refuses it too); use VariableAggregation.SUM or ONLY_FIRST_REPLICA, or a "
                f"float dtype")
        signature = f"Variable {initial.shape} {initial.dtype.str} {synchronization.name} " \
                    f"{aggregation.name}"
    except (ValueError, TypeError) as exc:
        error = exc
    if comm is not None and comm.Get_size() > 1:
        agree(comm, signature, error, "Variable creation",
              hint="variables created in the same order with the same shapes and dtypes")
        assert initial is not None  # agree raised on every rank if any rank failed
        comm.Bcast(initial.reshape(-1).view(np.uint8), root=0)  # rank 0's value everywhere
    elif error is not None:
        raise error
    assert initial is not None  # (else the error was raised above)
    cls = SyncOnReadVariable if synchronization is VariableSynchronization.ON_READ \
        else MirroredVariable
    if trainable is None:
        trainable = synchronization is not VariableSynchronization.ON_READ
    return cls(strategy, initial, name, trainable, synchronization, aggregation)
