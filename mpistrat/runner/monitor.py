"""The job monitor of ``mpistrat run -n N``: how each rank ended, seen from outside the
job, so that a host lost with all its processes is named even when the launcher kills
every other rank at once.

When hydra (MPICH's ``mpiexec``) loses the connection to a host's proxy — the host's
processes were killed, or it went down — it fails with ``assert (!closed) failed`` and
ends every other rank with ``SIGKILL`` within a fraction of a second: no rank can say
which host was lost, and hydra does not either. ``mpistrat run -n`` therefore listens on a
TCP port (:class:`JobMonitor`), and every rank connects to it when it starts
(:class:`MonitorClient`, address in ``MPISTRAT_RUN_MONITOR``), says who and where it is,
and says how it ends. Nothing else is sent. When a rank's connection closes without its
end being announced, its process died; the ranks of the lost host die first (the others
only once the launcher reacts to that), and the monitor records the order in which the
connections closed. A rank that never announces its end and whose connection stays open is
on the far side of a network partition. After the launcher ends, the monitor turns this
into one message (:meth:`JobMonitor.summary`, :func:`lost_text`). Under a plain
``mpiexec`` the ranks start the same monitor in a process of their own
(:mod:`.sidecar`).
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import InitVar, dataclass, field

from .hosts import local_addresses, name_ranks

__all__ = ["JobMonitor", "MonitorClient", "MONITOR_ENV", "RankRecord", "active",
           "LAUNCHER_GRACE", "address", "listen", "lost_text"]

MONITOR_ENV = "MPISTRAT_RUN_MONITOR"
_CONNECT_TIMEOUT = 1.0  # seconds per address a rank tries to reach the monitor
_SETTLE = 1.0  # seconds the summary waits for the connections of ended ranks to close
# Once a rank has failed or vanished, the launcher gets this long (beyond --timeout and the
# watchdog's hard stop) to end before it is ended: it may wait forever for a host it has
# lost, while every rank ends within its own bound.
LAUNCHER_GRACE = 20.0
_ACTIVE: list[JobMonitor] = []


def active() -> JobMonitor | None:
    """The job monitor of the ``mpistrat run -n`` in progress, if any."""
    return _ACTIVE[-1] if _ACTIVE else None


@dataclass
class RankRecord:
    """What the monitor knows of one rank."""

    rank: int
    host: str
    pid: int
    status: int | None = None  # the status it announced on ending
    ended: int | None = None  # when it announced it, in the order of events
    closed: float | None = None  # when its connection closed (time.time())
    order: int | None = None  # when its connection closed, in the order of events


@dataclass
class _Connection:
    sock: socket.socket
    buffer: bytes = b""
    rank: int | None = None


@dataclass
class JobMonitor:
    """Listens for the ranks of one job (in the process that runs ``mpiexec``).

    Use as a context manager: inside it, ``MPISTRAT_RUN_MONITOR`` is set in this
    process's environment (the launcher and the ranks inherit it; :func:`launch_command`
    also passes it with the launcher's flags) and :func:`active` returns it. Then
    :meth:`finish` prints what happened.

    Args:
        size: the number of ranks.
        timeout: the job's ``--timeout`` (for the launcher's bound, :attr:`bound`).
        report_dir: the job's ``--report-dir``, where cut-off ranks leave their reports.
        listener: a listening socket to accept the ranks on (default: a new one, see
            :func:`listen`).
    """

    size: int
    timeout: float | None = None
    report_dir: str | None = None
    records: dict[int, RankRecord] = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    # (signal, time.time()) of every signal passed on to the launcher (:meth:`forwarded`)
    signals: list[tuple[int, float]] = field(default_factory=list)
    listener: InitVar[socket.socket | None] = None

    def __post_init__(self, listener: socket.socket | None) -> None:
        self._listener = listener if listener is not None else listen(self.size)
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._events = 0  # ends announced and connections closed, counted in order
        self.lock = threading.Lock()  # held while the records change
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mpistrat-job-monitor",
                                        daemon=True)

    @property
    def bound(self) -> float:
        """Seconds the launcher may run on after a rank failed or vanished."""
        from .watchdog import HARD_STOP  # (not at the top: see :mod:`.sidecar`)

        return (self.timeout or 0.0) + HARD_STOP + LAUNCHER_GRACE

    def start(self) -> JobMonitor:
        """Start accepting and watching the ranks (in a thread of this process)."""
        self._thread.start()
        return self

    def __enter__(self) -> JobMonitor:
        self.start()
        self._saved = os.environ.get(MONITOR_ENV)
        os.environ.update(self.env())
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        if self._saved is None:
            os.environ.pop(MONITOR_ENV, None)
        else:
            os.environ[MONITOR_ENV] = self._saved
        self.close()

    def finish(self, status: int) -> int:
        """Print :meth:`summary` of a launcher that ended with ``status``; return it."""
        text = self.summary(status, self.report_dir)
        if text:
            sys.stdout.flush()
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
        return status

    def forwarded(self, signum: int) -> None:
        """Signal ``signum`` was passed on to the launcher, which ends the ranks itself:
        ranks that vanish after that were not lost (:meth:`summary`)."""
        self.signals.append((signum, time.time()))

    def env(self) -> dict[str, str]:
        """``MPISTRAT_RUN_MONITOR=PORT HOST ADDRESS,...`` (see :func:`address`)."""
        return {MONITOR_ENV: address(self._listener)}

    def close(self) -> None:
        """Stop listening (after the launcher ended); keeps the records."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(2.0)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self._selector.close()

    def _loop(self) -> None:
        while not self._stopped.is_set():
            # epoll returns ready connections in the order they became ready: the order
            # of closes below is the order in which the kernel saw them
            for key, _ in self._selector.select(timeout=0.2):
                if key.data is None:
                    self._accept()
                else:
                    self._read(key.data)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            sock.setblocking(False)
            self._selector.register(sock, selectors.EVENT_READ, _Connection(sock))

    def _read(self, connection: _Connection) -> None:
        try:
            data = connection.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data:
            connection.buffer += data
            *lines, connection.buffer = connection.buffer.split(b"\n")
            for line in lines:
                self._line(connection, line.decode(errors="replace").split())
            return
        self._selector.unregister(connection.sock)
        connection.sock.close()
        with self.lock:
            record = self.records.get(connection.rank) if connection.rank is not None else None
            if record is not None and record.closed is None:
                record.closed = time.time()
                record.order = self._events
                self._events += 1

    def _line(self, connection: _Connection, words: list[str]) -> None:
        with self.lock:
            if len(words) == 4 and words[0] == "hello" and words[1].isdigit() \
                    and words[3].isdigit():
                connection.rank = int(words[1])
                self.records[connection.rank] = RankRecord(connection.rank, words[2],
                                                           int(words[3]))
            elif len(words) == 2 and words[0] == "end" and connection.rank is not None \
                    and words[1].lstrip("-").isdigit():
                record = self.records[connection.rank]
                record.status, record.ended = int(words[1]), self._events
                self._events += 1

    # -- what happened

    def settled(self) -> bool:
        """Every rank that said hello has announced its end or lost its connection."""
        with self.lock:
            return bool(self.records) and all(
                r.status is not None or r.closed is not None for r in self.records.values())

    def troubled(self) -> bool:
        """Some rank failed, or vanished without announcing its end."""
        with self.lock:
            return any((r.status or 0) != 0 or (r.closed is not None and r.status is None)
                       for r in self.records.values())

    def vanished(self) -> tuple[list[RankRecord], list[str]]:
        """The ranks whose process died without announcing its end, before any rank
        announced a failure, in the order their connections closed; and every rank's
        host (``"?"`` for a rank never heard of)."""
        with self.lock:
            records = dict(self.records)
        # a rank that announced a failure ends the job: who vanished after that was ended
        # by the launcher; who vanished before was lost
        failed = [r.ended for r in records.values()
                  if r.status and r.ended is not None]
        first_failure = min(failed) if failed else None
        vanished = sorted((r for r in records.values()
                           if r.status is None and r.closed is not None),
                          key=lambda r: r.order if r.order is not None else 0)
        if first_failure is not None:
            vanished = [r for r in vanished if (r.order or 0) < first_failure]
        return vanished, _hostnames(records, self.size)

    def lost_host(self) -> list[RankRecord] | None:
        """The ranks of the host that vanished first, when all of them did (a host lost
        with every process on it): None while no host has vanished whole."""
        vanished, hostnames = self.vanished()
        if not vanished:
            return None
        first = [r for r in vanished if r.host == vanished[0].host]
        everyone = [r for r, h in enumerate(hostnames) if h == vanished[0].host]
        return first if sorted(r.rank for r in first) == everyone else None

    def summary(self, status: int, report_dir: str | None = None) -> str | None:
        """What to tell the user after the launcher ended with ``status`` (None: nothing
        beyond what the ranks reported)."""
        if status == 0:
            return None
        deadline = time.monotonic() + _SETTLE
        while not self.settled() and time.monotonic() < deadline:
            time.sleep(0.05)  # the last closes of a job the launcher just ended
        with self.lock:
            records = dict(self.records)
        if not records:
            return None
        vanished, hostnames = self.vanished()
        silent = sorted(r.rank for r in records.values()
                        if r.status is None and r.closed is None)
        missing = sorted(set(range(self.size)) - set(records))
        lines = []
        if self.signals and (not vanished or self.signals[0][1] <= (vanished[0].closed or 0)):
            try:
                name = signal.Signals(self.signals[0][0]).name
            except ValueError:
                name = f"signal {self.signals[0][0]}"
            lines.append(f"mpistrat run: this launcher passed {name} on to mpiexec, which "
                         f"ended the job's ranks; mpiexec exited with status {status}.")
            vanished = []  # (ended by the signal, not lost)
        if vanished:
            lines.append(lost_text(vanished, hostnames, status))
        if silent:
            files = [os.path.join(report_dir, f"rank-{r}.txt") for r in silent] \
                if report_dir else []
            lines.append(
                f"mpistrat run: {name_ranks(silent, hostnames)} never reported how "
                f"{'it' if len(silent) == 1 else 'they'} ended: this launcher cannot reach "
                f"{'it' if len(silent) == 1 else 'them'} (host down, or cut off by a "
                f"network partition), so {'its' if len(silent) == 1 else 'their'} own "
                f"reports cannot reach this terminal either"
                + (f"; they are written to {report_dir}" if report_dir else
                   "; give --report-dir DIR (on a shared file system) to keep them") + ".")
            lines += _read_reports(files, silent)
        if missing and (vanished or silent):
            lines.append(f"mpistrat run: rank(s) {missing} never reached this launcher's "
                         f"monitor; nothing is known of them.")
        return "\n".join(lines) if lines else None


