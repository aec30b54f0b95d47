"""``mpistrat trace summary``: each step's compute, communication, waiting and input on
every rank (the writer's classification, or the events again where it is incomplete), the
straggler named with its delay on the aligned clock, the slowest collectives with their
bus bandwidth against ``mpistrat bench``'s, the steps every rank recorded whole, the text,
JSON and PNG outputs."""

from __future__ import annotations

import importlib.util
import json

import pytest
from click.testing import CliRunner
from test_trace_files import MS, header, write_job

from mpistrat.bench.files import read_busbw_curve, write_json
from mpistrat.bench.results import Point
from mpistrat.cli import cli
from mpistrat.trace import TraceError
from mpistrat.trace.summary import bus_factor, summarize
from mpistrat.trace.writer import TraceWriter

needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                      reason="matplotlib is not installed")


def _expected(job, step, rank):
    """The model's breakdown of ``rank`` in ``step`` (ms), one collective per step."""
    start, stop, ((arrive, agreed, done),) = job[step][rank]
    return {"step_ms": (stop - start) / MS, "compute_ms": (arrive - start + stop - done) / MS,
            "communication_ms": (done - agreed) / MS, "waiting_ms": (agreed - arrive) / MS,
            "hidden_ms": 0.0, "input_ms": 0.0}


def _row(found, step, rank):
    (row,) = [r for r in found.per_step if (r.step, r.rank) == (step, rank)]
    return row


def _close(row, expected):
    b = row.breakdown
    for name, value in expected.items():
        assert getattr(b, name) == pytest.approx(value, abs=1e-5), name


@pytest.mark.parametrize("size", [2, 3])
def test_the_rank_that_arrives_last_is_named_with_its_delay(tmp_path, size):
    # rank 1 computes 20 ms longer in every step; its clock drifts and starts off rank 0's
    job = write_job(tmp_path, size=size, steps=8, slow=(1,), slow_ms=20,
                    drift_us={1: 120, 2: -90}, offset_us={1: 2500, 2: -400})
    found = summarize(tmp_path)
    (straggler, *others) = found.stragglers
    assert straggler.rank == 1 and others == []
    assert (straggler.last, straggler.of) == (8, 8)
    assert (straggler.collectives_last, straggler.collectives) == (8, 8)
    assert straggler.median_delay_ms == pytest.approx(20, rel=0.10)
    assert straggler.mean_delay_ms == pytest.approx(20, rel=0.10)
    assert straggler.total_delay_ms == pytest.approx(8 * straggler.mean_delay_ms)
    # exactly: its arrival less the second-to-last's, on the aligned clock
    arrivals = sorted(job[0][r][2][0][0] for r in range(size))
    assert straggler.max_delay_ms == pytest.approx((arrivals[-1] - arrivals[-2]) / MS,
                                                   abs=1e-4)
    assert found.steps == list(range(8)) and found.left_out_steps == []


def test_the_breakdown_is_the_writer_s_classification(tmp_path):
    job = write_job(tmp_path, size=3, steps=5, slow=(2,), slow_ms=10)
    found = summarize(tmp_path)
    for step in range(5):
        for rank in range(3):
            row = _row(found, step, rank)
            assert row.source == "kernels"
            _close(row, _expected(job, step, rank))
    totals = {t.rank: t for t in found.totals}
    expected = sum(_expected(job, s, 0)["waiting_ms"] for s in range(5))
    assert totals[0].steps == 5 and totals[0].total.waiting_ms == pytest.approx(expected)
    assert totals[0].mean.waiting_ms == pytest.approx(expected / 5)
    assert totals[2].mean.waiting_ms == pytest.approx(0.05)     # the slow one hardly waits
    for t in found.totals:     # the parts add up to the step
        m = t.mean
        assert m.compute_ms + m.exposed_communication_ms + m.waiting_ms + m.input_ms == \
            pytest.approx(m.step_ms)


