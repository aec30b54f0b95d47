"""``CheckpointManager`` and ``latest_checkpoint``: numbered checkpoints in a directory,
the newest save found on restart, the oldest saves deleted.

Every function here is collective: the chief looks at the directory and tells the other
ranks (or, when it fails, raises its error on every rank), so every rank resumes from the
same checkpoint even when only the chief sees the files, and a job never resumes from a
torn one (a checkpoint counts only once its manifest is in place; see
:mod:`mpistrat.checkpoint._files`).

Numbering and order, as TF's ``CheckpointManager`` keeps them: a save without a number
takes one above every ``NAME-N`` in the directory, so a new run in the directory of an
older one continues its numbering; "newest" means the newest save (each manifest records
its place in the directory's save order), so the checkpoint just written is never the one
deleted, and ``latest_checkpoint`` names it even when an explicit ``checkpoint_number`` is
lower than older checkpoints'.
"""

from __future__ import annotations

import builtins
import os
from typing import Any

from ..runtime._mpi import Comm, state_comm
from . import _files
from .checkpoint import Checkpoint, _on_chief

__all__ = ["CheckpointManager", "latest_checkpoint"]


def _chief_says(comm: Comm, chief: int, question: Any) -> Any:
    """``question()`` evaluated on the chief, its answer on every rank; its error, of any
    type, raised on every rank (an ``OSError`` stays one)."""

    def failure(exc: Exception) -> tuple[type[Exception], str]:
        cls = type(exc) if getattr(builtins, type(exc).__name__, None) is type(exc) \
            else OSError if isinstance(exc, OSError) else RuntimeError
        return cls, f"{type(exc).__name__}: {exc} (on the chief, rank {chief})"

    return _on_chief(comm, chief, question, failure)


def latest_checkpoint(directory: str | os.PathLike[str], checkpoint_name: str | None = "ckpt",
                      comm: Comm | None = None) -> str | None:
    """The path of the newest complete checkpoint ``checkpoint_name-N`` in ``directory``
    (the newest save, whatever its N), or None; collective, read by rank 0 of ``comm``
    (default ``COMM_WORLD``, or ``COMM_SELF`` on a parameter-server coordinator) and the
    same on every rank. ``checkpoint_name=None`` accepts any name."""
    comm = state_comm() if comm is None else comm
    directory = os.fspath(directory)

    def newest() -> str | None:
        found = _files.scan(directory, checkpoint_name)
        return found[-1][1] if found else None

    return _chief_says(comm, 0, newest)


class CheckpointManager:
    """Save ``checkpoint`` as ``directory/checkpoint_name-N`` and keep the newest
    ``max_to_keep`` saves (TF's ``tf.train.CheckpointManager``). Collective, like the
    checkpoint.

    Args:
        checkpoint: the :class:`Checkpoint` to save and restore.
        directory: where the checkpoints go (created by the chief when missing).
        max_to_keep: how many saves to keep (None: all).
        checkpoint_name: the file name prefix.
    """

    def __init__(self, checkpoint: Checkpoint, directory: str | os.PathLike[str],
                 max_to_keep: int | None = 5, checkpoint_name: str = "ckpt") -> None:
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(f"checkpoint must be an mpistrat.checkpoint.Checkpoint, got "
                            f"{type(checkpoint).__name__}")
        if max_to_keep is not None and (isinstance(max_to_keep, bool)
                                        or not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(f"max_to_keep must be an integer >= 1 or None (keep all), got "
                             f"{max_to_keep!r}")
        if not isinstance(checkpoint_name, str) or not checkpoint_name or "/" in \
                checkpoint_name or os.sep in checkpoint_name or checkpoint_name in (".", ".."):
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
        """The complete checkpoints, oldest save first (collective)."""
        comm = self.checkpoint.comm
        chief = self.checkpoint._agree("CheckpointManager.checkpoints", self._prefix)
        return _chief_says(comm, chief, lambda: [p for _, p in _files.scan(
            self.directory, self.checkpoint_name)])

    @property
    def latest_checkpoint(self) -> str | None:
        """The newest save among the complete checkpoints, or None (collective)."""
        found = self.checkpoints
        return found[-1] if found else None

    def save(self, checkpoint_number: int | None = None) -> str:
        """Save as ``checkpoint_name-N``, then delete the oldest saves beyond
        ``max_to_keep`` (never this one) and leftovers of crashed saves; collective.
        Returns the path.

        N is ``checkpoint_number``, or by default one more than both the checkpoint's
        ``save_counter`` and every N in the directory (see :meth:`Checkpoint.save`). An
        explicit number is honoured even below existing ones: that save is still the
        newest (``latest_checkpoint`` names it, pruning deletes the oldest saves first),
        and an existing checkpoint of that number is replaced.
        """
        ckpt = self.checkpoint
        if checkpoint_number is None:
            return ckpt._save("CheckpointManager.save", self._prefix, True, after=self._prune)
        if isinstance(checkpoint_number, bool) or not isinstance(checkpoint_number, int) \
                or checkpoint_number < 0:
            raise ValueError(f"checkpoint_number must be an integer >= 0, got "
                             f"{checkpoint_number!r}")
        return ckpt._save("CheckpointManager.save", f"{self._prefix}-{checkpoint_number}",
                          False, after=self._prune)

    def _prune(self, path: str) -> None:
        """On the chief, holding the directory's lock, after saving ``path``."""
        _files.prune(self.directory, self.checkpoint_name, self.max_to_keep, protect=path)

    def restore_or_initialize(self) -> str | None:
        """Restore the newest complete checkpoint and return its path, or return None
        (nothing saved yet: the objects keep their initial values)."""
        return self.checkpoint.restore(self.latest_checkpoint)
