"""The job monitor under a plain ``mpiexec -n N mpistrat run`` (MPICH's hydra): how the
ranks of a lost host get named when no ``mpistrat run -n`` watches the job from outside.

When hydra loses a host's proxy (every process of the host killed, or the host gone) it
fails with ``assert (!closed) failed`` and ends every other rank with ``SIGKILL`` within a
fraction of a second, so no rank lives to say which host was lost, and hydra does not
either. ``mpistrat run -n`` names it from its own process (:mod:`.monitor`). Under a plain
``mpiexec`` the ranks start that process themselves, when the job spans several hosts
(:func:`start`, collective):

* the lowest rank that runs on the launcher's host — its parent is a ``hydra_pmi_proxy``
  and ``mpiexec`` is among its ancestors (:func:`hydra_launcher`) — starts this module
  as a process in a session of its own, out of reach of hydra's kill, with the listening
  socket of a :class:`~.monitor.JobMonitor`; every rank connects to it and says how it
  ends, as under ``mpistrat run -n``;
* the rank opens ``mpiexec``'s standard error (``/proc/PID/fd/2``: the terminal, pipe
  or file the user reads) and a pidfd of ``mpiexec`` for it. Once ``mpiexec`` has ended
  (on a file its own writes, at its own offset, would otherwise overwrite the line), it
  writes there which host's ranks all ended first without a word (:func:`verdict`);
* it ends with the job: once every rank has ended or vanished, or once ``mpiexec`` ended.

The ranks authenticate to it as to ``mpistrat run -n``'s monitor, with the job's secret
(given to the monitor process in its environment, never on its command line), and it
listens on the address its host reaches the job's other hosts from.

A job on one host, or under another launcher (``srun``, Open MPI), starts nothing.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, Any

from . import auth
from .hosts import local_addresses, route_sources
from .monitor import MONITOR_ENV, JobMonitor, MonitorClient, address, listen, lost_text

__all__ = ["hydra_launcher", "start", "main"]

_PROXY = "hydra_pmi_proxy"
_LAUNCHERS = ("mpiexec", "mpiexec.hydra", "mpirun")
_POLL = 0.05  # seconds between looks at the monitor's records
_SETTLE_CLOSES = 1.0  # seconds after mpiexec ended for a lost host's closes to come
_AT_ONCE = 0.02  # seconds within which a lost host's ranks vanish (measured: 0-6 ms)
_LAST_WORD = 10.0  # seconds the monitor waits for mpiexec to end after the ranks did
_CHILD: list[subprocess.Popen] = []  # (reaped when the next job starts one)
# The monitor process imports this module, .monitor and .hosts (the standard library only)
# without running mpistrat's and mpistrat.runner's __init__ (NumPy and the rest, 0.4 s
# on an idle core, seconds on the busy cores of a starting job): until it listens, a host
# lost goes unnamed.
_RUNNER = os.path.dirname(os.path.abspath(__file__))
_BOOT = f"""import sys, types
for name, path in (("mpistrat", {os.path.dirname(_RUNNER)!r}), ("mpistrat.runner", {_RUNNER!r})):
    sys.modules[name] = types.ModuleType(name)
    sys.modules[name].__path__ = [path]
