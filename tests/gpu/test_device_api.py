"""The public API on device arrays: ``mpistrat.all_reduce`` (one array, a batch) and the
cross-device ops' ``batch_reduce`` with CuPy arrays and PyTorch CUDA tensors — results of
the caller's type on the caller's device, written into the caller's memory where asked
(the same device pointer), equal to a float64 reference and bitwise identical on every
rank.

Runs on COMM_WORLD of whatever launch started pytest (1 process, or mpiexec -n N, as
``bin/gputest`` does). The MPI algorithms (``xring``, ``rechd``, ``psgpu``) also run on
ranks sharing one GPU; ``nccl`` only with one GPU per rank.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.runtime._mpi import world

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")

LENGTHS = [1, 1000, 1 << 20 | 3]


def _device() -> int:
    from mpistrat.runtime.topology import get_topology

    return get_topology(world()).local_rank % cupy.cuda.runtime.getDeviceCount()


def _specs() -> list[str]:
    from mpistrat.runtime.topology import get_topology

    shared = get_topology(world()).local_size > cupy.cuda.runtime.getDeviceCount()
    return ["xring", "rechd", "psgpu"] + ([] if shared else ["nccl"])


def _contribution(rank: int, n: int, salt: int = 0) -> np.ndarray:
    return ((((np.arange(n) * 7 + rank * 5 + salt) % 17) - 8) / 3).astype(np.float32)


def _reference(op: str, n: int, salt: int = 0) -> np.ndarray:
    size = world().Get_size()
    total = np.stack([_contribution(r, n, salt).astype(np.float64) for r in range(size)]).sum(0)
    return total / size if op == "mean" else total


def _check(host: np.ndarray, op: str, n: int, salt: int = 0) -> None:
    comm = world()
    ref = _reference(op, n, salt)
    tol = (comm.size + 2) * float(np.finfo(np.float32).eps) * np.abs(ref).max(initial=0) * 4
    assert host.shape == (n,) and host.dtype == np.float32
    assert np.all(np.abs(host.astype(np.float64) - ref) <= tol + 1e-12)
    digest = hashlib.sha256(host.tobytes()).hexdigest()
    assert comm.allgather(digest) == [digest] * comm.size, "results differ between ranks"


def _ptr(array) -> int:
    """The device address of a CuPy array's data."""
    return array.data.ptr


def _host(array) -> np.ndarray:
    return cupy.asnumpy(array)


def _on_this_device(array) -> bool:
    return isinstance(array, cupy.ndarray) and array.device.id == _device()


def _specs_param():
    return pytest.mark.parametrize("spec", ["xring", "rechd", "psgpu", "nccl"])


def _skip_unless_runs(spec: str) -> None:
    if spec not in _specs():
        pytest.skip(f"{spec} needs one GPU per rank; these ranks share one")


@_specs_param()
@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("inplace", [False, True])
def test_all_reduce_of_a_cupy_array(spec, op, n, inplace):
    _skip_unless_runs(spec)
    with cupy.cuda.Device(_device()):
        x = cupy.asarray(_contribution(world().rank, n))
        result = ms.all_reduce(x, op, spec, inplace=inplace)
        assert _on_this_device(result)
        if inplace:
            assert _ptr(result) == _ptr(x)
        else:
            assert _ptr(result) != _ptr(x)
            assert np.array_equal(_host(x), _contribution(world().rank, n))
        _check(_host(result), op, n)


@_specs_param()
@pytest.mark.parametrize("inplace", [False, True])
def test_all_reduce_of_a_batch_of_cupy_arrays(spec, inplace):
    _skip_unless_runs(spec)
    lengths = [5, 4099, 1 << 18]
    with cupy.cuda.Device(_device()):
        xs = [cupy.asarray(_contribution(world().rank, n, salt=i))
              for i, n in enumerate(lengths)]
        pointers = [_ptr(x) for x in xs]
        results = ms.all_reduce(xs, "sum", spec, inplace=inplace)
        assert isinstance(results, list) and len(results) == len(xs)
        for i, (n, r) in enumerate(zip(lengths, results)):
            assert _on_this_device(r)
            assert (_ptr(r) == pointers[i]) == inplace
            _check(_host(r), "sum", n, salt=i)


@_specs_param()
@pytest.mark.parametrize("inplace", [False, True])
def test_all_reduce_of_a_torch_cuda_tensor(spec, inplace):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("this PyTorch has no CUDA")
    _skip_unless_runs(spec)
    n = 1 << 16 | 5
    device = torch.device("cuda", _device())
    x = torch.as_tensor(_contribution(world().rank, n)).to(device)
    pointer = x.data_ptr()
    result = ms.all_reduce(x, "mean", spec, inplace=inplace)
    assert isinstance(result, torch.Tensor) and result.device == device
    assert (result.data_ptr() == pointer) == inplace
    _check(result.cpu().numpy(), "mean", n)


