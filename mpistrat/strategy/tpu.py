"""``TPUStrategy``: named, so that TF code that mentions it imports and its
``isinstance(strategy, TPUStrategy)`` branches work, but not constructible: an MPI job has
no TPUs."""

from __future__ import annotations

from typing import Any

from ..errors import UnsupportedError
from .base import Strategy

__all__ = ["TPUStrategy"]


class TPUStrategy(Strategy):
    """TF's ``tf.distribute.TPUStrategy`` (and ``tf.distribute.experimental.TPUStrategy``).

    Raises:
        UnsupportedError: always. TPUs are reached through TF's TPU runtime and XLA, which an
            MPI job does not have; use :class:`MultiWorkerMirroredStrategy` (one rank per
            GPU, or CPU replicas), which runs the same ``strategy.run`` training loops.
    """

    def __init__(self, tpu_cluster_resolver: Any = None, experimental_device_assignment: Any = None,
                 experimental_spmd_xla_partitioning: bool = False, **kwargs: Any) -> None:
        raise UnsupportedError(
            "TPUStrategy needs TF's TPU runtime and XLA compiler, and mpistrat runs over MPI "
            "without TensorFlow, so there are no TPUs to train on; use "
            "mpistrat.MultiWorkerMirroredStrategy() (GPUs through NCCL, or CPU replicas) with "
            "the same strategy.run / strategy.reduce loop, launched by `mpistrat run -n N`"
        )
