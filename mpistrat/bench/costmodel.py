"""An alpha-beta cost model per algorithm: fit it on a sweep, predict other job sizes.

Each algorithm's time for ``n`` bytes on ``p`` ranks is modelled as
``t = alpha * L(p) + beta * B(p) * n`` (Hockney; Thakur, Rabenseifner and Gropp 2005),
where ``alpha`` is the cost of one message step (latency plus Python overhead),
``beta`` the time per byte on the critical path (transfer and reduction together), and
``L``/``B`` count the steps and the bytes per byte each algorithm puts on its critical
path:

=================  ==========================  ====================================
algorithm          L(p) (steps)                B(p) (bytes moved per byte)
=================  ==========================  ====================================
native             2 ceil(lg p)                2(p-1)/p  (MPICH's large-message
                                               reduce-scatter + allgather)
xring#s            2(p-1) s                    2(p-1)/p
rechd              2 lg q (+2 when p != q)     2(q-1)/q (+2 when p != q),
                                               q = largest power of two <= p
pscpu#s            2(p-1)                      2(p-1)/s (a gather rank takes n/s
                                               from every rank and sends it back)
a/b#s (r per       half of a's on r ranks      half of a's on r ranks
node, N nodes)     + b#s's on N                + b#s's on N
                   + ceil(lg r) (broadcast)    + 2(r-1)/r (broadcast)
=================  ==========================  ====================================

At the measured job size ``L`` and ``B`` are constants, so the fit is a line
``t = a + b n`` per algorithm, fitted by least squares on relative errors (every size
counts alike, small or large) with ``a, b >= 0``; then ``alpha = a / L`` and
``beta = b / B``. The fit's error on the measured points is reported: a large error
says the algorithm changes regime (protocol switches, cache sizes) within the range.

Prediction assumes every link behaves like the links measured: measure on the network
you care about (or approximate it on one machine with ``--transport net``, which turns
the MPI library's shared-memory path off). Nothing here needs MPI.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .. import algorithms
from ..errors import UnknownAlgorithmError
from ..spec import format_bytes
from .report import format_us
from .results import Point

__all__ = ["Fit", "CostModel", "Prediction", "terms", "fit_points", "fit", "predict"]

_FLAT_FAMILY = {"native": "native", "xring": "ring", "nccl": "ring", "rechd": "rechd",
                "pscpu": "shuffle", "psgpu": "shuffle"}


def _lg(p: int) -> int:
    return max(p - 1, 0).bit_length()  # ceil(log2 p)


def _flat_terms(alg: str, p: int, shards: int) -> tuple[float, float]:
    family = _FLAT_FAMILY.get(alg)
    if family is None:
        raise KeyError(alg)
    if p <= 1:
        return 0.0, 0.0
    if family == "native":
        return 2.0 * _lg(p), 2 * (p - 1) / p
    if family == "ring":
        return 2.0 * (p - 1) * (shards if alg == "xring" else 1), 2 * (p - 1) / p
    if family == "rechd":
        q = 1 << (p.bit_length() - 1)
        extra = 2.0 if q != p else 0.0
        return 2.0 * (q.bit_length() - 1) + extra, 2 * (q - 1) / q + extra
    return 2.0 * (p - 1), 2 * (p - 1) / min(shards, p)


def terms(alg: str, shards: int, ranks: int, nodes: int = 1) -> tuple[float, float]:
    """(L, B) of ``alg#shards`` on ``ranks`` ranks spread evenly over ``nodes`` nodes.

    Raises:
        KeyError: the algorithm has no model (e.g. one registered by a plugin).
    """
    try:
        info = algorithms.get(alg)
    except UnknownAlgorithmError:
        raise KeyError(alg) from None
    if not info.hierarchical:
        return _flat_terms(alg, ranks, shards)
    nodes = max(1, min(nodes, ranks))
    per_node = -(-ranks // nodes)
    intra_l, intra_b = _flat_terms(info.intra, per_node, 1)
    inter_l, inter_b = _flat_terms(info.inter, nodes, shards)
    bcast_l, bcast_b = (_lg(per_node), 2 * (per_node - 1) / per_node) if per_node > 1 \
        else (0, 0.0)
    return intra_l / 2 + inter_l + bcast_l, intra_b / 2 + inter_b + bcast_b


def fit_points(sizes: Sequence[int], times: Sequence[float]) -> tuple[float, float]:
    """``(a, b)`` >= 0 minimising the sum of ``((a + b n) / t - 1)^2`` over the points."""
    if len(sizes) != len(times) or not sizes:
        raise ValueError("fit_points needs as many sizes as times, at least one")
    w = [1.0 / t for t in times]
    s11 = sum(x * x for x in w)
    s12 = sum(x * x * n for x, n in zip(w, sizes))
    s22 = sum((x * n) ** 2 for x, n in zip(w, sizes))
    r1, r2 = sum(w), sum(x * n for x, n in zip(w, sizes))
    det = s11 * s22 - s12 * s12
    if det > 0:
        a, b = (r1 * s22 - r2 * s12) / det, (s11 * r2 - s12 * r1) / det
        if a >= 0 and b >= 0:
            return a, b
    # the unconstrained optimum is outside a, b >= 0: the best of the two edges
    only_a = (r1 / s11, 0.0)
    only_b = (0.0, r2 / s22 if s22 > 0 else 0.0)

    def loss(ab: tuple[float, float]) -> float:
        return sum(((ab[0] + ab[1] * n) / t - 1) ** 2 for n, t in zip(sizes, times))

    return min(only_a, only_b, key=loss)


@dataclass(frozen=True)
class Fit:
    """The fitted model of one algorithm and its error on the measured points."""

    label: str
    alg: str
    shards: int
    alpha: float  # seconds per step
    beta: float  # seconds per byte on the critical path
    steps: float  # L at the measured layout
    volume: float  # B at the measured layout
    median_error: float  # relative, over the measured points
    max_error: float
    points: int

    def time(self, nbytes: int, ranks: int, nodes: int) -> float:
        steps, volume = terms(self.alg, self.shards, ranks, nodes)
        return self.alpha * steps + self.beta * volume * nbytes

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.label, "alg": self.alg, "shards": self.shards,
                "alpha_s": self.alpha, "beta_s_per_byte": self.beta,
                "L": self.steps, "B": self.volume, "median_rel_error": self.median_error,
                "max_rel_error": self.max_error, "points": self.points}


@dataclass(frozen=True)
class CostModel:
    """Fits of every modelled algorithm of a sweep, and what could not be modelled."""

    ranks: int
    nodes: int
    fits: tuple[Fit, ...]
    skipped: tuple[str, ...] = ()

    def lines(self) -> list[str]:
        out = [f"# Cost model t = alpha*L + beta*B*n, fitted on the medians at {self.ranks} "
               f"rank(s), {self.nodes} node(s); error = |model - measured| / measured"]
        rows = [("algorithm", "alpha(us)", "beta(ns/B)", "1/beta(GB/s)", "L", "B",
                 "err median", "err max", "points")]
        for f in self.fits:
            rows.append((f.label, f"{f.alpha * 1e6:.2f}", f"{f.beta * 1e9:.4g}",
                         f"{1 / f.beta / 1e9:.3g}" if f.beta > 0 else "inf",
                         f"{f.steps:g}", f"{f.volume:.3g}", f"{f.median_error:.0%}",
                         f"{f.max_error:.0%}", str(f.points)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        out += ["#   " + "  ".join(c.rjust(w) if i else c.ljust(w)
                                   for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
        out += [f"# not modelled: {s}" for s in self.skipped]
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"ranks": self.ranks, "nodes": self.nodes,
                "fits": [f.as_dict() for f in self.fits], "skipped": list(self.skipped)}


def fit(points: Sequence[Point], ranks: int, nodes: int) -> CostModel:
    """Fit every single-algorithm entry of a sweep measured on ``ranks`` MPI ranks over
    ``nodes`` nodes (only correct points count)."""
    by_label: dict[str, list[Point]] = {}
    for p in points:
        if p.kind == "algorithm" and p.correct and p.median > 0:
            by_label.setdefault(p.label, []).append(p)
    fits, skipped = [], []
    for label, group in by_label.items():
        alg, shards = group[0].alg or label, group[0].shards
        try:
            steps, volume = terms(alg, shards, ranks, nodes)
        except KeyError:
            skipped.append(f"{label} (no model for {alg!r})")
            continue
        if steps <= 0 or volume <= 0:
            skipped.append(f"{label} (nothing crosses ranks at {ranks} rank(s))")
            continue
        sizes = [p.nbytes for p in group]
        times = [p.median for p in group]
        a, b = fit_points(sizes, times)
        errors = [abs(a + b * n - t) / t for n, t in zip(sizes, times)]
        fits.append(Fit(label, alg, shards, a / steps, b / volume, steps, volume,
                        statistics.median(errors), max(errors), len(group)))
    return CostModel(ranks, nodes, tuple(fits), tuple(skipped))


@dataclass(frozen=True)
class Prediction:
    """Predicted times (seconds) per size and algorithm for another job size."""

    ranks: int
    ranks_per_node: int
    nodes: int
    sizes: tuple[int, ...]
    times: dict[str, tuple[float, ...]]

    def best(self) -> list[str]:
        return [min(self.times, key=lambda label: self.times[label][i])
                for i in range(len(self.sizes))]

    def lines(self) -> list[str]:
        labels = list(self.times)
        out = [f"# Predicted time (us) at {self.ranks} ranks, {self.ranks_per_node} per node "
               f"({self.nodes} node(s)), from the cost model (every link like the measured "
               f"ones)"]
        rows = [["size", *labels, "best"]]
        for i, (size, best) in enumerate(zip(self.sizes, self.best())):
            rows.append([format_bytes(size), *(format_us(self.times[lb][i]) for lb in labels),
                         best])
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        out += ["#   " + "  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"ranks": self.ranks, "ranks_per_node": self.ranks_per_node,
                "nodes": self.nodes, "sizes": list(self.sizes),
                "times_s": {k: list(v) for k, v in self.times.items()}, "best": self.best()}


def predict(model: CostModel, ranks: int, ranks_per_node: int,
            sizes: Sequence[int]) -> Prediction:
    """Predict every fitted algorithm at ``ranks`` ranks, ``ranks_per_node`` per node.

    Raises:
        ValueError: ranks or ranks_per_node below 1, no sizes, or nothing fitted.
    """
    if ranks < 1 or ranks_per_node < 1:
        raise ValueError(f"--predict-ranks and ranks per node must be >= 1, got {ranks} "
                         f"and {ranks_per_node}")
    if not sizes:
        raise ValueError("predict needs at least one size")
    if not model.fits:
        raise ValueError("the cost model has no fitted algorithm to predict with (a sweep "
                         "on one rank moves nothing; measure on 2 or more ranks)")
    nodes = math.ceil(ranks / min(ranks_per_node, ranks))
    times = {f.label: tuple(f.time(n, ranks, nodes) for n in sizes) for f in model.fits}
    return Prediction(ranks, min(ranks_per_node, ranks), nodes, tuple(sizes), times)
