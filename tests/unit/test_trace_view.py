"""The HTML timeline of a trace (mpistrat.trace.view, ``mpistrat trace view``): the page
embeds every drawable event of the ranks' files (as the trace writer writes them), nests
spans by depth, cannot be broken out of by hostile names, loads nothing from the network,
rejects what is not a trace with a clear error, and, where Chromium is installed, draws."""

from __future__ import annotations

import base64
import gzip
import hashlib
import html
import json
import re
import shutil
import subprocess

import pytest
from click.testing import CliRunner

from mpistrat.cli.trace_view import view
from mpistrat.trace import TraceError
from mpistrat.trace.view import load_trace, prepare, write_html
from mpistrat.trace.writer import TraceWriter

MS = 1_000_000  # ns

HOSTILE = "</script><script>document.body.setAttribute('data-pwned','1')</script><!--"


def _rank_events(rank: int, size: int, steps: int, late: int) -> list[tuple]:
    """One rank's event tuples (start_ns, dur_ns, name, cat, args, thread) as the recorder
    keeps them: steps of a strategy.run then an all-reduce whose agreement waits for rank
    ``late`` (which computes 20 ms longer)."""
    thread = 1000 + rank
    events = []
    for step in range(steps):
        t = step * 40 * MS
        compute = 5 * MS + (20 * MS if rank == late else 0)
        arrive = t + compute
        last = t + 26 * MS          # the late rank waits 1 ms too
        end = last + 2 * MS
        events += [
            (t, compute, "strategy.run", "user_annotation", {"replicas": 1}, thread),
            (t + MS, compute - 2 * MS, "replica_fn", "user_annotation", None, thread),
            (arrive, end - arrive, "all_reduce", "cpu_op",
             {"Collective name": "allreduce", "dtype": "float32", "In msg nelems": 65536,
              "Out msg nelems": 65536, "Group size": size, "algorithm": "ring",
              "bytes": 262144, "seq": step, "algbw (GB/s)": 0.13, "busbw (GB/s)": 0.13},
             thread),
            (arrive, last - arrive, "agreement", "mpistrat_phase", {"last rank": late},
             thread),
            (last, end - last, "ring", "mpistrat_phase", None, thread),
            (t, 40 * MS, f"ProfilerStep#{step}", "user_annotation", {"step": step}, thread),
        ]
    return events


@pytest.fixture
def merged(tmp_path):
    """A 2-rank trace: each rank's file written by the trace writer, their traceEvents
    combined into one list (what ``mpistrat trace merge`` produces, less its header)."""
    combined = []
    for rank in range(2):
        path = tmp_path / f"rank-{rank}.json"
        header = {"distributedInfo": {"rank": rank, "world_size": 2, "backend": "mpistrat"},
                  "mpistrat": {"format": 1, "run": "ab12", "rank": rank, "size": 2}}
        writer = TraceWriter(str(path), header, rank, 0, 0)
        writer.put(_rank_events(rank, 2, steps=3, late=1), 3)
        writer.close()
        combined += json.loads(path.read_text())["traceEvents"]
    out = tmp_path / "job.json"
    out.write_text(json.dumps({"traceEvents": combined, "mpistrat": {"run": "ab12"}}))
    return out


def _data(page: str) -> dict:
    found = re.search(r'<script type="application/json" id="trace-data">(.*?)</script>',
                      page, re.S)
    assert found, "no embedded trace"
    return json.loads(found.group(1))


def _script(page: str) -> str:
    return re.search(r"<script>(.*?)</script>", page, re.S).group(1)


def _spans(data: dict, name: str) -> list[list]:
    index = data["names"].index(name)
    return [e for e in data["events"] if e[2] == index]


def test_page_has_every_event_of_the_ranks(merged, tmp_path):
    trace = json.loads(merged.read_text())
    drawable = [e for e in trace["traceEvents"] if e["ph"] in ("X", "i")]
    result = write_html(merged, tmp_path / "job.html")
    data = _data((tmp_path / "job.html").read_text())
    assert result.events == len(data["events"]) == len(drawable)
    assert result.processes == 2 and result.skipped == {} and result.left_out == 0
    assert [p["name"] for p in data["processes"]] == ["rank 0", "rank 1"]
    assert sorted({data["names"][e[2]] for e in data["events"]}) == \
        sorted({e["name"] for e in drawable})
    # the training thread first, then the classification's streams in order
    rows = [data["threads"][t]["name"] for t in data["processes"][0]["threads"]]
    assert rows == ["thread 1000", "stream 7 compute", "stream 8 communication",
                    "stream 9 waiting"]
    collective = _spans(data, "all_reduce")[0]
    assert collective[6]["busbw (GB/s)"] == 0.13 and collective[6]["Group size"] == 2
    assert data["events"] == sorted(data["events"], key=lambda e: e[0])
    assert "(run ab12)" in data["title"]


