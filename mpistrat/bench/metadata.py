"""What a benchmark result needs to be read later: the machine, the MPI library, the job's
shape, the versions and the options (stored in the JSON and CSV files)."""

from __future__ import annotations

import datetime
import os
import platform
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["collect", "git_state"]


def git_state(repo: Path) -> dict[str, Any]:
    """The commit and dirtiness of the checkout at ``repo`` (empty when it is none)."""
    if not (repo / ".git").exists():
        return {}
    state: dict[str, Any] = {}
    try:
        state["commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
            timeout=10).stdout.strip() or None
        state["dirty"] = bool(subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
            capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return state


def collect(comm: Any, options: Mapping[str, Any], *, ranks_per_node: int | None = None,
            mpi_env: Mapping[str, str] | None = None,
            notes: list[str] | None = None) -> dict[str, Any]:
    """Describe the run (collective over ``comm``; the result is complete on rank 0,
    an empty dict elsewhere).

    Args:
        comm: the benchmark's communicator.
        options: the run's options, stored as given.
        ranks_per_node: the virtual node size in force (None: physical nodes).
        mpi_env: MPI settings the run set through the environment (transport knobs).
        notes: remarks printed with the results.
    """
    import mpi4py
    import numpy as np

    import mpistrat

    from ..info import collect_info
    from ..launch.hugepages import thp_mode
    from ..topology import get_topology

    info = collect_info(comm, gpus=False)
    topology = get_topology(comm, ranks_per_node)
    if comm.Get_rank() != 0:
        return {}
    return {
        "tool": "mpistrat bench",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "hosts": sorted({r["host"] for r in info["ranks"]}),
        "hostnames_by_rank": [r["host"] for r in info["ranks"]],
        "ranks": comm.Get_size(),
        "nodes": topology.num_nodes,
        "ranks_per_node": [len(r) for r in topology.node_ranks],
        "physical_nodes": info["nodes"],
        "virtual_ranks_per_node": topology.ranks_per_node,
        "cpus": os.cpu_count(),
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "mpi_library": info["mpi"]["library_version"],
        "mpi_vendor": info["mpi"]["vendor"],
        "mpi_standard": info["mpi"]["standard"],
        "mpi4py": mpi4py.__version__,
        "numpy": np.__version__,
        "mpistrat": mpistrat.__version__,
        "git": git_state(Path(mpistrat.__file__).resolve().parent.parent),
        "argv": list(sys.argv),
        "mpi_env": dict(mpi_env or {}),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
        "thp_mode": thp_mode(),
        "notes": list(notes or []),
        "options": dict(options),
        "method": "per size: one checked iteration per entry against MPI_Allreduce; "
                  "warm-up rounds; timed rounds (each entry once per round, start "
                  "rotating); iteration = Barrier, Wtime, all-reduce, Wtime; buffers "
                  "refilled from a pristine copy before every iteration (untimed); "
                  "sample = max over ranks; time = median of samples; algbw = bytes / "
                  "time; busbw = algbw * 2(n-1)/n, n = ranks x replicas; GB = 1e9 B",
    }
