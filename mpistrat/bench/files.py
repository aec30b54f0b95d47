"""Result files: JSON (everything, reloadable), CSV (one row per sample) and Markdown.

Files are written atomically (a temporary file renamed into place), so a sweep that is
interrupted leaves the previous complete file, or the partial one of this run with
``"complete": false``, never a torn file.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

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

    The document is checked field by field against what the analyses read (the records,
    the metadata, the per-size runs, a saved cost model), so a damaged or hand-edited
    file is one error naming the bad field, not a ``KeyError`` deep in an analysis.

    Raises:
        ValueError: the file cannot be read, is not an ``mpistrat bench`` result, or a
            field of it is missing or of the wrong type (the message names it).
    """
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror or exc}); give a file "
                         f"written by mpistrat bench --json") from None
    except (ValueError, RecursionError) as exc:  # (JSONDecodeError, UnicodeDecodeError,
        # an integer of more than 4300 digits, nesting deeper than Python's recursion)
        raise ValueError(f"{path} is not JSON ({type(exc).__name__}: "
                         f"{_short(str(exc), 120)}); give a file written by mpistrat bench "
                         f"--json") from None
    if not isinstance(document, dict) or document.get("format") != "mpistrat-bench/1":
        raise ValueError(f"{path} is not an mpistrat bench result (no "
                         f"'format': 'mpistrat-bench/1'); give a file written by "
                         f"mpistrat bench --json")
    _Checker(str(path)).document(document)
    points = [Point.from_dict(r) for r in document.get("results", [])]
    return document.get("meta", {}), points, document


def _short(text: str, most: int = 60) -> str:
    return text if len(text) <= most else f"{text[:most - 15]}...{text[-10:]}"


