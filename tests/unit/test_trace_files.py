"""Reading rank files (``mpistrat.trace.files``): files the writer wrote read back whole;
a file torn by a killed rank is cut back to its last complete event; forged and hostile
files (not an object, huge numbers, deep nesting, wrong types, links, FIFOs, oversized
files, other runs, duplicate ranks) are clear errors or are left out by name.

:func:`write_job` (used by the merge, summary and HTA tests too) writes a synthetic job's
rank files with the real :class:`~mpistrat.trace.writer.TraceWriter`, from a model of
true time: in every step each rank computes, then all-reduces; the collective's agreement
lasts until the last rank has arrived."""

from __future__ import annotations

import json
import os
import re

import pytest

from mpistrat.trace import TraceError
from mpistrat.trace.files import ranges, read_directory, read_rank
from mpistrat.trace.writer import TraceWriter

MS = 1_000_000          # ns
US = 1_000


def header(rank, size, run="0123abcd", host="node1", offset_ns=0, trip_ns=20 * US):
    """What mpistrat.trace.start writes at the top of a rank file."""
    return {"distributedInfo": {"rank": rank, "world_size": size, "backend": "mpistrat"},
            "schemaVersion": 1, "baseTimeNanoseconds": 1_700_000_000_000_000_000,
            "mpistrat": {"format": 1, "run": run, "rank": rank, "size": size, "host": host,
                         "pid": 4000 + rank, "steps": [0, None], "max_events": 2000,
                         "clock": {"offset_ns": offset_ns, "round_trip_ns": trip_ns}}}


def model(size, steps, slow=(), slow_ms=20.0, collectives=1, jitter_us=50):
    """True times (ns) of a job: per step and rank ``(start, stop, [(arrive, agreed,
    done), ...])``. Every rank computes 30 ms (``slow`` ranks ``slow_ms`` more) and
    arrives at the first collective (rank r ``r * jitter_us`` later); later collectives
    of a step follow 2 ms after the previous one, rank 0 arriving last by 0.2 ms."""
    found = []
    start = 1 * MS
    for _ in range(steps):
        ranks: dict[int, list] = {r: [] for r in range(size)}
        arrive = {r: start + 30 * MS + int(slow_ms * MS * (r in slow)) + r * jitter_us * US
                  for r in range(size)}
        for k in range(collectives):
            agreed = max(arrive.values()) + 50 * US
            done = agreed + 4 * MS
            for r in range(size):
                ranks[r].append((arrive[r], agreed, done))
            arrive = {r: done + 2 * MS + (200 * US if r == 0 else r * US) for r in range(size)}
        stop = done + 1 * MS
        found.append({r: (start, stop, ranks[r]) for r in range(size)})
        start = stop
    return found


def write_job(directory, *, size=2, steps=6, run="0123abcd", slow=(), slow_ms=20.0,
              collectives=1, drift_us=None, offset_us=None, trip_us=20, hosts=None,
              clock_sync=True, seq=True, partial_last=False, nbytes=1 << 20, ranks=None,
              jitter_us=50):
    """Write ``directory/rank-R.json`` for ``ranks`` (default all) of a :func:`model`
    job; rank r's clock is ``offset_us[r]`` off rank 0's at the start and drifts by
    ``drift_us[r]`` until the stop (where ``clock_sync`` records it). Returns the model."""
    os.makedirs(directory, exist_ok=True)
    job = model(size, steps, slow, slow_ms, collectives, jitter_us)
    end = job[-1][0][1] + 1 * MS
    for r in (range(size) if ranks is None else ranks):
        offset = int((offset_us or {}).get(r, 0) * US)
        drift = int((drift_us or {}).get(r, 0) * US)

        def local(t, offset=offset, drift=drift):
            return t - drift * t // end - offset       # this rank's clock at true time t

        def span(a, b, name, cat, args, thread=11, local=local):
            return (local(a), local(b) - local(a), name, cat, args, thread)

        trip = round(trip_us * US) if r else 0       # (rank 0 is the reference)
        writer = TraceWriter(os.path.join(directory, f"rank-{r}.json"),
                             header(r, size, run, (hosts or {}).get(r, "node1"), offset,
                                    trip), r, offset, 0)
        for number, step in enumerate(job):
            start, stop, calls = step[r]
            events = []
            for k, (arrive, agreed, done) in enumerate(calls):
                ident = {"seq": number * collectives + k + 1} if seq else {}
                args = {"Collective name": "allreduce", "dtype": "float32",
                        "In msg nelems": nbytes // 4, "Out msg nelems": nbytes // 4,
                        "Group size": size, "algorithm": "xring", "bytes": nbytes, **ident}
                events.append(span(arrive, done, "all_reduce", "cpu_op", args))
                events.append(span(arrive, agreed, "agreement", "mpistrat_phase",
                                   ident or None))
            events.append(span(start, start + 25 * MS, "replica_fn", "user_annotation", None))
            step_args = {"step": number}
            if partial_last and number == len(job) - 1:
                step_args["partial"] = True
            events.append(span(start, stop, f"ProfilerStep#{number}", "user_annotation",
                               step_args))
            writer.put(events, number + 1)
        if clock_sync:
            writer.put([(local(end), -1, "clock_sync", "clock",
                         {"offset_ns": offset + drift, "round_trip_ns": trip}, 0)],
                       len(job))
        writer.close()
    return job


