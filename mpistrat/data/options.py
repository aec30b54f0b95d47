"""Dataset and input options: ``Options().experimental_distribute.auto_shard_policy`` (how a
dataset is split across workers) and ``InputOptions`` (how a distributed input is replicated).

The names and values are TensorFlow's (``tf.data.Options``,
``tf.data.experimental.AutoShardPolicy``, ``tf.distribute.InputOptions``,
``tf.distribute.InputReplicationMode``), so TF scripts set them unchanged.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

__all__ = [
    "AutoShardPolicy",
    "AutoShardWarning",
    "DistributeOptions",
    "Options",
    "InputReplicationMode",
    "InputOptions",
]


class AutoShardPolicy(enum.IntEnum):
    """How a distributed dataset is split across workers (TF's values).

    OFF: every worker sees the whole dataset. AUTO: FILE when the dataset is read from
    files (``Dataset.from_files``), DATA otherwise. FILE: worker ``w`` reads files ``w,
    w+W, ...``. DATA: every worker runs the whole pipeline and keeps its share of each
    global batch.
    """

    OFF = -1
    AUTO = 0
    FILE = 1
    DATA = 2


class AutoShardWarning(UserWarning):
    """AUTO sharding fell back to DATA sharding (the dataset is not read from files)."""


class DistributeOptions:
    """``Options().experimental_distribute``: the distribution options of a dataset.

    An option that was never set reads as its default and does not override another
    dataset's value when options are merged.
    """

    __slots__ = ("_auto_shard_policy",)

    def __init__(self) -> None:
        self._auto_shard_policy: AutoShardPolicy | None = None

    @property
    def auto_shard_policy(self) -> AutoShardPolicy:
        """The :class:`AutoShardPolicy` (default ``AUTO``)."""
        if self._auto_shard_policy is None:
            return AutoShardPolicy.AUTO
        return self._auto_shard_policy

    @auto_shard_policy.setter
    def auto_shard_policy(self, value: Any) -> None:
        self._auto_shard_policy = _policy(value)

    def _merged(self, newer: DistributeOptions) -> DistributeOptions:
        out = DistributeOptions()
        out._auto_shard_policy = (newer._auto_shard_policy
                                  if newer._auto_shard_policy is not None
                                  else self._auto_shard_policy)
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DistributeOptions):
            return NotImplemented
        return self._auto_shard_policy == other._auto_shard_policy

    def __hash__(self) -> int:
        return hash(self._auto_shard_policy)

    def __repr__(self) -> str:
        return f"DistributeOptions(auto_shard_policy={self.auto_shard_policy.name})"


def _policy(value: Any) -> AutoShardPolicy:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"auto_shard_policy must be an AutoShardPolicy (OFF, AUTO, FILE or DATA), got "
            f"{value!r} ({type(value).__name__})"
        )
    try:
        return AutoShardPolicy(value)
    except ValueError:
        valid = ", ".join(f"{p.name}={p.value}" for p in AutoShardPolicy)
        raise ValueError(
            f"auto_shard_policy {value!r} is not a policy; use one of {valid}"
        ) from None


class Options:
    """A dataset's options (``tf.data.Options``): ``experimental_distribute`` and
    ``experimental_deterministic``.

    Attach them with ``dataset.with_options(options)``; read them with
    ``dataset.options()``. Unknown attributes raise ``AttributeError``, so a misspelt
    option is never silently ignored.
    """

    __slots__ = ("_distribute", "_deterministic")

    def __init__(self) -> None:
        self._distribute = DistributeOptions()
        self._deterministic: bool | None = None

    @property
    def experimental_deterministic(self) -> bool:
        """Accepted for TF scripts (default True). Pipelines here always produce
        elements in order, so False changes nothing."""
        return True if self._deterministic is None else self._deterministic

    @experimental_deterministic.setter
    def experimental_deterministic(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"experimental_deterministic must be a bool, got {value!r}")
        self._deterministic = value

    @property
    def experimental_distribute(self) -> DistributeOptions:
        """The :class:`DistributeOptions` (``auto_shard_policy``)."""
        return self._distribute

    @experimental_distribute.setter
    def experimental_distribute(self, value: DistributeOptions) -> None:
        if not isinstance(value, DistributeOptions):
            raise TypeError(
                f"experimental_distribute must be a DistributeOptions, got "
                f"{type(value).__name__}; set its fields instead: "
                f"options.experimental_distribute.auto_shard_policy = AutoShardPolicy.DATA"
            )
        self._distribute = value

    def merge(self, options: Options) -> Options:
        """These options updated with every option set in ``options`` (the newer wins)."""
        if not isinstance(options, Options):
            raise TypeError(f"can only merge Options, got {type(options).__name__}")
        out = Options()
        out._distribute = self._distribute._merged(options._distribute)
        out._deterministic = (options._deterministic if options._deterministic is not None
                              else self._deterministic)
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Options):
            return NotImplemented
        return (self._distribute, self._deterministic) == (other._distribute,
                                                           other._deterministic)

    def __hash__(self) -> int:
        return hash((self._distribute, self._deterministic))

    def __repr__(self) -> str:
        return (f"Options(experimental_distribute={self._distribute!r}, "
                f"experimental_deterministic={self.experimental_deterministic})")


class InputReplicationMode(enum.Enum):
    """How ``distribute_datasets_from_function`` replicates the input pipeline.

    PER_WORKER: the function runs once per worker and the worker's replicas take
    consecutive elements. PER_REPLICA: the function runs once per replica.
    """

    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"


@dataclass(frozen=True)
class InputOptions:
    """Options of a distributed input (``tf.distribute.InputOptions``).

    Attributes:
        experimental_prefetch_to_device: move each batch to its replica's device as it is
            produced (the strategy does the move; host replicas ignore it).
        experimental_replication_mode: :class:`InputReplicationMode` (PER_REPLICA only
            with ``distribute_datasets_from_function``).
        experimental_fetch_to_device: the newer name of the prefetch option; when set
            (not None) it wins over ``experimental_prefetch_to_device``.
    """

    experimental_prefetch_to_device: bool = True
    experimental_replication_mode: InputReplicationMode = InputReplicationMode.PER_WORKER
    experimental_fetch_to_device: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.experimental_prefetch_to_device, bool):
            raise TypeError(f"experimental_prefetch_to_device must be a bool, got "
                            f"{self.experimental_prefetch_to_device!r}")
        if not isinstance(self.experimental_replication_mode, InputReplicationMode):
            raise TypeError(
                f"experimental_replication_mode must be InputReplicationMode.PER_WORKER or "
                f"PER_REPLICA, got {self.experimental_replication_mode!r}"
            )
        fetch = self.experimental_fetch_to_device
        if fetch is not None and not isinstance(fetch, bool):
            raise TypeError(f"experimental_fetch_to_device must be a bool or None, got "
                            f"{fetch!r}")

    @property
    def fetch_to_device(self) -> bool:
        """Whether batches go to the replicas' devices: ``experimental_fetch_to_device``
        when set, else ``experimental_prefetch_to_device``."""
        if self.experimental_fetch_to_device is not None:
            return self.experimental_fetch_to_device
        return self.experimental_prefetch_to_device
