"""``mpistrat validate``: parse an all-reduce spec, print its plan, check it against a layout."""

from __future__ import annotations

import json

import click

from .. import algorithms
from ..errors import MpistratError, SpecError
from ..layout import Layout, check_spec
from ..spec import AllReduceSpec, parse_spec
from ._table import format_table

__all__ = ["validate"]


def _shards_text(row) -> str:
    meaning = algorithms.get(row.alg).shards
    if meaning is algorithms.Shards.IGNORED:
        return f"{row.shards} (ignored)" if row.shards != 1 else "1"
    if meaning is algorithms.Shards.PIPELINES:
        return f"{row.shards} pipeline{'s' if row.shards != 1 else ''}"
    return f"{row.shards} gather rank{'s' if row.shards != 1 else ''}"


def _hierarchy_text(row) -> str:
    if not row.hierarchical:
        return "no"
    return f"yes: {row.intra} in node, {row.inter} across nodes"


def render_plan(spec: AllReduceSpec) -> str:
    """The human form of a spec's plan: one row per entry."""
    rows = [
        (row.index, row.range_text, row.alg, _shards_text(row), _hierarchy_text(row))
        for row in spec.plan()
    ]
    table = format_table(["#", "bytes", "algorithm", "shards", "hierarchical"], rows, "  ")
    return (
        f"all-reduce spec {spec}   (comma form: {spec.to_comma_form()})\n\n{table}\n\n"
        f"A tensor of B bytes goes to the first row whose range ends at or above B."
    )


def _layout(workers, gpus_per_worker, local_replicas, nodes) -> Layout | None:
    if workers is None:
        for name, value in (("--gpus-per-worker", gpus_per_worker),
                            ("--local-replicas", local_replicas), ("--nodes", nodes)):
            if value is not None:
                raise click.UsageError(f"{name} needs --workers (the number of ranks)")
        return None
    if gpus_per_worker is not None and local_replicas is not None:
        raise click.UsageError(
            "--gpus-per-worker and --local-replicas exclude each other: a worker has GPUs or "
            "CPU replicas"
        )
    gpus = bool(gpus_per_worker)
    devices = gpus_per_worker if gpus else (local_replicas or 1)
    try:
        return Layout(workers, devices, gpus, nodes if nodes is not None else workers)
    except MpistratError as exc:
        raise click.UsageError(str(exc)) from None


@click.command()
@click.argument("spec", metavar="SPEC")
@click.option("--json", "as_json", is_flag=True, help="Print the plan (and findings) as JSON.")
@click.option("--workers", "-w", type=click.IntRange(min=1), metavar="W",
              help="Check the spec for W workers (MPI ranks).")
@click.option("--gpus-per-worker", "-g", type=click.IntRange(min=0), metavar="G",
              help="GPUs per worker (0: CPU replicas).")
@click.option("--local-replicas", type=click.IntRange(min=1), metavar="K",
              help="CPU replicas per worker when there are no GPUs (default 1).")
@click.option("--nodes", type=click.IntRange(min=1), metavar="N",
              help="Number of nodes the workers are spread over (default: one worker per "
                   "node, as in TensorFlow).")
def validate(spec, as_json, workers, gpus_per_worker, local_replicas, nodes):
    """Parse and check an all-reduce SPEC and print its plan.

    \b
    SPEC forms (limits are bytes; K, M, G, T are powers of two):
      xring                          one algorithm for every size
      nccl#2:1K:pscpu/pscpu#2        alg[#shards][:limit:alg[#shards]]...
      nccl:2:1024,pscpu/pscpu:2:-1   alg:shards:limit,...   (-1: no limit)

    With --workers (and --gpus-per-worker or --local-replicas, --nodes) the spec is also
    checked against that layout: errors (exit status 2) and warnings are reported.
    """
    try:
        parsed = parse_spec(spec)
    except SpecError as exc:
        raise click.BadParameter(
            f"{exc}", param_hint="SPEC"
        ) from None
    layout = _layout(workers, gpus_per_worker, local_replicas, nodes)
    findings = check_spec(parsed, layout) if layout is not None else []
    errors = [f for f in findings if f.level == "error"]
    if as_json:
        click.echo(json.dumps({
            "spec": str(parsed),
            "comma_form": parsed.to_comma_form(),
            "entries": [row.as_dict() for row in parsed.plan()],
            "layout": None if layout is None else {
                "workers": layout.workers, "devices_per_worker": layout.devices_per_worker,
                "gpus": layout.gpus, "nodes": layout.nodes,
            },
            "findings": [f.as_dict() for f in findings],
            "ok": not errors,
        }, indent=2))
    else:
        click.echo(render_plan(parsed))
        if layout is not None:
            click.echo(f"\nChecked for {layout.describe()}: "
                       f"{len(errors)} error(s), {len(findings) - len(errors)} warning(s).")
            for finding in findings:
                click.echo(f"  {finding.level}: {finding.message}",
                           err=finding.level == "error")
    if errors:
        raise SystemExit(2)
