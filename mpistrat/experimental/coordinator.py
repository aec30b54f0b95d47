"""``tf.distribute.experimental.coordinator``: the older spelling of
:mod:`mpistrat.coordinator`, with the same classes."""

from __future__ import annotations

from ..ps.coordinator import ClusterCoordinator, PerWorkerValues, RemoteValue

__all__ = ["ClusterCoordinator", "PerWorkerValues", "RemoteValue"]
