"""Checkpoints that survive a killed or preempted job: written by the chief only,
atomically, and restored identically on every rank.

* :class:`Checkpoint` — named state (variables, arrays, :class:`Scalar` counters, random
  generators, :func:`global_generators`): ``save``/``write`` and ``restore``;
* :class:`CheckpointManager`, :func:`latest_checkpoint` — numbered checkpoints in a
  directory, the newest complete save found on restart;
* :class:`PreemptionCheckpointHandler` — save and stop together when Slurm (or anyone)
  signals that the job must end (mpistrat's form and TF's, with :class:`TerminationConfig`);
  :class:`PreemptionWatcher` only notes the notice.

On disk a checkpoint ``PATH`` is ``PATH.json`` (a manifest, the commit record) and
``PATH.<sha256[:16]>.npz`` (NumPy arrays, named for their SHA-256, which the manifest
holds); see :mod:`mpistrat.checkpoint._files` for the format and the guarantees. A
checkpoint that is missing, torn, forged or not the objects' is the same error on every
rank, before any object changes.
"""

from __future__ import annotations

from ._files import CheckpointCorruptError, CheckpointNotFoundError
from ._random import global_generators
from .checkpoint import Checkpoint, Scalar
from .manager import CheckpointManager, latest_checkpoint
from .preemption import (
    PREEMPTION_EXIT_STATUS,
    PreemptionCheckpointHandler,
    PreemptionWatcher,
    TerminationConfig,
)

__all__ = ["Checkpoint", "Scalar", "global_generators", "CheckpointManager", "latest_checkpoint",
           "PreemptionCheckpointHandler", "PREEMPTION_EXIT_STATUS", "TerminationConfig",
           "PreemptionWatcher",
           "CheckpointNotFoundError", "CheckpointCorruptError"]
