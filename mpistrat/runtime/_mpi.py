"""Lazy access to ``mpi4py.MPI``: importing it initialises MPI, so only code that needs a
communicator calls :func:`mpi`. Nothing imports ``mpi4py.MPI`` at module import time."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["mpi", "world", "Comm"]

if TYPE_CHECKING:
    from mpi4py.MPI import Intracomm as Comm
else:
    Comm = Any  # for annotations only; importing mpi4py.MPI here would start MPI


_MPI: Any = None


def mpi() -> Any:
    """Return the ``mpi4py.MPI`` module, initialising MPI on first use."""
    global _MPI
    if _MPI is None:
        from mpi4py import MPI  # (MPI starts on first use: validate and --help never start it)

        _MPI = MPI
    return _MPI


def world() -> Comm:
    """``MPI.COMM_WORLD``, the default communicator."""
    return mpi().COMM_WORLD


_STATE_COMM: list[Any] = [None]


def state_comm() -> Comm:
    """The communicator whose ranks hold the job's training state, for checkpoints:
    ``COMM_WORLD``, or ``COMM_SELF`` on the coordinator of a parameter-server job, the
    only rank that runs the training program (its workers and ps never reach the
    checkpoint calls)."""
    found = _STATE_COMM[0]
    return world() if found is None else found


def set_state_comm(comm: Comm | None) -> None:
    """Set (None: reset to ``COMM_WORLD``) what :func:`state_comm` returns."""
    _STATE_COMM[0] = comm
