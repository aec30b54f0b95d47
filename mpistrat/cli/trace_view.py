"""``mpistrat trace view``: a trace as a self-contained HTML timeline, for any browser."""

from __future__ import annotations

import os

import click

from ..trace import TraceError
from ..trace.view import MAX_EVENTS, write_html

__all__ = ["view"]


def _default_output(trace: str) -> str:
    base = os.path.basename(trace)
    for suffix in (".json.gz", ".gz", ".json"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
            break
    return (base or "trace") + ".html"


@click.command("view")
@click.argument("trace", metavar="TRACE.json", type=click.Path(dir_okay=True))
@click.option("-o", "--output", metavar="OUT.html", type=click.Path(dir_okay=False),
              help="The page to write (default: TRACE's name with .html, in the current "
                   "directory).")
@click.option("--from", "from_ms", type=float, metavar="MS",
              help="Keep only events that end after MS ms, and open there.")
@click.option("--to", "to_ms", type=float, metavar="MS",
              help="Keep only events that start before MS ms, and open there.")
@click.option("--max-events", type=click.IntRange(min=1), default=MAX_EVENTS,
              show_default=True, metavar="N",
              help="Embed at most N events (the earliest); a page must stay small enough "
                   "to draw.")
@click.option("--title", metavar="TEXT", help="The page's title (default: the file's name).")
def view(trace, output, from_ms, to_ms, max_events, title):
    """Write TRACE.json (a merged trace, or one rank's) as one HTML file that draws it as a
    timeline: a band per rank, a row per thread, colours by category; the mouse wheel
    zooms, dragging pans, hovering shows an event's duration and args.

    The page loads nothing from the network: copy it off the cluster and open it in any
    browser (OUT.html?from=120&to=180 opens on 120-180 ms).

    \b
    Examples:
      mpistrat trace merge traces -o job.json && mpistrat trace view job.json -o job.html
      mpistrat trace view job.json --from 200 --to 260 -o steps.html
    """
    if from_ms is not None and to_ms is not None and to_ms <= from_ms:
        raise click.BadParameter(f"--to {to_ms} must be greater than --from {from_ms}",
                                 param_hint="'--to'")
    window = None if from_ms is None and to_ms is None else (from_ms, to_ms)
    out = output or _default_output(trace)
    try:
        result = write_html(trace, out, title=title, max_events=max_events, window=window)
    except TraceError as exc:
        raise click.ClickException(str(exc)) from None
    if result.skipped:
        reasons = ", ".join(f"{n} {why}" for why, n in result.skipped.items())
        click.echo(f"skipped {sum(result.skipped.values())} events of the wrong shape: "
                   f"{reasons}", err=True)
    if result.left_out:
        click.echo(f"left out {result.left_out} events (outside --from/--to, or over "
                   f"--max-events {max_events}); pass --from/--to for a window", err=True)
    click.echo(f"wrote {result.path}: {result.events} events of {result.processes} "
               f"process{'es' if result.processes != 1 else ''}, "
               f"{result.bytes / 2**20:.1f} MiB; open it in any browser (no network needed)")