def test_noise_in_other_collectives_does_not_hide_the_straggler(tmp_path):
    # a second all-reduce per step where rank 0 arrives last by 0.2 ms
    write_job(tmp_path, size=3, steps=6, slow=(2,), slow_ms=15, collectives=2)
    found = summarize(tmp_path)
    (straggler,) = found.stragglers
    assert straggler.rank == 2 and (straggler.last, straggler.of) == (6, 6)
    assert (straggler.collectives_last, straggler.collectives) == (6, 12)
    assert straggler.median_delay_ms == pytest.approx(15, rel=0.10)


def test_agreements_without_seq_are_matched_by_their_order(tmp_path):
    write_job(tmp_path, size=2, steps=4, slow=(0,), slow_ms=20, collectives=2, seq=False)
    (straggler,) = summarize(tmp_path).stragglers
    assert straggler.rank == 0 and straggler.last == 4
    assert straggler.median_delay_ms == pytest.approx(20.2, rel=0.05)   # (+0.2 ms: rank 0
    # is last in the step's second collective too)


def test_no_straggler_when_no_collective_is_matched(tmp_path):
    write_job(tmp_path, size=2, steps=3, ranks=[0])
    found = summarize(tmp_path)
    assert found.stragglers == [] and found.missing == [1]
    assert any("no trace of rank 1" in w for w in found.warnings)


def test_only_steps_every_rank_recorded_whole_are_summarized(tmp_path):
    write_job(tmp_path, size=2, steps=6, ranks=[0], partial_last=True)
    write_job(tmp_path, size=2, steps=4, ranks=[1])        # killed: 4 steps written
    found = summarize(tmp_path)
    assert found.steps == [0, 1, 2, 3] and found.left_out_steps == [4, 5]
    assert any("steps 4-5 left out: not recorded whole on every rank (step 5 ended where "
               "tracing stopped)" in w for w in found.warnings)
    assert {t.steps for t in found.totals} == {4}


def test_a_step_whose_classification_was_torn_off_is_classified_again(tmp_path):
    job = write_job(tmp_path, size=2, steps=3, slow=(1,), clock_sync=False)
    path = tmp_path / "rank-0.json"
    lines = path.read_bytes().split(b"\n")
    # the last chunk: the step's events, then its kernels; the last two kernels torn off
    assert b'"cat": "kernel"' in lines[-4] and b'"cat": "kernel"' in lines[-5]
    path.write_bytes(b"\n".join(lines[:-4]) + b"\n" + lines[-4][:20])
    found = summarize(tmp_path)
    row = _row(found, 2, 0)
    assert row.source == "events"
    _close(row, _expected(job, 2, 0))
    assert _row(found, 1, 0).source == "kernels"
    assert any("classified again" in w for w in found.warnings)
    assert any("rank-0.json is torn" in w for w in found.warnings)


def test_communication_on_another_thread_during_compute_is_hidden(tmp_path):
    writer = TraceWriter(str(tmp_path / "rank-0.json"), header(0, 1, trip_ns=0), 0, 0, 0)
    writer.put([(0, 100 * MS, "ProfilerStep#0", "user_annotation", {"step": 0}, 1),
                (10 * MS, 20 * MS, "bucket all_reduce", "cpu_op", {"bytes": 4096}, 2),
                (40 * MS, 10 * MS, "all_reduce", "cpu_op", {"bytes": 4096}, 1),
                (60 * MS, 5 * MS, "next batch", "input", None, 1)], 1)
    writer.close()
    (row,) = summarize(tmp_path).per_step
    # compute: the training thread's time neither communicating nor waiting (85 ms), of
    # which 20 ms overlapped the other thread's bucket all-reduce
    _close(row, {"step_ms": 100, "compute_ms": 85, "communication_ms": 30,
                 "hidden_ms": 20, "waiting_ms": 0, "input_ms": 5})
    assert row.breakdown.exposed_communication_ms == pytest.approx(10)


