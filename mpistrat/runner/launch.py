"""``mpistrat run -n N``: start the job through :mod:`mpistrat.launch.selflaunch` (the
``mpiexec`` that matches mpi4py's MPI library, signals forwarded, its exit status passed
through) while watching, from outside the job, how each rank ends
(:mod:`~mpistrat.runner.monitor`), so that a lost host is named even when the launcher
ends every other rank at once."""

from __future__ import annotations

import os
import re
import socket
import sys
from collections.abc import Mapping

from ..errors import TopologyError
from ..launch import selflaunch
from ..launch.hugepages import malloc_hugepages_env
from ..launch.selflaunch import FORWARDED_SIGNALS
from .auth import SECRET_ENV
from .monitor import MONITOR_ENV, active
from .options import RunOptions

__all__ = ["launch_command", "self_launch", "job_hosts", "host_file", "FORWARDED_SIGNALS"]

# where other resource managers hand the launcher its hosts (not read here: the monitor
# then listens on every address, still authenticated)
_OTHER_HOST_LISTS = ("PBS_NODEFILE", "LSB_HOSTS", "LSB_MCPU_HOSTS", "PE_HOSTFILE",
                     "OAR_NODEFILE", "COBALT_NODEFILE", "PRTE_MCA_prte_default_hostfile",
                     "OMPI_MCA_orte_default_hostfile", "OMPI_MCA_rmaps_base_hostfile")
_MAX_HOST_FILE = 1 << 20  # bytes of a host file read here


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
    environ = os.environ if env is None else env
    if rank_env is None:
        rank_env = dict(malloc_hugepages_env(environ) or {})
    # the job monitor's address and the job's secret reach the ranks by name, their
    # values through the environment only: a command line is readable by every user
    inherit = [name for name in (MONITOR_ENV, SECRET_ENV) if environ.get(name)]
    return selflaunch.launch_argv("mpistrat run", "-n", nprocs, command, mpiexec=mpiexec,
                                  env=env, python=python, rank_env=rank_env, inherit=inherit)


def host_file(path: str) -> list[tuple[str, str]] | None:
    """A hydra host file's entries, ``host[:slots]`` per line (comments and blank lines
    skipped): ``(host, slots as written, "" when not)``; None when the file cannot be read
    or names no host."""
    try:
        with open(path, "rb") as file:
            text = file.read(_MAX_HOST_FILE).decode(errors="replace")
    except OSError:
        return None
    entries = []
    for line in text.splitlines():
        host, _, rest = line.split("#", 1)[0].strip().partition(":")
        host = re.split(r"\s", host, maxsplit=1)[0]
        if host:
            entries.append((host, rest.split()[0] if rest.split() else ""))
    return entries or None


def job_hosts(env: Mapping[str, str] | None = None) -> list[str] | None:
    """The hosts ``mpiexec`` will start ranks on, as far as its environment tells (what
    hydra reads: ``HYDRA_HOST_FILE``, else a Slurm allocation's node list); this host
    alone when nothing names others; None when another resource manager's list decides
    (not read here)."""
    environ = os.environ if env is None else env
    path = environ.get("HYDRA_HOST_FILE")
    if path:
        entries = host_file(path)  # (unreadable: hydra says so itself)
        return [host for host, _ in entries] if entries else None
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if nodelist:
        from ..cluster.hostlist import expand_hostlist

        try:
            return expand_hostlist(nodelist, "SLURM_JOB_NODELIST")
        except TopologyError:
            return None
    if any(environ.get(name) for name in _OTHER_HOST_LISTS):
        return None
    return [socket.gethostname()]


def self_launch(argv: list[str]) -> int:
    """Run ``argv`` (an mpiexec command line) as :func:`mpistrat.launch.selflaunch.
    self_launch` does, watched by the active :class:`~mpistrat.runner.monitor.JobMonitor`
    (``mpistrat run -n``) when there is one."""
    return selflaunch.self_launch(argv, active())
