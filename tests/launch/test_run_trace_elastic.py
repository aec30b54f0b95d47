"""``mpistrat run -n 3 --min-ranks 2 --trace DIR`` on one host (issue 41): the last rank
kills itself (SIGKILL) in the first launch; the job goes on on the two others. The first
launch's files stay in ``DIR`` and parse, the killed rank's too (it may hold fewer steps:
what it recorded since its last hand-over to the writer is lost), and the survivors' hold
the steps handed over before the kill; the relaunch writes its own into
``DIR/restart-1``, a run of 2 ranks that ``mpistrat trace summary`` reads."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

import pytest

from mpistrat.trace.files import read_rank

pytestmark = pytest.mark.launch

# a step counter snapshotted at each step boundary (mpistrat.elastic.step(), which marks
# the trace's steps too). In launch 0 every rank sleeps past the recorder's hand-over
# period (1 s) in the loop's second step, so that the third's boundary hands the steps so
# far to the writer; the last rank kills itself in the fourth, half a second after its
# all-reduce (while the others wait in the next)
SCRIPT = textwrap.dedent("""\
    import os, signal, time
    import numpy as np
    import mpistrat
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    restart = int(os.environ["MPISTRAT_ELASTIC_RESTART"])
    steps = mpistrat.checkpoint.Scalar(0)
    manager = mpistrat.CheckpointManager(mpistrat.Checkpoint(steps=steps), "ckpt")
    manager.restore_or_initialize()
    if comm.rank == 0:
        print(f"@@ restart={restart} size={comm.size}", flush=True)
    for step in range(5):
        mpistrat.elastic.step()
        steps.assign_add(1)
        total = mpistrat.all_reduce(np.ones(3), comm=comm)
        assert total[0] == comm.size
        if step == 1 and restart == 0:
            time.sleep(1.1)
        if step == 3 and restart == 0 and comm.rank == comm.size - 1:
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
    """)


def _parses(path, size: int) -> dict:
    """``path`` read by the trace's own reader (a file torn by a kill is cut back to its
    last whole event) and, when it is whole, as plain JSON; its header's fields."""
    trace = read_rank(str(path))
    assert (trace.size, trace.skipped) == (size, {}), (path, trace.size, trace.skipped)
    if not trace.torn:
        with open(path) as file:
            json.load(file)
    steps = {e["args"]["step"] for e in trace.events if e["ph"] == "X"
             and e["name"].startswith("ProfilerStep#") and not e["args"].get("partial")}
    return {"rank": trace.rank, "run": trace.run, "steps": steps}


def test_an_elastic_relaunch_traces_into_its_own_directory(mpistrat_cmd, tmp_path):
    script, traces, shm = tmp_path / "job.py", tmp_path / "traces", tmp_path / "shm"
    script.write_text(SCRIPT)
    shm.mkdir(mode=0o700)
    done = subprocess.run(
        [*mpistrat_cmd, "run", "-n", "3", "--min-ranks", "2", "--timeout", "20", "--trace",
         str(traces), str(script)], cwd=tmp_path, capture_output=True, text=True,
        timeout=90, check=False, env={**os.environ, "MPISTRAT_ELASTIC_DIR": str(shm)})
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert not list(shm.iterdir()), out   # (the snapshots are gone with the job)
    assert "@@ restart=0 size=3" in done.stdout and "@@ restart=1 size=2" in done.stdout, out
    assert sorted(p.name for p in traces.iterdir()) == \
        ["rank-0.json", "rank-1.json", "rank-2.json", "restart-1"], out
    first = [_parses(traces / f"rank-{r}.json", 3) for r in range(3)]
    assert [f["rank"] for f in first] == [0, 1, 2]
    assert len({f["run"] for f in first}) == 1, first   # one start of tracing
    # steps 0-2 were handed over at step 3's boundary, half a second before the kill
    assert all(f["steps"] >= {0, 1, 2} for f in first[:2]), first

    again = traces / "restart-1"
    assert sorted(p.name for p in again.iterdir()) == ["rank-0.json", "rank-1.json"], out
    second = [_parses(again / f"rank-{r}.json", 2) for r in range(2)]
    assert [f["rank"] for f in second] == [0, 1]
    assert len({f["run"] for f in second}) == 1 and second[0]["run"] != first[0]["run"]
    # the time before the loop (step 0) and the loop's 5 steps, the last ended by stop
    assert all(f["steps"] == {0, 1, 2, 3, 4} for f in second), second

    summary = subprocess.run([*mpistrat_cmd, "trace", "summary", str(again), "--json"],
                             capture_output=True, text=True, timeout=60, check=False)
    assert summary.returncode == 0, summary.stderr
    found = json.loads(summary.stdout)
    assert (found["size"], found["ranks"], found["missing"]) == (2, [0, 1], []), found
    assert found["steps"] == [0, 1, 2, 3, 4], found   # whole on both ranks
    assert {row["rank"] for row in found["per_step"]} == {0, 1}, found["per_step"]
