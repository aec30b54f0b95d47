"""How the ranks of ``mpistrat run`` end: together, with every failure shown once.

Each rank turns the end of its script into an :class:`Outcome` (an exit status and, on
failure, the text to show: the traceback, or the non-zero ``sys.exit`` status), then
calls :func:`finish`. There the ranks meet in one non-blocking ``Iallreduce`` of their
statuses on a private communicator:

* every rank arrives (all succeeded, or the ranks failed together, e.g. the same bug on
  every rank): rank 0 prints each distinct report once, tagged with the ranks it came
  from (``[0-3] Traceback ...``), and every rank exits with the highest status — unless a
  failure left a collective in flight (a collective timeout), which MPI cannot finalize
  cleanly: then rank 0 aborts the job with that status after printing;
* a failed rank whose peers do not arrive within ``grace`` seconds (they wait in a
  collective for it, or still compute) prints its own report tagged with its rank,
  flushes, and calls ``MPI_Abort`` with its status: the launcher then ends every rank.
  With the watchdog (:mod:`~mpistrat.runner.watchdog`) it first probes the other ranks:
  when some do not answer and the failure is a collective's (a timeout, an aborted
  collective, an MPI error), the report names the unreachable hosts and ranks instead of
  the symptom (which often blames a peer on the same host that waited for them too), and
  only the lowest failing rank that answers prints it in full. ``MPI_Abort`` returns in
  MPICH and the launcher may be cut off, so the rank then ends itself (``os._exit``).
"""

from __future__ import annotations

import faulthandler
import os
import runpy
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import CollectiveAbortedError, CollectiveTimeoutError, MpistratError
from ..runtime._mpi import mpi
from ..runtime.stall import trace_failure
from .watchdog import abort_and_exit

__all__ = ["Outcome", "outcome_of", "finish", "FAILURE_GRACE"]

FAILURE_GRACE = 1.0  # seconds a failed rank waits for the others to end too
_DELIVERY = 0.25  # seconds between the last report and MPI_Abort
_DEFER = 3.0  # extra seconds a secondary report waits for the primary one's abort
_FOLLOWER = 1.0  # seconds a rank that defers to another's report waits before aborting
HARD_STOP = 10.0  # after this long in the abort path, the process ends regardless
_PROBE = 1.0  # the watchdog's liveness probe (runner/watchdog.py PROBE_SECONDS)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_HIDDEN = (os.path.dirname(os.path.abspath(__file__)), os.path.abspath(runpy.__file__))


@dataclass(frozen=True)
class Outcome:
    """How one rank's script ended.

    Attributes:
        status: the exit status (0: success).
        report: what to show for a failure (a traceback, a message), None on success.
        in_flight: the failure left a collective in flight (a collective timeout).
        secondary: another rank reports the same failure better (a collective timeout
            on a rank other than the one that names the missing ranks): this report is
            shown only when no such rank's report is.
        location: the traceback's header and frames without the exception (where the
            script was), for a report that replaces the exception with a diagnosis.
        symptom: the failure is a collective's (a timeout, an aborted collective, an MPI
            error), which a lost peer explains better than the exception does.
        what: the exception's type name.
    """

    status: int
    report: str | None = None
    in_flight: bool = False
    secondary: bool = False
    location: str = ""
    symptom: bool = False
    what: str = ""


