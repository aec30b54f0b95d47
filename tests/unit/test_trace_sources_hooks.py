"""The trace's sources that need no MPI: the elastic hooks' step boundaries (an input
position is the input's, a script's boundary the script's, an iterator that marked the
step itself is not counted twice), the snapshot fence's wait, and failure reports (kept
whatever the window, cut to their first 2 KB, nothing when tracing is off)."""

from __future__ import annotations

import json

import pytest

from mpistrat import elastic, trace
from mpistrat.elastic import hooks
from mpistrat.runtime import recorder, stall
from mpistrat.trace.writer import TraceWriter


@pytest.fixture
def traced(tmp_path):
    """A recorder writing ``rank-0.json`` as trace.start would, without MPI; yields a
    function that hands the events over and returns the file's events."""
    path = str(tmp_path / "rank-0.json")
    header = {"distributedInfo": {"rank": 0, "world_size": 1, "backend": "mpistrat"}}
    writer = TraceWriter(path, header, 0, 0, 0)
    made = []

    def make(steps=(0, None)):
        rec = recorder.Recorder(steps, trace.MAX_EVENTS, writer.put)
        recorder.install(rec)
        made.append(rec)

        def events():
            rec.hand_over()
            writer.flush()
            with open(path) as f:
                return json.load(f)["traceEvents"]

        return rec, events

    hooks.reset()
    yield make
    hooks.reset()
    recorder.install(None)
    writer.close()


def _named(events, name):
    return [e for e in events if e.get("name") == name]


def test_an_input_position_and_the_script_mark_steps_from_their_sources(traced):
    rec, _ = traced()
    seen = []
    hooks.set_taker(seen.append)
    hooks.step_boundary(("DistributedDataset/3/x", 0))
    assert (rec.step, rec.source) == (1, recorder.FROM_INPUT)
    hooks.step_boundary(("DistributedDataset/3/x", 1), traced=True)  # marked by its caller
    assert rec.step == 1
    elastic.step()
    assert (rec.step, rec.source) == (2, recorder.FROM_SCRIPT)
    hooks.step_boundary(("DistributedDataset/3/x", 2))  # below the script's: not a step
    assert rec.step == 2
    # the snapshots' taker sees every boundary, whoever marked the trace's step
    assert seen == [("DistributedDataset/3/x", 0), ("DistributedDataset/3/x", 1), None,
                    ("DistributedDataset/3/x", 2)]


def test_a_write_that_waits_for_a_snapshot_is_a_fence_wait_span(traced):
    _, events = traced()
    waited = []
    hooks.set_fence(lambda: waited.append(1))
    hooks.before_write()
    hooks.set_fence(None)
    hooks.before_write()  # no snapshot in flight: nothing
    assert waited == [1]
    (span,) = _named(events(), "snapshot fence wait")
    assert span["cat"] == "checkpoint" and span["ph"] == "X"


def test_a_failure_is_kept_outside_the_window_and_cut_to_its_first_2_kb(traced):
    rec, events = traced(steps=(5, 6))
    assert not recorder.on  # (step 0 is outside the window)
    long = "x" * (3 * stall.MAX_TRACED_REPORT)
    stall.trace_failure("stall", long, [3, 1], collective="all_reduce")
    recorder.instant("closure scheduled", recorder.PS, {"id": 0})  # (windowed: dropped)
    (event,) = [e for e in events() if e.get("ph") == "i"]
    assert event["name"] == "stall" and event["cat"] == "failure"
    args = event["args"]
    assert args["ranks"] == [1, 3] and args["collective"] == "all_reduce"
    assert args["report"].startswith("x" * stall.MAX_TRACED_REPORT)
    assert args["report"].endswith(f"({len(long)} characters in all)")
    assert len(args["report"]) < stall.MAX_TRACED_REPORT + 40


def test_nothing_is_recorded_when_tracing_is_off():
    recorder.install(None)
    hooks.reset()
    stall.trace_failure("failure", "boom", [0])  # no recorder: nothing, no error
    hooks.step_boundary(("X/1", 0))
    hooks.set_fence(lambda: None)
    hooks.before_write()
    hooks.reset()
    assert recorder.current() is None and not recorder.on