def _document(path):
    with open(path) as f:
        return json.load(f)


def _dump(path, document):
    with open(path, "w") as f:
        json.dump(document, f)


# -- whole files -------------------------------------------------------------------------


def test_the_writer_s_files_read_back_whole(tmp_path):
    write_job(tmp_path, size=3, steps=4, hosts={2: "node2"})
    run = read_directory(tmp_path)
    assert (run.run, run.size, run.missing, run.left_out) == ("0123abcd", 3, [], [])
    assert [t.rank for t in run.ranks] == [0, 1, 2] and run.ranks[2].host == "node2"
    assert all(t.events == [] for t in run.ranks)      # (the headers only, so far)
    traces = list(run.traces())
    assert [t.rank for t in traces] == [0, 1, 2]
    for trace in traces:
        assert trace.skipped == {} and not trace.torn
        on_disk = _document(trace.path)["traceEvents"]
        assert trace.events == on_disk
        assert sum(e["name"].startswith("ProfilerStep#") for e in trace.events) == 4
    assert run.warnings() == []


# -- torn files ----------------------------------------------------------------------------


def _tear(path, keep):
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(keep(data))
    return data


@pytest.mark.parametrize("keep", [
    lambda d: d[:-4],                                  # the trailer lost
    lambda d: d[:-4][:-37],                            # inside the last event
    lambda d: d[:d.rindex(b'"ts"')],                   # inside the last event's fields
    lambda d: d[:-4] + b",\n" + b"}\n",                # a 2-byte write over the old trailer
    lambda d: d[:-4] + b",",                           # a 1-byte write
    lambda d: d[:-4] + b",\n{\"ph\": \"X\", \"name\": \"\xc3",  # a character cut in two
], ids=["trailer", "mid-event", "mid-field", "old-trailer", "comma", "utf8"])
def test_a_torn_file_is_cut_back_to_its_last_complete_event(tmp_path, keep):
    write_job(tmp_path, size=2, steps=3)
    path = str(tmp_path / "rank-1.json")
    whole = _document(path)["traceEvents"]
    data = _tear(path, keep)
    trace = read_rank(path)
    assert trace.torn and 0 <= trace.torn_bytes < 400
    assert trace.events == whole[:len(trace.events)]
    assert len(whole) - 2 <= len(trace.events) <= len(whole)  # (the last two: clock_sync
    # and the name of its thread)
    assert trace.rank == 1 and trace.skipped == {}
    run = read_directory(tmp_path)
    assert len(list(run.traces())) == 2
    assert any(re.search(r"rank-1\.json is torn.*cut back \d+ bytes", w)
               for w in run.warnings())
    assert len(data) > 0


def test_a_file_torn_inside_its_header_is_a_clear_error(tmp_path):
    write_job(tmp_path, size=1, steps=1)
    path = tmp_path / "rank-0.json"
    _tear(path, lambda d: d[:60])
    with pytest.raises(TraceError, match="not valid JSON.*no traceEvents list"):
        read_rank(path)


def test_a_whole_list_with_garbage_after_it_is_not_taken_for_a_tear(tmp_path):
    write_job(tmp_path, size=1, steps=1)
    path = tmp_path / "rank-0.json"
    _tear(path, lambda d: d + b"garbage")
    with pytest.raises(TraceError, match="not valid JSON"):
        read_rank(path)


