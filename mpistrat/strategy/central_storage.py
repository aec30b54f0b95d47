"""``CentralStorageStrategy``: one copy of each variable, compute replicated on this
process's local replicas (TF's ``tf.distribute.experimental.CentralStorageStrategy``).

The compute devices are CPU replicas (``/cpu:0`` by default), run as
``MirroredStrategy`` runs them (one replica thread at a time, ``merge_call``). Each
variable created in the strategy's scope is an :class:`AggregatingVariable`: one NumPy
array on the parameter device, which every replica reads. An update in replica context
is merged across the replicas by the variable's aggregation (SUM, MEAN: reduced onto the
parameter device; ONLY_FIRST_REPLICA: replica 0's value) and applied once; aggregation
NONE is an error there when there is more than one replica, as in TF. Reductions
(``reduce``, ``extended.reduce_to``/``batch_reduce_to``) are a
:class:`~mpistrat.ReductionToOneDevice` onto the parameter device over ``COMM_SELF``: the
strategy never communicates with other ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..communication import CommunicationOptions
from ..cross_device_ops import ReductionToOneDevice
from ..errors import BackendUnavailable
from ..runtime._mpi import mpi
from ..values import parse_device
from . import context
from .base import Strategy, StrategyExtended
from .variables import (
    OneCopyVariable,
    VariableAggregation,
    VariableSynchronization,
    _initial,
    _parse,
)

__all__ = ["CentralStorageStrategy", "AggregatingVariable"]

_LOCAL_CPU = "/cpu:0"


class AggregatingVariable(OneCopyVariable):
    """The one copy of a variable of a :class:`CentralStorageStrategy` (TF's
    ``AggregatingVariable``), on the strategy's parameter device.

    Every replica reads the same array. Updates follow :class:`~mpistrat.strategy.
    variables.OneCopyVariable`'s rules: in replica context with more than one replica,
    merged by the aggregation and applied once.
    """

    def __init__(self, strategy: CentralStorageStrategy, initial: np.ndarray,
                 name: str | None, trainable: bool, synchronization: Any,
                 aggregation: Any) -> None:
        self._strategy = strategy
        self._value = initial
        self._init_common(name, trainable, synchronization, aggregation)

    @property
    def distribute_strategy(self) -> CentralStorageStrategy:
        return self._strategy

    @property
    def device(self) -> str:
        """The parameter device, where the one copy lives."""
        return self._strategy.extended.parameter_devices[0]

    def _merge_device(self) -> str:
        return self.device

    def _apply(self, kind: str, value: np.ndarray, use_locking: bool) -> None:
        if kind == "assign":
            self._set(self._value, value)
        elif kind == "assign_add":
            self._set(self._value, self._value + value)
        else:
            self._set(self._value, self._value - value)

    def __repr__(self) -> str:
        return (f"<AggregatingVariable {self._name!r} shape={self.shape} on {self.device}: "
                f"{np.array2string(self._value, threshold=6)}>")


def _plain(value: Any) -> Any:
    """An AggregatingVariable as its value (its one copy), anything else unchanged."""
    return value.numpy() if isinstance(value, AggregatingVariable) else value


def _device_of(destinations: Any) -> Any:
    """An AggregatingVariable as destinations means its (parameter) device."""
    return destinations.device if isinstance(destinations, AggregatingVariable) \
        else destinations


class CentralStorageExtended(StrategyExtended):
    """``strategy.extended`` of a :class:`CentralStorageStrategy`: the compute devices are
    ``worker_devices``, the parameter device is ``parameter_devices[0]``."""

    def __init__(self, strategy: CentralStorageStrategy, compute_devices: Sequence[str],
                 parameter_device: str) -> None:
        comm = mpi().COMM_SELF
        ops = ReductionToOneDevice(reduce_to_device=parameter_device, comm=comm)
        super().__init__(strategy, ops, compute_devices, 1, 0, True)
        self._parameter_device = parameter_device

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """Where variables live: the one parameter device."""
        return (self._parameter_device,)

    def reduce_to(self, reduce_op: Any, value: Any, destinations: Any,
                  options: CommunicationOptions | None = None, *, inplace: bool = False,
                  out: Any = None) -> Any:
        """Reduce ``value`` across the local replicas on the parameter device and copy the
        result to ``destinations`` (a variable means its parameter device); see
        :meth:`StrategyExtended.reduce_to`."""
        return super().reduce_to(reduce_op, _plain(value), _device_of(destinations), options,
                                 inplace=inplace, out=out)

    def batch_reduce_to(self, reduce_op: Any, value_destination_pairs: Any,
                        options: CommunicationOptions | None = None, *,
                        inplace: bool = False, out: Any = None) -> list[Any]:
        """Several :meth:`reduce_to` at once (``(value, destinations)`` pairs)."""
        if isinstance(value_destination_pairs, (list, tuple)):
            value_destination_pairs = [
                (_plain(pair[0]), *map(_device_of, pair[1:])) if isinstance(pair, tuple)
                else pair for pair in value_destination_pairs]
        return super().batch_reduce_to(reduce_op, value_destination_pairs, options,
                                       inplace=inplace, out=out)


def _local_device(name: Any, what: str) -> str:
    device = parse_device(name)
    if device.task not in (None, 0):
        raise ValueError(f"CentralStorageStrategy is local to one process: {what} {name!r} "
                         f"names task {device.task}; give a local device such as "
                         f"'/cpu:0'")
    return f"/{device.kind}:{device.index}"


class CentralStorageStrategy(Strategy):
    """One copy of each variable, compute replicated on this process's local replicas
    (TF's ``tf.distribute.experimental.CentralStorageStrategy``).

    Args:
        compute_devices: the replicas' device names (``["/cpu:0", "/cpu:1"]`` for two CPU
            replicas); default ``["/cpu:0"]``. GPU names need the GPU backend.
        parameter_device: where the variables live; default the compute device when
            there is exactly one, else ``/cpu:0`` (TF's rule).

    Raises:
        ValueError: no compute devices, a repeated device, a name that is not a device,
            or a device of another task.
        TypeError: a device name that is not a str.
        BackendUnavailable: a GPU device: this strategy computes on CPU replicas (GPU
            replicas: ``MirroredStrategy(["/gpu:0", ...])`` or
            ``MultiWorkerMirroredStrategy(gpus_per_rank=G)``).
    """

    def __init__(self, compute_devices: Sequence[str] | None = None,
                 parameter_device: str | None = None) -> None:
        if isinstance(compute_devices, str):
            raise TypeError(f"compute_devices is a list of device names, got the string "
                            f"{compute_devices!r}; write [{compute_devices!r}]")
        names = (_LOCAL_CPU,) if compute_devices is None else tuple(compute_devices)
        if not names:
            raise ValueError("CentralStorageStrategy needs at least one compute device, got []")
        devices = [_local_device(d, "compute device") for d in names]
        if len(set(devices)) != len(devices):
            raise ValueError(f"CentralStorageStrategy compute devices repeat: {list(names)}")
        if parameter_device is None:
            parameter_device = devices[0] if len(devices) == 1 else _LOCAL_CPU
        parameter = _local_device(parameter_device, "parameter_device")
        gpus = sum(1 for d in [*devices, parameter] if d.startswith("/gpu"))
        if gpus:
            raise BackendUnavailable(
                f"CentralStorageStrategy computes on CPU replicas and keeps its variables in "
                f"host memory; {gpus} of its devices are GPUs ({list(names)}, parameter "
                f"device {parameter_device!r}). For GPU replicas use MirroredStrategy("
                f"['/gpu:0', ...]) or MultiWorkerMirroredStrategy(gpus_per_rank=G), whose "
                f"variables live on the GPUs")
        extended = CentralStorageExtended(self, devices, parameter)
        super().__init__(extended, mpi().COMM_SELF)

    def _create_variable(self, initial_value: Any = None, trainable: bool | None = None,
                         name: str | None = None, dtype: Any = None,
                         synchronization: Any = VariableSynchronization.AUTO,
                         aggregation: Any = VariableAggregation.NONE,
                         shape: Any = None) -> AggregatingVariable:
        """A variable created in ``scope()``: one copy on the parameter device, whatever
        the synchronization (TF makes the same variable for ON_WRITE and ON_READ)."""
        if not context.in_cross_replica_context():
            raise RuntimeError(
                "variables of CentralStorageStrategy are created in its scope(), not inside "
                "strategy.run: create them before the training loop")
        synchronization = _parse(VariableSynchronization, synchronization, "synchronization")
        aggregation = _parse(VariableAggregation, aggregation, "aggregation")
        initial = _initial(initial_value, dtype)
        if trainable is None:
            trainable = synchronization is not VariableSynchronization.ON_READ
        self._variables_created += 1
        return AggregatingVariable(self, initial, name, trainable, synchronization,
                                   aggregation)

    def _shuffle_seed(self) -> int | None:
        return None

    def __repr__(self) -> str:
        ext = self.extended
        return (f"CentralStorageStrategy(compute_devices={list(ext.worker_devices)}, "
                f"parameter_device={ext.parameter_devices[0]!r})")
