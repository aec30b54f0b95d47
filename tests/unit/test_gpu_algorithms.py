"""The GPU algorithm table without CuPy: a clear BackendUnavailable naming what is missing."""

from __future__ import annotations

import importlib.util

import pytest

from mpistrat.algorithms import gpu
from mpistrat.errors import BackendUnavailable

HAVE_CUPY = importlib.util.find_spec("cupy") is not None


@pytest.mark.skipif(HAVE_CUPY, reason="checks the error raised without CuPy")
@pytest.mark.parametrize("name", ["nccl", "psgpu"])
def test_without_cupy(name):
    with pytest.raises(BackendUnavailable) as info:
        gpu.implementation(name)
    text = str(info.value)
    assert f"algorithm {name!r} needs a CUDA GPU through CuPy" in text
    assert "CuPy is not installed (pip install 'mpistrat[gpu]')" in text and "'xring'" in text


def test_unknown_name():
    with pytest.raises(KeyError, match="'xring' is not a GPU algorithm"):
        gpu.implementation("xring")


def test_nccl_refuses_host_buffers():
    import numpy as np

    from mpistrat import ReduceOp
    from mpistrat.algorithms import nccl
    from mpistrat.backends import get_backend

    buf = np.zeros(3)
    with pytest.raises(BackendUnavailable, match="runs on CuPy device buffers, got numpy"):
        nccl.all_reduce(None, buf, op=ReduceOp.SUM, backend=get_backend(buf))
