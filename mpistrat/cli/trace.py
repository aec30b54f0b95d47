"""``mpistrat trace``: read the per-rank traces of ``mpistrat run --trace DIR`` (no MPI).

``merge`` writes one timeline for Perfetto and ``chrome://tracing``, ``summary`` says
where each step's time went and who everyone waited for, ``view`` draws a trace as a
self-contained HTML page. A thin layer over :mod:`mpistrat.trace.merge`,
:mod:`mpistrat.trace.summary` and :mod:`mpistrat.trace.view`.
"""

from __future__ import annotations

import json
from typing import Any

import click

from ..errors import BackendUnavailable
from ..trace import TraceError
from ..trace.files import MAX_BYTES, ranges
from ..trace.summary import Summary
from ._table import format_table
from .trace_view import view

__all__ = ["trace"]

_MAX_MIB = click.option(
    "--max-mib", type=click.IntRange(min=1), default=MAX_BYTES >> 20, show_default=True,
    metavar="MIB", help="The largest rank file read (a file over it is left out).")


@click.group("trace")
def trace() -> None:
    """Read the traces of mpistrat run --trace DIR: one timeline, a summary, a page.

    \b
    Examples:
      mpistrat run -n 4 --trace traces --trace-steps 10:20 train.py
      mpistrat trace summary traces
      mpistrat trace merge traces -o job.json     # open job.json in ui.perfetto.dev
      mpistrat trace view job.json -o job.html    # or as a page, without network
    """


def _warn(warnings: list[str]) -> None:
    for line in warnings:
        click.echo(f"warning: {line}", err=True)


def _us(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.1f}"


@trace.command("merge")
@click.argument("directory", metavar="DIR", type=click.Path(file_okay=False))
@click.option("-o", "--output", metavar="FILE.json", type=click.Path(dir_okay=False),
              help="The merged trace (.gz: compressed). Default: DIR-merged.json beside DIR "
                   "(never inside it: HTA reads every .json there as a rank).")
@_MAX_MIB
def merge(directory: str, output: str | None, max_mib: int) -> None:
    """Merge the rank files of DIR into one trace: one process per rank, the clocks
    aligned (the drift measured between the start and the stop corrected), for Perfetto
    (ui.perfetto.dev) and chrome://tracing.

    Files of another run are left out, a file torn by a killed rank is cut back to its
    last complete event, and the residual clock skew of each rank is reported.
    """
    from ..trace.merge import merge as merge_traces

    try:
        result = merge_traces(directory, output, max_bytes=max_mib << 20)
    except TraceError as exc:
        raise click.ClickException(str(exc)) from None
    _warn(result.warnings)
    rows = [(c.rank, result.hosts.get(c.rank, "?"), _us(c.skew_us), c.describe())
            for c in result.clocks]
    click.echo(format_table(("rank", "host", "skew ±µs", "clock"), rows))
    skew = result.max_skew_us
    click.echo(f"clock skew: at most ±{_us(skew)} µs (half the round trip of the offset "
               f"measurements)" if skew is not None else
               "clock skew: unknown for some ranks (see the warnings)")
    missing = f"; rank(s) {', '.join(map(str, result.missing))} missing" \
        if result.missing else ""
    click.echo(f"wrote {result.path}: {len(result.ranks)} of {result.size} ranks of run "
               f"{result.run}{missing}, {result.events} events, "
               f"{result.bytes / 2**20:.1f} MiB; open it in https://ui.perfetto.dev or "
               f"chrome://tracing")


@trace.command("summary")
@click.argument("directory", metavar="DIR", type=click.Path(file_okay=False))
@click.option("--bench", "bench_path", metavar="FILE", type=click.Path(dir_okay=False),
              help="An mpistrat bench --json result: compare each all-reduce's busbw with "
                   "the bench's at the same size.")
@click.option("--png", metavar="FILE.png", type=click.Path(dir_okay=False),
              help="Draw each rank's mean step as a stacked bar (needs matplotlib).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option("--steps", "per_step", is_flag=True,
              help="Print every step of every rank as well.")
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True,
              help="Collectives listed (the slowest by mean time).")
