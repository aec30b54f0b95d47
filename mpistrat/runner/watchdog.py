"""The watchdog of ``mpistrat run``: no rank stays in a collective past ``--timeout``, and
reports name the hosts and ranks that can no longer be reached.

The watched agreement (:mod:`mpistrat.runtime.stall`) bounds the wait for the ranks to *arrive*
in a collective. Once they have, the algorithm's own MPI calls run (``Recv``, ``Wait``,
``Sendrecv``: blocking, in C) and nothing in Python polls them: a peer that dies or is cut
off in the middle leaves the rank blocked for good. Hence a thread per rank:

* **The bound.** Every watched agreement records, per thread, the collective it starts
  (an entry of :mod:`mpistrat.runtime.stall`). Once a second (or a tenth of the shortest bound) the
  watchdog looks at the threads' stacks (``sys._current_frames``): a thread whose
  collective's outermost frame is still on its stack ``--timeout`` seconds after the
  collective started is stuck. The watchdog then probes the other ranks (below), prints
  one report — the hosts and ranks that do not answer, or, when all answer, what each
  rank is doing — writes it to ``--report-dir`` if given, calls ``MPI_Abort`` and ends the
  process with ``os._exit`` whatever MPI does (``MPI_Abort`` returns in MPICH 5, and the
  launcher that would end the rank may be unreachable); ``faulthandler``'s C-level timer
  ends it even if the interpreter cannot (:data:`HARD_STOP`). After ``--stall-check``
  seconds (and every as long) it reports such a collective without ending anything.
  MPI calls release the GIL, so the thread runs while the rank is blocked in one.
* **The liveness probe.** Every rank has a UDP socket (on the loopback when the job runs
  on one host); the addresses and ports are exchanged once at the start. The watchdog
  thread answers every probe at once with what its rank is doing ("in all_reduce
  (collective #12 ...) for 10.3 s", "running the script", "ending"). A probe sends one
  datagram to every rank (three tries in :data:`PROBE_SECONDS`) and collects the
  answers: ranks that do not answer are unreachable — killed, their host down, or cut
  off by a network partition — and are named grouped by host (``host node2 (ranks 2,
  3)``). Probes happen only when something is already wrong (a timeout, a stall report,
  a failed rank whose peers do not come). Every datagram carries an HMAC under the job's
  secret (:mod:`.auth`) over its kind, the probe's random number, the sender's rank and
  its text; an answer counts only for a probe in progress and once per rank, so forged
  or replayed datagrams change nothing. A probe is answered at the sender's known
  address only, never at an arbitrary source (no reflection), and each wake-up reads at
  most :data:`MAX_DRAIN` datagrams, so a flood cannot keep the watchdog from its checks.

Of the ranks that a fault stops together, the lowest one that answers the probe and is
itself stuck or failing prints the full report; the others print one line pointing to it,
so each side of a partition shows one report. The cost on the normal path: one object and
a short frame walk per collective (in the agreement), a thread that wakes once a second.
"""

from __future__ import annotations

import faulthandler
import os
import runpy
import secrets
import select
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import trace
from ..runtime import stall
from ..runtime._mpi import Comm, mpi
from ..runtime.stall import AGREED, CHANNEL, FRAME, POLLED, REPORTED, SEQ, STARTED, WHAT
from ..runtime.topology import get_topology
from . import auth
from .hosts import group_by_host, local_addresses, name_ranks
from .reports import write_report

__all__ = ["Watchdog", "Answer", "Diagnosis", "PROBE_SECONDS", "HARD_STOP", "MAX_DRAIN",
           "name_ranks", "group_by_host", "local_addresses", "abort_and_exit", "flush_trace"]

