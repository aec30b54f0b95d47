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

Nobody but the job's ranks can speak to the monitor (see ``docs/security.md``): it
listens on the loopback when the job runs on this host alone, else on the address this
host reaches the job's hosts from; on every connection it first sends a random challenge,
and every line a rank sends carries an HMAC of the challenge and the line under the
job's secret (:mod:`.auth`), so a line forged, or recorded on one connection and replayed
on another, is refused. Each rank is accepted once, only within ``range(size)``; lines are
at most :data:`MAX_LINE` bytes; a connection that has not said a valid hello within
:data:`HELLO_WITHIN` seconds is closed, and at most :data:`MAX_PENDING` such connections
are held at once (the oldest goes first). A bad line closes its connection with a note and
changes nothing else; nothing a client sends can stop the monitor's thread.
"""

from __future__ import annotations

import errno
import os
import re
import selectors
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import InitVar, dataclass, field

from . import auth
from .hosts import interface_address, local_addresses, name_ranks, route_sources
from .reports import read_report, report_path

__all__ = ["JobMonitor", "MonitorClient", "MONITOR_ENV", "RankRecord", "active",
           "LAUNCHER_GRACE", "address", "listen", "bind_address", "lost_text",
           "vanished_records", "MAX_LINE", "MAX_PENDING", "HELLO_WITHIN"]

MONITOR_ENV = "MPISTRAT_RUN_MONITOR"
_CONNECT_TIMEOUT = 1.0  # seconds per address a rank tries to reach the monitor
_CHALLENGE_WAIT = 10.0  # seconds a rank waits for the monitor's challenge (a busy start)
MAX_LINE = 512  # bytes of one line to the monitor (a hello with a 255-byte host name: ~360)
MAX_PENDING = 64  # connections held at once that have not said a valid hello yet
HELLO_WITHIN = 10.0  # seconds a connection has to say a valid hello
_PAUSE = 0.25  # seconds the monitor stops accepting when it has no file descriptor left
_GREETING = b"mpistrat-monitor 1 "
_HELLO = re.compile(rb"hello (\d{1,9}) ([!-~]{1,255}) (\d{1,10}) ([0-9a-f]{64})")
_END = re.compile(rb"end (-?\d{1,6}) ([0-9a-f]{64})")
_SETTLE = 1.0  # seconds the summary waits for the connections of ended ranks to close
_QUIET = 0.3  # ... or until none has closed for this long
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
    peer: str
    challenge: str
    opened: float = field(default_factory=time.monotonic)
    buffer: bytearray = field(default_factory=bytearray)
    rank: int | None = None
    ended: bool = False


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
        secret: the job's secret (default: a new one, see :mod:`.auth`).
        listener: a listening socket to accept the ranks on (default: a new one on
            ``bind``, see :func:`listen`).
        bind: the address to listen on when no ``listener`` is given (default: the
            loopback; ``""``: every address).
    """

    size: int
    timeout: float | None = None
    report_dir: str | None = None
    secret: bytes = field(default_factory=auth.new_secret, repr=False)
    records: dict[int, RankRecord] = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    # (signal, time.time()) of every signal passed on to the launcher (:meth:`forwarded`)
    signals: list[tuple[int, float]] = field(default_factory=list)
    # messages refused (forged, replayed, malformed, oversized): how many, the first's note
    refused: int = 0
    first_refusal: str | None = None
    # end a lost host's message with how to resume (False: the caller says what follows,
    # as mpistrat run --min-ranks does)
    rerun_hint: bool = True
    listener: InitVar[socket.socket | None] = None
    bind: InitVar[str] = "127.0.0.1"

    def __post_init__(self, listener: socket.socket | None, bind: str) -> None:
        self._listener = listener if listener is not None else listen(self.size, bind)
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._pending: dict[socket.socket, _Connection] = {}  # (insertion: oldest first)
        self._paused_until: float | None = None  # accepting stopped (no descriptors)
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
        self._saved = {name: os.environ.get(name) for name in self.env()}
        os.environ.update(self.env())
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        for name, value in self._saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self.close()

    def finish(self, status: int) -> int:
        """Print :meth:`summary` of a launcher that ended with ``status``; return it."""
        text = self.summary(status, self.report_dir)
        if self.refused:
            text = "\n".join(filter(None, [text, (
                f"mpistrat run: the job monitor refused {self.refused} message(s) that were "
                f"not this job's ranks' (the first: {self.first_refusal}); they changed "
                f"nothing. Something else connects to its port.")]))
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
        """``MPISTRAT_RUN_MONITOR=PORT HOST ADDRESS,...`` (see :func:`address`) and the
        job's secret (``MPISTRAT_JOB_SECRET``): the ranks' environment, never a command
        line."""
        return {MONITOR_ENV: address(self._listener), auth.SECRET_ENV: auth.encode(self.secret)}

    def close(self) -> None:
        """Stop listening (after the launcher ended); keeps the records."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(2.0)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self._listener.close()  # (not in the map while accepting is paused)
        self._selector.close()

    def _loop(self) -> None:
        while not self._stopped.is_set():
            # epoll returns ready connections in the order they became ready: the order
            # of closes below is the order in which the kernel saw them
            for key, _ in self._selector.select(timeout=0.2):
                try:
                    if key.data is None:
                        self._accept()
                    else:
                        self._read(key.data)
                except Exception as exc:  # noqa: BLE001 - no client can stop the monitor
                    if key.data is not None:
                        self._refuse(key.data, f"{type(exc).__name__} while reading it")
            self._sweep()

    def _note(self, connection: _Connection, why: str) -> None:
        """Count a message of ``connection``'s refused for ``why``."""
        with self.lock:
            self.refused += 1
            if self.first_refusal is None:
                self.first_refusal = f"from {connection.peer}: {why}"

    def _refuse(self, connection: _Connection, why: str) -> None:
        """Close ``connection`` for ``why`` (a note; nothing else changes)."""
        self._note(connection, why)
        self._drop(connection)

    def _drop(self, connection: _Connection) -> None:
        self._pending.pop(connection.sock, None)
        try:
            self._selector.unregister(connection.sock)
        except (KeyError, ValueError):
            pass
        connection.sock.close()

    def _sweep(self) -> None:
        """Close connections that said no valid hello in time; accept again after a pause."""
        now = time.monotonic()
        for connection in [c for c in self._pending.values()
                           if now - c.opened > HELLO_WITHIN]:
            self._refuse(connection, f"no valid hello within {HELLO_WITHIN:g} s")
        if self._paused_until is not None and now >= self._paused_until:
            self._paused_until = None
            self._selector.register(self._listener, selectors.EVENT_READ, None)

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # no descriptor for it: make room, or stop accepting a moment (the
                    # listener would stay readable, and this loop spin)
                    if self._pending:
                        self._refuse(next(iter(self._pending.values())),
                                     "closed to make room (no file descriptors left)")
                    else:
                        self._selector.unregister(self._listener)
                        self._paused_until = time.monotonic() + _PAUSE
                return
            if len(self._pending) >= MAX_PENDING:
                self._refuse(next(iter(self._pending.values())),
                             f"closed for a newer connection ({MAX_PENDING} without a hello)")
            challenge = os.urandom(16).hex()
            connection = _Connection(sock, auth.printable(f"{peer[0]}:{peer[1]}"), challenge)
            try:
                sock.setblocking(False)
                sock.send(_GREETING + challenge.encode() + b"\n")
            except OSError:
                sock.close()
                continue
            self._pending[sock] = connection
            self._selector.register(sock, selectors.EVENT_READ, connection)

    def _read(self, connection: _Connection) -> None:
        try:
            data = connection.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data:
            start = len(connection.buffer)
            connection.buffer += data
            # (only the new bytes are searched: a long line costs its length, once)
            while (end := connection.buffer.find(b"\n", start)) >= 0:
                line = bytes(connection.buffer[:end])
                del connection.buffer[:end + 1]
                start = 0
                if not self._line(connection, line):
                    return  # (refused: closed)
            if len(connection.buffer) > MAX_LINE:
                self._refuse(connection, f"a line longer than {MAX_LINE} bytes")
            return
        self._drop(connection)
        with self.lock:
            record = self.records.get(connection.rank) if connection.rank is not None else None
            if record is not None and record.closed is None:
                record.closed = time.time()
                record.order = self._events
                self._events += 1

    def _line(self, connection: _Connection, line: bytes) -> bool:
        """Act on one line; False when it was refused (and the connection closed)."""
        if len(line) > MAX_LINE:
            self._refuse(connection, f"a line longer than {MAX_LINE} bytes")
            return False
        if connection.rank is None:
            hello = _HELLO.fullmatch(line)
            if hello is None:
                self._refuse(connection, "not a hello of mpistrat's")
                return False
            rank, host, pid, mac = (g.decode("ascii") for g in hello.groups())
            if not auth.verify(self.secret, bytes.fromhex(mac), "hello", connection.challenge,
                               rank, host, pid):
                self._refuse(connection, "a hello without this job's authentication")
                return False
            with self.lock:
                if int(rank) >= self.size or int(rank) in self.records:
                    why = (f"rank {int(rank)} is not one of the job's {self.size}"
                           if int(rank) >= self.size else f"rank {int(rank)} said hello before")
                else:
                    why = None
                    connection.rank = int(rank)
                    self.records[connection.rank] = RankRecord(
                        connection.rank, auth.printable(host, 64), int(pid))
            if why is not None:
                self._refuse(connection, why)
                return False
            self._pending.pop(connection.sock, None)
            return True
        end = _END.fullmatch(line)
        if end is None or connection.ended or not auth.verify(
                self.secret, bytes.fromhex(end.group(2).decode()), "end",
                connection.challenge, end.group(1).decode()):
            # (on a rank's own connection: only that rank could have sent it)
            self._note(connection, f"a line after rank {connection.rank}'s hello")
            return True
        with self.lock:
            connection.ended = True
            record = self.records[connection.rank]
            record.status, record.ended = int(end.group(1)), self._events
            self._events += 1
        return True

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
        return vanished_records(records), _hostnames(records, self.size)

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
        # the last closes of a job the launcher just ended come in a burst; ranks cut off
        # by a partition never close: stop waiting once the burst is over
        deadline = time.monotonic() + _SETTLE
        seen, quiet_since = self._events, time.monotonic()
        while not self.settled() and time.monotonic() < deadline:
            time.sleep(0.05)
            if self._events != seen:
                seen, quiet_since = self._events, time.monotonic()
            elif time.monotonic() - quiet_since >= _QUIET:
                break
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
            lines.append(lost_text(vanished, hostnames, status, rerun=self.rerun_hint))
        if silent:
            files = [report_path(report_dir, r) for r in silent] if report_dir else []
            lines.append(
                f"mpistrat run: {name_ranks(silent, hostnames)} never reported how "
                f"{'it' if len(silent) == 1 else 'they'} ended: this launcher cannot reach "
                f"{'it' if len(silent) == 1 else 'them'} (host down, or cut off by a "
                f"network partition), so {'its' if len(silent) == 1 else 'their'} own "
                f"reports cannot reach this terminal either"
                + (f"; they are written to {report_dir}" if report_dir else
                   "; give --report-dir DIR (on a shared file system) to keep them") + ".")
            lines += _read_reports(files, silent, self.secret)
        if missing and (vanished or silent):
            lines.append(f"mpistrat run: rank(s) {missing} never reached this launcher's "
                         f"monitor; nothing is known of them.")
        return "\n".join(lines) if lines else None


