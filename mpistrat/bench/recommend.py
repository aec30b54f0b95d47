"""Turn a sweep into an all-reduce spec: the fastest algorithm per size range.

For every measured size the candidates are the single algorithms (not whole specs, not
peers) whose results were all correct. The fastest by median time wins, with one rule
against noise: an algorithm within ``tolerance`` of the fastest counts as tied, and a
tie goes first to the previous (smaller) size's choice, so neighbouring sizes merge into
fewer ranges, then to ``native``. Consecutive sizes with the same choice form one range.
The limit between two ranges is the largest power of two at or below the geometric mean
of the last size of one and the first size of the next (at least the former), so a
sweep with factor 4 puts the boundary halfway between its sizes in log scale.

Spec files (``--save FILE``, ``--spec @FILE``) hold one spec string; blank lines and
lines starting with ``#`` are comments. Nothing here needs MPI.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import SpecError
from ..spec import AllReduceSpec, AllReduceSpecTuple, format_bytes, parse_spec
from .entries import BASELINE
from .files import write_text
from .results import Point, baseline_of, group_by_size

__all__ = ["Choice", "Recommendation", "recommend", "read_spec_file", "write_spec_file",
           "resolve_spec", "DEFAULT_TOLERANCE"]

DEFAULT_TOLERANCE = 0.03


@dataclass(frozen=True)
class Choice:
    """One range of the recommendation.

    Attributes:
        label, alg, shards: the chosen algorithm.
        limit: the spec limit of the range (-1: no upper bound).
        sizes: the measured sizes that fall in the range.
        gains: native's median / the chosen median at each of those sizes.
    """

    label: str
    alg: str
    shards: int
    limit: int
    sizes: tuple[int, ...]
    gains: tuple[float | None, ...]

    def gain_text(self) -> str:
        known = [g for g in self.gains if g is not None]
        if not known:
            return "-"
        low, high = min(known), max(known)
        median = sorted(known)[len(known) // 2]
        if math.isclose(low, high, rel_tol=0.005):
            return f"{low:.2f}x"
        return f"{low:.2f}x - {high:.2f}x (median {median:.2f}x)"


@dataclass(frozen=True)
class Recommendation:
    """The recommended spec and, per range, what was measured."""

    spec: AllReduceSpec
    choices: tuple[Choice, ...]
    tolerance: float
    skipped_sizes: tuple[int, ...] = ()

    def lines(self) -> list[str]:
        """The printed form: a ``#`` table of ranges, then ``spec: ...`` to copy."""
        rows = []
        for row, choice in zip(self.spec.plan(), self.choices):
            measured = (format_bytes(choice.sizes[0]) if len(choice.sizes) == 1 else
                        f"{format_bytes(choice.sizes[0])} - {format_bytes(choice.sizes[-1])}"
                        f" ({len(choice.sizes)} sizes)")
            rows.append((row.range_text, choice.label, measured, choice.gain_text()))
        heads = ("bytes", "algorithm", "measured", "gain over native")
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(heads)]

        def line(cells: Sequence[str]) -> str:
            return ("#   " + "  ".join(c.ljust(w) for c, w in zip(cells, widths))).rstrip()

        out = [f"# Recommended spec: fastest correct algorithm per size range (within "
               f"{self.tolerance:.0%} of the fastest counts as a tie)", line(heads)]
        out += [line(r) for r in rows]
        if self.skipped_sizes:
            out.append("# not used (no correct algorithm): "
                       + ", ".join(format_bytes(s) for s in self.skipped_sizes))
        out.append(f"spec: {self.spec}")
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "spec": str(self.spec), "comma_form": self.spec.to_comma_form(),
            "tolerance": self.tolerance,
            "ranges": [{"range": row.range_text, "algorithm": c.label, "alg": c.alg,
                        "shards": c.shards, "limit": c.limit, "sizes": list(c.sizes),
                        "gains_over_native": list(c.gains)}
                       for row, c in zip(self.spec.plan(), self.choices)],
            "skipped_sizes": list(self.skipped_sizes),
        }


def _boundary(last: int, first: int) -> int:
    """The limit between a range ending at size ``last`` and one starting at ``first``."""
    mean = math.isqrt(last * first)
    power = 1 << (mean.bit_length() - 1) if mean > 0 else 1
    return min(max(power, last), first - 1)


