"""One rank's trace file, written in closed chunks by a thread of its own.

The file is a Kineto-style JSON object whose first line carries ``distributedInfo`` (HTA
finds the rank there) and whose ``traceEvents`` list always ends in ``]}``: each chunk is
written over the previous closing bracket together with a new one, in one ``write``, so
that the file parses whenever the process dies between two chunks — however it dies (a
``SIGKILL`` inside the ``write`` itself can tear the last chunk: the readers of
:mod:`mpistrat.trace.files` cut such a file back to its last whole event). A
chunk is one buffer from the recorder (whole steps): its events, plus the step's
classification (:mod:`mpistrat.trace.classify`) as Kineto kernel events on the rank's
streams, so that HTA's temporal breakdown works on CPU jobs too.

Timestamps are microseconds on rank 0's clock since the trace started (``ts``), from
this rank's clock plus the offset measured at the start (:mod:`mpistrat.trace.clock`);
``baseTimeNanoseconds`` gives that start on rank 0's wall clock.
"""

from __future__ import annotations

import json
import os
import queue
import threading
from typing import Any

from . import classify

__all__ = ["TraceWriter", "FORMAT", "TRAILER"]

FORMAT = 1
TRAILER = b"\n]}\n"
_ENCODE = json.JSONEncoder(default=str).encode
_QUOTED: dict[str, str] = {}  # strings seen often (names, keys, dtypes), JSON-quoted
_MAX_QUOTED = 4096
_INFINITE = (float("inf"), float("-inf"))


def _quote(text: str) -> str:
    found = _QUOTED.get(text)
    if found is None:
        found = _ENCODE(text)
        if len(_QUOTED) < _MAX_QUOTED and len(text) <= 200:
            _QUOTED[text] = found
    return found


_KEYS: dict[Any, str] = {}  # args keys seen, as '"key": '


def _key(key: Any) -> str:
    found = _KEYS.get(key)
    if found is None:
        found = _quote(str(key)) + ": "
        if len(_KEYS) < _MAX_QUOTED and type(key) is str and len(key) <= 200:
            _KEYS[key] = found
    return found


def _args(args: dict[str, Any]) -> str:
    """``args`` as JSON: flat ints, strings and finite floats (to six significant
    digits) written directly (the encoder costs several microseconds a dict), anything
    else through the encoder."""
    parts = []
    keys = _KEYS
    for key, value in args.items():
        kind = type(value)
        if kind is int:
            text = str(value)
        elif kind is str:
            text = _QUOTED.get(value) or _quote(value)
        elif kind is float and value == value and value not in _INFINITE:
            text = format(value, ".6g")  # (bandwidths, ratios: six digits are plenty)
        elif kind is bool:
            text = "true" if value else "false"
        else:
            text = _ENCODE(value if kind is not float else str(value))
        parts.append((keys.get(key) or _key(key)) + text)
    return "{" + ", ".join(parts) + "}"


class TraceWriter:
    """Formats and writes one rank's events (see the module docstring).

    Args:
        path: the file (created or truncated).
        header: the top-level fields other than ``traceEvents`` (``distributedInfo``
            first), written once.
        rank: the process id of every event (one process per rank in a merged trace).
        offset_ns: this rank's clock to rank 0's (added to every time).
        base_ns: rank 0's clock at the start (subtracted).
    """

    def __init__(self, path: str, header: dict[str, Any], rank: int, offset_ns: int,
                 base_ns: int) -> None:
        self.path = path
        self.rank = rank
        self.shift = offset_ns - base_ns
        self._threads: dict[int, str] = {}
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.bytes = 0
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        self._file = os.fdopen(fd, "wb", buffering=0)
        fields = ",\n".join(f"{json.dumps(key)}: {json.dumps(value)}"
                            for key, value in header.items())
        opening = f"{{{fields},\n\"traceEvents\": [\n".encode()
        first = self._meta("process_name", 0, {"name": f"rank {rank}"}) + ",\n" + \
            self._meta("process_sort_index", 0, {"sort_index": rank})
        for stream, label in classify.STREAM_NAMES.items():
            first += ",\n" + self._meta("thread_name", stream, {"name": label})
        os.write(fd, opening + first.encode() + TRAILER)
        self._pos = len(opening) + len(first.encode())
        self.bytes = self._pos + len(TRAILER)
        self._thread = threading.Thread(target=self._serve, name="mpistrat-trace-writer",
                                        daemon=True)
        self._thread.start()

    def _meta(self, name: str, tid: int, args: dict[str, Any]) -> str:
        return (f'{{"ph": "M", "name": "{name}", "pid": {self.rank}, "tid": {tid}, '
                f'"args": {json.dumps(args)}}}')

    # -- the recorder's side ------------------------------------------------------------
    def put(self, events: list[tuple], step: int) -> None:
        """Queue a buffer of events (whole steps); returns at once."""
        self._queue.put(events)

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until everything queued so far is in the file."""
        done = threading.Event()
        self._queue.put(done)
        done.wait(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, then stop the thread and close the file."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self._file.close()

    # -- the writer's thread ------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                self._write(item)
            except Exception as exc:  # noqa: BLE001 - tracing never ends the job
                self.error = exc

    def _write(self, events: list[tuple]) -> None:
        lines = [self._format(e) for e in events]
        lines += [self._kernel(k) for k in classify.kernels(events)]
        for ident, name in self._new_threads(events):
            lines.append(self._meta("thread_name", ident, {"name": name}))
        if not lines:
            return
        chunk = (",\n" + ",\n".join(lines)).encode()
        self._file.seek(self._pos)
        data = memoryview(chunk + TRAILER)
        while data:  # (a raw write may write less)
            data = data[self._file.write(data) or 0:]
        self._pos += len(chunk)
        self.bytes = self._pos + len(TRAILER)

    def _new_threads(self, events: list[tuple]) -> list[tuple[int, str]]:
        fresh = {e[5] for e in events if e[5] not in self._threads}
        if not fresh:
            return []
        names = {t.native_id: t.name for t in threading.enumerate()}
        found = []
        for ident in sorted(fresh):
            name = names.get(ident, f"thread {ident}")
            if name == "MainThread":
                name = "main"
            self._threads[ident] = name
            found.append((ident, name))
        return found

    def _kernel(self, event: tuple) -> str:
        """:meth:`_format` of a classification's kernel (args ``stream``, ``device`` 0
        and ``step``, written directly: a step's kernels are most of what is written)."""
        start, dur, name, _, args, stream = event
        step = args["step"]
        return (f'{{"ph": "X", "cat": "kernel", "name": {_quote(name)}, "pid": {self.rank}, '
                f'"tid": {stream}, "ts": {(start + self.shift) / 1000:.3f}, '
                f'"dur": {dur / 1000:.3f}, "args": {{"stream": {stream}, "device": 0, '
                f'"step": {step if type(step) is int else _ENCODE(step)}}}}}')

    def _format(self, event: tuple) -> str:
        start, dur, name, cat, args, thread = event
        quoted = _quote(name)
        ts = (start + self.shift) / 1000
        text = (f'{{"ph": "{"i" if dur < 0 else "X"}", "cat": "{cat}", "name": {quoted}, '
                f'"pid": {self.rank}, "tid": {thread}, "ts": {ts:.3f}')
        if dur >= 0:
            text += f', "dur": {dur / 1000:.3f}'
        else:
            text += ', "s": "t"'
        if args:
            text += f', "args": {_args(args) if type(args) is dict else _ENCODE(args)}'
        return text + "}"
