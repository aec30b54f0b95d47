"""Save and stop together when the job is told to end (preemption, time limit, Ctrl-C).

Slurm sends ``SIGTERM`` when it preempts or cancels a job and at its time limit, and any
signal chosen with ``sbatch --signal=USR1@120`` that many seconds before it; ``mpiexec``
forwards both to every rank, and so does ``mpistrat run -n``. The signal reaches the ranks
at slightly different moments, in different steps, so no rank may act on it alone:
:meth:`PreemptionCheckpointHandler.save_checkpoint_if_preempted`, called once per step on
every rank, ORs the ranks' flags (one small non-blocking all-reduce) and, once any rank
has its flag, saves a checkpoint on every rank's behalf and ends every rank with the same
exit status. The restarted (requeued) job then resumes from that checkpoint.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..runtime import stall
from ..runtime._mpi import mpi
from .manager import CheckpointManager

__all__ = ["PreemptionCheckpointHandler", "PREEMPTION_EXIT_STATUS"]

PREEMPTION_EXIT_STATUS = 42  # "saved and stopped, run me again": for the batch script


class PreemptionCheckpointHandler:
    """Turn a termination signal into a checkpoint saved at a step every rank agrees on.

    Create it on every rank (in the main thread: it installs signal handlers), then call
    :meth:`save_checkpoint_if_preempted` once per step on every rank.

    Args:
        manager: where the checkpoint goes.
        signals: the signals to catch (names or numbers); default ``SIGTERM`` and
            ``SIGUSR1``.
        exit_status: the status every rank ends with after saving (``SystemExit``);
            None returns normally instead (check :attr:`preempted` then).
    """

    def __init__(self, manager: CheckpointManager, signals: Iterable[Any] = ("SIGTERM", "SIGUSR1"),
                 exit_status: int | None = PREEMPTION_EXIT_STATUS) -> None:
        if not isinstance(manager, CheckpointManager):
            raise TypeError(f"manager must be an mpistrat.checkpoint.CheckpointManager, got "
                            f"{type(manager).__name__}")
        self.manager = manager
        self.exit_status = exit_status
        self.received: int | None = None  # the first signal this rank caught
        self.preempted = False  # the ranks agreed to stop; the checkpoint is saved
        self.saved_path: str | None = None
        self._flag = np.zeros(1, dtype=np.int64)
        self._saved_handlers: dict[int, Any] = {}
        for sig in signals:
            number = _signal_number(sig)
            self._saved_handlers[number] = signal.signal(number, self._catch)

    def _catch(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signum

    def close(self) -> None:
        """Put the previous signal handlers back."""
        for number, handler in self._saved_handlers.items():
            signal.signal(number, handler)
        self._saved_handlers.clear()

    def __enter__(self) -> PreemptionCheckpointHandler:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def save_checkpoint_if_preempted(self) -> bool:
        """Collective: if any rank caught a signal, save a checkpoint and stop.

        Returns:
            False when no rank caught one (carry on). With ``exit_status=None``, True
            after saving; otherwise it raises ``SystemExit(exit_status)`` on every rank.
        """
        if self.preempted:
            return True
        MPI = mpi()
        comm = self.manager.checkpoint.comm
        self._flag[0] = self.received or 0
        watch = stall.current()
        if watch is not None:  # under mpistrat run: a rank that never calls is reported
            watch.allreduce(comm, self._flag, "save_checkpoint_if_preempted")
        else:
            request = comm.Iallreduce(MPI.IN_PLACE, self._flag, op=MPI.MAX)
            pause = 1e-5
            while not request.Test():  # polled, so signal handlers run meanwhile
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)
        if not self._flag[0]:
            return False
        self.preempted = True
        self.saved_path = self.manager.save()
        if comm.Get_rank() == 0:
            name = signal.Signals(int(self._flag[0])).name
            print(f"mpistrat: {name} received; saved {self.saved_path} and stopping so the "
                  f"job can be restarted from it", file=sys.stderr, flush=True)
        if self.exit_status is not None:
            raise SystemExit(self.exit_status)
        return True


def _signal_number(sig: Any) -> int:
    if isinstance(sig, str):
        name = sig.upper() if sig.upper().startswith("SIG") else "SIG" + sig.upper()
        try:
            return int(getattr(signal, name))
        except AttributeError:
            raise ValueError(f"unknown signal {sig!r}; give a name such as 'SIGUSR1' or "
                             f"'TERM', or a number") from None
    return int(sig)