def recommend(points: Sequence[Point], tolerance: float = DEFAULT_TOLERANCE) -> Recommendation:
    """The spec that picks the fastest correct algorithm at every measured size.

    Raises:
        ValueError: a negative tolerance, or no size with a correct algorithm result.
    """
    if not tolerance >= 0:
        raise ValueError(f"tolerance must be >= 0 (a fraction: 0.03 is 3 %), got {tolerance}")
    picks: list[tuple[int, Point, Point | None]] = []
    skipped: list[int] = []
    previous: str | None = None
    for nbytes, size_points in group_by_size(points).items():
        candidates = [p for p in size_points
                      if p.kind == "algorithm" and p.correct and p.median > 0]
        if not candidates:
            skipped.append(nbytes)
            continue
        best = min(candidates, key=lambda p: p.median)
        tied = [p for p in candidates if p.median <= best.median * (1 + tolerance)]
        chosen = (next((p for p in tied if p.label == previous), None)
                  or next((p for p in tied if p.label == BASELINE), None) or best)
        previous = chosen.label
        picks.append((nbytes, chosen, baseline_of(size_points)))
    if not picks:
        raise ValueError("nothing to recommend: no size has a correct result of a single "
                         "algorithm (check the #wrong column)")
    groups: list[list[tuple[int, Point, Point | None]]] = []
    for pick in picks:
        if groups and groups[-1][-1][1].label == pick[1].label:
            groups[-1].append(pick)
        else:
            groups.append([pick])
    choices = []
    for index, group in enumerate(groups):
        chosen = group[0][1]
        limit = (-1 if index == len(groups) - 1
                 else _boundary(group[-1][0], groups[index + 1][0][0]))
        choices.append(Choice(
            chosen.label, chosen.alg or chosen.label, chosen.shards, limit,
            tuple(n for n, _p, _b in group),
            tuple(p.speedup_over(b) for _n, p, b in group)))
    spec = AllReduceSpec(tuple(AllReduceSpecTuple(c.alg, c.shards, c.limit) for c in choices))
    return Recommendation(spec, tuple(choices), tolerance, tuple(skipped))


# ------------------------------------------------------------------ spec files


def write_spec_file(path: str | os.PathLike, recommendation: Recommendation,
                    about: Sequence[str] = ()) -> None:
    """Write the recommended spec, with its ranges and ``about`` lines as comments."""
    lines = ["# mpistrat all-reduce spec, recommended by mpistrat bench"]
    lines += [f"# {line}" for line in about]
    lines += [line for line in recommendation.lines() if line.startswith("#")]
    lines.append(str(recommendation.spec))
    write_text(path, "\n".join(lines) + "\n")


_MAX_SPEC_FILE = 64 * 1024  # bytes: a spec line and its comments


def read_spec_file(path: str | os.PathLike) -> AllReduceSpec:
    """Read a spec file: one spec string; blank lines and ``#`` lines are ignored.

    Raises:
        SpecError: the file cannot be read, holds no spec or several, or the spec is
            invalid; the message names the file.
    """
    fix = "give the path of a file written by mpistrat bench --recommend --save"
    try:
        with open(path, "rb") as file:
            data = file.read(_MAX_SPEC_FILE + 1)
    except OSError as exc:
        raise SpecError(f"cannot read spec file {str(path)!r}: {exc.strerror or exc}; "
                        f"{fix}") from None
    if len(data) > _MAX_SPEC_FILE:
        raise SpecError(f"spec file {str(path)!r} is larger than a spec file "
                        f"({_MAX_SPEC_FILE // 1024} KiB); {fix}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(f"spec file {str(path)!r} is not UTF-8 text (byte {exc.start}); "
                        f"{fix}") from None
    lines = [ln.strip() for ln in text.splitlines()
             if ln.strip() and not ln.strip().startswith("#")]
    if len(lines) != 1:
        raise SpecError(f"spec file {str(path)!r} should hold exactly one spec line (plus "
                        f"'#' comments), found {len(lines)}")
    try:
        return parse_spec(lines[0])
    except SpecError as exc:
        raise type(exc)(f"spec file {str(path)!r}: {exc}") from None


def resolve_spec(text: str) -> AllReduceSpec:
    """A spec option's value: ``@FILE`` reads a spec file, anything else is a spec.

    Raises:
        SpecError: as :func:`read_spec_file` or :func:`~mpistrat.parse_spec`.
    """
    if text.startswith("@"):
        return read_spec_file(text[1:])
    return parse_spec(text)
