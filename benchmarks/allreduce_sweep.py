#!/usr/bin/env python
"""Time every all-reduce algorithm against ``native`` (MPI_Allreduce) in the same run.

Run it under MPI (rank 0 prints; the other ranks only take part)::

    python -m mpistrat.launch -n 2 -- python benchmarks/allreduce_sweep.py \\
        --json results/sweep.json --markdown results/sweep.md

For every size from ``--minbytes`` to ``--maxbytes`` (times ``--stepfactor``) it

1. allocates the buffer once, plus a pristine copy of its input (small integers, so
   sums are exact in any order) that is copied back into the buffer before every
   iteration, outside the timed region (repeated in-place SUMs would otherwise grow
   the values by a factor ``n`` per iteration, to inf);
2. checks one iteration of every algorithm against ``comm.Allreduce`` of the same
   input and counts the wrong elements (summed over ranks);
3. warms up, then times ``iters`` rounds; a round runs every algorithm once
   (round-robin, the start rotating each round) so slow drift of a noisy machine hits
   every algorithm alike. One timed iteration is
   ``Barrier; t0 = Wtime(); algorithms.run(...); t = Wtime() - t0``; after the last round
   one ``Allreduce(MAX)`` turns every iteration's time into its maximum over ranks;
4. reports median, min and max of those, algbw = bytes / median,
   busbw = algbw * 2 (n - 1) / n and the ratios to ``native`` at that size.

The sweep ends with the project's three targets (best of xring/rechd/pscpu vs native).
This script is self-contained on purpose (the ``mpistrat bench`` command comes later);
see ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# -------------------------------------------------------------------------------------
# options (parsed identically on every rank before MPI starts: a mistake exits every
# rank with argparse's message and status 2)
# -------------------------------------------------------------------------------------

FLAT_TARGET_FAMILIES = ("xring", "rechd", "pscpu")
KiB, MiB = 1 << 10, 1 << 20


def _bytes(text: str) -> int:
    from mpistrat.spec import parse_bytes

    try:
        value = parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a byte count >= 1, got {text!r}")
    return value


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_nonnegative_int = _int_at_least(0)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="allreduce_sweep.py",
        description="Time mpistrat's all-reduce algorithms against native MPI_Allreduce "
        "over a range of sizes. Run under MPI: python -m mpistrat.launch -n 2 -- python "
        "benchmarks/allreduce_sweep.py [options]",
    )
    parser.add_argument(
        "--algorithms", default=None, metavar="LIST",
        help="comma list of algorithm names with optional '#shards' (xring#2 = 2 ring "
        "pipelines, pscpu#2 = 2 gather ranks), e.g. 'native,xring,xring#2,rechd,pscpu#2,"
        "pscpu/pscpu'. 'native' is always added (first) as the baseline. Default: every "
        "CPU algorithm of the registry with 1 shard, plus xring#2 and pscpu#<ranks>")
    parser.add_argument("--minbytes", "-b", type=_bytes, default=_bytes("4"),
                        help="smallest size in bytes, K/M/G suffixes (default 4)")
    parser.add_argument("--maxbytes", "-e", type=_bytes, default=_bytes("256M"),
                        help="largest size in bytes (default 256M)")
    parser.add_argument("--stepfactor", "-f", type=_positive_int, default=4,
                        help="multiply the size by this factor each step (default 4)")
    parser.add_argument("--dtype", default="float32",
                        help="NumPy dtype of the buffer (default float32; bfloat16 needs "
                        "ml_dtypes)")
    parser.add_argument("--op", default="sum", help="sum, mean, min or max (default sum)")
    parser.add_argument(
        "--iters", "-n", type=_positive_int, default=None,
        help="timed rounds per size (every algorithm runs once per round). Default: "
        "adaptive, so each (size, algorithm) gets about --time-per-point seconds, "
        "clamped to [--min-iters, --max-iters]")
    parser.add_argument("--warmup", "-w", type=_nonnegative_int, default=None,
                        help="warm-up rounds per size (default: adaptive, at least 3, "
                        "until about 10%% of the measured time is spent, at most 100)")
    parser.add_argument("--time-per-point", type=_positive_float, default=3.0,
                        metavar="SECONDS",
                        help="adaptive --iters aims at this much measured time per (size, "
                        "algorithm) (default 3.0)")
    parser.add_argument("--min-iters", type=_positive_int, default=5,
                        help="fewest timed rounds of the adaptive count (default 5)")
    parser.add_argument("--max-iters", type=_positive_int, default=1000,
                        help="most timed rounds of the adaptive count (default 1000)")
    parser.add_argument("--ranks-per-node", type=_positive_int, default=None,
                        help="virtual node size for hierarchical algorithms (default: "
                        "$MPISTRAT_RANKS_PER_NODE, else physical nodes)")
    parser.add_argument("--json", metavar="FILE", help="write every sample and the run's "
                        "metadata as JSON (rewritten after each size)")
    parser.add_argument("--markdown", metavar="FILE",
                        help="write the table and the targets as Markdown")
    parser.add_argument("--quiet", "-q", action="store_true",
                        help="no progress on stderr")
    args = parser.parse_args(argv)
    if args.maxbytes < args.minbytes:
        parser.error(f"--maxbytes ({args.maxbytes}) is below --minbytes ({args.minbytes})")
    if args.stepfactor < 2:
        parser.error("--stepfactor must be at least 2")
    if args.min_iters > args.max_iters:
        parser.error(f"--min-iters ({args.min_iters}) exceeds --max-iters ({args.max_iters})")
    from mpistrat.ops import ReduceOp

    try:
        args.op = ReduceOp.parse(args.op)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        args.dtype = _dtype(args.dtype)
    except TypeError as exc:
        parser.error(str(exc))
    if args.dtype.kind == "c" and args.op.primitive.name in ("MIN", "MAX"):
        parser.error(f"{args.op.name} is not defined for complex dtype {args.dtype}")
    return args


def _dtype(name: str) -> np.dtype:
    if name.lower() == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError("dtype bfloat16 needs the ml_dtypes package") from None
        return np.dtype(ml_dtypes.bfloat16)
    try:
        dtype = np.dtype(name)
    except TypeError:
        raise TypeError(f"unknown dtype {name!r}") from None
    if dtype.kind not in "fiuc":
        raise TypeError(f"dtype {name!r} is not numeric (float, int, uint, complex)")
    return dtype


def sizes(minbytes: int, maxbytes: int, factor: int) -> list[int]:
    out, size = [], minbytes
    while size <= maxbytes:
        out.append(size)
        size *= factor
    return out


# -------------------------------------------------------------------------------------
# what is measured
# -------------------------------------------------------------------------------------


@dataclass
class Entry:
    """One algorithm of the sweep: a registry name and its shards."""

    label: str  # as shown: "xring#2"
    alg: str
    shards: int


@dataclass
class Cell:
    """The result for one (size, algorithm)."""

    entry: Entry
    nbytes: int
    count: int
    samples: np.ndarray  # seconds, max over ranks, one per timed iteration
    wrong: int
    warmup: int
    per_rank_median: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return float(np.median(self.samples))

    def algbw(self) -> float:
        return self.nbytes / self.median / 1e9 if self.median > 0 else math.inf

    def busbw(self, ranks: int) -> float:
        return self.algbw() * 2 * (ranks - 1) / ranks


def parse_algorithms(text: str | None, ranks: int) -> list[Entry]:
    """The entries to time, 'native' first (raises ValueError on a bad name)."""
    from mpistrat import algorithms
    from mpistrat.spec import parse_spec

    if text is None:
        tokens = []
        for name in algorithms.names():
            if algorithms.get(name).needs_gpu:
                continue
            tokens.append(name)
            if name == "xring":
                tokens.append("xring#2")
            elif name == "pscpu":
                tokens.append(f"pscpu#{ranks}")  # every rank gathers one piece
    else:
        tokens = [t.strip() for t in text.split(",") if t.strip()]
        if not tokens:
            raise ValueError("--algorithms is empty")
    entries: list[Entry] = []
    seen: set[tuple[str, int]] = set()
    for token in tokens:
        spec = parse_spec(token)  # alg[#shards]; unknown names get "did you mean"
        if len(spec) != 1:
            raise ValueError(f"--algorithms entry {token!r} is a spec with several entries; "
                             f"give one algorithm[#shards] per comma")
        alg, shards, _limit = spec[0]
        if algorithms.get(alg).needs_gpu:
            raise ValueError(f"algorithm {alg!r} needs GPUs; this benchmark times host "
                             f"(NumPy) buffers")
        key = (alg, shards)
        if key in seen:
            continue
        seen.add(key)
        entries.append(Entry(alg if shards == 1 else f"{alg}#{shards}", alg, shards))
    if ("native", 1) not in seen:
        entries.insert(0, Entry("native", "native", 1))
    else:
        entries.sort(key=lambda e: (e.alg, e.shards) != ("native", 1))
    return entries


def fill_pattern(buf: np.ndarray, rank: int) -> None:
    """Small integers 1..15 (exact sums in any order), different on every rank and with a
    long period, so a misplaced or missing piece shows up as wrong elements."""
    step = 1 << 22
    for start in range(0, buf.size, step):
        index = np.arange(start, min(start + step, buf.size), dtype=np.int64)
        values = (index * 40503 + rank * 7919) % 65521 % 15 + 1
        buf[start:start + index.size] = values.astype(buf.dtype)


def format_size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def _us(seconds: float) -> str:
    us = seconds * 1e6
    return f"{us:.1f}" if us < 1000 else f"{us:.0f}"


def _gbps(value: float) -> str:
    if not math.isfinite(value):
        return "inf"
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.2f}"


COLUMNS = [
    # (header, width, right-aligned)
    ("size", 9, True), ("algorithm", 12, False), ("iters", 5, True),
    ("median us", 10, True), ("min us", 10, True), ("max us", 10, True),
    ("algbw GB/s", 10, True), ("busbw GB/s", 10, True),
    ("busbw/nat", 9, True), ("time/nat", 8, True), ("#wrong", 6, True),
]


def row_values(cell: Cell, native: Cell | None, ranks: int) -> list[str]:
    bw_ratio = time_ratio = None
    if native is not None and cell.median > 0 and native.median > 0:
        bw_ratio = native.median / cell.median  # = busbw / native busbw (same bytes)
        time_ratio = cell.median / native.median
    return [
        format_size(cell.nbytes), cell.entry.label, str(len(cell.samples)),
        _us(cell.median), _us(float(cell.samples.min())), _us(float(cell.samples.max())),
        _gbps(cell.algbw()), _gbps(cell.busbw(ranks)),
        _ratio(bw_ratio), _ratio(time_ratio), str(cell.wrong),
    ]


def set_label_width(entries: list[Entry]) -> None:
    """Widen the algorithm column to the longest label (the rows are printed as they come)."""
    widest = max(len(e.label) for e in entries)
    COLUMNS[1] = (COLUMNS[1][0], max(COLUMNS[1][1], widest), COLUMNS[1][2])


def text_row(values: list[str]) -> str:
    parts = []
    for value, (_h, width, right) in zip(values, COLUMNS):
        parts.append(value.rjust(width) if right else value.ljust(width))
    return "  ".join(parts).rstrip()


def text_header() -> str:
    header = text_row([h for h, _w, _r in COLUMNS])
    rule = text_row(["-" * w for _h, w, _r in COLUMNS])
    return f"{header}\n{rule}"


def markdown_table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(h for h, _w, _r in COLUMNS) + " |",
             "|" + "|".join("---:" if r else ":---" for _h, _w, r in COLUMNS) + "|"]
    lines += ["| " + " | ".join(v.replace("|", "\\|") for v in row) + " |" for row in rows]
    return "\n".join(lines)


# -------------------------------------------------------------------------------------
# the targets of the issue
# -------------------------------------------------------------------------------------

TARGETS = [
    # (name, predicate on bytes, metric, threshold)
    ("busbw >= 1.5x native at >= 32 MiB", lambda b: b >= 32 * MiB, "busbw", 1.5),
    ("busbw >= 1.0x native at 4-16 MiB", lambda b: 4 * MiB <= b <= 16 * MiB, "busbw", 1.0),
    ("latency <= 3x native at <= 4 KiB", lambda b: b <= 4 * KiB, "time", 3.0),
]


def evaluate_targets(results: dict[int, dict[str, Cell]]) -> list[dict[str, Any]]:
    """Best of the xring/rechd/pscpu entries (any shards, correct results only) against
    native, at every measured size of each target's range."""
    out = []
    for name, in_range, metric, threshold in TARGETS:
        checks = []
        for nbytes in sorted(results):
            if not in_range(nbytes):
                continue
            cells = results[nbytes]
            native = cells.get("native")
            candidates = [c for c in cells.values()
                          if c.entry.alg in FLAT_TARGET_FAMILIES and c.wrong == 0]
            if native is None or not candidates or native.median <= 0:
                continue
            best = min(candidates, key=lambda c: c.median)
            if metric == "busbw":
                value = native.median / best.median
                ok = value >= threshold
            else:
                value = best.median / native.median
                ok = value <= threshold
            checks.append({"bytes": nbytes, "size": format_size(nbytes),
                           "best": best.entry.label, "ratio": value, "pass": ok,
                           "best_us": best.median * 1e6, "native_us": native.median * 1e6})
        status = ("NOT MEASURED" if not checks
                  else "PASS" if all(c["pass"] for c in checks) else "FAIL")
        out.append({"target": name, "metric": f"{metric} ratio", "threshold": threshold,
                    "status": status, "sizes": checks})
    return out


