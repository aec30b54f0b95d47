"""The trace's hot path: one branch when tracing is off, a tuple appended when it is on.

Instrumented code writes::

    t = recorder.begin()              # 0 when off (no clock read, no allocation)
    ...
    if t:
        recorder.end(t, "all_reduce", recorder.COLLECTIVE, {...})

Events are kept as tuples in a list and formatted by the writer
(:mod:`mpistrat.trace.writer`), never where they happen. Step boundaries
(:func:`boundary`) end one ``ProfilerStep#N`` span and start the next, turn recording on
and off for the step window, and hand the buffer to the writer, which formats it there,
between the two steps. This module imports only the standard library, so that
every layer of mpistrat (the MPI runtime included) can record without an import cycle;
the rest of tracing (starting it over MPI, the writer, the readers) is
:mod:`mpistrat.trace`, above the layers it records.
"""

from __future__ import annotations

import threading
from time import monotonic_ns
from typing import Any

__all__ = ["bus_factor", "on", "begin", "end", "instant", "boundary", "Recorder", "current",
           "STEP", "USER", "COLLECTIVE", "PHASE", "INPUT", "CHECKPOINT", "PS", "FAILURE",
           "TRACE", "WRITE",
           "FROM_STRATEGY", "FROM_INPUT", "FROM_SCRIPT"]

# categories (Kineto's where one exists: steps and user spans are user_annotation, ops
# cpu_op; the classification's intervals, written by the writer, are kernel)
STEP = "user_annotation"
USER = "user_annotation"
COLLECTIVE = "cpu_op"
PHASE = "mpistrat_phase"
INPUT = "input"
CHECKPOINT = "checkpoint"
PS = "ps"
FAILURE = "failure"
TRACE = "trace"
WRITE = "trace write"
"""The span in which a rank formatted and queued a chunk of its trace (between steps)."""

# where a step boundary comes from; a boundary from a lower source is ignored once one
# from a higher source has been seen (a loop over a distributed dataset marks its steps
# at every batch, and its strategy.run calls then count no more)
FROM_STRATEGY = 1
FROM_INPUT = 2
FROM_SCRIPT = 3

on = False
"""True while events are recorded (a recorder exists and the step is in its window)."""

_active: list[Recorder] = []


def current() -> Recorder | None:
    """The recorder of this process, or None when tracing is off."""
    return _active[0] if _active else None


def begin() -> int:
    """The start of a span: the clock (ns) while recording, else 0."""
    return monotonic_ns() if on else 0


def end(start: int, name: str, cat: str, args: dict[str, Any] | None = None,
        stop: int = 0) -> None:
    """Record the span ``[start, stop]`` (``start`` from :func:`begin`, non-zero;
    ``stop`` a clock reading the caller used too, else now)."""
    if _active:
        _active[0].add(start, (stop or monotonic_ns()) - start, name, cat, args)


def instant(name: str, cat: str, args: dict[str, Any] | None = None) -> None:
    """Record a moment (a stall report, a closure scheduled, a failure)."""
    if on and _active:
        _active[0].add(monotonic_ns(), -1, name, cat, args)


def boundary(source: int) -> None:
    """A step boundary from ``source`` (:data:`FROM_STRATEGY`, ...)."""
    if _active:
        _active[0].boundary(source)


def _set_on(value: bool) -> None:
    global on
    on = value