@_MAX_MIB
def summary(directory: str, bench_path: str | None, png: str | None, as_json: bool,
            per_step: bool, top: int, max_mib: int) -> None:
    """Where each step's time went on every rank (compute, communication, waiting for
    the other ranks, waiting for input), the ranks the others wait for most often and by
    how much (the stragglers), and the slowest collectives by size with their bus
    bandwidth (against mpistrat bench's with --bench).

    Only the steps that every rank recorded whole are summarized.
    """
    from ..trace.plot import plot_breakdown, require_matplotlib
    from ..trace.summary import summarize

    try:
        if png:
            require_matplotlib()
        bench = None
        if bench_path is not None:
            from ..bench.files import read_busbw_curve

            bench = read_busbw_curve(bench_path)
        found = summarize(directory, bench=bench, max_bytes=max_mib << 20)
        if png:
            plot_breakdown(found, png)
    except (TraceError, BackendUnavailable, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    _warn(found.warnings)
    if as_json:
        click.echo(json.dumps(found.to_dict(), indent=1))
    else:
        click.echo(_text(found, per_step, top))
    if png:
        click.echo(f"wrote {png}", err=as_json)


def _text(found: Summary, per_step: bool, top: int) -> str:
    hosts = sorted(set(found.hosts.values()))
    lines = [f"run {found.run}: {len(found.ranks)} of {found.size} ranks on "
             f"{', '.join(hosts[:4])}{' ...' if len(hosts) > 4 else ''}; "
             f"{len(found.steps)} steps recorded whole on every rank"
             + (f" ({ranges(found.steps)})" if found.steps else "")]
    skew = found.max_skew_us
    lines.append(f"clock skew between ranks: at most ±{skew:.1f} µs" if skew is not None
                 else "clock skew between ranks: unknown for some ranks")
    if not found.steps:
        return "\n".join(lines)
    lines += ["", f"time per step (ms, mean over {len(found.steps)} steps)"]
    rows = [(t.rank, t.host, *(f"{v:.2f}" for v in (
        t.mean.step_ms, t.mean.compute_ms, t.mean.communication_ms, t.mean.hidden_ms,
        t.mean.waiting_ms, t.mean.input_ms))) for t in found.totals]
    lines.append(format_table(("rank", "host", "step", "compute", "communication",
                               "(hidden)", "waiting", "input"), rows))
    lines += ["", "stragglers (in each step, the rank the others waited for longest)"]
    if not found.stragglers:
        lines.append("  none: no collective's agreement was matched across ranks")
    for s in found.stragglers[:4]:
        lines.append(f"  rank {s.rank} ({found.hosts.get(s.rank, '?')}): last in {s.last} of "
                     f"{s.of} steps ({s.collectives_last} of {s.collectives} collectives); "
                     f"the others waited {s.median_delay_ms:.2f} ms for it (median; mean "
                     f"{s.mean_delay_ms:.2f}, max {s.max_delay_ms:.2f}), "
                     f"{s.total_delay_ms:.1f} ms in all")
    if found.collectives:
        bench = any(c.bench_busbw_GBps is not None for c in found.collectives)
        lines += ["", "slowest collectives (a call's time: the shortest of its ranks', "
                      "that is without waiting)"]
        headers = ["name", "bytes", "calls", "mean ms", "algbw GB/s", "busbw GB/s",
                   "algorithm"] + (["bench best busbw", "by", "ratio"] if bench else [])
        table: list[list[Any]] = []
        for c in found.collectives[:top]:
            row: list[Any] = [c.name, _bytes(c.bytes), c.count, f"{c.mean_ms:.3f}",
                              _gb(c.algbw_GBps), _gb(c.busbw_GBps), c.algorithm or "-"]
            if bench:
                row += [_gb(c.bench_busbw_GBps), c.bench_label or "-",
                        "-" if c.ratio is None else f"{c.ratio:.2f}"]
            table.append(row)
        lines.append(format_table(headers, table))
    if per_step:
        lines += ["", "every step (ms)"]
        lines.append(format_table(
            ("step", "rank", "step", "compute", "communication", "(hidden)", "waiting",
             "input"),
            [(r.step, r.rank, *(f"{v:.2f}" for v in (
                r.breakdown.step_ms, r.breakdown.compute_ms, r.breakdown.communication_ms,
                r.breakdown.hidden_ms, r.breakdown.waiting_ms, r.breakdown.input_ms)))
             for r in found.per_step]))
    return "\n".join(lines)


def _bytes(value: int | None) -> str:
    if value is None:
        return "?"
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if value >= 1 << shift:
            return f"{value / (1 << shift):.4g} {unit}"
    return f"{value} B"


def _gb(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


trace.add_command(view)
