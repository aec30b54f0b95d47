"""``ClusterResolver``: the interface every resolver implements, and ``SimpleClusterResolver``.

A cluster resolver answers, for the process it runs in: which cluster is this
(:meth:`~ClusterResolver.cluster_spec`), which task am I (``task_type``, ``task_id``),
how many accelerators do I have (:meth:`~ClusterResolver.num_accelerators`) and what is
my server's URL (:meth:`~ClusterResolver.master`). From those follow the worker count,
this task's worker id and whether it is the chief (see :mod:`.multi_worker`).

Resolvers never raise from their constructors for problems in the environment: a
missing or malformed variable is raised on first use. So under MPI, where
:func:`~mpistrat.cluster.resolve_cluster` checks every rank's resolver collectively, a
bad environment on one rank becomes an error on every rank instead of a hang.
"""

from __future__ import annotations

import numbers
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

from ..backends.capabilities import probe_gpus
from .cluster_spec import ClusterSpec, format_master_url
from .multi_worker import id_in_cluster, is_chief, validate_cluster_spec, worker_count

__all__ = ["ClusterResolver", "SimpleClusterResolver", "coerce_task_id", "local_gpu_count"]

_UNSET: Any = object()


def local_gpu_count() -> int:
    """The number of CUDA devices this process sees (0 without CuPy or CUDA)."""
    return len(probe_gpus().devices)


def coerce_task_id(value: Any, what: str = "task_id") -> int | None:
    """``value`` as a task index: None, an int, or a string of digits (TF_CONFIG's ``"1"``).

    Raises:
        ValueError: anything else (bools, fractions, negative numbers, other text).
    """
    if value is None:
        return None
    number: int | None = None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        number = int(value)
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, str) and value.strip().isdigit():
        number = int(value.strip())
    if number is None or number < 0:
        raise ValueError(
            f"{what} must be a non-negative integer (or a string of digits), got "
            f"{type(value).__name__} {value!r}"
        )
    return number


