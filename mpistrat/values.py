"""Distributed values: ``PerReplica`` (one value per local device) and ``Mirrored`` (the same
value on every device), as in ``tf.distribute``.

Each MPI rank holds only its own components: the values of its ``G`` local devices
(``/cpu:0``, ``/cpu:1`` … for CPU replicas, ``/gpu:0`` … for GPUs). Device names accept
TensorFlow's spellings (``/device:CPU:0``, ``CPU:0``, ``/job:worker/replica:0/task:1/device:GPU:0``);
a name without a task means this rank's device.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ._nest import map_structure

__all__ = ["Device", "DistributedValues", "PerReplica", "Mirrored", "parse_device",
           "default_devices", "select_replica", "regroup", "components_of", "single"]

_DEVICE_RE = re.compile(
    r"^(?:/?job:(?P<job>[\w-]+))?(?:/?replica:(?P<replica>\d+))?(?:/?task:(?P<task>\d+))?"
    r"(?:/?(?:device:)?(?P<kind>cpu|gpu):(?P<index>\d+))?$",
    re.IGNORECASE,
)

_V = TypeVar("_V", bound="DistributedValues")


@dataclass(frozen=True, order=True)
class Device:
    """A replica's device: ``kind`` (``"cpu"`` or ``"gpu"``), ``index``, and the ``task``
    (MPI rank) it belongs to, None meaning "this rank"."""

    kind: str
    index: int
    task: int | None = None

    def on(self, rank: int) -> Device:
        """This device with its task filled in (``rank`` when it has none)."""
        return self if self.task is not None else Device(self.kind, self.index, rank)

    def __str__(self) -> str:
        if self.task is None:
            return f"/{self.kind}:{self.index}"
        return f"/job:worker/task:{self.task}/device:{self.kind.upper()}:{self.index}"


def parse_device(name: Any) -> Device:
    """Parse a device name (``"/cpu:0"``, ``"/device:GPU:1"``, ``"/job:worker/task:2/device:CPU:0"``).

    Raises:
        ValueError: the name is empty or not a device name.
        TypeError: ``name`` is not a str (or a :class:`Device`).
    """
    if isinstance(name, Device):
        return name
    if not isinstance(name, str):
        raise TypeError(f"a device name must be a str such as '/cpu:0', got {name!r} "
                        f"({type(name).__name__})")
    match = _DEVICE_RE.match(name.strip())
    if not name.strip() or not match or match.group("kind") is None:
        raise ValueError(
            f"{name!r} is not a device name: expected '/cpu:N' or '/gpu:N', optionally with "
            f"TensorFlow's '/job:worker/task:T/device:CPU:N' prefix"
        )
    task = match.group("task")
    return Device(match.group("kind").lower(), int(match.group("index")),
                  int(task) if task is not None else None)


def default_devices(count: int, gpus: bool = False) -> tuple[str, ...]:
    """The names of ``count`` local devices: ``/cpu:0``… or ``/gpu:0``…."""
    kind = "gpu" if gpus else "cpu"
    return tuple(f"/{kind}:{index}" for index in range(count))


_DEVICE_SETS: dict[tuple, tuple[Device, ...]] = {}  # names or devices -> the parsed tuple


def interned(devices: tuple[Device, ...]) -> tuple[Device, ...]:
    """The one tuple kept for this device set (equal sets are then compared by identity)."""
    if len(_DEVICE_SETS) < 1024:
        return _DEVICE_SETS.setdefault(devices, devices)
    return _DEVICE_SETS.get(devices, devices)


class DistributedValues:
    """Values of one tensor on a rank's local devices (``tf.distribute.DistributedValues``).

    Args:
        values: one value per local device (NumPy arrays, or anything array-like).
        devices: their device names (default ``/cpu:0``, ``/cpu:1``, …), all different.

    Raises:
        ValueError: no values, a device count that does not match, or a repeated device.
    """

    __slots__ = ("_values", "_devices")

    def __init__(self, values: Sequence[Any], devices: Sequence[Any] | None = None) -> None:
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise TypeError(
                f"{type(self).__name__} takes a list or tuple of per-device values, got "
                f"{type(values).__name__}"
            )
        values = tuple(values)
        if not values:
            raise ValueError(f"{type(self).__name__} needs at least one value")
        names = default_devices(len(values)) if devices is None else tuple(devices)
        if len(names) != len(values):
            raise ValueError(
                f"{type(self).__name__} got {len(values)} values but {len(names)} devices "
                f"{list(map(str, names))}; give one device per value"
            )
        try:
            parsed = _DEVICE_SETS.get(names)
        except TypeError:  # unhashable names: parse_device says what is wrong
            parsed = None
        if parsed is None:
            parsed = tuple(parse_device(d) for d in names)
            if len(set(parsed)) != len(parsed):
                raise ValueError(f"{type(self).__name__} devices repeat: {list(map(str, names))}")
            parsed = interned(parsed)
            if len(_DEVICE_SETS) < 1024:
                _DEVICE_SETS[names] = parsed
        self._values = values
        self._devices = parsed

    @classmethod
    def _trusted(cls: type[_V], values: Sequence[Any], devices: tuple[Device, ...]) -> _V:
        """Build from already-parsed, known-good devices (no validation: hot paths)."""
        self = cls.__new__(cls)
        self._values = tuple(values)
        self._devices = devices
        return self

    @property
    def values(self) -> tuple[Any, ...]:
        """The per-device values, in device order."""
        return self._values

    @property
    def devices(self) -> tuple[str, ...]:
        """The device names, canonical (``/cpu:0`` for a local device)."""
        return tuple(str(d) for d in self._devices)

    @property
    def device_set(self) -> tuple[Device, ...]:
        """The parsed devices (for comparisons)."""
        return self._devices

    @property
    def primary(self) -> Any:
        """The value on the first device."""
        return self._values[0]

    def get(self, device: Any) -> Any:
        """The value on ``device`` (any spelling of its name).

        Raises:
            KeyError: no component lives on that device.
        """
        wanted = parse_device(device)
        for have, value in zip(self._devices, self._values):
            if have == wanted:
                return value
        raise KeyError(f"{type(self).__name__} has no value on {device!r}; its devices are "
                       f"{list(self.devices)}")

    def __getitem__(self, key: Any) -> Any:
        """``value[i]`` (i-th device) or ``value["/cpu:1"]``."""
        if isinstance(key, int):
            return self._values[key]
        return self.get(key)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        body = ", ".join(f"{device!r}: {value!r}" for device, value in
                         zip(self.devices, self._values))
        return f"{type(self).__name__}({{{body}}})"


class PerReplica(DistributedValues):
    """One (possibly different) value per local device."""

    __slots__ = ()


class Mirrored(DistributedValues):
    """A value that is the same on every device it lives on (the result of a reduction)."""

    __slots__ = ()


def select_replica(index: int, structure: Any) -> Any:
    """Replica ``index``'s part of ``structure``: the component of each PerReplica/Mirrored
    leaf; distributed variables and plain values unchanged."""

    def pick(leaf: Any) -> Any:
        if isinstance(leaf, DistributedValues):
            return leaf.values[index]
        return leaf

    return map_structure(pick, structure)


def regroup(per_replica: list[Any], devices: Sequence[str]) -> Any:
    """Combine one value per local replica, nest position by nest position: the same
    object from every replica stays as it is, otherwise a :class:`PerReplica`.

    With one replica the value comes back unwrapped (TF's rule).
    """
    if len(per_replica) == 1:
        return per_replica[0]

    def combine(*leaves: Any) -> Any:
        first = leaves[0]
        if all(leaf is first for leaf in leaves[1:]):
            return first
        return PerReplica(list(leaves), devices)

    try:
        return map_structure(combine, *per_replica)
    except ValueError as exc:
        raise ValueError(f"the replicas returned values of different structures: {exc}") \
            from None


def components_of(value: Any) -> tuple[Any, ...]:
    """The local components of a DistributedValues; a plain value is its only component
    (what a reduction to a single device returns, as in TF)."""
    return tuple(value.values) if isinstance(value, DistributedValues) else (value,)


def single(value: Any) -> Any:
    """A Mirrored on a single device as the value itself (TF returns the tensor there);
    anything else unchanged."""
    if isinstance(value, Mirrored) and len(value.values) == 1:
        return value.values[0]
    return value
