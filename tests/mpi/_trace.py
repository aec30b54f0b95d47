"""What the MPI trace tests share: a traced run's events, and nesting on the written clock."""

from __future__ import annotations

import json

from mpistrat import trace

SLACK = 0.002  # µs: ts and dur are written with 3 decimals


def traced(root, world, calls):
    """Run ``calls()`` with tracing on (started and stopped over ``world``); this rank's
    trace events (complete ones)."""
    path = trace.start(root, comm=world)
    try:
        calls()
    finally:
        trace.stop()
    with open(path) as f:
        doc = json.load(f)
    return [e for e in doc["traceEvents"] if e.get("ph") == "X"]


def inside(event, outer):
    """``event`` lies within ``outer`` (on the file's rounded clock)."""
    return (outer["ts"] - SLACK <= event["ts"]
            and event["ts"] + event["dur"] <= outer["ts"] + outer["dur"] + SLACK)
