"""``ReduceOp`` parsing, the NumPy backend's primitives, and ``all_reduce`` on one process."""

from __future__ import annotations

import numpy as np
import pytest

from mpistrat import PerReplica, ReduceOp
from mpistrat.backends import NumpyBackend, get_backend
from mpistrat.errors import SpecTypeError

# --- ReduceOp ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "op"),
    [
        ("sum", ReduceOp.SUM), ("SUM", ReduceOp.SUM), ("Sum", ReduceOp.SUM),
        ("mean", ReduceOp.MEAN), ("Mean", ReduceOp.MEAN), (" mean ", ReduceOp.MEAN),
        ("min", ReduceOp.MIN), ("mIn", ReduceOp.MIN),
        ("max", ReduceOp.MAX), ("MAX", ReduceOp.MAX),
    ],
)
def test_parse_any_case(text, op):
    assert ReduceOp.parse(text) is op


@pytest.mark.parametrize("op", list(ReduceOp))
def test_parse_passes_members_through(op):
    assert ReduceOp.parse(op) is op


@pytest.mark.parametrize("name", ["avg", "product", "", "sum_", "prod"])
def test_parse_unknown_name(name):
    with pytest.raises(ValueError, match=rf"unknown reduce op {name!r}") as info:
        ReduceOp.parse(name)
    message = str(info.value)
    for valid in ("SUM", "MEAN", "MIN", "MAX"):
        assert valid in message


@pytest.mark.parametrize("value", [1, None, b"sum", 1.5, ["sum"], np.add])
def test_parse_wrong_type(value):
    with pytest.raises(TypeError, match=type(value).__name__) as info:
        ReduceOp.parse(value)
    assert repr(value) in str(info.value)
    assert not isinstance(info.value, ValueError)


def test_primitive_and_str():
    assert ReduceOp.MEAN.primitive is ReduceOp.SUM
    for op in (ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX):
        assert op.primitive is op
    assert str(ReduceOp.MEAN) == "MEAN"
    assert ReduceOp("SUM") is ReduceOp.SUM


def test_mpi_op():
    MPI = pytest.importorskip("mpi4py.MPI")
    assert ReduceOp.SUM.mpi_op() == MPI.SUM
    assert ReduceOp.MEAN.mpi_op() == MPI.SUM
    assert ReduceOp.MIN.mpi_op() == MPI.MIN
    assert ReduceOp.MAX.mpi_op() == MPI.MAX


# --- the NumPy backend -------------------------------------------------------------------


@pytest.fixture
def backend():
    return NumpyBackend()


def test_get_backend():
    assert isinstance(get_backend(np.zeros(3)), NumpyBackend)
    assert isinstance(get_backend(np.float32(1)), NumpyBackend)
    assert get_backend(np.zeros(1)) is get_backend(np.ones(2))  # one shared instance
    with pytest.raises(TypeError, match=r"builtins\.list"):
        get_backend([1.0, 2.0])


def test_asarray_does_not_copy_arrays(backend):
    a = np.arange(4.0)
    assert backend.asarray(a) is a
    assert backend.asarray(3).shape == ()


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def test_scratch_reuses_memory_and_grows(backend):
    first = backend.scratch("t", 10, np.float32)
    assert first.shape == (10,) and first.dtype == np.float32
    again = backend.scratch("t", 7, np.float32)
    assert _address(again) == _address(first) and again.shape == (7,)
    # the same pool serves other dtypes while it is large enough
    other = backend.scratch("t", 5, np.float64)
    assert _address(other) == _address(first) and other.dtype == np.float64
    # a different tag is a different buffer
    elsewhere = backend.scratch("u", 10, np.float32)
    assert not np.shares_memory(elsewhere, first)
    # growing: a larger request gets a new buffer big enough, then reuse again
    big = backend.scratch("t", 1 << 16, np.float64)
    assert big.shape == (1 << 16,)
    assert big.nbytes == 8 << 16
    assert not np.shares_memory(big, first)  # (the old buffer is still alive here)
    assert _address(backend.scratch("t", 1000, np.int8)) == _address(big)
    big[:] = 1.5  # writable, usable
    assert _address(backend.scratch("t", 1 << 16, np.float64)) == _address(big)
    assert _address(backend.scratch("t", 3, np.float16)) == _address(big)
    # zero elements is fine
    assert backend.scratch("t", 0, np.float32).size == 0
    backend.release()
    fresh = backend.scratch("t", 4, np.float32)
    assert fresh.shape == (4,)