# -- forged and hostile files ------------------------------------------------------------


def _forge(tmp_path, change):
    write_job(tmp_path, size=2, steps=1)
    path = tmp_path / "rank-1.json"
    document = _document(path)
    change(document)
    _dump(path, document)
    return path


@pytest.mark.parametrize("change, message", [
    (lambda d: d["distributedInfo"].update(rank="1"),
     r"distributedInfo\.rank must be an integer >= 0, got '1'"),
    (lambda d: d["distributedInfo"].update(world_size=True),
     r"distributedInfo\.world_size must be an integer from 1 to 1048576, got True"),
    (lambda d: d["distributedInfo"].update(rank=7), r"less than world_size \(2\)"),
    (lambda d: d["distributedInfo"].update(world_size=10**9),
     r"distributedInfo\.world_size must be an integer from 1 to 1048576"),
    (lambda d: d.pop("distributedInfo"), r"distributedInfo is missing"),
    (lambda d: d.update(mpistrat=[]), r"mpistrat must be an object"),
    (lambda d: d["mpistrat"].update(run="../x"), r"mpistrat\.run must be a run id"),
    (lambda d: d["mpistrat"].update(format=2), r"mpistrat\.format must be 1"),
    (lambda d: d["mpistrat"].update(size=3), r"mpistrat\.size must be distributedInfo"),
    (lambda d: d["mpistrat"].update(host="h" * 5000), r"mpistrat\.host must be a host name"),
    (lambda d: d["mpistrat"]["clock"].update(offset_ns=1.5),
     r"mpistrat\.clock\.offset_ns must be an integer, got 1\.5"),
    (lambda d: d["mpistrat"]["clock"].update(offset_ns=10**30),
     r"mpistrat\.clock\.offset_ns must be an integer"),
    (lambda d: d.update(baseTimeNanoseconds=-5), r"baseTimeNanoseconds must be an integer"),
    (lambda d: d.update(traceEvents={"a": 1}), r"traceEvents must be a list"),
])
def test_a_header_of_the_wrong_shape_names_the_field(tmp_path, change, message):
    path = _forge(tmp_path, change)
    with pytest.raises(TraceError, match=message):
        read_rank(path)
    run = read_directory(tmp_path)     # the others still read; this one is left out
    assert [t.rank for t in run.ranks] == [0] and run.missing == [1]
    assert run.left_out[0][0].endswith("rank-1.json")
    assert any("no trace of rank 1 of 2" in w for w in run.warnings())


