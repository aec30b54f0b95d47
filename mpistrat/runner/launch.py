"""``mpistrat run -n N``: start the job through :mod:`mpistrat.launch.selflaunch` (the
``mpiexec`` that matches mpi4py's MPI library, signals forwarded, its exit status passed
through) while watching, from outside the job, how each rank ends
(:mod:`~mpistrat.runner.monitor`), so that a lost host is named even when the launcher
ends every other rank at once."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from ..launch import selflaunch
from ..launch.hugepages import malloc_hugepages_env
from ..launch.selflaunch import FORWARDED_SIGNALS
from .monitor import MONITOR_ENV, active
from .options import RunOptions

__all__ = ["launch_command", "self_launch", "FORWARDED_SIGNALS"]


def launch_command(options: RunOptions, nprocs: int, mpiexec: str | None = None,
                   env: Mapping[str, str] | None = None,
                   python: str = sys.executable,
                   rank_env: Mapping[str, str] | None = None) -> list[str]:
    """The ``mpiexec`` command line that runs ``options`` on ``nprocs`` ranks
    (``rank_env``: variables every rank gets, passed with the launcher's flags; by
    default the job monitor's address when one is active, see
    :mod:`~mpistrat.runner.monitor`, and the heap's huge-page tunable of
    :mod:`~mpistrat.launch.hugepages`, so that the ranks start with it instead of each
    starting over).

    Raises:
        RunSetupError: this process already runs under an MPI launcher with several
            ranks (each would start its own job).
        MpistratError: no ``mpiexec`` was found (the message says how to get one).
    """
    command = [python, "-m", "mpistrat", "run", *options.command_line()]
    if rank_env is None:
        environ = os.environ if env is None else env
        value = environ.get(MONITOR_ENV)
        rank_env = {MONITOR_ENV: value} if value else {}
        rank_env.update(malloc_hugepages_env(environ) or {})
    return selflaunch.launch_argv("mpistrat run", "-n", nprocs, command, mpiexec=mpiexec,
                                  env=env, python=python, rank_env=rank_env)


def self_launch(argv: list[str]) -> int:
    """Run ``argv`` (an mpiexec command line) as :func:`mpistrat.launch.selflaunch.
    self_launch` does, watched by the active :class:`~mpistrat.runner.monitor.JobMonitor`
    (``mpistrat run -n``) when there is one."""
    return selflaunch.self_launch(argv, active())
