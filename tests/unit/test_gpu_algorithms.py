"""The GPU algorithms without CuPy: a clear BackendUnavailable naming what is missing."""

from __future__ import annotations

import importlib.util

import pytest

from mpistrat import dispatch
from mpistrat.errors import BackendUnavailable

HAVE_CUPY = importlib.util.find_spec("cupy") is not None


@pytest.mark.skipif(HAVE_CUPY, reason="checks the error raised without CuPy")
@pytest.mark.parametrize("name", ["nccl", "psgpu"])
def test_without_cupy(name):
    with pytest.raises(BackendUnavailable) as info:
        dispatch.implementation(name)
    text = str(info.value)
    assert f"algorithm {name!r} needs a CUDA GPU through CuPy" in text
    assert "CuPy is not installed (pip install 'mpistrat[gpu]')" in text and "'xring'" in text


def test_every_flat_name_has_code_and_no_code_lacks_a_name():
    from mpistrat import algorithms

    flat = {n for n in algorithms.names() if not algorithms.get(n).hierarchical}
    assert set(dispatch.IMPLEMENTATIONS) == flat
    assert {"nccl", "psgpu"} < flat


def test_a_hierarchical_name_cannot_be_registered_with_code_of_its_own():
    info = dispatch.get("pscpu/pscpu")
    with pytest.raises(ValueError, match="'pscpu/pscpu' is hierarchical"):
        dispatch.register(info, dispatch.IMPLEMENTATIONS["pscpu"])


def test_nccl_refuses_host_buffers():
    import numpy as np

    from mpistrat import ReduceOp
    from mpistrat.algorithms import nccl
    from mpistrat.backends import get_backend

    buf = np.zeros(3)
    with pytest.raises(BackendUnavailable, match="runs on CuPy device buffers, got numpy"):
        nccl.all_reduce(None, buf, op=ReduceOp.SUM, backend=get_backend(buf))
