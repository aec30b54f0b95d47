"""``Server``: what a worker or ps rank runs when the script branches on its task.

TF's parameter-server scripts start a ``tf.distribute.Server`` on every worker and ps
task and ``join()`` it, while the chief builds the strategy. Over MPI the ranks of one
job are the tasks, so ``Server.join()`` is the worker's or ps's half of
:class:`~mpistrat.ParameterServerStrategy`'s collective construction, followed by
serving: closures on a worker, one-sided variable access on a ps. It returns when the
coordinator's program ends.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..cluster.base import ClusterResolver, SimpleClusterResolver
from ..runtime._mpi import Comm
from .strategy import ParameterServerStrategy

__all__ = ["Server"]


class Server:
    """A worker's or ps's service in parameter-server training (``tf.distribute.Server``).

    Args:
        server_or_cluster_def: a cluster (a dict of job names to address lists, or a
            ``ClusterSpec``) with ``chief``, ``ps`` and ``worker`` jobs, or a cluster
            resolver (its task is this rank's).
        job_name, task_index: this rank's task in that cluster (``"worker"``, 0); with a
            resolver, its own task is used when these are None.
        protocol, config: accepted for TF's signature; MPI is the only transport.
        start: accepted for TF's signature; the service starts in :meth:`join`, which
            every worker and ps rank must call while the chief constructs the strategy.
        num_ps, arena_bytes, comm: as for :class:`~mpistrat.ParameterServerStrategy`;
            every rank must pass the same.

    ``target`` is ``"mpi://<job>:<task>@rank<r>"``: the task and the rank of the job's
    communicator that serves it (TF's is a gRPC address; nothing connects to it here).
    """

    def __init__(self, server_or_cluster_def: Any, job_name: str | None = None,
                 task_index: int | None = None, protocol: str | None = None,
                 config: Any = None, start: bool = True, *, num_ps: int | None = None,
                 arena_bytes: int | None = None, comm: Comm | None = None) -> None:
        if protocol not in (None, "grpc", "mpi"):
            raise ValueError(f"protocol {protocol!r}: mpistrat's servers talk MPI; leave "
                             f"protocol out")
        if isinstance(server_or_cluster_def, ClusterResolver):
            resolver = server_or_cluster_def
            if job_name is not None:
                resolver.task_type = job_name
            if task_index is not None:
                resolver.task_id = task_index
        elif isinstance(server_or_cluster_def, Mapping) or hasattr(server_or_cluster_def,
                                                                     "as_dict"):
            resolver = SimpleClusterResolver(server_or_cluster_def, task_type=job_name,
                                             task_id=task_index)
        else:
            raise TypeError(f"Server takes a cluster (dict or ClusterSpec) or a cluster "
                            f"resolver, got a {type(server_or_cluster_def).__name__}")
        if resolver.task_type not in ("worker", "ps"):
            raise ValueError(f"a Server runs a worker or ps task, got job_name "
                             f"{resolver.task_type!r}; the chief constructs "
                             f"ParameterServerStrategy instead")
        self._resolver = resolver
        self._options = (num_ps, arena_bytes, comm)
        self._joined = False

    @property
    def target(self) -> str:
        rank = None if self._options[2] is None else self._options[2].Get_rank()
        where = "" if rank is None else f"@rank{rank}"
        return f"mpi://{self._resolver.task_type}:{self._resolver.task_id}{where}"

    def start(self) -> None:
        """Nothing to do before :meth:`join` (TF starts its gRPC server here)."""

    def join(self) -> None:
        """Take part in the strategy's construction, then serve until the coordinator's
        program ends (collective with the chief's ``ParameterServerStrategy(...)``).

        Raises:
            RuntimeError: called twice.
            ValueError: the cluster, the task or the ranks do not match (on every rank).
        """
        if self._joined:
            raise RuntimeError("Server.join() serves once; the job has ended")
        self._joined = True
        strategy = ParameterServerStrategy.__new__(ParameterServerStrategy)
        strategy._setup(self._resolver, None, *self._options)
        strategy._serve()

    def __repr__(self) -> str:
        return f"Server({self.target})"
