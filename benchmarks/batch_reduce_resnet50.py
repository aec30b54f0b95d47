#!/usr/bin/env python
"""Time ``MultiWorkerAllReduce.batch_reduce`` on a ResNet-50-shaped gradient batch.

Run it under MPI (rank 0 prints; the other ranks only take part)::

    python -m mpistrat.launch -n 2 -- python benchmarks/batch_reduce_resnet50.py \\
        --json results/batch-reduce.json --markdown results/batch-reduce.md

The batch is ResNet-50 v1's 161 float32 gradients (``packing.resnet50_gradient_shapes()``,
25,557,032 elements, 97.5 MiB), each its own array, ``G`` of them per rank
(``--local-replicas``, default 1). Methods, timed in the same run:

* ``per-tensor native``: one ``comm.Allreduce(MPI.IN_PLACE, t)`` per tensor (161 calls);
* ``flat native``: one ``comm.Allreduce`` of a flat buffer with all 25.6 M elements;
* ``flat SPEC``: the spec's algorithm on that flat buffer, called directly:
  ``algorithms.run(alg, comm, buf, op=SUM, shards=shards, backend=...)`` with the entry
  ``parse_spec(SPEC).route(nbytes)`` that a buffer of the total size routes to. This is
  the reference of the 1.2x target: the all-reduce alone, no packing, no API;
* ``flat SPEC (batch_reduce)``: ``MultiWorkerAllReduce(SPEC, num_packs=0).batch_reduce``
  of one 1-D PerReplica of the total size, which adds the API's cost (argument checks,
  the agreement Allreduce, one copy of the input) but no packing;
* ``batch_reduce num_packs=P`` for each ``--num-packs`` value: the 161 tensors
  concatenated and cut into P packs;
* ``batch_reduce agg B/M``: ``num_packs=0`` with ``agg_small_grads_max_bytes=B,
  agg_small_grads_max_group=M`` (runs of small tensors packed, the rest one by one);
* ``batch_reduce no packing``: ``num_packs=0``, one all-reduce per tensor.

Every batch_reduce is ``ops.batch_reduce("sum", pairs)`` with ``pairs = [(v, v) for v in
per_replica_values]`` built once. Method (as ``allreduce_sweep.py``): input of small
integers (sums exact in any order); one checked call of every method, whose results are
compared element by element with ``per-tensor native``'s; warm-up rounds; timed rounds
in which every method runs once, the start rotating each round; one iteration is
``Barrier; t0 = Wtime(); method(); t = Wtime() - t0``; afterwards one ``Allreduce(MAX)``
turns each iteration's time into its slowest rank's. In-place methods get their input
back (copied from a pristine copy) before each iteration, outside the timed region;
with G > 1, adding up the G local components is part of every method's timed work.

Targets of the issue: the best packed batch_reduce (``num_packs`` >= 1) is faster than
``per-tensor native``, and within 1.2x of ``flat SPEC``. See ``benchmarks/README.md``.
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
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from allreduce_sweep import (  # noqa: E402  (small shared helpers)
    git_state,
    run_or_abort,
    _bytes, _nonnegative_int, _positive_int, fill_pattern, format_size)

DEFAULT_SPEC = "rechd"
FASTER_THAN_PER_TENSOR = 1.0  # packed median / per-tensor native median must be below it
FLAT_RATIO_TARGET = 1.2       # packed median / flat SPEC median must be at most this

# -------------------------------------------------------------------------------------
# options (parsed identically on every rank before MPI starts)
# -------------------------------------------------------------------------------------


def _num_packs_list(text: str) -> list[int]:
    values = []
    for token in (t.strip() for t in text.split(",")):
        if not token:
            continue
        try:
            value = int(token)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected integers >= 1, got {token!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(
                f"num_packs values must be >= 1 (num_packs=0 is the 'no packing' and 'agg' "
                f"rows), got {value}")
        if value not in values:
            values.append(value)
    return values


def _bytes_or_zero(text: str) -> int:
    return 0 if text.strip() == "0" else _bytes(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="batch_reduce_resnet50.py",
        description="Time MultiWorkerAllReduce.batch_reduce on ResNet-50's 161 float32 "
        "gradients against per-tensor and flat MPI_Allreduce. Run under MPI: python -m "
        "mpistrat.launch -n 2 -- python benchmarks/batch_reduce_resnet50.py [options]")
    parser.add_argument("--spec", default=DEFAULT_SPEC,
                        help=f"all_reduce_spec of MultiWorkerAllReduce, any spec form "
                        f"(default {DEFAULT_SPEC!r})")
    parser.add_argument("--num-packs", type=_num_packs_list, default=[1, 2, 4],
                        metavar="LIST", help="comma list of num_packs values, each >= 1, "
                        "one row each (default 1,2,4; '' for none)")
    parser.add_argument("--agg-max-bytes", type=_bytes_or_zero, default=64 * 1024,
                        metavar="BYTES", help="agg_small_grads_max_bytes of the 'agg' row "
                        "(num_packs=0), K/M suffixes; 0 drops the row (default 64K)")
    parser.add_argument("--agg-max-group", type=_positive_int, default=16, metavar="M",
                        help="agg_small_grads_max_group of the 'agg' row (default 16)")
    parser.add_argument("--no-unpacked", action="store_true",
                        help="drop the 'batch_reduce no packing' row (161 spec calls)")
    parser.add_argument("--local-replicas", "-G", type=_positive_int, default=1,
                        metavar="G", help="components (CPU replicas) per rank (default 1)")
    parser.add_argument("--iters", "-n", type=_positive_int, default=20,
                        help="timed rounds; every method runs once per round (default 20)")
    parser.add_argument("--warmup", "-w", type=_nonnegative_int, default=3,
                        help="warm-up rounds (default 3)")
    parser.add_argument("--json", metavar="FILE",
                        help="write every sample and the run's metadata as JSON")
    parser.add_argument("--markdown", metavar="FILE",
                        help="write the table and the targets as Markdown")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress on stderr")
    args = parser.parse_args(argv)
    from mpistrat import SpecError, parse_spec

    try:
        args.spec_text = args.spec
        args.spec = parse_spec(args.spec)
    except (SpecError, TypeError, ValueError) as exc:
        parser.error(f"--spec: {exc}")
    return args


# -------------------------------------------------------------------------------------
# the methods
# -------------------------------------------------------------------------------------


@dataclass
class Method:
    label: str
    kind: str  # per-tensor | flat-native | flat-spec | flat-batch | batch
    num_packs: int = 0
    agg_bytes: int = 0
    agg_group: int = 0
    collectives: int = 0  # all-reduce calls (of the spec or MPI) per method call
    plan: str = ""
    ops: Any = None

    @property
    def packed(self) -> bool:
        """A batch_reduce that concatenates the batch (the issue's "packed")."""
        return self.kind == "batch" and self.num_packs > 0


def batch_plan(spec: Any, shapes: list[tuple[int, ...]], num_packs: int, agg_bytes: int,
               agg_group: int) -> tuple[int, str]:
    """What MultiWorkerAllReduce does with the batch: tensors routed by size to spec
    entries, each entry's tensors packed. Returns (all-reduce calls, description)."""
    from mpistrat import packing

    specs = [(s, np.dtype(np.float32)) for s in shapes]
    routed: dict[int, list[int]] = {}
    for i, (shape, dtype) in enumerate(specs):
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        routed.setdefault(spec.index_for(nbytes), []).append(i)
    calls, parts = 0, []
    for entry in sorted(routed):
        plan = packing.plan_tf_packing([specs[i] for i in routed[entry]],
                                       num_packs=num_packs,
                                       agg_small_grads_max_bytes=agg_bytes,
                                       agg_small_grads_max_group=agg_group if agg_bytes else 0)
        calls += len(plan.packs) + len(plan.passthrough)
        alg, shards, _ = spec[entry]
        name = alg if shards == 1 else f"{alg}#{shards}"
        parts.append(f"{name}: {len(routed[entry])} tensors -> {len(plan.packs)} pack(s) "
                     f"+ {len(plan.passthrough)} single(s)")
    return calls, "; ".join(parts)


def build_methods(args: argparse.Namespace, shapes: list[tuple[int, ...]],
                  flat_entry: Any) -> list[Method]:
    from mpistrat import MultiWorkerAllReduce

    spec = args.spec
    spec_label = args.spec_text
    alg, shards, _ = flat_entry
    routed = alg if shards == 1 else f"{alg}#{shards}"
    methods = [
        Method("per-tensor native", "per-tensor", collectives=len(shapes),
               plan=f"{len(shapes)} x MPI_Allreduce"),
        Method("flat native", "flat-native", collectives=1, plan="1 x MPI_Allreduce"),
        Method(f"flat {spec_label}", "flat-spec", collectives=1,
               plan=f"algorithms.run({routed!r}) on the flat buffer"),
        Method(f"flat {spec_label} (batch_reduce)", "flat-batch", collectives=1,
               plan="batch_reduce of one 1-D tensor, num_packs=0",
               ops=MultiWorkerAllReduce(all_reduce_spec=spec, num_packs=0)),
    ]
    for p in args.num_packs:
        calls, plan = batch_plan(spec, shapes, p, 0, 0)
        methods.append(Method(f"batch_reduce num_packs={p}", "batch", num_packs=p,
                              collectives=calls, plan=plan,
                              ops=MultiWorkerAllReduce(all_reduce_spec=spec, num_packs=p)))
    if args.agg_max_bytes:
        calls, plan = batch_plan(spec, shapes, 0, args.agg_max_bytes, args.agg_max_group)
        methods.append(Method(
            f"batch_reduce agg {format_size(args.agg_max_bytes).replace(' ', '')}"
            f"/{args.agg_max_group}", "batch", agg_bytes=args.agg_max_bytes,
            agg_group=args.agg_max_group, collectives=calls, plan=plan,
            ops=MultiWorkerAllReduce(all_reduce_spec=spec, num_packs=0,
                                     agg_small_grads_max_bytes=args.agg_max_bytes,
                                     agg_small_grads_max_group=args.agg_max_group)))
    if not args.no_unpacked:
        calls, plan = batch_plan(spec, shapes, 0, 0, 0)
        methods.append(Method("batch_reduce no packing", "batch", collectives=calls,
                              plan=plan,
                              ops=MultiWorkerAllReduce(all_reduce_spec=spec, num_packs=0)))
    return methods


class Bench:
    """The buffers and one call of each method (collective: every rank builds one)."""

    def __init__(self, args: argparse.Namespace, comm: Any, MPI: Any, methods: list[Method],
                 shapes: list[tuple[int, ...]], flat_entry: Any) -> None:
        from mpistrat import PerReplica, algorithms
        from mpistrat.backends import get_backend
        from mpistrat.ops import ReduceOp

        self.comm, self.MPI, self.methods = comm, MPI, methods
        self.algorithms, self.SUM = algorithms, ReduceOp.SUM
        self.G = G = args.local_replicas
        rank = comm.Get_rank()
        self.shapes = shapes
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.total = int(self.offsets[-1])
        # the G flat inputs (small integers, different on every rank and replica) ...
        self.flat_in = []
        for d in range(G):
            flat = np.empty(self.total, dtype=np.float32)
            fill_pattern(flat, rank * G + d)
            self.flat_in.append(flat)
        # ... and the batch: every gradient its own array, as a model's are
        self.inputs = [[self.flat_in[d][o:o + n].reshape(s).copy()
                        for o, n, s in zip(self.offsets[:-1], self.sizes, shapes)]
                       for d in range(G)]
        self.work = [np.empty(s, dtype=np.float32) for s in shapes]  # per-tensor native
        self.flat = np.empty(self.total, dtype=np.float32)            # flat methods
        self.backend = get_backend(self.flat)
        self.values = [PerReplica([self.inputs[d][i] for d in range(G)])
                       for i in range(len(shapes))]
        self.pairs = [(v, v) for v in self.values]
        self.flat_value = PerReplica(list(self.flat_in))
        self.flat_pairs = [(self.flat_value, self.flat_value)]
        self.flat_alg, self.flat_shards = flat_entry[0], flat_entry[1]

    # -- untimed preparation, then the timed call

    def prepare(self, m: Method) -> None:
        if self.G > 1:
            return  # the methods add the G components up themselves (timed)
        if m.kind == "per-tensor":
            for w, x in zip(self.work, self.inputs[0]):
                np.copyto(w, x)
        elif m.kind in ("flat-native", "flat-spec"):
            np.copyto(self.flat, self.flat_in[0])

    def _local_sum(self, out: np.ndarray, parts: list[np.ndarray]) -> None:
        np.add(parts[0], parts[1], out=out)
        for part in parts[2:]:
            np.add(out, part, out=out)

    def call(self, m: Method, rotation: int) -> Any:
        comm, MPI = self.comm, self.MPI
        if m.kind == "per-tensor":
            if self.G == 1:
                for w in self.work:
                    comm.Allreduce(MPI.IN_PLACE, w)
            else:
                for i, w in enumerate(self.work):
                    self._local_sum(w, [self.inputs[d][i] for d in range(self.G)])
                    comm.Allreduce(MPI.IN_PLACE, w)
            return None
        if m.kind in ("flat-native", "flat-spec"):
            if self.G > 1:
                self._local_sum(self.flat, self.flat_in)
            if m.kind == "flat-native":
                comm.Allreduce(MPI.IN_PLACE, self.flat)
            else:
                self.algorithms.run(self.flat_alg, comm, self.flat, op=self.SUM,
                                    shards=self.flat_shards, backend=self.backend,
                                    rotation=rotation)
            return None
        if m.kind == "flat-batch":
            return m.ops.batch_reduce("sum", self.flat_pairs)
        return m.ops.batch_reduce("sum", self.pairs)

    def timed(self, m: Method, rotation: int) -> float:
        MPI, comm = self.MPI, self.comm
        self.prepare(m)
        comm.Barrier()
        t0 = MPI.Wtime()
        result = self.call(m, rotation)
        t = MPI.Wtime() - t0
        del result  # the results are freed outside the timed region
        return t

    # -- correctness

    def check(self) -> tuple[np.ndarray, int, list[str]]:
        """One call of every method, compared with per-tensor native's results.

        Returns (wrong elements per method summed over ranks, modified input elements
        summed over ranks, problems seen on this rank)."""
        problems: list[str] = []
        E = len(self.methods)
        wrong = np.zeros(E, dtype=np.int64)
        ref = None
        # per-tensor native first: it is the reference
        order = sorted(range(E), key=lambda e: self.methods[e].kind != "per-tensor")
        for e in order:
            m = self.methods[e]
            self.prepare(m)
            result = self.call(m, 0)
            if m.kind == "per-tensor":
                ref = np.concatenate([w.reshape(-1) for w in self.work])
                # sanity: the reference against one flat MPI_Allreduce of the same input
                flat = self.flat_in[0].copy()
                for part in self.flat_in[1:]:
                    flat += part
                self.comm.Allreduce(self.MPI.IN_PLACE, flat)
                wrong[e] = int(np.count_nonzero(ref != flat))
                del flat
            elif m.kind in ("flat-native", "flat-spec"):
                wrong[e] = int(np.count_nonzero(self.flat != ref))
            elif m.kind == "flat-batch":
                wrong[e] = self._compare(m, result, [(0, self.total)], ref, problems,
                                         [(self.total,)])
            else:
                spans = list(zip(self.offsets[:-1].tolist(), self.sizes))
                wrong[e] = self._compare(m, result, spans, ref, problems, self.shapes)
            del result
        modified = 0
        for d in range(self.G):
            for i, x in enumerate(self.inputs[d]):
                o, n = int(self.offsets[i]), self.sizes[i]
                modified += int(np.count_nonzero(x.reshape(-1) != self.flat_in[d][o:o + n]))
        totals = np.zeros(E + 1, dtype=np.int64)
        self.comm.Allreduce(np.append(wrong, modified), totals, op=self.MPI.SUM)
        return totals[:E], int(totals[E]), problems

    def _compare(self, m: Method, result: Any, spans: list[tuple[int, int]], ref: np.ndarray,
                 problems: list[str], shapes: list[tuple[int, ...]]) -> int:
        """Wrong elements of a batch_reduce result; a missing or misshapen tensor counts
        all its elements as wrong, on every replica."""
        wrong = 0
        if not isinstance(result, list) or len(result) != len(spans):
            problems.append(f"{m.label}: returned {type(result).__name__} of "
                            f"{len(result) if hasattr(result, '__len__') else '?'} values, "
                            f"expected {len(spans)}")
            return sum(n for _, n in spans) * self.G
        for i, ((o, n), shape, mirrored) in enumerate(zip(spans, shapes, result)):
            values = list(getattr(mirrored, "values", ()))
            if len(values) != self.G:
                problems.append(f"{m.label}: tensor {i} has {len(values)} component(s), "
                                f"expected {self.G}")
                wrong += n * self.G
                continue
            for v in values:
                v = np.asarray(v)
                if v.shape != tuple(shape) or v.dtype != np.float32:
                    problems.append(f"{m.label}: tensor {i} came back {v.shape} {v.dtype}, "
                                    f"expected {tuple(shape)} float32")
                    wrong += n
                    continue
                wrong += int(np.count_nonzero(v.reshape(-1) != ref[o:o + n]))
        return wrong

    # -- the rounds

    def measure(self, warmup: int, iters: int, quiet: bool) -> tuple[np.ndarray, np.ndarray,
                                                                      list]:
        """Warm-up and timed rounds; returns (times max over ranks, iters x E; this rank's
        medians; the per-rank medians gathered on rank 0)."""
        E = len(self.methods)
        times = np.zeros((iters, E), dtype=np.float64)
        rank0 = self.comm.Get_rank() == 0
        gc.collect()
        gc.disable()
        try:
            t_start = time.perf_counter()
            for r in range(warmup + iters):
                for e in range(E):
                    k = (e + r) % E
                    t = self.timed(self.methods[k], r)
                    if r >= warmup:
                        times[r - warmup, k] = t
                if rank0 and not quiet:
                    what = "warm-up" if r < warmup else "round"
                    index = r + 1 if r < warmup else r - warmup + 1
                    total = warmup if r < warmup else iters
                    print(f"  {what} {index}/{total} ({time.perf_counter() - t_start:.1f} s)",
                          file=sys.stderr, flush=True)
        finally:
            gc.enable()
        local_median = np.median(times, axis=0)
        self.comm.Allreduce(self.MPI.IN_PLACE, times, op=self.MPI.MAX)
        medians = self.comm.gather(local_median, root=0)
        return times, local_median, medians


# -------------------------------------------------------------------------------------
# results, targets and output
# -------------------------------------------------------------------------------------


@dataclass
class Row:
    method: Method
    samples: np.ndarray
    wrong: int
    per_rank_median: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return float(np.median(self.samples))


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}" if seconds < 0.1 else f"{seconds * 1e3:.1f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.2f}"