def test_scratch_is_per_backend_instance():
    one, two = NumpyBackend(), NumpyBackend()
    assert not np.shares_memory(one.scratch("t", 8, np.int64), two.scratch("t", 8, np.int64))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int32, np.int64])
@pytest.mark.parametrize(
    ("op", "reference"),
    [(ReduceOp.SUM, np.add), (ReduceOp.MEAN, np.add), (ReduceOp.MIN, np.minimum),
     (ReduceOp.MAX, np.maximum)],
)
def test_combine(backend, op, reference, dtype):
    dst = (np.arange(10) % 7 - 3).astype(dtype)
    src = (np.arange(10)[::-1] % 5 - 2).astype(dtype)
    expected = reference(dst, src)
    src_before = src.copy()
    target = dst
    backend.combine(op, dst, src)
    assert dst is target  # in place
    assert dst.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(dst, expected)
    np.testing.assert_array_equal(src, src_before)


def test_combine_on_views(backend):
    buf = np.zeros(6, np.float64)
    backend.combine(ReduceOp.SUM, buf[2:4], np.array([1.0, 2.0]))
    np.testing.assert_array_equal(buf, [0, 0, 1, 2, 0, 0])


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.complex128])
def test_divide_inexact_in_place(backend, dtype):
    array = np.array([3, 6, 9, 12], dtype=dtype)
    result = backend.divide(array, 3)
    assert result is array
    assert result.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(result, np.array([1, 2, 3, 4], dtype=dtype))


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8])
def test_divide_integers_gives_new_float64(backend, dtype):
    array = np.array([3, 4, 9], dtype=dtype)
    result = backend.divide(array, 2)
    assert result is not array
    assert result.dtype == np.float64
    np.testing.assert_array_equal(result, [1.5, 2.0, 4.5])
    np.testing.assert_array_equal(array, np.array([3, 4, 9], dtype=dtype))  # untouched


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.arange(20.0)[::2],
        lambda: np.arange(12, dtype=np.int32).reshape(3, 4).T,
        lambda: np.asfortranarray(np.arange(12.0).reshape(3, 4)),
        lambda: np.arange(24.0).reshape(2, 3, 4)[:, ::2, 1:3],
        lambda: np.arange(10.0)[::-1],
    ],
    ids=["stride2", "transposed", "fortran", "sliced3d", "reversed"],
)
def test_flat_copy_of_non_contiguous(backend, make):
    array = make()
    assert not array.flags.c_contiguous
    copy = backend.flat_copy(array)
    assert copy.ndim == 1 and copy.flags.c_contiguous and copy.size == array.size
    assert copy.dtype == array.dtype
    np.testing.assert_array_equal(copy, array.reshape(-1))  # C (row-major) order
    assert not np.shares_memory(copy, array)
    assert backend.flat_view(array) is None


def test_flat_copy_and_view_of_contiguous(backend):
    array = np.arange(6.0).reshape(2, 3)
    copy = backend.flat_copy(array)
    assert copy.shape == (6,) and not np.shares_memory(copy, array)
    copy[0] = 99
    assert array[0, 0] == 0
    view = backend.flat_view(array)
    assert view.shape == (6,) and np.shares_memory(view, array)
    scalar = backend.flat_copy(np.float32(2.5))
    assert scalar.shape == (1,) and scalar[0] == np.float32(2.5)


