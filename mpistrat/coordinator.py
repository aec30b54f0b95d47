"""``tf.distribute.coordinator``: parameter-server training's coordinator (see docs/ps.md).

``import mpistrat as tfd`` then ``tfd.coordinator.ClusterCoordinator(strategy)``, as in
TF. Importing this module loads the parameter-server code (and cloudpickle);
``import mpistrat`` alone does not.
"""

from __future__ import annotations

from .ps.coordinator import ClusterCoordinator, PerWorkerValues, RemoteValue
from .ps.worker import experimental_get_current_worker_index

#: TF's name for it in ``tf.distribute.coordinator`` (``PerWorkerValues`` in
#: ``tf.distribute.experimental.coordinator``): the same class.
PerWorkerValue = PerWorkerValues

__all__ = ["ClusterCoordinator", "PerWorkerValue", "RemoteValue",
           "experimental_get_current_worker_index"]