COLUMNS = [("method", False), ("calls", True), ("iters", True), ("median ms", True),
           ("min ms", True), ("max ms", True), ("algbw GB/s", True),
           ("time/per-tensor", True), ("time/flat spec", True), ("#wrong", True)]


def row_values(row: Row, per_tensor: Row, flat_spec: Row, nbytes: int) -> list[str]:
    med = row.median
    return [row.method.label, str(row.method.collectives), str(len(row.samples)), _ms(med),
            _ms(float(row.samples.min())), _ms(float(row.samples.max())),
            f"{nbytes / med / 1e9:.2f}" if med > 0 else "inf",
            _ratio(med / per_tensor.median if per_tensor.median > 0 else None),
            _ratio(med / flat_spec.median if flat_spec.median > 0 else None),
            str(row.wrong)]


def text_table(rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[c]) for r in rows)) for c, (h, _) in enumerate(COLUMNS)]

    def line(values: list[str]) -> str:
        return "  ".join(v.rjust(w) if right else v.ljust(w)
                         for v, w, (_h, right) in zip(values, widths, COLUMNS)).rstrip()

    return "\n".join([line([h for h, _ in COLUMNS]), line(["-" * w for w in widths])]
                     + [line(r) for r in rows])


def markdown_table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(h for h, _ in COLUMNS) + " |",
             "|" + "|".join("---:" if right else ":---" for _h, right in COLUMNS) + "|"]
    lines += ["| " + " | ".join(v.replace("|", "\\|") for v in r) + " |" for r in rows]
    return "\n".join(lines)


