"""Hosts an elastic job lost, probed in the background, so that a host that answers again
is taken back at the job's next restart (``mpistrat run --min-ranks`` over a hydra host
file; :mod:`mpistrat.runner.elastic`).

A host lost in a launch is left out of the relaunch that follows (it just failed). From
then on a thread asks hydra to start ``true`` on it every :data:`PROBE_EVERY_S` seconds
(``MPISTRAT_ELASTIC_PROBE_EVERY``), each try bounded by :data:`PROBE_TIMEOUT_S`; at the
next restart, whatever its cause, the hosts whose last try succeeded are offered to the
relaunch again, as free slots of the host file are (never beyond the first launch's
size). A host that fails again is left out again, and probed again. The probing costs a
restart no time: the relaunch reads the last answers, it does not wait for new ones.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Callable, Iterable, Sequence

__all__ = ["HostProber", "PROBE_EVERY_S", "PROBE_TIMEOUT_S", "PROBE_EVERY_ENV",
           "probe_every", "hydra_probe"]

PROBE_EVERY_S = 15.0
PROBE_TIMEOUT_S = 10.0
PROBE_EVERY_ENV = "MPISTRAT_ELASTIC_PROBE_EVERY"


def probe_every(env: dict[str, str] | None = None) -> float:
    """Seconds between two probes of a lost host: ``MPISTRAT_ELASTIC_PROBE_EVERY`` (a
    number > 0), else :data:`PROBE_EVERY_S`.

    Raises:
        ValueError: the variable is set to something else (naming it).
    """
    text = (os.environ if env is None else env).get(PROBE_EVERY_ENV, "").strip()
    if not text:
        return PROBE_EVERY_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{PROBE_EVERY_ENV}={text!r}: expected the seconds between two "
                         f"probes of a lost host, a number > 0 (default {PROBE_EVERY_S:g})")
    return seconds


def hydra_probe(mpiexec: str) -> Callable[[str], list[str]]:
    """The command that asks hydra's ``mpiexec`` to start ``true`` on one host (``-hosts``
    overrides the host file)."""
    return lambda host: [mpiexec, "-hosts", host, "-n", "1", "true"]


class HostProber:
    """Probes the hosts it watches (:meth:`watch`), one after the other, every ``every``
    seconds, in a daemon thread; :meth:`answering` tells which answered their last probe.

    Args:
        command: the argv that probes a host (exit status 0: it answers).
        every: seconds between two rounds of probes.
        timeout: seconds a probe may take; past it, its process group is killed and the
            host does not answer.
    """

    def __init__(self, command: Callable[[str], Sequence[str]], every: float = PROBE_EVERY_S,
                 timeout: float = PROBE_TIMEOUT_S) -> None:
        self._command = command
        self.every = every
        self.timeout = timeout
        self._answers: dict[str, bool] = {}  # watched host -> its last probe answered
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._running: subprocess.Popen | None = None  # the probe under way

    def watch(self, hosts: Iterable[str]) -> None:
        """Probe ``hosts`` from the next round on (none answers before its first probe)."""
        with self._lock:
            for host in hosts:
                self._answers[host] = False
            if self._answers and self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="mpistrat-host-probe")
                self._thread.start()

    def forget(self, hosts: Iterable[str]) -> None:
        """Stop probing ``hosts`` (taken back, or lost for good)."""
        with self._lock:
            for host in hosts:
                self._answers.pop(host, None)

    def answering(self) -> list[str]:
        """The watched hosts whose last probe succeeded, in the order they were watched."""
        with self._lock:
            return [host for host, answered in self._answers.items() if answered]

    def close(self) -> None:
        """Stop the probing; a probe under way is killed (the job's end never waits for
        a host that does not answer)."""
        self._stop.set()
        with self._lock:
            running = self._running
        if running is not None:
            _kill(running)
        if self._thread is not None:
            self._thread.join(1.0)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            with self._lock:
                hosts = list(self._answers)
            for host in hosts:
                if self._stop.is_set():
                    return
                answered = self.probe(host)
                with self._lock:
                    if host in self._answers:
                        self._answers[host] = answered

    def probe(self, host: str) -> bool:
        """Whether ``host`` answers now (the command's exit status 0 within the timeout)."""
        try:
            process = subprocess.Popen(list(self._command(host)), stdin=subprocess.DEVNULL,
                                       stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL, start_new_session=True)
        except OSError:
            return False
        with self._lock:
            self._running = process
        try:
            return process.wait(self.timeout) == 0 and not self._stop.is_set()
        except subprocess.TimeoutExpired:
            _kill(process)
            return False
        finally:
            with self._lock:
                self._running = None


def _kill(process: subprocess.Popen) -> None:
    """End a probe: its process group (the launcher and whatever it started, e.g. ssh to a
    host that is gone), then reap it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()
