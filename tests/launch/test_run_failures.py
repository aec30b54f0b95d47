"""How ``mpistrat run`` jobs fail: an exception, ``sys.exit`` or a kill on one rank ends
the whole job within seconds with a non-zero status and one tagged report; a rank that
never reaches a collective is named; setup mistakes are clear errors printed once."""

from __future__ import annotations

import re
import textwrap
import time

import pytest

pytestmark = pytest.mark.launch

# Every rank reduces once, then rank 1 misbehaves as asked while the others go on to a
# second reduction (where they would wait for rank 1 forever).
SCRIPT = textwrap.dedent("""\
    import os, signal, sys, time
    import numpy as np
    import mpistrat
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    mode = sys.argv[1]
    mpistrat.all_reduce(np.ones(3), comm=comm)
    if comm.rank == 1:
        if mode == "raise":
            raise RuntimeError("rank 1 fails on purpose")
        if mode == "exit":
            sys.exit(3)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "stall":
            time.sleep(60)
        if mode == "early":
            sys.exit(0)
    if mode == "everywhere":
        {}["missing key on rank %d" % 0]
    mpistrat.all_reduce(np.ones(3), comm=comm)
    print(f"rank {comm.rank} finished")
    """)


@pytest.fixture
def job(mpirun, mpistrat_cmd, tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)

    def run(mode, n=3, options=(), timeout=60):
        started = time.monotonic()
        result = mpirun(n, [*mpistrat_cmd, "run", *options, str(script), mode], timeout=timeout)
        return result, time.monotonic() - started

    return run


def test_exception_on_one_rank_ends_the_job_with_its_traceback_once(job):
    result, elapsed = job("raise")
    assert result.returncode == 1, result.stdout + result.stderr
    assert elapsed < 20
    err = result.stderr
    assert err.count("Traceback (most recent call last):") == 1, err
    assert err.count("[1] Traceback (most recent call last):") == 1, err
    assert "[1] RuntimeError: rank 1 fails on purpose" in err
    assert re.search(r'\[1\]   File ".*job\.py", line 11, in <module>', err), err
    assert "runpy" not in err and "mpistrat/runner" not in err  # only the script's frames
    assert "finished" not in result.stdout


def test_the_same_exception_on_every_rank_is_printed_once(job):
    result, _ = job("everywhere")
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.count("Traceback") == 1, result.stderr
    assert "[0-2] KeyError: 'missing key on rank 0'" in result.stderr
    assert "Abort" not in result.stderr  # every rank ended by itself, together


def test_sys_exit_on_one_rank_passes_its_status(job):
    result, elapsed = job("exit", n=2)
    assert result.returncode == 3, result.stdout + result.stderr
    assert elapsed < 20
    assert result.stderr.count("[1] mpistrat run: ") == 1
    assert "job.py exited with status 3" in result.stderr


def test_a_killed_rank_ends_the_job(job):
    result, elapsed = job("kill")
    assert result.returncode != 0, result.stdout + result.stderr
    assert elapsed < 20
    assert "finished" not in result.stdout


def test_a_stalled_rank_is_named_and_the_timeout_aborts(job):
    result, elapsed = job("stall", options=["--stall-check", "0.5", "--timeout", "2"])
    assert result.returncode == 1, result.stdout + result.stderr
    assert elapsed < 20  # the missing rank sleeps 60 s
    err = result.stderr
    report = next(line for line in err.splitlines() if "mpistrat: stall:" in line)
    assert report.startswith("[0] mpistrat: stall: rank(s) [1] have not arrived in all_reduce")
    assert "rank(s) [0, 2] are waiting there" in report
    assert "CollectiveTimeoutError: all_reduce" in err and "rank(s) [1] did not arrive" in err
    assert err.count("Traceback") == 1, err  # rank 0's names the missing rank; rank 2 defers


def test_a_rank_that_finished_early_is_named_and_the_job_ends(job):
    """Rank 1 leaves the loop one step early: the others' report says so; at the timeout
    they fail and meet rank 1 at the end; rank 0 prints the report of the rank that names
    the missing ranks (not one per waiting rank), then aborts (the timed-out collective
    is still in flight, so MPI cannot finalize)."""
    result, elapsed = job("early", options=["--stall-check", "0.5", "--timeout", "1.5"])
    assert result.returncode == 1, result.stdout + result.stderr
    assert elapsed < 20
    err = result.stderr
    assert "Rank 1 has finished the script." in err
    assert err.count("Traceback") == 1, err
    assert err.count("[0] mpistrat.errors.CollectiveTimeoutError") == 1
    # MPICH's own "Abort(1) on node 0 ..." line races with the kill hydra makes of the
    # abort (stderr and the abort reach hydra separately): the status is what is certain


