"""The edge where other libraries' arrays come in and results go back out as their type.

Every entry point (``all_reduce``, the ``CrossDeviceOps``, ``ReplicaContext.all_reduce``,
``Strategy.reduce``, ``Variable``) accepts NumPy and CuPy arrays, PyTorch tensors (CPU and
CUDA), JAX arrays, and anything that exposes DLPack, ``__cuda_array_interface__``,
``__array_interface__`` or the buffer protocol. :func:`to_native` turns such a value into
the array its backend works on — a NumPy array for host memory, a CuPy array for CUDA
memory — **sharing the caller's memory** (no copy), and :func:`restore` hands a result
back as the caller's type through the array-API standard's ``from_dlpack`` of the
caller's namespace (``array-api-compat`` supplies it for libraries that do not yet carry
``__array_namespace__``), again without a copy where the library allows one.

No framework is imported here: a value's library is already loaded when it hands us a
value, and ``array-api-compat`` looks frameworks up in ``sys.modules``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import is_cuda_array

__all__ = ["to_native", "to_host", "restore", "is_native", "is_writeable", "describe_type",
           "NATIVE_TYPES"]

NATIVE_TYPES = (np.ndarray, np.generic)

_ACCEPTED = ("a NumPy or CuPy array, a PyTorch tensor, a JAX array, or any array exposing "
             "DLPack, __cuda_array_interface__, __array_interface__ or the buffer protocol")


def describe_type(value: Any) -> str:
    """``module.Type`` of ``value``, for messages (``torch.Tensor``, ``numpy.ndarray``)."""
    kind = type(value)
    module = kind.__module__.split(".", 1)[0]
    return f"{module}.{kind.__name__}" if module != "builtins" else kind.__name__


def is_native(value: Any) -> bool:
    """True for values the backends take as they are (NumPy arrays and scalars, CuPy)."""
    return isinstance(value, NATIVE_TYPES) or type(value).__module__.startswith("cupy")


def is_writeable(array: Any) -> bool:
    """Whether a result may be written into ``array`` (a NumPy or CuPy array; CuPy's
    flags have no ``writeable``: its arrays always are)."""
    return bool(getattr(getattr(array, "flags", None), "writeable", True))


def to_native(value: Any, what: str = "reduce") -> Any:
    """``value`` as a NumPy array (host memory) or CuPy array (CUDA memory) that shares its
    memory: no copy for arrays of any library that exposes its memory.

    A PyTorch tensor that requires grad is read through ``detach()`` (the same memory).
    JAX arrays come back read-only (JAX arrays are immutable). Python numbers and lists
    of numbers become new NumPy arrays.

    Raises:
        TypeError: ``value`` is no array any backend handles, or its library cannot share
            its dtype (e.g. PyTorch's bfloat16 through DLPack); the message says what was
            expected.
    """
    if isinstance(value, NATIVE_TYPES):
        return value
    if is_cuda_array(value) is not None:
        from . import as_array  # (the package imports this module: a cycle at import)

        return as_array(value)[1]
    if hasattr(value, "__dlpack__"):
        return _from_dlpack(value, what)
    if hasattr(value, "__array_interface__") or _has_buffer(value) \
            or hasattr(value, "__array__") or isinstance(value, (int, float, complex, bool)):
        array = np.asarray(value)
        if array.dtype.kind not in "OUSV":
            return array
    elif isinstance(value, (list, tuple)) and _numbers(value):
        array = np.asarray(value)
        if array.dtype.kind not in "OUSV":
            return array
    raise TypeError(f"cannot {what} a value of type {describe_type(value)}: "
                    f"expected {_ACCEPTED}")


def to_host(array: Any) -> np.ndarray:
    """``array`` (any value :func:`to_native` takes) as a NumPy array: the same memory
    for host arrays, a copy for device arrays (which synchronises their stream)."""
    native = to_native(array)
    if isinstance(native, (np.ndarray, np.generic)):
        return np.asarray(native)
    return native.get()  # a CuPy array


def _from_dlpack(value: Any, what: str) -> np.ndarray:
    try:
        return np.from_dlpack(value)
    except (BufferError, RuntimeError, TypeError, ValueError) as exc:
        detach = getattr(value, "detach", None)
        if detach is not None and getattr(value, "requires_grad", False):
            return _from_dlpack(detach(), what)  # a leaf that needs grad: the same memory
        raise TypeError(
            f"cannot {what} a {describe_type(value)} of dtype {getattr(value, 'dtype', '?')}: "
            f"NumPy cannot share its memory through DLPack ({exc}); convert it to a dtype "
            f"NumPy has (e.g. float32) first"
        ) from exc


def _has_buffer(value: Any) -> bool:
    try:
        memoryview(value).release()
    except TypeError:
        return False
    return True


def _numbers(items: Any) -> bool:
    return all(isinstance(x, (int, float, complex, bool, np.generic))
               or isinstance(x, (list, tuple)) and _numbers(x) for x in items)


_NAMESPACES: dict[type, Any] = {}


def restore(result: Any, like: Any) -> Any:
    """``result`` (a NumPy or CuPy array) as the array type of ``like``, the caller's
    input: through ``from_dlpack`` of ``like``'s array namespace, sharing memory where
    the library can. NumPy and CuPy results, and results for inputs of no array library
    (lists, numbers, ``memoryview``, ``array.array``), come back as they are."""
    if is_native(like) or not hasattr(like, "__dlpack__") and is_cuda_array(like) is None:
        return result
    kind = type(like)
    namespace = _NAMESPACES.get(kind)
    if namespace is None:
        namespace = _namespace(like)
        _NAMESPACES[kind] = namespace
    if namespace is False:
        return result
    try:
        return namespace.from_dlpack(result)
    except BufferError:  # a read-only result (e.g. JAX's own memory): hand back a copy
        return namespace.from_dlpack(result.copy())


def _namespace(like: Any) -> Any:
    own = getattr(like, "__array_namespace__", None)
    if own is not None:
        namespace = own()
    else:
        # (20 ms to import; only values of other libraries need it)
        import array_api_compat

        try:
            namespace = array_api_compat.array_namespace(like)
        except TypeError:
            return False
    return namespace if hasattr(namespace, "from_dlpack") else False
