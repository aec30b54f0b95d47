"""The strategy API of tf.distribute over MPI: strategies, replica contexts, the context
functions and distributed variables (see docs/strategies.md)."""

from __future__ import annotations

from .base import Strategy, StrategyExtended
from .central_storage import AggregatingVariable, CentralStorageStrategy
from .context import (
    experimental_set_strategy,
    get_cross_replica_context,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)
from .mirrored import MirroredStrategy, MultiWorkerMirroredStrategy, OneDeviceStrategy
from .replica import ReplicaContext, ValueContext
from .run_options import RunOptions
from .tpu import TPUStrategy
from .variables import (
    DistributedVariable,
    MirroredVariable,
    SyncOnReadVariable,
    Variable,
    VariableAggregation,
    VariableSynchronization,
)

__all__ = [
    "Strategy", "StrategyExtended", "MultiWorkerMirroredStrategy", "MirroredStrategy",
    "OneDeviceStrategy", "ReplicaContext", "ValueContext", "get_strategy", "has_strategy",
    "get_replica_context", "get_cross_replica_context", "in_cross_replica_context",
    "experimental_set_strategy", "Variable", "VariableSynchronization", "VariableAggregation",
    "DistributedVariable", "MirroredVariable", "SyncOnReadVariable",
    "CentralStorageStrategy", "AggregatingVariable", "RunOptions", "TPUStrategy",
]
