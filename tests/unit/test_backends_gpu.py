"""Backend dispatch for device arrays, without CuPy: small fakes exposing the CUDA protocols
get a clear BackendUnavailable; host arrays never import CuPy."""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest

from mpistrat.backends import NumpyBackend, as_array, get_backend, is_cuda_array
from mpistrat.errors import BackendUnavailable

HAVE_CUPY = importlib.util.find_spec("cupy") is not None
needs_no_cupy = pytest.mark.skipif(HAVE_CUPY, reason="checks the error raised without CuPy")


class CudaInterfaceTensor:
    """Like a PyTorch CUDA tensor: exposes __cuda_array_interface__."""

    @property
    def __cuda_array_interface__(self):
        return {"shape": (4,), "typestr": "<f4", "data": (0x7F0000000000, False), "version": 3}


class CpuTensor:
    """Like a PyTorch CPU tensor: the CUDA interface property raises."""

    @property
    def __cuda_array_interface__(self):
        raise AttributeError("can't get __cuda_array_interface__ on a CPU tensor")


class DLPackArray:
    def __init__(self, device_type):
        self.device_type = device_type

    def __dlpack__(self, stream=None):
        raise AssertionError("must not be exported when CuPy is missing")

    def __dlpack_device__(self):
        return (self.device_type, 0)


def test_is_cuda_array():
    assert is_cuda_array(CudaInterfaceTensor()) == "__cuda_array_interface__"
    assert is_cuda_array(DLPackArray(2)) == "dlpack"
    assert is_cuda_array(DLPackArray(13)) == "dlpack"
    assert is_cuda_array(DLPackArray(1)) is None  # kDLCPU
    assert is_cuda_array(DLPackArray(3)) is None  # kDLCUDAHost: pinned host memory
    assert is_cuda_array(CpuTensor()) is None
    assert is_cuda_array(np.zeros(3)) is None


def test_host_arrays_stay_on_numpy_without_cupy():
    before = "cupy" in sys.modules
    backend, array = as_array(np.arange(3.0))
    assert isinstance(backend, NumpyBackend) and array.dtype == np.float64
    assert ("cupy" in sys.modules) == before


@needs_no_cupy
@pytest.mark.parametrize(("value", "how"), [
    (CudaInterfaceTensor(), "__cuda_array_interface__"), (DLPackArray(2), "dlpack")])
def test_cuda_array_without_cupy_says_how_to_install(value, how):
    for call in (get_backend, as_array):
        with pytest.raises(BackendUnavailable) as info:
            call(value)
        text = str(info.value)
        assert f"CUDA device array ({how})" in text and "CuPy, which is not installed" in text
        assert "pip install 'mpistrat[gpu]'" in text and type(value).__name__ in text


def test_a_broken_cupy_install_is_backend_unavailable(monkeypatch):
    """CuPy present but failing to import (e.g. its CUDA libraries missing): the backend,
    which is where CuPy is imported, gives BackendUnavailable with the fix, not the
    ImportError."""
    import importlib.machinery

    import mpistrat.backends as backends

    class BrokenCupy:
        def find_spec(self, name, path=None, target=None):
            if name == "cupy":
                return importlib.machinery.ModuleSpec("cupy", self)
            return None

        def create_module(self, spec):
            raise ImportError("libcudart.so.12: cannot open shared object file")

        def exec_module(self, module):
            raise AssertionError("never reached")

    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    monkeypatch.setattr(sys, "meta_path", [BrokenCupy(), *sys.meta_path])
    monkeypatch.setattr(backends, "_CUPY", {})
    with pytest.raises(BackendUnavailable) as info:
        get_backend(DLPackArray(2))
    text = str(info.value)
    assert "CuPy failed to import (libcudart.so.12" in text
    assert "pip install 'mpistrat[gpu]'" in text


def test_unknown_objects_are_type_errors():
    for value in (CpuTensor(), DLPackArray(1), object(), [1.0, 2.0]):
        with pytest.raises(TypeError, match="__cuda_array_interface__ or DLPack"):
            get_backend(value)


def test_backend_unavailable_is_not_a_type_error():
    """Callers that catch TypeError for 'not an array' must not swallow a missing CuPy."""
    assert not issubclass(BackendUnavailable, TypeError)


# --- CUDA-aware MPI: forced or detected ----------------------------------------------------


class _UninitialisedMPI:
    @staticmethod
    def Is_initialized():
        return False


@pytest.mark.parametrize(("forced", "direct", "why"), [
    (True, True, "MPISTRAT_CUDA_AWARE_MPI=1"), (False, False, "MPISTRAT_CUDA_AWARE_MPI=0"),
    (None, False, "cannot tell"),
])
def test_cuda_aware_choice(forced, direct, why):
    from mpistrat.backends.capabilities import cuda_aware_choice

    got, reason = cuda_aware_choice(_UninitialisedMPI, forced)
    assert got is direct and why in reason