def test_copy_comm_view_synchronize(backend):
    dst = np.zeros(3, np.int64)
    backend.copy(dst, np.array([1, 2, 3]))
    np.testing.assert_array_equal(dst, [1, 2, 3])
    raw = backend.comm_view(dst)
    assert raw.dtype == np.uint8 and raw.nbytes == dst.nbytes and np.shares_memory(raw, dst)
    assert backend.synchronize() is None


# --- all_reduce on one process (COMM_SELF) ----------------------------------------------


@pytest.fixture
def self_comm():
    MPI = pytest.importorskip("mpi4py.MPI")
    return MPI.COMM_SELF


@pytest.mark.parametrize("spec", ["xring", "rechd", "pscpu", "native", "pscpu/pscpu"])
def test_all_reduce_on_one_process(self_comm, spec):
    from mpistrat import all_reduce

    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    b = a * 10
    before = a.copy()
    out = all_reduce(a, "sum", spec, self_comm)
    assert out is not a and not np.shares_memory(out, a)
    assert out.dtype == np.int32 and out.shape == (2, 3)
    np.testing.assert_array_equal(out, a)
    np.testing.assert_array_equal(a, before)
    # two local replicas
    s, _ = all_reduce(PerReplica([a, b]), "sum", spec, self_comm)
    np.testing.assert_array_equal(s, a + b)
    mean = all_reduce(PerReplica([a, b]), "mean", spec, self_comm)
    assert isinstance(mean, list) and len(mean) == 2
    for r in mean:
        assert r.dtype == np.float64
        np.testing.assert_array_equal(r, (a + b) / 2)
    assert not np.shares_memory(mean[0], mean[1])
    lo = all_reduce(PerReplica([a, b]), "min", spec, self_comm)[1]
    np.testing.assert_array_equal(lo, np.minimum(a, b))
    # in place
    x, y = a.astype(np.float64), b.astype(np.float64)
    got = all_reduce(PerReplica([x, y]), "max", spec, self_comm, inplace=True)
    assert got[0] is x and got[1] is y
    np.testing.assert_array_equal(x, b)
    np.testing.assert_array_equal(y, b)


@pytest.mark.parametrize(
    ("valid", "invalid"),
    [(("xring", 1), ("xring", True)), (("pscpu", 1, -1), ("pscpu", 1.0, -1))],
)
def test_invalid_spec_rejected_after_an_equal_valid_one(self_comm, valid, invalid):
    from mpistrat import all_reduce, parse_spec

    with pytest.raises(SpecTypeError):
        parse_spec(invalid)  # the parser rejects it ...
    x = np.ones(3)
    all_reduce(x, spec=valid, comm=self_comm)
    with pytest.raises(SpecTypeError):  # ... and so must all_reduce, whatever came before
        all_reduce(x, spec=invalid, comm=self_comm)


def test_numpy_copy_many_and_copy_pieces():
    """The host side of the batched copies (one launch on a GPU): every pair, every piece
    where it belongs, empty pieces and non-contiguous targets included."""
    backend = NumpyBackend()
    srcs = [np.arange(n, dtype=np.float32) + n for n in (0, 1, 5, 300)]
    dsts = [np.zeros(n, np.float32) for n in (0, 1, 5, 300)]
    strided = np.zeros(10, np.float32)[::2]
    backend.copy_many(dsts + [strided], srcs + [srcs[3][:5]])
    assert all(np.array_equal(d, s) for d, s in zip(dsts, srcs))
    assert np.array_equal(strided, srcs[3][:5])
    out = np.full(12, -1, np.float32)
    backend.copy_pieces(out, [(srcs[2], 1, 4, 0), (srcs[0], 0, 0, 3), (srcs[3], 290, 298, 3)])
    assert np.array_equal(out[:11], np.concatenate([srcs[2][1:4], srcs[3][290:298]]))
    assert out[11] == -1
