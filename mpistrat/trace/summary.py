"""Where each step's time went, and who everyone waited for (``mpistrat trace summary``).

From the rank files of one run (:mod:`mpistrat.trace.files`), for the steps that every
rank recorded whole:

* **the breakdown**, per step and rank: compute, communication (of which hidden behind
  compute), waiting for the other ranks (the collectives' agreements) and waiting for
  input. It is read from the classification the writer put in each file as kernel events
  (:mod:`mpistrat.trace.classify`): the same intervals HTA's temporal breakdown reads, so
  the two agree. A step whose kernel events did not all reach the file (a torn end) is
  classified again from its events.
* **the stragglers**: the ranks' agreements of one collective are matched (the same
  ``seq`` on the collective's communicator in the same step, else the k-th agreement of
  the step) and put on rank 0's clock (:mod:`mpistrat.trace.merge`): the rank whose
  agreement starts last arrived last, and the others waited for it from the second-to-last
  arrival on. The rank that kept the others waiting longest in a step is that step's
  straggler; the summary names the ranks that are stragglers most often and by how much.
* **the slowest collectives** by (name, bytes): each call's time is the shortest of its
  ranks' (the last to arrive waits least, so that is the collective itself), with algbw
  and busbw (nccl-tests' definitions) and, given an ``mpistrat bench`` result, the bench's
  busbw at the same size and the ratio.
"""

from __future__ import annotations

import bisect
import math
import os
import statistics
from collections import Counter
from dataclasses import asdict, astuple, dataclass, field
from typing import Any

from ..runtime.recorder import bus_factor
from . import TraceError, classify
from .files import MAX_BYTES, RankTrace, event_tuples, ranges, read_directory
from .merge import Clock, clock_of, max_skew

__all__ = ["Breakdown", "StepRow", "RankTotals", "Straggler", "CollectiveStats", "Summary",
           "BenchCurve", "summarize", "bus_factor"]

_KERNEL_KIND = {name: key for key, name in (
    ("compute", classify.KERNEL_NAMES[classify.COMPUTE_STREAM]),
    ("communication", classify.KERNEL_NAMES[classify.COMM_STREAM]),
    ("waiting", classify.KERNEL_NAMES[classify.WAIT_STREAM]),
    ("input", classify.KERNEL_NAMES[-1]))}
_KINDS = ("compute", "communication", "waiting", "input")

Interval = tuple[int, int]