def test_spans_nest_by_depth(merged):
    data = prepare(json.loads(merged.read_text()))
    depth = {name: {e[5] for e in _spans(data, name)}
             for name in ("ProfilerStep#0", "strategy.run", "replica_fn", "all_reduce",
                          "agreement", "ring")}
    assert depth == {"ProfilerStep#0": {0}, "strategy.run": {1}, "replica_fn": {2},
                     "all_reduce": {1}, "agreement": {2}, "ring": {2}}
    # back-to-back steps stay on one row although ts + dur is not exact in binary
    steps = [{"ph": "X", "name": f"s{i}", "ts": ts, "dur": dur, "pid": 0, "tid": 1}
             for i, (ts, dur) in enumerate([(5641.337, 27943.269), (33584.606, 28103.277),
                                            (61687.883, 27981.676)])]
    assert [e[5] for e in prepare(steps)["events"]] == [0, 0, 0]


def test_thread_rows_spans_then_streams_then_instants():
    events = [
        {"ph": "i", "name": "clock_sync", "cat": "clock", "ts": 0, "pid": 0, "tid": 0},
        {"ph": "X", "name": "compute", "cat": "kernel", "ts": 1, "dur": 1, "pid": 0, "tid": 8},
        {"ph": "X", "name": "compute", "cat": "kernel", "ts": 1, "dur": 1, "pid": 0, "tid": 7},
        {"ph": "X", "name": "copy", "ts": 2, "dur": 1, "pid": 0, "tid": 55},
        {"ph": "X", "name": "step", "ts": 1, "dur": 1, "pid": 0, "tid": 99},
        {"ph": "X", "name": "r1", "ts": 0, "dur": 1, "pid": 1, "tid": 1},
        {"ph": "M", "name": "process_sort_index", "pid": 1, "args": {"sort_index": -1}},
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": 99, "args": {"name": "main"}},
    ]
    data = prepare(events)
    assert [p["pid"] for p in data["processes"]] == ["1", "0"]
    rows = [data["threads"][t] for t in data["processes"][1]["threads"]]
    assert [(r["name"], r["tid"]) for r in rows] == [
        ("main", "99"), ("thread 55", "55"), ("thread 7", "7"), ("thread 8", "8"),
        ("thread 0", "0")]


def test_legend_tells_steps_agreements_and_streams_apart(merged):
    data = prepare(json.loads(merged.read_text()))
    keys = {k["key"]: k for k in data["keys"]}
    assert {"step", "user_annotation", "cpu_op", "agreement", "mpistrat_phase",
            "kernel compute", "kernel communication", "kernel waiting"} <= set(keys)
    assert keys["step"]["count"] == 6 and keys["agreement"]["count"] == 6
    assert keys["agreement"]["color"] == keys["kernel waiting"]["color"]
    assert keys["agreement"]["color"] != keys["cpu_op"]["color"]
    # in an order that reads: a step's contents, then the streams, whatever came first
    assert [k["key"] for k in data["keys"]] == [
        "step", "user_annotation", "cpu_op", "agreement", "mpistrat_phase",
        "kernel compute", "kernel communication", "kernel waiting"]
    expected = {"ProfilerStep#1": "step", "replica_fn": "user_annotation",
                "all_reduce": "cpu_op", "agreement": "agreement", "ring": "mpistrat_phase",
                "compute": "kernel compute", "waiting Sync": "kernel waiting"}
    for name, key in expected.items():
        assert {data["keys"][e[3]]["key"] for e in _spans(data, name)} == {key}


def test_hostile_names_cannot_end_the_script(tmp_path):
    events = [
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": HOSTILE}},
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": 1, "args": {"name": "<!--"}},
        {"ph": "X", "name": HOSTILE, "cat": "</SCRIPT >", "ts": 0, "dur": 10, "pid": 0,
         "tid": 1, "args": {"note": "</script><img src=x onerror=alert(1)>", "&": "&amp;"}},
        {"ph": "i", "name": "{{SCRIPT}} {{DATA}}", "ts": 5, "pid": 0, "tid": 1, "s": "t"},
    ]
    title = "<img src=x onerror=alert(1)> {{SCRIPT}}"
    write_html(events, tmp_path / "x.html", title=title)
    page = (tmp_path / "x.html").read_text()
    assert len(re.findall(r"</script", page, re.I)) == 2          # the page's own two
    assert len(re.findall(r"<script", page, re.I)) == 2
    assert "<!--" not in page and "<img" not in page
    assert page.count(_script(page)) == 1                         # filled in once
    assert f"<title>{html.escape(title)}</title>" in page
    data = _data(page)                                            # every name intact
    assert data["names"] == [HOSTILE, "{{SCRIPT}} {{DATA}}"]
    assert data["processes"][0]["name"] == HOSTILE
    assert data["threads"][0]["name"] == "<!--"
    assert data["events"][0][6]["note"] == "</script><img src=x onerror=alert(1)>"


