"""One rank's trace file, in closed chunks: formatted by the thread that hands a chunk
over (the training thread, between two steps), written by a thread of its own.

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
        self._heads: dict[tuple, str] = {}  # (name, cat, thread, instant): up to "ts"
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._formatting = threading.RLock()  # (a signal handler may flush mid-format)
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
        """Format a buffer of events (whole steps) on the calling thread and queue the
        text for the writer's thread to write (formatting holds the GIL: in a thread of
        its own it would stall the training thread at random points, and with it every
        rank waiting for this one in a collective; here it runs between two steps, on
        every rank at the same step)."""
        with self._formatting:  # (the chunks' order is the file's)
            try:
                chunk = self._chunk(events)
            except Exception as exc:  # noqa: BLE001 - tracing never ends the job
                self.error = exc
                return
            if chunk:
                self._queue.put(chunk)

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

    def _chunk(self, events: list[tuple]) -> bytes:
        """The text of ``events``, their classification and any new thread's name, as
        the file's next chunk (empty for nothing to write)."""
        lines = self._format_all(events)
        lines += self._format_all(classify.kernels(events))
        for ident, name in self._new_threads(events):
            lines.append(self._meta("thread_name", ident, {"name": name}))
        return (",\n" + ",\n".join(lines)).encode() if lines else b""

    def _write(self, chunk: bytes) -> None:
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

    def _format_all(self, events: list[tuple]) -> list[str]:
        """Each event as one JSON object: ``ph``, ``cat``, ``name``, ``pid``, ``tid``, then
        ``ts`` and ``dur`` (microseconds, three decimals; an instant has ``"s": "t"``
        instead of ``dur``), then ``args``. The fields before ``ts`` are kept per name,
        category and thread (a step's events repeat in every step): formatting is most
        of the writer's work, and the writer's work is most of what tracing costs."""
        heads = self._heads
        shift = self.shift
        lines: list[str] = []
        append = lines.append
        last: Any = None  # (a step's kernels on one stream share their args)
        written = ""
        for start, dur, name, cat, args, thread in events:
            head = heads.get((name, cat, thread, dur < 0)) or \
                self._head(name, cat, thread, dur < 0)
            if dur >= 0:
                text = f'{head}{(start + shift) / 1000:.3f}, "dur": {dur / 1000:.3f}'
            else:
                text = f'{head}{(start + shift) / 1000:.3f}, "s": "t"'
            if not args:
                append(text + "}")
                continue
            if args is not last:
                last = args
                written = _args(args) if type(args) is dict else _ENCODE(args)
            append(f'{text}, "args": {written}}}')
        return lines

    def _head(self, name: str, cat: str, thread: int, instant: bool) -> str:
        """The text of an event up to its ``ts``, kept for the next (``ProfilerStep#N``,
        a new name at every step, is not)."""
        step = name.startswith("ProfilerStep#")
        head = (f'{{"ph": "{"i" if instant else "X"}", "cat": {_quote(cat)}, '
                f'"name": {_ENCODE(name) if step else _quote(name)}, "pid": {self.rank}, '
                f'"tid": {thread}, "ts": ')
        if step:
            return head
        if len(self._heads) >= _MAX_QUOTED:
            self._heads.clear()
        self._heads[name, cat, thread, instant] = head
        return head