from mpistrat.runner.sidecar import main
sys.exit(main(sys.argv[1:]))
"""


def _stat(pid: int, proc: str) -> tuple[str, int] | None:
    """The command name and parent of process ``pid``, from ``/proc``."""
    try:
        with open(os.path.join(proc, str(pid), "stat")) as file:
            text = file.read()
    except OSError:
        return None
    # "PID (COMM) STATE PPID ...": COMM may hold spaces and parentheses
    name = text[text.index("(") + 1:text.rindex(")")]
    fields = text[text.rindex(")") + 2:].split()
    return name, int(fields[1])


def hydra_launcher(pid: int | None = None, proc: str = "/proc") -> int | None:
    """The process id of the hydra ``mpiexec`` that started this process (``pid``), if
    it runs on this host: the parent is hydra's proxy, and ``mpiexec`` is an ancestor.
    None elsewhere, and under any other launcher."""
    here = _stat(os.getpid() if pid is None else pid, proc)
    if here is None:
        return None
    parent = _stat(here[1], proc)
    if parent is None or parent[0] != _PROXY:
        return None
    ancestor, seen = parent[1], 0
    while ancestor > 1 and seen < 64:
        found = _stat(ancestor, proc)
        if found is None:
            return None
        if found[0] in _LAUNCHERS:
            return ancestor
        ancestor, seen = found[1], seen + 1
    return None


def start(comm: Any, rank: int, host: str, secret: bytes) -> MonitorClient | None:
    """Collective over ``comm`` (every rank of the job): start the job monitor beside a
    plain hydra job that spans several hosts, and connect this rank to it (see the module
    docstring), authenticated with ``secret`` (the job's, the same on every rank). None
    where nothing was started."""
    launcher = hydra_launcher()
    seen = comm.allgather((host, launcher is not None))
    hosts = {h for h, _ in seen}
    starter = next((r for r, (_, here) in enumerate(seen) if here), None)
    if len(hosts) < 2 or starter is None:
        return None
    # (the other hosts' addresses: the monitor listens where they reach this host)
    addresses = comm.gather(local_addresses() if host != seen[starter][0] else [],
                            root=starter)
    value = None
    if rank == starter:
        remote = [a for found in addresses for a in found]
        sources = route_sources(remote)
        value = _spawn(launcher, comm.Get_size(),  # type: ignore[arg-type]
                       secret, sources[0] if len(sources) == 1 else "")
    value = comm.bcast(value, root=starter)
    if not value:
        return None
    return MonitorClient.connect({MONITOR_ENV: value}, rank, host, secret)


def _spawn(launcher: int, size: int, secret: bytes, bind: str) -> str | None:
    """Start the monitor process for ``launcher``'s job of ``size`` ranks, listening on
    ``bind``; its address. The launcher's standard error and a handle on its end are
    opened here, while it certainly runs: the monitor process takes a moment to start."""
    for child in list(_CHILD):
        if child.poll() is not None:
            _CHILD.remove(child)
    opened: list[int] = []
    listener = None
    try:
        opened.append(os.open(f"/proc/{launcher}/fd/2", os.O_WRONLY | os.O_APPEND))
        try:
            opened.append(os.pidfd_open(launcher))
        except (AttributeError, OSError):
            opened.append(-1)  # (polled instead)
        listener = listen(size, bind)
        fds = (listener.fileno(), *(fd for fd in opened if fd >= 0))
        _CHILD.append(subprocess.Popen(
            [sys.executable, "-c", _BOOT, "--launcher", str(launcher), "--size", str(size),
             "--listener", str(listener.fileno()), "--out", str(opened[0]), "--pidfd",
             str(opened[1])],
            pass_fds=fds, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, auth.SECRET_ENV: auth.encode(secret)}))
        return address(listener)
    except OSError:
        return None  # (no /proc, or another user's launcher: nowhere to report)
    finally:
        for fd in opened:
            if fd >= 0:
                os.close(fd)
        if listener is not None:
            listener.close()  # (the child has its own)


def _ended(pid: int, pidfd: int) -> threading.Event:
    """An event set once the launcher process ``pid`` has ended (through its pidfd when
    there is one, else by polling)."""
    ended = threading.Event()

    def wait() -> None:
        if pidfd >= 0:
            select.select([pidfd], [], [])  # readable once the process has ended
        else:
            while _alive(pid):
                time.sleep(_POLL)
        ended.set()

    threading.Thread(target=wait, name="mpistrat-launcher-wait", daemon=True).start()
    return ended


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (not ended, not a zombie awaiting its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def verdict(monitor: JobMonitor) -> str | None:
    """What to report once the launcher has ended: the host of the first rank
    that vanished without a word, when every rank of that host vanished, either at once
    (within :data:`_AT_ONCE` of the first) or before any rank of another host. That is
    how hydra loses a host: its ranks die together, and the other hosts' ranks only
    once hydra has reacted (a few ms later). It is also how one rank killed or crashed
    looks when hydra's proxy ends its host-mates at once, and how ranks that a signal
    forwarded by the launcher ended may look: the message says only what was seen
    (:func:`.monitor.lost_text`). A job whose ranks announced a failure first is not
    reported."""
    lost = monitor.lost_host()
    if lost is None:
        return None
    vanished, hostnames = monitor.vanished()
    first, last = lost[0].closed or 0, max(r.closed or 0 for r in lost)
    with monitor.lock:
        others = [r.closed for r in monitor.records.values() if r.host != lost[0].host]
    if not others:
        return None
    before_others = all(closed is None or closed > last for closed in others)
    if last - first > _AT_ONCE and not before_others:
        return None
    return lost_text(vanished, hostnames, None)


def watch(monitor: JobMonitor, launcher_ended: threading.Event, out: IO[str]) -> str | None:
    """Watch ``monitor`` until the job is over; once the launcher has ended, write a lost
    host to ``out`` (the launcher's standard error). Returns what it wrote."""
    quiet_since = None  # when every rank had ended or vanished, the launcher still running
    while not launcher_ended.wait(_POLL):
        if monitor.settled():
            if not monitor.troubled():
                return None  # every rank ended normally
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since > _LAST_WORD:
                return None  # the launcher outlives its ranks: not hydra's way with a host
    deadline = time.monotonic() + _SETTLE_CLOSES
    while True:
        over = monitor.settled() or time.monotonic() > deadline
        text = verdict(monitor)
        if text is not None or over:
            break
        time.sleep(_POLL / 5)  # the lost host's last closes, still to come or to be read
    if text is not None:
        try:
            out.write(text + "\n")
            out.flush()
        except OSError:
            pass
    return text


def main(argv: Sequence[str] | None = None) -> int:
    import argparse  # (only in the monitor's own process)

    parser = argparse.ArgumentParser(prog=f"python -m {__name__}",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--launcher", type=int, required=True, help="mpiexec's process id")
    parser.add_argument("--size", type=int, required=True, help="the job's number of ranks")
    parser.add_argument("--listener", type=int, required=True, help="the listening socket")
    parser.add_argument("--out", type=int, required=True, help="mpiexec's standard error")
    parser.add_argument("--pidfd", type=int, default=-1, help="a pidfd of mpiexec")
    args = parser.parse_args(argv)
    listener = socket.socket(fileno=args.listener)
    secret = auth.take_secret()
    if secret is None:
        return 2  # (started by hand, not by a rank: nothing to authenticate the ranks with)
    with open(args.out, "a") as out:
        monitor = JobMonitor(args.size, secret=secret, listener=listener).start()
        try:
            watch(monitor, _ended(args.launcher, args.pidfd), out)
        finally:
            monitor.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
