"""torch's dtypes as NumPy holds them, for every part of mpistrat that takes torch
tensors (the torch adapter's gradient buckets and process group, checkpoints of tensors).
It imports torch: only code that already has a torch object in hand imports it."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["NUMPY_DTYPES", "bfloat16_type", "numpy_dtype"]

NUMPY_DTYPES: dict[torch.dtype, Any] = {
    torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64,
    torch.complex64: np.complex64, torch.complex128: np.complex128, torch.int8: np.int8,
    torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64,
    torch.uint8: np.uint8, torch.bool: np.bool_}
for _name, _np in (("uint16", np.uint16), ("uint32", np.uint32), ("uint64", np.uint64)):
    if hasattr(torch, _name):
        NUMPY_DTYPES[getattr(torch, _name)] = _np


def bfloat16_type() -> Any:
    """NumPy's bfloat16 (``ml_dtypes``); TypeError with the fix when it is missing."""
    try:
        import ml_dtypes
    except ImportError:
        raise TypeError("bfloat16 tensors need the ml_dtypes package for NumPy's bfloat16: "
                        "pip install ml_dtypes") from None
    return ml_dtypes.bfloat16


def numpy_dtype(dtype: torch.dtype, what: str = "use tensors",
                accepted: dict[torch.dtype, Any] | None = None) -> np.dtype:
    """The NumPy dtype of torch's ``dtype``, bfloat16 included; a TypeError saying that
    mpistrat cannot ``what`` of that dtype, and which it can, for the others (of
    ``accepted``, default :data:`NUMPY_DTYPES`)."""
    if dtype == torch.bfloat16:
        return np.dtype(bfloat16_type())
    known = NUMPY_DTYPES if accepted is None else accepted
    found = known.get(dtype)
    if found is None:
        raise TypeError(f"cannot {what} of dtype {dtype}: expected one of "
                        f"{sorted(str(d) for d in known)} or torch.bfloat16")
    return np.dtype(found)
