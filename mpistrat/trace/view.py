"""A merged trace as one self-contained HTML page (``mpistrat trace view``), for the
machines where Perfetto cannot be reached and ``chrome://tracing`` does not load.

The page needs no network (its script and style are inline, the trace is embedded as JSON
in a ``<script type="application/json">`` tag, and its Content-Security-Policy allows no
request at all). It draws the Trace Event file on a canvas: one band per process (a rank
of a merged trace), one row per thread with nested spans stacked by depth, colours by
category with a legend (click an entry to hide it), a time axis in ms. The mouse wheel
zooms, dragging pans, hovering shows an event's name, duration and args, a double click
shows the whole trace again; ``page.html?from=120&to=180`` opens on a window in ms.

Input is validated before anything is drawn: a file larger than ``max_bytes``, or one
that is not a Trace Event file (a JSON object with a ``traceEvents`` list, or a JSON
array of events), is a :class:`~mpistrat.trace.TraceError`; events of the wrong shape are
skipped and counted by reason, and the page says how many.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import html
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from . import TraceError
from ._view_page import PAGE, SCRIPT

__all__ = ["write_html", "render_html", "load_trace", "prepare", "ViewResult",
           "MAX_BYTES", "MAX_EVENTS"]

MAX_BYTES = 256 * 2**20
"""The largest trace file read (decompressed): about 10 GB of memory to parse in Python."""
MAX_EVENTS = 200_000
"""Events embedded in one page (about 20 MB of HTML, drawn at interactive speed)."""
MAX_NAME = 500            # characters of a name or category kept
MAX_ARGS = 4096           # bytes of one event's args (as JSON) kept
MAX_REASONS = 32          # distinct skip reasons counted separately
_EPSILON = 0.0015         # µs: a span ending this close to the next one's start is before it

_DRAWN = {"X", "i", "I", "M"}
_KNOWN_PHASES = {"B", "E", "C", "b", "n", "e", "s", "t", "f", "P", "N", "O", "D", "S", "T",
                 "p", "F", "R", "c", "(", ")", "v", "V", "G"}
_META_NAMES = {"process_name", "thread_name", "process_sort_index", "thread_sort_index"}

# legend keys: a category, refined where one category holds things worth telling apart
# (steps among user spans, agreements among phases, the classification's streams)
_KEY_LABELS = {
    "step": "step (ProfilerStep#N)",
    "user_annotation": "user_annotation (strategy.run, replica functions, spans)",
    "cpu_op": "cpu_op (collectives)",
    "agreement": "agreement (waiting for the other ranks)",
    "mpistrat_phase": "mpistrat_phase (algorithm phases)",
    "input": "input (waiting for the next batch)",
    "checkpoint": "checkpoint",
    "ps": "ps (parameter-server closures)",
    "failure": "failure",
    "kernel compute": "compute (stream 7)",
    "kernel communication": "communication (stream 8)",
    "kernel waiting": "waiting (stream 9)",
    "kernel input": "input wait (stream 9)",
}
_RANK = {key: i for i, key in enumerate(_KEY_LABELS)}
_KEY_COLORS = {
    "step": "#c5cfdc", "user_annotation": "#4e79a7", "cpu_op": "#f28e2b",
    "agreement": "#e15759", "mpistrat_phase": "#edc948", "input": "#b07aa1",
    "checkpoint": "#76b7b2", "ps": "#9c755f", "failure": "#ff0000",
    "kernel compute": "#59a14f", "kernel communication": "#f28e2b",
    "kernel waiting": "#e15759", "kernel input": "#b07aa1",
    "clock": "#bab0ac", "mpistrat_trace": "#bab0ac",
}
_PALETTE = ["#a0cbe8", "#ffbe7d", "#8cd17d", "#d4a6c8", "#86bcb6", "#ff9d9a", "#f1ce63",
            "#d37295", "#499894", "#fabfd2", "#79706e", "#b6992d"]
_KERNEL_KEYS = {"compute": "kernel compute", "ncclKernel (mpistrat communication)":
                "kernel communication", "waiting Sync": "kernel waiting",
                "input Sync": "kernel input"}


@dataclass(frozen=True)
class ViewResult:
    """What :func:`write_html` wrote.

    Attributes:
        path: the page.
        events: events drawn (spans and instants).
        processes: process bands (ranks).
        skipped: events of the wrong shape, by reason.
        left_out: well-formed events not embedded (outside ``window``, or over
            ``max_events``).
        bytes: the page's size.
    """

    path: str
    events: int
    processes: int
    skipped: dict[str, int] = field(default_factory=dict)
    left_out: int = 0
    bytes: int = 0


def load_trace(path: str | os.PathLike[str], *, max_bytes: int = MAX_BYTES) -> Any:
    """Read a Trace Event file (``.json``, or gzip-compressed) of at most ``max_bytes``.

    Raises:
        TraceError: a missing, oversized or unreadable file, or one that is not JSON.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise TraceError(f"{path!r} is a directory; view one file: merge a run's rank files "
                         f"first (mpistrat trace merge {path} -o job.json) and view job.json, "
                         f"or view one rank-R.json")
    try:
        with open(path, "rb") as f:
            head = f.read(2)
            f.seek(0)
            stream: Any = gzip.GzipFile(fileobj=f) if head == b"\x1f\x8b" else f
            data = stream.read(max_bytes + 1)
    except FileNotFoundError:
        raise TraceError(f"no trace file {path!r}") from None
    except (OSError, EOFError) as exc:
        raise TraceError(f"cannot read the trace {path!r}: {exc}") from None
    if len(data) > max_bytes:
        raise TraceError(
            f"{path!r} is larger than {max_bytes // 2**20} MiB; a page that big does not draw: "
            f"record fewer steps (mpistrat run --trace-steps A:B) or pass a larger max_bytes")
    try:
        return json.loads(data, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise TraceError(
            f"{path!r} is not valid JSON ({exc}); a Trace Event file is expected (a rank "
            f"file torn by a killed job reads again after mpistrat trace merge)") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)