def outcome_of(exc: BaseException | None, target: str) -> Outcome:
    """The outcome of a script that raised ``exc`` (None: it returned).

    ``SystemExit`` follows Python's rules: no code or 0 is success, an integer is the
    status, anything else is printed and gives status 1. ``KeyboardInterrupt`` gives
    130 (128 + SIGINT), as a shell reports a Ctrl-C.
    """
    if exc is None:
        return Outcome(0)
    if isinstance(exc, SystemExit):
        code = exc.code
        if code is None or code == 0:
            return Outcome(0)
        if isinstance(code, int) and not isinstance(code, bool):
            status = code & 0xFF or 1
            return Outcome(status, f"mpistrat run: {target} exited with status {code}")
        return Outcome(1, str(code))
    status = 130 if isinstance(exc, KeyboardInterrupt) else 1
    timed_out = isinstance(exc, CollectiveTimeoutError)
    symptom = timed_out or isinstance(exc, CollectiveAbortedError) or \
        type(exc).__module__ == "mpi4py.MPI"
    return Outcome(status, format_exception(exc), in_flight=timed_out,
                   secondary=timed_out and getattr(exc, "reporter", True) is False,
                   location=format_location(exc), symptom=symptom,
                   what=type(exc).__name__)


def format_location(exc: BaseException) -> str:
    """The header and the script's frames of ``exc``'s traceback (as
    :func:`format_exception` shows them), without the exception line."""
    return format_exception_only_frames(exc)