PROBE_SECONDS = 1.0  # how long a probe waits for answers
_TRIES = (0.0, 0.3, 0.6)  # when, within a probe, the datagrams are (re)sent
HARD_STOP = 10.0  # seconds after the watchdog decides to end the rank, it ends regardless
_BACKSTOP = 1.0  # seconds past the agreement's own timeout before the watchdog acts on it
_BLOCKED = 1.0  # an agreement that has not polled for this long is blocked inside MPI
_DELIVERY = 0.25  # seconds between the last report and MPI_Abort (the launcher forwards it)
ABORT_WAIT = 1.0  # seconds after MPI_Abort starts before the rank ends itself
_FOLLOWER_DELAY = 1.0  # a non-reporting rank gives the reporter's report time to get out
_TROUBLED_AFTER = 1.0  # seconds in one collective after which a rank counts as stuck
_PING, _PONG = b"msp?", b"msp!"
_HEADER = struct.Struct("!4sQI")  # kind, the probe's number, the sender's rank; then the
_TAG = 16  # text (answers: troubled, state), then this many bytes of HMAC over all of it
_MAX_STATE = 700  # bytes of a state text in an answer
_MAX_DATAGRAM = _HEADER.size + 1 + _MAX_STATE + _TAG
MAX_DRAIN = 64  # datagrams read per wake-up of the thread (then it checks its bounds)


@dataclass(frozen=True)
class Answer:
    """A rank's answer to a probe: whether it is stuck or ending itself, and what it does."""

    rank: int
    troubled: bool
    state: str


@dataclass
class Diagnosis:
    """What a probe found.

    Attributes:
        answers: the ranks that answered (this rank included), by rank.
        unreachable: the ranks that did not.
        hostnames: every rank's host name.
    """

    answers: dict[int, Answer]
    unreachable: list[int]
    hostnames: Sequence[str]
    lost: dict[str, list[int]] = field(init=False)

    def __post_init__(self) -> None:
        self.lost = group_by_host(self.unreachable, self.hostnames)

    def names(self) -> str:
        """The unreachable ranks in words: ``host node2 (ranks 2, 3)``."""
        return name_ranks(self.unreachable, self.hostnames)


