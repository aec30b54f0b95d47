"""Describe the MPI/GPU environment of a job: what ``mpistrat info`` reports.

:func:`collect_info` is collective: every rank probes itself (host, node group, GPUs
and which of them it would use, CuPy, NCCL, CUDA-aware MPI and, inside a Slurm job, what
Slurm gave it) and the records are gathered, so rank 0 can print one table for the whole
job.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import mpi4py

from . import __version__
from .backends.capabilities import cuda_aware_mpi, mpi_library_path, probe_gpus
from .errors import TopologyError
from .launch.env import detect
from .runtime._mpi import Comm, mpi, world
from .runtime.devices import assign_devices, duplicate_devices
from .runtime.topology import get_topology

__all__ = ["collect_info", "slurm_task", "slurm_job", "gpu_mapping"]

_THREAD_LEVELS = ("single", "funneled", "serialized", "multiple")


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _cpus() -> list[int] | None:
    getaffinity = getattr(os, "sched_getaffinity", None)
    return sorted(getaffinity(0)) if getaffinity else None


def slurm_task(env: Mapping[str, str], cpus: list[int] | None = None) -> dict[str, Any] | None:
    """What Slurm gave this process, from its ``SLURM_*`` variables.

    Args:
        env: the process environment.
        cpus: the CPUs this process may run on (its affinity, which Slurm's task
            binding sets), when known.

    Returns:
        None outside a Slurm job (no ``SLURM_JOB_ID``); otherwise a JSON-ready dict:
        the job and step, the node (``SLURMD_NODENAME``), ``SLURM_PROCID`` /
        ``SLURM_LOCALID`` / ``SLURM_NODEID``, the step's task count, the CPUs, and the
        GPUs (``SLURM_STEP_GPUS``, else ``SLURM_JOB_GPUS``: the GPU ids Slurm allocated
        on this node, which ``CUDA_VISIBLE_DEVICES`` then narrows or renumbers).
    """
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id:
        return None
    return {
        "job_id": job_id,
        "job_name": env.get("SLURM_JOB_NAME"),
        "partition": env.get("SLURM_JOB_PARTITION"),
        "cluster": env.get("SLURM_CLUSTER_NAME"),
        "job_nodelist": env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST"),
        "restart_count": _int_or_none(env.get("SLURM_RESTART_COUNT")) or 0,
        "step_id": env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID"),
        "step_tasks": _int_or_none(env.get("SLURM_STEP_NUM_TASKS")),
        "mpi_type": env.get("SLURM_MPI_TYPE"),
        "node": env.get("SLURMD_NODENAME"),
        "procid": _int_or_none(env.get("SLURM_PROCID")),
        "localid": _int_or_none(env.get("SLURM_LOCALID")),
        "nodeid": _int_or_none(env.get("SLURM_NODEID")),
        "cpus": cpus,
        "cpus_per_task": _int_or_none(env.get("SLURM_CPUS_PER_TASK")),
        "gpus": env.get("SLURM_STEP_GPUS") or env.get("SLURM_JOB_GPUS"),
        "gpus_on_node": _int_or_none(env.get("SLURM_GPUS_ON_NODE")),
    }


def slurm_job(tasks: list[dict[str, Any] | None], world_size: int) -> tuple[
        dict[str, Any] | None, list[str]]:
    """The job-wide part of the ranks' :func:`slurm_task` records, and notes about them.

    Returns:
        ``(summary, notes)``: the summary is None when no rank runs in a Slurm job. A
        note says when the Slurm step's tasks are not the MPI ranks (``mpiexec`` inside
        an allocation starts the ranks from one proxy task per node, so ``SLURM_PROCID``
        and ``SLURM_LOCALID`` describe the proxies).
    """
    present = [t for t in tasks if t is not None]
    if not present:
        return None, []
    first = present[0]
    keys = ("job_id", "job_name", "partition", "cluster", "job_nodelist", "restart_count",
            "step_id", "step_tasks", "mpi_type")
    summary = {key: first[key] for key in keys}
    notes = []
    if len(present) < len(tasks):
        notes.append(f"only {len(present)} of {len(tasks)} rank(s) run inside a Slurm job")
    if len({t["job_id"] for t in present}) > 1:
        notes.append("the ranks run in different Slurm jobs: "
                     + ", ".join(sorted({t["job_id"] for t in present})))
    step_tasks = first["step_tasks"]
    if step_tasks is not None and step_tasks != world_size:
        notes.append(
            f"Slurm step {first['job_id']}.{first['step_id']} has {step_tasks} task(s) for "
            f"{world_size} MPI rank(s): the ranks were not started by srun as its tasks "
            f"(mpiexec inside the allocation starts them from one proxy task per node), so "
            f"SLURM_PROCID and SLURM_LOCALID describe the launcher's tasks, not the ranks")
    return summary, notes


def gpu_mapping(probe: Any, local_rank: int, local_size: int, gpus_per_rank: int,
                visible: str | None) -> tuple[list[list[Any]] | None, str]:
    """The GPUs :func:`mpistrat.runtime.devices.assign_devices` gives this rank, for the report.

    Returns:
        ``([[ordinal, physical id], ...], "")``, or ``(None, why)`` when the rank gets no
        GPU (no probe, no CuPy, no device, or not enough devices for its share).
    """
    if probe is None:
        return None, "GPU probe skipped (--no-gpu)"
    if not probe.usable:
        return None, f"no GPUs: {probe.reason}"
    try:
        a = assign_devices(local_rank, local_size, gpus_per_rank, visible, len(probe.devices),
                           probe.identities)
    except TopologyError as exc:
        return None, str(exc)
    return [[o, p] for o, p in zip(a.ordinals, a.physical)], ""


def _rank_record(topology: Any, MPI: Any, gpus: bool, env: Mapping[str, str],
                 gpus_per_rank: int = 1) -> dict[str, Any]:
    probe = probe_gpus() if gpus else None
    assigned, why = gpu_mapping(probe, topology.local_rank, topology.local_size,
                                gpus_per_rank, env.get("CUDA_VISIBLE_DEVICES"))
    return {
        "rank": topology.rank,
        "host": topology.hostnames[topology.rank],
        "pid": os.getpid(),
        "node": topology.node,
        "local_rank": topology.local_rank,
        "local_size": topology.local_size,
        "leader": topology.is_leader,
        "cuda_visible_devices": env.get("CUDA_VISIBLE_DEVICES"),
        "gpus": [list(d) for d in probe.devices] if probe else [],
        "cupy": probe.cupy if probe else None,
        "nccl": probe.nccl if probe else None,
        "gpu_note": (probe.reason if probe else "GPU probe skipped (--no-gpu)"),
        "assigned_gpus": assigned,
        "assignment_note": why,
        "cuda_aware_mpi": cuda_aware_mpi(MPI),
        "slurm": slurm_task(env, _cpus()),
    }


def hosts_of(hostnames: Sequence[str], node_of_rank: Sequence[int]) -> list[dict[str, Any]]:
    """One record per host, in order of its first rank: its name, its ranks and the node
    groups they form (one group, unless virtual nodes cut the host)."""
    hosts: dict[str, dict[str, Any]] = {}
    for rank, (host, node) in enumerate(zip(hostnames, node_of_rank)):
        record = hosts.setdefault(host, {"host": host, "ranks": [], "nodes": []})
        record["ranks"].append(rank)
        if node not in record["nodes"]:
            record["nodes"].append(node)
    return list(hosts.values())


def _shared_gpu_notes(records: list[dict[str, Any]]) -> list[str]:
    claims = [(r["host"], [p for _, p in (r["assigned_gpus"] or [])]) for r in records]
    return [
        f"rank(s) {sorted(set(ranks))} on {host} share GPU {gpu}: fine for the MPI "
        f"algorithms (xring, rechd, psgpu), but NCCL ('nccl', 'nccl/...') needs a different "
        f"GPU for every rank"
        for (host, gpu), ranks in sorted(duplicate_devices(claims).items())
    ]


def collect_info(comm: Comm | None = None, gpus: bool = True,
                 env: Mapping[str, str] | None = None,
                 gpus_per_rank: int = 1) -> dict[str, Any]:
    """Gather a description of the job (collective over ``comm``).

    Args:
        comm: the communicator to describe (default ``COMM_WORLD``).
        gpus: probe CuPy and CUDA devices on every rank (imports CuPy when installed).
        env: this rank's environment (default ``os.environ``).
        gpus_per_rank: ``G``, for the rank -> GPU mapping (see :mod:`mpistrat.runtime.devices`).

    Returns:
        A JSON-ready dict, the same on every rank: versions, the MPI library, the
        launcher, node groups, one record per rank under ``"ranks"`` and, inside a
        Slurm job, the job under ``"slurm"`` (None otherwise) with notes under
        ``"notes"``.
    """
    env = os.environ if env is None else env
    MPI = mpi()
    comm = world() if comm is None else comm
    topology = get_topology(comm)
    records = comm.allgather(_rank_record(topology, MPI, gpus, env, gpus_per_rank))
    slurm, notes = slurm_job([r["slurm"] for r in records], topology.size)
    notes = _shared_gpu_notes(records) + notes
    launch = detect(env)
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
        "hosts": hosts_of(topology.hostnames, topology.node_of_rank),
        "gpus_per_rank": gpus_per_rank,
        "slurm": slurm,
        "ranks": records,
        "notes": notes,
        "warnings": warnings,
    }