def format_exception_only_frames(exc: BaseException) -> str:
    """The header and frames :func:`format_exception` shows for ``exc`` (its own
    traceback only), without the exception line."""
    tb = exc.__traceback__
    while tb is not None and _hidden(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    frames = traceback.extract_tb(tb)
    if isinstance(exc, MpistratError):
        while len(frames) > 1 and _inside_mpistrat(frames[-1].filename):
            frames.pop()
    lines = ["Traceback (most recent call last):\n"] if frames else []
    lines += traceback.format_list(frames)
    return "".join(lines)


def format_exception(exc: BaseException) -> str:
    """The traceback as Python prints it, without the runner's and runpy's frames; for
    mpistrat's own errors (whose messages say what went wrong and how to fix it), also
    without the frames inside mpistrat below the script's call."""
    lines = [format_exception_only_frames(exc)]
    lines += traceback.format_exception_only(type(exc), exc)
    context = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    if context is None:
        return "".join(lines)
    link = ("The above exception was the direct cause of the following exception:"
            if exc.__cause__ is not None else
            "During handling of the above exception, another exception occurred:")
    return f"{format_exception(context)}\n{link}\n\n{''.join(lines)}"


def _inside_mpistrat(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_PACKAGE)


def _hidden(filename: str) -> bool:
    return filename == "<frozen runpy>" or os.path.abspath(filename).startswith(_HIDDEN)


def finish(done: Any, outcome: Outcome, output: Any, grace: float = FAILURE_GRACE,
           watchdog: Any = None, notify: Any = None) -> int:
    """End this rank's part of the job (see the module docstring); every rank calls it once.

    Args:
        done: a private communicator spanning the job (a ``Dup`` of ``COMM_WORLD``).
        outcome: how this rank's script ended.
        output: the rank's :class:`~mpistrat.runner.output.RankOutput` (reports go to
            its real ``stderr``).
        grace: seconds a failed rank waits for the others before aborting the job.
        watchdog: the rank's :class:`~mpistrat.runner.watchdog.Watchdog`, if any: it
            probes the other ranks before a failed rank reports alone, and keeps the
            report (``--report-dir``, the job monitor).
        notify: called with the status when this rank ends another way (the job
            monitor of ``mpistrat run -n``).

    Returns:
        The job's exit status: the highest status of any rank. Does not return when a
        failed rank aborts the job.

    A failed rank's report goes into its trace (:mod:`mpistrat.trace`) as an instant
    ``failure``; before an abort the trace is written (:func:`~mpistrat.runner.watchdog.
    abort_and_exit`).
    """
    MPI = mpi()
    if outcome.status:
        trace_failure("failure", outcome.report or f"status {outcome.status}",
                      [done.Get_rank()], status=outcome.status, error=outcome.what)
    if done.Get_size() == 1:
        if outcome.report is not None:
            output.report(outcome.report)
        return outcome.status
    output.flush()
    if watchdog is not None:  # it ends this rank if MPI blocks the wait below
        watchdog.finishing(outcome.status, outcome.report,
                           grace + _DEFER + _PROBE + _FOLLOWER + 2.0)
    status = np.array([outcome.status, int(outcome.in_flight)], dtype=np.int64)
    request = done.Iallreduce(MPI.IN_PLACE, status, op=MPI.MAX)
    deadline = None
    if outcome.status:
        deadline = time.monotonic() + grace
    secondary = outcome.secondary  # it gives the primary report time to end the job
    diagnosis = None
    pause = 1e-4
    while not request.Test():
        if deadline is not None and time.monotonic() >= deadline:
            if watchdog is not None and diagnosis is None:
                diagnosis = watchdog.probe()  # a lost host: no primary report is coming
                secondary = secondary and not diagnosis.unreachable
            if secondary:
                secondary, deadline = False, deadline + _DEFER
                continue
            _fail_alone(outcome, output, watchdog, notify, diagnosis)
        time.sleep(pause)
        pause = min(pause * 2, 0.01)
    reports = done.gather((outcome.report, outcome.secondary) if outcome.status else None,
                          root=0)
    if done.Get_rank() == 0:
        primary = [r for r in reports if r is not None and not r[1]]
        shown = [r[0] if r is not None and (not primary or not r[1]) else None
                 for r in reports]
        for text, ranks in _grouped(shown):
            output.report(text, ranks)
    output.flush()
    if status[1]:
        if done.Get_rank() != 0:
            time.sleep(10 * _DELIVERY)  # rank 0 aborts the job meanwhile
        _abort(int(status[0]), notify=notify)
    return int(status[0])


def _fail_alone(outcome: Outcome, output: Any, watchdog: Any, notify: Any,
                diagnosis: Any = None) -> None:
    """The failed rank's report and abort when its peers do not come (never returns)."""
    _arm_hard_stop()
    if watchdog is not None and watchdog.exiting:  # it reported and ends the rank already
        time.sleep(HARD_STOP)
    text, reporter = outcome.report, True
    if watchdog is not None and text is not None:
        text, reporter = watchdog.explain_failure(text, outcome.location, outcome.symptom,
                                                  outcome.what, diagnosis)
        if text != outcome.report:  # (it names the ranks that cannot be reached)
            trace_failure("failure explained", text,
                          diagnosis.unreachable if diagnosis is not None else (),
                          status=outcome.status)
    if text is not None:
        output.report(text)
        if watchdog is not None:
            watchdog.record(outcome.status, text)
    output.flush()
    wait = _DELIVERY if reporter else _FOLLOWER
    if watchdog is not None:
        watchdog.wait_answering(wait)
        wait = 0.0
    _abort(outcome.status, wait, notify)


_DEVNULL: list[Any] = []


def _arm_hard_stop() -> None:
    """End the process HARD_STOP seconds from now whatever happens (faulthandler's
    C-level timer, which needs no GIL; exit status 1)."""
    if not _DEVNULL:
        _DEVNULL.append(open(os.devnull, "w"))  # noqa: SIM115 - kept until the end
    faulthandler.dump_traceback_later(HARD_STOP, exit=True, file=_DEVNULL[0])


def _abort(status: int, delay: float = _DELIVERY, notify: Any = None) -> None:
    """``MPI_Abort(status)``, and the end of this process whatever it does (see
    :func:`~mpistrat.runner.watchdog.abort_and_exit`). Never returns."""
    _arm_hard_stop()
    if notify is not None:
        try:
            notify(status)
        except Exception:  # noqa: BLE001 - the job ends anyway
            pass
    time.sleep(delay)  # let the launcher forward the last report first
    abort_and_exit(status)


def _grouped(reports: Sequence[str | None]) -> list[tuple[str, list[int]]]:
    """Identical reports merged, in the order of their lowest rank."""
    groups: dict[str, list[int]] = {}
    for rank, text in enumerate(reports):
        if text is not None:
            groups.setdefault(text, []).append(rank)
    return list(groups.items())