def evaluate_targets(rows: list[Row], spec_label: str) -> list[dict[str, Any]]:
    """The issue's two targets, for every packed batch_reduce (num_packs >= 1) with
    correct results; a target passes when the best of them meets it."""
    per_tensor = next(r for r in rows if r.method.kind == "per-tensor")
    flat_spec = next(r for r in rows if r.method.kind == "flat-spec")
    packed = [r for r in rows if r.method.packed]
    out = []
    for name, base, threshold, strict in (
            ("packed batch_reduce faster than per-tensor native", per_tensor,
             FASTER_THAN_PER_TENSOR, True),
            (f"packed batch_reduce within {FLAT_RATIO_TARGET}x of flat {spec_label}",
             flat_spec, FLAT_RATIO_TARGET, False)):
        checks = []
        base_ok = base.wrong == 0 and base.median > 0
        for r in packed:
            ratio = r.median / base.median if base.median > 0 else math.inf
            ok = base_ok and r.wrong == 0 and (ratio < threshold if strict
                                               else ratio <= threshold)
            checks.append({"method": r.method.label, "ratio": ratio, "pass": ok,
                           "ms": r.median * 1e3, "base_ms": base.median * 1e3,
                           "wrong": r.wrong})
        if not checks:
            status = "NOT MEASURED"
        else:
            status = "PASS" if any(c["pass"] for c in checks) else "FAIL"
        out.append({"target": name, "baseline": base.method.label,
                    "threshold": threshold, "comparison": "<" if strict else "<=",
                    "status": status, "checks": checks})
    return out


