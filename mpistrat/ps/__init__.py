"""Parameter-server building blocks: the variable store on the ps ranks' MPI windows.

Importing this package does not start MPI; creating a :class:`VariableStore` does.
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
