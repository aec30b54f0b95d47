"""Torch tensors as the MPI calls of the ``"mpistrat"`` backend take them: NumPy views of
every dtype (bfloat16 through ``ml_dtypes``), byte views, and contiguous CPU stand-ins for
strided or CUDA tensors that are written back afterwards."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["NUMPY_DTYPES", "bfloat16_type", "numpy_dtype", "host_view", "numpy_view",
           "byte_view", "Staged", "apart", "describe_tensors"]

NUMPY_DTYPES: dict[torch.dtype, Any] = {
    torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64,
    torch.complex64: np.complex64, torch.complex128: np.complex128, torch.int8: np.int8,
    torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64,
    torch.uint8: np.uint8, torch.bool: np.bool_}
for _name, _np in (("uint16", np.uint16), ("uint32", np.uint32), ("uint64", np.uint64)):
    if hasattr(torch, _name):
        NUMPY_DTYPES[getattr(torch, _name)] = _np


def bfloat16_type() -> Any:
    try:
        import ml_dtypes
    except ImportError:
        raise TypeError("bfloat16 tensors need the ml_dtypes package for NumPy's bfloat16: "
                        "pip install ml_dtypes") from None
    return ml_dtypes.bfloat16


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    if dtype == torch.bfloat16:
        return np.dtype(bfloat16_type())
    found = NUMPY_DTYPES.get(dtype)
    if found is None:
        raise TypeError(f"the mpistrat backend cannot reduce tensors of dtype {dtype}: "
                        f"expected one of {sorted(str(d) for d in NUMPY_DTYPES)} or torch.bfloat16")
    return np.dtype(found)


def host_view(tensor: torch.Tensor) -> np.ndarray:
    """A NumPy view of a contiguous CPU tensor (any dtype, bfloat16 included)."""
    if tensor.dtype == torch.bfloat16:
        return numpy_view(tensor.view(torch.int16)).view(bfloat16_type())
    return numpy_view(tensor)


def numpy_view(tensor: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor of a dtype NumPy has. Through DLPack, not
    ``Tensor.numpy()``, which marks the tensor's storage as never resizable again (a
    user's ``resize_`` after a collective would fail, as it does not with gloo)."""
    return np.from_dlpack(tensor.detach())


def byte_view(tensor: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor, as a uint8 NumPy view."""
    return numpy_view(tensor.reshape(-1).view(torch.uint8))


class Staged:
    """A contiguous CPU tensor to work on for ``tensor``, written back by :meth:`done`."""

    __slots__ = ("tensor", "work", "back")

    def __init__(self, tensor: torch.Tensor, read: bool = True) -> None:
        self.tensor = tensor
        self.back = tensor.device.type != "cpu" or not tensor.is_contiguous()
        if not self.back:
            self.work = tensor
        elif read:
            self.work = tensor.detach().to("cpu", memory_format=torch.contiguous_format,
                                           copy=True)
        else:
            self.work = torch.empty(tensor.shape, dtype=tensor.dtype)

    def done(self) -> None:
        if self.back:
            with torch.no_grad():
                self.tensor.copy_(self.work)


def apart(input: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of ``input`` where it shares storage with ``output`` (FSDP
    all-gathers a shard that lives inside the output; MPI forbids aliased buffers),
    else ``input`` staged as usual."""
    if input.device == output.device and \
            input.untyped_storage().data_ptr() == output.untyped_storage().data_ptr():
        return input.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)
    return Staged(input).work


def describe_tensors(tensors: Sequence[torch.Tensor]) -> str:
    return ",".join(f"{tuple(t.shape)}:{t.dtype}:{t.device.type}" for t in tensors)
