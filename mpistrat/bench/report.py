"""The human output of a sweep: nccl-tests-style text rows, a footer, a Markdown table.

Columns: size (B), count (elements), type, redop, algorithm, shards, iters, time (µs,
median over iterations of the slowest rank) with min and max, algbw and busbw (GB/s),
#wrong, and ``vs native`` = native's median / this median (above 1: faster).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from ..launch.hugepages import describe_heap
from ..spec import format_bytes
from .results import Point, baseline_of, group_by_size

__all__ = ["Table", "format_us", "format_gbps", "format_ratio", "summary_lines",
           "describe_size", "describe_run"]

# (header, unit, width, right-aligned)
_COLUMNS = [
    ("size", "(B)", 11, True), ("count", "(elements)", 11, True), ("type", "", 8, True),
    ("redop", "", 5, True), ("algorithm", "", 10, False), ("shards", "", 6, True),
    ("iters", "", 5, True), ("time", "(us)", 9, True), ("min", "(us)", 9, True),
    ("max", "(us)", 9, True), ("algbw", "(GB/s)", 8, True), ("busbw", "(GB/s)", 8, True),
    ("#wrong", "", 6, True), ("vs native", "", 9, True),
]


def format_us(seconds: float) -> str:
    us = seconds * 1e6
    return f"{us:.1f}" if us < 1000 else f"{us:.0f}"


def format_gbps(value: float) -> str:
    if not math.isfinite(value):
        return "inf"
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"


def format_ratio(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.2f}x"


def describe_size(nbytes: int) -> str:
    """``1 KiB``, ``96 B``: exact binary units where they fit."""
    return format_bytes(nbytes)


class Table:
    """Fixed-width rows, printed as each size finishes.

    Args:
        labels: every entry label, to size the algorithm column.
    """

    def __init__(self, labels: Iterable[str]) -> None:
        self.columns = list(_COLUMNS)
        widest = max((len(label) for label in labels), default=0)
        head, unit, width, right = self.columns[4]
        self.columns[4] = (head, unit, max(width, widest), right)

    def _line(self, values: Sequence[str], prefix: str = " ") -> str:
        cells = [v.rjust(w) if right else v.ljust(w)
                 for v, (_h, _u, w, right) in zip(values, self.columns)]
        return (prefix + "  ".join(cells)).rstrip()

    def header(self) -> str:
        return "\n".join([self._line([h for h, *_ in self.columns], "#"),
                          self._line([u for _h, u, *_ in self.columns], "#")])

    @staticmethod
    def values(point: Point, baseline: Point | None) -> list[str]:
        return [
            str(point.nbytes), str(point.count), point.dtype, point.op, point.label,
            str(point.shards), str(len(point.samples)), format_us(point.median),
            format_us(point.min), format_us(point.max), format_gbps(point.algbw),
            format_gbps(point.busbw), str(point.wrong),
            format_ratio(point.speedup_over(baseline)),
        ]

    def rows(self, points: Sequence[Point]) -> str:
        """The rows of one size's points."""
        baseline = baseline_of(points)
        return "\n".join(self._line(self.values(p, baseline)) for p in points)

    def markdown(self, points: Iterable[Point]) -> str:
        """Every point as a Markdown table (sizes in binary units)."""
        heads = [f"{h} {u}".strip() for h, u, *_ in self.columns]
        lines = ["| " + " | ".join(heads) + " |",
                 "|" + "|".join("---:" if right else ":---"
                                for *_x, right in self.columns) + "|"]
        for size_points in group_by_size(points).values():
            baseline = baseline_of(size_points)
            for p in size_points:
                values = self.values(p, baseline)
                values[0] = describe_size(p.nbytes)
                lines.append("| " + " | ".join(values) + " |")
        return "\n".join(lines)


def summary_lines(points: Sequence[Point]) -> list[str]:
    """The footer: wrong results, and the average busbw per entry over all sizes
    (nccl-tests' "Avg bus bandwidth")."""
    wrong = sum(p.wrong for p in points)
    lines = [f"# #wrong total : {wrong} " + ("OK" if wrong == 0 else
                                              "WRONG RESULTS (see the #wrong column)")]
    by_label: dict[str, list[float]] = {}
    for p in points:
        if math.isfinite(p.busbw):
            by_label.setdefault(p.label, []).append(p.busbw)
    if by_label:
        averages = "  ".join(f"{label} {format_gbps(statistics.fmean(values))}"
                             for label, values in by_label.items())
        lines.append(f"# Avg bus bandwidth (GB/s, mean over sizes): {averages}")
    return lines


def _hosts_lines(meta: dict[str, Any]) -> list[str]:
    """``# hosts: node1 x2, node2 x2; links 1gbit each (MPISTRAT_LINK_RATE), MTU 9000;
    MPI transport ...``
    (nothing for results written before the metadata had them)."""
    layout, net = meta.get("host_layout"), meta.get("network")
    if not layout:
        return []
    hosts = ", ".join(f"{name} x{count}" for name, count in
                      zip(layout["names"], layout["ranks_per_host"]))
    text = f"# hosts: {layout['count']} ({hosts})"
    if net and str(net.get("link_rate")).lower() == "off":
        text += f"; links unshaped ({net.get('link_rate_from')}=off)"
    elif net and net.get("link_rate"):
        text += f"; links {net['link_rate']} each ({net.get('link_rate_from')})"
    elif layout["count"] > 1:
        text += "; link rate unknown (set MPISTRAT_LINK_RATE)"
    if net and net.get("link_mtu"):
        text += f", MTU {net['link_mtu']}"
    if net and net.get("transport"):
        text += "; " + " ".join(f"{k}={v}" for k, v in net["transport"].items())
    return [text]


def describe_run(meta: dict[str, Any]) -> list[str]:
    """The ``#`` lines that open a sweep's output (from :func:`~.metadata.collect`)."""
    opts = meta["options"]
    lines = [
        f"# mpistrat bench {meta['mpistrat']}: all-reduce, {meta['ranks']} rank(s) x "
        f"{opts['replicas_per_rank']} replica(s) on {meta['nodes']} node(s) "
        f"({', '.join(meta['hosts'])}); {meta['mpi_library']}",
        f"# dtype {opts['dtype']}  op {opts['op']}  sizes {opts['size_range']}  warmup "
        f"{opts['warmup']}  iters {opts['iters']}  check {opts['check']}",
        f"# entries: {', '.join(opts['entries'])}",
    ]
    lines += _hosts_lines(meta)
    for key, value in sorted(meta.get("mpi_env", {}).items()):
        lines.append(f"# env: {key}={value}")
    if "thp_mode" in meta:
        lines.append(f"# memory: {describe_heap(meta.get('glibc_tunables'), meta['thp_mode'])}")
    lines += [f"# note: {note}" for note in meta.get("notes", [])]
    return lines