class _Checker:
    """The shape of a ``mpistrat-bench/1`` document, checked where the analyses read it;
    :meth:`fail` names the field (``results[3].samples``) and what it should hold."""

    def __init__(self, path: str) -> None:
        self.path = path

    def fail(self, field: str, expected: str, value: Any) -> NoReturn:
        raise ValueError(f"{self.path}: {field} must be {expected}, got "
                         f"{_short(repr(value))}; give a file written by mpistrat bench "
                         f"--json (or correct that field)")

    # one value

    @staticmethod
    def maybe(check: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
        """``check``, with null allowed."""
        return lambda field, value: None if value is None else check(field, value)

    def integer(self, field: str, value: Any, minimum: int = 0) -> None:
        if type(value) is not int or value < minimum:
            self.fail(field, f"an integer >= {minimum}", value)

    def number(self, field: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value < 0:
            self.fail(field, "a finite number >= 0", value)

    def text(self, field: str, value: Any, none: bool = False) -> None:
        if not (isinstance(value, str) or none and value is None):
            self.fail(field, "a string" + (" or null" if none else ""), value)

    def mapping(self, field: str, value: Any, none: bool = False) -> bool:
        """Whether ``value`` is an object (null too, with ``none``: then False)."""
        if value is None and none:
            return False
        if not isinstance(value, dict):
            self.fail(field, "an object" + (" or null" if none else ""), value)
        return True

    def items(self, field: str, value: Any, check: Any, least: int = 0) -> None:
        """A list of at least ``least`` items, each checked by ``check(field, item)``."""
        if not isinstance(value, list) or len(value) < least:
            self.fail(field, "a list" + (f" of at least {least} item(s)" if least else ""),
                      value)
        for index, item in enumerate(value):
            check(f"{field}[{index}]", item)

    def fields(self, where: str, record: dict, checks: dict[str, Any],
               required: tuple[str, ...] = ()) -> None:
        """Each of ``checks`` (name: ``check(field, value)``) on the fields present;
        ``required`` ones must be there."""
        for name in required:
            if name not in record:
                raise ValueError(f"{self.path}: {f'{where}.{name}' if where else name} is "
                                 f"missing; give a file written by mpistrat bench --json "
                                 f"(or add that field)")
        for name, check in checks.items():
            if name in record:
                check(f"{where}.{name}" if where else name, record[name])

    # the document

    def document(self, document: dict) -> None:
        self.fields("", document, {
            "meta": self.meta,
            "results": lambda f, v: self.items(f, v, self.record),
            "runs": self.runs,
            "cost_model": self.cost_model,
        })

    def record(self, field: str, record: Any) -> None:
        self.mapping(field, record)
        count = lambda f, v: self.integer(f, v)  # noqa: E731
        numbers = lambda f, v: self.items(f, v, self.number)  # noqa: E731
        self.fields(field, record, {
            "nbytes": count, "count": count, "dtype": self.text, "op": self.text,
            "label": self.text, "kind": self.text,
            "alg": lambda f, v: self.text(f, v, none=True),
            "shards": lambda f, v: self.integer(f, v, 1),
            "participants": lambda f, v: self.integer(f, v, 1),
            "samples": lambda f, v: self.items(f, v, self.number, least=1),
            "warmup": count, "wrong": count, "checked": count, "wrong_iterations": count,
            "per_rank_median": numbers,
        }, required=("nbytes", "count", "dtype", "op", "label", "kind", "alg", "shards",
                     "participants", "samples"))

    def meta(self, field: str, meta: Any) -> None:
        self.mapping(field, meta)
        texts = lambda f, v: self.items(f, v, self.text)  # noqa: E731
        maybe_text = lambda f, v: self.text(f, v, none=True)  # noqa: E731
        self.fields(field, meta, {
            "ranks": lambda f, v: self.integer(f, v, 1),
            "nodes": lambda f, v: self.integer(f, v, 1),
            "hosts": texts, "hostnames_by_rank": texts, "argv": texts, "notes": texts,
            "virtual_ranks_per_node": self.maybe(lambda f, v: self.integer(f, v, 1)),
            "mpistrat": self.text, "mpi_library": self.text, "date": self.text,
            "thp_mode": maybe_text, "glibc_tunables": maybe_text,
            "mpi_env": self.mapping,
            "options": self.options,
            "host_layout": self.host_layout,
            "network": self.network,
        })
        if meta.get("nodes", 1) > meta.get("ranks", 1):
            self.fail(f"{field}.nodes", f"at most {field}.ranks ({meta.get('ranks', 1)})",
                      meta["nodes"])
        if "size_range" in (meta.get("options") or {}):  # a sweep's: its header is printed
            self.fields(field, meta, {}, required=("mpistrat", "ranks", "nodes", "hosts",
                                                   "mpi_library", "options"))

    def options(self, field: str, options: Any) -> None:
        self.mapping(field, options)
        count_or_text = lambda f, v: (  # noqa: E731  ('adaptive (...)' or a count)
            None if isinstance(v, str) else self.integer(f, v))
        self.fields(field, options, {
            "replicas_per_rank": lambda f, v: self.integer(f, v, 1),
            "dtype": self.text, "op": self.text, "size_range": self.text, "check": self.text,
            "warmup": count_or_text, "iters": count_or_text,
            "entries": lambda f, v: self.items(f, v, self.text),
        }, required=("replicas_per_rank", "dtype", "op", "warmup", "iters", "check",
                     "entries") if "size_range" in options else ())

    def host_layout(self, field: str, layout: Any) -> None:
        if self.mapping(field, layout, none=True):
            self.fields(field, layout, {
                "count": lambda f, v: self.integer(f, v, 1),
                "names": lambda f, v: self.items(f, v, self.text),
                "ranks_per_host": lambda f, v: self.items(f, v, lambda g, w: self.integer(
                    g, w, 1)),
            }, required=("count", "names", "ranks_per_host"))

    def network(self, field: str, network: Any) -> None:
        if self.mapping(field, network, none=True):
            self.fields(field, network, {"transport": lambda f, v: self.mapping(f, v, True)})

    def runs(self, field: str, runs: Any) -> None:
        if not self.mapping(field, runs, none=True):
            return
        for key, run in runs.items():
            if not key.isdigit() or len(key) > 19:
                self.fail(f"{field} key {_short(repr(key))}", "a byte count (digits)", key)
            self.mapping(f"{field}.{key}", run)

    def cost_model(self, field: str, model: Any) -> None:
        if not self.mapping(field, model, none=True):
            return
        self.fields(field, model, {
            "model": self.text,
            "layouts": lambda f, v: self.items(f, v, self.layout),
            "fits": lambda f, v: self.items(f, v, self.fit),
            "skipped": lambda f, v: self.items(f, v, self.text),
        }, required=("fits",) if model.get("model") == "two-level alpha-beta" else ())

    def layout(self, field: str, layout: Any) -> None:
        self.mapping(field, layout)
        ranks = lambda f, v: self.items(f, v, self.integer, least=1)  # noqa: E731
        self.fields(field, layout, {
            "name": self.text, "host_of_rank": ranks, "node_of_rank": self.maybe(ranks),
        }, required=("name", "host_of_rank"))

    def fit(self, field: str, fit: Any) -> None:
        self.mapping(field, fit)
        seconds = {name: self.number for name in (
            "alpha_in_s", "beta_in_s_per_byte", "alpha_net_s", "beta_net_s_per_byte",
            "beta_burst_s_per_byte", "link_burst_bytes", "inline_saving")}
        self.fields(field, fit, {
            **seconds, "label": self.text, "alg": self.text,
            "shards": lambda f, v: self.integer(f, v, 1),
            "inline_bytes": lambda f, v: self.integer(f, v),
            "shared": lambda f, v: self.items(f, v, self.text),
            "intra_from": lambda f, v: self.text(f, v, none=True),
        }, required=("label", "alg", "shards", "alpha_in_s", "beta_in_s_per_byte",
                     "alpha_net_s", "beta_net_s_per_byte"))


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


def read_busbw_curve(path: str | os.PathLike[str]) -> Any:
    """The best correct busbw (GB/s) at each size of an ``mpistrat bench --json`` result,
    for ``mpistrat trace summary --bench`` (a :class:`mpistrat.trace.summary.BenchCurve`).

    Raises:
        TraceError: the file is not an ``mpistrat bench`` result (the reason named).
    """
    from ..errors import TraceError
    from ..trace.summary import BenchCurve

    source = os.fspath(path)
    try:
        meta, points, _ = read_json(source)
    except ValueError as exc:
        raise TraceError(f"--bench: {exc}") from None
    best: dict[int, tuple[float, str]] = {}
    for point in points:
        if point.correct and point.median > 0:
            bw = point.busbw
            if point.nbytes not in best or bw > best[point.nbytes][0]:
                best[point.nbytes] = (bw, point.label)
    ranks = meta.get("ranks")
    return BenchCurve(best, ranks if isinstance(ranks, int) else None, source)
