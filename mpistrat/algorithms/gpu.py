"""The GPU algorithms: ``nccl`` (NCCL through CuPy) and ``psgpu`` (the shuffle with its
gather shards reduced on GPUs), as :class:`~.hierarchical.Implementation` objects.

:func:`implementation` checks what the algorithm needs — CuPy, a visible CUDA device and,
for ``nccl``, NCCL in CuPy — and raises :class:`~mpistrat.errors.BackendUnavailable`
naming what is missing. It is the seam ``mpistrat.algorithms._gpu_implementation``.
"""

from __future__ import annotations

import functools
from typing import Any

from ..backends.capabilities import probe_gpus
from ..errors import BackendUnavailable
from . import nccl, shuffle
from .hierarchical import Implementation

__all__ = ["implementation"]

_IMPLEMENTATIONS = {
    # NCCL inside a node group: reduce onto the leader, NCCL broadcast back (nccl/<b>)
    "nccl": Implementation(nccl.all_reduce, nccl.reduce_to_root, broadcast=nccl.broadcast),
    # the shuffle on CuPy buffers: pieces added on the gather ranks' GPUs
    "psgpu": Implementation(shuffle.all_reduce, shuffle.reduce_to_root),
}


@functools.lru_cache(maxsize=1)
def _probe() -> Any:
    """What CuPy sees, probed once per process (run() asks on every call)."""
    return probe_gpus()


def implementation(name: str) -> Implementation:
    """The implementation of GPU algorithm ``name`` ('nccl' or 'psgpu').

    Raises:
        BackendUnavailable: CuPy, a CUDA device, or (for 'nccl') NCCL is missing.
        KeyError: ``name`` is not a GPU algorithm.
    """
    if name not in _IMPLEMENTATIONS:
        raise KeyError(f"{name!r} is not a GPU algorithm; expected one of "
                       f"{sorted(_IMPLEMENTATIONS)}")
    probe = _probe()
    if probe.cupy is None or not probe.devices:
        raise BackendUnavailable(
            f"algorithm {name!r} needs a CUDA GPU through CuPy: {probe.reason}; use a CPU "
            f"algorithm ('xring', 'rechd', 'pscpu', 'pscpu/pscpu') on host buffers")
    if name == "nccl" and probe.nccl is None:
        raise BackendUnavailable(
            f"algorithm 'nccl' needs NCCL through cupy.cuda.nccl: {probe.reason or 'missing'}; "
            f"use 'psgpu' or 'xring' on GPU buffers")
    return _IMPLEMENTATIONS[name]
