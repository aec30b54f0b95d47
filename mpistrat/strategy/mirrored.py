"""The concrete strategies: ``MultiWorkerMirroredStrategy`` (every rank of a communicator),
``MirroredStrategy`` (one process, its local devices) and ``OneDeviceStrategy``.

Local devices: CPU replicas ``/cpu:0 .. /cpu:K-1`` (``local_replicas=K``, default 1 or
``MPISTRAT_LOCAL_REPLICAS``). GPU replicas hold CuPy arrays and need the GPU backend;
on a host without CuPy and a GPU, asking for them is a clear error.

Communication (``MultiWorkerMirroredStrategy``): RING is mpistrat's host all-reduce —
``rechd`` for tensors up to 64 KiB (latency), ``xring`` above (a ring, as the name
promises) — over one pack per batch (``num_packs=1``: the fastest packing measured,
docs/batch_reduce.md). AUTO on host replicas picks by topology: on one node the
shared-memory ``shm`` where it measured fastest (:data:`AUTO_SPEC_ONE_NODE`); across
nodes with several ranks per node ``shm/rechd`` (:data:`AUTO_SPEC_NODES`); otherwise
RING's spec. GPU replicas are the GPU backend's (NCCL).
Any :class:`~mpistrat.CrossDeviceOps` may be given instead (e.g. a
``MultiWorkerAllReduce`` with a spec from ``mpistrat bench --recommend``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..backends.capabilities import probe_gpus
from ..cluster import ClusterResolver, resolve_cluster
from ..communication import CommunicationImplementation, CommunicationOptions
from ..cross_device_ops import CrossDeviceOps, MultiWorkerAllReduce, ReductionToOneDevice
from ..errors import BackendUnavailable, TopologyError
from ..runtime._mpi import Comm, mpi, world
from ..runtime.agreement import agree
from ..runtime.topology import get_topology
from ..values import default_devices, parse_device
from .base import Strategy, StrategyExtended

__all__ = ["MultiWorkerMirroredStrategy", "MirroredStrategy", "OneDeviceStrategy",
           "RING_SPEC", "AUTO_SPEC_ONE_NODE", "AUTO_SPEC_NODES", "LOCAL_REPLICAS"]

RING_SPEC = "rechd:64K:xring"
# AUTO on host replicas. One node: shared memory where it measured faster than the MPI
# library and the rings (16 KiB - 16 MiB, 1.1-1.2x native on 2 ranks; docs/benchmarks.md);
# rechd below (latency) and above (MPICH's single-copy point-to-point beats shm's copy-in
# and copy-out there). Several nodes with several ranks on a node: shared memory inside
# each node, rechd across node leaders.
AUTO_SPEC_ONE_NODE = "rechd:16K:shm:16M:rechd"
AUTO_SPEC_NODES = "rechd:16K:shm/rechd"
LOCAL_REPLICAS = "MPISTRAT_LOCAL_REPLICAS"


def _local_replicas(value: int | None, env: Mapping[str, str] | None = None) -> int:
    if value is None:
        text = (os.environ if env is None else env).get(LOCAL_REPLICAS, "").strip()
        if not text:
            return 1
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{LOCAL_REPLICAS}={text!r} is not a positive integer; set "
                             f"e.g. {LOCAL_REPLICAS}=2 or unset it") from None
        if value < 1:
            raise ValueError(f"{LOCAL_REPLICAS}={text!r} must be at least 1")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"local_replicas must be an integer >= 1 (CPU replicas per rank), "
                         f"got {value!r}")
    return int(value)


def _require_gpu_replicas(count: int) -> None:
    probe = probe_gpus()
    if not probe.usable:
        raise BackendUnavailable(
            f"{count} GPU replica(s) per rank were asked for, but this host cannot run them "
            f"({probe.reason}); use CPU replicas (local_replicas=K / --local-replicas K) or "
            f"run on GPU nodes with CuPy installed (pip install 'mpistrat[gpu]')")
    raise BackendUnavailable(
        f"GPU replicas (gpus_per_rank={count}) need the CuPy array backend, which this "
        f"version of mpistrat does not ship yet; use CPU replicas (local_replicas=K) — "
        f"GPUs were found ({len(probe.devices)}) but strategies reduce host arrays only")


def _host_ops(comm: Comm, implementation: CommunicationImplementation) -> Any:
    """The cross-device ops of host replicas: RING's spec, or AUTO's choice by topology
    (collective: every rank builds the same)."""
    spec = RING_SPEC
    if implementation is CommunicationImplementation.AUTO and comm.Get_size() > 1:
        topology = get_topology(comm)
        if topology.num_nodes == 1:
            spec = AUTO_SPEC_ONE_NODE
        elif any(len(ranks) > 1 for ranks in topology.node_ranks):
            spec = AUTO_SPEC_NODES
    return MultiWorkerAllReduce(all_reduce_spec=spec, num_packs=1, comm=comm)


def _same_comm(a: Any, b: Any) -> bool:
    MPI = mpi()
    return MPI.Comm.Compare(a, b) in (MPI.IDENT, MPI.CONGRUENT)


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous data parallelism over every rank of ``comm`` (TF's
    ``MultiWorkerMirroredStrategy``); each rank is a worker with ``G`` local replicas.

    Args:
        communication: AUTO, RING or NCCL (``CollectiveCommunication``; strings accepted).
        cluster_resolver: where the workers come from; default: the MPI ranks. A
            ``TFConfigClusterResolver`` or ``SlurmClusterResolver`` is checked against
            the ranks (every rank raises on a mismatch).
        cross_device_ops: any :class:`~mpistrat.CrossDeviceOps` over the same
            communicator, instead of the one ``communication`` picks.
        comm: the communicator (default ``COMM_WORLD``).
        communication_options: TF 2.4's :class:`CommunicationOptions` (its
            ``implementation`` overrides ``communication``); the default options of
            every reduction.
        local_replicas: CPU replicas per rank (default ``MPISTRAT_LOCAL_REPLICAS`` or 1).
        gpus_per_rank: GPU replicas per rank (needs the GPU backend).

    Creating the strategy is collective: every rank must create it, with the same
    number of local replicas (checked).
    """

    def __init__(self, communication: Any = CommunicationImplementation.AUTO,
                 cluster_resolver: Any = None, cross_device_ops: Any = None, comm: Comm | None = None,
                 communication_options: CommunicationOptions | None = None, *,
                 local_replicas: int | None = None, gpus_per_rank: int | None = None) -> None:
        comm = world() if comm is None else comm
        signature = error = None
        devices: tuple[str, ...] = ()
        try:
            if communication_options is not None and not isinstance(communication_options,
                                                                    CommunicationOptions):
                raise ValueError(f"communication_options must be an instance of "
                                 f"CommunicationOptions, got {communication_options!r}")
            if isinstance(communication, ClusterResolver):
                raise ValueError(
                    f"MultiWorkerMirroredStrategy's first argument is `communication` (TF's "
                    f"experimental signature), got the cluster resolver {communication!r}; "
                    f"pass it by keyword: cluster_resolver=...")
            implementation = CommunicationImplementation.parse(
                communication_options.implementation if communication_options is not None
                and communication_options.implementation is not CommunicationImplementation.AUTO
                else communication)
            if cluster_resolver is not None and not isinstance(cluster_resolver, ClusterResolver):
                raise ValueError(f"cluster_resolver must be an instance of ClusterResolver "
                                 f"(e.g. TFConfigClusterResolver()), got {cluster_resolver!r}")
            if cross_device_ops is not None and not isinstance(cross_device_ops, CrossDeviceOps):
                raise ValueError(f"cross_device_ops must be a CrossDeviceOps (e.g. "
                                 f"MultiWorkerAllReduce(...)), got {cross_device_ops!r}")
            if cross_device_ops is not None and not _same_comm(cross_device_ops.comm, comm):
                raise TopologyError(
                    f"cross_device_ops reduces over a communicator of "
                    f"{cross_device_ops.comm.Get_size()} rank(s) that is not the strategy's "
                    f"({comm.Get_size()} rank(s)); build it with comm=<the strategy's "
                    f"communicator>")
            if gpus_per_rank:
                _require_gpu_replicas(gpus_per_rank)
            if implementation is CommunicationImplementation.NCCL:
                raise BackendUnavailable(
                    "communication=NCCL needs GPU replicas (CuPy and GPUs with NCCL) on every "
                    "rank; these ranks reduce host arrays — use RING or AUTO")
            replicas = _local_replicas(local_replicas)
            devices = default_devices(replicas)
            signature = f"MultiWorkerMirroredStrategy G={replicas} {implementation.name}"
        except (ValueError, TypeError, BackendUnavailable) as exc:
            error = exc
        agree(comm, signature, error, "MultiWorkerMirroredStrategy()",
              hint="the same number of local replicas and the same communication")
        info = resolve_cluster(cluster_resolver, comm)
        if cross_device_ops is None:
            cross_device_ops = _host_ops(comm, implementation)
        self._cluster_resolver = info.resolver
        self._cluster = info
        self._communication = (CommunicationImplementation.RING
                               if implementation is CommunicationImplementation.AUTO
                               else implementation)  # AUTO on host replicas: RING
        self._seed: int | None = None
        extended = StrategyExtended(self, cross_device_ops, devices, info.num_workers,
                                    info.worker_index, info.is_chief, communication_options)
        super().__init__(extended, comm)

    @property
    def communication(self) -> CommunicationImplementation:
        """The implementation AUTO resolved to (RING on host replicas)."""
        return self._communication

    def _shuffle_seed(self) -> int | None:
        if self._seed is None:  # one seed for unseeded shuffles, the same on every rank
            seed = int(np.random.SeedSequence().generate_state(1)[0])
            self._seed = int(self._comm.bcast(seed, root=0))
        return self._seed


