"""The staged transport's pipeline logic on host buffers (HostMover: synchronous copies), at
every rank count: chunked messages of any size, message order per peer, broadcast, the
chunked Iallreduce, and the algorithms run through it — their results must be bitwise equal
to the same algorithm run directly (the staged path moves the same bytes)."""

from __future__ import annotations

import numpy as np
import pytest

from mpistrat import ReduceOp
from mpistrat.algorithms import halving_doubling, native, ring, shuffle
from mpistrat.algorithms.source import Source
from mpistrat.backends.transport import HostMover, StagedTransport, staged_allreduce
from mpistrat.backends import NumpyBackend
from mpistrat.backends.capabilities import device_buffers_to_mpi

CHUNK = 40  # bytes: tiny, so every message is many chunks (and some end ragged)


class StagedHostBackend(NumpyBackend):
    """NumPy arithmetic, but messages staged through a HostMover in CHUNK-byte pieces."""

    name = "numpy-staged"

    def __init__(self, chunk: int = CHUNK) -> None:
        super().__init__()
        self.mover = HostMover()
        self.chunk = chunk

    def transport(self, comm):
        return StagedTransport(comm, self.mover, self.chunk)


def _data(rank, n, dtype=np.float32):
    x = (np.arange(n) * 7 + rank * 13) % 29 - 14
    return (x / 3).astype(dtype)


def _agree(comm, array):
    digests = comm.allgather(array.tobytes())
    return all(d == digests[0] for d in digests)


@pytest.mark.parametrize("nbytes", [0, 1, 39, 40, 41, 1000])
def test_ring_exchange(comm, nbytes):
    t = StagedTransport(comm, HostMover(), CHUNK)
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    out = np.full(nbytes, 255, np.uint8)
    mine = ((np.arange(nbytes) + comm.rank) % 251).astype(np.uint8)
    t.sendrecv(mine, right, 1, out, left, 1)
    assert np.array_equal(out, ((np.arange(nbytes) + left) % 251).astype(np.uint8))


def test_many_messages_keep_their_order(comm):
    """Several staged sends to one peer with one tag arrive in the order they were started."""
    t = StagedTransport(comm, HostMover(), CHUNK)
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    sizes = [100, 0, 7, 333, 40]
    outs = [np.zeros(s, np.uint8) for s in sizes]
    recvs = [t.irecv(o, left, 3) for o in outs]
    sends = [t.isend(np.full(s, (comm.rank * 10 + i) % 256, np.uint8), right, 3)
             for i, s in enumerate(sizes)]
    for r in reversed(recvs):  # waiting out of order must still progress everything
        r.Wait()
    t.waitall(sends)
    assert all(np.all(o == (left * 10 + i) % 256) for i, o in enumerate(outs))


@pytest.mark.parametrize("nbytes", [0, 5, 401])
def test_bcast(comm, nbytes):
    t = StagedTransport(comm, HostMover(), CHUNK)
    root = comm.size - 1
    view = (np.arange(nbytes) % 256).astype(np.uint8) if comm.rank == root \
        else np.zeros(nbytes, np.uint8)
    t.bcast(view, root)
    assert np.array_equal(view, (np.arange(nbytes) % 256).astype(np.uint8))


@pytest.mark.parametrize("n", [0, 1, 9, 10, 1001])
@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_staged_allreduce_equals_native(comm, n, dtype):
    buf = _data(comm.rank, n, dtype)
    expected = buf.copy()
    native.all_reduce(comm, expected, op=ReduceOp.SUM, backend=NumpyBackend())
    typed = native._typed(buf, ReduceOp.SUM)
    staged_allreduce(comm, buf, HostMover(),
                     lambda host: [host.view(buf.dtype), typed[0][1]], typed[1], CHUNK)
    assert np.array_equal(buf, expected)


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX])
@pytest.mark.parametrize("n", [0, 1, 3, 17, 1000, 4099])
@pytest.mark.parametrize("shards", [1, 2])
def test_ring_staged_equals_direct(comm, op, n, shards):
    direct = _data(comm.rank, n)
    staged = direct.copy()
    ring.all_reduce(comm, direct, op=op, shards=shards, backend=NumpyBackend())
    ring.all_reduce(comm, staged, op=op, shards=shards, backend=StagedHostBackend())
    assert np.array_equal(staged, direct)
    assert _agree(comm, staged)
    stack = np.stack([_data(r, n).astype(np.float64) for r in range(comm.size)])
    ref = {ReduceOp.SUM: stack.sum(0), ReduceOp.MIN: stack.min(0), ReduceOp.MAX: stack.max(0)}[op]
    assert np.allclose(staged, ref, atol=1e-4 * comm.size)