def targets_text(targets: list[dict[str, Any]], markdown: bool = False) -> str:
    lines = []
    for target in targets:
        head = f"{target['status']:<12}  {target['target']}"
        lines.append(f"- **{target['status']}** {target['target']}" if markdown else head)
        for check in target["sizes"]:
            mark = "ok " if check["pass"] else "BAD"
            kind = "busbw" if target["metric"].startswith("busbw") else "time"
            detail = (f"{check['size']:>9}: best {check['best']} {kind} ratio "
                      f"{check['ratio']:.2f} ({check['best_us']:.1f} us vs native "
                      f"{check['native_us']:.1f} us)")
            lines.append(f"  - {mark} {detail}" if markdown else f"    {mark}  {detail}")
    return "\n".join(lines)


# -------------------------------------------------------------------------------------
# the measurement
# -------------------------------------------------------------------------------------


class Sweep:
    def __init__(self, args: argparse.Namespace, comm: Any, MPI: Any, entries: list[Entry]):
        from mpistrat import algorithms

        self.args, self.comm, self.MPI, self.entries = args, comm, MPI, entries
        self.algorithms = algorithms
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def _run(self, entry: Entry, buf: np.ndarray, backend: Any, rotation: int) -> None:
        self.algorithms.run(entry.alg, self.comm, buf, op=self.args.op, shards=entry.shards,
                            backend=backend, rotation=rotation,
                            ranks_per_node=self.args.ranks_per_node)

    def _reference(self, pristine: np.ndarray, backend: Any) -> np.ndarray:
        ref = pristine.copy()
        if ref.dtype.char in self.MPI._typedict and ref.dtype.kind in "fiuc":
            self.comm.Allreduce(self.MPI.IN_PLACE, ref, op=self.args.op.mpi_op())
        else:  # e.g. bfloat16: MPI has no type for it; native wraps a user-defined op
            from mpistrat.algorithms import native

            native.all_reduce(self.comm, ref, op=self.args.op, backend=backend)
        return ref

    def _timed(self, entry: Entry, buf: np.ndarray, pristine: np.ndarray, backend: Any,
               rotation: int) -> float:
        MPI, comm, run, args = self.MPI, self.comm, self.algorithms.run, self.args
        alg, shards, op, rpn = entry.alg, entry.shards, args.op, args.ranks_per_node
        np.copyto(buf, pristine)  # outside the timed region
        comm.Barrier()
        t0 = MPI.Wtime()
        run(alg, comm, buf, op=op, shards=shards, backend=backend, rotation=rotation,
            ranks_per_node=rpn)
        return MPI.Wtime() - t0

    def measure(self, nbytes: int) -> tuple[dict[str, Cell], dict[str, Any]]:
        from mpistrat.backends import get_backend

        args, comm, MPI = self.args, self.comm, self.MPI
        E = len(self.entries)
        started = time.perf_counter()
        count = nbytes // args.dtype.itemsize
        buf = np.empty(count, dtype=args.dtype)
        pristine = np.empty(count, dtype=args.dtype)
        fill_pattern(pristine, self.rank)
        np.copyto(buf, pristine)
        backend = get_backend(buf)

        # 1. correctness: one iteration of each algorithm against comm.Allreduce
        ref = self._reference(pristine, backend)
        wrong_local = np.zeros(E, dtype=np.int64)
        for e, entry in enumerate(self.entries):
            np.copyto(buf, pristine)
            self._run(entry, buf, backend, 0)
            wrong_local[e] = int(np.count_nonzero(buf != ref))
        del ref
        wrong = np.zeros_like(wrong_local)
        comm.Allreduce(wrong_local, wrong, op=MPI.SUM)

        gc.collect()
        checked = time.perf_counter()
        gc.disable()
        try:
            # 2. warm-up rounds (timed, to size the adaptive iteration count)
            warm: list[list[float]] = [[] for _ in range(E)]
            budget = args.time_per_point * E
            rounds = 0
            w0 = time.perf_counter()
            while True:
                if args.warmup is not None:
                    if rounds >= args.warmup:
                        break
                else:
                    go = None
                    if self.rank == 0:
                        go = rounds < 3 or (rounds < 100
                                            and time.perf_counter() - w0 < 0.1 * budget)
                    if not comm.bcast(go, root=0):
                        break
                for e in range(E):
                    k = (e + rounds) % E
                    warm[k].append(self._timed(self.entries[k], buf, pristine, backend,
                                               rounds))
                rounds += 1
            if args.iters is not None:
                iters = args.iters
            else:
                # estimate each algorithm's time from the second half of its warm-up
                # (max over ranks); with no warm-up, one extra timed round estimates it
                if rounds == 0:
                    for e in range(E):
                        warm[e].append(self._timed(self.entries[e], buf, pristine,
                                                   backend, 0))
                est = np.array([float(np.median(w[len(w) // 2:])) for w in warm])
                comm.Allreduce(MPI.IN_PLACE, est, op=MPI.MAX)
                iters = None
                if self.rank == 0:
                    per_round = max(float(est.sum()), 1e-9)
                    iters = int(min(args.max_iters,
                                    max(args.min_iters, math.ceil(budget / per_round))))
                iters = comm.bcast(iters, root=0)

            # 3. timed rounds, round-robin with a rotating start
            warmed = time.perf_counter()
            times = np.zeros((iters, E), dtype=np.float64)
            for it in range(iters):
                for e in range(E):
                    k = (e + it) % E
                    times[it, k] = self._timed(self.entries[k], buf, pristine, backend,
                                               rounds + it)
        finally:
            gc.enable()
        timed = time.perf_counter()
        local_median = np.median(times, axis=0)
        comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)  # each iteration: its slowest rank
        medians = comm.gather(local_median, root=0)
        elapsed = time.perf_counter() - started
        del buf, pristine
        gc.collect()

        cells = {}
        for e, entry in enumerate(self.entries):
            cells[entry.label] = Cell(
                entry, count * args.dtype.itemsize, count, times[:, e].copy(), int(wrong[e]),
                rounds, [float(m[e]) for m in medians] if medians is not None else [])
        return cells, {"iters": iters, "warmup": rounds, "seconds": elapsed,
                       "setup_check_s": checked - started, "warmup_s": warmed - checked,
                       "timed_s": timed - warmed}


# -------------------------------------------------------------------------------------
# metadata and output
# -------------------------------------------------------------------------------------


def metadata(comm: Any, args: argparse.Namespace, entries: list[Entry],
             size_list: list[int]) -> dict[str, Any]:
    """Collective: every rank calls it; the result is meaningful on rank 0."""
    import mpi4py

    import mpistrat
    from mpistrat.info import collect_info

    info = collect_info(comm, gpus=False)
    if comm.Get_rank() != 0:
        return {}
    git = git_state(Path(__file__).resolve().parent.parent)
    hosts = sorted({r["host"] for r in info["ranks"]})
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "hosts": hosts,
        "ranks": comm.Get_size(),
        "nodes": info["nodes"],
        "ranks_per_node": info["ranks_per_node"],
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "mpi_library": " ".join(info["mpi"]["library_version"].split()),
        "mpi_vendor": info["mpi"]["vendor"],
        "mpi4py": mpi4py.__version__,
        "numpy": np.__version__,
        "mpistrat": mpistrat.__version__,
        "git": git,
        "argv": sys.argv,
        "options": {
            "algorithms": [e.label for e in entries],
            "sizes": size_list,
            "dtype": str(args.dtype),
            "op": args.op.name,
            "iters": args.iters if args.iters is not None else "adaptive",
            "warmup": args.warmup if args.warmup is not None else "adaptive",
            "time_per_point_s": args.time_per_point,
            "min_iters": args.min_iters,
            "max_iters": args.max_iters,
            "ranks_per_node": args.ranks_per_node,
            "env_ranks_per_node": os.environ.get("MPISTRAT_RANKS_PER_NODE"),
        },
        "method": "per size: one correctness iteration per algorithm vs comm.Allreduce; "
                  "warm-up rounds; timed rounds (each algorithm once per round, start "
                  "rotating); iteration = Barrier, Wtime, run, Wtime; buffer refilled from "
                  "a pristine copy before every iteration (untimed); sample = max over "
                  "ranks; algbw = bytes / median; busbw = algbw * 2(n-1)/n; GB = 1e9 B",
        "info": info,
    }


def write_json(path: str, meta: dict[str, Any], results: dict[int, dict[str, Cell]],
               runs: dict[int, dict[str, Any]], ranks: int,
               targets: list[dict[str, Any]] | None) -> None:
    records = []
    for nbytes in sorted(results):
        cells = results[nbytes]
        native = cells.get("native")
        for label, cell in cells.items():
            ratio = (native.median / cell.median
                     if native is not None and cell.median > 0 else None)
            records.append({
                "bytes": cell.nbytes,
                "size": format_size(cell.nbytes),
                "count": cell.count,
                "algorithm": label,
                "alg": cell.entry.alg,
                "shards": cell.entry.shards,
                "warmup": cell.warmup,
                "iters": len(cell.samples),
                "samples_s": [float(x) for x in cell.samples],
                "median_s": cell.median,
                "min_s": float(cell.samples.min()),
                "max_s": float(cell.samples.max()),
                "per_rank_median_s": cell.per_rank_median,
                "algbw_GBps": cell.algbw(),
                "busbw_GBps": cell.busbw(ranks),
                "busbw_ratio_to_native": ratio,
                "time_ratio_to_native": 1 / ratio if ratio else None,
                "wrong": cell.wrong,
            })
    document = {"meta": meta, "sizes": {str(k): v for k, v in sorted(runs.items())},
                "results": records, "targets": targets, "complete": targets is not None}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(document, fh, indent=1, allow_nan=False, default=str)
        fh.write("\n")
    os.replace(tmp, path)


def write_markdown(path: str, meta: dict[str, Any], rows: list[list[str]],
                   targets: list[dict[str, Any]], seconds: float) -> None:
    opts = meta["options"]
    git = meta.get("git") or {}
    commit = (git.get("commit") or "unknown")[:12] + (" (dirty)" if git.get("dirty") else "")
    text = [
        f"### All-reduce sweep: {meta['ranks']} ranks, {opts['dtype']} {opts['op']}",
        "",
        f"- date: {meta['date']}; host(s): {', '.join(meta['hosts'])} "
        f"({meta['cpus']} CPUs, {meta['platform']})",
        f"- MPI: {meta['mpi_library']}; mpi4py {meta['mpi4py']}; numpy {meta['numpy']}; "
        f"Python {meta['python']}; mpistrat {meta['mpistrat']} @ {commit}",
        f"- iterations: {opts['iters']} (warm-up {opts['warmup']})"
        + (f", about {opts['time_per_point_s']} s measured per point, within "
           f"[{opts['min_iters']}, {opts['max_iters']}]" if opts['iters'] == "adaptive" else "")
        + f"; the sweep took {seconds:.0f} s",
        f"- command: `python -m mpistrat.launch -n {meta['ranks']} -- python "
        f"{shlex.join(meta['argv'])}`",
        "- times: median/min/max over timed iterations of the slowest rank's time; "
        "algbw = bytes / median (GB = 1e9 B); busbw = algbw × 2(n−1)/n; "
        "busbw/nat and time/nat: ratios to `native` at the same size; "
        "#wrong: elements (summed over ranks) differing from `comm.Allreduce` in one "
        "checked iteration",
        "",
        markdown_table(rows),
        "",
        "Targets (best of xring/rechd/pscpu, any shards, vs native):",
        "",
        targets_text(targets, markdown=True),
        "",
    ]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(text))


def progress_bar(total: int, quiet: bool) -> Any:
    if quiet:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, file=sys.stderr, unit="size", dynamic_ncols=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    from mpi4py import MPI

    from mpistrat.layout import check_spec
    from mpistrat.topology import get_topology

    comm = MPI.COMM_WORLD.Dup()
    rank, n = comm.Get_rank(), comm.Get_size()

    # validation: deterministic, so every rank reaches the same verdict
    try:
        entries = parse_algorithms(args.algorithms, n)
        topology = get_topology(comm, args.ranks_per_node)
        notes = []
        for entry in entries:
            for finding in check_spec([(entry.alg, entry.shards)], topology.layout()):
                if finding.level == "error":
                    raise ValueError(finding.message)
                if finding.entry is not None:
                    notes.append(finding.message.replace("entry 0 ", "", 1))
    except ValueError as exc:
        if rank == 0:
            print(f"allreduce_sweep.py: error: {exc}", file=sys.stderr)
        comm.Free()
        return 2
    size_list = [s for s in sizes(args.minbytes, args.maxbytes, args.stepfactor)
                 if s >= args.dtype.itemsize]
    if not size_list:
        if rank == 0:
            print(f"allreduce_sweep.py: error: no size in [{args.minbytes}, "
                  f"{args.maxbytes}] holds one {args.dtype} element", file=sys.stderr)
        comm.Free()
        return 2

    set_label_width(entries)
    meta = metadata(comm, args, entries, size_list)
    out = sys.stdout
    if rank == 0:
        print(f"# mpistrat all-reduce sweep: {n} ranks on {', '.join(meta['hosts'])} "
              f"({meta['nodes']} node(s)); {meta['mpi_library']}", file=out)
        print(f"# mpi4py {meta['mpi4py']}, numpy {meta['numpy']}, mpistrat "
              f"{meta['mpistrat']}; dtype {args.dtype}, op {args.op.name}; sizes "
              f"{format_size(size_list[0])} .. {format_size(size_list[-1])} "
              f"(x{args.stepfactor}); iters "
              f"{args.iters or 'adaptive'}, warm-up "
              f"{args.warmup if args.warmup is not None else 'adaptive'}", file=out)
        print(f"# algorithms: {', '.join(e.label for e in entries)}", file=out)
        for note in dict.fromkeys(notes):
            print(f"# note: {note}", file=out)
        if n == 1:
            print("# note: one rank: every algorithm is a no-op and busbw is 0", file=out)
        print(text_header(), file=out, flush=True)

    sweep = Sweep(args, comm, MPI, entries)
    results: dict[int, dict[str, Cell]] = {}
    runs: dict[int, dict[str, Any]] = {}
    rows: list[list[str]] = []
    bar = progress_bar(len(size_list), args.quiet) if rank == 0 else None
    t_start = time.perf_counter()
    for index, nbytes in enumerate(size_list):
        if bar is not None:
            bar.set_postfix_str(format_size(nbytes))
        cells, run = sweep.measure(nbytes)
        if rank != 0:
            continue
        results[nbytes], runs[nbytes] = cells, run
        native = cells.get("native")
        lines = []
        for cell in cells.values():
            values = row_values(cell, native, n)
            rows.append(values)
            lines.append(text_row(values))
        text = "\n".join(lines)
        if bar is not None:
            bar.write(text, file=out)
            bar.update(1)
        else:
            print(text, file=out, flush=True)
            if not args.quiet:
                print(f"[{index + 1}/{len(size_list)}] {format_size(nbytes)}: "
                      f"{run['iters']} rounds, {run['warmup']} warm-up, "
                      f"{run['seconds']:.1f} s", file=sys.stderr, flush=True)
        if args.json:
            write_json(args.json, meta, results, runs, n, None)
    seconds = time.perf_counter() - t_start
    if bar is not None:
        bar.close()
    if rank == 0:
        targets = evaluate_targets(results)
        wrong = sum(c.wrong for cells in results.values() for c in cells.values())
        print(file=out)
        print("Targets (best of xring/rechd/pscpu, any shards, vs native; "
              "entries with wrong results excluded):", file=out)
        print(targets_text(targets), file=out)
        if wrong:
            print(f"WARNING: {wrong} wrong elements in total (see #wrong)", file=out)
        print(f"# sweep took {seconds:.1f} s", file=out, flush=True)
        if args.json:
            write_json(args.json, meta, results, runs, n, targets)
        if args.markdown:
            write_markdown(args.markdown, meta, rows, targets, seconds)
    comm.Free()
    return 0


def git_state(repo: Path) -> dict[str, Any]:
    """The checkout's commit and whether it has uncommitted changes (for run metadata)."""
    git: dict[str, Any] = {}
    try:
        git["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo,
                                       capture_output=True, text=True,
                                       timeout=10).stdout.strip() or None
        git["dirty"] = bool(subprocess.run(["git", "status", "--porcelain"], cwd=repo,
                                           capture_output=True, text=True,
                                           timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return git


def run_or_abort(main) -> None:
    """Run ``main()`` and exit with its status; an uncaught exception on any rank prints its
    traceback and aborts the whole job (one failing rank would leave the others waiting in
    a collective)."""
    try:
        status = main()
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)
        raise
    sys.exit(status)


if __name__ == "__main__":
    run_or_abort(main)