def _ident(value: Any) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or \
        (isinstance(value, str) and len(value) <= MAX_NAME)


def _clip(text: str) -> str:
    return text if len(text) <= MAX_NAME else text[:MAX_NAME - 1] + "\u2026"


def _key(cat: str, name: str) -> str:
    if cat == "user_annotation" and name.startswith("ProfilerStep#"):
        return "step"
    if cat == "mpistrat_phase" and name == "agreement":
        return "agreement"
    if cat == "kernel":
        return _KERNEL_KEYS.get(name, "kernel")
    return cat


def _events_of(trace: Any) -> list[Any]:
    if isinstance(trace, list):
        return trace
    if isinstance(trace, dict):
        events = trace.get("traceEvents")
        if isinstance(events, list):
            return events
        if "traceEvents" in trace:
            raise TraceError(f"traceEvents is a {type(events).__name__}, expected a list of "
                             f"events")
        keys = ", ".join(repr(k) for k in list(trace)[:8])
        raise TraceError(f"not a Trace Event file: a JSON object with a traceEvents list, or "
                         f"a JSON array of events, expected; got an object with keys {keys}")
    raise TraceError(f"not a Trace Event file: a JSON object with a traceEvents list, or a "
                     f"JSON array of events, expected; got a JSON {type(trace).__name__}")


