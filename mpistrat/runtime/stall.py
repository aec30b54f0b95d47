"""Stall checks for mpistrat's collectives: name the ranks that have not arrived, and give
up after a timeout.

Every mpistrat collective starts with the agreement of :mod:`mpistrat.runtime.agreement` (one
small ``Iallreduce``; for ``all_reduce``, an ``Iallgather`` of fixed-size blocks). Once
:func:`watch` has been called (``mpistrat run`` calls it for ``--stall-check`` and
``--timeout``), that collective is polled against deadlines instead of waited on. While the ranks arrive together nothing else happens: no message,
one ``improbe`` per call.

Only a rank that has waited ``grace`` seconds speaks: it sends one arrival note to the two
*monitors* (ranks 0 and 1 of the collective's communicator), and a waiting monitor sends
its note to every rank. Notes travel on a private duplicate of ``COMM_WORLD``, so a user's
receive with ``ANY_TAG`` never sees them. After ``stall_check`` seconds (and again every
``stall_check`` seconds) the first waiting monitor reports the ranks it has no note from
and what they were last seen waiting in; when neither monitor is waiting, each waiting rank
reports what it knows. After ``timeout`` seconds every waiting rank raises
:class:`~mpistrat.CollectiveTimeoutError`: a monitor first sends its list of missing ranks
to every rank, and the other ranks wait for that list (up to another ``timeout``) so that
every rank names the same ranks (at most ``VERDICT_WAIT`` seconds more).

Each watched agreement also records, per thread, the collective it starts (an
an entry: what, when, and the outermost mpistrat frame of the call), so that
``mpistrat run``'s watchdog (:mod:`mpistrat.runner.watchdog`) can bound the time a rank
spends in the rest of the collective too — the algorithm's own MPI calls, which no
Python loop polls — and name unreachable hosts in the reports (:attr:`Watch.diagnose`).
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, cast

from ..errors import CollectiveTimeoutError
from . import recorder
from ._mpi import Comm, mpi

__all__ = ["watch", "unwatch", "current", "allreduce_max", "Watch", "new_entry", "VERDICT_WAIT", "WHAT",
           "CHANNEL", "SEQ", "STARTED", "AGREED", "FRAME", "REPORTED", "POLLED",
           "trace_failure", "MAX_TRACED_REPORT"]

_TAG = 0x5A8  # point-to-point tag of notes and verdicts, on the private communicator
_MONITORS = 2  # ranks 0 and 1 of each communicator
_ANNOUNCED = 0  # the key of announcements (a channel's key is never 0 in practice)
SPIN = 10e-3  # poll (yielding the core) without sleeping for this long: short waits
VERDICT_WAIT = 2.0  # seconds a timed-out non-monitor waits at most for the monitors' list
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # mpistrat/
# Code that runs collectives but is not one (the script's runner, the CLI, benchmark
# loops): the outermost frame of a collective is below these.
_NOT_COLLECTIVE = tuple(os.path.join(_PACKAGE, name) for name in
                        ("runner" + os.sep, "cli" + os.sep, "bench" + os.sep,
                         "launch" + os.sep, "__main__.py"))
_IN_COLLECTIVE: dict[Any, bool] = {}  # code object -> is it mpistrat's collective code
MAX_TRACED_REPORT = 2048  # characters of a report kept in the trace


def trace_failure(name: str, report: str, ranks: Any = (), **args: Any) -> None:
    """Record a failure in this rank's trace (:mod:`mpistrat.trace`): an instant ``name``
    of category ``failure`` with the ``report`` (its first :data:`MAX_TRACED_REPORT`
    characters) and the ``ranks`` it is about, whatever the trace's step window (what
    went wrong is what a trace of a failed job is read for). Nothing when tracing is off.
    """
    rec = recorder.current()
    if rec is None:
        return
    if len(report) > MAX_TRACED_REPORT:
        report = report[:MAX_TRACED_REPORT] + f" ... ({len(report)} characters in all)"
    rec.add(time.monotonic_ns(), -1, name, recorder.FAILURE,
            {"report": report, "ranks": sorted(int(r) for r in ranks), **args})


# What a watched agreement records, per thread, of the collective it starts: a list (the
# cheapest record to make once per collective), indexed by these names. FRAME is the
# outermost mpistrat frame of the call, which stays on the thread's stack until the
# collective returns; AGREED is None while the ranks are still arriving, then True; POLLED
# is the agreement's last poll (a poll can block inside MPI); REPORTED is how long the
# collective had lasted at the watchdog's last stall report.
WHAT, CHANNEL, SEQ, STARTED, AGREED, FRAME, REPORTED, POLLED = range(8)


def new_entry(what: str, channel: Any, started: float, frame: Any) -> list:
    """An entry (see above) of a collective that started at ``started``."""
    return [what, channel, channel.seq, started, None, frame, 0.0, started]


def _outermost(frame: Any) -> Any:
    """The outermost of the consecutive mpistrat frames from ``frame`` up: the public call
    the script made (all_reduce, a strategy's reduce, CheckpointManager.save ...)."""
    cache = _IN_COLLECTIVE
    while True:
        up = frame.f_back
        if up is None:
            return frame
        code = up.f_code
        inside = cache.get(code)
        if inside is None:
            name = os.path.abspath(code.co_filename)
            inside = cache[code] = (name.startswith(_PACKAGE)
                                    and not name.startswith(_NOT_COLLECTIVE))
        if not inside:
            return frame
        frame = up


class _Channel:
    """What the watch knows about one communicator: its members as world ranks, a key
    that names it on every rank, and how many agreements it has started."""

    __slots__ = ("key", "members", "rank", "size", "seq")

    def __init__(self, key: int, members: tuple[int, ...], rank: int) -> None:
        self.key, self.members, self.rank = key, members, rank
        self.size = len(members)
        self.seq = 0

    @property
    def monitor(self) -> bool:
        return self.rank < _MONITORS


class Watch:
    """The process-wide stall check and timeout of agreements (see the module docstring).

    Args:
        side: a private duplicate of ``COMM_WORLD`` for notes.
        stall_check: seconds before a stall is reported (None: never).
        timeout: seconds before a waiting rank raises (None: never).
        report: called with each stall report (default: write it to ``sys.stderr``).
    """

    def __init__(self, side: Any, stall_check: float | None, timeout: float | None,
                 report: Callable[[str], None] | None = None) -> None:
        MPI = mpi()
        self.side = side
        self.stall_check = stall_check
        self.timeout = timeout
        self.report = report or _to_stderr
        self.grace = min(1.0, 0.25 * min(t for t in (stall_check, timeout, math.inf) if t))
        self._world_group = side.Get_group()
        self._keyval = MPI.Comm.Create_keyval()
        self._ordinals: dict[tuple[int, ...], int] = {}
        self._heard: dict[int, dict[int, int]] = {}  # key -> comm rank -> latest seq
        self._seen: dict[int, tuple[int, str]] = {}  # world rank -> (key, what) of its last note
        self._verdicts: dict[int, tuple[int, list[int]]] = {}  # key -> (seq, missing)
        self._outbox: list[Any] = []
        self._lock = threading.Lock()
        self.active: dict[int, list] = {}  # thread id -> the entry of its collective
        # ``diagnose(world_ranks)``: a sentence on why those ranks are missing (hosts that
        # do not answer), or None; set by mpistrat run's watchdog for the stall reports.
        self.diagnose: Callable[[list[int]], str | None] | None = None

    def close(self) -> None:
        """Take the notes still addressed to this rank, then free the private communicator."""
        self._drain()
        MPI = mpi()
        MPI.Comm.Free_keyval(self._keyval)
        self._world_group.Free()
        self.side.Free()

    # -- the agreement's allreduce

    def allreduce(self, comm: Comm, flags: Any, what: str) -> None:
        """``comm.Iallreduce(IN_PLACE, flags, MAX)``, watched."""
        MPI = mpi()
        self.wait(comm, comm.Iallreduce(MPI.IN_PLACE, flags, op=MPI.MAX), what,
                  sys._getframe(1))

    def wait(self, comm: Comm, request: Any, what: str, frame: Any = None) -> None:
        """Wait for ``request``, the first collective of an agreement on ``comm`` (every
        rank's agreement must start with the same collective), watched like
        :meth:`allreduce`. ``frame``: where the collective was called (default: the
        caller's frame)."""
        channel = self._channel(comm)
        if channel is None:
            request.Wait()
            return
        channel.seq += 1
        now = time.monotonic()
        entry = [what, channel, channel.seq, now, None,
                 _outermost(frame if frame is not None else sys._getframe(1)), 0.0, now]
        self.active[threading.get_ident()] = entry
        self._drain()
        if not request.Test():
            self._wait(channel, request, what, entry)
        entry[AGREED] = True

    def track(self, comm: Comm, what: str) -> None:
        """Record, for ``mpistrat run``'s watchdog, a collective that starts without an
        agreement (``all_reduce(check=False)``): the watchdog then bounds it by
        ``--timeout`` like a watched one (its number in reports is that of the last
        agreement on ``comm``). Costs what an agreement's record costs (about 0.4 µs)."""
        channel = self._channel(comm)
        if channel is None:
            return
        now = time.monotonic()
        self.active[threading.get_ident()] = [what, channel, channel.seq, now, True,
                                              _outermost(sys._getframe(1)), 0.0, now]

    def _channel(self, comm: Comm) -> _Channel | None:
        channel = cast("_Channel | None", comm.Get_attr(self._keyval))
        if channel is not None:
            return channel
        if comm.Is_inter() or comm.Get_size() == 1:
            return None
        MPI = mpi()
        group = comm.Get_group()
        try:
            members = tuple(group.Translate_ranks(None, self._world_group))
        finally:
            group.Free()
        if MPI.UNDEFINED in members:
            return None  # not made from COMM_WORLD's processes: unwatched
        with self._lock:
            ordinal = self._ordinals.get(members, 0)
            self._ordinals[members] = ordinal + 1
        digest = hashlib.blake2b(repr((members, ordinal)).encode(), digest_size=8).digest()
        channel = _Channel(int.from_bytes(digest, "little") >> 1, members, comm.Get_rank())
        comm.Set_attr(self._keyval, channel)
        return channel

    def _wait(self, channel: _Channel, request: Any, what: str, entry: list) -> None:
        start = time.monotonic()
        note_at = self.grace
        report_at = self.stall_check or math.inf
        give_up_at = self.timeout or math.inf
        deferred = False
        pause = 10e-6
        while not request.Test():
            now = entry[POLLED] = time.monotonic()
            waited = now - start
            if waited < SPIN:
                yield_core()
                continue
            if waited >= note_at:
                self._send_notes(channel, what)
                note_at = math.inf
            if report_at <= waited < give_up_at:  # at the timeout, the error reports
                self._stall_report(channel, what, waited)
                report_at += self.stall_check or math.inf
            if deferred:
                self._drain()
                verdict = self._verdicts.get(channel.key)
                if verdict is not None and verdict[0] >= channel.seq:
                    raise self._timeout_error(channel, what, verdict[1], partial=False,
                                              reporter=False)
            if waited >= give_up_at:
                error = self._give_up(channel, what, final=deferred)
                if error is not None:
                    raise error
                deferred = True
                give_up_at = waited + min(self.timeout or 0, VERDICT_WAIT)
            time.sleep(pause)
            pause = min(pause * 2, 1e-3 if waited < 1.0 else 10e-3)

    # -- notes

    def _send(self, payload: tuple, dests: Any) -> None:
        with self._lock:
            self._outbox = [r for r in self._outbox if not r.Test()]
            for dest in dests:
                self._outbox.append(self.side.isend(payload, dest=dest, tag=_TAG))

    def _send_notes(self, channel: _Channel, what: str) -> None:
        if channel.monitor:
            dests = [w for r, w in enumerate(channel.members) if r != channel.rank]
        else:
            dests = list(channel.members[:_MONITORS])
        self._send(("note", channel.key, channel.seq, channel.rank, what), dests)

    def announce(self, what: str) -> None:
        """Tell the monitors of ``COMM_WORLD`` that this rank will join no more collectives
        (``what``: e.g. "finished the script"), for their stall reports."""
        me = self.side.Get_rank()
        dests = [r for r in range(min(_MONITORS, self.side.Get_size())) if r != me]
        self._send(("note", _ANNOUNCED, 0, me, what), dests)

    def _drain(self) -> None:
        """Take every note and verdict that has come; keep what they say."""
        MPI = mpi()
        status = MPI.Status()
        while True:
            with self._lock:  # threads may watch collectives on different communicators
                message = self.side.improbe(MPI.ANY_SOURCE, _TAG, status)
                if message is None:
                    return
                kind, key, seq, *rest = message.recv()
                source = status.Get_source()
            if kind == "note":
                rank, what = rest
                heard = self._heard.setdefault(key, {})
                heard[rank] = max(seq, heard.get(rank, 0))
                self._seen[source] = (key, what)
            else:
                if seq >= self._verdicts.get(key, (0, []))[0]:
                    self._verdicts[key] = (seq, rest[0])

    def _arrived(self, channel: _Channel) -> set[int]:
        heard = self._heard.get(channel.key, {})
        return {r for r, seq in heard.items() if seq >= channel.seq} | {channel.rank}

    # -- reports

    def _stall_report(self, channel: _Channel, what: str, waited: float) -> None:
        self._drain()
        arrived = self._arrived(channel)
        monitors_here = [r for r in range(min(_MONITORS, channel.size)) if r in arrived]
        if monitors_here and monitors_here[0] != channel.rank:
            return  # a monitor (the lower one) is waiting, and reports
        missing = sorted(set(range(channel.size)) - arrived)
        if not missing:
            return
        where = self._describe(channel)
        if channel.monitor:
            lines = [f"mpistrat: stall: rank(s) {missing} have not arrived in {what} "
                     f"(collective #{channel.seq} on {where}) after {waited:.1f} s; rank(s) "
                     f"{sorted(arrived)} are waiting there."]
            lines += self._whereabouts(channel, missing)
            diagnosis = self._diagnosis([channel.members[r] for r in missing])
            diagnosed = bool(diagnosis)
            lines += diagnosis
        else:
            monitors = list(range(min(_MONITORS, channel.size)))
            lines = [f"mpistrat: stall: rank {channel.rank} has waited {waited:.1f} s in "
                     f"{what} (collective #{channel.seq} on {where}); ranks {monitors}, "
                     f"which would name every missing rank, have not arrived either."]
            diagnosis = self._diagnosis([channel.members[r] for r in monitors])
            diagnosed = bool(diagnosis)
            lines += diagnosis
        lines.append(("" if diagnosed else
                      "Every rank must make the same collective calls in the same order; a "
                      "missing rank is busy, stuck, or took another code path. ")
                     + ("This check repeats; --timeout (MPISTRAT_COLLECTIVE_TIMEOUT) ends the "
                        "job instead." if self.timeout is None else
                        f"The job gives up after {self.timeout:g} s (--timeout)."))
        text = " ".join(lines)
        about = missing if channel.monitor else range(min(_MONITORS, channel.size))
        trace_failure("stall", text, [channel.members[r] for r in about], collective=what,
                      seq=channel.seq, waited_s=round(waited, 3))
        self.report(text)

    def _whereabouts(self, channel: _Channel, missing: list[int]) -> list[str]:
        """What the notes say of missing ranks: waiting in another collective, or done."""
        lines = []
        for rank in missing:
            seen = self._seen.get(channel.members[rank])
            if seen is not None and seen[0] == _ANNOUNCED:
                lines.append(f"Rank {rank} has {seen[1]}.")
            elif seen is not None and seen[0] != channel.key:
                lines.append(f"Rank {rank} was last seen waiting in {seen[1]} on another "
                             f"communicator.")
        return lines

    def _diagnosis(self, world_ranks: list[int]) -> list[str]:
        """What the watchdog's liveness probe says of missing ranks (nothing without one)."""
        if self.diagnose is None:
            return []
        try:
            text = self.diagnose(world_ranks)
        except Exception as exc:  # noqa: BLE001 - a report must not fail the collective
            text = f"(the liveness probe failed: {type(exc).__name__}: {exc})"
        return [text] if text else []

    def describe(self, channel: _Channel) -> str:
        """``the world communicator of N ranks`` or ``a communicator of N ranks (world
        ranks [...])``: where a collective runs, for messages."""
        return self._describe(channel)

    def _describe(self, channel: _Channel) -> str:
        if channel.members == tuple(range(self.side.Get_size())):
            return f"the world communicator of {channel.size} ranks"
        return (f"a communicator of {channel.size} ranks (world ranks "
                f"{list(channel.members)})")

    def _give_up(self, channel: _Channel, what: str, final: bool) -> CollectiveTimeoutError | None:
        """The error to raise at the timeout, or None to wait for a monitor's verdict."""
        self._drain()
        arrived = self._arrived(channel)
        if channel.monitor:
            missing = sorted(set(range(channel.size)) - arrived)
            others = [w for r, w in enumerate(channel.members) if r != channel.rank]
            self._send(("verdict", channel.key, channel.seq, missing), others)
            lowest = min(r for r in range(_MONITORS) if r in arrived)
            return self._timeout_error(channel, what, missing, partial=False,
                                       reporter=lowest == channel.rank)
        verdict = self._verdicts.get(channel.key)
        if verdict is not None and verdict[0] >= channel.seq:
            return self._timeout_error(channel, what, verdict[1], partial=False,
                                       reporter=False)
        monitors = range(min(_MONITORS, channel.size))
        if not final and any(r in arrived for r in monitors):
            return None
        missing = [r for r in monitors if r not in arrived]
        return self._timeout_error(channel, what, missing, partial=True, reporter=True)

    def _timeout_error(self, channel: _Channel, what: str, missing: list[int],
                       partial: bool, reporter: bool) -> CollectiveTimeoutError:
        """The error of a timed-out rank. ``reporter`` marks the one rank (the lowest
        waiting monitor) whose error says it all, so that ``mpistrat run`` shows that
        one and not one per waiting rank (the attribute ``reporter`` of the error)."""
        known = (f"rank(s) {missing} did not arrive" if not partial else
                 f"rank(s) {missing} (the monitors, which track arrivals) did not arrive, "
                 f"and other ranks may be missing too")
        error = CollectiveTimeoutError(
            f"{what} (collective #{channel.seq} on {self._describe(channel)}) timed out "
            f"after {self.timeout:g} s on rank {channel.rank}: {known}; they are stuck "
            f"elsewhere or took another code path (every rank must make the same collective "
            f"calls in the same order); this communicator cannot be used after the timeout "
            f"(the collective timeout comes from --timeout or MPISTRAT_COLLECTIVE_TIMEOUT)",
            missing,
        )
        error.reporter = reporter  # type: ignore[attr-defined]
        trace_failure("collective timeout", str(error), [channel.members[r] for r in missing],
                      collective=what, seq=channel.seq)
        return error


yield_core = getattr(os, "sched_yield", lambda: time.sleep(0))


def _to_stderr(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


_CURRENT: list[Watch] = []


def current() -> Watch | None:
    """The process-wide watch, or None when agreements are not watched."""
    return _CURRENT[0] if _CURRENT else None


def allreduce_max(comm: Comm, flags: Any, what: str) -> None:
    """``comm.Iallreduce(IN_PLACE, flags, MAX)`` and its wait: watched (:meth:`Watch.
    allreduce`) when agreements are, else a plain wait. Non-blocking either way, so that
    it matches the other ranks' whether they are watched or not."""
    found = current()
    if found is None:
        MPI = mpi()
        comm.Iallreduce(MPI.IN_PLACE, flags, op=MPI.MAX).Wait()
    else:
        found.allreduce(comm, flags, what)


def watch(stall_check: float | None = 60.0, timeout: float | None = None,
          report: Callable[[str], None] | None = None) -> Watch | None:
    """Watch every agreement from now on (collective over ``COMM_WORLD``).

    Args:
        stall_check: seconds a rank waits before the ranks that have not arrived are
            reported (None or 0: no reports).
        timeout: seconds a rank waits before it raises
            :class:`~mpistrat.CollectiveTimeoutError` (None or 0: wait forever).
        report: receives each report's text (default: ``sys.stderr``).

    Returns:
        The new watch, or None when both are off (agreements are then waited on plainly).

    Raises:
        ValueError: a negative or non-finite number (on this rank, before communicating:
            every rank passes the same values).
    """
    for name, value in (("stall_check", stall_check), ("timeout", timeout)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 <= value < math.inf):
            raise ValueError(f"{name} must be a number of seconds >= 0 (0 or None: off), "
                             f"got {value!r}")
    unwatch()
    if not stall_check and not timeout:
        return None
    side = mpi().COMM_WORLD.Dup()
    _CURRENT.append(Watch(side, float(stall_check) if stall_check else None,
                          float(timeout) if timeout else None, report))
    return _CURRENT[0]


def unwatch() -> None:
    """Stop watching agreements and free the private communicator (collective when a
    watch is on: every rank calls it)."""
    if _CURRENT:
        _CURRENT.pop().close()