class MirroredStrategy(Strategy):
    """One process over its local devices (TF's ``MirroredStrategy``).

    Args:
        devices: device names (``["/cpu:0", "/cpu:1"]`` for two CPU replicas); default
            ``/cpu:0`` (GPUs need the GPU backend).
        cross_device_ops: default :class:`~mpistrat.ReductionToOneDevice` (TF's choice
            without NCCL).
        comm: the communicator the reductions run on (default ``COMM_SELF``: this
            process alone).
    """

    def __init__(self, devices: Sequence[str] | None = None, cross_device_ops: Any = None,
                 comm: Comm | None = None) -> None:
        names = ("/cpu:0",) if devices is None else tuple(devices)
        if not names:
            raise ValueError("MirroredStrategy needs at least one device, got []")
        parsed = [parse_device(d) for d in names]
        if len(set(parsed)) != len(parsed):
            raise ValueError(f"MirroredStrategy devices repeat: {list(names)}")
        gpus = [d for d in parsed if d.kind == "gpu"]
        if gpus:
            _require_gpu_replicas(len(gpus))
        comm = mpi().COMM_SELF if comm is None else comm
        if cross_device_ops is None:
            cross_device_ops = ReductionToOneDevice(comm=comm)
        elif not isinstance(cross_device_ops, CrossDeviceOps):
            raise ValueError(f"cross_device_ops must be a CrossDeviceOps (e.g. "
                             f"ReductionToOneDevice() or MultiWorkerAllReduce(...)), got "
                             f"{cross_device_ops!r}")
        extended = StrategyExtended(self, cross_device_ops, [str(d) for d in parsed],
                                    comm.Get_size(), comm.Get_rank(), comm.Get_rank() == 0)
        super().__init__(extended, comm)

    def _shuffle_seed(self) -> int | None:
        return None


class OneDeviceStrategy(MirroredStrategy):
    """Everything on one device (TF's ``OneDeviceStrategy``): one replica, no reduction
    across processes."""

    def __init__(self, device: str) -> None:
        if isinstance(device, (list, tuple)):
            raise TypeError(f"OneDeviceStrategy takes one device name, got {device!r}; for "
                            f"several devices use MirroredStrategy")
        super().__init__([device])
