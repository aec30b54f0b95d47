"""``nccl``: all-reduce, broadcast and reduce through NCCL (``cupy.cuda.nccl``).

One NCCL communicator spans every device of every rank of an MPI communicator: rank 0
creates the unique id and broadcasts it over MPI; each rank then joins with NCCL rank
``rank * G + i`` for its device ``i`` — with ``G > 1`` devices per rank, the ``G``
joins run inside one NCCL group (``groupStart``/``groupEnd``), as NCCL requires when one
thread initialises several devices. Communicators are built once and cached on the MPI
communicator per device tuple (:func:`mpistrat.runtime._commcache.comm_cache`), so they are
destroyed when the MPI communicator is freed. Before the first build the ranks check,
collectively, that no two of them use the same physical GPU
(:func:`mpistrat.runtime.devices.require_distinct_devices`): NCCL would fail with a vaguer error.

Each collective is queued on the current CuPy stream of the buffer's device, after the
work already queued there, and that stream is synchronised before returning, so results
are ready when handed back and MPI may touch the buffers right after (the hierarchical
algorithms' cross-node stage). MEAN runs as SUM (the caller divides). Dtypes: NCCL's
(8/32/64-bit integers, float16/32/64); complex SUM runs on the float pairs.

CuPy is imported when a function runs, never at import.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..backends.protocol import ArrayBackend
from ..errors import BackendUnavailable
from ..ops import ReduceOp
from ..runtime._commcache import comm_cache
from ..runtime._mpi import Comm
from ..runtime.devices import device_identity, require_distinct_devices

__all__ = ["all_reduce", "all_reduce_devices", "broadcast", "reduce_to_root", "communicators"]


class _Communicators:
    """The NCCL communicators of one MPI communicator and device tuple."""

    def __init__(self, comms: list[Any]) -> None:
        self.comms = comms

    def release(self) -> None:
        for comm in self.comms:
            try:
                comm.destroy()
            except Exception:  # the process may be tearing CUDA down already
                pass
        self.comms = []


def _nccl() -> Any:
    try:
        from cupy.cuda import nccl  # (CuPy on demand: import mpistrat starts no CUDA)
    except Exception as exc:
        raise BackendUnavailable(
            f"the 'nccl' algorithm needs NCCL through cupy.cuda.nccl, which failed to "
            f"import ({exc}); install CuPy with NCCL: pip install 'mpistrat[gpu]'"
        ) from exc
    if not getattr(nccl, "available", True):
        raise BackendUnavailable("the 'nccl' algorithm needs NCCL, but this CuPy was built "
                                 "without it; install a CuPy wheel (pip install "
                                 "'mpistrat[gpu]')")
    return nccl


def communicators(comm: Comm, devices: Sequence[int]) -> list[Any]:
    """The NCCL communicators of this rank's ``devices`` over ``comm`` (collective on the
    first call for this device tuple; cached on ``comm`` after)."""
    key = ("nccl", tuple(devices))
    cache = comm_cache(comm)
    if key in cache:
        return cache[key].comms
    import cupy  # (CuPy on demand: import mpistrat starts no CUDA)

    nccl = _nccl()
    identities = [device_identity(cupy, d) or f"ordinal {d}" for d in devices]
    require_distinct_devices(comm, identities, purpose="the 'nccl' algorithm")
    sizes = comm.allgather(len(devices))
    if len(set(sizes)) != 1:
        raise BackendUnavailable(f"every rank must bring the same number of GPUs to NCCL; "
                                 f"got {sizes} by rank")
    g = len(devices)
    uid = nccl.get_unique_id() if comm.Get_rank() == 0 else None
    uid = comm.bcast(uid, root=0)
    total = comm.Get_size() * g
    comms = []
    if g == 1:
        with cupy.cuda.Device(devices[0]):
            comms.append(nccl.NcclCommunicator(total, uid, comm.Get_rank()))
    else:
        nccl.groupStart()
        try:
            for i, device in enumerate(devices):
                with cupy.cuda.Device(device):
                    comms.append(nccl.NcclCommunicator(total, uid, comm.Get_rank() * g + i))
        finally:
            nccl.groupEnd()
    cache[key] = _Communicators(comms)
    return comms


def _dtype(nccl: Any, array: Any, op: ReduceOp) -> tuple[Any, int]:
    """NCCL's type for ``array`` and the element count to pass."""
    kind, factor = _nccl_type(np.dtype(array.dtype), op.primitive)
    return kind, array.size * factor


_NCCL_TYPES = {"b": "NCCL_INT8", "B": "NCCL_UINT8", "i": "NCCL_INT32", "I": "NCCL_UINT32",
               "l": "NCCL_INT64", "L": "NCCL_UINT64", "q": "NCCL_INT64", "Q": "NCCL_UINT64",
               "e": "NCCL_FLOAT16", "f": "NCCL_FLOAT32", "d": "NCCL_FLOAT64"}