def targets_text(targets: list[dict[str, Any]], markdown: bool = False) -> str:
    lines = []
    for t in targets:
        lines.append(f"- **{t['status']}** {t['target']}" if markdown
                     else f"{t['status']:<12}  {t['target']}")
        for c in t["checks"]:
            mark = "ok " if c["pass"] else "BAD"
            detail = (f"{c['method']}: {c['ratio']:.2f}x ({c['ms']:.1f} ms vs "
                      f"{t['baseline']} {c['base_ms']:.1f} ms; target {t['comparison']} "
                      f"{t['threshold']:g})" + (f", {c['wrong']} wrong" if c["wrong"] else ""))
            lines.append(f"  - {mark} {detail}" if markdown else f"    {mark}  {detail}")
    return "\n".join(lines)


def metadata(comm: Any, args: argparse.Namespace, methods: list[Method], tensors: int,
             total: int, flat_entry: Any) -> dict[str, Any]:
    """Collective: every rank calls it; the result is meaningful on rank 0."""
    import mpi4py

    import mpistrat
    from mpistrat.info import collect_info

    info = collect_info(comm, gpus=False)
    if comm.Get_rank() != 0:
        return {}
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "hosts": sorted({r["host"] for r in info["ranks"]}),
        "ranks": comm.Get_size(),
        "nodes": info["nodes"],
        "cpus": os.cpu_count(),
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "mpi_library": " ".join(info["mpi"]["library_version"].split()),
        "mpi4py": mpi4py.__version__,
        "numpy": np.__version__,
        "mpistrat": mpistrat.__version__,
        "git": git_state(Path(__file__).resolve().parent.parent),
        "argv": sys.argv,
        "options": {
            "spec": args.spec_text,
            "spec_entries": [list(e) for e in args.spec],
            "flat_entry": list(flat_entry),
            "num_packs": args.num_packs,
            "agg_small_grads_max_bytes": args.agg_max_bytes,
            "agg_small_grads_max_group": args.agg_max_group,
            "local_replicas": args.local_replicas,
            "iters": args.iters,
            "warmup": args.warmup,
        },
        "batch": {"tensors": tensors, "elements": total,
                  "bytes": total * 4, "dtype": "float32"},
        "methods": [{"label": m.label, "kind": m.kind, "num_packs": m.num_packs,
                     "agg_bytes": m.agg_bytes, "agg_group": m.agg_group,
                     "calls": m.collectives, "plan": m.plan} for m in methods],
        "method": "one checked call of every method against per-tensor native; warm-up "
                  "rounds; timed rounds (every method once per round, start rotating); "
                  "iteration = Barrier, Wtime, call, Wtime; in-place inputs refilled "
                  "before every iteration (untimed); sample = max over ranks",
        "info": info,
    }


