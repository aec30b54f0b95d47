"""Lazy access to ``mpi4py.MPI``: importing it initialises MPI, so only code that needs a
communicator calls :func:`mpi`. Nothing imports ``mpi4py.MPI`` at module import time."""

from __future__ import annotations

from typing import Any

__all__ = ["mpi", "world"]


_MPI: Any = None


def mpi() -> Any:
    """Return the ``mpi4py.MPI`` module, initialising MPI on first use."""
    global _MPI
    if _MPI is None:
        from mpi4py import MPI  # (MPI starts on first use: validate and --help never start it)

        _MPI = MPI
    return _MPI


def world() -> Any:
    """``MPI.COMM_WORLD``, the default communicator."""
    return mpi().COMM_WORLD
