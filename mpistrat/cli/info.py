"""``mpistrat info``: the MPI/GPU environment of a job, one table for all ranks."""

from __future__ import annotations

import json
from typing import Any

import click

from ._table import format_table

__all__ = ["info", "render_info"]


def _yes_no(value: Any) -> str:
    return {True: "yes", False: "no", None: "unknown"}.get(value, str(value))


def render_info(data: dict[str, Any]) -> str:
    """The human form of :func:`mpistrat.info.collect_info`'s result."""
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
        "",
    ]
    rows = []
    for r in data["ranks"]:
        gpus = ", ".join(f"{i}:{name}" for i, name in r["gpus"]) or "none"
        rows.append((
            r["rank"], r["host"], r["node"], f"{r['local_rank']}/{r['local_size']}",
            "yes" if r["leader"] else "", r["pid"], r["cuda_visible_devices"] or "-", gpus,
            r["cupy"] or "no", r["nccl"] or "no", _yes_no(r["cuda_aware_mpi"]),
        ))
    lines.append(format_table(
        ["rank", "host", "node", "local", "leader", "pid", "CUDA_VISIBLE_DEVICES", "GPUs",
         "CuPy", "NCCL", "CUDA-aware MPI"], rows))
    notes = sorted({r["gpu_note"] for r in data["ranks"] if r["gpu_note"]})
    for note in notes:
        lines.append(f"note: {note}")
    for warning in data["warnings"]:
        lines.append(f"warning: {warning}")
    return "\n".join(lines)


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the description as JSON.")
@click.option("--no-gpu", is_flag=True, help="Do not probe CuPy or CUDA devices.")
def info(as_json, no_gpu):
    """Describe the MPI and GPU environment of every rank.

    Run it under the launcher to see the whole job; rank 0 prints one table:

    \b
      mpiexec -n 4 mpistrat info
      MPISTRAT_RANKS_PER_NODE=2 mpiexec -n 4 mpistrat info --json
    """
    from ..info import collect_info
    from .._mpi import world

    data = collect_info(gpus=not no_gpu)
    if world().Get_rank() == 0:
        click.echo(json.dumps(data, indent=2) if as_json else render_info(data))