def test_page_loads_nothing_from_the_network(merged, tmp_path):
    write_html(merged, tmp_path / "job.html")
    page = (tmp_path / "job.html").read_text()
    policy = re.search(r'http-equiv="Content-Security-Policy" content="([^"]*)"', page)
    assert policy and "default-src 'none'" in policy.group(1)
    # only the page's own script may run: its hash is the one in the policy
    digest = base64.b64encode(hashlib.sha256(_script(page).encode()).digest()).decode()
    assert f"script-src 'sha256-{digest}'" in policy.group(1)
    assert "http:" not in page and "https:" not in page and " src=" not in page


@pytest.mark.parametrize("text, expected", [
    ("hello", "is not valid JSON"),
    ("42", "got a JSON int"),
    ('{"name": "x", "events": []}', "got an object with keys 'name', 'events'"),
    ('{"traceEvents": {"ph": "X"}}', "traceEvents is a dict, expected a list"),
    ('{"traceEvents": []}', "no event to draw"),
    ('[{"ph": "C", "name": "c", "ts": 1}, 7]', "skipped: 1 phase 'C' (not drawn); "
                                              "1 not an object"),
    ('[{"ph": "X", "name": "x", "ts": NaN, "dur": 1}]', "NaN is not a JSON number"),
])
def test_what_is_not_a_trace_is_a_clear_error(tmp_path, text, expected):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(TraceError, match=re.escape(expected)):
        write_html(path, tmp_path / "bad.html")
    assert not (tmp_path / "bad.html").exists()


def test_files_that_cannot_be_read(tmp_path, merged):
    with pytest.raises(TraceError, match="no trace file"):
        load_trace(tmp_path / "missing.json")
    with pytest.raises(TraceError, match=r"is a directory.*mpistrat trace merge"):
        load_trace(tmp_path)
    with pytest.raises(TraceError, match=r"larger than 0 MiB.*--trace-steps"):
        load_trace(merged, max_bytes=100)
    bomb = tmp_path / "bomb.json.gz"                 # small file, large when unpacked
    bomb.write_bytes(gzip.compress(b"[" + b" " * 10_000 + b"]"))
    with pytest.raises(TraceError, match="larger than"):
        load_trace(bomb, max_bytes=5000)
    torn = tmp_path / "torn.json"
    torn.write_text(merged.read_text()[:-40])
    with pytest.raises(TraceError, match="not valid JSON"):
        load_trace(torn)


def test_gzip_trace_reads_as_the_plain_one(merged, tmp_path):
    packed = tmp_path / "job.json.gz"
    packed.write_bytes(gzip.compress(merged.read_bytes()))
    assert load_trace(packed) == load_trace(merged)


def test_events_of_the_wrong_shape_are_skipped_and_counted(tmp_path):
    good = {"ph": "X", "name": "ok", "ts": 1, "dur": 2, "pid": 0, "tid": 0}
    bad = [
        "text", None,
        {"ph": "B", "name": "b", "ts": 1, "pid": 0, "tid": 0},
        {"ph": "Q", "name": "q", "ts": 1},
        {**good, "dur": -1}, {**good, "dur": None}, {**good, "ts": "1"}, {**good, "ts": True},
        {**good, "ts": 1e400}, {**good, "name": 3}, {**good, "cat": ["x"]},
        {**good, "pid": [0]}, {**good, "tid": 1.5}, {**good, "args": [1]},
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": 0, "args": {}},
        {"ph": "M", "name": "process_sort_index", "pid": 0, "args": {"sort_index": "1"}},
    ]
    fine = [{"ph": "M", "name": "process_labels", "pid": 0, "args": {"labels": "x"}}]
    data = prepare([good, *bad, *fine, {**good, "ph": "i", "dur": None}])
    assert len(data["events"]) == 2
    assert data["skipped"] == {
        "not an object": 2, "phase 'B' (not drawn)": 1, "no known phase (ph)": 1,
        "X event without a finite dur >= 0": 2, "ts missing or not a finite number": 3,
        "name not a string": 1, "cat not a string": 1,
        "pid or tid not an integer or a short string": 2, "args not an object": 1,
        "thread_name without an args.name": 1, "process_sort_index without an args.sort_index": 1}
    result = write_html([good, *bad], tmp_path / "p.html")
    assert result.events == 1 and sum(result.skipped.values()) == len(bad)


