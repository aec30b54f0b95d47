"""``mpistrat run --trace DIR`` end to end: a job where one rank is slow in every step is
named by ``mpistrat trace summary`` with its delay; a job killed mid-run leaves rank files
that parse and merge; ``--trace-steps`` needs ``--trace``."""

from __future__ import annotations

import json
import subprocess
import textwrap

import pytest

pytestmark = pytest.mark.launch

# the last rank sleeps DELAY seconds in every step, before the step's all-reduce; with
# "kill", rank 1 kills itself (SIGKILL) in step 6, a second after step 5 began (past the
# recorder's hand-over period: steps 0-5 are in the files)
SCRIPT = textwrap.dedent("""\
    import os, signal, sys, time
    import numpy as np
    import mpistrat
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    delay, mode = float(sys.argv[1]), sys.argv[2]
    strategy = mpistrat.get_strategy()
    grads = [np.ones(256, dtype=np.float32), np.ones(70000, dtype=np.float32)]
    for step in range(12):
        mpistrat.trace.step()
        if comm.rank == comm.size - 1:
            time.sleep(delay)
        strategy.run(lambda: sum(float(g.sum()) for g in grads))
        total = mpistrat.all_reduce(grads[0], comm=comm)
        assert total[0] == comm.size
        mpistrat.all_reduce(grads[1], comm=comm)
        if mode == "kill" and step == 5:
            time.sleep(1.1)
        if mode == "kill" and step == 6 and comm.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
    """)


def _run(argv, timeout=120):
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture
def job(mpistrat_cmd, tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)

    def run(n, *args, mode="run", delay=0.04):
        traces = tmp_path / "traces"
        done = _run([*mpistrat_cmd, "run", "-n", str(n), "--timeout", "60", "--trace",
                     str(traces), *args, str(script), str(delay), mode])
        return done, traces

    return run


@pytest.mark.parametrize("n", [2, 3])
def test_summary_names_the_slow_rank_and_its_delay(job, mpistrat_cmd, n):
    done, traces = job(n, "--trace-steps", "2:12")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in traces.iterdir()) == [f"rank-{r}.json" for r in range(n)]
    summary = _run([*mpistrat_cmd, "trace", "summary", str(traces), "--json"])
    assert summary.returncode == 0, summary.stderr
    found = json.loads(summary.stdout)
    (slowest, *_) = found["stragglers"]
    assert slowest["rank"] == n - 1
    assert slowest["last"] >= 0.9 * slowest["of"]  # last in (nearly) every collective
    assert slowest["median_delay_ms"] == pytest.approx(40, rel=0.10)
    text = _run([*mpistrat_cmd, "trace", "summary", str(traces)])
    assert text.returncode == 0 and f"rank {n - 1}" in text.stdout


def test_a_job_killed_mid_run_leaves_traces_that_parse_and_merge(job, mpistrat_cmd, tmp_path):
    done, traces = job(2, mode="kill", delay=0.0)
    assert done.returncode != 0
    for rank in range(2):
        with open(traces / f"rank-{rank}.json") as f:
            doc = json.load(f)
        steps = [e for e in doc["traceEvents"] if e["name"].startswith("ProfilerStep#")]
        assert len(steps) >= 5, (rank, len(steps))
    merged = tmp_path / "job.json"
    out = _run([*mpistrat_cmd, "trace", "merge", str(traces), "-o", str(merged)])
    assert out.returncode == 0, out.stderr
    with open(merged) as f:
        events = json.load(f)["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}


def test_trace_steps_needs_trace(mpistrat_cmd, tmp_path):
    script = tmp_path / "s.py"
    script.write_text("pass\n")
    done = _run([*mpistrat_cmd, "run", "--trace-steps", "1:3", str(script)])
    assert done.returncode == 2 and "--trace-steps goes with --trace" in done.stderr
