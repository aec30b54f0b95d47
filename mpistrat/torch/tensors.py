"""Torch tensors as the MPI calls of the ``"mpistrat"`` backend take them: NumPy views of
every dtype (bfloat16 through ``ml_dtypes``), byte views, and contiguous CPU stand-ins for
strided or CUDA tensors that are written back afterwards."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..backends.torch_dtypes import NUMPY_DTYPES, bfloat16_type
from ..backends.torch_dtypes import numpy_dtype as _numpy_dtype

__all__ = ["NUMPY_DTYPES", "bfloat16_type", "numpy_dtype", "host_view", "numpy_view",
           "byte_view", "Staged", "apart", "describe_tensors"]

def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The NumPy dtype the backend's MPI calls see a tensor of ``dtype`` as."""
    return _numpy_dtype(dtype, "reduce tensors with the mpistrat backend")


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
