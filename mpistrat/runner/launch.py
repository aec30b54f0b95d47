"""``mpistrat run -n N``: start the job with the ``mpiexec`` that matches mpi4py's MPI
library, forward signals to it, and pass its exit status through."""

from __future__ import annotations

import signal
import subprocess
import sys
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
                   python: str = sys.executable) -> list[str]:
    """The ``mpiexec`` command line that runs ``options`` on ``nprocs`` ranks.

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
    return find_launcher(mpiexec, env, python).argv(nprocs, command)


def self_launch(argv: list[str]) -> int:
    """Run ``argv`` (an mpiexec command line) and return its exit status (128 + N when
    a signal N ended it), forwarding :data:`FORWARDED_SIGNALS` to it meanwhile."""
    process = subprocess.Popen(argv)

    def forward(signum: int, frame: Any) -> None:
        process.send_signal(signum)

    saved = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    try:
        status = process.wait()
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    return 128 - status if status < 0 else status
