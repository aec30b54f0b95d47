"""One measured point (a size and an entry) and the statistics reported for it.

Conventions (nccl-tests, ``doc/PERFORMANCE.md``): a sample is one iteration's time on
its slowest rank; time is reported as the median over samples, with min and max;
``algbw = bytes / time`` and ``busbw = algbw * 2(n-1)/n`` with ``n`` the number of
participants (ranks x replicas per rank); GB/s means 10^9 B/s.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .entries import BASELINE

__all__ = ["Point", "bus_factor", "baseline_of", "group_by_size"]


def bus_factor(participants: int) -> float:
    """nccl-tests' all-reduce bus factor ``2(n-1)/n`` (0 for a single participant)."""
    if participants < 1:
        raise ValueError(f"participants must be >= 1, got {participants}")
    return 2 * (participants - 1) / participants


@dataclass(frozen=True)
class Point:
    """The samples of one entry at one size, and what was checked.

    Attributes:
        nbytes, count, dtype, op: the buffer (bytes per replica, elements, type, op).
        label, kind, alg, shards: the entry (see :class:`~mpistrat.bench.entries.Entry`);
            for a spec, ``alg``/``shards`` are what this size routed to.
        participants: ranks x replicas per rank (the bus factor's ``n``).
        samples: seconds, one per timed iteration, each the max over ranks.
        warmup: warm-up iterations run before the samples.
        wrong: wrong elements (summed over ranks and replicas) in the worst checked
            iteration; ``checked`` iterations were verified, ``wrong_iterations`` of
            them had a wrong element.
        per_rank_median: each rank's own median (seconds), for spotting a slow rank.
    """

    nbytes: int
    count: int
    dtype: str
    op: str
    label: str
    kind: str
    alg: str | None
    shards: int
    participants: int
    samples: tuple[float, ...]
    warmup: int = 0
    wrong: int = 0
    checked: int = 0
    wrong_iterations: int = 0
    per_rank_median: tuple[float, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError(f"point {self.label} at {self.nbytes} B has no samples")

    @property
    def median(self) -> float:
        return float(statistics.median(self.samples))

    @property
    def min(self) -> float:
        return float(min(self.samples))

    @property
    def max(self) -> float:
        return float(max(self.samples))

    @property
    def mean(self) -> float:
        return float(statistics.fmean(self.samples))

    @property
    def stdev(self) -> float:
        return float(statistics.stdev(self.samples)) if len(self.samples) > 1 else 0.0

    @property
    def algbw(self) -> float:
        """GB/s: bytes / median time (inf for a zero time)."""
        return self.nbytes / self.median / 1e9 if self.median > 0 else math.inf

    @property
    def busbw(self) -> float:
        """GB/s: algbw x 2(n-1)/n."""
        factor = bus_factor(self.participants)
        return self.algbw * factor if factor else 0.0

    @property
    def correct(self) -> bool:
        return self.wrong == 0

    def speedup_over(self, baseline: Point | None) -> float | None:
        """``baseline.median / self.median``: above 1 is faster than the baseline."""
        if baseline is None or self.median <= 0 or baseline.median <= 0:
            return None
        return baseline.median / self.median

    def as_dict(self, baseline: Point | None = None) -> dict[str, Any]:
        """JSON-ready record: the fields, every sample and the derived statistics."""
        record = asdict(self)
        record["samples"] = list(self.samples)
        record["per_rank_median"] = list(self.per_rank_median)
        speedup = self.speedup_over(baseline)
        record.update({
            "median_s": self.median, "min_s": self.min, "max_s": self.max,
            "mean_s": self.mean, "stdev_s": self.stdev, "iters": len(self.samples),
            "algbw_GBps": _finite(self.algbw), "busbw_GBps": _finite(self.busbw),
            "speedup_over_native": speedup,
        })
        return record

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> Point:
        """The inverse of :meth:`as_dict` (derived fields are ignored)."""
        names = cls.__dataclass_fields__
        values = {k: v for k, v in record.items() if k in names}
        values["samples"] = tuple(float(s) for s in values["samples"])
        values["per_rank_median"] = tuple(values.get("per_rank_median") or ())
        return cls(**values)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def group_by_size(points: Iterable[Point]) -> dict[int, list[Point]]:
    """Points by size, sizes ascending, entries in measurement order."""
    groups: dict[int, list[Point]] = {}
    for point in points:
        groups.setdefault(point.nbytes, []).append(point)
    return dict(sorted(groups.items()))


def baseline_of(points: Sequence[Point]) -> Point | None:
    """The ``native`` point among one size's points."""
    return next((p for p in points if p.label == BASELINE), None)