def lost_text(vanished: Sequence[RankRecord], hostnames: Sequence[str],
              status: int | None) -> str:
    """The message on ranks that vanished (:meth:`JobMonitor.vanished`): who ended first
    without a report and who of its host followed, how soon, and what that can mean,
    after the launcher ended with ``status`` (None: not known, :mod:`.sidecar`).

    From outside, a host lost with every process on it and one rank killed or crashed
    look alike: hydra's proxy ends a dead rank's host-mates within a few ms. Only
    hydra's own lines tell them apart, so the message says what was seen."""
    first_host = vanished[0].host
    on_host = [r for r in vanished if r.host == first_host]
    lost = sorted(r.rank for r in on_host)
    after = sorted(r.rank for r in vanished if r.host != first_host)
    when = time.strftime("%H:%M:%S", time.localtime(vanished[0].closed or 0))
    whole = lost == [r for r, h in enumerate(hostnames) if h == first_host]
    head = on_host[0].rank
    # how close the others followed: a few ms for a host gone at once, and for a rank
    # whose host-mates hydra's proxy ended at once; tens of ms when the launcher did
    spread = (on_host[-1].closed or 0) - (on_host[0].closed or 0)
    if len(lost) == 1:
        text = (f"mpistrat run: the first rank to end without a report was "
                f"{name_ranks(lost, hostnames)}, at {when}")
    else:
        text = (f"mpistrat run: the first ranks to end without a report were "
                f"{'every rank of ' if whole else ''}{name_ranks(lost, hostnames)}: rank "
                f"{head} at {when}, the others within {spread * 1e3:.0f} ms")
    if after:
        text += f"; the launcher then ended {name_ranks(after, hostnames)}"
    if status is not None:
        text += f". mpiexec exited with status {status}"
    if whole and len(set(hostnames)) > 1:
        text += (". If mpiexec says 'assert (!closed) failed' above, the job lost that "
                 "host: it failed, or every process on it was killed; otherwise rank "
                 f"{head} was killed or crashed, and hydra ended the others")
    else:
        text += f". Rank {head} was killed or crashed, and the launcher ended the others"
    return text + ". Rerun the job to resume from its last complete checkpoint."


