"""Starting a job from inside mpistrat, for ``mpistrat run -n N`` and ``mpistrat bench
--np N`` alike: the same nesting rule, the same ``mpiexec``, the same signal forwarding and
the same exit status.

* **Nesting**: under a launcher that started several ranks, each rank would start a job
  of its own; :func:`launch_argv` refuses (on every rank, with the same message). A Slurm
  batch step is one process, so starting ``mpiexec`` there is allowed.
* **Signals**: Ctrl-C, termination and Slurm's warning signals (``sbatch --signal``) reach
  the job (:data:`FORWARDED_SIGNALS`); the launcher's exit status is passed through (128 +
  N when a signal N ended it).
* **A watched job** (``mpistrat run -n``'s :class:`~mpistrat.runner.monitor.JobMonitor`):
  a launcher still running ``bound`` seconds after a rank failed or vanished waits for a
  host it lost, and is ended.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from ..errors import RunSetupError
from .env import detect
from .mpiexec import find_launcher

__all__ = ["FORWARDED_SIGNALS", "Watch", "launch_argv", "self_launch"]

FORWARDED_SIGNALS = tuple(getattr(signal, name) for name in
                          ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2")
                          if hasattr(signal, name))


class Watch(Protocol):
    """What :func:`self_launch` asks of a job watcher."""

    @property
    def bound(self) -> float:
        """Seconds the launcher may run on after trouble."""

    def troubled(self) -> bool:
        """True once a rank failed or vanished."""

    def forwarded(self, signum: int) -> None:
        """Signal ``signum`` was passed on to the launcher (it ends the ranks itself)."""


def launch_argv(what: str, option: str, nprocs: int, command: Sequence[str], *,
                mpiexec: str | None = None, env: Mapping[str, str] | None = None,
                python: str = sys.executable,
                rank_env: Mapping[str, str] | None = None,
                inherit: Sequence[str] = ()) -> list[str]:
    """The ``mpiexec`` command line that runs ``command`` on ``nprocs`` ranks, with the
    ``mpiexec`` that matches mpi4py's MPI library (``what``/``option``, e.g. ``"mpistrat
    run"``/``"-n"``, name the caller in messages; ``rank_env``: variables every rank gets;
    ``inherit``: variables of this environment every rank gets, named but not valued on
    the command line, see :meth:`~mpistrat.launch.mpiexec.Launcher.argv`).

    Raises:
        RunSetupError: this process already runs under an MPI launcher with several
            ranks (each would start its own job).
        MpistratError: no ``mpiexec`` was found (the message says how to get one).
    """
    launched = detect(env)
    if launched.launcher and not launched.launcher.startswith("Slurm") and \
            (launched.size or 0) > 1:
        raise RunSetupError(
            f"{what} {option} {nprocs}: already running under {launched.launcher} with "
            f"{launched.size} ranks; leave out {option} (the launcher started the ranks)")
    return find_launcher(mpiexec, env, python).argv(nprocs, list(command), env=rank_env,
                                                    inherit=inherit)


def self_launch(argv: list[str], watch: Watch | None = None) -> int:
    """Run ``argv`` (an mpiexec command line) and return its exit status (128 + N when
    a signal N ended it), forwarding :data:`FORWARDED_SIGNALS` to it meanwhile; with a
    ``watch``, end a launcher that still runs ``watch.bound`` seconds after trouble
    (SIGTERM, then SIGKILL 5 s later), saying why."""
    process = subprocess.Popen(argv)

    def forward(signum: int, frame: Any) -> None:
        process.send_signal(signum)
        if watch is not None:
            watch.forwarded(signum)

    saved = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    try:
        status = process.wait() if watch is None else _wait(process, watch)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    return 128 - status if status < 0 else status


def _wait(process: subprocess.Popen, watch: Watch) -> int:
    trouble_since = None
    while True:
        try:
            return process.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
        if trouble_since is None:
            if watch.troubled():
                trouble_since = time.monotonic()
            continue
        if time.monotonic() - trouble_since < watch.bound:
            continue
        sys.stderr.write(
            f"mpistrat run: {_name(process)} still runs {watch.bound:g} s after a rank failed "
            f"or vanished (it waits for a host it cannot reach); ending it\n")
        sys.stderr.flush()
        process.terminate()
        try:
            return process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            process.kill()
            return process.wait()


def _name(process: subprocess.Popen) -> str:
    args = process.args
    first = args[0] if isinstance(args, (list, tuple)) and args else str(args)
    return str(first).rsplit("/", 1)[-1]