@functools.lru_cache(maxsize=64)
def _nccl_type(dt: np.dtype, primitive: ReduceOp) -> tuple[Any, int]:
    """NCCL's type for ``dt`` and how many of them one element is (cached: every call
    looks it up)."""
    nccl = _nccl()
    if dt.kind == "c" and primitive is ReduceOp.SUM:
        return getattr(nccl, "NCCL_FLOAT32" if dt.itemsize == 8 else "NCCL_FLOAT64"), 2
    if dt.char not in _NCCL_TYPES:
        raise TypeError(f"NCCL cannot reduce {dt} with {primitive.name}; expected an "
                        f"integer or float16/32/64 array (or complex with SUM), or use 'xring'")
    return getattr(nccl, _NCCL_TYPES[dt.char]), 1


@functools.lru_cache(maxsize=8)
def _op(nccl: Any, op: ReduceOp) -> Any:
    return {ReduceOp.SUM: nccl.NCCL_SUM, ReduceOp.MIN: nccl.NCCL_MIN,
            ReduceOp.MAX: nccl.NCCL_MAX}[op.primitive]


def _require_cupy(backend: ArrayBackend, name: str) -> None:
    if getattr(backend, "name", None) != "cupy":
        raise BackendUnavailable(
            f"the '{name}' algorithm runs on CuPy device buffers, got {backend.name} buffers; "
            f"pass CuPy arrays or use a CPU algorithm ('xring', 'rechd', 'pscpu')")


def all_reduce_devices(comm: Comm, bufs: Sequence[Any], *, op: ReduceOp) -> None:
    """All-reduce one buffer per local device (``bufs[i]`` on this rank's device ``i``) over
    every device of every rank of ``comm``, in place."""
    import cupy  # (CuPy on demand: import mpistrat starts no CUDA)

    nccl = _nccl()
    devices = [int(b.device.id) for b in bufs]
    comms = communicators(comm, devices)
    if bufs[0].size == 0:
        return
    kind, count = _dtype(nccl, bufs[0], op)
    if len(bufs) == 1:  # (the common case, without the group calls)
        (buf,), (nc,) = bufs, comms
        with cupy.cuda.Device(devices[0]):
            stream = cupy.cuda.get_current_stream()
            nc.allReduce(buf.data.ptr, buf.data.ptr, count, kind, _op(nccl, op), stream.ptr)
            stream.synchronize()
        return
    streams = []
    nccl.groupStart()  # (several devices of this rank: one group call)
    try:
        for nc, buf in zip(comms, bufs):
            with cupy.cuda.Device(buf.device.id):
                stream = cupy.cuda.get_current_stream()
                streams.append(stream)
                nc.allReduce(buf.data.ptr, buf.data.ptr, count, kind, _op(nccl, op), stream.ptr)
    finally:
        nccl.groupEnd()
    for stream in streams:
        stream.synchronize()


def all_reduce(comm: Comm, buf: Any, *, op: ReduceOp, shards: int = 1, backend: ArrayBackend,
               rotation: int = 0) -> None:
    """NCCL all-reduce of ``buf`` in place over ``comm`` (``shards``, ``rotation`` unused)."""
    _require_cupy(backend, "nccl")
    all_reduce_devices(comm, [buf], op=op)


def broadcast(comm: Comm, buf: Any, *, backend: ArrayBackend, root: int = 0) -> None:
    """NCCL broadcast of ``root``'s ``buf`` to every rank of ``comm``, in place: the last
    stage of ``nccl/<b>`` hierarchies (replaces ``MPI_Bcast``)."""
    import cupy  # (CuPy on demand: import mpistrat starts no CUDA)

    _require_cupy(backend, "nccl")
    nccl = _nccl()
    (nc,) = communicators(comm, [int(buf.device.id)])
    if buf.size == 0:
        return
    with cupy.cuda.Device(buf.device.id):
        stream = cupy.cuda.get_current_stream()
        nc.bcast(buf.data.ptr, buf.nbytes, nccl.NCCL_UINT8, root, stream.ptr)
        stream.synchronize()


def reduce_to_root(comm: Comm, buf: Any, *, op: ReduceOp, backend: ArrayBackend,
                   root: int = 0) -> None:
    """NCCL reduce of ``buf`` onto ``root`` in place (other ranks' buffers are left as
    they were): the first stage of ``nccl/<b>`` hierarchies."""
    import cupy  # (CuPy on demand: import mpistrat starts no CUDA)

    _require_cupy(backend, "nccl")
    nccl = _nccl()
    (nc,) = communicators(comm, [int(buf.device.id)])
    if buf.size == 0:
        return
    kind, count = _dtype(nccl, buf, op)
    with cupy.cuda.Device(buf.device.id):
        stream = cupy.cuda.get_current_stream()
        nc.reduce(buf.data.ptr, buf.data.ptr, count, kind, _op(nccl, op), root, stream.ptr)
        stream.synchronize()