def vanished_records(records: Mapping[int, RankRecord]) -> list[RankRecord]:
    """The ranks of ``records`` whose process died without announcing its end, before any
    rank announced a failure, in the order their connections closed
    (:meth:`JobMonitor.vanished`; ``mpistrat run --min-ranks`` decides from it too)."""
    # a rank that announced a failure ends the job: who vanished after that was ended
    # by the launcher; who vanished before was lost
    failed = [r.ended for r in records.values() if r.status and r.ended is not None]
    first_failure = min(failed) if failed else None
    vanished = sorted((r for r in records.values()
                       if r.status is None and r.closed is not None),
                      key=lambda r: r.order if r.order is not None else 0)
    if first_failure is not None:
        vanished = [r for r in vanished if (r.order or 0) < first_failure]
    return vanished


def lost_text(vanished: Sequence[RankRecord], hostnames: Sequence[str],
              status: int | None, rerun: bool = True) -> str:
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
    if not rerun:  # (mpistrat run --min-ranks says next what it does)
        return text + "."
    return text + ". Rerun the job to resume from its last complete checkpoint."


def listen(size: int, bind: str = "127.0.0.1") -> socket.socket:
    """A TCP socket listening on ``bind`` (``""``: every address of this host), for
    ``size`` ranks."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((bind, 0))
    listener.listen(min(4096, max(128, 2 * size)))  # (a flood fills a short queue)
    return listener


def bind_address(hosts: Iterable[str] | None, interface: str | None = None) -> str:
    """Where the monitor of a job on ``hosts`` listens: the loopback when every host is
    this one; else this host's address on the cluster's network: that of ``interface``
    when given (hydra's ``HYDRA_IFACE``, the interface its proxies call back on), or the
    one address this host reaches all the others from; ``""`` (every address, still
    authenticated) when that cannot be told (hosts not known, not resolvable here, or
    reached from several addresses)."""
    if hosts is None:
        return interface_address(interface) or "" if interface else ""
    here = {socket.gethostname(), socket.getfqdn(), "localhost"}
    others = [h for h in hosts if h not in here]
    if not others:
        return "127.0.0.1"
    if interface and (found := interface_address(interface)):
        return found
    ours = set(local_addresses()) | {"127.0.0.1"}
    remote: list[str] = []
    for host in others:
        try:
            found_all = {str(info[4][0])
                         for info in socket.getaddrinfo(host, None, socket.AF_INET)}
        except OSError:
            return ""  # a host this one cannot resolve (hydra's launcher may)
        # (a name whose addresses are all this host's is another name of this host)
        remote += [a for a in found_all if a not in ours and not a.startswith("127.")]
    if not remote:
        return "127.0.0.1"
    sources = route_sources(remote)
    return sources[0] if len(sources) == 1 else ""


def address(listener: socket.socket) -> str:
    """How ranks reach ``listener`` (the value of ``MPISTRAT_RUN_MONITOR``):
    ``PORT HOST ADDRESS,...``: this host's name and the addresses it listens on (the
    loopback only for ranks on this host)."""
    bound, port = listener.getsockname()[:2]
    addresses = ["127.0.0.1", *local_addresses()] if bound == "0.0.0.0" else [bound]
    return f"{port} {socket.gethostname()} {','.join(addresses)}"


def _hostnames(records: Mapping[int, RankRecord], size: int) -> list[str]:
    return [records[r].host if r in records else "?" for r in range(size)]


def _read_reports(paths: Sequence[str], ranks: Sequence[int], secret: bytes,
                  wait: float = 3.0) -> list[str]:
    """The report files of ``ranks`` that this job wrote (waiting a little for ones still
    being written); files of earlier jobs, or of anyone else, are named and ignored."""
    deadline = time.monotonic() + wait
    while not all(os.path.exists(p) for p in paths) and time.monotonic() < deadline:
        time.sleep(0.1)
    lines = []
    for rank, path in zip(ranks, paths):
        text, why = read_report(path, secret, rank)
        if why is not None:
            lines.append(f"mpistrat run: {auth.printable(path)} is ignored: {why}.")
        if text is None:
            continue
        lines.append(f"mpistrat run: rank {rank}'s report ({auth.printable(path)}):")
        lines += [f"  {line}" for line in text.split("\n")]
    return lines


class MonitorClient:
    """A rank's connection to the job monitor (see the module docstring)."""

    def __init__(self, sock: socket.socket, rank: int, secret: bytes, challenge: str) -> None:
        self._sock = sock
        self.rank = rank
        self._secret = secret
        self._challenge = challenge
        self._lock = threading.Lock()

    @classmethod
    def connect(cls, env: Mapping[str, str] | None, rank: int, host: str,
                secret: bytes | None = None) -> MonitorClient | None:
        """Connect to the monitor named in ``MPISTRAT_RUN_MONITOR``, answer its
        challenge and say hello, authenticated with ``secret`` (default: the job's, from
        ``env``, see :func:`.auth.take_secret`). None without the variable or a secret,
        or when no address answers as the monitor (the job runs on, unmonitored)."""
        source = os.environ if env is None else env
        if secret is None:
            secret = auth.take_secret(env)
        words = source.get(MONITOR_ENV, "").split()
        if secret is None or len(words) != 3 or not re.fullmatch(r"\d{1,5}", words[0]):
            return None
        port, monitor_host, addresses = words
        # the loopback only on the monitor's own host: elsewhere it is another machine's
        here = socket.gethostname() == monitor_host
        candidates = [a for a in addresses.split(",")
                      if a not in ("", "-") and (here or not a.startswith("127."))]
        name = host.split()[0] if host and host.split() else "?"
        name = "".join(c if "!" <= c <= "~" else "?" for c in name[:255])
        for address in candidates:
            try:
                sock = socket.create_connection((address, int(port)),
                                                timeout=_CONNECT_TIMEOUT)
            except (OSError, ValueError):
                continue
            try:
                challenge = _read_challenge(sock)
                if challenge is None:
                    sock.close()
                    continue
                pid = os.getpid()
                mac = auth.tag(secret, "hello", challenge, rank, name, pid).hex()
                sock.sendall(f"hello {rank} {name} {pid} {mac}\n".encode())
            except OSError:
                sock.close()
                continue
            return cls(sock, rank, secret, challenge)
        return None

    def end(self, status: int) -> None:
        """Announce this rank's exit status and close the connection."""
        with self._lock:
            if self._sock is None:
                return
            try:
                self._sock.settimeout(1.0)
                mac = auth.tag(self._secret, "end", self._challenge, int(status)).hex()
                self._sock.sendall(f"end {int(status)} {mac}\n".encode())
            except OSError:
                pass
            finally:
                self._sock.close()
                self._sock = None  # type: ignore[assignment]


def _read_challenge(sock: socket.socket) -> str | None:
    """The monitor's greeting line: its challenge, or None when what answers is not it."""
    sock.settimeout(_CHALLENGE_WAIT)
    data = b""
    while not data.endswith(b"\n") and len(data) < 64:
        chunk = sock.recv(64 - len(data))
        if not chunk:
            return None
        data += chunk
    match = re.fullmatch(re.escape(_GREETING) + rb"([0-9a-f]{32})\n", data)
    return match.group(1).decode() if match else None
