"""What a benchmark result needs to be read later: the machine, the MPI library, the job's
shape, the versions and the options (stored in the JSON and CSV files)."""

from __future__ import annotations

import datetime
import os
import platform
import re
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mpi4py
import numpy as np

from .. import __version__
from ..info import collect_info
from ..launch.hugepages import thp_mode
from ..runtime._mpi import Comm
from ..runtime.topology import get_topology

__all__ = ["collect", "git_state", "network", "parse_rate", "hosts_layout", "LINK_RATE",
           "LINK_MTU"]

LINK_RATE = "MPISTRAT_LINK_RATE"  # the rate of each host's link, as tc writes it (1gbit)
LINK_MTU = "MPISTRAT_LINK_MTU"  # the links' MTU in bytes (1500, or 9000 for jumbo frames)
# the MPI settings that decide which path bytes between hosts take (recorded when set)
_TRANSPORT_VARS = ("MPIR_CVAR_CH4_NETMOD", "FI_PROVIDER", "MPIR_CVAR_NOLOCAL",
                   "UCX_TLS", "OMPI_MCA_pml", "OMPI_MCA_btl")
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}


def parse_rate(text: str | None) -> float | None:
    """Bits per second of a rate written as tc writes it (``1gbit``, ``500mbit``,
    ``100mbps`` = bytes), or None when it is missing or not a rate."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-z]+)\s*", (text or "").lower())
    if not match or match.group(2) not in _RATE_UNITS:
        return None
    return float(match.group(1)) * _RATE_UNITS[match.group(2)]


def network(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What is known of the links between hosts: the rate from ``MPISTRAT_LINK_RATE``
    and the MTU from ``MPISTRAT_LINK_MTU`` (set them where the launcher cannot know them;
    ``bin/cluster-local env`` prints both) and the MPI transport variables in force."""
    env = os.environ if env is None else env
    rate = env.get(LINK_RATE) or None
    mtu = (env.get(LINK_MTU) or "").strip()
    return {"link_rate": rate, "link_bits_per_s": parse_rate(rate),
            "link_rate_from": LINK_RATE if rate else None,
            "link_mtu": int(mtu) if mtu.isdigit() else None,
            "transport": {k: env[k] for k in _TRANSPORT_VARS if k in env}}


def hosts_layout(hostnames_by_rank: list[str]) -> dict[str, Any]:
    """Hosts in order of their first rank, with how many ranks each ran and which
    ranks (the cost model's layout: which ranks share a host's link)."""
    index: dict[str, int] = {}
    host_of_rank = [index.setdefault(h, len(index)) for h in hostnames_by_rank]
    return {"count": len(index), "names": list(index),
            "ranks_per_host": [host_of_rank.count(i) for i in range(len(index))],
            "host_of_rank": host_of_rank}


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


def collect(comm: Comm, options: Mapping[str, Any], *, ranks_per_node: int | None = None,
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
        "host_layout": hosts_layout([r["host"] for r in info["ranks"]]),
        "network": network(),
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
        "mpistrat": __version__,
        "git": git_state(Path(__file__).resolve().parents[2]),
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
