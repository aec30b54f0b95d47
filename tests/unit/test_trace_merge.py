"""``mpistrat trace merge``: the ranks' clocks aligned (a drift measured between the start
and the stop corrected linearly), one process per rank with its events in time order, the
skew reported, the output never inside the trace directory; torn files, missing ranks and
implausible clock measurements handled with a warning."""

from __future__ import annotations

import gzip
import json
import os

import pytest
from click.testing import CliRunner
from test_trace_files import MS, write_job

from mpistrat.cli import cli
from mpistrat.trace import TraceError
from mpistrat.trace.merge import MAX_DRIFT, default_output, merge
from mpistrat.trace.view import prepare


def _load(path):
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def _spans(document, rank, name):
    return [e for e in document["traceEvents"] if e["pid"] == rank and e["name"] == name
            and e["ph"] == "X"]


def test_a_drift_between_start_and_stop_is_corrected(tmp_path):
    # ranks 1 and 2 drift 150 µs and -120 µs from rank 0 over the run, and their clocks
    # start 3 ms and 7 ms off (the start's offset is in the files already)
    drift = {1: 150, 2: -120}
    job = write_job(tmp_path / "t", size=3, steps=6, drift_us=drift,
                    offset_us={1: 3000, 2: -7000}, trip_us=30)
    raw = {r: json.load(open(tmp_path / "t" / f"rank-{r}.json")) for r in range(3)}
    result = merge(tmp_path / "t", tmp_path / "job.json")
    merged = _load(tmp_path / "job.json")
    for rank in range(3):
        steps = _spans(merged, rank, "all_reduce")
        before = _spans(raw[rank], rank, "all_reduce")
        truth = [step[rank][2][0] for step in job]          # (arrive, agreed, done)
        for event, old, (arrive, _, done) in zip(steps, before, truth):
            assert event["ts"] == pytest.approx(arrive / 1000, abs=0.002)
            assert event["ts"] + event["dur"] == pytest.approx(done / 1000, abs=0.002)
        if rank:   # the file's own times are off by up to the drift at the end
            last_error = abs(before[-1]["ts"] - truth[-1][0] / 1000)
            assert last_error > 0.8 * abs(drift[rank]) * truth[-1][0] / (job[-1][0][1] + MS)
    clocks = {c.rank: c for c in result.clocks}
    assert clocks[1].drift_ns == 150_000 and clocks[2].drift_ns == -120_000
    assert all(c.corrected for c in clocks.values())
    assert clocks[1].skew_us == 15.0 and result.max_skew_us == 15.0
    skew = merged["mpistrat"]["skew"]
    assert skew["max_us"] == 15.0
    assert skew["ranks"][2] == {"rank": 2, "skew_us": 15.0, "half_round_trip_us": 15.0,
                                "end_half_round_trip_us": 15.0, "drift_us": -120.0,
                                "drift_corrected": True}