def write_json(path: str, meta: dict[str, Any], rows: list[Row], targets: list[dict],
               problems: list[str], modified: int, seconds: float) -> None:
    per_tensor = next(r for r in rows if r.method.kind == "per-tensor")
    flat_spec = next(r for r in rows if r.method.kind == "flat-spec")
    records = [{
        "method": r.method.label, "kind": r.method.kind, "num_packs": r.method.num_packs,
        "agg_bytes": r.method.agg_bytes, "agg_group": r.method.agg_group,
        "calls": r.method.collectives, "plan": r.method.plan,
        "samples_s": [float(x) for x in r.samples], "median_s": r.median,
        "min_s": float(r.samples.min()), "max_s": float(r.samples.max()),
        "per_rank_median_s": r.per_rank_median,
        "time_ratio_to_per_tensor_native": r.median / per_tensor.median,
        "time_ratio_to_flat_spec": r.median / flat_spec.median,
        "wrong": r.wrong,
    } for r in rows]
    document = {"meta": meta, "results": records, "targets": targets,
                "problems": problems, "inputs_modified": modified, "seconds": seconds}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(document, fh, indent=1, allow_nan=False, default=str)
        fh.write("\n")
    os.replace(tmp, path)


def write_markdown(path: str, meta: dict[str, Any], table: list[list[str]],
                   targets: list[dict], methods: list[Method], seconds: float) -> None:
    opts, batch = meta["options"], meta["batch"]
    git = meta.get("git") or {}
    commit = (git.get("commit") or "unknown")[:12] + (" (dirty)" if git.get("dirty") else "")
    load = meta.get("loadavg")
    flat = opts["flat_entry"]
    flat_name = flat[0] if flat[1] == 1 else f"{flat[0]}#{flat[1]}"
    text = [
        f"### batch_reduce on ResNet-50's gradients: {meta['ranks']} ranks x "
        f"{opts['local_replicas']} replica(s), spec `{opts['spec']}`",
        "",
        f"- batch: {batch['tensors']} float32 tensors, {batch['elements']:,} elements "
        f"({batch['bytes'] / 2**20:.1f} MiB), SUM",
        f"- date: {meta['date']}; host(s): {', '.join(meta['hosts'])} ({meta['cpus']} CPUs, "
        f"{meta['platform']})" + (f"; load average at start {load[0]:.2f}" if load else ""),
        f"- MPI: {meta['mpi_library']}; mpi4py {meta['mpi4py']}; numpy {meta['numpy']}; "
        f"Python {meta['python']}; mpistrat {meta['mpistrat']} @ {commit}",
        f"- rounds: {opts['iters']} timed after {opts['warmup']} warm-up, every method once "
        f"per round (start rotating); the run took {seconds:.0f} s",
        f"- command: `python -m mpistrat.launch -n {meta['ranks']} -- python "
        f"{shlex.join(meta['argv'])}`",
        f"- `flat {opts['spec']}` is `algorithms.run({flat_name!r}, ...)` on one flat buffer "
        f"of the batch's total size (the entry that size routes to); `(batch_reduce)` is "
        f"`MultiWorkerAllReduce(num_packs=0).batch_reduce` of that one 1-D tensor",
        "- times: median/min/max over timed iterations of the slowest rank's time; calls: "
        "all-reduces per call; algbw = batch bytes / median (GB = 1e9 B); "
        "#wrong: elements (summed over ranks and replicas) differing from "
        "`per-tensor native` in one checked call",
        "",
        markdown_table(table),
        "",
        "Plans:",
        "",
    ]
    text += [f"- {m.label}: {m.plan}" for m in methods]
    text += ["", "Targets (every packed batch_reduce, num_packs >= 1; PASS when the best "
             "meets it):", "", targets_text(targets, markdown=True), ""]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(text))


