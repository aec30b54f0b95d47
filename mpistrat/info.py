"""Describe the MPI/GPU environment of a job: what ``mpistrat info`` reports.

:func:`collect_info` is collective: every rank probes itself (host, node group, GPUs,
CuPy, NCCL, CUDA-aware MPI) and the records are gathered, so rank 0 can print one
table for the whole job.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

from . import __version__
from ._mpi import mpi, world
from .backends.capabilities import cuda_aware_mpi, mpi_library_path, probe_gpus
from .launch.env import detect
from .topology import get_topology

__all__ = ["collect_info"]

_THREAD_LEVELS = ("single", "funneled", "serialized", "multiple")


def _rank_record(topology: Any, MPI: Any, gpus: bool) -> dict[str, Any]:
    probe = probe_gpus() if gpus else None
    return {
        "rank": topology.rank,
        "host": topology.hostnames[topology.rank],
        "pid": os.getpid(),
        "node": topology.node,
        "local_rank": topology.local_rank,
        "local_size": topology.local_size,
        "leader": topology.is_leader,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "gpus": [list(d) for d in probe.devices] if probe else [],
        "cupy": probe.cupy if probe else None,
        "nccl": probe.nccl if probe else None,
        "gpu_note": (probe.reason if probe else "GPU probe skipped (--no-gpu)"),
        "cuda_aware_mpi": cuda_aware_mpi(MPI),
    }


def collect_info(comm: Any = None, gpus: bool = True) -> dict[str, Any]:
    """Gather a description of the job (collective over ``comm``).

    Args:
        comm: the communicator to describe (default ``COMM_WORLD``).
        gpus: probe CuPy and CUDA devices on every rank (imports CuPy when installed).

    Returns:
        A JSON-ready dict, the same on every rank: versions, the MPI library, the
        launcher, node groups and one record per rank under ``"ranks"``.
    """
    import mpi4py

    MPI = mpi()
    comm = world() if comm is None else comm
    topology = get_topology(comm)
    records = comm.allgather(_rank_record(topology, MPI, gpus))
    launch = detect()
    vendor, vendor_version = MPI.get_vendor()
    major, minor = MPI.Get_version()
    warnings = []
    mismatch = launch.mismatch(topology.size)
    if mismatch:
        warnings.append(mismatch)
    return {
        "mpistrat": __version__,
        "python": platform.python_version(),
        "executable": sys.executable,
        "mpi4py": mpi4py.__version__,
        "mpi": {
            "vendor": f"{vendor} {'.'.join(map(str, vendor_version))}",
            "library_version": " ".join(MPI.Get_library_version().split("\n", 1)[0].split()),
            "standard": f"{major}.{minor}",
            "library_path": mpi_library_path(),
            "thread_level": _THREAD_LEVELS[MPI.Query_thread()]
            if 0 <= MPI.Query_thread() < len(_THREAD_LEVELS) else str(MPI.Query_thread()),
        },
        "launcher": {"name": launch.launcher, "size": launch.size},
        "world_size": topology.size,
        "nodes": topology.num_nodes,
        "ranks_per_node": [len(r) for r in topology.node_ranks],
        "virtual_ranks_per_node": topology.ranks_per_node,
        "ranks": records,
        "warnings": warnings,
    }