def test_args_that_are_too_big_or_not_json_are_replaced():
    events = [{"ph": "X", "name": "a", "ts": 0, "dur": 1, "args": {"x": "y" * 10_000}},
              {"ph": "X", "name": "b", "ts": 2, "dur": 1, "args": {"x": float("nan")}},
              {"ph": "X", "name": "c", "ts": 4, "dur": 1, "args": {(1, 2): 3}}]
    data = prepare(events)
    assert [list(e[6]) for e in data["events"]] == [["(args)"]] * 3
    assert "left out" in data["events"][0][6]["(args)"]


def test_max_events_keeps_the_earliest_and_counts_the_rest(merged, tmp_path):
    trace = json.loads(merged.read_text())
    drawable = sorted(e["ts"] for e in trace["traceEvents"] if e["ph"] in ("X", "i"))
    result = write_html(trace, tmp_path / "few.html", max_events=5)
    data = _data((tmp_path / "few.html").read_text())
    assert result.events == 5 and result.left_out == len(drawable) - 5
    assert [e[0] for e in data["events"]] == [round(t, 3) for t in drawable[:5]]
    with pytest.raises(TraceError, match="max_events must be a positive integer, got 0"):
        write_html(trace, tmp_path / "none.html", max_events=0)


def test_window_keeps_the_overlapping_events_and_opens_on_them(merged):
    trace = json.loads(merged.read_text())
    data = prepare(trace, window=(45.0, 60.0))               # inside step 1
    assert data["view"] == [45.0, 60.0]
    for e in data["events"]:
        assert e[0] <= 60_000 and e[0] + max(e[1], 0) >= 45_000
    assert {data["names"][e[2]] for e in data["events"]} >= {"ProfilerStep#1", "agreement"}
    assert "ProfilerStep#0" not in {data["names"][e[2]] for e in data["events"]}
    assert data["left_out"] > 0
    after = prepare(trace, window=(45.0, None))
    assert after["view"] == [45.0, after["span"][1] / 1000]
    with pytest.raises(TraceError, match="'to' must be greater than 'from'"):
        prepare(trace, window=(60.0, 45.0))
    with pytest.raises(TraceError, match="no event to draw in the window"):
        prepare(trace, window=(10_000.0, 10_001.0))


# ----------------------------------------------------------------------------- the CLI
def test_cli_writes_the_page(merged, tmp_path):
    out = tmp_path / "job.html"
    result = CliRunner().invoke(view, [str(merged), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert f"wrote {out}:" in result.output and "of 2 processes" in result.output
    assert _data(out.read_text())["processes"][1]["name"] == "rank 1"


def test_cli_default_output_and_window(merged, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(view, [str(merged), "--from", "45", "--to", "60"])
    assert result.exit_code == 0, result.output
    assert _data((tmp_path / "job.html").read_text())["view"] == [45.0, 60.0]
    assert "left out" in result.output


@pytest.mark.parametrize("args, code, expected", [
    (["--from", "5", "--to", "5"], 2, "--to 5.0 must be greater than --from 5.0"),
    (["--max-events", "0"], 2, "--max-events"),
])
def test_cli_bad_options(merged, args, code, expected):
    result = CliRunner().invoke(view, [str(merged), *args])
    assert result.exit_code == code and expected in result.output


def test_cli_not_a_trace_is_an_error_not_a_traceback(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"hello": 1}')
    result = CliRunner().invoke(view, [str(bad), "-o", str(tmp_path / "bad.html")])
    assert result.exit_code == 1 and result.exception is not None
    assert isinstance(result.exception, SystemExit)
    assert "Error: not a Trace Event file" in result.output


# ------------------------------------------------------------------- in a real browser
def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return name
    pytest.skip("no Chromium to render the page with")


def _headless(page, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1000,600",
         "--virtual-time-budget=3000", *args, page.as_uri()],
        capture_output=True, text=True, timeout=90, check=False)


def test_chromium_draws_the_page_and_runs_no_injected_script(merged, tmp_path):
    trace = json.loads(merged.read_text())
    trace["traceEvents"].append({"ph": "X", "name": HOSTILE, "ts": 1, "dur": 1, "pid": 0,
                                 "tid": 1000})
    page = tmp_path / "job.html"
    write_html(trace, page)
    dom = _headless(page, "--dump-dom").stdout
    body = re.search(r"<body[^>]*>", dom)
    assert body, dom[-2000:]
    drawn = re.search(r'data-drawn="(\d+)"', body.group(0))   # the script ran, and drew
    assert drawn and int(drawn.group(1)) > 0, body.group(0)
    assert "data-pwned" not in body.group(0)
    shot = tmp_path / "job.png"
    _headless(page, f"--screenshot={shot}")
    assert shot.stat().st_size > 1000
    image = pytest.importorskip("PIL.Image").open(shot).convert("RGB")
    colours = {c for _, c in image.getcolors(maxcolors=1 << 20)}
    assert (0x59, 0xA1, 0x4F) in colours and (0xE1, 0x57, 0x59) in colours  # compute, waiting