def test_one_process_per_rank_with_its_events_in_time_order(tmp_path):
    write_job(tmp_path / "t", size=3, steps=4, hosts={0: "a", 1: "a", 2: "b"},
              drift_us={2: 80})
    result = merge(tmp_path / "t", tmp_path / "job.json")
    merged = _load(tmp_path / "job.json")
    assert (result.ranks, result.missing, result.size) == ([0, 1, 2], [], 3)
    assert result.events == len(merged["traceEvents"])
    names = {e["pid"]: e["args"]["name"] for e in merged["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "rank 0 (a)", 1: "rank 1 (a)", 2: "rank 2 (b)"}
    pids = [e["pid"] for e in merged["traceEvents"]]
    assert pids == sorted(pids)                      # rank by rank
    for rank in range(3):
        mine = [e for e in merged["traceEvents"] if e["pid"] == rank]
        phases = [e["ph"] for e in mine]
        assert phases == sorted(phases, key=lambda p: p != "M")   # metadata first
        times = [e["ts"] for e in mine if e["ph"] != "M"]
        assert times == sorted(times) and len(times) > 4 * 6
    meta = merged["mpistrat"]
    assert meta["run"] == "0123abcd" and meta["size"] == 3 and meta["missing"] == []
    assert [r["host"] for r in meta["ranks"]] == ["a", "a", "b"]
    assert merged["distributedInfo"]["world_size"] == 3
    view = prepare(merged)                 # the page viewer reads it as a trace too
    assert len(view["processes"]) == 3


def test_the_default_output_is_beside_the_directory_never_in_it(tmp_path):
    write_job(tmp_path / "traces", size=2, steps=2)
    assert default_output(tmp_path / "traces") == str(tmp_path / "traces-merged.json")
    assert default_output(str(tmp_path / "traces") + "/") == \
        str(tmp_path / "traces-merged.json")
    result = merge(tmp_path / "traces")
    assert result.path == str(tmp_path / "traces-merged.json")
    assert sorted(os.listdir(tmp_path / "traces")) == ["rank-0.json", "rank-1.json"]
    for inside in ("job.json", "sub/job.json", "rank-3.json"):
        with pytest.raises(TraceError, match="inside the trace directory.*beside"):
            merge(tmp_path / "traces", tmp_path / "traces" / inside)
    os.symlink(tmp_path / "traces", tmp_path / "alias")
    with pytest.raises(TraceError, match="inside the trace directory"):
        merge(tmp_path / "traces", tmp_path / "alias" / "job.json")


def test_a_gz_output_is_compressed(tmp_path):
    write_job(tmp_path / "t", size=2, steps=2)
    merge(tmp_path / "t", tmp_path / "job.json.gz")
    with open(tmp_path / "job.json.gz", "rb") as f:
        assert f.read(2) == b"\x1f\x8b"
    assert {e["pid"] for e in _load(tmp_path / "job.json.gz")["traceEvents"]} == {0, 1}


def test_a_job_that_died_merges_with_what_it_left(tmp_path):
    # no clock_sync (the job died before stop), rank 2 never wrote, rank 1's file torn
    write_job(tmp_path / "t", size=3, steps=4, ranks=[0, 1], clock_sync=False,
              drift_us={1: 100})
    path = tmp_path / "t" / "rank-1.json"
    path.write_bytes(path.read_bytes()[:-30])
    result = merge(tmp_path / "t", tmp_path / "job.json")
    assert result.missing == [2] and result.ranks == [0, 1]
    text = "\n".join(result.warnings)
    assert "rank-1.json is torn" in text and "no trace of rank 2 of 3" in text
    (clock,) = [c for c in result.clocks if c.rank == 1]
    assert clock.drift_ns is None and not clock.corrected and "drift unknown" in \
        clock.describe()
    merged = _load(tmp_path / "job.json")
    assert {e["pid"] for e in merged["traceEvents"]} == {0, 1}
    assert merged["mpistrat"]["missing"] == [2]
    assert merged["mpistrat"]["ranks"][1]["torn"] is True


def test_an_implausible_drift_is_not_corrected(tmp_path):
    job = write_job(tmp_path / "t", size=2, steps=3)
    end_us = (job[-1][0][1] + MS) / 1000
    path = tmp_path / "t" / "rank-1.json"
    document = json.loads(path.read_text())
    (sync,) = [e for e in document["traceEvents"] if e["name"] == "clock_sync"]
    sync["args"]["offset_ns"] = int(3 * MAX_DRIFT * end_us * 1000)
    path.write_text(json.dumps(document))
    result = merge(tmp_path / "t", tmp_path / "job.json")
    (clock,) = [c for c in result.clocks if c.rank == 1]
    assert not clock.corrected and "implausible" in clock.describe()
    assert any("more than 1000 ppm; a bad measurement: not corrected" in w
               for w in result.warnings)
    merged = _load(tmp_path / "job.json")
    assert _spans(merged, 1, "all_reduce")[0]["ts"] == _spans(document, 1, "all_reduce")[0]["ts"]


def test_a_rank_whose_offset_was_never_measured_is_reported(tmp_path):
    write_job(tmp_path / "t", size=2, steps=2, trip_us=-0.001)   # round_trip_ns -1
    result = merge(tmp_path / "t", tmp_path / "job.json")
    assert result.max_skew_us is None
    assert any("never measured" in w for w in result.warnings)


def test_the_command_prints_the_skew_and_the_file(tmp_path):
    write_job(tmp_path / "t", size=2, steps=2, drift_us={1: 40}, trip_us=50)
    out = CliRunner().invoke(cli, ["trace", "merge", str(tmp_path / "t")])
    assert out.exit_code == 0, out.output
    assert "clock skew: at most ±25.0 µs" in out.output
    assert "drift +40.0 µs corrected" in out.output
    assert f"wrote {tmp_path / 't-merged.json'}: 2 of 2 ranks of run 0123abcd" in out.output


def test_the_command_s_errors_are_clear(tmp_path):
    out = CliRunner().invoke(cli, ["trace", "merge", str(tmp_path / "none")])
    assert out.exit_code == 1 and "Error: no trace directory" in out.output
    write_job(tmp_path / "t", size=1, steps=1)
    out = CliRunner().invoke(cli, ["trace", "merge", str(tmp_path / "t"), "-o",
                                   str(tmp_path / "t" / "job.json")])
    assert out.exit_code == 1 and "inside the trace directory" in out.output
    out = CliRunner().invoke(cli, ["trace", "merge", str(tmp_path / "t"), "--max-mib", "0"])
    assert out.exit_code == 2
