"""Array backends (NumPy host buffers; CuPy device buffers later) and capability probes.

Nothing here imports CuPy at import time; probes import it lazily when asked.
"""

from __future__ import annotations

from typing import Any

from .numpy_backend import NumpyBackend

__all__ = ["NumpyBackend", "get_backend"]

_NUMPY = NumpyBackend()


def get_backend(array: Any) -> NumpyBackend:
    """The backend that handles ``array``.

    Raises:
        TypeError: no backend handles this kind of array.
    """
    if NumpyBackend.owns(array):
        return _NUMPY
    raise TypeError(
        f"cannot all-reduce a {type(array).__module__}.{type(array).__name__}: expected a "
        f"NumPy array (or a value numpy.asarray accepts)"
    )
