"""MPI test harness: run under ``mpiexec -n N python -m pytest --with-mpi tests/mpi``
(``bin/mpitest`` does that for N = 1, 2, 3, 4).

What this file guarantees, so that later tests only write assertions:

* **Every rank reports every failure.** After each test the ranks agree on its outcome
  (one ``allgather`` per test): if the test failed on any rank it is reported failed on
  every rank, and rank 0's report carries every failing rank's traceback. Ranks never
  drift apart (one rank in test k+1's collectives while another is still in test k's),
  and the exit status is the same on every rank.
* **Nothing hangs.** A test that deadlocks (one rank raised before a collective the
  others entered) is stopped by its time limit: the rank dumps every thread's stack and
  ends, and the launcher then ends the job. ``bin/mpitest`` passes ``--mpi-test-timeout``
  with pytest-timeout off: one watchdog thread per rank, armed for each test (its
  ``timeout`` mark, else the option), which a stuck MPI call cannot block.
  pytest-timeout's thread method does the same with a new thread per test, which cost
  4 ms a test at 4 ranks on 2 cores (36 s of the 4-rank run). Without the option,
  pytest-timeout applies as configured. ``bin/mpitest`` adds a wall-clock limit on the
  whole job.
* **Any communicator.** The ``comm`` fixture runs a test on ``COMM_WORLD``, a ``Dup`` of
  it and a ``Split`` sub-communicator (ranks halved), as mpi4py's own tests do; compute
  expected values from ``comm.rank`` and ``comm.size`` so tests pass at every ``-n``.

Every test collected here is marked ``mpi`` (pytest-mpi), so a plain ``pytest`` run
without ``--with-mpi`` skips them instead of running them on one process by accident.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time

import pytest
from _pytest.runner import runtestprotocol

MPI = pytest.importorskip("mpi4py.MPI")


def pytest_addoption(parser, pluginmanager):
    parser.addoption("--mpi-test-timeout", type=float, default=None, metavar="SECONDS",
                     help="end the rank (stacks dumped) when a test runs longer than this "
                          "(a test's timeout mark wins); one watchdog thread per rank, for "
                          "runs with pytest-timeout off (-p no:timeout)")
    if not pluginmanager.has_plugin("timeout"):  # its settings in pyproject.toml, unused
        parser.addini("timeout", "pytest-timeout's (off in this run)")
        parser.addini("timeout_method", "pytest-timeout's (off in this run)")


def pytest_configure(config):
    if not config.pluginmanager.has_plugin("timeout"):
        config.addinivalue_line("markers", "timeout(seconds): this test's time limit")


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.mpi)


class _Watchdog:
    """Ends this rank when the armed test runs past its deadline: prints which test and
    how long, dumps every thread's stack to stderr, and exits with status 1 (the launcher
    then ends the job). One daemon thread polls the deadline four times a second, so a
    rank stuck in an MPI call is still ended (mpi4py releases the GIL while it waits)."""

    def __init__(self, config) -> None:
        self.armed: tuple[float, float, str] | None = None  # (deadline, seconds, test id)
        self.capture = config.pluginmanager.getplugin("capturemanager")
        threading.Thread(target=self._watch, daemon=True, name="mpitest-watchdog").start()

    def _watch(self) -> None:
        while True:
            time.sleep(0.25)
            armed = self.armed  # (one read: the test thread replaces it)
            if armed is not None and time.monotonic() >= armed[0]:
                if self.capture is not None:  # the test's output capture would swallow it
                    self.capture.suspend_global_capture(in_=True)
                world = MPI.COMM_WORLD
                sys.stderr.write(
                    f"\n+++++ Timeout +++++ {armed[2]} ran past its {armed[1]:g} s limit on "
                    f"rank {world.Get_rank()} of {world.Get_size()}; every thread's stack:\n")
                sys.stderr.flush()
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(1)


_WATCHDOG: list[_Watchdog] = []


def _limit(item) -> float | None:
    """This test's time limit under the watchdog (None: the watchdog is off)."""
    default = item.config.getoption("mpi_test_timeout")
    if default is None:
        return None
    mark = item.get_closest_marker("timeout")
    seconds = float(mark.args[0]) if mark is not None and mark.args else default
    return seconds if seconds > 0 else None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Run one test, then agree on its outcome across ranks before reporting it."""
    if not item.config.getoption("with_mpi", False):
        return None  # not under MPI: pytest's own protocol (the test is skipped anyway)
    world = MPI.COMM_WORLD
    limit = _limit(item)
    if limit is not None:
        if not _WATCHDOG:
            _WATCHDOG.append(_Watchdog(item.config))
        _WATCHDOG[0].armed = (time.monotonic() + limit, limit, item.nodeid)
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    reports = runtestprotocol(item, nextitem=nextitem, log=False)
    if _WATCHDOG:
        # off for the agreement: a rank that waits there for a stuck one is not the one to
        # blame (the stuck one's limit ends it, and the launcher the job)
        _WATCHDOG[0].armed = None
    failures = [r for r in reports if r.failed]
    mine = "\n".join(f"[{r.when}] {r.longreprtext}" for r in failures) if failures else None
    texts = world.allgather(mine)
    bad = [rank for rank, text in enumerate(texts) if text is not None]
    if bad:
        detail = "\n".join(
            f"----- rank {rank} of {world.size} -----\n{text}"
            for rank, text in enumerate(texts) if text is not None
        )
        target = failures[0] if failures else next(
            (r for r in reports if r.when == "call"), reports[-1]
        )
        target.outcome = "failed"
        target.longrepr = f"failed on rank(s) {bad} of {world.size}\n{detail}"
    for report in reports:
        item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def _halves(world):
    """Split the world into a lower and an upper half (a genuine sub-communicator)."""
    return world.Split(color=int(world.rank >= (world.size + 1) // 2), key=world.rank)


@pytest.fixture(params=["world", "dup", "split"])
def comm(request):
    """The communicator under test: COMM_WORLD, a Dup of it, or a Split half of it."""
    world = MPI.COMM_WORLD
    if request.param == "world":
        yield world
        return
    sub = world.Dup() if request.param == "dup" else _halves(world)
    try:
        yield sub
    finally:
        sub.Free()


@pytest.fixture
def world():
    """``MPI.COMM_WORLD``."""
    return MPI.COMM_WORLD


@pytest.fixture
def root(world):
    """A temporary directory every rank names the same (rank 0 makes it and broadcasts
    its name), removed after the test."""
    import shutil
    import tempfile

    path = world.bcast(tempfile.mkdtemp(prefix="mpistrat-test-") if world.rank == 0 else None)
    yield path
    world.Barrier()
    if world.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def _no_elastic_leaks():
    """No step-boundary taker, resume position, snapshot fence or job secret of an
    elastic job (mpistrat.elastic) leaks into or out of a test."""
    from mpistrat.elastic import hooks
    from mpistrat.elastic.env import set_job_secret

    hooks.reset()
    set_job_secret(None)
    yield
    hooks.reset()
    set_job_secret(None)


@pytest.fixture
def reports():
    """Watch agreements (stall check 0.3 s, no timeout); yields this rank's reports."""
    from mpistrat.runtime import stall

    seen: list[str] = []
    stall.watch(0.3, None, report=seen.append)
    try:
        yield seen
    finally:
        MPI.COMM_WORLD.Barrier()
        stall.unwatch()