def _check(event: Any) -> str | None:
    """Why ``event`` cannot be drawn (None: it can)."""
    if not isinstance(event, dict):
        return "not an object"
    ph = event.get("ph")
    if ph not in _DRAWN:
        if isinstance(ph, str) and ph in _KNOWN_PHASES:
            return f"phase {ph!r} (not drawn)"
        return "no known phase (ph)"
    if not _ident(event.get("pid", 0)) or not _ident(event.get("tid", 0)):
        return "pid or tid not an integer or a short string"
    args = event.get("args")
    if args is not None and not isinstance(args, dict):
        return "args not an object"
    if ph == "M":
        if event.get("name") not in _META_NAMES:
            return None                       # other metadata: valid, not needed
        key = "name" if event["name"].endswith("_name") else "sort_index"
        value = (args or {}).get(key)
        ok = isinstance(value, str) if key == "name" else \
            isinstance(value, int) and not isinstance(value, bool)
        return None if ok else f"{event['name']} without an args.{key}"
    if not isinstance(event.get("name"), str):
        return "name not a string"
    if not isinstance(event.get("cat", ""), str):
        return "cat not a string"
    if not _number(event.get("ts")):
        return "ts missing or not a finite number"
    if ph == "X" and not (_number(event.get("dur")) and event["dur"] >= 0):
        return "X event without a finite dur >= 0"
    return None


def _flat(value: Any) -> bool:
    kind = type(value)
    return kind is int or kind is bool or value is None or \
        (kind is str and len(value) <= 200) or (kind is float and math.isfinite(value))


def _args(args: dict[str, Any] | None) -> dict[str, Any] | None:
    if not args:
        return None
    if len(args) <= 16 and all(type(k) is str and len(k) <= 64 and _flat(v)
                               for k, v in args.items()):
        return args                 # (most events: a few numbers and short names)
    try:
        text = json.dumps(args, default=str, allow_nan=False)
    except (TypeError, ValueError) as exc:   # NaN, keys that are not strings
        return {"(args)": f"not JSON ({exc}), left out of the page"}
    if len(text) > MAX_ARGS:
        return {"(args)": f"{len(text)} bytes of JSON, left out of the page"}
    return args


def prepare(trace: Any, *, max_events: int = MAX_EVENTS,
            window: tuple[float | None, float | None] | None = None,
            title: str = "trace") -> dict[str, Any]:
    """The page's data from a loaded trace (see :func:`write_html`): processes, threads,
    legend keys, names and the events as ``[ts, dur, name, key, thread, depth, args]``
    (``dur`` -1 for an instant), sorted by time.

    Raises:
        TraceError: not a Trace Event file, or no event that can be drawn.
    """
    events = _events_of(trace)
    if window is not None:
        lo = -math.inf if window[0] is None else window[0] * 1000
        hi = math.inf if window[1] is None else window[1] * 1000
        if not lo < hi:
            raise TraceError(f"the window {window[0]}..{window[1]} ms is empty: "
                             f"'to' must be greater than 'from'")
    skipped: dict[str, int] = {}
    proc_names: dict[Any, str] = {}
    proc_sort: dict[Any, int] = {}
    thread_names: dict[tuple[Any, Any], str] = {}
    thread_sort: dict[tuple[Any, Any], int] = {}
    kept: list[dict[str, Any]] = []
    left_out = 0
    for event in events:
        reason = _check(event)
        if reason is not None:
            if reason not in skipped and len(skipped) >= MAX_REASONS:
                reason = "other"
            skipped[reason] = skipped.get(reason, 0) + 1
            continue
        pid, tid = event.get("pid", 0), event.get("tid", 0)
        if event["ph"] == "M":
            name, args = event.get("name"), event.get("args") or {}
            if name == "process_name":
                proc_names[pid] = _clip(args["name"])
            elif name == "process_sort_index":
                proc_sort[pid] = args["sort_index"]
            elif name == "thread_name":
                thread_names[(pid, tid)] = _clip(args["name"])
            elif name == "thread_sort_index":
                thread_sort[(pid, tid)] = args["sort_index"]
            continue
        if window is not None:
            start = event["ts"]
            stop = start + event["dur"] if event["ph"] == "X" else start
            if stop < lo or start > hi:
                left_out += 1
                continue
        kept.append(event)
    if not kept:
        found = "; ".join(f"{n} {why}" for why, n in skipped.items()) or "none at all"
        where = " in the window" if window is not None and left_out else ""
        raise TraceError(f"no event to draw{where}: X (complete) or i (instant) events with "
                         f"name, ts (and dur) expected; skipped: {found}")
    kept.sort(key=lambda e: (e["ts"], -e["dur"] if e["ph"] == "X" else 0))
    if len(kept) > max_events:
        left_out += len(kept) - max_events
        kept = kept[:max_events]
    return _layout(kept, proc_names, proc_sort, thread_names, thread_sort, skipped,
                   left_out, window, title)


