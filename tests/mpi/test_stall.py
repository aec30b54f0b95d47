"""The stall check and process-wide timeout of agreements (mpistrat.runtime.stall) at 1-4 ranks:
watched agreements behave like plain ones, a late rank is reported by name, a missing
rank makes every waiting rank raise CollectiveTimeoutError naming it."""

from __future__ import annotations

import time

import numpy as np
import pytest

from mpistrat.errors import CollectiveMismatchError, CollectiveTimeoutError
from mpistrat.runtime import stall
from mpistrat.runtime.agreement import agree

MPI = pytest.importorskip("mpi4py.MPI")


def test_watched_agreements_behave_like_plain_ones(comm, reports):
    for _ in range(50):
        agree(comm, "same call", None, "test_call")
    mine = ValueError("rank 0's argument is bad")
    with pytest.raises((ValueError, CollectiveMismatchError)) as info:
        agree(comm, None if comm.rank == 0 else "ok", mine if comm.rank == 0 else None,
              "test_call")
    assert info.value is mine if comm.rank == 0 else "failed on rank(s) [0]" in str(info.value)
    if comm.size > 1:
        with pytest.raises(CollectiveMismatchError, match="different arguments"):
            agree(comm, f"call of rank {comm.rank}", None, "test_call")
    agree(comm, "after the errors", None, "test_call")
    assert reports == []


@pytest.mark.timeout(30)
@pytest.mark.parametrize("late", ["last", "first"])
def test_a_late_rank_is_reported_by_name(comm, reports, late):
    """The late rank sleeps past the stall check; the lowest waiting monitor (rank 0, or
    rank 1 when rank 0 is late) reports it, the others stay quiet, the call completes."""
    if comm.size == 1:
        pytest.skip("one rank cannot stall")
    slow = comm.size - 1 if late == "last" else 0
    if comm.rank == slow:
        time.sleep(0.8)
    agree(comm, "same call", None, "test_collective")
    reporter = 1 if slow == 0 else 0
    gathered = comm.allgather(list(reports))
    for rank, texts in enumerate(gathered):
        if rank != reporter:
            assert texts == [], (rank, texts)
    assert 1 <= len(gathered[reporter]) <= 3, gathered[reporter]
    text = gathered[reporter][0]
    waiting = sorted(set(range(comm.size)) - {slow})
    assert f"rank(s) [{slow}] have not arrived in test_collective" in text, text
    assert f"rank(s) {waiting} are waiting there" in text, text
    assert ("world communicator" in text) == (comm.size == MPI.COMM_WORLD.size), text


@pytest.mark.timeout(30)
def test_missing_rank_times_out_everywhere_with_its_name():
    """With a 0.6 s timeout and the last rank asleep for 2 s, every other rank raises
    CollectiveTimeoutError naming it (non-monitor ranks take the monitors' list); then
    the late rank completes the agreement the others left in flight."""
    world = MPI.COMM_WORLD
    if world.size == 1:
        pytest.skip("one rank cannot stall")
    dup = world.Dup()
    stall.watch(None, 0.6, report=lambda text: None)
    late = world.size - 1
    error = elapsed = None
    started = time.monotonic()
    try:
        if world.rank == late:
            time.sleep(2.0)
            agree(dup, "same call", None, "test_collective")  # completes the others' one
        else:
            try:
                agree(dup, "same call", None, "test_collective")
            except CollectiveTimeoutError as exc:
                elapsed = time.monotonic() - started
                error = exc
                _finish_pending(exc.__traceback__)
    finally:
        world.Barrier()
        stall.unwatch()
        dup.Free()
    reporters = world.allgather(getattr(error, "reporter", None))
    if world.rank != late:
        assert isinstance(error, CollectiveTimeoutError), error
        assert error.missing == [late], (error.missing, str(error))
        assert f"rank(s) [{late}] did not arrive" in str(error)
        assert 0.6 <= elapsed < 1.9, elapsed
    assert reporters == [True] + [False] * (world.size - 2) + [None], reporters


def test_watch_rejects_bad_values():
    with pytest.raises(ValueError, match=r"timeout must be a number of seconds >= 0.*-1"):
        stall.watch(60, -1)
    with pytest.raises(ValueError, match="stall_check"):
        stall.watch(float("inf"), None)
    assert stall.watch(0, None) is None and stall.current() is None


def _finish_pending(tb) -> None:
    """Wait for the agreement's collective that a timed-out rank left in flight (found in
    the traceback's frames), so the communicator is freed with nothing pending."""
    while tb is not None:
        request = tb.tb_frame.f_locals.get("request")
        if isinstance(request, MPI.Request):
            request.Wait()
        tb = tb.tb_next


def test_each_collective_is_recorded_for_the_watchdog(comm, reports):
    """A watched agreement records, for its thread, the collective it starts: its name,
    number, when it started and agreed, and the outermost mpistrat frame of the call (the
    public function), which leaves the thread's stack when the collective returns."""
    import threading

    import mpistrat

    if comm.size == 1:
        pytest.skip("a communicator of one rank is not watched")
    from mpistrat.runtime.stall import AGREED, FRAME, SEQ, STARTED, WHAT

    watch = stall.current()
    mpistrat.all_reduce(np.ones(4), comm=comm)
    entry = watch.active[threading.get_ident()]
    assert entry[WHAT] == "all_reduce" and entry[FRAME].f_code.co_name == "all_reduce"
    assert entry[AGREED] is True and entry[STARTED] <= time.monotonic()
    seq = entry[SEQ]
    agree(comm, "same call", None, "test_collective")  # called from here: its own frame
    entry = watch.active[threading.get_ident()]
    assert (entry[WHAT], entry[SEQ], entry[FRAME].f_code.co_name) == (
        "test_collective", seq + 1, "agree")


def test_a_collective_without_agreement_can_be_tracked(comm, reports):
    """Watch.track records a collective that makes no agreement (all_reduce with
    check=False) the same way, already past the arrival, numbered after the last one."""
    import threading

    from mpistrat.runtime.stall import AGREED, FRAME, SEQ, WHAT

    if comm.size == 1:
        pytest.skip("a communicator of one rank is not watched")
    watch = stall.current()
    agree(comm, "same call", None, "test_collective")
    seq = watch.active[threading.get_ident()][SEQ]

    def unchecked_collective():
        watch.track(comm, "unchecked")
        return watch.active[threading.get_ident()]

    entry = unchecked_collective()
    assert (entry[WHAT], entry[SEQ], entry[AGREED]) == ("unchecked", seq, True)
    assert entry[FRAME].f_code.co_name == "unchecked_collective"
    watch.track(MPI.COMM_SELF, "alone")  # one rank: nothing to watch
    assert watch.active[threading.get_ident()] is entry
