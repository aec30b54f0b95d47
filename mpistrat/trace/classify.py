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

from bisect import bisect_left
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


def _reaching(items: list[tuple], starts: list[int], reach: int, start: int,
              stop: int) -> list[tuple]:
    """The ``items`` (sorted by their start, ``starts``; none longer than ``reach``) that
    overlap ``[start, stop)``."""
    return [i for i in items[bisect_left(starts, start - reach):bisect_left(starts, stop)]
            if i[1] > start]


def _clip(items: list[tuple], start: int, stop: int) -> list[Interval]:
    return union([(max(i[0], start), min(i[1], stop)) for i in items])


def steps(events: list[tuple]) -> list[dict[str, Any]]:
    """Each step's intervals, from event tuples ``(start, dur, name, cat, args, thread)``
    (the recorder's, or a file's events as tuples): a dict per ``ProfilerStep`` with
    ``step``, ``start``, ``stop``, ``thread`` and the interval lists ``compute``,
    ``communication``, ``waiting``, ``input``, ``hidden``."""
    marks = [e for e in events if e[3] == "user_annotation" and e[1] >= 0
             and e[2].startswith("ProfilerStep#")]
    if not marks:
        return []
    collectives = sorted((e[0], e[0] + e[1], e[5]) for e in events
                         if e[3] == "cpu_op" and e[1] > 0)
    waits = sorted((e[0], e[0] + e[1], e[5], e[3]) for e in events
                   if e[1] > 0 and ((e[3] == "mpistrat_phase" and e[2] == "agreement")
                                    or e[3] == "input"))
    # (each step looks only at the items that can reach into it: those starting at most
    # the longest item's length before it, found by bisection: a buffer of many steps
    # costs each step its own events, not every event of the buffer)
    found = []
    collective_starts = [c[0] for c in collectives]
    wait_starts = [w[0] for w in waits]
    collective_reach = max((c[1] - c[0] for c in collectives), default=0)
    wait_reach = max((w[1] - w[0] for w in waits), default=0)
    for mark in marks:
        start, stop, thread = mark[0], mark[0] + mark[1], mark[5]
        here = _reaching(collectives, collective_starts, collective_reach, start, stop)
        waited = [w for w in _reaching(waits, wait_starts, wait_reach, start, stop)
                  if w[2] == thread]
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
        found.append({"step": (mark[4] or {}).get("step"), "start": start, "stop": stop,
                      "thread": thread, "compute": compute, "communication": communication,
                      "waiting": waiting, "input": pipeline,
                      "hidden": overlap(elsewhere, compute) if elsewhere else []})
    return found


def kernels(events: list[tuple]) -> list[tuple]:
    """The steps' intervals as kernel event tuples on the streams of :data:`STREAM_NAMES`
    (the writer formats them like any other event)."""
    found: list[tuple] = []
    for step in steps(events):
        for key, stream, label in (("compute", COMPUTE_STREAM, COMPUTE_STREAM),
                                   ("communication", COMM_STREAM, COMM_STREAM),
                                   ("waiting", WAIT_STREAM, WAIT_STREAM),
                                   ("input", WAIT_STREAM, -1)):
            args = {"stream": stream, "device": 0, "step": step["step"]}
            for start, stop in step[key]:
                found.append((start, stop - start, KERNEL_NAMES[label], "kernel", args,
                              stream))
    return found
