"""Every GPU-capable algorithm on CuPy buffers: results equal to a float64 reference within
tolerance, bitwise identical across ranks, SUM/MEAN/MIN/MAX, lengths 0/1/odd/not divisible.

Runs on COMM_WORLD of whatever launch started pytest (1 process, or mpiexec -n N).
``nccl`` needs one GPU per rank (skipped when ranks share one); the MPI algorithms accept
shared GPUs. Set MPISTRAT_CUDA_AWARE_MPI=0/1 to pick the staged or direct transport.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np
import pytest

from mpistrat import ReduceOp, dispatch
from mpistrat.algorithms import Implementation, halving_doubling, native, ring, shuffle
from mpistrat.algorithms.hierarchical import hierarchical
from mpistrat.runtime._mpi import world

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")

LENGTHS = [0, 1, 7, 1000, 1 << 20 | 3]


def _comm():
    return world()


def _contribution(rank, n, dtype):
    x = (np.arange(n) * 7 + rank * 5) % 17 - 8
    return x.astype(dtype) if np.dtype(dtype).kind in "iu" else (x / 3).astype(dtype)


def _reference(op, size, n, dtype):
    stack = np.stack([_contribution(r, n, dtype).astype(np.float64) for r in range(size)])
    if op is ReduceOp.MIN:
        return stack.min(0)
    if op is ReduceOp.MAX:
        return stack.max(0)
    total = stack.sum(0)
    return total / size if op is ReduceOp.MEAN else total


def _device():
    comm = _comm()
    from mpistrat.runtime.topology import get_topology

    count = cupy.cuda.runtime.getDeviceCount()
    return get_topology(comm).local_rank % count


def _distinct_gpus():
    comm = _comm()
    from mpistrat.runtime.topology import get_topology

    return get_topology(comm).local_size <= cupy.cuda.runtime.getDeviceCount()


def _nccl_flat(comm, buf, *, op, shards, backend, rotation):
    dispatch.implementation("nccl").all_reduce(comm, buf, op=op, shards=shards, backend=backend,
                                          rotation=rotation)


def _hier(intra, inter):
    return functools.partial(hierarchical, intra=intra, inter=inter)


ALGORITHMS = {
    "xring": ring.all_reduce,
    "xring#2": functools.partial(ring.all_reduce, shards=2),
    "rechd": halving_doubling.all_reduce,
    "psgpu": shuffle.all_reduce,
    "native": native.all_reduce,
    "nccl": _nccl_flat,
    "nccl/xring": "nccl/xring",
    "nccl/pscpu": "nccl/pscpu",
    # MPI stages on both levels: with several ranks in a node group and several groups
    # (bin/gputest: 4 ranks, MPISTRAT_RANKS_PER_NODE=2), the leaders' result reaches the
    # others through the transport's broadcast (staged without CUDA-aware MPI)
    "xring/xring": "xring/xring",
    "pscpu/pscpu": "pscpu/pscpu",
}


def _run(name, comm, buf, op, backend):
    algorithm = ALGORITHMS[name]
    if isinstance(algorithm, str) and not algorithm.startswith("nccl"):
        dispatch.compose(*algorithm.split("/"))(comm, buf, op=op, shards=1, backend=backend,
                                                rotation=0)
        return
    if isinstance(algorithm, str):
        intra = dispatch.implementation("nccl")
        inter = Implementation(ring.all_reduce) if algorithm.endswith("xring") else \
            Implementation(shuffle.all_reduce, shuffle.reduce_to_root)
        _hier(intra, inter)(comm, buf, op=op, shards=1, backend=backend, rotation=0)
        return
    kwargs = {} if "#" in name else {"shards": 1}
    algorithm(comm, buf, op=op, backend=backend, rotation=0, **kwargs)


@pytest.mark.parametrize("name", list(ALGORITHMS))
@pytest.mark.parametrize("op", list(ReduceOp))
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32])
def test_algorithm(name, op, n, dtype):
    comm = _comm()
    if name.startswith("nccl") and not _distinct_gpus():
        pytest.skip("NCCL needs one GPU per rank of a node group")
    from mpistrat.backends import get_backend

    with cupy.cuda.Device(_device()):
        buf = cupy.asarray(_contribution(comm.rank, n, dtype))
        backend = get_backend(buf)
        _run(name, comm, buf, op, backend)
        if op is ReduceOp.MEAN:
            buf = backend.divide(buf, comm.size)
        host = cupy.asnumpy(buf)
    ref = _reference(op, comm.size, n, dtype)
    eps = 0.0 if np.dtype(dtype).kind in "iu" else float(np.finfo(dtype).eps)
    tol = (comm.size + 2) * eps * np.abs(ref).max(initial=0) * 4 + (1e-12 if eps else 0)
    digest = hashlib.sha256(host.tobytes()).hexdigest()
    digests = comm.allgather(digest)
    assert host.shape == (n,)
    assert np.all(np.abs(host.astype(np.float64) - ref) <= tol), name
    assert digests == [digests[0]] * comm.size, "results differ between ranks"


def test_two_devices_per_rank_nccl():
    """G = 2: one NCCL communicator per device, created inside an NCCL group."""
    comm = _comm()
    from mpistrat.algorithms.nccl import all_reduce_devices
    from mpistrat.runtime.topology import get_topology

    count = cupy.cuda.runtime.getDeviceCount()
    local = get_topology(comm).local_size
    if count < 2 * local:
        pytest.skip(f"needs 2 GPUs per rank, this node has {count} for {local} rank(s)")
    first = get_topology(comm).local_rank * 2
    bufs = []
    for i in range(2):
        with cupy.cuda.Device(first + i):
            bufs.append(cupy.asarray(_contribution(comm.rank * 2 + i, 1001, np.float32)))
    all_reduce_devices(comm, bufs, op=ReduceOp.SUM)
    stack = np.stack([_contribution(r, 1001, np.float32).astype(np.float64)
                      for r in range(comm.size * 2)])
    for b in bufs:
        assert np.allclose(cupy.asnumpy(b), stack.sum(0), atol=1e-4 * comm.size)


def test_torch_like_interface_is_zero_copy():
    from mpistrat.backends import as_array

    with cupy.cuda.Device(_device()):
        x = cupy.arange(10, dtype=cupy.float32)

        class Foreign:
            __cuda_array_interface__ = x.__cuda_array_interface__

        _, array = as_array(Foreign())
        assert array.data.ptr == x.data.ptr
