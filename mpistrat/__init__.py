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
from .errors import CollectiveTimeoutError  # noqa: E402
from .values import DistributedValues, Mirrored, PerReplica  # noqa: E402

__all__ += [
    "CollectiveCommunication", "CommunicationImplementation", "CommunicationOptions",
    "CrossDeviceOps", "ReductionToOneDevice", "AllReduceCrossDeviceOps", "NcclAllReduce",
    "HierarchicalCopyAllReduce", "MultiWorkerAllReduce", "CollectiveTimeoutError",
    "DistributedValues", "PerReplica", "Mirrored",
]
