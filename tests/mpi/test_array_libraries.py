"""Other libraries' arrays at every entry point: PyTorch (CPU) and JAX tensors, and plain
buffers, go in without a copy and come back as the caller's type, correct and bitwise
identical on every rank; one rank passing something unusable gives the same error on
every rank; a list is a batch, replicas are a PerReplica.

PyTorch and JAX are test extras (bin/_setup.sh installs them); a framework that is not
installed skips its cases and says so.
"""

from __future__ import annotations

import array
import warnings

import numpy as np
import pytest
from _checks import digest, finish

import mpistrat as ms
from mpistrat import CollectiveMismatchError, PerReplica

MPI = pytest.importorskip("mpi4py.MPI")

LIBRARIES = ["torch", "jax"]


class Lib:
    """Build and read back one library's arrays."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.mod = pytest.importorskip(name if name == "torch" else "jax.numpy",
                                       reason=f"{name} is not installed (a test extra)")

    def full(self, shape, value, dtype="float32"):
        if self.name == "torch":
            import torch

            return torch.full(shape, value, dtype=getattr(torch, dtype))
        # (JAX keeps float64 only with jax_enable_x64: ask for what it gives)
        return self.mod.full(shape, value, dtype="float32" if dtype == "float64" else dtype)

    def is_mine(self, value) -> bool:
        return type(value).__module__.split(".")[0] in (
            ("torch",) if self.name == "torch" else ("jax", "jaxlib"))

    @staticmethod
    def host(value) -> np.ndarray:
        return np.asarray(value)


@pytest.fixture(params=LIBRARIES)
def lib(request):
    return Lib(request.param)


def _check(comm, results, want, label):
    problems, digests = [], []
    for index, (got, expected) in enumerate(zip(results, want)):
        host = np.asarray(got)
        if not np.array_equal(host, expected):
            problems.append(f"{label} {index}: got {host}, expected {expected}")
        digests.append((f"{label} {index}", digest(np.ascontiguousarray(host))))
    finish(comm, problems, digests)


def test_all_reduce_hands_back_the_callers_type(comm, lib):
    n, r = comm.size, comm.rank
    x = lib.full((2, 3), r + 1.0)
    total = n * (n + 1) / 2
    out = ms.all_reduce(x, "sum", "xring", comm)
    mean = ms.all_reduce(x, "mean", "rechd", comm)
    problems = [f"{type(v).__name__} is not a {lib.name} array" for v in (out, mean)
                if not lib.is_mine(v)]
    if not np.array_equal(np.asarray(x), np.full((2, 3), r + 1.0)):
        problems.append("the input changed")
    assert not problems, problems
    _check(comm, [out, mean], [np.full((2, 3), total), np.full((2, 3), total / n)], "one")


def test_torch_in_place_shares_memory_and_returns_the_input(comm):
    torch = pytest.importorskip("torch")
    n, r = comm.size, comm.rank
    x = torch.full((5,), float(r))
    grads = [torch.full((3,), 1.0, requires_grad=False), torch.arange(4, dtype=torch.float64)]
    pointer = x.data_ptr()
    got = ms.all_reduce(x, "sum", "shm", comm, inplace=True)
    batch = ms.all_reduce(grads, "mean", "xring", comm, inplace=True)
    problems = []
    if got is not x or x.data_ptr() != pointer:
        problems.append("in place did not write into the tensor itself")
    if batch[0] is not grads[0] or batch[1] is not grads[1]:
        problems.append("the grouped in-place call did not return the inputs")
    assert not problems, problems
    _check(comm, [x, grads[0], grads[1]],
           [np.full(5, n * (n - 1) / 2), np.ones(3), np.arange(4.0)], "in place")


def test_a_parameter_that_requires_grad_is_reduced_through_its_data(comm):
    torch = pytest.importorskip("torch")
    p = torch.nn.Parameter(torch.ones(3))
    out = ms.all_reduce(p, "sum", "native", comm)
    with torch.no_grad():
        ms.all_reduce(p, "max", "native", comm, inplace=True)
    assert isinstance(out, torch.Tensor) and not out.requires_grad
    _check(comm, [out, p.detach()], [np.full(3, comm.size), np.ones(3)], "parameter")


def test_batch_with_out_and_zero_copy_inputs(comm, lib):
    n, r = comm.size, comm.rank
    batch = [lib.full((4,), r + 1.0), lib.full((2, 2), 2.0, "float64"), lib.full((1,), r, "int32")]
    outs = [np.empty_like(np.asarray(b)) for b in batch]  # (JAX makes float64 float32)
    got = ms.all_reduce(batch, "sum", "pscpu", comm, out=outs)
    plain = ms.all_reduce(tuple(batch), "max", "rechd", comm)
    assert got is not outs and all(a is b for a, b in zip(got, outs))
    assert all(lib.is_mine(v) for v in plain), [type(v) for v in plain]
    total = n * (n + 1) / 2
    _check(comm, outs + list(plain),
           [np.full(4, total), np.full((2, 2), 2.0 * n), np.full(1, n * (n - 1) // 2),
            np.full(4, n), np.full((2, 2), 2.0), np.full(1, n - 1)], "batch")


def test_buffers_without_a_library(comm):
    """The buffer protocol and __array_interface__: NumPy results, memory shared in place."""
    n = comm.size
    buf = array.array("d", [1.0, 2.0, 3.0])
    view = memoryview(bytearray(np.arange(4, dtype=np.int64).tobytes())).cast("q")
    got = ms.all_reduce(buf, "sum", "native", comm)
    ms.all_reduce(view, "sum", "native", comm, inplace=True)
    assert isinstance(got, np.ndarray)
    _check(comm, [got, np.asarray(buf), np.frombuffer(view, np.int64)],
           [np.array([1.0, 2.0, 3.0]) * n, [1.0, 2.0, 3.0], np.arange(4) * n], "buffers")


def test_a_list_is_a_batch_and_replicas_are_per_replica(comm):
    n = comm.size
    a, b = np.full(3, 1.0), np.full(3, 2.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batch = ms.all_reduce([a, b], "sum", "xring", comm)
    replicas = ms.all_reduce(PerReplica([a, b]), "sum", "xring", comm)
    assert isinstance(batch, list) and isinstance(replicas, list)
    from mpistrat import allreduce

    warned = [w for w in caught if issubclass(w.category, FutureWarning)]
    assert warned or allreduce._WARNED, "the change of meaning of a list was not announced"
    _check(comm, batch + replicas,
           [np.full(3, n), np.full(3, 2.0 * n), np.full(3, 3.0 * n), np.full(3, 3.0 * n)],
           "list")


BAD_ON_RANK_0 = {
    "not an array": lambda lib: object(),
    "read-only in place": lambda lib: lib.full((3,), 1.0) if lib.name == "jax" else None,
    "another shape": lambda lib: lib.full((4,), 1.0),
}


@pytest.mark.parametrize("kind", list(BAD_ON_RANK_0))
def test_one_rank_bad_input_is_an_error_on_every_rank_of_all_reduce(comm, lib, kind):
    bad = BAD_ON_RANK_0[kind](lib)
    if bad is None:
        pytest.skip(f"{lib.name} arrays are writeable")
    if kind == "another shape" and comm.size == 1:
        pytest.skip("one rank: nothing to disagree with")
    good = lib.full((3,), 1.0)
    inplace = kind == "read-only in place"
    if inplace and lib.name == "jax":
        good = np.ones(3, np.float32)  # the other ranks pass a writeable array
    value = bad if comm.rank == 0 else good
    with pytest.raises((TypeError, ValueError)) as caught:
        ms.all_reduce(value, "sum", "xring", comm, inplace=inplace)
    if comm.size > 1 and comm.rank > 0:
        assert isinstance(caught.value, CollectiveMismatchError), repr(caught.value)
    names = comm.allgather(type(caught.value).__name__)
    assert len(names) == comm.size


ENTRY_POINTS = ["cross_device_ops.reduce", "cross_device_ops.batch_reduce",
                "cross_device_ops.broadcast", "strategy.reduce", "replica_context.all_reduce"]


def _call(entry: str, comm, value):
    if entry.startswith("cross_device_ops"):
        ops = ms.MultiWorkerAllReduce(all_reduce_spec="xring", comm=comm)
        if entry.endswith(".reduce"):
            return [ops.reduce("sum", value, "/cpu:0")]
        if entry.endswith("batch_reduce"):
            return ops.batch_reduce("sum", [(value, "/cpu:0"), (value, "/cpu:0")])
        return [ops.broadcast(value, "/cpu:0")]
    strategy = ms.MultiWorkerMirroredStrategy(comm=comm)
    if entry == "strategy.reduce":
        return [strategy.reduce("sum", value, axis=None)]
    return list(strategy.run(
        lambda: ms.get_replica_context().all_reduce("sum", [value, value])))


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_every_entry_point_takes_and_returns_the_library(comm, lib, entry):
    n, r = comm.size, comm.rank
    value = lib.full((2,), r + 1.0)
    results = _call(entry, comm, value)
    assert all(lib.is_mine(v) for v in results), [type(v) for v in results]
    want = np.full(2, 1.0) if entry.endswith("broadcast") else np.full(2, n * (n + 1) / 2)
    _check(comm, results, [want] * len(results), entry)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_every_entry_point_refuses_a_non_array_on_one_rank_everywhere(comm, entry):
    value = object() if comm.rank == 0 else np.ones(2)
    with pytest.raises((TypeError, ValueError)) as caught:
        _call(entry, comm, value)
    if comm.rank == 0:
        assert "object" in str(caught.value), str(caught.value)
    elif comm.size > 1:
        assert isinstance(caught.value, CollectiveMismatchError), repr(caught.value)


def test_batch_reduce_in_place_writes_into_the_callers_tensors(comm, lib):
    """``batch_reduce(..., inplace=True)`` writes into the caller's own tensors (the same
    objects come back); JAX arrays are immutable, so every rank says so."""
    n, r = comm.size, comm.rank
    ops = ms.MultiWorkerAllReduce(all_reduce_spec="xring:64:pscpu", num_packs=1, comm=comm)
    grads = [lib.full((2, 3), r + 1.0), lib.full((40,), 2.0), lib.full((3,), 1.0, "float64")]
    pairs = [(PerReplica([g]), "/cpu:0") for g in grads]
    if lib.name == "jax":
        with pytest.raises(ValueError, match="read-only.*writeable"):
            ops.batch_reduce("sum", [(v, v) for v, _ in pairs], inplace=True)
        return
    got = ops.batch_reduce("mean", [(v, v) for v, _ in pairs], inplace=True)
    assert all(a is b for a, b in zip(got, grads)), [type(a) for a in got]
    _check(comm, grads, [np.full((2, 3), (n + 1) / 2), np.full(40, 2.0), np.ones(3)],
           "in place")


def test_replica_context_writes_into_given_outputs(world):
    torch = pytest.importorskip("torch")
    n, r = world.size, world.rank
    grads = [torch.full((2,), r + 1.0), torch.ones(3, dtype=torch.float64)]
    outs = [torch.empty(2), torch.empty(3, dtype=torch.float64)]
    strategy = ms.MultiWorkerMirroredStrategy(comm=world)

    def step():
        ctx = ms.get_replica_context()
        a = ctx.all_reduce("sum", grads, out=outs)
        b = ctx.all_reduce("mean", grads, inplace=True)
        return a is outs and b is grads

    assert strategy.run(step) is True
    _check(world, outs + grads, [np.full(2, n * (n + 1) / 2), np.full(3, float(n)),
                                 np.full(2, (n + 1) / 2), np.ones(3)], "replica context")


def test_variables_take_other_libraries_values(world, lib):
    strategy = ms.MultiWorkerMirroredStrategy(comm=world)
    with strategy.scope():
        v = ms.Variable(lib.full((3,), 0.0))
    v.assign(lib.full((3,), 2.0))
    v.assign_add(lib.full((3,), 1.0))
    values = [v.numpy()]
    if lib.name == "torch":  # a Parameter (requires grad) initialises a variable too
        import torch

        with strategy.scope():
            values.append(ms.Variable(torch.nn.Parameter(torch.full((3,), 3.0))).numpy())
    _check(world, values, [np.full(3, 3.0)] * len(values), "variable")
