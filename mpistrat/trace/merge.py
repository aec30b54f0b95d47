"""One timeline for a job (``mpistrat trace merge DIR -o job.json``).

Every rank's ``ts`` is already on rank 0's clock: the writer added the offset measured at
the start. Clocks drift apart during a run, so ``mpistrat.trace.stop`` measures the offset
again and records it as a final ``clock_sync`` instant; the drift between the two
measurements is corrected linearly in time (an event halfway through the run moves by
half the drift). What remains uncertain is half the round trip of the best measurement
(Cristian's method): that residual skew is reported per rank, with the drift, in the
merged file's ``mpistrat.skew`` and by the command. A rank without ``clock_sync`` (its job
died) keeps the start's offset; its drift is unknown.

The merged file is one Trace Event JSON object that Perfetto and ``chrome://tracing``
open: one process per rank (``pid`` = rank, named ``rank R (host)``), each rank's events
sorted by time, and the run's metadata under ``mpistrat`` (ranks, files, skew), after the
events. It is written one rank at a time (the memory needed is one rank's), next to the
trace directory by default, never into it (HTA reads every ``.json`` of a directory as
one rank's trace).
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass, field
from typing import IO, Any

from .._atomic import exclusive_temporary
from . import TraceError
from .files import MAX_BYTES, RankTrace, RunTraces, read_directory

__all__ = ["Clock", "clock_of", "max_skew", "MergeResult", "merge", "default_output",
           "aligned_events", "MAX_DRIFT"]

MAX_DRIFT = 1e-3
"""The largest drift corrected, as a fraction of the time between the measurements
(1000 ppm; real clocks drift by a few ppm): a larger one is a bad measurement."""


@dataclass(frozen=True)
class Clock:
    """How one rank's times are put on rank 0's clock.

    Attributes:
        rank: the rank.
        round_trip_ns: the start's measurement round trip (-1: it failed, the offset is
            unknown).
        end_round_trip_ns: the stop's (None: no ``clock_sync``).
        end_us: when the stop's measurement was taken (µs, on the start's alignment).
        drift_ns: the offset at the stop less the offset at the start (None: unknown).
        corrected: whether the drift is corrected (known, and not implausibly large).
    """

    rank: int
    round_trip_ns: int
    end_round_trip_ns: int | None = None
    end_us: float | None = None
    drift_ns: int | None = None
    corrected: bool = False

    @property
    def skew_us(self) -> float | None:
        """The residual uncertainty (µs): half the larger round trip of the measurements
        used (None when the start's failed: the rank's clock is not aligned at all)."""
        if self.round_trip_ns < 0:
            return None
        trips = [self.round_trip_ns]
        if self.corrected and self.end_round_trip_ns is not None:
            trips.append(self.end_round_trip_ns)
        return max(trips) / 2000

    def align(self, ts_us: float) -> float:
        """``ts_us`` (the file's) on rank 0's clock, the drift corrected."""
        if not self.corrected or self.drift_ns is None or not self.end_us:
            return ts_us
        return ts_us + self.drift_ns / 1000 * ts_us / self.end_us

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "skew_us": self.skew_us,
                "half_round_trip_us": None if self.round_trip_ns < 0
                else self.round_trip_ns / 2000,
                "end_half_round_trip_us": None if self.end_round_trip_ns is None
                else self.end_round_trip_ns / 2000,
                "drift_us": None if self.drift_ns is None else self.drift_ns / 1000,
                "drift_corrected": self.corrected}

    def describe(self) -> str:
        """A few words on this rank's clock."""
        if self.rank == 0:
            return "the reference clock"
        if self.round_trip_ns < 0:
            return "offset never measured (not aligned)"
        if self.drift_ns is None:
            return "drift unknown (no clock_sync: the job ended before mpistrat.trace.stop)"
        if not self.corrected:
            return (f"drift {self.drift_ns / 1000:.0f} µs implausible (a bad measurement at "
                    f"stop): not corrected")
        return f"drift {self.drift_ns / 1000:+.1f} µs corrected"


def clock_of(trace: RankTrace, warnings: list[str] | None = None) -> Clock:
    """The :class:`Clock` of ``trace``, from its header and its last ``clock_sync``."""
    syncs = [e for e in trace.events if e["ph"] in ("i", "I") and e["name"] == "clock_sync"
             and e.get("cat") == "clock"]
    if trace.round_trip_ns < 0 or not syncs:
        return Clock(trace.rank, trace.round_trip_ns)
    sync = max(syncs, key=lambda e: e["ts"])
    args = sync["args"]
    end_us, trip = float(sync["ts"]), args["round_trip_ns"]
    if trip < 0:                       # the stop's measurement failed
        return Clock(trace.rank, trace.round_trip_ns)
    drift = args["offset_ns"] - trace.offset_ns
    plausible = end_us > 0 and abs(drift) / 1000 <= MAX_DRIFT * end_us
    if not plausible and warnings is not None:
        warnings.append(f"rank {trace.rank}: its clock_sync says the clock drifted "
                        f"{drift / 1000:.0f} µs in {end_us / 1e6:.3f} s, more than "
                        f"{MAX_DRIFT * 1e6:.0f} ppm; a bad measurement: not corrected")
    return Clock(trace.rank, trace.round_trip_ns, trip, end_us, drift, plausible)


@dataclass(frozen=True)
class MergeResult:
    """What :func:`merge` wrote.

    Attributes:
        path: the merged file.
        run: the run id; ``size``: its world size.
        ranks: the ranks merged; ``missing``: those without a file; ``hosts``: each
            merged rank's host.
        events: events written (metadata included).
        clocks: each merged rank's :class:`Clock`.
        warnings: files left out, torn files, skipped events, clocks not corrected.
        bytes: the file's size.
    """

    path: str
    run: str
    size: int
    ranks: list[int]
    missing: list[int]
    hosts: dict[int, str]
    events: int
    clocks: list[Clock]
    warnings: list[str]
    bytes: int

    @property
    def max_skew_us(self) -> float | None:
        """The largest residual skew (None: some rank's clock is not aligned)."""
        return max_skew(self.clocks)


def max_skew(clocks: list[Clock]) -> float | None:
    """The largest residual skew of ``clocks`` (µs; None: one of them is not aligned)."""
    skews = [c.skew_us for c in clocks]
    found = [s for s in skews if s is not None]
    return None if len(found) < len(skews) else max(found, default=0.0)


def default_output(directory: str | os.PathLike[str]) -> str:
    """``DIR/../<DIR's name>-merged.json``: beside the directory, never in it."""
    full = os.path.abspath(os.fspath(directory))
    return os.path.join(os.path.dirname(full), f"{os.path.basename(full) or 'trace'}-merged.json")


def _inside(path: str, directory: str) -> bool:
    parent = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    top = os.path.realpath(directory)
    return parent == top or parent.startswith(top.rstrip(os.sep) + os.sep)


def aligned_events(trace: RankTrace, clock: Clock) -> list[dict[str, Any]]:
    """``trace``'s events for the merged file: its process named ``rank R (host)``,
    metadata first, then the rest sorted by their time on rank 0's clock."""
    meta = [{"ph": "M", "name": "process_name", "pid": trace.rank, "tid": 0,
             "args": {"name": f"rank {trace.rank} ({trace.host})"}},
            {"ph": "M", "name": "process_sort_index", "pid": trace.rank, "tid": 0,
             "args": {"sort_index": trace.rank}}]
    timed = []
    for event in trace.events:
        if event["ph"] == "M":
            if event["name"] not in ("process_name", "process_sort_index"):
                meta.append(event)
            continue
        moved = dict(event)
        start = clock.align(event["ts"])
        moved["ts"] = round(start, 3)
        if event["ph"] == "X":
            moved["dur"] = round(max(clock.align(event["ts"] + event["dur"]) - start, 0.0), 3)
        timed.append(moved)
    timed.sort(key=lambda e: (e["ts"], -e.get("dur", 0.0)))
    return meta + timed


def merge(directory: str | os.PathLike[str], output: str | os.PathLike[str] | None = None,
          *, max_bytes: int = MAX_BYTES) -> MergeResult:
    """Merge the rank files of ``directory`` into one trace (see the module docstring).

    Args:
        directory: the directory of ``mpistrat run --trace DIR``.
        output: the merged file (default :func:`default_output`; ``.gz`` compresses it);
            not inside ``directory``.
        max_bytes: the largest rank file read.

    Raises:
        TraceError: the directory holds no readable rank file, two files of one rank,
            the output lies inside it, or it cannot be written.
    """
    directory = os.fspath(directory)
    out = os.fspath(output) if output is not None else default_output(directory)
    if os.path.isdir(directory) and _inside(out, directory):
        raise TraceError(f"-o {out!r} is inside the trace directory {directory!r}, where "
                         f"HTA would read it as one more rank; write it beside the "
                         f"directory (the default is {default_output(directory)!r})")
    run = read_directory(directory, max_bytes=max_bytes)
    done = _write(out, run)
    warnings = run.warnings() + done.warnings
    for clock in done.clocks:
        if clock.round_trip_ns < 0:
            warnings.append(f"rank {clock.rank}: its clock offset was never measured (the "
                            f"measurement at the start timed out): its times may be off by "
                            f"any amount")
    if not done.clocks:
        os.unlink(out)
        raise TraceError(f"no rank file of {directory!r} can be read: "
                         + "; ".join(warnings[:4]))
    return MergeResult(path=out, run=run.run, size=run.size,
                       ranks=[c.rank for c in done.clocks], missing=run.missing,
                       hosts=done.hosts, events=done.events, clocks=done.clocks,
                       warnings=warnings, bytes=os.path.getsize(out))


@dataclass
class _Written:
    clocks: list[Clock] = field(default_factory=list)
    hosts: dict[int, str] = field(default_factory=dict)
    files: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    base_ns: int | None = None
    events: int = 0


def _metadata(run: RunTraces, done: _Written) -> dict[str, Any]:
    """The merged file's top-level fields other than ``traceEvents`` (written after it:
    what they say is known once every rank is read)."""
    return {
        "distributedInfo": {"backend": "mpistrat", "world_size": run.size,
                            "ranks": [c.rank for c in done.clocks]},
        "schemaVersion": 1,
        "displayTimeUnit": "ms",
        "baseTimeNanoseconds": done.base_ns,
        "mpistrat": {
            "format": 1, "merged": True, "run": run.run, "size": run.size,
            "ranks": done.files, "missing": run.missing,
            "left_out": [{"file": os.path.basename(p), "reason": why}
                         for p, why in run.left_out],
            "skew": {"max_us": max_skew(done.clocks),
                     "ranks": [c.as_dict() for c in done.clocks]},
        },
    }


def _write(out: str, run: RunTraces) -> _Written:
    """Write the merged file, one rank at a time (only one rank's events in memory)."""
    done = _Written()

    def write(raw: IO[bytes]) -> None:
        stream: Any = gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=5) \
            if out.endswith(".gz") else raw
        stream.write(b'{"traceEvents": [')
        separator = b"\n"
        for trace in run.traces():
            clock = clock_of(trace, done.warnings)
            lines = []
            for event in aligned_events(trace, clock):
                try:
                    lines.append(json.dumps(event, allow_nan=False))
                except (ValueError, TypeError, RecursionError):
                    continue            # (args nested too deeply to write again)
            if lines:
                stream.write(separator + ",\n".join(lines).encode())
                separator = b",\n"
            done.events += len(lines)
            done.clocks.append(clock)
            done.hosts[trace.rank] = trace.host
            if done.base_ns is None:
                done.base_ns = trace.base_ns
            done.files.append({"rank": trace.rank, "host": trace.host, "pid": trace.pid,
                               "file": os.path.basename(trace.path),
                               "events": len(trace.events), "skipped": trace.skipped,
                               "torn": trace.torn, "torn_bytes": trace.torn_bytes})
        fields = "".join(f",\n{json.dumps(k)}: {json.dumps(v)}"
                         for k, v in _metadata(run, done).items())
        stream.write(f"\n]{fields}}}\n".encode())
        if stream is not raw:
            stream.close()

    try:
        parent = os.path.dirname(os.path.abspath(out))
        os.makedirs(parent, exist_ok=True)
        with exclusive_temporary(out, 0o666) as (file, temporary):
            write(file)
            file.flush()
            os.fsync(file.fileno())
            os.replace(temporary, out)
    except OSError as exc:
        raise TraceError(f"cannot write the merged trace {out!r}: {exc.strerror or exc}; "
                         f"choose another place with -o") from None
    return done