@dataclass(frozen=True)
class Breakdown:
    """Time (ms) of one step, or of several added up, on one rank.

    ``communication`` counts all of it, ``hidden`` the part that overlapped compute (on
    another thread): ``compute + communication - hidden + waiting + input`` is the step.
    """

    step_ms: float = 0.0
    compute_ms: float = 0.0
    communication_ms: float = 0.0
    hidden_ms: float = 0.0
    waiting_ms: float = 0.0
    input_ms: float = 0.0

    @property
    def exposed_communication_ms(self) -> float:
        return self.communication_ms - self.hidden_ms

    def __add__(self, other: Breakdown) -> Breakdown:
        return Breakdown(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def scaled(self, factor: float) -> Breakdown:
        return Breakdown(*(a * factor for a in astuple(self)))


@dataclass(frozen=True)
class StepRow:
    """One step on one rank; ``source``: ``"kernels"`` (the file's classification) or
    ``"events"`` (classified again: the step's kernel events were incomplete)."""

    step: int
    rank: int
    breakdown: Breakdown
    source: str = "kernels"


@dataclass(frozen=True)
class RankTotals:
    """One rank over the steps summarized: ``total`` added up, ``mean`` per step."""

    rank: int
    host: str
    steps: int
    total: Breakdown
    mean: Breakdown


@dataclass(frozen=True)
class Straggler:
    """A rank the others waited for.

    Attributes:
        rank: the rank.
        last: steps in which it kept the others waiting longest (the step's straggler),
        of: steps with a collective matched across ranks.
        collectives_last: collectives it arrived last at, of ``collectives`` matched.
        mean_delay_ms, median_delay_ms, max_delay_ms: in the steps it was the straggler
            of, how long the others waited for it (its arrival less the second-to-last's,
            added up over the step's collectives).
        total_delay_ms: that wait over every collective it arrived last at.
    """

    rank: int
    last: int
    of: int
    collectives_last: int
    collectives: int
    mean_delay_ms: float
    median_delay_ms: float
    max_delay_ms: float
    total_delay_ms: float


@dataclass(frozen=True)
class CollectiveStats:
    """The calls of one collective at one size.

    Attributes:
        name, bytes: the collective's span name and its bytes per rank (None: unknown).
        collective, group_size, algorithm: from its args (Kineto's names, mpistrat's
            algorithm), the most common value.
        count: calls (matched across ranks).
        mean_ms, median_ms: a call's time, the shortest of its ranks'.
        algbw_GBps, busbw_GBps: bytes / mean time, times nccl-tests' bus factor.
        bench_busbw_GBps, bench_label, bench_how: ``mpistrat bench``'s best busbw at this
            size (``"exact"``, or ``"interpolated A..B"`` between the sizes measured), the
            entry that reached it; None without a bench result or a point at this size.
        ratio: busbw / bench busbw.
    """

    name: str
    bytes: int | None
    collective: str
    group_size: int
    algorithm: str
    count: int
    mean_ms: float
    median_ms: float
    algbw_GBps: float | None
    busbw_GBps: float | None
    bench_busbw_GBps: float | None = None
    bench_label: str | None = None
    bench_how: str | None = None
    ratio: float | None = None


@dataclass(frozen=True)
class Summary:
    """What :func:`summarize` found (``to_dict()`` for JSON)."""

    directory: str
    run: str
    size: int
    ranks: list[int]
    hosts: dict[int, str]
    missing: list[int]
    steps: list[int]
    left_out_steps: list[int]
    per_step: list[StepRow]
    totals: list[RankTotals]
    stragglers: list[Straggler]
    collectives: list[CollectiveStats]
    clocks: list[Clock]
    warnings: list[str] = field(default_factory=list)
    bench: str | None = None

    @property
    def max_skew_us(self) -> float | None:
        return max_skew(self.clocks)

    def to_dict(self) -> dict[str, Any]:
        def breakdown(b: Breakdown) -> dict[str, float]:
            found = {k: round(v, 4) for k, v in asdict(b).items()}
            found["exposed_communication_ms"] = round(b.exposed_communication_ms, 4)
            return found

        return {
            "directory": self.directory, "run": self.run, "size": self.size,
            "ranks": self.ranks, "hosts": {str(r): h for r, h in self.hosts.items()},
            "missing": self.missing, "steps": self.steps,
            "left_out_steps": self.left_out_steps,
            "skew": {"max_us": self.max_skew_us, "ranks": [c.as_dict() for c in self.clocks]},
            "totals": [{"rank": t.rank, "host": t.host, "steps": t.steps,
                        "total": breakdown(t.total), "mean": breakdown(t.mean)}
                       for t in self.totals],
            "per_step": [{"step": s.step, "rank": s.rank, "source": s.source,
                          **breakdown(s.breakdown)} for s in self.per_step],
            "stragglers": [asdict(s) for s in self.stragglers],
            "collectives": [asdict(c) for c in self.collectives],
            "bench": self.bench, "warnings": self.warnings,
        }


# -- one rank's steps -------------------------------------------------------------------------


def _used(event: dict[str, Any]) -> bool:
    """Whether the summary reads ``event``: steps, their classification, and what it is
    made of (collectives, agreements, input waits)."""
    cat = event.get("cat")
    return cat in ("kernel", "cpu_op", "input") \
        or (cat == "mpistrat_phase" and event["name"] == "agreement") \
        or (cat == "user_annotation" and event["name"].startswith("ProfilerStep#"))


@dataclass
class _Step:
    step: int
    start: int                     # ns, the file's clock
    stop: int
    partial: bool
    parts: list[tuple] = field(default_factory=list)
    kernels: dict[str, list[Interval]] = field(default_factory=dict)
    source: str = "kernels"


@dataclass
class _Rank:
    """What the summary keeps of one rank once its events are read (not the events: its
    agreements and collectives go into :class:`_Matches`)."""

    rank: int
    host: str
    clock: Clock
    steps: dict[int, _Step]


def _steps_of(tuples: list[tuple]) -> dict[int, _Step]:
    found: dict[int, _Step] = {}
    for e in sorted(tuples, key=lambda e: e[0]):
        if e[3] == "user_annotation" and e[1] >= 0 and e[2].startswith("ProfilerStep#"):
            if e[1] == 0 and (e[4] or {}).get("partial") is True:
                continue  # the mark of the step after the window (for HTA), not a step
            number = e[4]["step"]
            step = found.get(number)
            if step is None:
                step = found[number] = _Step(number, e[0], e[0] + e[1], False)
            step.start, step.stop = min(step.start, e[0]), max(step.stop, e[0] + e[1])
            step.partial = (e[4] or {}).get("partial") is True   # (its last part's)
            step.parts.append(e)
    for e in tuples:
        if e[3] == "kernel" and e[2] in _KERNEL_KIND:
            step = found.get(e[4]["step"])
            if step is not None:
                step.kernels.setdefault(_KERNEL_KIND[e[2]], []).append((e[0], e[0] + e[1]))
    return found


def _breakdown(intervals: dict[str, list[Interval]], start: int, stop: int) -> Breakdown:
    parts = {k: classify.union([(max(a, start), min(b, stop)) for a, b in intervals.get(k, [])])
             for k in _KINDS}
    hidden = classify.overlap(parts["communication"], parts["compute"])
    ms = 1e-6
    return Breakdown(step_ms=(stop - start) * ms,
                     compute_ms=classify.total(parts["compute"]) * ms,
                     communication_ms=classify.total(parts["communication"]) * ms,
                     hidden_ms=classify.total(hidden) * ms,
                     waiting_ms=classify.total(parts["waiting"]) * ms,
                     input_ms=classify.total(parts["input"]) * ms)


def _complete(step: _Step) -> bool:
    """Whether the step's kernel events cover it (they always do when all were written)."""
    covered = classify.total(classify.union(
        [(max(a, step.start), min(b, step.stop)) for spans in step.kernels.values()
         for a, b in spans]))
    return abs(covered - (step.stop - step.start)) <= 1000 + (step.stop - step.start) // 1000


def _read(trace: RankTrace, matches: _Matches, warnings: list[str]) -> _Rank:
    """What the summary needs of ``trace``: its steps with their intervals (classified
    again where the kernel events are incomplete); its agreements and collectives are
    added to ``matches``."""
    tuples = event_tuples([e for e in trace.events if _used(e)])
    steps = _steps_of(tuples)
    again: dict[int, dict[str, list[Interval]]] | None = None
    for step in steps.values():
        if _complete(step):
            continue
        if again is None:             # classify the events again, once per rank
            again = {}
            for found in classify.steps([e for e in tuples if e[3] != "kernel"]):
                merged = again.setdefault(found["step"], {})
                for key in _KINDS:
                    merged.setdefault(key, []).extend(found[key])
        step.kernels, step.source = again.get(step.step, {}), "events"
    clock = clock_of(trace, warnings)
    agreements = [e for e in tuples if e[1] >= 0 and e[2] == "agreement"
                  and e[3] == "mpistrat_phase"]
    for match, agreement in _matched(agreements, steps).items():
        matches.arrive(match, trace.rank, clock.align(agreement[0] / 1000))
    calls = [e for e in tuples if e[1] >= 0 and e[3] == "cpu_op"]
    for match, call in _matched(calls, steps).items():
        matches.call(match, call)
    return _Rank(trace.rank, trace.host, clock, steps)


# -- stragglers and collectives ---------------------------------------------------------------


def _matched(events: list[tuple], steps: dict[int, _Step]) -> dict[tuple, tuple]:
    """``events`` inside ``steps``, by a key the ranks share: ``(step, name, "seq", seq,
    n)`` (the n-th with that seq), else ``(step, name, "k", k)``."""
    spans = sorted((s.start, s.stop, s.step) for s in steps.values())
    starts = [s[0] for s in spans]
    seen: Counter[tuple] = Counter()
    found = {}
    for e in sorted(events, key=lambda e: e[0]):
        i = bisect.bisect_right(starts, e[0]) - 1
        if i < 0 or e[0] >= spans[i][1]:
            continue
        args = e[4] or {}
        base = (spans[i][2], e[2], "seq", args["seq"]) if "seq" in args \
            else (spans[i][2], e[2], "k")
        key = base + (seen[base],)
        seen[base] += 1
        found[key] = e
    return found


class _Matches:
    """The ranks' agreements and collectives matched by key (see :func:`_matched`), kept
    as they come, one rank at a time: per agreement the count of ranks and the last two
    arrivals; per collective call the count of ranks and the shortest time."""

    def __init__(self) -> None:
        self.arrivals: dict[tuple, list[Any]] = {}   # [ranks, last, its rank, second]
        self.calls: dict[tuple, list[Any]] = {}      # [ranks, shortest ns, args]

    def arrive(self, key: tuple, rank: int, when: float) -> None:
        found = self.arrivals.get(key)
        if found is None:
            self.arrivals[key] = [1, when, rank, -math.inf]
            return
        found[0] += 1
        if (when, rank) > (found[1], found[2]):
            found[1:] = [when, rank, found[1]]
        elif when > found[3]:
            found[3] = when

    def call(self, key: tuple, event: tuple) -> None:
        found = self.calls.get(key)
        if found is None:
            self.calls[key] = [1, event[1], event[4] or {}]
        else:
            found[0] += 1
            found[1] = min(found[1], event[1])

    def stragglers(self, steps: set[int]) -> list[Straggler]:
        caused: dict[int, dict[int, float]] = {}  # step -> rank -> µs the others waited
        last_at: Counter[int] = Counter()
        waited: dict[int, float] = {}
        matched = 0
        for key, (ranks, when, last, second) in self.arrivals.items():
            if ranks < 2 or key[0] not in steps:
                continue
            matched += 1
            mine = caused.setdefault(key[0], {})
            mine[last] = mine.get(last, 0.0) + when - second
            last_at[last] += 1
            waited[last] = waited.get(last, 0.0) + when - second
        delays: dict[int, list[float]] = {}
        for by_rank in caused.values():
            rank, delay = max(by_rank.items(), key=lambda item: (item[1], -item[0]))
            if delay > 0:
                delays.setdefault(rank, []).append(delay)
        found = [Straggler(rank=rank, last=len(d), of=len(caused),
                           collectives_last=last_at[rank], collectives=matched,
                           mean_delay_ms=statistics.fmean(d) / 1000,
                           median_delay_ms=statistics.median(d) / 1000,
                           max_delay_ms=max(d) / 1000, total_delay_ms=waited[rank] / 1000)
                 for rank, d in delays.items()]
        return sorted(found, key=lambda s: (-s.last, -s.total_delay_ms, s.rank))

    def collectives(self, steps: set[int], size: int) -> list[CollectiveStats]:
        groups: dict[tuple[str, int | None], list[list[Any]]] = {}
        for key, found in self.calls.items():
            if key[0] in steps:
                groups.setdefault((key[1], found[2].get("bytes")), []).append(found)
        stats = []
        for (name, nbytes), group in groups.items():
            times = [shortest / 1e6 for _, shortest, _ in group]         # ms
            args = [a for _, _, a in group]
            collective = _common([a.get("Collective name") for a in args
                                  if isinstance(a.get("Collective name"), str)], name)
            group_size = _common([a.get("Group size") for a in args
                                  if type(a.get("Group size")) is int
                                  and a["Group size"] > 0], size)
            algorithm = _common([a.get("algorithm") for a in args
                                 if isinstance(a.get("algorithm"), str)], "")
            mean = statistics.fmean(times)
            algbw = nbytes / (mean * 1e6) if nbytes is not None and mean > 0 else None
            stats.append(CollectiveStats(
                name=name, bytes=nbytes, collective=collective, group_size=group_size,
                algorithm=algorithm, count=len(times), mean_ms=mean,
                median_ms=statistics.median(times), algbw_GBps=algbw,
                busbw_GBps=None if algbw is None
                else algbw * bus_factor(collective, group_size)))
        return sorted(stats, key=lambda c: (-c.mean_ms, c.name))


def _common(values: list[Any], default: Any) -> Any:
    values = [v for v in values if v is not None]
    return Counter(values).most_common(1)[0][0] if values else default


# -- the bench's busbw --------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchCurve:
    """What ``mpistrat bench`` measured, for the summary: the best correct busbw (GB/s)
    at each size in bytes with the entry that reached it, the ranks it ran on, and where
    it came from (:func:`mpistrat.bench.files.read_busbw_curve` reads one)."""

    best: dict[int, tuple[float, str]]
    ranks: int | None
    source: str


def _bench_warnings(bench: BenchCurve, size: int) -> list[str]:
    found = []
    if bench.ranks is not None and bench.ranks != size:
        found.append(f"--bench {bench.source}: measured on {bench.ranks} ranks, the trace's "
                     f"run has {size}: busbw ratios compare different world sizes")
    if not bench.best:
        found.append(f"--bench {bench.source}: no correct measured point to compare with")
    return found


def _with_bench(stats: CollectiveStats, curve: dict[int, tuple[float, str]]) -> CollectiveStats:
    if stats.bytes is None or stats.busbw_GBps is None or \
            "allreduce" not in stats.collective.lower().replace("_", ""):
        return stats                    # (mpistrat bench measures all-reduce)
    sizes = sorted(curve)
    if stats.bytes in curve:
        bw, label = curve[stats.bytes]
        how = "exact"
    else:
        i = bisect.bisect_left(sizes, stats.bytes)
        if i == 0 or i == len(sizes):
            return stats                # outside what the bench measured
        (lo, hi) = sizes[i - 1], sizes[i]
        share = (math.log(stats.bytes) - math.log(lo)) / (math.log(hi) - math.log(lo))
        bw = curve[lo][0] + share * (curve[hi][0] - curve[lo][0])
        label = curve[lo][1] if curve[lo][1] == curve[hi][1] else \
            f"{curve[lo][1]}/{curve[hi][1]}"
        how = f"interpolated {lo}..{hi} B"
    ratio = stats.busbw_GBps / bw if bw > 0 else None
    return CollectiveStats(**{**asdict(stats), "bench_busbw_GBps": bw, "bench_label": label,
                              "bench_how": how, "ratio": ratio})


# -- the summary ----------------------------------------------------------------------------------


def summarize(directory: str | os.PathLike[str], *, bench: BenchCurve | None = None,
              max_bytes: int = MAX_BYTES) -> Summary:
    """Summarize the rank files of ``directory`` (see the module docstring).

    Args:
        directory: the directory of ``mpistrat run --trace DIR``.
        bench: an ``mpistrat bench --json`` result to compare the collectives' busbw with
            (:func:`mpistrat.bench.files.read_busbw_curve`).
        max_bytes: the largest rank file read.

    Raises:
        TraceError: the directory holds no readable rank file, or two files of one rank.
    """
    run = read_directory(directory, max_bytes=max_bytes)
    warnings: list[str] = []
    curve = None
    if bench is not None:
        warnings += _bench_warnings(bench, run.size)
        curve = bench.best
    matches = _Matches()
    ranks = [_read(trace, matches, warnings) for trace in run.traces()]  # (one at a time)
    warnings[:0] = run.warnings()
    if not ranks:
        raise TraceError(f"no rank file of {os.fspath(directory)!r} can be read: "
                         + "; ".join(warnings[:4]))
    whole = [{n for n, s in r.steps.items() if not s.partial} for r in ranks]
    common = sorted(set.intersection(*whole))
    seen = set().union(*(set(r.steps) for r in ranks))
    left_out = sorted(seen - set(common))
    if left_out:
        partial = sorted({n for r in ranks for n, st in r.steps.items() if st.partial})
        warnings.append(f"step{'s' if len(left_out) > 1 else ''} {ranges(left_out)} "
                        f"left out: not recorded whole on every rank"
                        + (f" (step {ranges(partial)} ended where tracing stopped)"
                           if partial else ""))
    if not common:
        warnings.append("no step recorded whole on every rank: nothing to summarize (the "
                        "script marks steps with mpistrat.trace.step(), or the strategy does)")
    rows = sorted((StepRow(n, r.rank, _breakdown(r.steps[n].kernels, r.steps[n].start,
                                                 r.steps[n].stop), r.steps[n].source)
                   for r in ranks for n in common), key=lambda row: (row.step, row.rank))
    redone = sorted({r.rank for r in rows if r.source == "events"})
    if redone:
        warnings.append(f"rank{'s' if len(redone) > 1 else ''} {ranges(redone)}: some "
                        f"steps' classification did not all reach the file; classified "
                        f"again from their events")
    totals = []
    for r in ranks:
        mine = [row.breakdown for row in rows if row.rank == r.rank]
        total = sum(mine, Breakdown())
        totals.append(RankTotals(r.rank, r.host, len(mine), total,
                                 total.scaled(1 / len(mine)) if mine else total))
    collectives = matches.collectives(set(common), run.size)
    if curve:
        collectives = [_with_bench(c, curve) for c in collectives]
    clocks = [r.clock for r in ranks]
    if max_skew(clocks) is None:
        warnings.append("some ranks' clocks were never aligned: who arrived last may be "
                        "wrong for them")
    return Summary(directory=os.fspath(directory), run=run.run, size=run.size,
                   ranks=[r.rank for r in ranks], hosts={r.rank: r.host for r in ranks},
                   missing=run.missing, steps=common, left_out_steps=left_out,
                   per_step=rows, totals=totals, stragglers=matches.stragglers(set(common)),
                   collectives=collectives, clocks=clocks, warnings=warnings,
                   bench=None if bench is None else bench.source)
