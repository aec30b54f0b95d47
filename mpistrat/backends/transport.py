"""How the algorithms move buffers over MPI: directly, or staged through host memory.

An algorithm asks its backend for a **transport** over a communicator and sends and
receives byte views through it (``isend``/``irecv`` return requests with ``Wait`` and
``Test``; ``waitall``, ``send``, ``recv``, ``sendrecv`` complete them):

* :class:`DirectTransport` hands the views to MPI — host buffers, and device buffers
  when MPI is CUDA-aware (the backend then synchronises its stream before each send,
  so MPI never reads memory a kernel is still writing);
* :class:`StagedTransport` moves device bytes through pinned host buffers when MPI is
  not CUDA-aware. A message is cut into chunks of ``chunk_bytes`` (both sides cut
  alike, so every rank of a communicator must use the same transport kind — see
  :func:`mpistrat.backends.capabilities.device_buffers_to_mpi`). Sending queues every
  chunk's device→host copy at once on a copy stream (after the work already queued on
  the compute stream) and posts each chunk's ``MPI_Isend`` as soon as its copy is done,
  so the copies of later chunks overlap the transfer of earlier ones; receiving posts
  every chunk's ``MPI_Irecv`` at once and queues each chunk's host→device copy on a
  second stream as soon as it lands. Nothing copies a whole buffer with ``asnumpy``.

The copies go through a **mover** — :class:`CudaMover` (CuPy: pinned host memory,
``cudaMemcpyAsync`` on two non-blocking streams, events) or :class:`HostMover`, whose
"device" is host memory and whose copies are synchronous, so the same pipeline logic runs
on NumPy buffers in tests without a GPU. All staged requests of a mover progress together
(a small progress engine): waiting on one request also posts the sends and copies of the
others, so two ranks waiting on each other's messages cannot deadlock. Sends are posted
in the order they were started, which keeps MPI's message order per (peer, tag) equal to
the order of the algorithm's calls.

:func:`staged_allreduce` is ``native``'s staged form: each chunk is copied to the host,
reduced by ``MPI_Iallreduce`` as soon as it arrives there, and copied back as soon as
its reduction completes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..runtime._mpi import Comm, mpi

__all__ = [
    "STAGE_CHUNK_BYTES", "chunk_cuts", "DirectTransport", "StagedTransport", "HostMover",
    "CudaMover", "staged_allreduce", "staged_collective",
]

STAGE_CHUNK_BYTES = 1 << 20  # a staged message travels in chunks of this many bytes


def chunk_cuts(nbytes: int, chunk_bytes: int, align: int = 1) -> list[tuple[int, int]]:
    """``[start, stop)`` byte ranges cutting ``nbytes`` into chunks of at most
    ``chunk_bytes`` (a multiple of ``align``); an empty message is one empty chunk, so
    the receiver of an empty message still matches one send."""
    step = max(align, chunk_bytes // align * align)
    if nbytes == 0:
        return [(0, 0)]
    return [(a, min(a + step, nbytes)) for a in range(0, nbytes, step)]


# ------------------------------------------------------------------------------ direct


class DirectTransport:
    """Views go to MPI as they are (``before`` runs before each send and receive: a
    stream sync, so MPI neither reads memory that queued kernels still write nor writes
    memory that they still use)."""

    __slots__ = ("comm", "before")

    def __init__(self, comm: Comm, before: Callable[[], None] | None = None) -> None:
        self.comm = comm
        self.before = before

    def isend(self, view: Any, dest: int, tag: int) -> Any:
        if self.before is not None:
            self.before()
        return self.comm.Isend([view, mpi().BYTE], dest, tag=tag)

    def irecv(self, view: Any, source: int, tag: int) -> Any:
        if self.before is not None:
            self.before()
        return self.comm.Irecv([view, mpi().BYTE], source, tag=tag)

    @staticmethod
    def waitall(requests: Sequence[Any]) -> None:
        mpi().Request.Waitall(requests)

    def send(self, view: Any, dest: int, tag: int) -> None:
        if self.before is not None:
            self.before()
        self.comm.Send([view, mpi().BYTE], dest, tag=tag)

    def recv(self, view: Any, source: int, tag: int) -> None:
        if self.before is not None:
            self.before()
        self.comm.Recv([view, mpi().BYTE], source, tag=tag)

    def sendrecv(self, send: Any, dest: int, send_tag: int, recv: Any, source: int,
                 recv_tag: int) -> None:
        if self.before is not None:
            self.before()
        BYTE = mpi().BYTE
        self.comm.Sendrecv([send, BYTE], dest, send_tag, [recv, BYTE], source, recv_tag)

    def bcast(self, view: Any, root: int) -> None:
        if self.before is not None:
            self.before()
        self.comm.Bcast([view, mpi().BYTE], root=root)


# ------------------------------------------------------------------------------ movers


class HostMover:
    """A "device" that is host memory: copies complete at once (tests of the pipeline)."""

    def __init__(self) -> None:
        self.engine = _Engine()

    @staticmethod
    def host(nbytes: int) -> tuple[np.ndarray, Any]:
        return np.empty(nbytes, dtype=np.uint8), None

    def after_compute(self) -> None:
        """Order later copies after the work queued so far (nothing here)."""

    @staticmethod
    def to_host(host: np.ndarray, device: Any) -> Any:
        np.copyto(host, device)
        return None

    @staticmethod
    def to_device(device: Any, host: np.ndarray) -> Any:
        np.copyto(device, host)
        return None

    @staticmethod
    def done(event: Any) -> bool:
        return True

    @staticmethod
    def wait(event: Any) -> None:
        """Copies are synchronous: nothing to wait for."""

    def release(self) -> None:
        """Nothing is held."""


class CudaMover:
    """Device <-> pinned host copies on two non-blocking CUDA streams (one per direction,
    so the two overlap) of one device; completion is tracked with CUDA events."""

    _D2H, _H2D = 2, 1  # cudaMemcpyDeviceToHost, cudaMemcpyHostToDevice

    def __init__(self, device: int) -> None:
        import cupy  # (CuPy on demand: import mpistrat starts no CUDA)

        self.cupy = cupy
        self.device = device
        with cupy.cuda.Device(device):
            self.d2h = cupy.cuda.Stream(non_blocking=True)
            self.h2d = cupy.cuda.Stream(non_blocking=True)
        self.engine = _Engine()

    def host(self, nbytes: int) -> tuple[np.ndarray, Any]:
        """A pinned host buffer (from CuPy's pinned memory pool) and its owner."""
        if nbytes == 0:
            return np.empty(0, dtype=np.uint8), None
        memory = self.cupy.cuda.alloc_pinned_memory(nbytes)
        return np.frombuffer(memory, dtype=np.uint8, count=nbytes), memory

    def after_compute(self) -> None:
        """Make both copy streams wait for the work queued on the current (compute)
        stream: a send must read what the kernels wrote, and a receive must not land in
        memory that queued kernels still use (a buffer from CuPy's pool is "free" once
        the compute stream's queued work on it is ordered, not done)."""
        cuda = self.cupy.cuda
        with cuda.Device(self.device):
            event = cuda.Event(disable_timing=True)
            event.record(cuda.get_current_stream())
            self.d2h.wait_event(event)
            self.h2d.wait_event(event)

    def _copy(self, dst: int, src: int, nbytes: int, kind: int, stream: Any) -> Any:
        cuda = self.cupy.cuda
        with cuda.Device(self.device):
            if nbytes:
                cuda.runtime.memcpyAsync(dst, src, nbytes, kind, stream.ptr)
            event = cuda.Event(disable_timing=True)
            event.record(stream)
        return event

    def to_host(self, host: np.ndarray, device: Any) -> Any:
        return self._copy(host.ctypes.data, device.data.ptr, host.nbytes, self._D2H, self.d2h)

    def to_device(self, device: Any, host: np.ndarray) -> Any:
        return self._copy(device.data.ptr, host.ctypes.data, host.nbytes, self._H2D, self.h2d)

    @staticmethod
    def done(event: Any) -> bool:
        return event.done

    @staticmethod
    def wait(event: Any) -> None:
        event.synchronize()

    def release(self) -> None:
        """Wait for outstanding copies (the pinned buffers go back to CuPy's pool)."""
        self.d2h.synchronize()
        self.h2d.synchronize()


# ------------------------------------------------------------------------------ staged


class _Engine:
    """The staged requests of one mover that still have work to do."""

    def __init__(self) -> None:
        self.sends: deque[_StagedSend] = deque()  # sends with chunks not yet posted
        self.recvs: list[_StagedRecv] = []  # receives with chunks not yet copied

    def progress(self) -> bool:
        moved = False
        while self.sends:  # post in the order the sends started: MPI keeps that order
            head = self.sends[0]
            moved |= head.post_ready()
            if not head.all_posted:
                break
            self.sends.popleft()
        if self.recvs:
            for op in self.recvs:
                moved |= op.land_ready()
            self.recvs = [op for op in self.recvs if not op.all_landed]
        return moved


class _StagedSend:
    __slots__ = ("comm", "mover", "dest", "tag", "cuts", "host", "owner", "events",
                 "requests", "posted")

    def __init__(self, t: StagedTransport, view: Any, dest: int, tag: int) -> None:
        self.comm, self.mover, self.dest, self.tag = t.comm, t.mover, dest, tag
        self.cuts = chunk_cuts(view.nbytes, t.chunk_bytes)
        self.host, self.owner = self.mover.host(view.nbytes)
        self.mover.after_compute()
        self.events = [self.mover.to_host(self.host[a:b], view[a:b]) for a, b in self.cuts]
        self.requests: list[Any] = []
        self.posted = 0
        self.mover.engine.sends.append(self)
        self.mover.engine.progress()

    @property
    def all_posted(self) -> bool:
        return self.posted == len(self.cuts)

    def post_ready(self) -> bool:
        start = self.posted
        BYTE = mpi().BYTE
        while self.posted < len(self.cuts) and self.mover.done(self.events[self.posted]):
            a, b = self.cuts[self.posted]
            self.requests.append(self.comm.Isend([self.host[a:b], BYTE], self.dest,
                                                 tag=self.tag))
            self.posted += 1
        return self.posted > start

    def Test(self) -> bool:
        self.mover.engine.progress()
        return self.all_posted and mpi().Request.Testall(self.requests)

    def Wait(self) -> None:
        _wait_all([self], self.mover.engine)


class _StagedRecv:
    __slots__ = ("mover", "view", "cuts", "host", "owner", "requests", "landed", "last")

    def __init__(self, t: StagedTransport, view: Any, source: int, tag: int) -> None:
        self.mover, self.view = t.mover, view
        self.cuts = chunk_cuts(view.nbytes, t.chunk_bytes)
        self.host, self.owner = self.mover.host(view.nbytes)
        BYTE = mpi().BYTE
        self.requests = [t.comm.Irecv([self.host[a:b], BYTE], source, tag=tag)
                         for a, b in self.cuts]
        self.mover.after_compute()
        self.landed = 0
        self.last: Any = None
        self.mover.engine.recvs.append(self)

    @property
    def all_landed(self) -> bool:
        return self.landed == len(self.cuts)

    def land_ready(self) -> bool:
        start = self.landed
        while self.landed < len(self.cuts) and self.requests[self.landed].Test():
            a, b = self.cuts[self.landed]
            self.last = self.mover.to_device(self.view[a:b], self.host[a:b])
            self.landed += 1
        return self.landed > start

    def Test(self) -> bool:
        self.mover.engine.progress()
        # the copies run in order on one stream: the last one done means all are
        return self.all_landed and self.mover.done(self.last)

    def Wait(self) -> None:
        _wait_all([self], self.mover.engine)


def _wait_all(requests: Sequence[Any], engine: _Engine) -> None:
    pending = list(requests)
    while pending:
        moved = engine.progress()
        still = [r for r in pending if not r.Test()]
        if len(still) == len(pending) and not moved:
            time.sleep(0)  # give the CPU to a peer rank sharing it, then poll again
        pending = still


class StagedTransport:
    """Device views travel through pinned host buffers, chunked and overlapped."""

    __slots__ = ("comm", "mover", "chunk_bytes")

    def __init__(self, comm: Comm, mover: Any, chunk_bytes: int = STAGE_CHUNK_BYTES) -> None:
        self.comm = comm
        self.mover = mover
        self.chunk_bytes = chunk_bytes

    def isend(self, view: Any, dest: int, tag: int) -> _StagedSend:
        return _StagedSend(self, view, dest, tag)

    def irecv(self, view: Any, source: int, tag: int) -> _StagedRecv:
        return _StagedRecv(self, view, source, tag)

    def waitall(self, requests: Sequence[Any]) -> None:
        _wait_all(requests, self.mover.engine)

    def send(self, view: Any, dest: int, tag: int) -> None:
        self.waitall([self.isend(view, dest, tag)])

    def recv(self, view: Any, source: int, tag: int) -> None:
        self.waitall([self.irecv(view, source, tag)])

    def sendrecv(self, send: Any, dest: int, send_tag: int, recv: Any, source: int,
                 recv_tag: int) -> None:
        incoming = self.irecv(recv, source, recv_tag)
        self.waitall([incoming, self.isend(send, dest, send_tag)])

    def bcast(self, view: Any, root: int) -> None:
        """Broadcast in staged chunks: the root copies each chunk to the host, ``MPI_Ibcast``
        carries it, the others copy it to their device as it completes."""
        staged_collective(self.comm, view, self.mover, self.chunk_bytes,
                          lambda host: self.comm.Ibcast([host, mpi().BYTE], root=root),
                          upload=self.comm.Get_rank() == root)


def staged_collective(comm: Comm, view: Any, mover: Any, chunk_bytes: int,
                      start: Callable[[np.ndarray], Any], *, upload: bool = True,
                      align: int = 1) -> None:
    """Run a non-blocking collective (``start(host_chunk) -> request``) on each chunk of
    the device bytes ``view`` in place, through pinned host memory: a chunk's collective
    starts once its device->host copy is done (``upload``; else at once) and its
    host->device copy is queued once the collective completes. Every rank starts the
    chunks' collectives in the same order."""
    cuts = chunk_cuts(view.nbytes, chunk_bytes, align)
    host, _owner = mover.host(view.nbytes)
    if upload:
        mover.after_compute()
        uploads = [mover.to_host(host[a:b], view[a:b]) for a, b in cuts]
    requests: list[Any] = []
    landed = 0
    last = None
    while landed < len(cuts):
        moved = False
        if len(requests) < len(cuts) and (not upload or mover.done(uploads[len(requests)])):
            a, b = cuts[len(requests)]
            requests.append(start(host[a:b]))
            moved = True
        while landed < len(requests) and requests[landed].Test():
            a, b = cuts[landed]
            last = mover.to_device(view[a:b], host[a:b])
            landed += 1
            moved = True
        if not moved:
            time.sleep(0)
    mover.wait(last)


def staged_allreduce(comm: Comm, buf: Any, mover: Any, typed: Callable[[np.ndarray], Any],
                     mpi_op: Any, chunk_bytes: int = STAGE_CHUNK_BYTES) -> None:
    """``MPI_Allreduce`` of the device buffer ``buf`` in place, staged in chunks (whole
    elements) with ``MPI_Iallreduce``; ``typed(host_chunk_bytes)`` gives the MPI buffer
    spec of a host chunk."""
    IN_PLACE = mpi().IN_PLACE
    staged_collective(comm, buf.view(np.uint8), mover, chunk_bytes,
                      lambda host: comm.Iallreduce(IN_PLACE, typed(host), op=mpi_op),
                      align=buf.itemsize)
