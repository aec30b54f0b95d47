"""MPI test harness: run under ``mpiexec -n N python -m pytest --with-mpi tests/mpi``
(``bin/mpitest`` does that for N = 1, 2, 3, 4).

What this file guarantees, so that later tests only write assertions:

* **Every rank reports every failure.** After each test the ranks agree on its outcome
  (one ``allgather`` per test): if the test failed on any rank it is reported failed on
  every rank, and rank 0's report carries every failing rank's traceback. Ranks never
  drift apart (one rank in test k+1's collectives while another is still in test k's),
  and the exit status is the same on every rank.
* **Nothing hangs.** A test that deadlocks (one rank raised before a collective the
  others entered) is stopped by pytest-timeout's thread method, which dumps the stacks and
  ends the rank; the launcher then ends the job. ``bin/mpitest`` adds a wall-clock limit
  on the whole job.
* **Any communicator.** The ``comm`` fixture runs a test on ``COMM_WORLD``, a ``Dup`` of
  it and a ``Split`` sub-communicator (ranks halved), as mpi4py's own tests do; compute
  expected values from ``comm.rank`` and ``comm.size`` so tests pass at every ``-n``.

Every test collected here is marked ``mpi`` (pytest-mpi), so a plain ``pytest`` run
without ``--with-mpi`` skips them instead of running them on one process by accident.
"""

from __future__ import annotations

import pytest
from _pytest.runner import runtestprotocol

MPI = pytest.importorskip("mpi4py.MPI")


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.mpi)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Run one test, then agree on its outcome across ranks before reporting it."""
    if not item.config.getoption("with_mpi", False):
        return None  # not under MPI: pytest's own protocol (the test is skipped anyway)
    world = MPI.COMM_WORLD
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    reports = runtestprotocol(item, nextitem=nextitem, log=False)
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