def test_the_slowest_collectives_with_their_bandwidth(tmp_path):
    write_job(tmp_path, size=3, steps=4, slow=(1,), nbytes=1 << 20)
    (stats,) = summarize(tmp_path).collectives
    # a call's time is the shortest of its ranks' (the last to arrive: 50 µs + 4 ms)
    assert (stats.name, stats.bytes, stats.count) == ("all_reduce", 1 << 20, 4)
    assert (stats.collective, stats.group_size, stats.algorithm) == ("allreduce", 3, "xring")
    assert stats.mean_ms == pytest.approx(4.05) and stats.median_ms == pytest.approx(4.05)
    assert stats.algbw_GBps == pytest.approx((1 << 20) / 4.05e-3 / 1e9)
    assert stats.busbw_GBps == pytest.approx(stats.algbw_GBps * 4 / 3)
    assert stats.bench_busbw_GBps is None and stats.ratio is None


@pytest.mark.parametrize("name, size, factor", [
    ("allreduce", 4, 1.5), ("all_reduce", 2, 1.0), ("allgather", 4, 0.75),
    ("reduce_scatter", 2, 0.5), ("broadcast", 8, 1.0), ("allreduce", 1, 0.0),
])
def test_bus_factor_is_nccl_tests(name, size, factor):
    assert bus_factor(name, size) == pytest.approx(factor)


def _bench(path, seconds_by_size, ranks=3):
    points = [Point(nbytes=n, count=n // 4, dtype="float32", op="sum", label=label,
                    kind="algorithm", alg=label, shards=1, participants=ranks,
                    samples=(seconds,) * 3)
              for n, entries in seconds_by_size.items() for label, seconds in entries.items()]
    write_json(path, {"ranks": ranks, "nodes": 1}, points, complete=True)


def test_bench_busbw_at_the_same_size_and_the_ratio(tmp_path):
    write_job(tmp_path / "t", size=3, steps=3, nbytes=1 << 20)
    _bench(tmp_path / "exact.json", {1 << 20: {"ring": 2e-3, "rechd": 1e-3}})
    (stats,) = summarize(tmp_path / "t", bench=read_busbw_curve(tmp_path / "exact.json")).collectives
    best = (1 << 20) / 1e-3 / 1e9 * 4 / 3
    assert stats.bench_busbw_GBps == pytest.approx(best) and stats.bench_label == "rechd"
    assert stats.bench_how == "exact"
    assert stats.ratio == pytest.approx(stats.busbw_GBps / best)
    # between two measured sizes: interpolated on a log scale of size (halfway here)
    _bench(tmp_path / "between.json", {1 << 19: {"ring": 1e-3}, 1 << 21: {"ring": 2e-3}})
    (stats,) = summarize(tmp_path / "t", bench=read_busbw_curve(tmp_path / "between.json")).collectives
    low, high = (1 << 19) / 1e-3 / 1e9 * 4 / 3, (1 << 21) / 2e-3 / 1e9 * 4 / 3
    assert stats.bench_busbw_GBps == pytest.approx((low + high) / 2)
    assert stats.bench_how == "interpolated 524288..2097152 B"
    # outside what was measured: nothing to compare with
    _bench(tmp_path / "small.json", {64: {"ring": 1e-5}})
    (stats,) = summarize(tmp_path / "t", bench=read_busbw_curve(tmp_path / "small.json")).collectives
    assert stats.bench_busbw_GBps is None


def test_a_bench_of_another_world_size_is_flagged(tmp_path):
    write_job(tmp_path / "t", size=2, steps=2)
    _bench(tmp_path / "b.json", {1 << 20: {"ring": 1e-3}}, ranks=4)
    found = summarize(tmp_path / "t", bench=read_busbw_curve(tmp_path / "b.json"))
    assert any("measured on 4 ranks, the trace's run has 2" in w for w in found.warnings)


@pytest.mark.parametrize("content, message", [
    ("not json", r"--bench: .* is not JSON"),
    ('{"format": "other"}', r"--bench: .* is not an mpistrat bench result"),
    ('{"format": "mpistrat-bench/1", "results": [{"nbytes": 64}]}',
     r"--bench: .*results\[0\]\.count is missing"),
    (None, r"--bench: .*results\[1\]\.nbytes must be an integer >= 0, got '1M'"),
])
def test_a_bad_bench_file_is_a_clear_error(tmp_path, content, message):
    write_job(tmp_path / "t", size=2, steps=2)
    if content is None:      # a real result with one field forged
        _bench(tmp_path / "b.json", {64: {"ring": 1e-5}, 1 << 20: {"ring": 1e-3}})
        document = json.loads((tmp_path / "b.json").read_text())
        document["results"][1]["nbytes"] = "1M"
        content = json.dumps(document)
    (tmp_path / "b.json").write_text(content)
    with pytest.raises(TraceError, match=message):
        summarize(tmp_path / "t", bench=read_busbw_curve(tmp_path / "b.json"))


