"""All-reduce algorithms: the registry of names (pure, no MPI) and, later, their implementations."""

from __future__ import annotations

from .registry import AlgorithmInfo, Shards, get, names, register

__all__ = ["AlgorithmInfo", "Shards", "get", "names", "register"]