def _layout(kept: list[dict[str, Any]], proc_names: dict[Any, str], proc_sort: dict[Any, int],
            thread_names: dict[tuple[Any, Any], str],
            thread_sort: dict[tuple[Any, Any], int], skipped: dict[str, int], left_out: int,
            window: tuple[float | None, float | None] | None, title: str) -> dict[str, Any]:
    # threads: first those with spans of their own (by first event), then the
    # classification's streams (kernel events only) by tid, then those with instants only
    first: dict[tuple[Any, Any], int] = {}
    own: set[tuple[Any, Any]] = set()      # threads with spans other than kernels
    kernels: set[tuple[Any, Any]] = set()
    for i, event in enumerate(kept):
        where = (event.get("pid", 0), event.get("tid", 0))
        first.setdefault(where, i)
        if event.get("cat") == "kernel":
            kernels.add(where)
        elif event["ph"] == "X":
            own.add(where)
    streams = kernels - own
    group = {w: 0 if w in own else 1 if w in streams else 2 for w in first}
    pids = sorted({p for p, _ in first}, key=lambda p: (proc_sort.get(p, 0), _order(p)))
    threads: list[dict[str, Any]] = []
    index: dict[tuple[Any, Any], int] = {}
    processes = []
    for pid in pids:
        mine = sorted((w for w in first if w[0] == pid),
                      key=lambda w: (thread_sort.get(w, 0), group[w],
                                     _order(w[1]) if w in streams else (0, first[w])))
        rows = []
        for where in mine:
            index[where] = len(threads)
            rows.append(len(threads))
            threads.append({"name": thread_names.get(where, f"thread {where[1]}"),
                            "tid": str(where[1])})
        processes.append({"name": proc_names.get(pid, f"process {pid}"), "pid": str(pid),
                          "threads": rows})
    names: dict[str, int] = {}
    keys: dict[str, int] = {}
    counts: list[int] = []
    stacks: dict[int, list[float]] = {}
    rows_out = []
    for event in kept:
        thread = index[(event.get("pid", 0), event.get("tid", 0))]
        name = _clip(event["name"])
        key = _key(_clip(event.get("cat", "")), name)
        if key not in keys:
            keys[key] = len(keys)
            counts.append(0)
        counts[keys[key]] += 1
        ts = round(event["ts"], 3)
        if event["ph"] == "X":
            dur = round(event["dur"], 3)
            stack = stacks.setdefault(thread, [])
            while stack and stack[-1] <= ts + _EPSILON:
                stack.pop()
            depth = len(stack)
            stack.append(ts + dur)
        else:
            dur, depth = -1, 0
        rows_out.append([ts, dur, names.setdefault(name, len(names)), keys[key], thread,
                         depth, _args(event.get("args"))])
    # the legend in the order of _KEY_LABELS (what a step holds, then the streams),
    # other categories after them by name
    order = sorted(keys, key=lambda k: (_RANK.get(k, len(_RANK)), k))
    renumber = {keys[k]: i for i, k in enumerate(order)}
    for row in rows_out:
        row[3] = renumber[row[3]]
    legend = [{"key": k, "label": _KEY_LABELS.get(k, k or "(no category)"),
               "color": _color(k), "count": counts[keys[k]]} for k in order]
    start = min(e[0] for e in rows_out)
    stop = max(e[0] + max(e[1], 0) for e in rows_out)
    view = None
    if window is not None:
        view = [start / 1000 if window[0] is None else window[0],
                stop / 1000 if window[1] is None else window[1]]
    return {"title": title, "processes": processes, "threads": threads, "keys": legend,
            "names": list(names), "events": rows_out, "span": [start, stop], "view": view,
            "skipped": skipped, "left_out": left_out}