class Watchdog:
    """The watchdog thread of one rank (module docstring). Start it with :meth:`start`
    (collective over ``COMM_WORLD``), stop it with :meth:`stop`.

    Attributes:
        phase: what the rank does outside collectives, for probe answers (the runner sets
            ``"running the script"``, ``"finished the script"``, ...).
        ending: the rank is ending after a failure (probe answers say so).
    """

    def __init__(self, watch: Any, rank: int, hostnames: Sequence[str],
                 peers: Sequence[tuple[int, Sequence[str]]], sock: socket.socket, key: bytes,
                 report: Callable[[str], None], report_file: str | None = None,
                 notify: Callable[[int, str], None] | None = None) -> None:
        self.watch = watch
        self.rank, self.size = rank, len(hostnames)
        self.hostnames = tuple(hostnames)
        self.host = self.hostnames[rank]
        self.timeout: float | None = watch.timeout
        self.stall_check: float | None = watch.stall_check
        bounds = [t for t in (self.timeout, self.stall_check) if t]
        self.tick = max(0.05, min([1.0, *(t / 10 for t in bounds)]))
        self.report = report
        self.report_file = report_file
        self.notify = notify
        self.phase = "starting"
        self.ending = False
        self.exiting = False  # the watchdog is ending this rank (end() runs)
        self._finishing: tuple[float, int, str | None] | None = None
        self._finish_probed = 0.0
        self._sock = sock
        self._key = key
        self._targets = [[(str(a), int(p)) for a, p in self._addresses(r, port, addresses)]
                         for r, (port, addresses) in enumerate(peers)]
        self._pongs: dict[int, dict[int, Answer]] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mpistrat-watchdog",
                                        daemon=True)
        self._devnull: Any = None

    def _addresses(self, rank: int, port: int, addresses: Sequence[str]) -> list[tuple]:
        if rank == self.rank or self.hostnames[rank] == self.host:
            return [("127.0.0.1", port)]
        return [(address, port) for address in addresses]

    @classmethod
    def start(cls, watch: Any, comm: Comm, report: Callable[[str], None],
              report_file: str | None = None,
              notify: Callable[[int, str], None] | None = None,
              secret: bytes | None = None) -> Watchdog:
        """Exchange the probe addresses over ``comm`` (a private duplicate of
        ``COMM_WORLD``; collective: every rank calls it), start the thread, and hand the
        watch its diagnosis (for the stall reports). ``secret``: the job's (the same on
        every rank); default: rank 0 makes one and broadcasts it."""
        hostnames = _hostnames(mpi().COMM_WORLD)
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        # one host: nobody else needs to reach it (the loopback); else every address,
        # as the peers' packets arrive on whichever this host has on their route
        lone = len(set(hostnames)) == 1
        sock.bind(("127.0.0.1" if lone else "", 0))
        sock.setblocking(False)
        if secret is None:
            secret = comm.bcast(auth.new_secret() if comm.Get_rank() == 0 else None, root=0)
        peers = comm.allgather((sock.getsockname()[1], [] if lone else local_addresses()))
        dog = cls(watch, comm.Get_rank(), hostnames, peers, sock, secret, report, report_file,
                  notify)
        watch.diagnose = dog.explain_missing
        dog._thread.start()
        return dog

    def stop(self) -> None:
        """Stop the thread and close the socket (not collective)."""
        self.watch.diagnose = None
        self._stopped.set()
        try:  # (any datagram wakes the thread; this one is dropped unread)
            self._sock.sendto(b"wake", ("127.0.0.1", self._sock.getsockname()[1]))
        except OSError:
            pass
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(2 * self.tick + 1.0)
        self._sock.close()

    # -- the thread

    def _loop(self) -> None:
        failures = 0
        while not self._stopped.is_set():
            try:
                self._pump(self.tick)
                if not self._stopped.is_set():
                    self._check()
                failures = 0
            except Exception:  # noqa: BLE001 - the watchdog must keep watching
                failures += 1
                if failures == 1:
                    self.report("mpistrat: watchdog error (it keeps running):\n"
                                + traceback.format_exc())
                time.sleep(self.tick)

    def _pump(self, timeout: float) -> None:
        """Wait up to ``timeout`` for datagrams; answer probes, keep answers."""
        try:
            readable, _, _ = select.select([self._sock], [], [], max(0.0, timeout))
        except (OSError, ValueError):
            return  # closed by stop()
        if readable:
            with self._lock:
                self._drain()

    def _drain(self) -> None:
        for _ in range(MAX_DRAIN):
            try:
                data, source = self._sock.recvfrom(_MAX_DATAGRAM + 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                continue  # e.g. an ICMP error of an earlier datagram
            message = self._open(data)
            if message is None:
                continue
            kind, nonce, rank, text = message
            if kind == _PING:
                troubled, state = self.state()
                self._send(_PONG, nonce, bytes([troubled]) + state.encode()[:_MAX_STATE],
                           self._reply_to(rank, source))
            elif kind == _PONG and nonce in self._pongs and text and \
                    rank not in self._pongs[nonce]:
                self._pongs[nonce][rank] = Answer(
                    rank, bool(text[0]), text[1:].decode(errors="replace"))

    def _open(self, data: bytes) -> tuple[bytes, int, int, bytes] | None:
        """(kind, nonce, rank, text) of an authentic datagram from another rank; None
        for anything else (short, long, forged, of an unknown kind or rank)."""
        if not _HEADER.size + _TAG <= len(data) <= _MAX_DATAGRAM:
            return None
        kind, nonce, rank = _HEADER.unpack_from(data)
        text, mac = data[_HEADER.size:-_TAG], data[-_TAG:]
        if kind not in (_PING, _PONG) or not 0 <= rank < self.size or rank == self.rank or \
                not auth.verify(self._key, mac, kind, nonce, rank, text):
            return None
        return kind, nonce, rank, text

    def _send(self, kind: bytes, nonce: int, text: bytes,
              targets: Sequence[tuple[str, int]]) -> None:
        datagram = _HEADER.pack(kind, nonce, self.rank) + text
        datagram += auth.tag(self._key, kind, nonce, self.rank, text, size=_TAG)
        for target in targets:
            try:
                self._sock.sendto(datagram, target)
            except OSError:
                pass  # no route (a link that is down): no answer either

    def _reply_to(self, rank: int, source: tuple[str, int]) -> list[tuple[str, int]]:
        """Where to answer rank ``rank``'s probe: where it came from when that is one of
        the rank's own addresses, else to those addresses (never to a stranger)."""
        targets = self._targets[rank]
        return [source] if tuple(source[:2]) in targets else targets

    # -- what this rank is doing

    def _collectives(self) -> list[tuple[Any, float]]:
        """The collectives threads of this rank are in now, with how long each lasted."""
        now = time.monotonic()
        frames = sys._current_frames()
        inside = []
        for ident, entry in list(self.watch.active.items()):
            frame = entry[FRAME]
            if frame is None:
                continue
            top = frames.get(ident)
            if top is None or not _on_stack(top, frame):
                entry[FRAME] = None  # done: let its locals go
                continue
            inside.append((entry, now - entry[STARTED]))
        return inside

    def state(self) -> tuple[bool, str]:
        """(stuck or ending, what this rank is doing in words), for probe answers."""
        if self.ending:
            return True, "ending after a failure"
        inside = self._collectives()
        if not inside:
            return False, self.phase
        entry, lasted = max(inside, key=lambda item: item[1])
        return lasted >= _TROUBLED_AFTER, self._doing(entry, lasted)

    def _doing(self, entry: list, lasted: float, limit: str = "") -> str:
        """``in all_reduce (collective #12 on ...) for 10.2 s[LIMIT], all ranks having
        arrived (exchanging data)``."""
        phase = ("waiting for the other ranks to arrive" if entry[AGREED] is None else
                 "all ranks having arrived (exchanging data)")
        return (f"in {entry[WHAT]} (collective #{entry[SEQ]} on "
                f"{self.watch.describe(entry[CHANNEL])}) for {lasted:.1f} s{limit}, {phase}")

    # -- the probe

    def probe(self, wait: float = PROBE_SECONDS) -> Diagnosis:
        """Ask every rank what it is doing; those that do not answer within ``wait``
        seconds are unreachable. Any thread may call it."""
        nonce = secrets.randbits(64)
        answers: dict[int, Answer] = {}
        self._pongs[nonce] = answers
        troubled, state = self.state()
        answers[self.rank] = Answer(self.rank, troubled, state)
        start = time.monotonic()
        try:
            for when in (*_TRIES, wait):
                while len(answers) < self.size:
                    left = start + when - time.monotonic()
                    if left <= 0:
                        break
                    self._pump(min(left, 0.05))
                if when >= wait or len(answers) == self.size:
                    break
                for rank, targets in enumerate(self._targets):
                    if rank not in answers:
                        self._send(_PING, nonce, b"", targets)
        finally:
            self._pongs.pop(nonce, None)
        unreachable = [r for r in range(self.size) if r not in answers]
        return Diagnosis(dict(answers), unreachable, self.hostnames)

    def is_reporter(self, diagnosis: Diagnosis) -> bool:
        """Whether this rank prints the full report: the lowest rank that answered and is
        stuck or ending itself (each side of a partition has one)."""
        troubled = [r for r, answer in diagnosis.answers.items() if answer.troubled]
        return not troubled or min(troubled + [self.rank]) == self.rank

    def explain_missing(self, world_ranks: list[int]) -> str | None:
        """For the agreement's stall report: which of ``world_ranks`` do not answer."""
        diagnosis = self.probe()
        silent = [r for r in world_ranks if r in diagnosis.unreachable]
        if not silent:
            return None
        return (f"{_subject(silent, self.hostnames)} not answer mpistrat's liveness probe "
                f"either: {_cut_off(silent, self.hostnames, self.host)}.")

    # -- stuck collectives

    def _check(self) -> None:
        self._check_finishing()
        for entry, lasted in self._collectives():
            if entry[AGREED] is None:
                # the agreement polls its own timeout, unless a poll blocks inside MPI
                # (a peer killed mid-connection can make MPICH's progress block)
                blocked = time.monotonic() - entry[POLLED] >= _BLOCKED
                if self.timeout and (lasted >= self.timeout and blocked or lasted >=
                                     self.timeout + stall.VERDICT_WAIT + _BACKSTOP):
                    self._fire(entry, lasted)
                continue
            if self.timeout and lasted >= self.timeout:
                self._fire(entry, lasted)
            elif self.stall_check and lasted >= entry[REPORTED] + self.stall_check:
                entry[REPORTED] = lasted
                self._stall_report(entry, lasted)

    def finishing(self, status: int, report: str | None, within: float) -> None:
        """The runner's last step has begun: this rank waits for the others to end the
        script too (status 0), or, failed, for them or for its turn to abort. A failed
        rank still here after ``within`` seconds is blocked inside MPI: it is ended with
        its report. A finished one whose peers do not come within ``--timeout`` is ended
        when they do not answer either (a host lost after this rank's last collective)."""
        self.phase = ("finished the script, waiting for the others" if status == 0 else
                      f"ending after a failure (status {status})")
        self._finishing = (time.monotonic() + (within if status else 0.0), status, report)

    def _check_finishing(self) -> None:
        if self._finishing is None or self.ending and not self._finishing[1]:
            return
        deadline, status, report = self._finishing
        now = time.monotonic()
        if status:
            if now >= deadline:
                self._end(status, (report or "") + "\n(mpistrat: this rank's end was blocked "
                          "inside MPI; it ends itself)", True)
            return
        if not self.timeout or now - deadline < self.timeout or \
                now - self._finish_probed < self.timeout:
            return
        self._finish_probed = now
        diagnosis = self.probe()
        if not diagnosis.unreachable:
            return  # the others still run: the job's own length is not bounded
        self.ending = True
        text = (f"mpistrat.errors.PeerLostError: lost {diagnosis.names()}: rank "
                f"{self.rank} ({self.host}) finished the script and has waited "
                f"{now - deadline:.1f} s for the other ranks to finish theirs. "
                + self._findings(diagnosis) + " " + _ENDING)
        reporter = self.is_reporter(diagnosis)
        self._end(1, text if reporter else self._follower_line(diagnosis, "the end"),
                  reporter, diagnosis.unreachable)

    def _stall_report(self, entry: list, lasted: float) -> None:
        diagnosis = self.probe()
        if not self.is_reporter(diagnosis):
            return
        text = (f"mpistrat: stall: rank {self.rank} ({self.host}) has been "
                f"{self._doing(entry, lasted)}. " + self._findings(diagnosis))
        text += (" This check repeats; --timeout (MPISTRAT_COLLECTIVE_TIMEOUT) ends the job "
                 "instead." if self.timeout is None else
                 f" The job gives up after {self.timeout:g} s (--timeout).")
        stall.trace_failure("stall", text, diagnosis.unreachable, collective=entry[WHAT],
                            seq=entry[SEQ], waited_s=round(lasted, 3))
        self.report(text)

    def _findings(self, diagnosis: Diagnosis) -> str:
        if diagnosis.unreachable:
            answered = sorted(diagnosis.answers)
            return (f"{_subject(diagnosis.unreachable, self.hostnames)} not answer "
                    f"mpistrat's liveness probe ({PROBE_SECONDS:g} s): "
                    f"{_cut_off(diagnosis.unreachable, self.hostnames, self.host)}; MPI "
                    f"cannot complete a collective without them. Answering: "
                    + _states(diagnosis, answered) + ".")
        return ("Every rank answers mpistrat's liveness probe, so MPI itself is stuck (a "
                "rank that left the collective's pattern, or a network path MPI uses and "
                "the probe does not): " + _states(diagnosis, sorted(diagnosis.answers)) + ".")

    def _fire(self, entry: list, lasted: float) -> None:
        """A collective outlasted --timeout: report, then end this rank (never returns)."""
        self.ending = True
        diagnosis = self.probe()
        reporter = self.is_reporter(diagnosis)
        doing = self._doing(entry, lasted, f", past --timeout {self.timeout:g} s")
        if reporter:
            if diagnosis.unreachable:
                head = f"mpistrat.errors.PeerLostError: lost {diagnosis.names()}: "
            else:
                head = "mpistrat.errors.CollectiveTimeoutError: "
            text = (f"{self._location(entry)}{head}rank {self.rank} ({self.host}) has been "
                    f"{doing}. " + self._findings(diagnosis) + " " + _ENDING)
        else:
            text = self._follower_line(diagnosis, f"{entry[WHAT]} (collective #{entry[SEQ]})")
        self._end(1, text, reporter, diagnosis.unreachable)

    def _location(self, entry: list) -> str:
        """The script's frames down to its call into mpistrat, as a traceback."""
        frame = entry[FRAME]
        if frame is None:
            return ""
        summary = traceback.extract_stack(frame.f_back) if frame.f_back is not None else []
        below = [i for i, f in enumerate(summary) if _hidden(f.filename)]
        frames = summary[below[-1] + 1:] if below else summary
        if not frames:
            return ""
        return "Traceback (most recent call last):\n" + "".join(traceback.format_list(frames))

    def _follower_line(self, diagnosis: Diagnosis, what: str) -> str:
        troubled = [r for r, a in diagnosis.answers.items() if a.troubled]
        lead = min(troubled) if troubled else self.rank
        lost = (f"{diagnosis.names()} cannot be reached" if diagnosis.unreachable else
                "the job cannot go on")
        return (f"mpistrat: rank {self.rank} ({self.host}) stops too in {what}: {lost}; "
                f"rank {lead} reports.")

    def explain_failure(self, report: str, location: str, symptom: bool,
                        what: str = "an error",
                        diagnosis: Diagnosis | None = None) -> tuple[str, bool]:
        """For a rank whose script failed while its peers do not come (the runner's
        abort path): (the report to print, whether this rank is the reporter). When ranks
        do not answer and the failure is a collective's (a timeout, an aborted
        collective), the report names them instead of the symptom; other failures keep
        their traceback, with the unreachable ranks added (``diagnosis``: a probe made
        just before, else one is made now)."""
        self.ending = True
        if diagnosis is None:
            diagnosis = self.probe()
        reporter = self.is_reporter(diagnosis)
        if not diagnosis.unreachable:
            return report, True
        if not reporter and symptom:
            return self._follower_line(diagnosis, "its collective"), False
        findings = self._findings(diagnosis)
        if symptom:
            return (f"{location}mpistrat.errors.PeerLostError: lost {diagnosis.names()}: "
                    f"a collective could not complete on rank {self.rank} ({self.host}) "
                    f"(it surfaced here as {_article(what)} {what}). "
                    + findings + " " + _ENDING), True
        return f"{report.rstrip()}\n(mpistrat: also, {findings})", True

    # -- ending the rank

    def _arm_hard_stop(self) -> None:
        """End the process HARD_STOP seconds from now even if Python cannot run (a C-level
        timer of faulthandler; exit status 1). Armed once."""
        if self._devnull is None:
            self._devnull = open(os.devnull, "w")  # noqa: SIM115 - kept until the end
            faulthandler.dump_traceback_later(HARD_STOP, exit=True, file=self._devnull)

    def _end(self, status: int, text: str, reporter: bool, ranks: Sequence[int] = ()) -> None:
        """:meth:`end`, the report kept in the trace first (about ``ranks``: those that
        cannot be reached)."""
        stall.trace_failure("failure", text, ranks, rank=self.rank, status=status)
        self.end(status, text, reporter)

    def end(self, status: int, text: str, reporter: bool = True) -> None:
        """Report ``text``, then end the job from this rank: ``MPI_Abort``, then
        ``os._exit(status)`` (see :func:`abort_and_exit`, which writes the trace first).
        Never returns."""
        self.ending = self.exiting = True
        self._arm_hard_stop()
        self.report(text)
        self.record(status, text)
        self.wait_answering(_DELIVERY if reporter else _FOLLOWER_DELAY)
        abort_and_exit(status, self.wait_answering)

    def record(self, status: int, text: str) -> None:
        """Keep a report where it survives a cut link: the report file, and the job
        monitor of ``mpistrat run -n``."""
        if self.report_file:
            write_report(self.report_file, text, self._key, self.rank, self.host)
        if self.notify is not None:
            try:
                self.notify(status, text)
            except Exception:  # noqa: BLE001 - the report is printed already
                pass

    def wait_answering(self, seconds: float) -> None:
        """Sleep ``seconds``, answering probes meanwhile (a rank about to end still tells
        its peers it is alive and ending, so they do not count it as lost)."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            self._pump(min(left, 0.05))


def abort_and_exit(status: int, wait: Callable[[float], None] = time.sleep) -> None:
    """``MPI_Abort(COMM_WORLD, status)`` on a thread of its own, then ``os._exit(status)``:
    MPICH's MPI_Abort returns under hydra (the launcher then ends the rank, usually within
    a fraction of a second), blocks for seconds under Slurm's PMI, and the launcher of a
    rank cut off from it never ends it. The rank waits for MPI_Abort at most ABORT_WAIT
    seconds, then for the launcher's kill at most ABORT_WAIT more, then exits with
    ``status``: either way the launcher has the abort, or sees this rank fail. Never
    returns.

    Under :mod:`mpistrat.trace` the rank's trace is written first, so that its file
    ends with the failure."""
    flush_trace()
    aborter = threading.Thread(target=lambda: mpi().COMM_WORLD.Abort(status),
                               name="mpistrat-abort", daemon=True)
    aborter.start()
    aborter.join(ABORT_WAIT)
    wait(ABORT_WAIT)  # the launcher's kill is the usual end
    os._exit(status)


def flush_trace() -> None:
    """Write what this rank's trace holds (:func:`mpistrat.trace.flush`, which waits for
    the file a bounded time) before the process ends abnormally; a failure to write it
    does not keep the rank from ending."""
    if trace.active():
        try:
            trace.flush()
        except Exception:  # noqa: BLE001 - the rank ends anyway
            pass


_ENDING = ("An MPI job cannot continue without its ranks: this rank ends now, and the "
           "others with it; rerun the job to resume from its last complete checkpoint.")


def _article(word: str) -> str:
    return "an" if word[:1].lower() in "aeiou" else "a"


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]


def _subject(ranks: Sequence[int], hostnames: Sequence[str]) -> str:
    """``Host node2 (ranks 2, 3) does`` / ``Ranks 2 (node1) and 3 (node2) do``."""
    text = name_ranks(ranks, hostnames)
    groups = group_by_host(ranks, hostnames)
    whole = all(members == [r for r, h in enumerate(hostnames) if h == host]
                for host, members in groups.items())
    one = len(groups) == 1 and (whole or len(ranks) == 1)
    return f"{_capital(text)} {'does' if one else 'do'}"


def _cut_off(ranks: Sequence[int], hostnames: Sequence[str], here: str) -> str:
    """Why ranks do not answer, in words."""
    hosts = sorted({hostnames[r] for r in ranks})
    if here in hosts:
        return (f"{'it was' if len(ranks) == 1 else 'they were'} killed or stopped, or "
                f"{'hangs' if len(ranks) == 1 else 'hang'} without letting Python run")
    one = len(hosts) == 1
    names = " and ".join(hosts)
    return (f"{names} {'is' if one else 'are'} down, {'its' if one else 'their'} processes "
            f"were killed, or the network between {here} and {names} failed (a partition)")


def _states(diagnosis: Diagnosis, ranks: Sequence[int]) -> str:
    parts = []
    for rank in ranks:
        answer = diagnosis.answers[rank]
        parts.append(f"rank {rank} ({diagnosis.hostnames[rank]}) {answer.state}")
    return "; ".join(parts)


def _on_stack(top: Any, frame: Any) -> bool:
    while top is not None:
        if top is frame:
            return True
        top = top.f_back
    return False


_RUNNER = os.path.dirname(os.path.abspath(__file__))


def _hidden(filename: str) -> bool:
    """Frames of the runner and runpy: the script's frames are those above the last."""
    path = os.path.abspath(filename)
    return filename == "<frozen runpy>" or path.startswith(_RUNNER + os.sep) or \
        path == os.path.abspath(runpy.__file__)


def _hostnames(comm: Comm) -> tuple[str, ...]:
    """Every rank's host name, from the topology (processor names)."""
    try:
        return tuple(get_topology(comm).hostnames)
    except Exception:  # noqa: BLE001 - the same on every rank (the environment's fault)
        return tuple(comm.allgather(mpi().Get_processor_name()))
