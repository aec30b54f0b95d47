"""``mpistrat run --trace DIR`` across the two real hosts of conftest.py (issue 41): one
job of 2 hosts x 2 ranks where the last rank (on node2) sleeps ``DELAY`` in every step,
then ``mpistrat trace merge`` and ``mpistrat trace summary --json`` on its files.

What must hold across hosts and not only on one: every rank's clock offset is measured
over the links (the all-reduces' bytes cross them too), the merge reports each rank's
residual skew and drift, bounded by the round trips that rank measured, the merged file
has every rank's events in time order, and the summary names the sleeping rank on node2
with its delay. The hosts are namespaces of one kernel, so their clocks are one clock:
an offset or a drift the measurement reports must lie within its own uncertainty (half
the round trip) of zero, a property of Cristian's method that a real cluster cannot
check.
"""

from __future__ import annotations

import json
import math
import re
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster

VENV_BIN = Path(sys.executable).parent
MPISTRAT = VENV_BIN / "mpistrat"
DELAY = 0.03          # s, the last rank's sleep in every step
STEPS = 12            # steps 2-11 traced (--trace-steps): the first, with the links'
WINDOW = "2:12"       # connections made, left out

# the last rank sleeps before every step's all-reduce (256 KiB: bytes that cross the links)
SCRIPT = textwrap.dedent(f"""\
    import sys, time
    import numpy as np
    import mpistrat
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    delay = float(sys.argv[1])
    grads = np.ones(1 << 16, dtype=np.float32)
    for step in range({STEPS}):
        mpistrat.trace.step()
        if comm.rank == comm.size - 1:
            time.sleep(delay)
        total = mpistrat.all_reduce(grads, comm=comm)
        assert total[0] == comm.size, total[0]
    """)

# a row of the merge's table: rank, host, skew (±µs), what it says of the clock
_SKEW_ROW = re.compile(r"^(\d+)\s+(\S+)\s+(\d+\.\d|unknown)\s+(.*)$", re.MULTILINE)


def _number(value) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


@pytest.mark.timeout(240)
def test_a_traced_job_across_hosts_merges_and_names_its_straggler(cluster, tmp_path):
    script, traces = tmp_path / "job.py", tmp_path / "traces"
    script.write_text(SCRIPT)
    before = cluster.bytes()
    run = cluster.run([MPISTRAT, "run", "-n", "4", "--timeout", "60", "--trace", traces,
                       "--trace-steps", WINDOW, script, str(DELAY)], timeout=120)
    moved = cluster.moved(before)
    assert run.returncode == 0, f"the traced job failed:\n{run.stdout}{run.stderr}"
    assert sorted(p.name for p in traces.iterdir()) == [f"rank-{r}.json" for r in range(4)]
    # 10 all-reduces of 256 KiB crossed each host's link (launcher and clocks: some 10 KB)
    assert all(sent > 1 << 20 for sent in moved.values()), moved

    # each rank file's own measurements: the start's (header) and the stop's (clock_sync)
    measured = {}
    for rank in range(4):
        doc = json.loads((traces / f"rank-{rank}.json").read_text())
        clock = doc["mpistrat"]["clock"]
        syncs = [e["args"] for e in doc["traceEvents"] if e["name"] == "clock_sync"]
        assert len(syncs) == 1, (rank, syncs)   # the job ended well: measured at stop
        measured[rank] = (doc["mpistrat"]["host"], clock, syncs[0])
    assert [measured[r][0] for r in range(4)] == ["node1", "node1", "node2", "node2"], measured

    merged = tmp_path / "job.json"
    done = cluster.run([MPISTRAT, "trace", "merge", traces, "-o", merged], timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    # (a drift over 1000 ppm, from a slow measurement on a loaded machine, is said and
    # not corrected; nothing else is to be warned of)
    assert all("not corrected" in line for line in done.stderr.splitlines()
               if line.startswith("warning")), done.stderr
    print(done.stdout)   # the skews, for the record (pytest -s)
    printed = {int(r): (host, skew, says) for r, host, skew, says in
               _SKEW_ROW.findall(done.stdout)}
    assert sorted(printed) == [0, 1, 2, 3], done.stdout
    with open(merged) as file:
        doc = json.load(file)
    skew = doc["mpistrat"]["skew"]
    assert _number(skew["max_us"]), skew
    by_rank = {c["rank"]: c for c in skew["ranks"]}
    assert sorted(by_rank) == [0, 1, 2, 3], skew
    for rank, c in by_rank.items():
        host, start, stop = measured[rank]
        for name in ("skew_us", "half_round_trip_us", "end_half_round_trip_us", "drift_us"):
            assert _number(c[name]), (rank, name, c)
        assert c["half_round_trip_us"] == start["round_trip_ns"] / 2000, (c, start)
        assert c["end_half_round_trip_us"] == stop["round_trip_ns"] / 2000, (c, stop)
        # the skew is the uncertainty of this rank's own measurements, no more, no less:
        # half the larger round trip of those used (the stop's, when the drift is
        # corrected; a drift over 1000 ppm of the run, from a slow measurement, is not)
        assert type(c["drift_corrected"]) is bool, c
        used = [start["round_trip_ns"]] + ([stop["round_trip_ns"]] if c["drift_corrected"]
                                           else [])
        assert c["skew_us"] == max(used) / 2000, c
        assert printed[rank][:2] == (host, f"{c['skew_us']:.1f}"), (printed[rank], c)
        # one kernel's clock: the offsets and the drift are zero within their uncertainty
        assert abs(start["offset_ns"]) <= start["round_trip_ns"] / 2 + 1, (rank, start)
        assert abs(stop["offset_ns"]) <= stop["round_trip_ns"] / 2 + 1, (rank, stop)
        assert abs(c["drift_us"]) * 1000 <= \
            (start["round_trip_ns"] + stop["round_trip_ns"]) / 2 + 2, (rank, c)
    assert skew["max_us"] == max(c["skew_us"] for c in by_rank.values()), skew
    assert by_rank[0]["skew_us"] == 0, by_rank[0]   # rank 0 is the reference

    # every rank's events, each rank's in time order, its steps among them
    timed: dict[int, list[float]] = {}
    steps: dict[int, int] = {}
    for event in doc["traceEvents"]:
        if event["ph"] == "M":
            continue
        timed.setdefault(event["pid"], []).append(event["ts"])
        if event["name"].startswith("ProfilerStep#") and event.get("dur", 0) > 0:
            steps[event["pid"]] = steps.get(event["pid"], 0) + 1
    assert sorted(timed) == [0, 1, 2, 3], sorted(timed)
    for rank, times in timed.items():
        assert times == sorted(times), f"rank {rank}'s events are not in time order"
    assert all(steps.get(rank, 0) >= 10 for rank in range(4)), steps
    assert [r["host"] for r in doc["mpistrat"]["ranks"]] == \
        ["node1", "node1", "node2", "node2"], doc["mpistrat"]["ranks"]

    summary = cluster.run([MPISTRAT, "trace", "summary", traces, "--json"], timeout=60)
    assert summary.returncode == 0, summary.stdout + summary.stderr
    found = json.loads(summary.stdout)
    assert found["hosts"]["3"] == "node2", found["hosts"]
    assert len(found["steps"]) >= 9, found["steps"]
    slowest = found["stragglers"][0]
    print(f"straggler: {slowest}")
    assert slowest["rank"] == 3, found["stragglers"]
    assert slowest["last"] >= 0.9 * slowest["of"], slowest   # the straggler of every step
    assert slowest["median_delay_ms"] == pytest.approx(DELAY * 1000, rel=0.10), slowest