class Recorder:
    """The events of one rank: a buffer of tuples ``(start_ns, dur_ns, name, cat, args,
    thread)`` (``dur_ns`` -1 for an instant), the step counter and the window.

    Args:
        steps: the window ``(first, stop)``: steps ``first <= step < stop`` are recorded
            (``stop`` None: no end). The time before the first boundary belongs to step 0.
        max_events: events kept per step; more are counted as dropped.
        sink: called with each full buffer (a list it then owns) and the step it ends
            at, from the thread that ends the step, between two steps: the writer
            formats it there (:data:`WRITE`, its span, lies between the steps).
        flush_events: hand the buffer over at a boundary once it holds this many events
            (a chunk is whole steps; a rank killed mid-run loses what it recorded since).
        flush_seconds: or once this long has passed since the last hand-over.
        align_steps: either at a step that is a multiple of this: ranks in lockstep
            format their chunks in the same gap between two steps instead of one
            waiting in a collective while the other formats. Not for long steps (of
            ``flush_seconds / align_steps`` or more, where a chunk's formatting is a
            small part of one step), nor for the first step and the window's end, nor
            for a buffer of 8 × ``flush_events``: those are handed over at once.
    """

    def __init__(self, steps: tuple[int, int | None], max_events: int,
                 sink: Any, flush_events: int = 512, flush_seconds: float = 1.0,
                 align_steps: int = 16) -> None:
        self.first, self.stop = steps
        self.max_events = max_events
        self.sink = sink
        self.flush_events = flush_events
        self.flush_ns = int(flush_seconds * 1e9)
        self.align_steps = max(1, align_steps)
        self.handed = 0  # (the first step is handed over at once: a job that dies
        #                    early still leaves it)
        self.buffer: list[tuple] = []
        self.step = 0
        self.source = 0
        self.step_start = monotonic_ns()
        self.thread = threading.get_native_id()  # the thread that marks the steps
        self.closed = -1          # the step close_step ended (a partial step, once)
        self.in_step = 0          # events recorded in this step
        self.dropped = 0          # events dropped over the whole run
        self.lock = threading.Lock()  # (only around handing the buffer over)

    def in_window(self, step: int) -> bool:
        return self.first <= step and (self.stop is None or step < self.stop)

    def add(self, start: int, dur: int, name: str, cat: str, args: Any) -> None:
        if self.in_step >= self.max_events:
            self.dropped += 1
            return
        self.in_step += 1
        self.buffer.append((start, dur, name, cat, args, threading.get_native_id()))

    def boundary(self, source: int) -> None:
        if source < self.source:
            return
        self.source = source
        now = monotonic_ns()
        self.thread = threading.get_native_id()
        if on and self.closed != self.step:
            self.buffer.append((self.step_start, now - self.step_start,
                                f"ProfilerStep#{self.step}", STEP, {"step": self.step},
                                self.thread))
        self.step += 1
        ended = self.step_start
        self.step_start = now
        self.in_step = 0
        was = on
        _set_on(self.in_window(self.step))
        if was and not on:
            # the window ends: a zero-length mark of the next step, so that tools that
            # leave out a trace's last step as incomplete (HTA) leave out only this
            self.buffer.append((now, 0, f"ProfilerStep#{self.step}", STEP,
                                {"step": self.step, "partial": True}, self.thread))
            self.closed = self.step
        if not self.buffer:
            return
        if not self.handed or not on or len(self.buffer) >= 8 * self.flush_events or (
                (len(self.buffer) >= self.flush_events or now - self.handed >= self.flush_ns)
                and (self.step % self.align_steps == 0
                     or now - ended >= self.flush_ns // self.align_steps)):
            self.handed = now
            self.hand_over()
            # (the next step starts once its chunk is written: the writer's time is
            # its own span between the steps, not part of either)
            self.step_start = monotonic_ns()
            if on:
                self.buffer.append((now, self.step_start - now, WRITE, TRACE, None,
                                    self.thread))

    def hand_over(self) -> None:
        """Give the buffer to the sink (a new list takes its place)."""
        with self.lock:
            events, self.buffer = self.buffer, []
        if events:
            self.sink(events, self.step)

    def close_step(self) -> None:
        """End the current step's span where tracing stops or the process is about to
        end (a last, partial step; once per step, on the thread that marks the steps,
        whichever thread calls this)."""
        if on and self.closed != self.step:
            self.closed = self.step
            self.buffer.append((self.step_start, monotonic_ns() - self.step_start,
                                f"ProfilerStep#{self.step}", STEP,
                                {"step": self.step, "partial": True}, self.thread))


def install(recorder: Recorder | None) -> None:
    """Make ``recorder`` this process's (None: tracing off)."""
    _active[:] = [recorder] if recorder is not None else []
    _set_on(recorder is not None and recorder.in_window(recorder.step))


# -- the collectives' bus bandwidth, as nccl-tests define it (the spans carry it)

def bus_factor(collective: str, size: int) -> float:
    """busbw / algbw for ``collective`` (Kineto's ``Collective name``: ``allreduce``,
    ``all_gather``, ``reduce_scatter_tensor``, ...) over ``size`` ranks: 2(n-1)/n for
    all-reduce, (n-1)/n for all-gather, reduce-scatter and all-to-all, 1 for the others,
    0 on one rank."""
    found = _BUS_FACTORS.get((collective, size))
    if found is not None:
        return found
    kind = collective.lower().replace("_", "").replace("-", "")
    if size <= 1:
        found = 0.0
    elif "allreduce" in kind:
        found = 2 * (size - 1) / size
    elif any(k in kind for k in ("allgather", "reducescatter", "alltoall")):
        found = (size - 1) / size
    else:
        found = 1.0
    if len(_BUS_FACTORS) < 256:  # (every traced collective asks: remembered)
        _BUS_FACTORS[collective, size] = found
    return found


_BUS_FACTORS: dict[tuple[str, int], float] = {}
