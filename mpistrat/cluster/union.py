"""``UnionResolver``: one cluster from several resolvers (TF's
``tf.distribute.cluster_resolver.UnionResolver``), for instance the workers found by
:class:`SlurmClusterResolver` plus parameter servers given in code."""

from __future__ import annotations

from typing import Any

from ..errors import DuplicateTaskError
from .base import ClusterResolver, coerce_task_id
from .cluster_spec import ClusterSpec, format_master_url

__all__ = ["UnionResolver"]


class UnionResolver(ClusterResolver):
    """The union of the clusters of ``resolvers``.

    A job that every resolver lists as a list of addresses (tasks ``0..n-1``) is
    concatenated in the resolvers' order, the tasks renumbered; a job that some resolver
    gives as ``{index: address}`` keeps the indices, and an index given twice is an error.

    ``task_type``, ``task_id`` and ``rpc_layer`` given here win; otherwise they, and
    :attr:`environment`, :meth:`master` and :meth:`num_accelerators`, come from the first
    resolver.

    Args:
        *resolvers: at least one :class:`ClusterResolver`.
        task_type, task_id, rpc_layer: this task (keywords only).

    Raises:
        ValueError: no resolver, or an unknown keyword argument.
        TypeError: an argument that is not a ClusterResolver.

    :meth:`cluster_spec` raises :class:`~mpistrat.errors.DuplicateTaskError` (a ``KeyError``,
    TF's error, and a ``ValueError``) for a task index that two
    resolvers both give, naming the task, both addresses and both resolvers.
    """

    def __init__(self, *resolvers: ClusterResolver, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - {"task_type", "task_id", "rpc_layer"})
        if unknown:
            raise ValueError(f"UnionResolver got unexpected keyword arguments {unknown}; it "
                             f"takes resolvers, then task_type=, task_id= and rpc_layer=")
        if not resolvers:
            raise ValueError("UnionResolver needs at least one ClusterResolver, e.g. "
                             "UnionResolver(SlurmClusterResolver(), SimpleClusterResolver(ps))")
        for i, resolver in enumerate(resolvers):
            if not isinstance(resolver, ClusterResolver):
                raise TypeError(f"UnionResolver's argument {i} is a {type(resolver).__name__}, "
                                f"not a ClusterResolver; pass resolvers such as "
                                f"SimpleClusterResolver(ClusterSpec(...))")
        self._resolvers = resolvers
        if kwargs.get("task_type") is not None:
            self.task_type = kwargs["task_type"]
        if kwargs.get("task_id") is not None:
            self.task_id = coerce_task_id(kwargs["task_id"])
        self._rpc_layer = kwargs.get("rpc_layer")
        self.source = "the union of " + ", ".join(type(r).__name__ for r in resolvers)

    @property
    def resolvers(self) -> tuple[ClusterResolver, ...]:
        """The resolvers, in the order given."""
        return self._resolvers

    def cluster_spec(self) -> ClusterSpec:
        """Every resolver's jobs merged (see the class); asks each resolver every time.

        Raises:
            DuplicateTaskError: (a ``KeyError`` and a ``ValueError``) two resolvers give the
                same task index of a job.
        """
        specs: list[tuple[str, dict[str, Any]]] = []
        failure: Exception | None = None
        for i, resolver in enumerate(self._resolvers):
            # Every resolver is asked even after one failed: one may be collective (the
            # MPIClusterResolver's first cluster_spec), and a rank that skipped it because
            # an earlier resolver failed there would leave the other ranks waiting in it.
            try:
                specs.append((f"resolver {i} ({type(resolver).__name__})",
                              resolver.cluster_spec().as_dict()))
            except Exception as exc:  # re-raised below, once every resolver was asked
                failure = exc if failure is None else failure
        if failure is not None:
            raise failure
        dense = {job for _, spec in specs for job in spec}
        dense -= {job for _, spec in specs for job, tasks in spec.items()
                  if isinstance(tasks, dict)}
        merged: dict[str, Any] = {}
        owner: dict[tuple[str, int], str] = {}
        for name, spec in specs:
            for job, tasks in spec.items():
                if job in dense:
                    merged.setdefault(job, []).extend(tasks)
                    continue
                target = merged.setdefault(job, {})
                items = tasks.items() if isinstance(tasks, dict) else enumerate(tasks)
                for index, address in items:
                    if index in target:
                        # a KeyError, as TF's UnionResolver raises for a task given twice
                        raise DuplicateTaskError(
                            f"UnionResolver: task {job}:{index} is given twice, as "
                            f"{target[index]} by {owner[job, index]} and as {address} by "
                            f"{name}; "
                            f"give each task of a job with sparse indices once, or list the "
                            f"job's tasks as plain lists so they are numbered one after another"
                        )
                    target[index] = address
                    owner[job, index] = name
        return ClusterSpec(merged)

    def master(self, task_type: str | None = None, task_id: int | None = None,
               rpc_layer: str | None = None) -> str:
        """The address of ``task_type:task_id`` in the merged cluster; without them, the
        first resolver's ``master``."""
        if task_type is not None and task_id is not None:
            return format_master_url(self.cluster_spec().task_address(task_type, task_id),
                                     rpc_layer or self.rpc_layer)
        return self._resolvers[0].master(rpc_layer=rpc_layer or self._rpc_layer)

    def _default_task_type(self) -> str | None:
        return self._resolvers[0].task_type

    def _default_task_id(self) -> int | None:
        return self._resolvers[0].task_id

    @property
    def rpc_layer(self) -> str | None:
        """The one given here, else the first resolver's."""
        return self._rpc_layer if self._rpc_layer is not None else self._resolvers[0].rpc_layer

    @rpc_layer.setter
    def rpc_layer(self, value: str | None) -> None:
        self._rpc_layer = value

    @property
    def environment(self) -> str:
        """The first resolver's."""
        return self._resolvers[0].environment

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                         config_proxy: Any = None) -> dict[str, int]:
        """The first resolver's answer."""
        return self._resolvers[0].num_accelerators(task_type, task_id, config_proxy)
