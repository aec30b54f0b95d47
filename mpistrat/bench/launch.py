"""Starting the benchmark: self-launching under ``mpiexec`` and MPI settings that must be in
the environment before MPI starts (the transport, forced library algorithms).

``--transport net`` turns the MPI library's shared-memory path off, so ranks on one
machine talk through the network module as ranks on different nodes would: MPICH's
``MPIR_CVAR_NOLOCAL=1``; Open MPI's ``OMPI_MCA_pml=ob1`` with ``OMPI_MCA_btl=self,tcp``.
Both families' variables are set (each library ignores the other's). It approximates
inter-node behaviour (loopback TCP, not a real NIC). ``--mpi-env KEY=VALUE`` sets any
other variable, e.g. ``MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=ring`` to force MPICH's
algorithm for ``native`` (see the MPI library's documentation for the names).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping, MutableMapping, Sequence

__all__ = ["TRANSPORTS", "transport_env", "parse_env", "apply_env", "relaunch_command",
           "strip_options"]

TRANSPORTS: dict[str, dict[str, str]] = {
    "auto": {},
    "net": {"MPIR_CVAR_NOLOCAL": "1", "OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "self,tcp"},
}


def transport_env(transport: str) -> dict[str, str]:
    """The environment variables of a ``--transport`` choice.

    Raises:
        ValueError: an unknown transport.
    """
    try:
        return dict(TRANSPORTS[transport])
    except KeyError:
        raise ValueError(f"--transport must be one of {', '.join(TRANSPORTS)}, got "
                         f"{transport!r}") from None


def parse_env(items: Iterable[str]) -> dict[str, str]:
    """``KEY=VALUE`` strings → a dict.

    Raises:
        ValueError: an item without ``=`` or with an empty key.
    """
    env: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--mpi-env takes KEY=VALUE (e.g. "
                             f"MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=ring), got {item!r}")
        env[key.strip()] = value
    return env


def apply_env(env: Mapping[str, str], environ: MutableMapping[str, str] | None = None) -> None:
    """Put ``env`` into ``environ`` (default ``os.environ``) before MPI starts.

    Raises:
        RuntimeError: MPI is already initialised in this process, so the library would
            not see the settings.
    """
    if not env:
        return
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized():
        raise RuntimeError(f"MPI is already initialised in this process, so "
                           f"{', '.join(sorted(env))} would have no effect; set them "
                           f"before MPI starts (run mpistrat bench in a fresh process)")
    (os.environ if environ is None else environ).update(env)


def strip_options(args: Sequence[str], names: Iterable[str]) -> list[str]:
    """``args`` without the options ``names`` and their values (``--np 2``, ``--np=2``)."""
    names = set(names)
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg == "--":
            out.append(arg)
            continue
        name = arg.split("=", 1)[0]
        if name in names:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def relaunch_command(args: Sequence[str], python: str = sys.executable) -> list[str]:
    """The command each rank runs when ``mpistrat bench --np N ARGS`` launches itself:
    ``python -m mpistrat bench ARGS`` without the launch options."""
    return [python, "-m", "mpistrat", "bench",
            *strip_options(args, ("--np", "-np", "--mpiexec"))]
