"""Where a strategy's local replicas keep their arrays: host memory, or one GPU each.

A strategy owns one placement. Its replica ``i`` runs inside :meth:`Placement.on`
``(i)`` (for GPU replicas: with its CUDA device current, so the arrays ``fn`` makes land
there), and the strategy moves what it hands a replica — distributed datasets' batches,
distributed variables' copies, the per-replica results of reductions — onto that replica's
device with :meth:`Placement.put` and :meth:`Placement.clone`.

CPU replicas (:class:`HostPlacement`) keep NumPy arrays; :class:`GpuPlacement` keeps CuPy
arrays on the ordinals of :func:`mpistrat.runtime.devices.node_assignment`. CuPy is
imported only when a GPU placement is made.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._nest import map_structure
from ..backends import device_backend
from ..backends.interop import to_host, to_native

__all__ = ["Placement", "HostPlacement", "GpuPlacement"]


class Placement(abc.ABC):
    """The local replicas' devices and how arrays reach them (the interface; CPU replicas
    are :class:`HostPlacement`)."""

    gpu = False

    def __init__(self, devices: Sequence[str]) -> None:
        self.devices = tuple(devices)

    def on(self, index: int) -> contextlib.AbstractContextManager:
        """Make replica ``index``'s device current (a no-op on the host)."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def put(self, value: Any, index: int) -> Any:
        """``value`` as an array on replica ``index``'s device, without a copy when it
        already is one."""

    @abc.abstractmethod
    def clone(self, array: Any, index: int) -> Any:
        """A new array equal to ``array`` on replica ``index``'s device (never shares
        memory with ``array``)."""

    def put_nest(self, value: Any, index: int) -> Any:
        """:meth:`put` applied to every array leaf of a nest (other leaves unchanged)."""
        return map_structure(lambda leaf: self.put(leaf, index) if _is_array(leaf) else leaf,
                             value)


def _is_array(leaf: Any) -> bool:
    return hasattr(leaf, "shape") and hasattr(leaf, "dtype")


class HostPlacement(Placement):
    """CPU replicas: NumPy arrays in this process's memory."""

    def put(self, value: Any, index: int) -> Any:
        return to_host(value)

    def clone(self, array: Any, index: int) -> Any:
        return np.array(to_host(array), copy=True)


class GpuPlacement(Placement):
    """GPU replicas: replica ``i`` keeps CuPy arrays on CUDA device ``ordinals[i]``.

    Args:
        ordinals: one CUDA device ordinal per local replica (this process's numbering).
        devices: the replicas' device names (default ``/gpu:<ordinal>``).
    """

    gpu = True

    def __init__(self, ordinals: Sequence[int], devices: Sequence[str] | None = None) -> None:
        self.ordinals = tuple(int(o) for o in ordinals)
        # each replica's device backend: it moves arrays there (CuPy imported here)
        self._backends = [device_backend(o) for o in self.ordinals]
        super().__init__(devices if devices is not None
                         else tuple(f"/gpu:{o}" for o in self.ordinals))

    def on(self, index: int) -> contextlib.AbstractContextManager:
        return self._backends[index].xp.cuda.Device(self.ordinals[index])

    def put(self, value: Any, index: int) -> Any:
        return self._backends[index].asarray(to_native(value))

    def clone(self, array: Any, index: int) -> Any:
        return self._backends[index].clone(to_native(array))
