"""Result files: JSON (everything, reloadable), CSV (one row per sample) and Markdown.

Files are written atomically (a temporary file renamed into place), so a sweep that is
interrupted leaves the previous complete file, or the partial one of this run with
``"complete": false``, never a torn file.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .._atomic import write_atomically
from .results import Point, baseline_of, group_by_size

__all__ = ["write_json", "read_json", "write_csv", "write_text", "CSV_FIELDS"]

CSV_FIELDS = [
    "bytes", "count", "dtype", "op", "algorithm", "kind", "alg", "shards", "participants",
    "iteration", "time_s", "median_s", "min_s", "max_s", "algbw_GBps", "busbw_GBps",
    "wrong", "speedup_over_native",
]


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` atomically, creating the parent folder."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(target, text)


def _records(points: Sequence[Point]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for size_points in group_by_size(points).values():
        baseline = baseline_of(size_points)
        out.extend(p.as_dict(baseline) for p in size_points)
    return out


def write_json(path: str | os.PathLike, meta: Mapping[str, Any], points: Sequence[Point],
               *, complete: bool, extra: Mapping[str, Any] | None = None) -> None:
    """Every point with all its samples, the run's metadata and ``extra`` sections
    (recommendation, cost model, prediction, per-size run facts)."""
    document = {"format": "mpistrat-bench/1", "meta": dict(meta), "results": _records(points),
                "complete": complete}
    document.update(extra or {})
    write_text(path, json.dumps(document, indent=1, allow_nan=False, default=str) + "\n")


def read_json(path: str | os.PathLike) -> tuple[dict[str, Any], list[Point], dict[str, Any]]:
    """Load a file written by :func:`write_json`: (metadata, points, whole document).

    Raises:
        ValueError: the file is not an ``mpistrat bench`` result.
    """
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON ({exc}); give a file written by "
                         f"mpistrat bench --json") from None
    if not isinstance(document, dict) or document.get("format") != "mpistrat-bench/1":
        raise ValueError(f"{path} is not an mpistrat bench result (no "
                         f"'format': 'mpistrat-bench/1'); give a file written by "
                         f"mpistrat bench --json")
    points = [Point.from_dict(r) for r in document.get("results", [])]
    return document.get("meta", {}), points, document


def write_csv(path: str | os.PathLike, meta: Mapping[str, Any], points: Sequence[Point]) -> None:
    """One row per sample (long format); the metadata as leading ``# key: value`` lines
    (``pandas.read_csv(path, comment="#")`` reads it)."""
    buffer = io.StringIO()
    for key, value in meta.items():
        if key in ("options", "mpi_env", "git"):
            value = json.dumps(value, default=str)
        elif isinstance(value, (list, tuple)):
            value = json.dumps(list(value), default=str)
        buffer.write(f"# {key}: {' '.join(str(value).split())}\n")
    writer = csv.DictWriter(buffer, fieldnames=CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    for record in _records(points):
        for iteration, sample in enumerate(record["samples"]):
            writer.writerow({
                "bytes": record["nbytes"], "count": record["count"], "dtype": record["dtype"],
                "op": record["op"], "algorithm": record["label"], "kind": record["kind"],
                "alg": record["alg"] or "", "shards": record["shards"],
                "participants": record["participants"], "iteration": iteration,
                "time_s": repr(sample), "median_s": repr(record["median_s"]),
                "min_s": repr(record["min_s"]), "max_s": repr(record["max_s"]),
                "algbw_GBps": record["algbw_GBps"], "busbw_GBps": record["busbw_GBps"],
                "wrong": record["wrong"],
                "speedup_over_native": record["speedup_over_native"],
            })
    write_text(path, buffer.getvalue())
