"""Where a step's time went on one rank: compute, communication, waiting, input.

A step is a ``ProfilerStep#N`` span of the thread that marked it (the training thread).
Within it:

* **waiting**: the agreements of its collectives (``agreement`` phases: time this rank
  waited for the last rank to arrive) and **input**: waits for the next batch (``input``
  events), both on the training thread;
* **communication**: the collectives (``cpu_op`` events, any thread) less the waiting;
* **compute**: the rest of the step on the training thread — what it spends neither
  communicating nor waiting;
* **hidden**: communication on other threads (a torch bucket reduced while ``backward()``
  goes on) that overlaps compute.

The writer adds these intervals to every rank's file as Kineto kernel events on three
streams (:data:`STREAM_NAMES`): HTA classifies kernels by name — ``nccl…Kernel`` as
communication, ``…Sync`` as neither compute nor communication, everything else as
compute — so its temporal breakdown and overlap work on a CPU job, and agree with
``mpistrat trace summary``, which reads the same intervals.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any

__all__ = ["STREAM_NAMES", "COMPUTE_STREAM", "COMM_STREAM", "WAIT_STREAM", "steps",
           "kernels", "union", "subtract", "total", "overlap"]

COMPUTE_STREAM, COMM_STREAM, WAIT_STREAM = 7, 8, 9
STREAM_NAMES = {COMPUTE_STREAM: "stream 7 compute", COMM_STREAM: "stream 8 communication",
                WAIT_STREAM: "stream 9 waiting"}
KERNEL_NAMES = {COMPUTE_STREAM: "compute", COMM_STREAM: "ncclKernel (mpistrat communication)",
                WAIT_STREAM: "waiting Sync", -1: "input Sync"}

Interval = tuple[int, int]


def union(intervals: list[Interval]) -> list[Interval]:
    """The intervals merged: sorted, disjoint."""
    merged: list[list[int]] = []
    for start, stop in sorted(intervals):
        if stop <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    return [(a, b) for a, b in merged]


def subtract(intervals: list[Interval], cut: list[Interval]) -> list[Interval]:
    """``intervals`` (disjoint, sorted) less ``cut`` (disjoint, sorted)."""
    found: list[Interval] = []
    j = 0
    for start, stop in intervals:
        while j < len(cut) and cut[j][1] <= start:
            j += 1
        k = j
        while k < len(cut) and cut[k][0] < stop:
            if cut[k][0] > start:
                found.append((start, cut[k][0]))
            start = max(start, cut[k][1])
            k += 1
        if start < stop:
            found.append((start, stop))
    return found


def overlap(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The time in both (disjoint, sorted) lists."""
    return subtract(a, subtract(a, b))


def total(intervals: list[Interval]) -> int:
    return sum(stop - start for start, stop in intervals)


def _sweep(items: list[tuple], taken: int, still_open: list[tuple], start: int,
           stop: int) -> tuple[int, list[tuple]]:
    """One step of a sweep over ``items`` (sorted by start) for the step ``[start,
    stop)`` (steps in time order): the items taken so far, and those open in the step
    (started before its end, not ended before its start)."""
    while taken < len(items) and items[taken][0] < stop:
        still_open.append(items[taken])
        taken += 1
    return taken, [i for i in still_open if i[1] > start]


def _clip(items: list[tuple], start: int, stop: int) -> list[Interval]:
    return union([(max(i[0], start), min(i[1], stop)) for i in items])