@pytest.mark.parametrize("content, message", [
    (b"[1, 2, 3]", "holds a JSON list, not an object"),
    (b"\"text\"", "holds a JSON str, not an object"),
    (b"not json at all", "not valid JSON"),
    (b"{\"distributedInfo\": NaN}", "not valid JSON"),
    (b"{\"baseTimeNanoseconds\": " + b"9" * 5000 + b"}", "not valid JSON"),
    (b"{\"distributedInfo\": 1e999}", "distributedInfo must be an object"),
    (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
    (b"{\"a\": " * 100_000 + b"1" + b"}" * 100_000, "not valid JSON"),
    (b"\xff\xfe{}", "not UTF-8"),
    (b"", "not valid JSON"),
])
def test_hostile_content_is_a_clear_error(tmp_path, content, message):
    path = tmp_path / "rank-0.json"
    path.write_bytes(content)
    with pytest.raises(TraceError, match=message):
        read_rank(path)


def test_a_huge_float_in_the_header_is_rejected(tmp_path):
    path = _forge(tmp_path, lambda d: d.update(baseTimeNanoseconds=1e300))
    with pytest.raises(TraceError, match="baseTimeNanoseconds must be an integer"):
        read_rank(path)


def test_events_of_an_unknown_shape_are_skipped_and_counted(tmp_path):
    bad = [
        "text", [1], {"ph": "B", "pid": 1, "tid": 1, "name": "x", "ts": 1},
        {"ph": "X", "pid": 0, "tid": 1, "name": "x", "ts": 1, "dur": 1},
        {"ph": "X", "pid": 1, "tid": -3, "name": "x", "ts": 1, "dur": 1},
        {"ph": "X", "pid": 1, "tid": 1, "name": 5, "ts": 1, "dur": 1},
        {"ph": "X", "pid": 1, "tid": 1, "name": "x", "ts": "1", "dur": 1},
        {"ph": "X", "pid": 1, "tid": 1, "name": "x", "ts": 1e300, "dur": 1},
        {"ph": "X", "pid": 1, "tid": 1, "name": "x", "ts": 10**400, "dur": 1},
        {"ph": "X", "pid": 1, "tid": 1, "name": "x", "ts": 1, "dur": -1},
        {"ph": "X", "pid": 1, "tid": 1, "name": "x", "ts": 1},
        {"ph": "X", "pid": 1, "tid": 1, "name": "x", "ts": 1, "dur": 1, "args": [1]},
        {"ph": "X", "pid": True, "tid": 1, "name": "x", "ts": 1, "dur": 1},
        {"ph": "X", "cat": "user_annotation", "pid": 1, "tid": 1, "name": "ProfilerStep#9",
         "ts": 1, "dur": 1, "args": {"step": "9"}},
        {"ph": "X", "cat": "kernel", "pid": 1, "tid": 7, "name": "compute", "ts": 1,
         "dur": 1, "args": {"stream": 7}},
        {"ph": "i", "cat": "clock", "pid": 1, "tid": 0, "name": "clock_sync", "ts": 1,
         "s": "t", "args": {"offset_ns": "5"}},
        {"ph": "X", "cat": "mpistrat_phase", "pid": 1, "tid": 1, "name": "agreement",
         "ts": 1, "dur": 1, "args": {"seq": -1}},
        {"ph": "X", "cat": "cpu_op", "pid": 1, "tid": 1, "name": "all_reduce", "ts": 1,
         "dur": 1, "args": {"bytes": 1.5}},
        {"ph": "M", "pid": 1, "tid": 1, "name": "thread_name", "args": {}},
    ]
    path = _forge(tmp_path, lambda d: d["traceEvents"].extend(bad))
    trace = read_rank(path)
    assert sum(trace.skipped.values()) == len(bad)
    assert trace.skipped["pid not the file's rank"] == 2
    assert trace.skipped["ts missing or not a finite number of µs"] == 3
    assert trace.skipped["ProfilerStep without an integer args.step"] == 1
    assert len(trace.events) == len(_document(tmp_path / "rank-0.json")["traceEvents"])
    run = read_directory(tmp_path)
    assert len(list(run.traces())) == 2
    (warning,) = run.warnings()
    assert f"rank-1.json: skipped {len(bad)} events of an unknown shape" in warning


def test_a_symbolic_link_is_not_followed(tmp_path):
    write_job(tmp_path / "job", size=2, steps=1)
    secret = tmp_path / "secret.json"
    secret.write_text("{}")
    os.replace(tmp_path / "job" / "rank-1.json", tmp_path / "elsewhere.json")
    os.symlink(tmp_path / "elsewhere.json", tmp_path / "job" / "rank-1.json")
    with pytest.raises(TraceError, match="is a symbolic link"):
        read_rank(tmp_path / "job" / "rank-1.json")
    run = read_directory(tmp_path / "job")
    assert run.missing == [1] and "symbolic link" in run.left_out[0][1]


def test_a_fifo_is_refused_without_blocking(tmp_path):
    write_job(tmp_path, size=2, steps=1)
    os.unlink(tmp_path / "rank-1.json")
    os.mkfifo(tmp_path / "rank-1.json")      # (opening it to read would wait for a writer)
    with pytest.raises(TraceError, match="not a regular file"):
        read_rank(tmp_path / "rank-1.json")
    (tmp_path / "rank-1.json").unlink()
    (tmp_path / "rank-1.json").mkdir()
    with pytest.raises(TraceError, match="not a regular file"):
        read_rank(tmp_path / "rank-1.json")


def test_a_file_over_the_size_limit_is_not_read(tmp_path):
    write_job(tmp_path, size=2, steps=3)
    size = os.path.getsize(tmp_path / "rank-1.json")
    with pytest.raises(TraceError, match=r"over the .* MiB read per rank file.*--trace-steps"):
        read_rank(tmp_path / "rank-1.json", max_bytes=size - 1)
    assert read_rank(tmp_path / "rank-1.json", max_bytes=size).rank == 1


# -- directories -------------------------------------------------------------------------


def test_files_of_another_run_are_left_out_by_name(tmp_path):
    write_job(tmp_path, size=3, steps=2, ranks=[0, 1], run="aaaa")
    write_job(tmp_path, size=3, steps=2, ranks=[2], run="bbbb")
    run = read_directory(tmp_path)
    assert run.run == "aaaa" and [t.rank for t in run.ranks] == [0, 1]
    assert run.missing == [2]
    warnings = "\n".join(run.warnings())
    assert re.search(r"rank-2\.json left out: it is of another run \(run id bbbb.*run aaaa",
                     warnings)
    assert "no trace of rank 2 of 3 (run aaaa)" in warnings


def test_a_tie_between_runs_goes_to_rank_0_s(tmp_path):
    write_job(tmp_path, size=2, steps=1, ranks=[1], run="aaaa")
    write_job(tmp_path, size=2, steps=1, ranks=[0], run="ffff")
    run = read_directory(tmp_path)
    assert run.run == "ffff" and run.missing == [1]


def test_two_files_of_one_rank_are_an_error(tmp_path):
    write_job(tmp_path, size=2, steps=1)
    (tmp_path / "rank-01.json").write_bytes((tmp_path / "rank-1.json").read_bytes())
    with pytest.raises(TraceError,
                       match=r"rank-01\.json, rank-1\.json in .* all hold rank 1 of run"):
        read_directory(tmp_path)


def test_a_file_whose_name_says_another_rank_is_left_out(tmp_path):
    write_job(tmp_path, size=3, steps=1, ranks=[0, 1])
    os.rename(tmp_path / "rank-1.json", tmp_path / "rank-2.json")
    run = read_directory(tmp_path)
    assert [t.rank for t in run.ranks] == [0] and run.missing == [1, 2]
    assert "its header says rank 1, its name rank 2" in run.left_out[0][1]


@pytest.mark.parametrize("make, message", [
    (lambda p: None, "no trace directory"),
    (lambda p: p.write_text("x"), "is a file, not a directory"),
    (lambda p: p.mkdir(), "no rank-R.json file"),
])
def test_a_directory_without_rank_files_is_a_clear_error(tmp_path, make, message):
    target = tmp_path / "traces"
    make(target)
    with pytest.raises(TraceError, match=message):
        read_directory(target)


def test_a_directory_of_only_unreadable_files_says_why(tmp_path):
    (tmp_path / "rank-0.json").write_text("[]")
    with pytest.raises(TraceError, match=r"no rank file .* can be read \(rank-0\.json: "
                                         r"holds a JSON list"):
        read_directory(tmp_path)


def test_a_file_broken_after_its_header_is_left_out_when_its_events_are_read(tmp_path):
    write_job(tmp_path, size=3, steps=2)
    path = tmp_path / "rank-1.json"
    data = path.read_bytes()
    middle = len(data) // 2
    path.write_bytes(data[:middle] + b"\x00garbage" + data[middle:])
    run = read_directory(tmp_path)
    assert [t.rank for t in run.ranks] == [0, 1, 2]       # its header is fine
    assert [t.rank for t in run.traces()] == [0, 2]
    assert run.missing == [1]
    assert "not valid JSON" in run.left_out[0][1]


def test_a_header_after_the_events_is_found_by_reading_the_whole_file(tmp_path):
    write_job(tmp_path, size=1, steps=2)
    path = tmp_path / "rank-0.json"
    document = _document(path)
    events = document.pop("traceEvents")
    _dump(path, {"traceEvents": events, **document})
    (header,) = read_directory(tmp_path).ranks
    assert (header.rank, header.run) == (0, "0123abcd")
    assert read_rank(path).events == events


def test_many_missing_ranks_are_named_as_ranges(tmp_path):
    write_job(tmp_path, size=1, steps=1)
    path = tmp_path / "rank-0.json"
    document = _document(path)
    for section, key in (("distributedInfo", "world_size"), ("mpistrat", "size")):
        document[section][key] = 1 << 20         # a forged world of a million ranks
    _dump(path, document)
    run = read_directory(tmp_path)
    assert run.missing == list(range(1, 1 << 20))
    assert "no trace of ranks 1-1048575 of 1048576" in run.warnings()[0]
    assert ranges([2, 3, 4, 7, 9, 10]) == "2-4, 7, 9-10" and ranges([]) == ""
