"""``mpistrat run -n N``: start the job with the ``mpiexec`` that matches mpi4py's MPI
library, forward signals to it, and pass its exit status through — watching, from
outside the job, how each rank ends (:mod:`~mpistrat.runner.monitor`), so that a lost host
is named even when the launcher ends every other rank at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import Any

from ..launch.env import detect
from ..launch.mpiexec import find_launcher
from .options import RunOptions

__all__ = ["launch_command", "self_launch", "FORWARDED_SIGNALS"]

# Ctrl-C, termination and Slurm's warning signals (sbatch --signal) reach the job too.
FORWARDED_SIGNALS = tuple(getattr(signal, name) for name in
                          ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2")
                          if hasattr(signal, name))


def launch_command(options: RunOptions, nprocs: int, mpiexec: str | None = None,
                   env: Mapping[str, str] | None = None,
                   python: str = sys.executable,
                   rank_env: Mapping[str, str] | None = None) -> list[str]:
    """The ``mpiexec`` command line that runs ``options`` on ``nprocs`` ranks
    (``rank_env``: variables every rank gets, passed with the launcher's flags; by
    default the job monitor's address when one is active, see
    :mod:`~mpistrat.runner.monitor`).

    Raises:
        RunSetupError: this process already runs under an MPI launcher with several
            ranks (each would start its own job).
        MpistratError: no ``mpiexec`` was found (the message says how to get one).
    """
    from .rank import RunSetupError

    launched = detect(env)
    if launched.launcher and not launched.launcher.startswith("Slurm") and \
            (launched.size or 0) > 1:
        raise RunSetupError(
            f"mpistrat run -n {nprocs}: already running under {launched.launcher} with "
            f"{launched.size} ranks; leave out -n (the launcher started the ranks)")
    command = [python, "-m", "mpistrat", "run", *options.command_line()]
    if rank_env is None:
        from .monitor import MONITOR_ENV

        value = (os.environ if env is None else env).get(MONITOR_ENV)
        rank_env = {MONITOR_ENV: value} if value else None
    return find_launcher(mpiexec, env, python).argv(nprocs, command, env=rank_env)


def self_launch(argv: list[str]) -> int:
    """Run ``argv`` (an mpiexec command line) and return its exit status (128 + N when
    a signal N ended it), forwarding :data:`FORWARDED_SIGNALS` to it meanwhile.

    While a :class:`~mpistrat.runner.monitor.JobMonitor` is active (``mpistrat run -n``),
    a launcher still running its ``bound`` seconds after a rank failed or vanished is
    ended (SIGTERM, then SIGKILL 5 s later), with a message: it waits for a host it lost.
    """
    from .monitor import active

    monitor = active()
    bound = monitor.bound if monitor is not None else None
    process = subprocess.Popen(argv)

    def forward(signum: int, frame: Any) -> None:
        process.send_signal(signum)

    saved = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    try:
        status = _wait(process, monitor, bound)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    return 128 - status if status < 0 else status


def _wait(process: subprocess.Popen, monitor: Any, bound: float | None) -> int:
    if monitor is None or bound is None:
        return process.wait()
    trouble_since = None
    while True:
        try:
            return process.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
        if trouble_since is None:
            if monitor.troubled():
                trouble_since = time.monotonic()
            continue
        if time.monotonic() - trouble_since < bound:
            continue
        sys.stderr.write(
            f"mpistrat run: {argv_name(process)} still runs {bound:g} s after a rank failed "
            f"or vanished (it waits for a host it cannot reach); ending it\n")
        sys.stderr.flush()
        process.terminate()
        try:
            return process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            process.kill()
            return process.wait()


def argv_name(process: subprocess.Popen) -> str:
    args = process.args
    first = args[0] if isinstance(args, (list, tuple)) and args else str(args)
    return str(first).rsplit("/", 1)[-1]