def _order(value: Any) -> tuple[int, Any]:
    return (0, value) if isinstance(value, int) else (1, str(value))


def _color(key: str) -> str:
    if key in _KEY_COLORS:
        return _KEY_COLORS[key]
    digest = hashlib.sha1(key.encode("utf-8", "replace")).digest()
    return _PALETTE[digest[0] % len(_PALETTE)]


def _embed(data: dict[str, Any]) -> str:
    """JSON that cannot end its ``<script>`` tag: ``<``, ``>`` and ``&`` as escapes."""
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_html(data: dict[str, Any]) -> str:
    """The page for :func:`prepare`'s data."""
    digest = base64.b64encode(hashlib.sha256(SCRIPT.encode()).digest()).decode()
    fill = {"TITLE": html.escape(data["title"]), "SCRIPT_HASH": f"sha256-{digest}",
            "SCRIPT": SCRIPT, "DATA": _embed(data)}
    # one pass: what is filled in is never searched for placeholders again
    return re.sub(r"\{\{([A-Z_]+)\}\}", lambda m: fill[m.group(1)], PAGE)


def write_html(trace_path_or_dict: Any, out_path: str | os.PathLike[str], *,
               title: str | None = None, max_events: int = MAX_EVENTS,
               window: tuple[float | None, float | None] | None = None,
               max_bytes: int = MAX_BYTES) -> ViewResult:
    """Write a trace as a self-contained HTML timeline (see the module docstring).

    Args:
        trace_path_or_dict: a Trace Event file (``mpistrat trace merge``'s, or one
            ``rank-R.json``; may be gzip-compressed), or the trace already loaded (a dict
            with ``traceEvents`` or a list of events).
        out_path: the page to write.
        title: shown at the top (default: the file's name, and the run's id if known).
        max_events: events embedded at most (the earliest; the rest are counted as left
            out): a page with millions of events does not draw.
        window: ``(from_ms, to_ms)`` (either may be None): embed only the events that
            overlap this window, and open on it.
        max_bytes: the largest file read.

    Returns:
        A :class:`ViewResult` with what was drawn, skipped and left out.

    Raises:
        TraceError: the file cannot be read, is not a Trace Event file, or has no event
            that can be drawn (the message says which).
    """
    if isinstance(max_events, bool) or not isinstance(max_events, int) or max_events < 1:
        raise TraceError(f"max_events must be a positive integer, got {max_events!r}")
    if isinstance(trace_path_or_dict, (dict, list)):
        trace, source = trace_path_or_dict, "trace"
    else:
        trace = load_trace(trace_path_or_dict, max_bytes=max_bytes)
        source = os.path.basename(os.fspath(trace_path_or_dict))
    if title is None:
        title = source
        info = trace.get("mpistrat") if isinstance(trace, dict) else None
        if isinstance(info, dict) and isinstance(info.get("run"), str):
            title += f" (run {info['run'][:32]})"
    data = prepare(trace, max_events=max_events, window=window, title=title)
    page = render_html(data)
    out = os.fspath(out_path)
    try:
        with open(out, "w", encoding="utf-8") as f:
            f.write(page)
    except OSError as exc:
        raise TraceError(f"cannot write the page {out!r}: {exc}") from None
    return ViewResult(out, len(data["events"]), len(data["processes"]), dict(data["skipped"]),
                      data["left_out"], len(page.encode()))