class ClusterResolver(ABC):
    """Where this process sits in a cluster (TF's ``tf.distribute.cluster_resolver``).

    Subclasses implement :meth:`cluster_spec` and may override the ``_default_*``
    hooks; ``task_type``, ``task_id`` and ``rpc_layer`` can be set, and a set value
    takes precedence over what the resolver found.
    """

    _task_type: Any = _UNSET
    _task_id: Any = _UNSET
    _rpc_layer: str | None = None
    _environment: str = ""
    #: Where the cluster comes from, for messages.
    source: str = "the cluster spec"

    @abstractmethod
    def cluster_spec(self) -> ClusterSpec:
        """The cluster (an empty ``ClusterSpec`` means local mode: one worker)."""

    def master(self, task_type: str | None = None, task_id: int | None = None,
               rpc_layer: str | None = None) -> str:
        """The URL of task ``(task_type, task_id)`` (default: this task).

        ``""`` when the task is unknown or the cluster is empty; otherwise the task's
        address, prefixed with ``"<rpc_layer>://"`` when an rpc layer is known.
        """
        task_type = self.task_type if task_type is None else task_type
        task_id = self.task_id if task_id is None else task_id
        if task_type is None or task_id is None:
            return ""
        spec = self.cluster_spec()
        if not spec:
            return ""
        return format_master_url(spec.task_address(task_type, task_id),
                                 rpc_layer or self.rpc_layer)

    @property
    def task_type(self) -> str | None:
        """This task's job name (``"chief"``, ``"worker"``, ...), or None if unknown."""
        return self._default_task_type() if self._task_type is _UNSET else self._task_type

    @task_type.setter
    def task_type(self, value: Any) -> None:
        self._task_type = None if value is None else str(value)

    @property
    def task_id(self) -> int | None:
        """This task's index within its job, or None if unknown."""
        return self._default_task_id() if self._task_id is _UNSET else self._task_id

    @task_id.setter
    def task_id(self, value: Any) -> None:
        self._task_id = coerce_task_id(value)

    def _default_task_type(self) -> str | None:
        return None

    def _default_task_id(self) -> int | None:
        return None

    @property
    def rpc_layer(self) -> str | None:
        """The protocol of :meth:`master` URLs (``"grpc"``), or None."""
        return self._rpc_layer

    @rpc_layer.setter
    def rpc_layer(self, value: str | None) -> None:
        self._rpc_layer = value

    @property
    def environment(self) -> str:
        """The environment the cluster runs in (TF: ``""``, or ``"google"``)."""
        return self._environment

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                         config_proxy: Any = None) -> dict[str, int]:
        """Accelerators of a task by device type, e.g. ``{"GPU": 2}``; ``{}`` for none.

        This base implementation counts the CUDA devices this process sees, so it
        only answers for this task. ``config_proxy`` (a TF session config) is ignored.

        Raises:
            ValueError: ``(task_type, task_id)`` names another task.
        """
        self._require_own_task(task_type, task_id)
        count = local_gpu_count()
        return {"GPU": count} if count else {}

    def _require_own_task(self, task_type: str | None, task_id: int | None) -> None:
        if (task_type is not None and task_type != self.task_type) or (
                task_id is not None and task_id != self.task_id):
            raise ValueError(
                f"{type(self).__name__}.num_accelerators counts the devices this process "
                f"sees, so it can only answer for this task ({self.task_type}:"
                f"{self.task_id}), not for {task_type}:{task_id}; call it on that task"
            )

    def validate(self) -> None:
        """Check this task against the cluster (see :func:`.validate_cluster_spec`)."""
        validate_cluster_spec(self.cluster_spec(), self.task_type, self.task_id, self.source)

    @property
    def num_workers(self) -> int:
        """The number of workers training together (1 in local mode)."""
        self.validate()
        return worker_count(self.cluster_spec(), self.task_type)

    @property
    def worker_index(self) -> int:
        """This task's worker id: 0 for the chief, then the workers in order."""
        self.validate()
        return id_in_cluster(self.cluster_spec(), self.task_type, self.task_id)

    @property
    def is_chief(self) -> bool:
        """True on the task that checkpoints and writes summaries."""
        self.validate()
        return is_chief(self.cluster_spec(), self.task_type, self.task_id)


class SimpleClusterResolver(ClusterResolver):
    """A resolver that returns what it was given (TF's ``SimpleClusterResolver``).

    Args:
        cluster_spec: the cluster (a ``ClusterSpec`` or a dict).
        master: the URL :meth:`master` returns when no task is given.
        task_type, task_id: this task.
        environment: the value of :attr:`environment`.
        num_accelerators: accelerators per task (e.g. ``{"GPU": 2}``), the same for
            every task; None counts this process's GPUs.
        rpc_layer: the protocol of :meth:`master` URLs.
    """

    def __init__(self, cluster_spec: ClusterSpec | Mapping[str, Any], master: str = "",
                 task_type: str | None = None, task_id: int | None = None,
                 environment: str = "", num_accelerators: Mapping[str, int] | None = None,
                 rpc_layer: str | None = None) -> None:
        self._spec = ClusterSpec(cluster_spec)
        self._master = master
        self.task_type = task_type
        self.task_id = task_id
        self._environment = environment
        self._accelerators = None if num_accelerators is None else dict(num_accelerators)
        self._rpc_layer = rpc_layer

    def cluster_spec(self) -> ClusterSpec:
        """The cluster given to the constructor."""
        return self._spec

    def master(self, task_type: str | None = None, task_id: int | None = None,
               rpc_layer: str | None = None) -> str:
        """The given task's address, else the ``master`` given to the constructor."""
        if task_type is not None and task_id is not None:
            address = self._spec.task_address(task_type, task_id)
        else:
            address = self._master
        return format_master_url(address, rpc_layer or self.rpc_layer) if address else ""

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                         config_proxy: Any = None) -> dict[str, int]:
        """The accelerators given to the constructor, else this process's GPUs."""
        if self._accelerators is not None:
            return dict(self._accelerators)
        return super().num_accelerators(task_type, task_id, config_proxy)
