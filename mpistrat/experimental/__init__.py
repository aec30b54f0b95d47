"""``tf.distribute.experimental`` under mpistrat: TF's experimental names, the same objects
as mpistrat's top-level ones (``import mpistrat as tfd`` then
``tfd.experimental.CentralStorageStrategy()``, ``tfd.experimental.partitioners...``).

``ParameterServerStrategy`` and the ``coordinator`` submodule load the parameter-server
code on first use, so that importing this module does not import cloudpickle.
"""

from __future__ import annotations

from typing import Any

from ..checkpoint import PreemptionCheckpointHandler, PreemptionWatcher, TerminationConfig
from ..communication import (
    CollectiveCommunication,
    CollectiveHints,
    CommunicationImplementation,
    CommunicationOptions,
)
from ..strategy import (
    CentralStorageStrategy,
    MultiWorkerMirroredStrategy,
    TPUStrategy,
    ValueContext,
)
from . import partitioners, rpc

__all__ = [
    "CentralStorageStrategy", "CollectiveCommunication", "CollectiveHints",
    "CommunicationImplementation", "CommunicationOptions", "MultiWorkerMirroredStrategy",
    "ParameterServerStrategy", "PreemptionCheckpointHandler", "PreemptionWatcher", "TPUStrategy",
    "TerminationConfig", "ValueContext",
    "coordinator", "partitioners", "rpc",
]


def __getattr__(name: str) -> Any:
    import importlib

    if name == "ParameterServerStrategy":  # (where mpistrat's lazy name loads it from)
        value = importlib.import_module("mpistrat.ps.strategy").ParameterServerStrategy
    elif name == "coordinator":
        value = importlib.import_module("mpistrat.experimental.coordinator")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value
