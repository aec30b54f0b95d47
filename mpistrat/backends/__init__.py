"""Array backends (NumPy host buffers, CuPy device buffers) and capability probes.

Nothing here imports CuPy at import time: :func:`get_backend` imports it only for an
array whose type comes from CuPy (CuPy is then already loaded) or for a CUDA array of
another library (``__cuda_array_interface__`` or a CUDA ``__dlpack_device__``, e.g. a
PyTorch CUDA tensor), which :func:`as_array` converts to CuPy at the edge without a copy.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from typing import Any

from ..errors import BackendUnavailable
from .numpy_backend import NumpyBackend
from .protocol import ArrayBackend

__all__ = ["ArrayBackend", "NumpyBackend", "copy_all", "get_backend", "host_backend",
           "device_backend", "as_array", "is_cuda_array"]

_NUMPY = NumpyBackend()
_CUPY: dict[int, Any] = {}  # device id -> CupyBackend

# DLPack device types: kDLCUDA = 2, kDLCUDAManaged = 13 (kDLCUDAHost = 3 is host memory)
_DLPACK_CUDA = (2, 13)

_INSTALL = "pip install 'mpistrat[gpu]' (CuPy for CUDA 12; see docs/gpu.md)"


def _from_cupy(array: Any) -> bool:
    return type(array).__module__.split(".", 1)[0] == "cupy"


def is_cuda_array(array: Any) -> str | None:
    """How ``array`` exposes CUDA device memory (``"cupy"``, ``"__cuda_array_interface__"``,
    ``"dlpack"``), or None for anything else. Imports nothing."""
    if _from_cupy(array):
        return "cupy"
    try:
        if hasattr(array, "__cuda_array_interface__"):
            return "__cuda_array_interface__"
        device = getattr(array, "__dlpack_device__", None)
        if device is not None and hasattr(array, "__dlpack__"):
            kind = device()[0]
            if int(kind) in _DLPACK_CUDA:
                return "dlpack"
    except Exception:  # a property that raises (e.g. a CPU tensor's interface) is a "no"
        return None
    return None


def _cupy_backend(array: Any, how: str) -> Any:
    if not _from_cupy(array) and importlib.util.find_spec("cupy") is None:
        raise BackendUnavailable(
            f"cannot all-reduce a {type(array).__module__}.{type(array).__name__}: it is a "
            f"CUDA device array ({how}), and device arrays need CuPy, which is not "
            f"installed; install it with {_INSTALL}, or pass host (NumPy) arrays"
        )
    return device_backend(_device_of(array, how))


def host_backend() -> NumpyBackend:
    """The backend of host (NumPy) arrays."""
    return _NUMPY


def device_backend(device: int) -> Any:
    """The CuPy backend of CUDA device ``device`` (one per device, made on first use).

    Raises:
        BackendUnavailable: CuPy is installed but fails to import.
    """
    backend = _CUPY.get(device)
    if backend is None:
        from .cupy_backend import CupyBackend  # (its module is only needed for devices)

        try:  # the backend imports CuPy, which fails when CuPy is installed but broken
            backend = CupyBackend(device)
        except ImportError as exc:
            raise BackendUnavailable(
                f"CuPy failed to import ({exc}); reinstall it with {_INSTALL}"
            ) from exc
        _CUPY[device] = backend
    return backend


def _device_of(array: Any, how: str) -> int:
    if how == "cupy":
        return int(array.device.id)
    if how == "dlpack":
        return int(array.__dlpack_device__()[1])
    import cupy  # (CuPy on demand: import mpistrat starts no CUDA)

    pointer = array.__cuda_array_interface__["data"][0]
    if not pointer:
        return int(cupy.cuda.Device().id)
    return int(cupy.cuda.runtime.pointerGetAttributes(pointer).device)


def get_backend(array: Any) -> Any:
    """The backend that handles ``array``: NumPy for host arrays, CuPy (per device) for
    CuPy arrays and other CUDA arrays.

    Raises:
        BackendUnavailable: a CUDA array, but CuPy is not installed or broken.
        TypeError: no backend handles this kind of array.
    """
    if NumpyBackend.owns(array):
        return _NUMPY
    how = is_cuda_array(array)
    if how is not None:
        return _cupy_backend(array, how)
    raise TypeError(
        f"cannot all-reduce a {type(array).__module__}.{type(array).__name__}: expected a "
        f"NumPy or CuPy array, or a CUDA array exposing __cuda_array_interface__ or DLPack "
        f"(other libraries' arrays go through mpistrat.backends.interop.to_native first)"
    )


def copy_all(pairs: Iterable[tuple[Any, Any]]) -> None:
    """Copy each ``(target, result)`` pair's result into its target, grouped by the
    targets' backend, so that a batch of device results goes back in one kernel launch
    (:meth:`~mpistrat.backends.cupy_backend.CupyBackend.copy_many`)."""
    groups: dict[int, tuple[Any, list[Any], list[Any]]] = {}
    for target, result in pairs:
        backend = get_backend(target)
        group = groups.setdefault(id(backend), (backend, [], []))
        group[1].append(target)
        group[2].append(result)
    for backend, into, sources in groups.values():
        backend.copy_many(into, sources)


def as_array(value: Any) -> tuple[Any, Any]:
    """``(backend, array)``: ``value`` as the array type its backend works on — CUDA
    arrays of other libraries become CuPy arrays sharing their memory (no copy).

    Raises:
        BackendUnavailable, TypeError: as :func:`get_backend`.
    """
    backend = get_backend(value)
    if backend is _NUMPY or _from_cupy(value):
        return backend, value
    return backend, backend.asarray(value)