@pytest.mark.parametrize("piece_bytes", [4 << 20, 1000])  # pieces in one or many messages
@pytest.mark.parametrize("n", [0, 1, 10, 1001])
@pytest.mark.parametrize("shards", [1, 2])
def test_shuffle_staged_equals_direct(comm, n, shards, piece_bytes, monkeypatch):
    monkeypatch.setattr(shuffle, "PIECE_BYTES", piece_bytes)
    shards = min(shards, comm.size)
    direct = _data(comm.rank, n)
    staged = direct.copy()
    shuffle.all_reduce(comm, direct, op=ReduceOp.SUM, shards=shards, backend=NumpyBackend())
    shuffle.all_reduce(comm, staged, op=ReduceOp.SUM, shards=shards,
                       backend=StagedHostBackend())
    assert np.array_equal(staged, direct) and _agree(comm, staged)
    root = _data(comm.rank, n)
    shuffle.reduce_to_root(comm, root, op=ReduceOp.MAX, backend=StagedHostBackend(), root=0)
    expected = _data(comm.rank, n)
    shuffle.reduce_to_root(comm, expected, op=ReduceOp.MAX, backend=NumpyBackend(), root=0)
    if comm.rank == 0:
        assert np.array_equal(root, expected)


@pytest.mark.parametrize("n", [0, 5, 3001])
def test_ring_out_of_place_staged_equals_direct(comm, n):
    """A scattered Source: pieces sent straight from the segments, staged."""
    whole = _data(comm.rank, n)
    cuts = [0, n // 3, n // 3 + 1, n]
    segments = [whole[a:b].copy() for a, b in zip(cuts[:-1], cuts[1:])]
    direct, staged = np.empty(n, np.float32), np.empty(n, np.float32)
    ring.all_reduce(comm, direct, op=ReduceOp.SUM, backend=NumpyBackend(),
                    source=Source(segments, coalesce_bytes=64))
    ring.all_reduce(comm, staged, op=ReduceOp.SUM, backend=StagedHostBackend(),
                    source=Source(segments, coalesce_bytes=64))
    assert np.array_equal(staged, direct) and _agree(comm, staged)


@pytest.mark.parametrize("forced", [True, False])
def test_transport_choice_is_agreed(world, forced):
    """One rank unable to take device buffers makes every rank stage them."""
    sub = world.Dup()
    try:
        mine = forced if world.rank > 0 else False
        assert device_buffers_to_mpi(sub, forced=mine) is False
        assert device_buffers_to_mpi(sub, forced=True) is False  # cached per communicator
    finally:
        sub.Free()
    sub = world.Dup()
    try:
        assert device_buffers_to_mpi(sub, forced=True) is True
    finally:
        sub.Free()


@pytest.mark.parametrize("pipeline", [4 << 20, 200])  # last step in one piece or many
@pytest.mark.parametrize("n", [0, 1, 3, 300, 1001, 4099])  # 300+: halving-doubling
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MAX])
def test_rechd_staged_equals_direct(comm, op, n, pipeline, monkeypatch):
    """Recursive halving-doubling through the staged transport: folds for a non-power of
    two, doubling for short buffers, the pipelined last step, in place and from a Source."""
    monkeypatch.setattr(halving_doubling, "PIPELINE_BYTES", pipeline)
    direct = _data(comm.rank, n)
    staged = direct.copy()
    halving_doubling.all_reduce(comm, direct, op=op, backend=NumpyBackend())
    backend = StagedHostBackend()
    copies = []
    to_host = backend.mover.to_host
    backend.mover.to_host = lambda host, device: copies.append(len(host)) or to_host(host, device)
    halving_doubling.all_reduce(comm, staged, op=op, backend=backend)
    assert np.array_equal(staged, direct) and _agree(comm, staged)
    if comm.size > 1 and n > 0:  # the bytes went through the mover, in CHUNK pieces
        assert copies and max(copies) <= CHUNK
    whole = _data(comm.rank, n)
    cuts = [0, n // 3, n // 3 + 1, n]
    segments = [whole[a:b].copy() for a, b in zip(cuts[:-1], cuts[1:])]
    out = np.empty(n, np.float32)
    halving_doubling.all_reduce(comm, out, op=op, backend=StagedHostBackend(),
                                source=Source(segments, coalesce_bytes=64))
    assert np.array_equal(out, direct)


class _OrderLog(HostMover):
    """A HostMover that records when the copy streams are told to wait for the compute
    stream and when each chunk is copied (CudaMover orders its streams that way)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[str] = []

    def after_compute(self) -> None:
        self.log.append("wait")

    def to_host(self, host, device):
        self.log.append("to_host")
        return super().to_host(host, device)

    def to_device(self, device, host):
        self.log.append("to_device")
        return super().to_device(device, host)


def test_copies_wait_for_the_compute_stream(comm):
    """A staged receive must not land in device memory that queued kernels still use (a
    buffer CuPy's pool handed out again): the host->device stream waits for the compute
    stream when the receive starts, as the device->host stream does for a send. Without
    this, rechd on two ranks sharing a GPU returned wrong tensors."""
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    receiver, sender = _OrderLog(), _OrderLog()
    out = np.zeros(100, np.uint8)
    receive = StagedTransport(comm, receiver, CHUNK).irecv(out, left, 7)
    assert receiver.log == ["wait"]  # before any chunk can land
    send = StagedTransport(comm, sender, CHUNK).isend(np.full(100, comm.rank, np.uint8),
                                                      right, 7)
    assert sender.log[0] == "wait" and sender.log.count("to_host") == 3
    send.Wait()
    receive.Wait()
    assert receiver.log == ["wait"] + ["to_device"] * 3
    assert np.all(out == left)
