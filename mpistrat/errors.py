"""Exception types raised by mpistrat.

Every message names the offending value, what was expected and how to fix it.
Errors about user input derive from ``ValueError`` (or ``TypeError``) so callers
that already catch the builtin types keep working.
"""

from __future__ import annotations

__all__ = [
    "MpistratError",
    "SpecError",
    "SpecTypeError",
    "UnknownAlgorithmError",
    "TopologyError",
    "BackendUnavailable",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CollectiveAbortedError",
    "PeerLostError",
    "DuplicateDeviceError",
    "PackingError",
    "PackingTypeError",
    "ArenaFullError",
    "CheckpointNotFoundError",
    "CheckpointCorruptError",
    "RunSetupError",
    "CancelledError",
    "WorkerUnavailableError",
    "TraceError",
    "UnsupportedError",
    "OutOfRangeError",
    "DuplicateTaskError",
]


class MpistratError(Exception):
    """Base class of every error raised by mpistrat."""


class SpecError(MpistratError, ValueError):
    """An all-reduce spec that cannot be parsed or fails validation."""


class SpecTypeError(SpecError, TypeError):
    """An all-reduce spec (or a part of one) of the wrong Python type."""


class UnknownAlgorithmError(SpecError):
    """An algorithm name that is not in the registry."""


class TopologyError(MpistratError, ValueError):
    """A spec or setting that does not fit the workers, devices or nodes it runs on."""


class BackendUnavailable(MpistratError, RuntimeError):
    """A capability (CuPy, a GPU, NCCL, a CUDA-aware MPI) that this machine does not have."""


class CollectiveMismatchError(MpistratError, ValueError):
    """Ranks called a collective with different arguments, or some rank's arguments were
    invalid; raised on every rank with a description of each rank's call."""


class CollectiveTimeoutError(MpistratError, TimeoutError):
    """Some ranks did not reach a collective within its ``timeout_seconds``.

    Attributes:
        missing: the ranks that had not arrived when the time ran out.
    """

    def __init__(self, message: str, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = missing


class CollectiveAbortedError(MpistratError, RuntimeError):
    """Another rank failed inside a collective this rank was taking part in.

    Raised by the shared-memory all-reduce on the ranks of a node group when one of them
    raised during the reduction: instead of waiting for a rank that will not come, every
    rank stops. The failing rank raises its own exception.

    Attributes:
        failed: the ranks (of the node group) that failed.
    """

    def __init__(self, message: str, failed: list[int]) -> None:
        super().__init__(message)
        self.failed = failed


class PeerLostError(MpistratError, RuntimeError):
    """Ranks of the job can no longer be reached: their host went down, their processes
    were killed, or the network between the hosts failed (a partition).

    Raised (and reported) by ``mpistrat run``'s watchdog when a collective cannot finish
    because of them. An MPI job cannot continue without its ranks: the job ends, and a
    rerun resumes from the last complete checkpoint.

    Attributes:
        lost: the ranks that did not answer, by host name (``{"node2": [2, 3]}``).
    """

    def __init__(self, message: str, lost: dict[str, list[int]]) -> None:
        super().__init__(message)
        self.lost = lost


class DuplicateDeviceError(TopologyError):
    """Two ranks of one communicator would use the same physical GPU."""


class PackingError(MpistratError, ValueError):
    """A batch, plan or packing option that cannot be packed as asked."""


class PackingTypeError(PackingError, TypeError):
    """A packing argument of the wrong Python type."""


class ArenaFullError(MpistratError, MemoryError):
    """A variable does not fit in the free part of a parameter server's arena (also
    importable from ``mpistrat.ps`` and ``mpistrat.ps.store``, where it was defined)."""


class CheckpointNotFoundError(MpistratError, FileNotFoundError):
    """No complete checkpoint at the path (never written, or its manifest is missing)."""


class CheckpointCorruptError(MpistratError, ValueError):
    """A checkpoint whose files do not match its manifest (torn, truncated, edited)."""


class RunSetupError(MpistratError, RuntimeError):
    """``mpistrat run`` (or ``bench --np``) cannot start: a missing script, an MPI launcher
    that does not match mpi4py's library, ``-n``/``--np`` under a launcher. Raised on every
    rank."""


class CancelledError(MpistratError, RuntimeError):
    """A closure scheduled on a :class:`~mpistrat.ClusterCoordinator` was cancelled (an
    earlier closure failed, so the coordinator threw the queue away) or aborted: its
    ``RemoteValue.fetch()`` raises this (TF's ``tf.errors.CancelledError``); schedule the
    function again."""


class WorkerUnavailableError(MpistratError, RuntimeError):
    """A worker could not run a closure for a transient reason (TF's worker
    ``UnavailableError``). Raised inside a scheduled function, the
    :class:`~mpistrat.ClusterCoordinator` runs the closure again, on any worker, and
    rebuilds that worker's per-worker datasets; it never reaches the user's program."""


class TraceError(MpistratError, ValueError):
    """A trace cannot be started (a bad step window, a directory that cannot be
    written), or a trace file cannot be read (not a trace, damaged, another job's)."""


class UnsupportedError(MpistratError, RuntimeError):
    """A ``tf.distribute`` name that exists here so that code naming it imports and its
    ``isinstance`` checks work, but that cannot work over MPI (TPUs, Google Cloud or
    Kubernetes discovery, TF's gRPC calls); the message names what to use instead."""


class OutOfRangeError(MpistratError, IndexError):
    """``get_next()`` on a distributed iterator whose input has ended on every worker (TF's
    ``tf.errors.OutOfRangeError``); ``next()`` raises ``StopIteration`` instead."""


class DuplicateTaskError(MpistratError, KeyError, ValueError):
    """A cluster in which one task of a job is given twice (``UnionResolver`` merging two
    resolvers that both name it). A ``KeyError`` as in TF, and a ``ValueError`` as every
    bad input here."""

    def __str__(self) -> str:  # (KeyError's own would quote the message)
        return str(self.args[0]) if self.args else ""