def test_missing_script_is_one_clear_error(mpirun, mpistrat_cmd):
    result = mpirun(2, [*mpistrat_cmd, "run", "no/such/script.py"], timeout=60)
    assert result.returncode == 2
    assert result.stderr.count("Error: mpistrat run: script 'no/such/script.py' not found") == 1


def test_mismatched_mpi_is_explained(mpistrat_cmd, tmp_path):
    """A launcher of another MPI (here: Open MPI's variables around an MPICH mpi4py)
    starts singletons; the one whose launcher rank is 0 explains, every one exits 2."""
    import os
    import subprocess

    script = tmp_path / "x.py"
    script.write_text("print('should not run')\n")
    outs = []
    for rank in (0, 1):
        env = {**os.environ, "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": str(rank)}
        outs.append(subprocess.run([*mpistrat_cmd, "run", str(script)], env=env,
                                   capture_output=True, text=True, timeout=60, check=False))
    assert [o.returncode for o in outs] == [2, 2]
    assert "started 2 processes but MPI sees a world of 1" in outs[0].stderr
    assert "mpistrat run -n N" in outs[0].stderr
    assert "Error" not in outs[1].stderr and "should not run" not in outs[0].stdout


# Rank 1 stops itself (SIGSTOP) while its main thread is inside the algorithm of an
# all-reduce: the others are then blocked inside the algorithm's MPI calls, which no
# Python loop polls (before the watchdog, they waited there for good, --timeout or not).
STOPPED = textwrap.dedent("""\
    import os, signal, sys, threading, time
    import numpy as np
    import mpistrat
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    x = np.ones(1 << 21)
    mpistrat.all_reduce(x, comm=comm, spec="rechd")
    comm.Barrier()

    def stop_inside_the_algorithm(main=threading.main_thread().ident):
        time.sleep(0.2)
        while True:
            frame = sys._current_frames().get(main)
            while frame is not None and "algorithms" not in frame.f_code.co_filename:
                frame = frame.f_back
            if frame is not None:
                os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(0.0005)

    if comm.rank == 1:
        threading.Thread(target=stop_inside_the_algorithm, daemon=True).start()
    for _ in range(100000):
        mpistrat.all_reduce(x, comm=comm, spec="rechd")
    print("finished")
    """)


def test_a_rank_that_stops_answering_mid_collective_is_named_within_the_timeout(
        mpirun, mpistrat_cmd, tmp_path):
    """The watchdog ends the ranks blocked in the algorithm's MPI calls past --timeout and
    names the rank that does not answer its liveness probe; rank 0 reports, rank 2 points
    to it, both write their reports to --report-dir."""
    script = tmp_path / "stopped.py"
    script.write_text(STOPPED)
    started = time.monotonic()
    result = mpirun(3, [*mpistrat_cmd, "run", "--stall-check", "1", "--timeout", "3",
                        "--report-dir", str(tmp_path / "reports"), str(script)], timeout=90)
    elapsed = time.monotonic() - started
    err = result.stderr
    assert result.returncode == 1, result.stdout + err
    assert elapsed < 20, (elapsed, err)  # 3 s, the probe (1 s), the abort; rank 1 never returns
    assert "finished" not in result.stdout
    # Rank 1 stops inside the algorithm: usually while every rank is exchanging data, but
    # it may be in the tail of a collective the others have finished, and then they wait
    # for it to arrive in the next one. Either way rank 1 is named as not answering.
    assert re.search(r"\[0\] mpistrat\.errors\.PeerLostError: lost rank 1 \(\S+\): ", err), err
    inside = re.search(r"PeerLostError: lost rank 1 \(\S+\): rank 0 \(\S+\) has been in "
                       r"all_reduce \(collective #\d+ on the world communicator of 3 ranks\) "
                       r"for ([\d.]+) s, past --timeout 3 s", err)
    if inside:  # (the others arrived too: the watchdog's bound, not the agreement's)
        assert 3.0 <= float(inside.group(1)) < 5.0, err
    else:  # (the others wait for rank 1 in the next collective: the agreement's timeout)
        assert "rank(s) [1] have not arrived in all_reduce" in err, err
    assert re.search(r"Rank 1 \(\S+\) does not answer mpistrat's liveness probe", err), err
    assert '[0]   File "' in err and "mpistrat.all_reduce(x, comm=comm" in err  # where
    assert err.count("PeerLostError") == 1, err  # rank 2 points to rank 0's report
    assert "PeerLostError: lost rank 1" in (tmp_path / "reports" / "rank-0.txt").read_text()
    # Rank 2's pointer to rank 0's report races with the launcher's kill after rank 0's
    # MPI_Abort (seen in a quiet CI run): when it made it out, it points to rank 0.
    pointer = tmp_path / "reports" / "rank-2.txt"
    if "[2] mpistrat: rank 2 (" in err:
        assert "rank 0 reports." in err, err
    if pointer.exists():
        assert "rank 0 reports" in pointer.read_text(), pointer.read_text()
