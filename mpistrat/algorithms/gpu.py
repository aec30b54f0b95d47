"""What the GPU algorithms need before they can run: ``nccl`` (NCCL through CuPy) and
``psgpu`` (the shuffle with its gather shards reduced on GPUs).

:func:`require` checks CuPy, a visible CUDA device and, for ``nccl``, NCCL in CuPy, and
raises :class:`~mpistrat.errors.BackendUnavailable` naming what is missing;
:func:`mpistrat.dispatch.implementation` asks it before handing out a GPU algorithm.
"""

from __future__ import annotations

import functools
from typing import Any

from ..backends.capabilities import probe_gpus
from ..errors import BackendUnavailable

__all__ = ["require"]


@functools.lru_cache(maxsize=1)
def _probe() -> Any:
    """What CuPy sees, probed once per process (every dispatch asks)."""
    return probe_gpus()


def require(name: str) -> None:
    """Raise :class:`BackendUnavailable` unless GPU algorithm ``name`` can run here.

    Raises:
        BackendUnavailable: CuPy, a CUDA device, or (for 'nccl') NCCL is missing.
    """
    probe = _probe()
    if probe.cupy is None or not probe.devices:
        raise BackendUnavailable(
            f"algorithm {name!r} needs a CUDA GPU through CuPy: {probe.reason}; use a CPU "
            f"algorithm ('xring', 'rechd', 'pscpu', 'pscpu/pscpu') on host buffers")
    if name == "nccl" and probe.nccl is None:
        raise BackendUnavailable(
            f"algorithm 'nccl' needs NCCL through cupy.cuda.nccl: {probe.reason or 'missing'}; "
            f"use 'psgpu' or 'xring' on GPU buffers")