# -- the command ---------------------------------------------------------------------------


def test_the_command_s_json_names_the_straggler(tmp_path):
    write_job(tmp_path, size=3, steps=5, slow=(2,), slow_ms=40)
    out = CliRunner().invoke(cli, ["trace", "summary", str(tmp_path), "--json"])
    assert out.exit_code == 0, out.output
    found = json.loads(out.output)
    (slowest,) = found["stragglers"]
    assert slowest["rank"] == 2 and slowest["last"] == slowest["of"] == 5
    assert slowest["median_delay_ms"] == pytest.approx(40, rel=0.10)
    assert found["steps"] == [0, 1, 2, 3, 4] and len(found["per_step"]) == 15
    assert found["totals"][0]["mean"]["waiting_ms"] > 39
    assert found["collectives"][0]["bytes"] == 1 << 20


def test_the_command_s_text(tmp_path):
    write_job(tmp_path, size=2, steps=4, slow=(1,), slow_ms=20, hosts={1: "node2"})
    out = CliRunner().invoke(cli, ["trace", "summary", str(tmp_path), "--steps"])
    assert out.exit_code == 0, out.output
    text = out.output
    assert "4 steps recorded whole on every rank (0-3)" in text
    assert "rank 1 (node2): last in 4 of 4 steps (4 of 4 collectives)" in text
    assert "all_reduce  1 MiB  4      4.050" in text
    assert "every step (ms)" in text and len(text.splitlines()) > 20


@needs_matplotlib
def test_the_command_draws_a_png(tmp_path):
    write_job(tmp_path / "t", size=3, steps=3, slow=(1,))
    out = CliRunner().invoke(cli, ["trace", "summary", str(tmp_path / "t"), "--png",
                                   str(tmp_path / "plots" / "ranks.png")])
    assert out.exit_code == 0, out.output
    data = (tmp_path / "plots" / "ranks.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000


def test_png_without_matplotlib_says_how_to_install(monkeypatch, tmp_path):
    write_job(tmp_path / "t", size=2, steps=2)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    out = CliRunner().invoke(cli, ["trace", "summary", str(tmp_path / "t"), "--png",
                                   str(tmp_path / "x.png")])
    assert out.exit_code == 1 and "pip install matplotlib" in out.output
    assert not (tmp_path / "x.png").exists()


def test_the_command_s_errors_are_clear(tmp_path):
    out = CliRunner().invoke(cli, ["trace", "summary", str(tmp_path / "none")])
    assert out.exit_code == 1 and "Error: no trace directory" in out.output
    (tmp_path / "rank-0.json").write_text("[]")
    out = CliRunner().invoke(cli, ["trace", "summary", str(tmp_path)])
    assert out.exit_code == 1 and "holds a JSON list, not an object" in out.output


def test_the_mark_where_the_window_ends_is_not_a_step(tmp_path):
    # the recorder marks the step after its window with a zero-length span (for HTA):
    # not a step of the summary, and no warning about it
    from mpistrat.runtime import recorder

    for rank in range(2):
        writer = TraceWriter(str(tmp_path / f"rank-{rank}.json"), header(rank, 2), rank, 0, 0)
        rec = recorder.Recorder((0, 3), 100, writer.put)
        recorder.install(rec)
        try:
            for _ in range(5):
                recorder.boundary(recorder.FROM_SCRIPT)
            rec.hand_over()
        finally:
            recorder.install(None)
            writer.close()
    found = summarize(tmp_path)
    assert found.steps == [0, 1, 2] and found.left_out_steps == []
    assert not any("left out" in w for w in found.warnings), found.warnings
