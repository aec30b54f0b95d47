"""``mpistrat info``: the MPI/GPU environment of a job, one table for all ranks."""

from __future__ import annotations

import json
from typing import Any

import click

from ..runtime._mpi import world
from ._table import format_table

__all__ = ["info", "render_info"]


def _or_dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _yes_no(value: Any) -> str:
    return {True: "yes", False: "no", None: "unknown"}.get(value, str(value))


def _spans(values: list[int], sep: str) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2" + sep + "5"``: runs of consecutive numbers joined."""
    runs: list[list[int]] = []
    for value in values:
        if runs and value == runs[-1][1] + 1:
            runs[-1][1] = value
        else:
            runs.append([value, value])
    return sep.join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _cpu_list(cpus: list[int] | None) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    return _spans(cpus, ",") if cpus else "?"


def _slurm_line(slurm: dict[str, Any]) -> str:
    job = f"job {slurm['job_id']}"
    if slurm["job_name"]:
        job += f" '{slurm['job_name']}'"
    details = [f"{key} {slurm[field]}" for key, field in
               (("partition", "partition"), ("cluster", "cluster"), ("nodes", "job_nodelist"))
               if slurm[field]]
    if slurm["restart_count"]:
        details.append(f"restart {slurm['restart_count']}")
    line = f"slurm        {', '.join([job] + details)}"
    if slurm["step_id"] is not None:
        tasks = f", {slurm['step_tasks']} task(s)" if slurm["step_tasks"] is not None else ""
        mpi = f", srun --mpi={slurm['mpi_type']}" if slurm["mpi_type"] else ""
        line += f"; step {slurm['job_id']}.{slurm['step_id']}{tasks}{mpi}"
    return line


def _mapping_lines(data: dict[str, Any]) -> list[str]:
    """The rank -> GPU mapping (``uses`` column in full), or why ranks have no GPU."""
    ranks = [r for r in data["ranks"] if "assigned_gpus" in r]
    if not ranks:
        return []
    g = data.get("gpus_per_rank", 1)
    if all(r["assigned_gpus"] is None for r in ranks):
        reasons = sorted({r["assignment_note"] for r in ranks})
        return [f"GPU mapping  none: {'; '.join(reasons)}"]
    lines = [f"GPU mapping  {g} GPU(s) per rank (CUDA ordinal, physical GPU):"]
    for r in ranks:
        if r["assigned_gpus"] is None:
            lines.append(f"  rank {r['rank']}: none: {r['assignment_note']}")
        else:
            used = ", ".join(f"{o} ({p})" for o, p in r["assigned_gpus"])
            lines.append(f"  rank {r['rank']}: {used}")
    return lines


def _rank_list(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    return _spans(ranks, ", ")


def render_info(data: dict[str, Any]) -> str:
    """The human form of :func:`mpistrat.info.collect_info`'s result.

    Inside a Slurm job a ``slurm`` line names the job and step, and the table gains
    what Slurm gave each rank: its node, ``SLURM_PROCID``, ``SLURM_LOCALID``, the CPUs
    it may run on and the GPU ids Slurm allocated to it.
    """
    mpi = data["mpi"]
    launcher = data["launcher"]
    virtual = data["virtual_ranks_per_node"]
    grouping = (f"virtual nodes of {virtual} rank(s) (MPISTRAT_RANKS_PER_NODE)"
                if virtual else "physical nodes (Split_type COMM_TYPE_SHARED)")
    lines = [
        f"mpistrat {data['mpistrat']}  |  Python {data['python']}  |  mpi4py {data['mpi4py']}",
        f"MPI library  {mpi['vendor']}, MPI standard {mpi['standard']}, thread level "
        f"{mpi['thread_level']}",
        f"             {mpi['library_version']}",
        f"             {mpi['library_path'] or 'library path unknown'}",
        "launcher     " + (f"{launcher['name']}, {launcher['size']} process(es)"
                           if launcher["name"] else "none detected (singleton)"),
        f"world        {data['world_size']} rank(s) on {data['nodes']} node group(s), "
        f"{grouping}; ranks per node: {' + '.join(map(str, data['ranks_per_node']))}",
    ]
    hosts = data.get("hosts") or []
    lines.append(f"hosts        {len(hosts)} host(s)")
    for record in hosts:
        groups = ", ".join(map(str, record["nodes"]))
        lines.append(f"  {record['host']:<10} ranks {_rank_list(record['ranks'])}"
                     f"  (node group{'s' if len(record['nodes']) > 1 else ''} {groups})")
    slurm = data.get("slurm")
    if slurm:
        lines.append(_slurm_line(slurm))
    lines.append("")
    rows: list[tuple[Any, ...]] = []
    for r in data["ranks"]:
        gpus = ", ".join(f"{i}:{name}" for i, name in r["gpus"]) or "none"
        uses = ",".join(str(o) for o, _ in r.get("assigned_gpus") or []) or "-"
        rows.append((
            r["rank"], r["host"], r["node"], f"{r['local_rank']}/{r['local_size']}",
            "yes" if r["leader"] else "", r["pid"], r["cuda_visible_devices"] or "-", gpus,
            uses, r["cupy"] or "no", r["nccl"] or "no", _yes_no(r["cuda_aware_mpi"]),
        ))
        task = r.get("slurm")
        if slurm:
            rows[-1] += ((task["node"] or "?", _or_dash(task["procid"]), _or_dash(task["localid"]),
                          _cpu_list(task["cpus"]), task["gpus"] or "-") if task else
                         ("-",) * 5)
    headers = ["rank", "host", "node", "local", "leader", "pid", "CUDA_VISIBLE_DEVICES", "GPUs",
               "uses", "CuPy", "NCCL", "CUDA-aware MPI"]
    if slurm:
        headers += ["Slurm node", "SLURM_PROCID", "SLURM_LOCALID", "CPUs", "Slurm GPUs"]
    lines.append(format_table(headers, rows))
    lines += _mapping_lines(data)
    notes = sorted({r["gpu_note"] for r in data["ranks"] if r["gpu_note"]})
    for note in notes + data.get("notes", []):
        lines.append(f"note: {note}")
    for warning in data["warnings"]:
        lines.append(f"warning: {warning}")
    return "\n".join(lines)


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the description as JSON.")
@click.option("--no-gpu", is_flag=True, help="Do not probe CuPy or CUDA devices.")
@click.option("--gpus-per-rank", type=click.IntRange(min=1), default=1, show_default=True,
              metavar="G", help="GPUs each rank would own, for the rank -> GPU mapping.")
def info(as_json, no_gpu, gpus_per_rank):
    """Describe the MPI and GPU environment of every rank.

    Run it under the launcher to see the whole job; rank 0 prints one table.
    The "uses" column and the GPU mapping show the CUDA devices each rank would use
    with --gpus-per-rank G (from CUDA_VISIBLE_DEVICES and its local rank), or why it
    has none. Inside a Slurm job it also shows what Slurm gave each rank (node,
    SLURM_PROCID, SLURM_LOCALID, CPUs, GPUs):

    \b
      mpiexec -n 4 mpistrat info
      MPISTRAT_RANKS_PER_NODE=2 mpiexec -n 4 mpistrat info --json
      srun --mpi=pmi2 -n 4 mpistrat info
    """
    # here, not at the top: only this command needs it (start-up time)
    from ..info import collect_info

    data = collect_info(gpus=not no_gpu, gpus_per_rank=gpus_per_rank)
    if world().Get_rank() == 0:
        click.echo(json.dumps(data, indent=2) if as_json else render_info(data))
