"""``mpistrat trace summary --png FILE``: each rank's time as a stacked bar.

One bar per rank, the mean step split into compute, communication not hidden behind
compute, waiting for the other ranks and waiting for input (ms per step), so that the rank
whose bar has the least waiting is the one the others wait for. matplotlib is optional
(``pip install matplotlib``); it is drawn without pyplot (no display, no global state).
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING

from .._atomic import write_atomically
from ..errors import BackendUnavailable

if TYPE_CHECKING:
    from .summary import Summary

__all__ = ["plot_breakdown", "require_matplotlib", "INSTALL_HINT"]

INSTALL_HINT = "pip install matplotlib (or pip install 'mpistrat[bench]')"
_PARTS = (("compute", "compute_ms", "#59a14f"),
          ("communication (exposed)", "exposed_communication_ms", "#f28e2b"),
          ("waiting for other ranks", "waiting_ms", "#e15759"),
          ("waiting for input", "input_ms", "#b07aa1"))


def require_matplotlib() -> None:
    """Raise a clear error when matplotlib cannot be imported (without importing it)."""
    if importlib.util.find_spec("matplotlib") is None:
        raise BackendUnavailable(f"--png needs matplotlib, which is not installed: "
                                 f"{INSTALL_HINT}")


def plot_breakdown(summary: Summary, path: str | os.PathLike[str]) -> None:
    """Draw each rank's mean step of ``summary`` into the PNG (or any format matplotlib
    knows, by the suffix) at ``path``.

    Raises:
        BackendUnavailable: matplotlib is not installed.
        ValueError: no step to draw.
    """
    require_matplotlib()
    if not summary.steps:
        raise ValueError("--png: no step recorded whole on every rank, nothing to draw")
    # optional, and slow to import: only --png needs it
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    totals = summary.totals
    labels = [f"rank {t.rank}\n{t.host}" if len(t.host) <= 16 else f"rank {t.rank}"
              for t in totals]
    figure = Figure(figsize=(max(6.0, 1.0 + 0.7 * len(totals)), 4.8), layout="constrained")
    FigureCanvasAgg(figure)
    axis = figure.subplots()
    bottom = [0.0] * len(totals)
    for label, attribute, color in _PARTS:
        heights = [max(getattr(t.mean, attribute), 0.0) for t in totals]
        axis.bar(range(len(totals)), heights, bottom=bottom, label=label, color=color,
                 width=0.7)
        bottom = [b + h for b, h in zip(bottom, heights)]
    axis.set_xticks(range(len(totals)))
    axis.set_xticklabels(labels, fontsize="small")
    axis.set_ylabel("ms per step (mean)")
    axis.grid(True, axis="y", alpha=0.3)
    axis.legend(fontsize="small", loc="lower right")
    stragglers = ", ".join(f"rank {s.rank} last in {s.last}/{s.of} steps "
                           f"(+{s.median_delay_ms:.1f} ms)" for s in summary.stragglers[:2])
    figure.suptitle(f"mpistrat trace summary: {len(summary.steps)} steps of run "
                    f"{summary.run}" + (f"\n{stragglers}" if stragglers else ""),
                    fontsize="medium")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    suffix = os.path.splitext(os.fspath(path))[1].lstrip(".").lower() or "png"
    write_atomically(path, lambda file: figure.savefig(file, dpi=110, format=suffix))
