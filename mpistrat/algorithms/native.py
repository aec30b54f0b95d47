"""``native``: the MPI library's own ``Allreduce`` — the baseline every algorithm is measured against.

Steps: one ``MPI_Allreduce`` in place. Dtypes MPI has no predefined type for (e.g.
bfloat16 from ml_dtypes) go through a user-defined, commutative ``MPI.Op`` over a
contiguous byte type, applying the NumPy ufunc. Preconditions: none beyond a contiguous
1-D buffer. CuPy buffers go to a CUDA-aware MPI as they are (after a stream sync), else
through pinned host memory in chunks, each reduced by ``MPI_Iallreduce`` as soon as its
copy lands (:func:`mpistrat.backends.transport.staged_allreduce`).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ..backends.capabilities import device_buffers_to_mpi
from ..backends.numpy_backend import UFUNCS
from ..backends.protocol import ArrayBackend
from ..backends.transport import staged_allreduce
from ..ops import ReduceOp
from ..runtime._mpi import Comm, mpi
from .source import Source

__all__ = ["all_reduce"]


@functools.lru_cache(maxsize=None)
def _custom(dtype: np.dtype, op: ReduceOp) -> tuple[Any, Any]:
    MPI = mpi()
    ufunc = UFUNCS[op]

    def apply(inbuf, inoutbuf, datatype):
        source = np.frombuffer(inbuf, dtype=dtype)
        target = np.frombuffer(inoutbuf, dtype=dtype)
        ufunc(target, source, out=target)

    datatype = MPI.BYTE.Create_contiguous(dtype.itemsize).Commit()
    return datatype, MPI.Op.Create(apply, commute=True)


def _typed(buf: np.ndarray, op: ReduceOp) -> tuple[Any, Any]:
    MPI = mpi()
    if buf.dtype.kind in "fiuc" and buf.dtype.char in MPI._typedict:
        return [buf, MPI._typedict[buf.dtype.char]], op.mpi_op()
    datatype, mpi_op = _custom(buf.dtype, op.primitive)
    return [buf.view(np.uint8), buf.size, datatype], mpi_op


def _direct(comm: Comm) -> bool:
    return device_buffers_to_mpi(comm)


def _staged(comm: Comm, buf: Any, op: ReduceOp, backend: ArrayBackend) -> None:
    """Device buffer, MPI not CUDA-aware: chunked Iallreduce through pinned host memory."""
    dtype = np.dtype(buf.dtype)
    sample = np.empty(0, dtype)
    spec, mpi_op = _typed(sample, op)
    mover = backend.mover()  # type: ignore[attr-defined]  # the CuPy backend's (name checked)
    if len(spec) == 2:
        def typed(host: np.ndarray) -> Any:
            return [host.view(dtype), spec[1]]
    else:
        def typed(host: np.ndarray) -> Any:
            return [host, host.nbytes // dtype.itemsize, spec[2]]
    staged_allreduce(comm, buf, mover, typed, mpi_op)


def all_reduce(comm: Comm, buf: Any, *, op: ReduceOp, shards: int = 1, backend: ArrayBackend,
               rotation: int = 0, source: Source | None = None) -> None:
    """Reduce ``buf`` across ``comm`` with ``MPI_Allreduce`` (``shards`` ignored): in place,
    or from a one-segment ``source`` as the send buffer (a scattered source is copied into
    ``buf`` first)."""
    if source is not None and (comm.Get_size() == 1 or buf.size == 0 or not source.contiguous):
        source.copy_into(buf, backend=backend)
        source = None
    if comm.Get_size() == 1 or buf.size == 0:
        return
    if backend.name == "cupy" and not _direct(comm):
        if source is not None:
            source.copy_into(buf, backend=backend)
        _staged(comm, buf, op, backend)
        return
    if backend.name == "cupy":
        backend.synchronize()  # a CUDA-aware MPI reads device memory: kernels must be done
    spec, mpi_op = _typed(buf, op)
    if source is not None:
        comm.Allreduce(_typed(source.segments[0], op)[0], spec, op=mpi_op)
    else:
        comm.Allreduce(mpi().IN_PLACE, spec, op=mpi_op)
