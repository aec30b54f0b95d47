"""Reading a run's rank files (``DIR/rank-R.json``), validated before anything uses them.

A rank file is read only if it is a regular file (not a link, a FIFO or a device) of at
most ``max_bytes``, holding a JSON object whose header has the fields the writer writes
(``distributedInfo``, ``baseTimeNanoseconds``, ``mpistrat`` with its run id, rank, size,
host and clock) with the right types and bounds. A file torn at its end (a rank killed
inside a ``write``) is cut back to its last complete event and still read, saying how
many bytes were lost. Events are checked one by one; one of an unknown shape is skipped
and counted by reason, never used.

:func:`read_directory` reads the headers of every rank file of a directory: files that
cannot be read are left out with the reason, files of another run than most are left out
by name, and the ranks of the run without a file are named. :meth:`RunTraces.traces` then
reads the ranks' events one rank at a time, so that the memory needed is one rank's.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from . import TraceError

__all__ = ["RankTrace", "RunTraces", "read_rank", "read_directory", "MAX_BYTES",
           "TIME_LIMIT_US", "event_tuples", "ranges"]

MAX_BYTES = 256 * 2**20
"""The largest rank file read (about 250 steps at the writer's megabyte per step)."""
TIME_LIMIT_US = 1e14
"""The largest ``ts`` or ``dur`` taken (µs: three years)."""
MAX_NAME = 1000           # characters of a name, a category, a host, a run id
MAX_RANKS = 1 << 20       # the largest world size taken
_INT_LIMIT = 2**63
_RANK_FILE = re.compile(r"rank-(\d{1,9})\.json")
_MARKER = '"traceEvents": ['
_PHASES = {"X", "i", "I", "M"}
_META = {"process_name": ("name", str), "thread_name": ("name", str),
         "process_sort_index": ("sort_index", int), "thread_sort_index": ("sort_index", int)}
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


@dataclass(frozen=True)
class RankTrace:
    """One rank's file, validated.

    Attributes:
        path: the file.
        rank, size, run, host, pid: from its header.
        base_ns: rank 0's wall clock (ns since the epoch) when tracing started.
        offset_ns, round_trip_ns: the clock offset measured at the start (already in
            every ``ts``) and its round trip (-1: the measurement failed).
        events: the events that passed the checks (metadata included), as in the file
            (none when only the header was read).
        skipped: events left out, by reason.
        torn: whether the file was torn at its end (its closing brackets missing);
        torn_bytes: the bytes cut off it then (a part of an event).
    """

    path: str
    rank: int
    size: int
    run: str
    host: str
    pid: int
    base_ns: int
    offset_ns: int
    round_trip_ns: int
    events: list[dict[str, Any]] = field(default_factory=list, repr=False)
    skipped: dict[str, int] = field(default_factory=dict)
    torn: bool = False
    torn_bytes: int = 0


@dataclass
class RunTraces:
    """The rank files of one run, their headers read (:meth:`traces` reads the events).

    Attributes:
        directory: where they were read.
        run, size: the run id and world size of most files.
        ranks: the files' headers, by rank (their ``events`` not read yet).
        missing: ranks of the run without a file that could be read.
        left_out: ``(file, reason)`` for each file not read.
        notes: torn files and skipped events, as :meth:`traces` reads them.
        max_bytes: the largest rank file read.
    """

    directory: str
    run: str
    size: int
    ranks: list[RankTrace]
    missing: list[int]
    left_out: list[tuple[str, str]]
    notes: list[str] = field(default_factory=list)
    max_bytes: int = MAX_BYTES

    def traces(self) -> Iterator[RankTrace]:
        """Each rank's file with its events, read and validated one rank at a time; a file
        that cannot be read now (changed since its header was read) is left out, its rank
        missing."""
        for header in self.ranks:
            try:
                trace = read_rank(header.path, max_bytes=self.max_bytes)
                if (trace.run, trace.rank, trace.size) != (header.run, header.rank,
                                                           header.size):
                    raise TraceError(f"{header.path!r} changed while it was read (now rank "
                                     f"{trace.rank} of run {trace.run})")
            except TraceError as exc:
                self.left_out.append((header.path, _reason(exc, header.path)))
                self.missing = sorted(self.missing + [header.rank])
                continue
            name = os.path.basename(trace.path)
            if trace.torn:
                self.notes.append(f"{name} is torn at its end (rank {trace.rank} was killed "
                                  f"while writing): cut back {trace.torn_bytes} bytes to "
                                  f"its last complete event")
            if trace.skipped:
                reasons = "; ".join(f"{n} {why}" for why, n in trace.skipped.items())
                self.notes.append(f"{name}: skipped {sum(trace.skipped.values())} events "
                                  f"of an unknown shape ({reasons})")
            yield trace

    def warnings(self) -> list[str]:
        """What a user should hear about: files left out, missing ranks, and (once
        :meth:`traces` has read them) torn files and skipped events."""
        found = [f"{os.path.basename(path)} left out: {why}" for path, why in self.left_out]
        if self.missing:
            found.append(f"no trace of rank{'s' if len(self.missing) > 1 else ''} "
                         f"{ranges(self.missing)} of {self.size} (run {self.run}): "
                         f"{'they' if len(self.missing) > 1 else 'it'} never started "
                         f"tracing, or the file was left out above")
        return found + self.notes


def _reason(exc: TraceError, path: str) -> str:
    """The message of ``exc`` without the file's name in front."""
    text = str(exc)
    for prefix in (repr(path) + " ", repr(path) + ": "):
        if text.startswith(prefix):
            return text[len(prefix):]
    return text


def ranges(numbers: list[int]) -> str:
    """Sorted ``numbers`` as ranges: ``[2, 3, 4, 7]`` as ``2-4, 7``."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


# -- one file ---------------------------------------------------------------------------------


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


_DECODER = json.JSONDecoder(parse_constant=_no_constant)


def _read_bytes(path: str, max_bytes: int, most: int | None = None) -> bytes:
    """The file's bytes (its first ``most`` only, if given): a regular file, not through
    a link, of at most ``max_bytes``."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK)
    except FileNotFoundError:
        raise TraceError(f"no trace file {path!r}") from None
    except OSError as exc:
        if os.path.islink(path):
            raise TraceError(f"{path!r} is a symbolic link; rank files are read only as "
                             f"the regular files mpistrat's writer makes (copy the file "
                             f"there instead of linking it)") from None
        raise TraceError(f"cannot open the trace {path!r}: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise TraceError(f"{path!r} is not a regular file (a FIFO, a device or a "
                             f"directory); a rank file is a regular file")
        if info.st_size > max_bytes:
            raise TraceError(
                f"{path!r} is {info.st_size / 2**20:.1f} MiB, over the {max_bytes / 2**20:g} "
                f"MiB read per rank file: record fewer steps (mpistrat run --trace-steps "
                f"A:B) or raise the limit (--max-mib)")
        chunks = []
        left = max_bytes + 1 if most is None else most
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as exc:
        raise TraceError(f"cannot read the trace {path!r}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if most is None and len(data) > max_bytes:
        raise TraceError(f"{path!r} grew over the {max_bytes / 2**20:g} MiB read per rank "
                         f"file while it was read; read it once its job has ended")
    return data


def _decode_text(data: bytes, path: str) -> str:
    # a tear can split a UTF-8 character: up to 3 bytes at the very end may be cut
    for cut in range(4):
        try:
            return data[:len(data) - cut].decode("utf-8")
        except UnicodeDecodeError as exc:
            if exc.start < len(data) - 4:
                break
    raise TraceError(f"{path!r} is not UTF-8 text; a rank file is JSON written by "
                     f"mpistrat's writer")


def _parse(data: bytes, path: str) -> tuple[Any, int | None]:
    """The document and the bytes cut off a torn end (None: the file was whole)."""
    text = _decode_text(data, path)
    try:
        return _DECODER.decode(text), None
    except (ValueError, RecursionError) as exc:
        problem = f"{type(exc).__name__}: {str(exc)[:120]}"
    # torn: the header, then one event at a time up to the first that does not parse
    start = text.find(_MARKER)
    if start < 0:
        raise TraceError(f"{path!r} is not valid JSON ({problem}), and not a torn rank file "
                         f"either (no traceEvents list); a rank file written by mpistrat's "
                         f"writer is expected") from None
    try:
        document = _DECODER.decode(text[:start] + '"traceEvents": []}')
    except (ValueError, RecursionError):
        raise TraceError(f"{path!r} is not valid JSON ({problem}), and its header does not "
                         f"parse either; a rank file written by mpistrat's writer is "
                         f"expected") from None
    if not isinstance(document, dict):
        raise TraceError(f"{path!r} is not a JSON object; a rank file is one")
    events: list[Any] = []
    pos = start + len(_MARKER)
    end = pos
    whitespace = re.compile(r"[ \t\r\n]*(,?)[ \t\r\n]*")
    while True:
        match = whitespace.match(text, pos)
        assert match is not None
        if events and not match.group(1):
            break                          # no comma: the list ends (or the file does)
        try:
            event, pos = _DECODER.raw_decode(text, match.end())
        except (ValueError, RecursionError):
            break
        events.append(event)
        end = pos
    document["traceEvents"] = events
    rest = text[end:]
    if rest.lstrip().startswith("]") or (len(rest) > 8 and rest.rstrip().endswith("]}")):
        # the list is whole, or the file goes on to its end after the damage (a tear
        # leaves at most a piece of the old closing brackets): not a torn file
        raise TraceError(f"{path!r} is not valid JSON ({problem}), and not merely torn at "
                         f"its end; a rank file written by mpistrat's writer is "
                         f"expected") from None
    return document, len(data) - len(text[:end].encode("utf-8"))


def _int(value: Any, low: int = -_INT_LIMIT, high: int = _INT_LIMIT) -> bool:
    return type(value) is int and low <= value <= high


def _text(value: Any) -> bool:
    return isinstance(value, str) and len(value) <= MAX_NAME


class _Header:
    """The header's fields, checked; :meth:`fail` names the field."""

    def __init__(self, path: str, document: Any) -> None:
        self.path = path
        if not isinstance(document, dict):
            raise TraceError(f"{path!r} holds a JSON {type(document).__name__}, not an "
                             f"object; a rank file is a JSON object with distributedInfo, "
                             f"mpistrat and traceEvents")
        self.document = document

    def fail(self, name: str, expected: str, value: Any) -> TraceError:
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:45] + "..." + shown[-10:]
        return TraceError(f"{self.path!r}: {name} must be {expected}, got {shown}; a rank "
                          f"file written by mpistrat run --trace (or mpistrat.trace.start) "
                          f"is expected")

    def get(self, where: dict[str, Any], prefix: str, name: str, check: Any,
            expected: str) -> Any:
        if name not in where:
            raise TraceError(f"{self.path!r}: {prefix}{name} is missing; a rank file "
                             f"written by mpistrat run --trace is expected")
        value = where[name]
        if not check(value):
            raise self.fail(prefix + name, expected, value)
        return value

    def section(self, where: dict[str, Any], prefix: str, name: str) -> dict[str, Any]:
        return self.get(where, prefix, name, lambda v: isinstance(v, dict), "an object")


def _time(value: Any, low: float = -TIME_LIMIT_US) -> bool:
    # (NaN fails both comparisons; an int too large for a float compares exactly)
    kind = type(value)
    return (kind is float or kind is int) and low <= value <= TIME_LIMIT_US


def _check_event(event: Any, rank: int) -> str | None:
    """Why ``event`` is of an unknown shape (None: it is known)."""
    if type(event) is not dict:
        return "not an object"
    get = event.get
    ph = get("ph")
    if ph not in _PHASES:
        return "phase not X, i or M"
    pid = get("pid")
    if pid != rank or type(pid) is not int:
        return "pid not the file's rank"
    tid = get("tid")
    if not (type(tid) is int and 0 <= tid <= _INT_LIMIT
            or type(tid) is str and len(tid) <= 100):
        return "tid not an integer >= 0"
    args = get("args")
    if args is not None and type(args) is not dict:
        return "args not an object"
    name = get("name")
    if type(name) is not str or len(name) > MAX_NAME:
        return "name not a string"
    if ph == "M":
        known = _META.get(name)
        if known is None:
            return None                       # other metadata: harmless, passed on
        key, kind = known
        value = (args or {}).get(key)
        ok = _text(value) if kind is str else _int(value)
        return None if ok else f"{name} without an args.{key}"
    cat = get("cat", "")
    if type(cat) is not str or len(cat) > MAX_NAME:
        return "cat not a string"
    if not _time(get("ts")):
        return "ts missing or not a finite number of µs"
    if ph == "X" and not _time(get("dur"), 0.0):
        return "X without a finite dur >= 0"
    if args and (cat in _CHECKED or "seq" in args or "bytes" in args
                 or name.startswith("ProfilerStep#")):
        return _check_args(event, args)
    if name.startswith("ProfilerStep#") or cat in _CHECKED:
        return _check_args(event, {})
    return None


_CHECKED = {"kernel", "clock"}


def _check_args(event: dict[str, Any], args: dict[str, Any]) -> str | None:
    """The args the readers use, where they are used."""
    name, cat = event["name"], event.get("cat")
    if name.startswith("ProfilerStep#") and cat == "user_annotation" and event["ph"] == "X":
        if not _int(args.get("step"), 0):
            return "ProfilerStep without an integer args.step"
    elif cat == "kernel":
        if not _int(args.get("step"), 0) or event["ph"] != "X":
            return "kernel event without an integer args.step"
    elif cat == "clock" and name == "clock_sync":
        if not (_int(args.get("offset_ns")) and _int(args.get("round_trip_ns"), -1)):
            return "clock_sync without integer args.offset_ns and round_trip_ns"
    if "seq" in args and not _int(args["seq"], 0):
        return "args.seq not an integer >= 0"
    if "bytes" in args and not _int(args["bytes"], 0):
        return "args.bytes not an integer >= 0"
    return None


_HEADER_BYTES = 1 << 16


def _header_only(path: str, max_bytes: int) -> dict[str, Any] | None:
    """The header of a file the writer wrote (its fields before ``traceEvents``), read
    from the file's beginning; None where it is not there."""
    data = _read_bytes(path, max_bytes, _HEADER_BYTES)
    text = data.decode("utf-8", errors="replace")
    start = text.find(_MARKER)
    if start < 0:
        return None
    try:
        document = _DECODER.decode(text[:start] + '"traceEvents": []}')
    except (ValueError, RecursionError):
        return None
    if not isinstance(document, dict) or not {"distributedInfo", "mpistrat"} <= set(document):
        return None           # (not the writer's order: the whole file is read instead)
    return document


def read_rank(path: str | os.PathLike[str], *, max_bytes: int = MAX_BYTES,
              header_only: bool = False) -> RankTrace:
    """Read and validate one rank file (see the module docstring).

    Args:
        path: the file.
        max_bytes: the largest file read.
        header_only: read and check the header only (the events are left empty), from
            the file's first 64 KiB where the writer puts it.

    Raises:
        TraceError: the file cannot be read, is too large, is not a JSON object, or its
            header lacks a field or has one of the wrong type (the message names it).
    """
    path = os.fspath(path)
    found = _header_only(path, max_bytes) if header_only else None
    if found is not None:
        document, torn = found, None
    else:
        document, torn = _parse(_read_bytes(path, max_bytes), path)
    header = _Header(path, document)
    info = header.section(document, "", "distributedInfo")
    own = header.section(document, "", "mpistrat")
    rank = header.get(info, "distributedInfo.", "rank", lambda v: _int(v, 0, MAX_RANKS - 1),
                      "an integer >= 0")
    size = header.get(info, "distributedInfo.", "world_size",
                      lambda v: _int(v, 1, MAX_RANKS), f"an integer from 1 to {MAX_RANKS}")
    if rank >= size:
        raise header.fail("distributedInfo.rank", f"less than world_size ({size})", rank)
    header.get(own, "mpistrat.", "format", lambda v: v == 1, "1 (this reader's format)")
    run = header.get(own, "mpistrat.", "run",
                     lambda v: isinstance(v, str) and re.fullmatch(r"[0-9a-f]{1,64}", v),
                     "a run id of hex digits")
    for name, value in (("rank", rank), ("size", size)):
        header.get(own, "mpistrat.", name, lambda v, value=value: v == value and _int(v),
                   f"distributedInfo's value ({value})")
    host = header.get(own, "mpistrat.", "host", _text, "a host name")
    pid = header.get(own, "mpistrat.", "pid", lambda v: _int(v, 0), "an integer >= 0")
    clock = header.section(own, "mpistrat.", "clock")
    offset = header.get(clock, "mpistrat.clock.", "offset_ns", _int, "an integer")
    trip = header.get(clock, "mpistrat.clock.", "round_trip_ns", lambda v: _int(v, -1),
                      "an integer >= -1")
    base = header.get(document, "", "baseTimeNanoseconds", lambda v: _int(v, 0),
                      "an integer >= 0")
    raw = header.get(document, "", "traceEvents", lambda v: isinstance(v, list), "a list")
    if header_only:
        raw = []
    events: list[dict[str, Any]] = []
    skipped: Counter[str] = Counter()
    for event in raw:
        why = _check_event(event, rank)
        if why is None:
            events.append(event)
        else:
            skipped[why] += 1
    return RankTrace(path=path, rank=rank, size=size, run=run, host=host, pid=pid,
                     base_ns=base, offset_ns=offset, round_trip_ns=trip, events=events,
                     skipped=dict(skipped), torn=torn is not None, torn_bytes=torn or 0)


# -- a directory ------------------------------------------------------------------------------


def rank_files(directory: str) -> dict[str, int]:
    """The ``rank-R.json`` files of ``directory``: name to the rank the name gives."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        raise TraceError(f"no trace directory {directory!r}; give the directory of "
                         f"mpistrat run --trace DIR") from None
    except NotADirectoryError:
        raise TraceError(f"{directory!r} is a file, not a directory; give the directory of "
                         f"mpistrat run --trace DIR (mpistrat trace view reads one "
                         f"file)") from None
    except OSError as exc:
        raise TraceError(f"cannot list the trace directory {directory!r}: "
                         f"{exc.strerror or exc}") from None
    found = {}
    for name in names:
        match = _RANK_FILE.fullmatch(name)
        if match:
            found[name] = int(match.group(1))
    return found


def read_directory(directory: str | os.PathLike[str], *,
                   max_bytes: int = MAX_BYTES) -> RunTraces:
    """Read the headers of every ``rank-R.json`` of ``directory`` (see the module
    docstring); :meth:`RunTraces.traces` reads their events.

    Raises:
        TraceError: no such directory, no rank file in it, none that can be read, or two
            files of one run that hold the same rank.
    """
    directory = os.fspath(directory)
    names = rank_files(directory)
    if not names:
        raise TraceError(f"no rank-R.json file in {directory!r}; give the directory of "
                         f"mpistrat run --trace DIR")
    read: list[RankTrace] = []
    left_out: list[tuple[str, str]] = []
    for name in sorted(names, key=lambda n: (names[n], n)):
        path = os.path.join(directory, name)
        try:
            trace = read_rank(path, max_bytes=max_bytes, header_only=True)
        except TraceError as exc:
            left_out.append((path, _reason(exc, path)))
            continue
        if trace.rank != names[name]:
            left_out.append((path, f"its header says rank {trace.rank}, its name rank "
                                   f"{names[name]}; rename it or remove it"))
            continue
        read.append(trace)
    if not read:
        reasons = "; ".join(f"{os.path.basename(p)}: {why}" for p, why in left_out[:4])
        raise TraceError(f"no rank file of {directory!r} can be read ({reasons})")
    runs = Counter((t.run, t.size) for t in read)
    top = max(runs.values())
    # most files win; a tie goes to the run of rank 0, then to the run id's order
    zero = next((t for t in read if t.rank == 0), None)
    (run, size) = min((key for key, n in runs.items() if n == top),
                      key=lambda key: (zero is None or key != (zero.run, zero.size), key))
    kept = []
    for trace in read:
        if (trace.run, trace.size) == (run, size):
            kept.append(trace)
        elif trace.run != run:
            left_out.append((trace.path, f"it is of another run (run id {trace.run}, "
                                         f"{runs[(trace.run, trace.size)]} file(s)) than "
                                         f"most files (run {run}, {top} file(s)): a leftover "
                                         f"of another job; remove it"))
        else:
            left_out.append((trace.path, f"its world size is {trace.size}, the other files' "
                                         f"{size}"))
    by_rank: dict[int, list[RankTrace]] = {}
    for trace in kept:
        by_rank.setdefault(trace.rank, []).append(trace)
    for rank, traces in by_rank.items():
        if len(traces) > 1:
            files = ", ".join(os.path.basename(t.path) for t in traces)
            raise TraceError(f"{files} in {directory!r} all hold rank {rank} of run {run}; "
                             f"one rank writes one file: remove the copies that are not "
                             f"rank-{rank}.json")
    missing = [r for r in range(size) if r not in by_rank]
    return RunTraces(directory=directory, run=run, size=size,
                     ranks=sorted(kept, key=lambda t: t.rank), missing=missing,
                     left_out=left_out, max_bytes=max_bytes)


def event_tuples(events: list[dict[str, Any]]) -> list[tuple]:
    """The spans and instants of validated ``events`` as the classification's tuples
    ``(start_ns, dur_ns, name, cat, args, thread)`` (``dur_ns`` -1 for an instant)."""
    found = []
    for e in events:
        ph = e["ph"]
        if ph == "M":
            continue
        dur = round(e["dur"] * 1000) if ph == "X" else -1
        found.append((round(e["ts"] * 1000), dur, e["name"], e.get("cat", ""),
                      e.get("args"), e["tid"]))
    return found
