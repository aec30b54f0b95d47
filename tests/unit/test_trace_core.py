"""The trace's recorder, writer and classification, without MPI: one rank's file is
valid JSON after every chunk and after the process is killed, the window and the per-step
cap bound what is kept, and the classification's interval arithmetic is exact."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from mpistrat import trace
from mpistrat.runtime import recorder
from mpistrat.trace import classify
from mpistrat.trace.writer import TraceWriter


@pytest.fixture
def rank_file(tmp_path):
    """A recorder writing ``rank-0.json`` as trace.start would, without MPI."""
    made = []

    def make(steps=(0, None), max_events=trace.MAX_EVENTS, flush_events=1):
        path = str(tmp_path / "rank-0.json")
        header = {"distributedInfo": {"rank": 0, "world_size": 1, "backend": "mpistrat"},
                  "mpistrat": {"format": 1, "run": "ab", "rank": 0, "size": 1}}
        writer = TraceWriter(path, header, 0, 0, 0)
        rec = recorder.Recorder(steps, max_events, writer.put, flush_events=flush_events,
                                align_steps=1)
        recorder.install(rec)
        made.append(writer)
        return path, rec, writer

    yield make
    recorder.install(None)
    for writer in made:
        writer.close()


def _load(path):
    with open(path) as f:
        return json.load(f)


def _spans(doc, name=None):
    return [e for e in doc["traceEvents"] if e.get("ph") == "X"
            and (name is None or e["name"] == name)]


@pytest.mark.parametrize("text, expected", [
    ("2:12", (2, 12)), ("0:1", (0, 1)), ("5:", (5, None)), ("30", (0, 30)),
    (None, (0, 100)), (" 3 : 4 ", (3, 4)),
])
def test_parse_steps(text, expected):
    assert trace.parse_steps(text) == expected


@pytest.mark.parametrize("text", ["", "a:b", "4:2", "3:3", "-1:4", "1:2:3", "1.5"])
def test_parse_steps_rejects_with_the_forms_it_takes(text):
    with pytest.raises(trace.TraceError, match="A:B"if text not in ("4:2", "3:3") else "empty"):
        trace.parse_steps(text)


def test_off_records_nothing_and_begin_is_zero():
    recorder.install(None)
    assert recorder.begin() == 0
    recorder.end(123, "x", recorder.USER)  # no recorder: nothing, no error
    recorder.instant("x", recorder.FAILURE)
    recorder.boundary(recorder.FROM_SCRIPT)
    assert recorder.current() is None and not recorder.on


def test_file_is_valid_json_after_every_chunk(rank_file):
    path, rec, writer = rank_file()
    doc = _load(path)
    assert doc["distributedInfo"]["rank"] == 0 and _spans(doc) == []
    with open(path) as f:  # HTA finds the rank on the first line, with a space
        assert '"rank": 0' in f.readline()
    for i in range(3):
        t = recorder.begin()
        recorder.end(t, f"work {i}", recorder.USER, {"i": i})
        recorder.boundary(recorder.FROM_SCRIPT)
        writer.flush()
        doc = _load(path)
        assert [e["name"] for e in _spans(doc) if e["cat"] == "user_annotation"] == \
            [n for j in range(i + 1) for n in (f"work {j}", f"ProfilerStep#{j}")]


def test_chunks_are_handed_over_at_aligned_steps_and_written_between_steps(tmp_path):
    """Every rank hands its buffer over at the same steps (the first at once, then at
    multiples of ``align_steps`` once ``flush_events`` are in, and at the window's end),
    and formats it between two steps: its ``trace write`` span lies in the gap, outside
    both steps, so that a step's time never holds the trace's own work."""
    handed = []
    header = {"distributedInfo": {"rank": 0, "world_size": 1, "backend": "mpistrat"}}
    writer = TraceWriter(str(tmp_path / "rank-0.json"), header, 0, 0, 0)

    def sink(events, step):
        handed.append(step)
        writer.put(events, step)
        time.sleep(0.002)  # (formatting that takes time)

    rec = recorder.Recorder((0, 30), 2000, sink, flush_events=3, flush_seconds=3600,
                            align_steps=4)
    recorder.install(rec)
    try:
        for i in range(32):
            t = recorder.begin()
            if t:
                recorder.end(t, f"work {i}", recorder.USER)
            recorder.boundary(recorder.FROM_SCRIPT)
    finally:
        recorder.install(None)
        writer.flush()
        writer.close()
    # the first step at once, then every 4th step (3 events by then), then the window's end
    assert handed == [1, 4, 8, 12, 16, 20, 24, 28, 30]
    events = _spans(_load(tmp_path / "rank-0.json"))
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e["name"].startswith("ProfilerStep#") and e["dur"] > 0)
    writes = [e for e in events if e["name"] == recorder.WRITE]
    assert len(writes) == 8 and all(w["cat"] == recorder.TRACE for w in writes)
    for w in writes:  # (2 ms each, in a gap between two steps; the last, at the
        #               window's end, is not recorded)
        assert w["dur"] >= 2000
        inside = (w["ts"] + 0.01, w["ts"] + w["dur"] - 0.01)  # (times of 3 decimals)
        assert not any(a < inside[1] and inside[0] < b for a, b in steps), (w, steps)
        assert any(abs(b - w["ts"]) < 0.01 for a, b in steps)  # (right after a step)


def test_a_flush_from_inside_the_formatting_does_not_deadlock(tmp_path):
    """A batch is formatted on the thread that hands it over; a signal handler (or
    anything called from inside the formatting) that flushes the trace on that same
    thread writes its events and returns instead of waiting for itself."""
    import threading

    header = {"distributedInfo": {"rank": 0, "world_size": 1, "backend": "mpistrat"}}
    writer = TraceWriter(str(tmp_path / "rank-0.json"), header, 0, 0, 0)

    class Interrupting:  # (its text is asked for in the middle of formatting)
        def __str__(self):
            writer.put([(2000, 10, "inner", recorder.USER, None, 1)], 0)
            return "outer's argument"

    done = threading.Event()

    def outer():
        writer.put([(1000, 10, "outer", recorder.USER, {"x": Interrupting()}, 1)], 0)
        done.set()

    threading.Thread(target=outer, daemon=True).start()
    assert done.wait(10), "put() from inside put() on the same thread waited for itself"
    writer.flush()
    writer.close()
    names = {e["name"]: e for e in _spans(_load(tmp_path / "rank-0.json"))}
    assert names["outer"]["args"] == {"x": "outer's argument"} and "inner" in names


def test_an_agreements_span_is_exactly_the_waiting_its_collective_leaves_out(monkeypatch):
    """The collective's algbw leaves out the time its agreements waited, and the trace
    shows that time as the agreement's span: both from one clock reading, so that a rank
    descheduled while recording (4 ranks on 2 cores) writes a span and a bandwidth that
    still agree."""
    from mpistrat.runtime import agreement

    clock = iter(range(1_000, 10**9, 1_000))  # (every reading 1 µs after the last)
    monkeypatch.setattr(agreement, "monotonic_ns", lambda: next(clock))
    monkeypatch.setattr(recorder, "monotonic_ns", lambda: next(clock))
    events = []
    recorder.install(recorder.Recorder((0, None), 100, lambda e, s: events.extend(e)))
    doors = agreement.DOORS
    try:
        doors.depth, doors.seq, doors.waited = 1, 7, 0  # (inside a traced collective)
        agreement.traced_agreement(500, None)
        waited = doors.waited
        recorder.current().hand_over()
    finally:
        doors.depth, doors.waited = 0, 0
        recorder.install(None)
    (span,) = [e for e in events if e[2] == "agreement"]
    assert span[4] == {"seq": 7} and span[0] == 500 and span[1] == waited > 0


def test_long_steps_are_handed_over_once_due_without_waiting_for_an_aligned_step():
    """Steps of ``flush_seconds / align_steps`` or more are handed over as soon as
    ``flush_seconds`` have passed (a job killed in a slow run loses at most that much),
    not at the next multiple of ``align_steps``, which could be minutes away."""
    handed = []
    rec = recorder.Recorder((0, None), 2000, lambda events, step: handed.append(step),
                            flush_events=1000, flush_seconds=0.05, align_steps=4)
    recorder.install(rec)
    try:
        for i in range(9):
            t = recorder.begin()
            time.sleep(0.03)  # (each step at least 0.03 s: due after two at most)
            recorder.end(t, f"work {i}", recorder.USER)
            recorder.boundary(recorder.FROM_SCRIPT)
    finally:
        recorder.install(None)
    assert handed[0] == 1
    assert all(b - a <= 2 for a, b in zip(handed, handed[1:] + [9])), handed
    assert any(step % 4 for step in handed[1:]), handed


def test_window_keeps_only_its_steps(rank_file):
    path, rec, writer = rank_file(steps=(2, 4))
    for i in range(6):
        t = recorder.begin()
        assert bool(t) == (2 <= i < 4)
        recorder.end(t or 1, f"work {i}", recorder.USER) if t else None
        recorder.boundary(recorder.FROM_SCRIPT)
    rec.hand_over()
    writer.flush()
    spans = _spans(_load(path))
    names = {e["name"] for e in spans}
    assert {"work 2", "work 3", "ProfilerStep#2", "ProfilerStep#3"} <= names
    assert not names & {"work 1", "work 4", "ProfilerStep#1", "ProfilerStep#5"}
    # where the window ends, a zero-length mark of the next step (HTA leaves out a
    # trace's last step as incomplete: only this mark, then)
    (mark,) = [e for e in spans if e["name"] == "ProfilerStep#4"]
    assert mark["dur"] == 0 and mark["args"] == {"step": 4, "partial": True}


def test_per_step_cap_bounds_a_long_run(rank_file):
    path, rec, writer = rank_file(max_events=50, flush_events=500)
    for step in range(200):
        for i in range(80):  # more than the cap in every step
            t = recorder.begin()
            recorder.end(t, "op", recorder.COLLECTIVE, {"bytes": 4096, "seq": i})
        recorder.boundary(recorder.FROM_SCRIPT)
    rec.hand_over()
    writer.flush()
    doc = _load(path)
    ops = [e for e in _spans(doc, "op")]
    assert len(ops) == 200 * 50 and rec.dropped == 200 * 30
    # per step: the events kept, their classification (a compute interval between two
    # collectives, the communication itself) and the step mark, a few hundred bytes each
    assert os.path.getsize(path) < 200 * (3 * 50 + 10) * 250


def test_lower_sources_count_no_more_once_a_higher_one_marks_steps(rank_file):
    path, rec, writer = rank_file()
    recorder.boundary(recorder.FROM_STRATEGY)
    recorder.boundary(recorder.FROM_STRATEGY)
    assert rec.step == 2
    recorder.boundary(recorder.FROM_INPUT)
    recorder.boundary(recorder.FROM_STRATEGY)  # a strategy.run inside the input's step
    assert rec.step == 3
    recorder.boundary(recorder.FROM_SCRIPT)
    recorder.boundary(recorder.FROM_INPUT)
    assert rec.step == 4


def test_killed_process_leaves_a_file_that_parses(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, time
        from mpistrat.runtime import recorder
        from mpistrat.trace.writer import TraceWriter
        w = TraceWriter({str(tmp_path / 'rank-0.json')!r}, {{"distributedInfo": {{"rank": 0}}}},
                        0, 0, 0)
        rec = recorder.Recorder((0, None), 3000, w.put, flush_events=10)
        recorder.install(rec)
        for step in range(100000):
            for i in range(20):
                t = recorder.begin()
                recorder.end(t, "op", recorder.COLLECTIVE, {{"seq": i}})
            recorder.boundary(recorder.FROM_SCRIPT)
            if step == 50:
                rec.hand_over()
                w.flush()
                print("ready", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.2)  # the writer in the middle of its chunks
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    doc = _load(tmp_path / "rank-0.json")
    steps = [e for e in _spans(doc) if e["name"].startswith("ProfilerStep#")]
    assert len(steps) >= 51


def test_classification_of_a_step():
    # a step 0..100 on thread 1: a collective 20..50 whose agreement 20..35, an input wait
    # 0..10, a collective on thread 2 (hidden behind compute) 60..80
    ev = [
        (0, 100, "ProfilerStep#0", "user_annotation", {"step": 0}, 1),
        (0, 10, "input wait", "input", None, 1),
        (20, 30, "all_reduce", "cpu_op", None, 1),
        (20, 15, "agreement", "mpistrat_phase", None, 1),
        (60, 20, "bucket all_reduce", "cpu_op", None, 2),
    ]
    (step,) = classify.steps(ev)
    assert step["input"] == [(0, 10)]
    assert step["waiting"] == [(20, 35)]
    assert step["communication"] == [(35, 50), (60, 80)]
    assert step["compute"] == [(10, 20), (50, 100)]
    assert step["hidden"] == [(60, 80)]
    kernels = classify.kernels(ev)
    by_stream = {s: classify.total([(k[0], k[0] + k[1]) for k in kernels if k[5] == s])
                 for s in (7, 8, 9)}
    assert by_stream == {7: 60, 8: 35, 9: 25}


def _mark(t, length, step):
    """The recorder's tuple of step ``step``, ``length`` long from ``t``, on thread 1."""
    return (t, length, f"ProfilerStep#{step}", "user_annotation", {"step": step}, 1)


def _classified_by_definition(events, mark):
    """One step's intervals straight from the definitions (every event of the buffer
    looked at): the reference for :func:`classify.steps`."""
    start, stop, thread = mark[0], mark[0] + mark[1], mark[5]

    def clip(items):
        return classify.union([(max(e[0], start), min(e[0] + e[1], stop)) for e in items
                               if e[0] < stop and e[0] + e[1] > start and e[1] > 0])

    waiting = clip([e for e in events if e[3] == "mpistrat_phase" and e[2] == "agreement"
                    and e[5] == thread])
    pipeline = classify.subtract(clip([e for e in events if e[3] == "input"
                                       and e[5] == thread]), waiting)
    blocked = classify.union(waiting + pipeline)
    calls = [e for e in events if e[3] == "cpu_op"]
    own = classify.subtract(clip([e for e in calls if e[5] == thread]), blocked)
    compute = classify.subtract([(start, stop)], classify.union(own + blocked))
    elsewhere = classify.subtract(clip([e for e in calls if e[5] != thread]), blocked)
    return {"compute": compute, "communication": classify.subtract(clip(calls), blocked),
            "waiting": waiting, "input": pipeline,
            "hidden": classify.overlap(elsewhere, compute)}


@pytest.mark.parametrize("seed", range(20))
def test_a_buffer_of_many_steps_is_classified_as_each_step_alone(seed):
    """Many steps in one buffer, with collectives on another thread that span several
    steps (a long bucket reduction) and agreements, input waits and calls that cross a
    step's edges: each step's intervals are those of its definition."""
    import random

    rng = random.Random(seed)
    events, t = [], 0
    for step in range(rng.randint(1, 40)):
        length = rng.randint(50, 400)
        events.append(_mark(t, length, step))
        for _ in range(rng.randint(0, 6)):
            at = t + rng.randint(-30, length)
            cat, name = rng.choice([("cpu_op", "all_reduce"), ("input", "input wait"),
                                    ("mpistrat_phase", "agreement"),
                                    ("mpistrat_phase", "pack")])
            events.append((at, rng.randint(0, 80), name, cat, None, 1))
        if rng.random() < 0.3:  # another thread's long reduction, over several steps
            events.append((t + rng.randint(0, length), rng.randint(100, 3000),
                           "bucket all_reduce", "cpu_op", None, 2))
        t += length + rng.randint(0, 20)
    rng.shuffle(events)  # (the recorder appends a span when it ends, not when it starts)
    found = classify.steps(events)
    marks = sorted((e for e in events if e[2].startswith("ProfilerStep#")),
                   key=lambda e: e[4]["step"])
    assert [f["step"] for f in sorted(found, key=lambda f: f["step"])] == \
        [m[4]["step"] for m in marks]
    for mark in marks:
        (got,) = [f for f in found if f["step"] == mark[4]["step"]]
        want = _classified_by_definition(events, mark)
        assert {key: got[key] for key in want} == want, mark


@pytest.mark.parametrize("seed", range(20))
def test_steps_of_one_collective_each_are_classified_by_the_definition(seed):
    """The usual shape of a training step (a collective on the training thread, its
    agreements inside it, back to back at times, or at its very edges), with odd steps
    among them (no collective, two collectives, one crossing the step's edge, an input
    wait, one very long collective early in the buffer): every step as its definition
    says."""
    import random

    rng = random.Random(seed)
    events, t = [], 0
    for step in range(rng.randint(1, 60)):
        length = rng.randint(100, 400)
        events.append(_mark(t, length, step))
        shape = rng.random()
        if shape < 0.75:  # the usual: one collective with agreements inside
            low = t + rng.randint(0, 40)
            high = min(t + length, low + rng.randint(1, 200))
            if step == 1 and rng.random() < 0.5:
                high = t + length  # (ends with the step)
            events.append((low, high - low, "all_reduce", "cpu_op", None, 1))
            at = low
            for _ in range(rng.randint(0, 3)):
                begin = rng.choice([at, rng.randint(at, high)])
                end = rng.randint(begin, high)
                if end > begin:
                    events.append((begin, end - begin, "agreement", "mpistrat_phase",
                                   None, 1))
                    at = end
        elif shape < 0.85:  # two collectives, or one crossing into the next step
            events.append((t + 5, 20, "all_reduce", "cpu_op", None, 1))
            events.append((t + length - 10, rng.randint(5, 60), "all_reduce", "cpu_op",
                           None, 1))
        elif shape < 0.9:  # an input wait, and a collective after it
            events.append((t, 10, "input wait", "input", None, 1))
            events.append((t + 20, 30, "all_reduce", "cpu_op", None, 1))
        elif shape < 0.95:  # another thread's collective
            events.append((t + 10, 30, "bucket all_reduce", "cpu_op", None, 2))
        if step == 0 and rng.random() < 0.5:  # the first collective, very long
            events.append((t + 1, 20_000, "all_reduce", "cpu_op", None, 2))
        t += length + rng.randint(0, 5)
    # (the window's end: a zero-length mark of the next step)
    events.append(_mark(t, 0, step + 1))
    rng.shuffle(events)
    found = {f["step"]: f for f in classify.steps(events)}
    for mark in (e for e in events if e[2].startswith("ProfilerStep#")):
        want = _classified_by_definition(events, mark)
        got = found[mark[4]["step"]]
        assert {key: got[key] for key in want} == want, mark


@pytest.mark.parametrize("a, cut, expected", [
    ([(0, 10)], [], [(0, 10)]),
    ([(0, 10)], [(0, 10)], []),
    ([(0, 10)], [(2, 3), (5, 6)], [(0, 2), (3, 5), (6, 10)]),
    ([(0, 4), (6, 10)], [(3, 7)], [(0, 3), (7, 10)]),
    ([(5, 6)], [(0, 1), (10, 11)], [(5, 6)]),
])
def test_subtract(a, cut, expected):
    assert classify.subtract(a, cut) == expected


def test_union_merges_overlaps_and_drops_empty():
    assert classify.union([(5, 7), (0, 2), (1, 3), (4, 4), (6, 9)]) == [(0, 3), (5, 9)]


def test_a_new_job_clears_an_earlier_job_s_relaunch_folders(tmp_path):
    # mpistrat run --trace DIR, launch 0: an earlier elastic job's DIR/restart-K rank files
    # must not be read as this job's; anything else there stays
    from mpistrat.runner.rank import _clear_old_relaunches

    (tmp_path / "restart-2").mkdir()
    (tmp_path / "restart-2" / "rank-0.json").write_text("{}")
    (tmp_path / "restart-3").mkdir()
    (tmp_path / "restart-3" / "rank-1.json").write_text("{}")
    (tmp_path / "restart-3" / "notes.txt").write_text("mine")
    (tmp_path / "restarts").mkdir()
    (tmp_path / "restarts" / "rank-0.json").write_text("{}")
    _clear_old_relaunches(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["restart-3", "restarts"]
    assert [p.name for p in (tmp_path / "restart-3").iterdir()] == ["notes.txt"]
    assert (tmp_path / "restarts" / "rank-0.json").exists()
    _clear_old_relaunches(str(tmp_path / "missing"))  # not there yet: nothing to do
