"""Detect the launcher from environment variables (pure: takes the environment as an argument)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["LaunchInfo", "detect"]

# (launcher name, size variable, rank variable), most specific first.
_LAUNCHERS = (
    ("Open MPI (prterun/mpirun)", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
    ("PMIx", "PMIX_SIZE", "PMIX_RANK"),
    ("MPICH Hydra / PMI", "PMI_SIZE", "PMI_RANK"),
    ("Slurm srun", "SLURM_NTASKS", "SLURM_PROCID"),
)


@dataclass(frozen=True)
class LaunchInfo:
    """What the environment says about how this process was started.

    Attributes:
        launcher: a human name for the launcher, or None when none is detected
            (a singleton: ``python script.py`` without mpiexec).
        size: the number of processes the launcher started, when it says.
        rank: this process's rank according to the launcher, when it says.
    """

    launcher: str | None
    size: int | None
    rank: int | None

    def mismatch(self, mpi_size: int) -> str | None:
        """A warning when the launcher started N > 1 processes but MPI sees ``mpi_size`` == 1.

        That is the classic sign of a launcher from one MPI library and mpi4py built for
        another: every process is rank 0 of 1.
        """
        if self.size and self.size > 1 and mpi_size == 1:
            return (
                f"{self.launcher} started {self.size} processes but MPI sees a world of 1: "
                f"the launcher and mpi4py's MPI library differ, so every process is rank 0 "
                f"of 1; use the mpiexec of the library mpi4py loads (python -m mpi4py "
                f"--mpi-library shows it; with the mpich wheel it is the mpiexec in the same "
                f"virtual environment), or srun --mpi=pmi2 under Slurm"
            )
        return None


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def detect(environ: Mapping[str, str] | None = None) -> LaunchInfo:
    """Identify the launcher from ``environ`` (default ``os.environ``)."""
    env = os.environ if environ is None else environ
    for name, size_var, rank_var in _LAUNCHERS:
        if size_var in env or rank_var in env:
            return LaunchInfo(name, _int(env.get(size_var)), _int(env.get(rank_var)))
    return LaunchInfo(None, None, None)
