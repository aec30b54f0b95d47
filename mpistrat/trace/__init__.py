"""Per-rank traces of where each step's time goes (``mpistrat run --trace DIR``).

Every rank writes ``DIR/rank-R.json`` in the Trace Event format that Perfetto,
``chrome://tracing`` and HTA open: its steps, each collective with its agreement (how long
this rank waited), algorithm phases, bytes and bandwidths, the strategy's replica
functions, input waits, checkpoint and snapshot saves, parameter-server closures, stall
reports and failures, and the classification of each step's time into compute,
communication and waiting (:mod:`mpistrat.trace.classify`). ``mpistrat trace merge``
aligns the ranks into one timeline; ``mpistrat trace summary`` names the stragglers.

Under ``mpistrat run --trace DIR`` nothing in the script changes. Elsewhere::

    import mpistrat
    mpistrat.trace.start("traces", steps="10:20")   # collective, over COMM_WORLD
    for batch in data:
        mpistrat.trace.step()                       # a plain loop marks its steps
        ...
    mpistrat.trace.stop()                           # collective

Steps come from the strategy when the script marks none: each batch of a distributed
dataset, else each ``strategy.run``; a call of :func:`step` takes over from both.
Only the steps in the window are recorded (the time before the first step is step 0),
at most :data:`MAX_EVENTS` events per step (about a megabyte), so a file's size is bounded
by the window. With tracing off, an instrumented call costs one branch.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import secrets
import socket
import time
from collections.abc import Iterator
from time import monotonic_ns
from typing import Any

from ..errors import TraceError
from ..runtime import recorder
from ..runtime.recorder import boundary, instant

__all__ = ["start", "stop", "step", "span", "tracing", "flush", "active", "parse_steps",
           "instant",
           "TraceError", "MAX_EVENTS", "DEFAULT_STEPS", "TRACE_ENV", "TRACE_STEPS_ENV",
           "rank_file"]

MAX_EVENTS = 2000
"""Events kept per step and rank: with their classification (at most two kernel events
each) the file grows by about a megabyte per step at most."""
DEFAULT_STEPS = "0:100"
TRACE_ENV = "MPISTRAT_TRACE"          # mpistrat run --trace's directory, for every rank
TRACE_STEPS_ENV = "MPISTRAT_TRACE_STEPS"
_SYNC_SECONDS = 10.0


def parse_steps(text: str | None) -> tuple[int, int | None]:
    """``"A:B"`` (steps A to B-1), ``"A:"`` (from A on) or ``"N"`` (the first N steps)
    as ``(first, stop)``."""
    if text is None:
        text = DEFAULT_STEPS
    match = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d*)\s*)?", str(text))
    if match is None:
        raise TraceError(f"--trace-steps takes A:B (steps A to B-1), A: (from step A on) "
                         f"or N (the first N steps), got {text!r}")
    if match.group(2) is None and ":" not in text:
        return 0, int(match.group(1))
    first = int(match.group(1))
    stop = int(match.group(2)) if match.group(2) else None
    if stop is not None and stop <= first:
        raise TraceError(f"--trace-steps {text!r} is empty: B must be greater than A")
    return first, stop


def rank_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank-{rank}.json")


class _Session:
    def __init__(self, comm: Any, rec: recorder.Recorder, writer: Any, path: str) -> None:
        self.comm = comm
        self.recorder = rec
        self.writer = writer
        self.path = path


_SESSION: list[_Session] = []


def active() -> bool:
    """True while this process writes a trace."""
    return bool(_SESSION)


def start(directory: str | os.PathLike[str], steps: str | tuple[int, int | None] | None = None,
          *, comm: Any = None, max_events: int = MAX_EVENTS) -> str:
    """Start tracing into ``directory`` (created; on a file system every host shares, for
    ``mpistrat trace merge``): collective over ``comm`` (default ``COMM_WORLD``).

    Args:
        directory: where each rank writes ``rank-R.json`` (old ``rank-*.json`` files there
            are removed first).
        steps: the window, ``"A:B"`` (see :func:`parse_steps`); default ``"0:100"``.
        max_events: events kept per step and rank.

    Returns:
        This rank's file.

    Raises:
        TraceError: on every rank, for a bad window, a directory that cannot be written,
            or tracing already started.
    """
    from ..runtime._mpi import mpi

    directory = os.fspath(directory)
    world = (comm if comm is not None else mpi().COMM_WORLD).Dup()
    rank, size = world.Get_rank(), world.Get_size()
    problem = None
    try:
        window = steps if isinstance(steps, tuple) else parse_steps(steps)
        if _SESSION:
            raise TraceError(f"tracing is already on (into {_SESSION[0].path}); "
                             f"call mpistrat.trace.stop() first")
        if rank == 0:
            os.makedirs(directory, exist_ok=True)
            for name in os.listdir(directory):
                if re.fullmatch(r"rank-\d+\.json", name):
                    os.unlink(os.path.join(directory, name))
    except (OSError, TraceError, TypeError, ValueError) as exc:
        problem = str(exc) if isinstance(exc, TraceError) else \
            f"cannot trace into {directory!r}: {exc}"
    problems = world.allgather(problem)
    if any(problems):
        world.Free()
        first = next(p for p in problems if p)
        raise TraceError(first)
    run = world.bcast(secrets.token_hex(8) if rank == 0 else None, root=0)
    measured = _sync(world)
    offset, trip = measured if measured is not None else (0, -1)
    base = world.bcast((monotonic_ns(), time.time_ns()) if rank == 0 else None, root=0)
    header = {
        "distributedInfo": {"rank": rank, "world_size": size, "backend": "mpistrat"},
        "schemaVersion": 1,
        "baseTimeNanoseconds": base[1],
        "mpistrat": {"format": 1, "run": run, "rank": rank, "size": size,
                     "host": socket.gethostname(), "pid": os.getpid(),
                     "steps": [window[0], window[1]], "max_events": max_events,
                     "clock": {"offset_ns": offset, "round_trip_ns": trip}},
    }
    from .writer import TraceWriter

    path = rank_file(directory, rank)
    problem = None
    writer = None
    try:
        os.makedirs(directory, exist_ok=True)
        writer = TraceWriter(path, header, rank, offset, base[0])
    except OSError as exc:
        problem = f"rank {rank} cannot write its trace {path!r}: {exc}"
    problems = world.allgather(problem)
    if any(problems):
        if writer is not None:
            writer.close()
        world.Free()
        raise TraceError(next(p for p in problems if p))
    assert writer is not None
    rec = recorder.Recorder(window, max_events, writer.put)
    _SESSION.append(_Session(world, rec, writer, path))
    recorder.install(rec)
    return path


def _sync(comm: Any) -> tuple[int, int] | None:
    return _clock().measure(comm, _SYNC_SECONDS)


def _clock() -> Any:
    from . import clock
    return clock


def step() -> None:
    """Mark a step boundary (a plain loop's; from then on the strategy's marks count no
    more). One branch when tracing is off."""
    boundary(recorder.FROM_SCRIPT)


@contextlib.contextmanager
def span(name: str, **args: Any) -> Iterator[None]:
    """Record the ``with`` block as a span called ``name`` (``args`` shown with it)."""
    t = recorder.begin()
    try:
        yield
    finally:
        if t:
            recorder.end(t, name, recorder.USER, args or None)


def flush() -> None:
    """Write what is recorded so far (before a process ends abnormally)."""
    if _SESSION:
        session = _SESSION[0]
        session.recorder.close_step()
        session.recorder.hand_over()
        session.writer.flush()


def stop(*, collective: bool = True) -> str | None:
    """End tracing: the last step's span, the clock measured again (``collective``: every
    rank calls it; the drift since the start goes into the file, for ``merge``), the file
    closed. Returns this rank's file (None when tracing was off)."""
    if not _SESSION:
        return None
    session = _SESSION.pop()
    rec = session.recorder
    rec.close_step()
    recorder.install(None)
    if collective:
        measured = _sync(session.comm)
        if measured is not None:
            rec.buffer.append((monotonic_ns(), -1, "clock_sync", "clock",
                               {"offset_ns": measured[0], "round_trip_ns": measured[1]},
                               rec.thread))
    if rec.dropped:
        rec.buffer.append((monotonic_ns(), -1, "events dropped", "mpistrat_trace",
                           {"dropped": rec.dropped, "max_events_per_step": rec.max_events},
                           rec.thread))
    rec.hand_over()
    session.writer.close()
    try:
        session.comm.Free()
    except Exception:  # noqa: BLE001 - MPI may be finalised at exit
        pass
    return session.path


@contextlib.contextmanager
def tracing(directory: str | os.PathLike[str], steps: str | None = None, *,
            comm: Any = None) -> Iterator[str]:
    """:func:`start` … :func:`stop` around a block (both collective)."""
    path = start(directory, steps, comm=comm)
    try:
        yield path
    finally:
        stop()


@atexit.register
def _at_exit() -> None:  # a script that never called stop(): its file, closed
    if _SESSION:
        stop(collective=False)