@_specs_param()
def test_cross_device_ops_batch_reduce_in_place(spec):
    _skip_unless_runs(spec)
    ops = ms.NcclAllReduce() if spec == "nccl" else \
        ms.MultiWorkerAllReduce(all_reduce_spec=spec)
    lengths = [3, 1000, 1 << 20]
    with cupy.cuda.Device(_device()):
        xs = [cupy.asarray(_contribution(world().rank, n, salt=i))
              for i, n in enumerate(lengths)]
        pointers = [_ptr(x) for x in xs]
        pairs = [(ms.PerReplica([x], ["/gpu:0"]), "/gpu:0") for x in xs]
        results = ops.batch_reduce(ms.ReduceOp.SUM, pairs, inplace=True)
        for i, (n, r) in enumerate(zip(lengths, results)):
            assert _on_this_device(r) and _ptr(r) == pointers[i]
            _check(_host(r), "sum", n, salt=i)
        fresh = ops.reduce(ms.ReduceOp.MEAN, ms.PerReplica([xs[1]], ["/gpu:0"]), "/gpu:0")
        assert _on_this_device(fresh)
        if world().size > 1:  # (one replica in all: the value is its own reduction)
            assert _ptr(fresh) != pointers[1]
        # xs[1] holds the sum now, the same on every rank: its mean is the sum again
        assert np.allclose(_host(fresh), _host(xs[1]), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int8])
def test_copy_many_and_copy_pieces_in_one_launch(dtype):
    """The batched copies behind a batch's write-back and gathering: sizes and offsets
    that are 16-byte, 4-byte and 1-byte aligned, empty pieces, and a pair that is not
    contiguous (copied on its own), against NumPy."""
    from mpistrat.backends import get_backend

    rng = np.random.default_rng(7)
    sizes = [0, 1, 3, 4, 17, 64, 1000, 4099, 1 << 18]
    with cupy.cuda.Device(_device()):
        srcs = [cupy.asarray((rng.standard_normal(n) * 50).astype(dtype)) for n in sizes]
        dsts = [cupy.zeros(n, dtype=dtype) for n in sizes]
        strided = cupy.zeros(20, dtype=dtype)[::2]
        backend = get_backend(srcs[0])
        backend.copy_many(dsts + [strided], srcs + [srcs[5][:10]])
        for dst, src in zip(dsts, srcs):
            assert np.array_equal(_host(dst), _host(src))
        assert np.array_equal(_host(strided), _host(srcs[5][:10]))

        # pieces of the segments at odd offsets, gathered into one buffer
        pieces, at = [], 1
        for src in srcs:
            start, stop = min(1, src.size), src.size
            pieces.append((src, start, stop, at))
            at += stop - start
        out = cupy.zeros(at + 1, dtype=dtype)
        backend.copy_pieces(out, pieces)
        expected = np.zeros(at + 1, dtype=dtype)
        for src, start, stop, where in pieces:
            expected[where:where + stop - start] = _host(src)[start:stop]
        assert np.array_equal(_host(out), expected)


@_specs_param()
def test_batch_of_resnet50_gradients_in_place(spec):
    """161 ResNet-50-shaped tensors reduced in place in one call (gathered and written
    back by batched copies): every tensor's result in its own memory."""
    from mpistrat.bench.shapes import resnet50_gradient_shapes

    _skip_unless_runs(spec)
    ops = ms.NcclAllReduce() if spec == "nccl" else \
        ms.MultiWorkerAllReduce(all_reduce_spec=spec)
    shapes = resnet50_gradient_shapes()
    with cupy.cuda.Device(_device()):
        grads = [cupy.asarray(_contribution(world().rank, int(np.prod(s)), salt=i)
                              .reshape(s)) for i, s in enumerate(shapes)]
        pointers = [_ptr(g) for g in grads]
        results = ops.batch_reduce(ms.ReduceOp.MEAN,
                                   [(ms.PerReplica([g], ["/gpu:0"]), "/gpu:0") for g in grads],
                                   inplace=True)
        for i, (s, g, r) in enumerate(zip(shapes, grads, results)):
            assert r is g and _ptr(r) == pointers[i] and r.shape == tuple(s)
            if i % 20 == 0 or i == len(shapes) - 1:
                _check(_host(r).reshape(-1), "mean", int(np.prod(s)), salt=i)