def listen(size: int) -> socket.socket:
    """A TCP socket listening on every address of this host, for ``size`` ranks."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("", 0))
    listener.listen(min(4096, max(16, size)))
    return listener


def address(listener: socket.socket) -> str:
    """How ranks reach ``listener`` (the value of ``MPISTRAT_RUN_MONITOR``):
    ``PORT HOST ADDRESS,...``, this host's name (ranks on it connect through the
    loopback) and its other addresses (for the other hosts)."""
    port = listener.getsockname()[1]
    addresses = ",".join(local_addresses()) or "-"
    return f"{port} {socket.gethostname()} {addresses}"


def _hostnames(records: Mapping[int, RankRecord], size: int) -> list[str]:
    return [records[r].host if r in records else "?" for r in range(size)]


def _read_reports(paths: Sequence[str], ranks: Sequence[int], wait: float = 3.0) -> list[str]:
    """The report files of ``ranks`` (waiting a little for ones still being written)."""
    deadline = time.monotonic() + wait
    while not all(os.path.exists(p) for p in paths) and time.monotonic() < deadline:
        time.sleep(0.1)
    lines = []
    for rank, path in zip(ranks, paths):
        try:
            with open(path) as file:
                text = file.read().rstrip("\n")
        except OSError:
            continue
        lines.append(f"mpistrat run: rank {rank}'s report ({path}):")
        lines += [f"  {line}" for line in text.split("\n")]
    return lines


class MonitorClient:
    """A rank's connection to the job monitor (see the module docstring)."""

    def __init__(self, sock: socket.socket, rank: int) -> None:
        self._sock = sock
        self.rank = rank
        self._lock = threading.Lock()

    @classmethod
    def connect(cls, env: Mapping[str, str] | None, rank: int, host: str) -> MonitorClient | None:
        """Connect to the monitor named in ``MPISTRAT_RUN_MONITOR`` and say hello; None
        without the variable or when no address answers (the job runs on, unmonitored)."""
        words = (os.environ if env is None else env).get(MONITOR_ENV, "").split()
        if len(words) != 3 or not words[0].isdigit():
            return None
        port, monitor_host, addresses = words
        # the loopback only on the monitor's own host: elsewhere it is another machine's
        candidates = ["127.0.0.1"] if socket.gethostname() == monitor_host else []
        candidates += [a for a in addresses.split(",") if a != "-"]
        for address in candidates:
            try:
                sock = socket.create_connection((address, int(port)),
                                                timeout=_CONNECT_TIMEOUT)
            except OSError:
                continue
            try:
                sock.sendall(f"hello {rank} {host.split()[0] if host else '?'} "
                             f"{os.getpid()}\n".encode())
            except OSError:
                sock.close()
                continue
            return cls(sock, rank)
        return None

    def end(self, status: int) -> None:
        """Announce this rank's exit status and close the connection."""
        with self._lock:
            if self._sock is None:
                return
            try:
                self._sock.settimeout(1.0)
                self._sock.sendall(f"end {int(status)}\n".encode())
            except OSError:
                pass
            finally:
                self._sock.close()
                self._sock = None  # type: ignore[assignment]
