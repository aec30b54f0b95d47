"""``MPIClusterResolver``: the workers are the ranks of an MPI communicator (the default).

Task ``worker:r`` is rank ``r``; rank 0 is the chief. The cluster spec lists
``host:port_base+i`` per rank, where ``host`` is the rank's ``MPI.Get_processor_name()``
and ``i`` counts the lower ranks on the same host. Those addresses are informational:
MPI carries the data and nothing listens on them; they keep TF code that prints or
inspects the cluster working.

MPI is initialised only when a method needs it. :meth:`~MPIClusterResolver.cluster_spec`,
:meth:`~MPIClusterResolver.hostnames` and :meth:`~MPIClusterResolver.master` are
**collective** on their first call (one ``allgather`` of the host names, cached after):
call them on every rank. The task, the worker count and ``is_chief`` are local.
"""

from __future__ import annotations

from typing import Any

from ..runtime._mpi import Comm, mpi, world
from .base import ClusterResolver
from .cluster_spec import ClusterSpec

__all__ = ["MPIClusterResolver"]


class MPIClusterResolver(ClusterResolver):
    """One ``worker`` task per rank of ``comm``.

    Args:
        comm: an mpi4py intracommunicator (default ``COMM_WORLD``, taken when first needed).
        gpus_per_rank: GPUs each rank uses, reported by :meth:`num_accelerators`;
            None counts the CUDA devices this process sees.
        port_base: the port of each host's first rank in the (informational) addresses.
        rpc_layer: the protocol of :meth:`master` URLs (default none).

    Raises:
        ValueError: ``gpus_per_rank`` or ``port_base`` out of range.
    """

    source = "the MPI communicator"

    def __init__(self, comm: Comm | None = None, gpus_per_rank: int | None = None,
                 port_base: int = 8888, rpc_layer: str | None = None) -> None:
        if gpus_per_rank is not None and (isinstance(gpus_per_rank, bool) or not isinstance(
                gpus_per_rank, int) or gpus_per_rank < 0):
            raise ValueError(f"gpus_per_rank must be an integer >= 0 or None, got "
                             f"{gpus_per_rank!r}")
        if isinstance(port_base, bool) or not isinstance(port_base, int) \
                or not 0 <= port_base <= 65535:
            raise ValueError(f"port_base must be a port number (0-65535), got {port_base!r}")
        self._comm = comm
        self._gpus_per_rank = gpus_per_rank
        self._port_base = port_base
        self._rpc_layer = rpc_layer
        self._hostnames: tuple[str, ...] | None = None

    @property
    def comm(self) -> Any:
        """The communicator whose ranks are the workers."""
        if self._comm is None:
            self._comm = world()
        return self._comm

    def _default_task_type(self) -> str | None:
        return "worker"

    def _default_task_id(self) -> int | None:
        return int(self.comm.Get_rank())

    def hostnames(self) -> tuple[str, ...]:
        """Every rank's processor name, by rank (collective on the first call)."""
        if self._hostnames is None:
            self._hostnames = tuple(self.comm.allgather(mpi().Get_processor_name()))
        return self._hostnames

    def cluster_spec(self) -> ClusterSpec:
        """``{"worker": ["host:port", ...]}``, one per rank (collective on the first call)."""
        seen: dict[str, int] = {}
        addresses = []
        for host in self.hostnames():
            addresses.append(f"{host}:{self._port_base + seen.get(host, 0)}")
            seen[host] = seen.get(host, 0) + 1
        return ClusterSpec({"worker": addresses})

    @property
    def num_workers(self) -> int:
        """The communicator's size."""
        return int(self.comm.Get_size())

    @property
    def worker_index(self) -> int:
        """This task's id (the rank, unless ``task_id`` was set)."""
        return int(self.task_id or 0)

    @property
    def is_chief(self) -> bool:
        """True on worker 0."""
        return self.worker_index == 0

    def validate(self) -> None:
        """Nothing to check: the communicator defines the cluster."""

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                         config_proxy: Any = None) -> dict[str, int]:
        """``{"GPU": gpus_per_rank}`` when given; else the CUDA devices this process sees."""
        if self._gpus_per_rank is not None:
            return {"GPU": self._gpus_per_rank} if self._gpus_per_rank else {}
        return super().num_accelerators(task_type, task_id, config_proxy)
