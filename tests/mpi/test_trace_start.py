"""Starting and stopping a trace at 1-4 ranks: every rank writes its own file with the
job's run id and its clock measured against rank 0's, a bad start raises the same error on
every rank, and after stop() nothing is recorded."""

from __future__ import annotations

import json
import os

import pytest

from mpistrat import trace
from mpistrat.runtime import recorder


def _load(path):
    with open(path) as f:
        return json.load(f)


def test_every_rank_writes_its_file_with_one_run_id_and_its_clock(world, root):
    path = trace.start(root, "0:5")
    assert path == os.path.join(root, f"rank-{world.rank}.json")
    assert recorder.on and trace.active()
    for _ in range(3):
        trace.step()
        with trace.span("work", n=world.rank):
            pass
    assert trace.stop() == path
    assert not recorder.on and not trace.active() and recorder.begin() == 0
    doc = _load(path)
    info = doc["mpistrat"]
    assert doc["distributedInfo"] == {"rank": world.rank, "world_size": world.size,
                                      "backend": "mpistrat"}
    runs = world.allgather(info["run"])
    assert len(set(runs)) == 1
    clock = info["clock"]
    if world.rank == 0:
        assert clock == {"offset_ns": 0, "round_trip_ns": 0}
    else:  # one host, one monotonic clock: the offset is within the round trip's error
        assert clock["round_trip_ns"] > 0
        assert abs(clock["offset_ns"]) <= clock["round_trip_ns"]
    names = [e["name"] for e in doc["traceEvents"] if e.get("ph") == "X"]
    assert names.count("work") == 3
    assert [n for n in names if n.startswith("ProfilerStep#")] == \
        ["ProfilerStep#0", "ProfilerStep#1", "ProfilerStep#2", "ProfilerStep#3"]
    (sync,) = [e for e in doc["traceEvents"] if e["name"] == "clock_sync"]
    assert abs(sync["args"]["offset_ns"]) <= max(sync["args"]["round_trip_ns"], 0) or \
        world.rank == 0


def test_a_bad_window_is_the_same_error_on_every_rank(world, root):
    steps = "4:2" if world.rank == world.size - 1 else "0:5"
    with pytest.raises(trace.TraceError, match="empty"):
        trace.start(root, steps)
    assert not trace.active()


def test_an_unwritable_directory_is_an_error_on_every_rank(world, root):
    blocked = os.path.join(root, "file")
    if world.rank == 0:
        open(blocked, "w").close()
    world.Barrier()
    with pytest.raises(trace.TraceError, match="cannot trace into"):
        trace.start(os.path.join(blocked, "traces"))
    assert not trace.active()


def test_starting_twice_says_so_and_old_rank_files_go(world, root):
    stale = os.path.join(root, f"rank-{world.size + 3}.json")
    if world.rank == 0:
        open(stale, "w").close()
    world.Barrier()
    with trace.tracing(root, "0:1"):
        assert not os.path.exists(stale)
        with pytest.raises(trace.TraceError, match="already on"):
            trace.start(root)
    assert not trace.active()
