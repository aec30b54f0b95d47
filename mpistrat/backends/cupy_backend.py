"""The CuPy backend: device buffers, one backend per CUDA device.

The same interface as :class:`~mpistrat.backends.numpy_backend.NumpyBackend`, so the
algorithms run unchanged on device arrays. Design choices:

* every operation runs on **the device of the backend** (``with Device(id)``) and on
  **the current CuPy stream** of that device, so work queued by the caller before the
  all-reduce is ordered before it; :meth:`synchronize` waits for that stream, and is
  what must run before MPI reads device memory written by a kernel;
* scratch buffers come from a per-tag pool grown by doubling (as on the host); results
  (:meth:`recycled`) come from CuPy's own memory pool, which already reuses freed
  device memory without a ``cudaMalloc``;
* :meth:`comm_view` is a CuPy ``uint8`` view: mpi4py passes it to a CUDA-aware MPI
  through ``__cuda_array_interface__``; for other MPI libraries the algorithms move
  device bytes through :mod:`mpistrat.backends.transport` (see :meth:`transport`).

CuPy is imported when the backend is created, never at ``import mpistrat``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ..ops import ReduceOp
from ..runtime._mpi import Comm
from .capabilities import device_buffers_to_mpi
from .transport import CudaMover, DirectTransport, StagedTransport

__all__ = ["CupyBackend"]

# One launch copies many byte ranges: block row y takes range y (and y + gridDim.y, ...),
# in 16-, 4- or 1-byte words as the range's addresses and length allow. The table holds
# the sources, then the destinations, then the byte counts.
_COPY_MANY = r"""
extern "C" __global__ void mpistrat_copy_many(const unsigned long long* table, int n) {
    const unsigned long long first = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    for (int k = blockIdx.y; k < n; k += gridDim.y) {
        const unsigned long long src = table[k], dst = table[n + k], bytes = table[2 * n + k];
        if (((src | dst | bytes) & 15) == 0) {
            const uint4* a = (const uint4*)src;
            uint4* b = (uint4*)dst;
            for (unsigned long long i = first; i < bytes / 16; i += step) b[i] = a[i];
        } else if (((src | dst | bytes) & 3) == 0) {
            const unsigned int* a = (const unsigned int*)src;
            unsigned int* b = (unsigned int*)dst;
            for (unsigned long long i = first; i < bytes / 4; i += step) b[i] = a[i];
        } else {
            const unsigned char* a = (const unsigned char*)src;
            unsigned char* b = (unsigned char*)dst;
            for (unsigned long long i = first; i < bytes; i += step) b[i] = a[i];
        }
    }
}
"""
_BATCHED_FROM = 3  # fewer copies than this go one by one


class CupyBackend:
    """Device arrays (``cupy.ndarray``) on one CUDA device."""

    name = "cupy"

    def __init__(self, device: int = 0) -> None:
        import cupy  # (CuPy on demand: import mpistrat starts no CUDA)

        self.xp = cupy
        self.device = device
        self._pool: dict[str, Any] = {}
        self._ufuncs = {ReduceOp.SUM: cupy.add, ReduceOp.MIN: cupy.minimum,
                        ReduceOp.MAX: cupy.maximum}
        self._mover: Any = None
        self._kernel: Any = None

    @staticmethod
    def owns(array: Any) -> bool:
        """True for CuPy arrays (checked without importing CuPy)."""
        return type(array).__module__.split(".", 1)[0] == "cupy" and hasattr(array, "device")

    def _on(self) -> Any:
        return self.xp.cuda.Device(self.device)

    def asarray(self, value: Any) -> Any:
        """``value`` as a CuPy array on this device: no copy for CuPy arrays of this device
        and objects exposing ``__cuda_array_interface__`` (e.g. PyTorch CUDA tensors);
        DLPack producers are imported with ``cupy.from_dlpack`` (also zero-copy). Arrays
        of another device and host arrays are copied here."""
        xp = self.xp
        with self._on():
            if isinstance(value, xp.ndarray):
                return value if value.device.id == self.device else xp.copy(value)
            if hasattr(value, "__cuda_array_interface__"):
                return xp.asarray(value)
            if isinstance(value, (np.ndarray, np.generic)):  # host memory: copied over
                return xp.asarray(value)
            if hasattr(value, "__dlpack__"):
                return xp.from_dlpack(value)
            return xp.asarray(value)

    def flat_copy(self, array: Any) -> Any:
        """A new C-contiguous 1-D copy of ``array``."""
        with self._on():
            return self.xp.array(array, copy=True, order="C").reshape(-1)

    def flat_view(self, array: Any) -> Any | None:
        """A 1-D view sharing ``array``'s memory, or None if it is not C-contiguous."""
        return array.reshape(-1) if array.flags.c_contiguous else None

    def scratch(self, tag: str, count: int, dtype: Any) -> Any:
        """A reusable 1-D device temporary (valid until the next call with ``tag``)."""
        dtype = np.dtype(dtype)
        nbytes = count * dtype.itemsize
        pool = self._pool.get(tag)
        if pool is None or pool.nbytes < nbytes:
            capacity = max(4096, 1 << max(nbytes - 1, 1).bit_length())
            with self._on():
                pool = self.xp.empty(capacity, dtype=self.xp.uint8)
            self._pool[tag] = pool
        return pool[:nbytes].view(dtype)

    def recycled(self, count: int, dtype: Any) -> Any:
        """A new 1-D device array (CuPy's memory pool recycles freed blocks)."""
        with self._on():
            return self.xp.empty(count, dtype=dtype)

    def _local(self, src: Any) -> Any:
        """``src``, copied onto this device first when it lies on another one (a kernel
        reads only its own device's memory without peer access)."""
        if isinstance(src, self.xp.ndarray) and src.device.id != self.device:
            return self.xp.copy(src)  # (called on this device: the copy lands here)
        return src

    def combine(self, op: ReduceOp, dst: Any, src: Any) -> None:
        """``dst = op(dst, src)`` element-wise, in place, on the current stream."""
        with self._on():
            self._ufuncs[op.primitive](dst, self._local(src), out=dst)

    def divide(self, array: Any, count: int) -> Any:
        """``array / count``: in place for inexact dtypes, a new float64 array for integers."""
        xp = self.xp
        with self._on():
            if array.dtype.kind in "fc":
                xp.true_divide(array, array.dtype.type(count), out=array)
                return array
            return xp.true_divide(array, count, dtype=xp.float64)

    def copy(self, dst: Any, src: Any) -> None:
        """``dst[...] = src`` (device to device, on the current stream; host arrays and
        other devices' arrays are copied over)."""
        with self._on():
            if not isinstance(src, self.xp.ndarray):
                src = self.xp.asarray(src)
            self.xp.copyto(dst, self._local(src))

    def copy_many(self, dsts: Sequence[Any], srcs: Sequence[Any]) -> None:
        """:meth:`copy` for each pair; pairs of contiguous arrays of one dtype and size on
        this device are copied by one kernel launch (a batch of gradients written back
        costs one launch, not one per tensor), the others one by one."""
        xp = self.xp
        spans, rest = [], []
        for dst, src in zip(dsts, srcs):
            if isinstance(src, xp.ndarray) and isinstance(dst, xp.ndarray) \
                    and src.dtype == dst.dtype and src.size == dst.size \
                    and src.flags.c_contiguous and dst.flags.c_contiguous \
                    and src.device.id == self.device and dst.device.id == self.device:
                if src.nbytes:
                    spans.append((src.data.ptr, dst.data.ptr, src.nbytes))
            else:
                rest.append((dst, src))
        self._copy_spans(spans)
        for dst, src in rest:
            self.copy(dst, src)

    def copy_pieces(self, out: Any, pieces: Iterable[tuple[Any, int, int, int]]) -> None:
        """``out[at:at + stop - start] = segment[start:stop]`` for each piece (contiguous
        1-D device arrays of ``out``'s dtype), by one kernel launch."""
        xp, base, size = self.xp, out.data.ptr, out.itemsize
        spans, rest = [], []
        for segment, start, stop, at in pieces:
            if isinstance(segment, xp.ndarray) and segment.device.id == self.device \
                    and segment.flags.c_contiguous and segment.dtype == out.dtype:
                if stop > start:
                    spans.append((segment.data.ptr + start * size, base + at * size,
                                  (stop - start) * size))
            else:
                rest.append((out[at:at + stop - start], segment[start:stop]))
        self._copy_spans(spans)
        for dst, src in rest:
            self.copy(dst, src)

    def _copy_spans(self, spans: list[tuple[int, int, int]]) -> None:
        """Copy each ``(source address, destination address, bytes)`` on the current
        stream: one launch of :data:`_COPY_MANY` from :data:`_BATCHED_FROM` spans up."""
        xp = self.xp
        if not spans:
            return
        with self._on():
            if len(spans) < _BATCHED_FROM:
                stream = xp.cuda.get_current_stream().ptr
                for src, dst, nbytes in spans:
                    xp.cuda.runtime.memcpyAsync(dst, src, nbytes,
                                                xp.cuda.runtime.memcpyDeviceToDevice, stream)
                return
            n = len(spans)
            table = np.empty(3 * n, dtype=np.uint64)
            table[:n], table[n:2 * n], table[2 * n:] = zip(*spans)
            blocks = min(max(int(table[2 * n:].max()) // (16 * 256 * 4), 1), 512)
            if self._kernel is None:
                self._kernel = xp.RawKernel(_COPY_MANY, "mpistrat_copy_many")
            # (the table's memory goes back to CuPy's pool, which hands it out again on
            # this stream only, so after the kernel has read it)
            self._kernel((blocks, min(n, 65535)), (256,), (xp.asarray(table), np.int32(n)))

    def clone(self, array: Any) -> Any:
        """A new array on this device equal to ``array`` (from any device or the host)."""
        with self._on():
            return self.xp.copy(array) if isinstance(array, self.xp.ndarray) else \
                self.xp.array(array, copy=True)

    def comm_view(self, array: Any) -> Any:
        """The bytes of a contiguous 1-D device array (a ``uint8`` view)."""
        return array.view(self.xp.uint8)

    def synchronize(self) -> None:
        """Wait until the current stream of this device has finished its work."""
        with self._on():
            self.xp.cuda.get_current_stream().synchronize()

    def transport(self, comm: Comm) -> Any:
        """How the algorithms move this backend's buffers over ``comm``: straight through
        a CUDA-aware MPI, else staged through pinned host memory (decided once per
        communicator, the same on every rank; see :mod:`mpistrat.backends.transport`)."""
        if device_buffers_to_mpi(comm):
            # MPI reads device memory: the kernels queued before a send must be done
            return DirectTransport(comm, before=self.synchronize)
        return StagedTransport(comm, self.mover())

    def mover(self) -> Any:
        """This device's :class:`~mpistrat.backends.transport.CudaMover` (created once)."""
        if self._mover is None:
            self._mover = CudaMover(self.device)
        return self._mover

    def release(self) -> None:
        """Drop the scratch pool (its device memory goes back to CuPy's pool)."""
        self._pool.clear()
        if self._mover is not None:
            self._mover.release()
