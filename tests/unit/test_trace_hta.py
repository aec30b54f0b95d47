"""HTA (Holistic Trace Analysis, ``pip install HolisticTraceAnalysis``) reads the rank
files the real recorder and writer make, as they are, and its temporal breakdown agrees
with ``mpistrat trace summary``'s: compute, the rest of each rank's time (exposed
communication, waiting, input) and the communication hidden behind compute.

HTA leaves out the last ``ProfilerStep`` unless told otherwise (torch.profiler's last step
is cut short); the summary leaves out the partial step ``mpistrat.trace.stop`` ends, so
both read the same steps."""

from __future__ import annotations

import logging
import os
import threading

import pytest
from test_trace_files import MS, header

from mpistrat.runtime import recorder
from mpistrat.trace.summary import summarize
from mpistrat.trace.writer import TraceWriter

TraceAnalysis = pytest.importorskip(
    "hta.trace_analysis", reason="HolisticTraceAnalysis is not installed (it is in the "
    "test extra: pip install -e '.[test]')").TraceAnalysis

START = 10**12

# HTA's own use of pandas deprecations is not ours to report
pytestmark = pytest.mark.filterwarnings("ignore:::hta\\..*")


@pytest.fixture
def clock(monkeypatch):
    """The recorder's clock, moved by hand (ns)."""
    now = [START]
    monkeypatch.setattr(recorder, "monotonic_ns", lambda: now[0])
    yield now
    recorder.install(None)


def _record(directory, clock, *, size=2, steps=6, stop=True):
    """Each rank, recorded by the real Recorder and TraceWriter: per step an input wait
    (2 ms), compute (25 ms, +10 ms on rank 1) during which another thread all-reduces a
    bucket (8 ms), then an all-reduce whose agreement waits for rank 1 (the slow one) and
    4 ms of transfer; ``stop``: a partial step at the end, as mpistrat.trace.stop makes."""
    os.makedirs(directory, exist_ok=True)
    for rank in range(size):
        clock[0] = START
        writer = TraceWriter(os.path.join(directory, f"rank-{rank}.json"),
                             header(rank, size, trip_ns=20_000 if rank else 0), rank, 0, START)
        rec = recorder.Recorder((0, None), 2000, writer.put, flush_events=1, align_steps=1)
        recorder.install(rec)
        for step in range(steps):
            t = recorder.begin()
            clock[0] += 2 * MS
            recorder.end(t, "next batch", recorder.INPUT)
            t = recorder.begin()
            clock[0] += 5 * MS
            bucket = recorder.begin()
            clock[0] += 8 * MS
            other = threading.Thread(target=recorder.end, args=(
                bucket, "bucket all_reduce", recorder.COLLECTIVE,
                {"Collective name": "allreduce", "bytes": 4096, "seq": 2 * step + 1}))
            other.start()
            other.join()
            clock[0] += (12 + 10 * (rank == 1)) * MS
            recorder.end(t, "replica_fn", recorder.USER)
            t = recorder.begin()
            agreement = recorder.begin()
            clock[0] += (1 + 10 * (rank != 1)) * MS
            recorder.end(agreement, "agreement", recorder.PHASE, {"seq": 2 * step + 2})
            clock[0] += 4 * MS
            recorder.end(t, "all_reduce", recorder.COLLECTIVE,
                         {"Collective name": "allreduce", "bytes": 1 << 20,
                          "seq": 2 * step + 2, "Group size": size})
            clock[0] += 1 * MS
            recorder.boundary(recorder.FROM_SCRIPT)
        if stop:
            clock[0] += 3 * MS
            rec.close_step()
        recorder.install(None)
        rec.hand_over()
        writer.close()


def _hta(directory, **kwargs):
    logging.getLogger("hta").setLevel(logging.WARNING)
    analysis = TraceAnalysis(trace_dir=str(directory), **kwargs)
    breakdown = analysis.get_temporal_breakdown(visualize=False).set_index("rank")
    overlap = analysis.get_comm_comp_overlap(visualize=False).set_index("rank")
    return analysis, breakdown, overlap


def _agree(found, breakdown, overlap, steps):
    assert found.steps == steps
    for totals in found.totals:
        hta = breakdown.loc[totals.rank]
        ours = totals.total
        rest = ours.exposed_communication_ms + ours.waiting_ms + ours.input_ms
        assert hta["compute_time(us)"] / 1000 == pytest.approx(ours.compute_ms, rel=0.05)
        assert hta["non_compute_time(us)"] / 1000 == pytest.approx(rest, rel=0.05)
        assert hta["idle_time(us)"] / 1000 == pytest.approx(0, abs=0.05 * ours.step_ms)
        hidden = 100 * ours.hidden_ms / ours.communication_ms
        assert overlap.loc[totals.rank]["comp_comm_overlap_pctg"] == \
            pytest.approx(hidden, rel=0.05)


def test_hta_reads_the_writer_s_files_and_agrees_with_the_summary(tmp_path, clock):
    _record(tmp_path / "traces", clock, size=2, steps=6)
    found = summarize(tmp_path / "traces")
    analysis, breakdown, overlap = _hta(tmp_path / "traces")
    assert sorted(analysis.t.get_ranks()) == [0, 1]
    assert list(analysis.get_profiler_steps()) == list(range(6))
    _agree(found, breakdown, overlap, list(range(6)))
    by_rank = {t.rank: t.mean for t in found.totals}       # (the model, per step)
    assert by_rank[0].compute_ms == pytest.approx(26) and by_rank[1].compute_ms == \
        pytest.approx(36)                                   # (+1 ms after the all-reduce)
    assert by_rank[0].waiting_ms == pytest.approx(11) and by_rank[1].hidden_ms == \
        pytest.approx(8)


def test_hta_with_the_last_step_agrees_on_a_run_that_ended_on_a_step(tmp_path, clock):
    _record(tmp_path / "traces", clock, size=3, steps=5, stop=False)
    found = summarize(tmp_path / "traces")
    _, breakdown, overlap = _hta(tmp_path / "traces", include_last_profiler_step=True)
    _agree(found, breakdown, overlap, list(range(5)))
