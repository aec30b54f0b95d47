"""Reduction operations: ``ReduceOp`` (TF's names) and what each means for arrays and MPI.

MEAN is never a primitive: algorithms run SUM and the caller divides by the number of
contributions afterwards, as TensorFlow does, so every algorithm is a pure reduction.
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np

from .runtime._mpi import mpi

__all__ = ["ReduceOp"]


class ReduceOp(str, enum.Enum):
    """How values from the replicas are combined (``tf.distribute.ReduceOp`` plus MIN/MAX)."""

    SUM = "SUM"
    MEAN = "MEAN"
    MIN = "MIN"
    MAX = "MAX"

    @classmethod
    def parse(cls, value: Any) -> ReduceOp:
        """Accept a ``ReduceOp`` or its name in any case (``"sum"``, ``"Mean"``).

        Raises:
            ValueError: an unknown name (the message lists the valid ones).
            TypeError: neither a ``ReduceOp`` nor a str.
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls[value.strip().upper()]
            except KeyError:
                pass
            raise ValueError(
                f"unknown reduce op {value!r}; expected one of "
                f"{', '.join(op.name for op in cls)} (any case)"
            )
        raise TypeError(
            f"reduce_op must be a ReduceOp or a str such as 'sum', got {value!r} "
            f"({type(value).__name__})"
        )

    @property
    def primitive(self) -> ReduceOp:
        """The reduction the algorithms run: SUM for MEAN, the op itself otherwise."""
        return ReduceOp.SUM if self is ReduceOp.MEAN else self

    def result_dtype(self, dtype: Any) -> np.dtype:
        """The dtype of this reduction's result over arrays of ``dtype``: MEAN of integers
        (or booleans) is float64, every other result keeps the dtype."""
        dtype = np.dtype(dtype)
        return np.dtype(np.float64) if self is ReduceOp.MEAN and dtype.kind in "iub" \
            else dtype

    def mpi_op(self) -> Any:
        """The predefined ``MPI.Op`` of :attr:`primitive`."""
        MPI = mpi()
        return {ReduceOp.SUM: MPI.SUM, ReduceOp.MIN: MPI.MIN, ReduceOp.MAX: MPI.MAX}[
            self.primitive
        ]

    def __str__(self) -> str:
        return self.value
