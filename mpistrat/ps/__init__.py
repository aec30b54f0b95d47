"""Parameter-server training over MPI (TF's ``ParameterServerStrategy``).

* :mod:`.roles`: the coordinator, ps and worker ranks;
* :mod:`.store`: the variables, in MPI window arenas on the ps ranks;
* :mod:`.strategy`: ``ParameterServerStrategy`` and its variables;
* :mod:`.coordinator`: ``ClusterCoordinator``, ``RemoteValue``, ``PerWorkerValues``;
* :mod:`.worker`: what a worker runs; :mod:`.server`: ``Server``;
* :mod:`.elastic`: the coordinator's snapshots under ``mpistrat run --min-ranks``.

Importing this package does not start MPI (nor import the strategy); creating a
:class:`VariableStore` or a strategy does. The public names are on :mod:`mpistrat`.
"""

from __future__ import annotations

from .store import (
    ARENA_ENV,
    DEFAULT_ARENA_BYTES,
    SUPPORTED_DTYPES,
    ArenaFullError,
    ShardedHandle,
    VariableHandle,
    VariableStore,
    arena_bytes_from_env,
)

__all__ = [
    "ARENA_ENV",
    "DEFAULT_ARENA_BYTES",
    "SUPPORTED_DTYPES",
    "ArenaFullError",
    "ShardedHandle",
    "VariableHandle",
    "VariableStore",
    "arena_bytes_from_env",
]