# -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    from mpi4py import MPI

    from mpistrat import packing
    from mpistrat.layout import check_spec
    from mpistrat.topology import get_topology

    comm = MPI.COMM_WORLD.Dup()
    rank, n = comm.Get_rank(), comm.Get_size()
    shapes = [tuple(s) for s in packing.resnet50_gradient_shapes()]
    total = sum(int(np.prod(s, dtype=np.int64)) for s in shapes)
    flat_entry = args.spec.route(total * 4)

    # validation: deterministic, so every rank reaches the same verdict
    notes = []
    try:
        layout = get_topology(comm).layout(args.local_replicas)
        for finding in check_spec(args.spec, layout):
            if finding.level == "error":
                raise ValueError(finding.message)
            notes.append(finding.message)
    except ValueError as exc:
        if rank == 0:
            print(f"batch_reduce_resnet50.py: error: {exc}", file=sys.stderr)
        comm.Free()
        return 2

    methods = build_methods(args, shapes, flat_entry)
    meta = metadata(comm, args, methods, len(shapes), total, flat_entry)
    out = sys.stdout
    if rank == 0:
        print(f"# mpistrat batch_reduce, ResNet-50 gradients: {len(shapes)} float32 tensors, "
              f"{total:,} elements ({total * 4 / 2**20:.1f} MiB); {n} ranks x "
              f"{args.local_replicas} replica(s) on {', '.join(meta['hosts'])}; "
              f"{meta['mpi_library']}", file=out)
        print(f"# spec {args.spec_text!r} (flat buffer -> {flat_entry[0]}"
              f"{'' if flat_entry[1] == 1 else '#' + str(flat_entry[1])}); "
              f"{args.iters} rounds after {args.warmup} warm-up; load average "
              f"{meta['loadavg'][0]:.2f}", file=out)
        for m in methods:
            print(f"#   {m.label}: {m.plan}", file=out)
        for note in notes:
            print(f"# note: {note}", file=out)
        if n == 1:
            print("# note: one rank: nothing crosses ranks", file=out)
        out.flush()

    started = time.perf_counter()
    bench = Bench(args, comm, MPI, methods, shapes, flat_entry)
    wrong, modified, problems = bench.check()
    problems_all = comm.gather(problems, root=0)
    if rank == 0 and not args.quiet:
        print(f"  checked every method ({time.perf_counter() - started:.1f} s)",
              file=sys.stderr, flush=True)
    times, _local, medians = bench.measure(args.warmup, args.iters, args.quiet)
    seconds = time.perf_counter() - started
    if rank == 0:
        rows = [Row(m, times[:, e].copy(), int(wrong[e]), [float(md[e]) for md in medians])
                for e, m in enumerate(methods)]
        per_tensor = next(r for r in rows if r.method.kind == "per-tensor")
        flat_spec = next(r for r in rows if r.method.kind == "flat-spec")
        table = [row_values(r, per_tensor, flat_spec, total * 4) for r in rows]
        print(text_table(table), file=out)
        targets = evaluate_targets(rows, args.spec_text)
        print(file=out)
        print("Targets (every packed batch_reduce, num_packs >= 1; PASS when the best "
              "meets it):", file=out)
        print(targets_text(targets), file=out)
        flat_problems = [f"rank {r}: {p}" for r, ps in enumerate(problems_all) for p in ps]
        for p in flat_problems:
            print(f"PROBLEM: {p}", file=out)
        if int(wrong.sum()):
            print(f"WARNING: {int(wrong.sum())} wrong elements in total (see #wrong)",
                  file=out)
        if modified:
            print(f"WARNING: batch_reduce modified {modified} input elements", file=out)
        print(f"# took {seconds:.1f} s", file=out, flush=True)
        if args.json:
            write_json(args.json, meta, rows, targets, flat_problems, modified, seconds)
        if args.markdown:
            write_markdown(args.markdown, meta, table, targets, methods, seconds)
    del bench
    comm.Free()
    return 0


if __name__ == "__main__":
    run_or_abort(main)
