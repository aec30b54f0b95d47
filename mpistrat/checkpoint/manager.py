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

import atexit
import builtins
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

from ..elastic import hooks
from ..elastic.env import AUTO_SHARE, elastic_env, job_secret
from ..runtime._mpi import Comm, state_comm
from . import _files
from .checkpoint import Checkpoint, _on_chief
from .snapshot import SnapshotInfo, SnapshotStore

__all__ = ["CheckpointManager", "latest_checkpoint", "set_snapshot_hooks"]

# (before, after): called around every snapshot a manager takes, once it is due; a
# parameter-server coordinator waits for its scheduled functions before, and sends the
# snapshot to its partner host after (mpistrat.ps.elastic)
_SNAPSHOT_HOOKS: list[tuple[Callable[[], object] | None,
                            Callable[[SnapshotStore], object] | None]] = []


def set_snapshot_hooks(before: Callable[[], object] | None = None,
                       after: Callable[[SnapshotStore], object] | None = None) -> None:
    """Call ``before()`` when a snapshot is due, before it is taken (it may wait until the
    state is whole, or raise: then none is taken), and ``after(store)`` once it is taken
    (None, None: no hooks). For :mod:`mpistrat.ps.elastic`."""
    _SNAPSHOT_HOOKS[:] = [(before, after)] if before is not None or after is not None else []


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

    In an elastic job (``mpistrat run --min-ranks``) the first manager also takes a
    snapshot of the checkpoint into each host's RAM at every step boundary (every
    ``--snapshot-every`` boundaries; see :mod:`mpistrat.checkpoint.snapshot` and
    :mod:`mpistrat.elastic.hooks`), and after a relaunch :meth:`restore_or_initialize`
    restores the newest snapshot, and the input pipeline's position with it, before
    looking at the directory. A torch loop marks its step boundaries with
    :class:`mpistrat.torch.DistributedBatchSampler`; its module and optimizer are
    snapshotted as the checkpoint's stateful leaves (a ZeroRedundancyOptimizer's state
    is gathered on each host's writing rank at every snapshot, collectively).

    Args:
        checkpoint: the :class:`Checkpoint` to save and restore.
        directory: where the checkpoints go (created by the chief when missing).
        max_to_keep: how many saves to keep (None: all).
        checkpoint_name: the file name prefix.

    Attributes:
        restored_snapshot: the snapshot :meth:`restore_or_initialize` restored, if any
            (:class:`~mpistrat.checkpoint.snapshot.SnapshotInfo`).
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
        self.restored_snapshot: SnapshotInfo | None = None
        self._launch = elastic_env()
        self._snapshots: SnapshotStore | None = None
        self._boundaries = 0  # step boundaries since the job began (restored with snapshots)
        self._last_snapshot = 0.0  # when the last one was taken (time.perf_counter())
        if self._launch is not None and hooks.taker() is None:
            if job_secret() is None:
                warnings.warn("an elastic job's variables are set, but this process has no "
                              "job secret (it was not started by mpistrat run): no "
                              "snapshots are taken", RuntimeWarning, stacklevel=2)
            else:
                hooks.set_taker(self._at_boundary)

    def _store(self) -> SnapshotStore:
        """The job's snapshots (collective the first time: every rank reaches the same
        step boundary, or restore, together)."""
        if self._snapshots is None:
            assert self._launch is not None
            secret = job_secret()
            assert secret is not None
            self._snapshots = SnapshotStore(self.checkpoint, self._launch, secret)
            # the job ends well when every rank's script does: its snapshots go then
            # (a failed launch ends in MPI_Abort, which runs no atexit: they stay for the
            # relaunch)
            atexit.register(self._snapshots.close, remove=True)
        return self._snapshots

    def _at_boundary(self, position: hooks.Position) -> None:
        """Take a snapshot at this step boundary when it is due: every
        ``snapshot_every`` boundaries, or (``auto``) when the time since the last one is
        long enough for its cost to be at most ``AUTO_SHARE`` of it."""
        assert self._launch is not None
        self._boundaries += 1
        every = self._launch.snapshot_every
        store = self._snapshots
        if every:
            if self._boundaries % every:
                return
        elif store is not None:
            due = not (store.taken and (time.perf_counter() - self._last_snapshot)
                       * AUTO_SHARE < store.last_cost)
            if store.collective:  # (rank 0, a writer, decides: every rank takes it or none)
                assert store.comm is not None
                due = store.comm.bcast(due, root=0)
            if not due:
                return
        before, after = _SNAPSHOT_HOOKS[0] if _SNAPSHOT_HOOKS else (None, None)
        waited = 0.0
        if before is not None:  # (a parameter-server job's drain of its workers)
            started = time.perf_counter()
            before()
            waited = time.perf_counter() - started
        store = self._store()
        store.take(position, self._boundaries)
        store.last_cost += waited  # (what auto weighs: the workers idled meanwhile)
        self._last_snapshot = time.perf_counter()
        if after is not None:
            after(store)

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
        (nothing saved yet: the objects keep their initial values).

        After an elastic job's relaunch, the newest snapshot any surviving host holds
        comes first (its manifest's path is returned, and :attr:`restored_snapshot`
        says more); the directory's newest checkpoint when no host holds one."""
        if self._launch is not None and self._launch.resumed and \
                hooks.taker() == self._at_boundary:
            store = self._store()
            info = store.restore()
            if info is None and store.skipped and self.checkpoint.comm.Get_rank() == 0:
                warnings.warn("no snapshot of this job could be restored, so the newest "
                              "checkpoint on disk is: " + "; ".join(store.skipped),
                              RuntimeWarning, stacklevel=2)
            if info is not None:
                self.restored_snapshot = info
                hooks.set_resume(info.position, info.finished)
                # (the first boundary to come is the restored one again: same number)
                self._boundaries = info.sequence - 1
                return info.path
        return self.checkpoint.restore(self.latest_checkpoint)
