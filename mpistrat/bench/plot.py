"""``--plot FILE.png``: bus bandwidth and latency against size, one line per entry.

Two panels on log-log axes, as people read collective benchmarks: busbw (GB/s) on the
left, where large sizes matter, and the median time (µs) on the right, where small sizes
matter, with a band from the 25th to the 75th percentile of the samples (min and max are
in the table: single outliers would hide the lines). matplotlib is optional
(``pip install matplotlib``); it is drawn without pyplot (no display, no global state).
"""

from __future__ import annotations

import importlib.util
import os
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from .._atomic import write_atomically
from ..errors import BackendUnavailable
from ..spec import format_bytes
from .results import Point

__all__ = ["plot", "require_matplotlib", "INSTALL_HINT"]

INSTALL_HINT = "pip install matplotlib (or pip install 'mpistrat[bench]')"


def require_matplotlib() -> None:
    """Raise a clear error when matplotlib cannot be imported (without importing it)."""
    if importlib.util.find_spec("matplotlib") is None:
        raise BackendUnavailable(f"--plot needs matplotlib, which is not installed: "
                                 f"{INSTALL_HINT}")


def _quartiles(samples: Sequence[float]) -> tuple[float, float]:
    if len(samples) < 2:
        return samples[0], samples[0]
    q1, _q2, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return q1, q3


def _size_ticks(axis: Any, sizes: Sequence[int]) -> None:
    step = max(1, len(sizes) // 8)
    ticks = list(sizes[::step])
    axis.set_xticks(ticks)
    axis.set_xticklabels([format_bytes(s).replace(" ", "") for s in ticks], rotation=45,
                         ha="right")
    axis.minorticks_off()


def plot(points: Sequence[Point], path: str | os.PathLike,
         meta: Mapping[str, Any] | None = None) -> None:
    """Draw ``points`` into the PNG (or any format matplotlib knows) at ``path``.

    Raises:
        BackendUnavailable: matplotlib is not installed.
        ValueError: there is nothing to draw.
    """
    require_matplotlib()
    # optional, and slow to import: only --plot needs it
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    series: dict[str, list[Point]] = {}
    for p in points:
        series.setdefault(p.label, []).append(p)
    if not series:
        raise ValueError("--plot: no measured points to draw")
    figure = Figure(figsize=(13, 5.2), layout="constrained")
    FigureCanvasAgg(figure)
    bw_axis, time_axis = figure.subplots(1, 2)
    sizes = sorted({p.nbytes for p in points})
    for label, group in series.items():
        group = sorted(group, key=lambda p: p.nbytes)
        x = [p.nbytes for p in group]
        style = {"marker": "o", "markersize": 3, "linewidth": 1.4, "label": label}
        if label == "native":
            style.update(color="black", linewidth=2.2)
        wrong = [p for p in group if not p.correct]
        bw_axis.plot(x, [max(p.busbw, 1e-6) for p in group], **style)
        line = time_axis.plot(x, [p.median * 1e6 for p in group], **style)[0]
        quartiles = [_quartiles(p.samples) for p in group]
        time_axis.fill_between(x, [q[0] * 1e6 for q in quartiles],
                               [q[1] * 1e6 for q in quartiles],
                               color=line.get_color(), alpha=0.15, linewidth=0)
        if wrong:
            time_axis.plot([p.nbytes for p in wrong], [p.median * 1e6 for p in wrong], "x",
                           color="red", markersize=9)
    for axis in (bw_axis, time_axis):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.grid(True, which="major", alpha=0.3)
        axis.set_xlabel("size per rank (bytes)")
        _size_ticks(axis, sizes)
    bw_axis.set_ylabel("busbw (GB/s) = bytes / time x 2(n-1)/n")
    bw_axis.set_title("bus bandwidth (higher is better)")
    time_axis.set_ylabel("time (us): median, band = 25th..75th percentile")
    time_axis.set_title("latency (lower is better); red x = wrong results")
    time_axis.legend(fontsize="small", loc="upper left")
    if meta:
        opts = meta.get("options", {})
        figure.suptitle(
            f"mpistrat bench: all-reduce {opts.get('dtype', '')} {opts.get('op', '')}, "
            f"{meta.get('ranks', '?')} ranks x {opts.get('replicas_per_rank', 1)} on "
            f"{meta.get('nodes', '?')} node(s); {meta.get('mpi_library', '')[:60]}",
            fontsize="medium")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    suffix = os.path.splitext(str(path))[1].lstrip(".").lower() or "png"
    write_atomically(path, lambda file: figure.savefig(file, dpi=110, format=suffix))