def steps(events: list[tuple]) -> list[dict[str, Any]]:
    """Each step's intervals, from event tuples ``(start, dur, name, cat, args, thread)``
    (the recorder's, or a file's events as tuples): a dict per ``ProfilerStep`` with
    ``step``, ``start``, ``stop``, ``thread`` and the interval lists ``compute``,
    ``communication``, ``waiting``, ``input``, ``hidden``."""
    marks = []
    collectives = []
    waits = []
    for e in events:  # (one pass: the writer classifies every step it writes)
        cat = e[3]
        if cat == "mpistrat_phase":
            if e[2] == "agreement" and e[1] > 0:
                waits.append((e[0], e[0] + e[1], e[5], cat))
        elif cat == "cpu_op":
            if e[1] > 0:
                collectives.append((e[0], e[0] + e[1], e[5]))
        elif cat == "user_annotation":
            if e[1] >= 0 and e[2].startswith("ProfilerStep#"):
                marks.append(e)
        elif cat == "input" and e[1] > 0:
            waits.append((e[0], e[0] + e[1], e[5], cat))
    if not marks:
        return []
    collectives.sort()
    waits.sort()
    marks.sort(key=itemgetter(0))
    # (a sweep over the steps in time order: each step looks at the items open at its
    # start and those starting before its end, so a buffer of many steps costs each step
    # its own events, however long one item of the buffer is)
    found = []
    open_collectives: list[tuple] = []
    open_waits: list[tuple] = []
    next_collective = next_wait = 0
    for mark in marks:
        start, stop, thread = mark[0], mark[0] + mark[1], mark[5]
        next_collective, open_collectives = _sweep(collectives, next_collective,
                                                   open_collectives, start, stop)
        next_wait, open_waits = _sweep(waits, next_wait, open_waits, start, stop)
        here = [c for c in open_collectives if c[0] < stop]
        waited = [w for w in open_waits if w[2] == thread and w[0] < stop]
        step = (mark[4] or {}).get("step")
        quick = _inside_one(here, waited, start, stop, thread)
        if quick is not None:
            found.append({"step": step, "start": start, "stop": stop, "thread": thread,
                          **quick})
            continue
        waiting: list[Interval] = []
        pipeline: list[Interval] = []
        if waited:
            waiting = _clip([w for w in waited if w[3] != "input"], start, stop)
            pipeline = subtract(_clip([w for w in waited if w[3] == "input"], start, stop),
                                waiting)
        blocked = union(waiting + pipeline) if pipeline else waiting
        communication: list[Interval] = []
        own: list[Interval] = []
        elsewhere: list[Interval] = []
        if here:
            communication = subtract(_clip(here, start, stop), blocked)
            mine = [c for c in here if c[2] == thread]
            if mine:
                own = subtract(_clip(mine, start, stop), blocked)
            if len(mine) < len(here):
                elsewhere = subtract(_clip([c for c in here if c[2] != thread], start, stop),
                                     blocked)
        compute = subtract([(start, stop)], union(own + blocked))
        found.append({"step": step, "start": start, "stop": stop,
                      "thread": thread, "compute": compute, "communication": communication,
                      "waiting": waiting, "input": pipeline,
                      "hidden": overlap(elsewhere, compute) if elsewhere else []})
    return found


def _inside_one(here: list[tuple], waited: list[tuple], start: int, stop: int,
                thread: int) -> dict[str, list[Interval]] | None:
    """The usual step, classified without the general interval arithmetic: at most one
    collective, on the step's thread and inside the step, whose agreements (no input
    waits) lie inside it, one after another. None for any other step."""
    if not here:
        if waited:
            return None
        return {"compute": [(start, stop)] if start < stop else [], "communication": [],
                "waiting": [], "input": [], "hidden": []}
    if len(here) > 1:
        return None
    low, high, owner = here[0]
    if owner != thread or low < start or high > stop:
        return None
    waiting = []
    communication = []
    at = low
    for w in waited:
        if w[3] == "input" or w[0] < at or w[1] > high:
            return None
        if w[0] > at:
            communication.append((at, w[0]))
            waiting.append((w[0], w[1]))
        elif waiting:  # (one after the other: one interval, as union makes it)
            waiting[-1] = (waiting[-1][0], w[1])
        else:
            waiting.append((w[0], w[1]))
        at = w[1]
    if at < high:
        communication.append((at, high))
    compute = []
    if start < low:
        compute.append((start, low))
    if high < stop:
        compute.append((high, stop))
    return {"compute": compute, "communication": communication, "waiting": waiting,
            "input": [], "hidden": []}


def kernels(events: list[tuple]) -> list[tuple]:
    """The steps' intervals as kernel event tuples on the streams of :data:`STREAM_NAMES`
    (the writer formats them like any other event)."""
    found: list[tuple] = []
    for step in steps(events):
        for key, stream, label in _KERNELS:
            intervals = step[key]
            if intervals:
                args = {"stream": stream, "device": 0, "step": step["step"]}
                name = KERNEL_NAMES[label]
                for start, stop in intervals:
                    found.append((start, stop - start, name, "kernel", args, stream))
    return found


_KERNELS = (("compute", COMPUTE_STREAM, COMPUTE_STREAM),
            ("communication", COMM_STREAM, COMM_STREAM),
            ("waiting", WAIT_STREAM, WAIT_STREAM),
            ("input", WAIT_STREAM, -1))
