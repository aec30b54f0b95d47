"""mpistrat: TensorFlow's tf.distribute all-reduce machinery over MPI, without TensorFlow.

Importing this package never initialises MPI and never imports CuPy: MPI starts when a
function that needs a communicator runs, and GPU support is probed lazily.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .errors import (
    BackendUnavailable,
    MpistratError,
    SpecError,
    SpecTypeError,
    TopologyError,
    UnknownAlgorithmError,
)
from .spec import AllReduceSpec, AllReduceSpecTuple, parse_spec

__all__ = [
    "__version__",
    "AllReduceSpec",
    "AllReduceSpecTuple",
    "parse_spec",
    "MpistratError",
    "SpecError",
    "SpecTypeError",
    "UnknownAlgorithmError",
    "TopologyError",
    "BackendUnavailable",
]

from .allreduce import CollectiveMismatchError, all_reduce  # noqa: E402
from .ops import ReduceOp  # noqa: E402

__all__ += ["all_reduce", "CollectiveMismatchError", "ReduceOp"]

from .communication import (  # noqa: E402
    CollectiveCommunication,
    CommunicationImplementation,
    CommunicationOptions,
)
from .cross_device_ops import (  # noqa: E402
    AllReduceCrossDeviceOps,
    CrossDeviceOps,
    HierarchicalCopyAllReduce,
    MultiWorkerAllReduce,
    NcclAllReduce,
    ReductionToOneDevice,
)
from .errors import CollectiveAbortedError, CollectiveTimeoutError  # noqa: E402
from .packing import flat_arrays  # noqa: E402
from .runtime.shared import (  # noqa: E402
    free_shared,
    is_shared,
    shared_arrays,
    shared_empty,
    shared_zeros,
)
from .values import DistributedValues, Mirrored, PerReplica  # noqa: E402

__all__ += [
    "CollectiveCommunication", "CommunicationImplementation", "CommunicationOptions",
    "CrossDeviceOps", "ReductionToOneDevice", "AllReduceCrossDeviceOps", "NcclAllReduce",
    "HierarchicalCopyAllReduce", "MultiWorkerAllReduce", "CollectiveTimeoutError",
    "CollectiveAbortedError", "shared_empty", "shared_zeros", "shared_arrays", "free_shared",
    "is_shared", "flat_arrays",
    "DistributedValues", "PerReplica", "Mirrored",
]

from .cluster import (  # noqa: E402
    ClusterInfo,
    ClusterResolver,
    ClusterSpec,
    MPIClusterResolver,
    SimpleClusterResolver,
    SlurmClusterResolver,
    TFConfigClusterResolver,
    check_against_world,
    resolve_cluster,
    should_checkpoint,
)
from .data import (  # noqa: E402
    AutoShardPolicy,
    Dataset,
    DistributedDataset,
    DistributedIterator,
    InputContext,
    InputOptions,
    InputReplicationMode,
    Options,
)
from .strategy import (  # noqa: E402
    CentralStorageStrategy,
    MirroredStrategy,
    MirroredVariable,
    MultiWorkerMirroredStrategy,
    OneDeviceStrategy,
    ReplicaContext,
    RunOptions,
    Strategy,
    StrategyExtended,
    SyncOnReadVariable,
    TPUStrategy,
    ValueContext,
    Variable,
    VariableAggregation,
    VariableSynchronization,
    experimental_set_strategy,
    get_cross_replica_context,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)

__all__ += [
    "ClusterSpec", "ClusterResolver", "SimpleClusterResolver", "MPIClusterResolver",
    "TFConfigClusterResolver", "SlurmClusterResolver", "ClusterInfo", "resolve_cluster",
    "check_against_world", "should_checkpoint",
    "Dataset", "Options", "AutoShardPolicy", "InputOptions", "InputReplicationMode",
    "InputContext", "DistributedDataset", "DistributedIterator",
    "Strategy", "StrategyExtended", "MultiWorkerMirroredStrategy", "MirroredStrategy",
    "OneDeviceStrategy", "ReplicaContext", "ValueContext", "get_strategy", "has_strategy",
    "get_replica_context", "get_cross_replica_context", "in_cross_replica_context",
    "experimental_set_strategy", "Variable", "VariableSynchronization", "VariableAggregation",
    "MirroredVariable", "SyncOnReadVariable", "CentralStorageStrategy", "RunOptions",
    "TPUStrategy",
]

from .checkpoint import (  # noqa: E402
    Checkpoint,
    CheckpointCorruptError,
    CheckpointManager,
    CheckpointNotFoundError,
    PreemptionCheckpointHandler,
    Scalar,
    latest_checkpoint,
)

__all__ += ["Checkpoint", "CheckpointManager", "latest_checkpoint", "Scalar",
            "PreemptionCheckpointHandler", "CheckpointNotFoundError", "CheckpointCorruptError"]

from . import elastic  # noqa: E402  (mpistrat run --min-ranks: info(), step())
from . import trace  # noqa: E402  (mpistrat run --trace; start(), step(), span())

__all__ += ["elastic", "trace"]

# tf.distribute.experimental.partitioners: the classes here, the whole set (with the
# shard-size helpers) in mpistrat.partitioners
from .partitioners import (  # noqa: E402
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    Partitioner,
)

__all__ += ["Partitioner", "FixedShardsPartitioner", "MinSizePartitioner", "MaxSizePartitioner"]


from .errors import CancelledError, WorkerUnavailableError  # noqa: E402

__all__ += ["CancelledError", "WorkerUnavailableError"]

# parameter-server training (tf.distribute.ParameterServerStrategy, tf.distribute.
# coordinator): loaded on first use, so `import mpistrat` does not import cloudpickle
_PS_NAMES = {
    "ParameterServerStrategy": "mpistrat.ps.strategy",
    "PSVariable": "mpistrat.ps.strategy",
    "ShardedVariable": "mpistrat.ps.strategy",
    "ClusterCoordinator": "mpistrat.ps.coordinator",
    "RemoteValue": "mpistrat.ps.coordinator",
    "PerWorkerValues": "mpistrat.ps.coordinator",
    "experimental_get_current_worker_index": "mpistrat.ps.worker",
    "Server": "mpistrat.ps.server",
}
__all__ += list(_PS_NAMES)

# tf.distribute's submodules: tfd.experimental.X, tfd.cluster_resolver.X (and, loaded on
# first use, tfd.coordinator.X)
from . import cluster_resolver, experimental  # noqa: E402

__all__ += ["cluster_resolver", "experimental", "coordinator"]


def __getattr__(name: str) -> object:
    if name in _PS_NAMES:
        import importlib

        value = getattr(importlib.import_module(_PS_NAMES[name]), name)
        globals()[name] = value
        return value
    if name == "coordinator":  # tf.distribute.coordinator (loads the parameter-server code)
        import importlib

        module = importlib.import_module("mpistrat.coordinator")
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _keep_old_module_paths() -> None:
    """The MPI substrate lives in :mod:`mpistrat.runtime`; scripts written against the old
    paths (``mpistrat.topology``, ``.devices``, ``.shared``, ``._agreement``, ``._stall``)
    get the same modules."""
    # inside the function: the package namespace gains only the five old names
    import sys

    from .runtime import agreement, devices, shared, stall, topology

    for old, module in (("topology", topology), ("devices", devices), ("shared", shared),
                        ("_agreement", agreement), ("_stall", stall)):
        sys.modules[f"{__name__}.{old}"] = module
        globals()[old] = module


_keep_old_module_paths()
