"""``CheckpointManager`` and ``latest_checkpoint``: numbered checkpoints in a directory,
the newest complete one found on restart, the oldest deleted.

Every function here is collective: the chief looks at the directory and tells the other
ranks, so every rank resumes from the same checkpoint even when only the chief sees the
files, and a job never resumes from a torn one (a checkpoint counts only once its
manifest is in place; see :mod:`mpistrat.checkpoint._files`).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from ..runtime._mpi import Comm, state_comm
from . import _files
from .checkpoint import Checkpoint

__all__ = ["CheckpointManager", "latest_checkpoint"]


def _chief_says(comm: Comm, chief: int, question: Any) -> Any:
    """``question()`` evaluated on the chief, its answer (or its OSError) on every rank."""
    answer = None
    if comm.Get_rank() == chief:
        try:
            answer = ("ok", question())
        except OSError as exc:
            answer = ("error", f"{type(exc).__name__}: {exc}")
    answer = comm.bcast(answer, root=chief)
    if answer[0] != "ok":
        raise OSError(f"{answer[1]} (on the chief, rank {chief})")
    return answer[1]


def latest_checkpoint(directory: str, checkpoint_name: str | None = "ckpt",
                      comm: Comm | None = None) -> str | None:
    """The path of the newest complete checkpoint ``checkpoint_name-N`` in ``directory``
    (highest N), or None; collective, read by rank 0 of ``comm`` (default ``COMM_WORLD``,
    or ``COMM_SELF`` on a parameter-server coordinator) and the same on every rank. ``checkpoint_name=None`` accepts any name."""
    comm = state_comm() if comm is None else comm

    def newest() -> str | None:
        found = _files.scan(directory, checkpoint_name)
        return found[-1][1] if found else None

    return _chief_says(comm, 0, newest)


class CheckpointManager:
    """Save ``checkpoint`` as ``directory/checkpoint_name-N`` and keep the newest
    ``max_to_keep`` (TF's ``tf.train.CheckpointManager``). Collective, like the checkpoint.

    Args:
        checkpoint: the :class:`Checkpoint` to save and restore.
        directory: where the checkpoints go (created by the chief when missing).
        max_to_keep: how many to keep (None: all).
        checkpoint_name: the file name prefix.
    """

    def __init__(self, checkpoint: Checkpoint, directory: str, max_to_keep: int | None = 5,
                 checkpoint_name: str = "ckpt") -> None:
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(f"checkpoint must be an mpistrat.checkpoint.Checkpoint, got "
                            f"{type(checkpoint).__name__}")
        if max_to_keep is not None and (isinstance(max_to_keep, bool)
                                        or not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(f"max_to_keep must be an integer >= 1 or None (keep all), got "
                             f"{max_to_keep!r}")
        if not checkpoint_name or "/" in checkpoint_name or os.sep in checkpoint_name:
            raise ValueError(f"checkpoint_name must be a file name prefix without '/', got "
                             f"{checkpoint_name!r}")
        self.checkpoint = checkpoint
        self.directory = os.fspath(directory)
        self.max_to_keep = max_to_keep
        self.checkpoint_name = checkpoint_name

    @property
    def _prefix(self) -> str:
        return os.path.join(self.directory, self.checkpoint_name)

    @property
    def checkpoints(self) -> list[str]:
        """The complete checkpoints, oldest first (collective)."""
        comm = self.checkpoint.comm
        chief = self.checkpoint._agree("CheckpointManager.checkpoints", self._prefix)
        return _chief_says(comm, chief, lambda: [p for _, p in _files.scan(
            self.directory, self.checkpoint_name)])

    @property
    def latest_checkpoint(self) -> str | None:
        """The newest complete checkpoint, or None (collective)."""
        found = self.checkpoints
        return found[-1] if found else None

    def save(self, checkpoint_number: int | None = None) -> str:
        """Save as ``checkpoint_name-N`` (N = ``checkpoint_number``, default the
        checkpoint's ``save_counter + 1``), then delete the oldest beyond ``max_to_keep``
        and leftovers of crashed saves. Returns the path."""
        ckpt = self.checkpoint
        if checkpoint_number is None:
            path = ckpt.save(self._prefix)
        else:
            if isinstance(checkpoint_number, bool) or not isinstance(checkpoint_number, int) \
                    or checkpoint_number < 0:
                raise ValueError(f"checkpoint_number must be an integer >= 0, got "
                                 f"{checkpoint_number!r}")
            path = ckpt.write(f"{self._prefix}-{checkpoint_number}")
        comm = ckpt.comm
        if comm.Get_rank() == ckpt._chief:
            try:
                self._prune()
            except OSError as exc:
                warnings.warn(f"could not delete old checkpoints in {self.directory}: {exc}",
                              RuntimeWarning, stacklevel=2)
        return path

    def _prune(self) -> None:
        _files.remove_temporaries(self.directory, self.checkpoint_name)
        if self.max_to_keep is None:
            return
        found = _files.scan(self.directory, self.checkpoint_name)
        for _, path in found[:-self.max_to_keep]:
            _files.remove(path)

    def restore_or_initialize(self) -> str | None:
        """Restore the newest complete checkpoint and return its path, or return None
        (nothing saved yet: the objects keep their initial values)."""
        return self.checkpoint.restore(self.latest_checkpoint)
