"""The concrete strategies: ``MultiWorkerMirroredStrategy`` (every rank of a communicator),
``MirroredStrategy`` (one process, its local devices) and ``OneDeviceStrategy``.

Local devices: CPU replicas ``/cpu:0 .. /cpu:K-1`` (``local_replicas=K``, default 1 or
``MPISTRAT_LOCAL_REPLICAS``), or GPU replicas (``gpus_per_rank=G``): the rank's ``G``
GPUs from :func:`~mpistrat.runtime.devices.node_assignment`, named ``/gpu:<ordinal>``,
each replica running with its GPU current and holding CuPy arrays there (its batches,
its copy of every variable, its results). On a host without CuPy and a GPU, asking for
them is a clear error on every rank.

Communication (``MultiWorkerMirroredStrategy``): RING is mpistrat's host all-reduce —
``rechd`` for tensors up to 64 KiB (latency), ``xring`` above (a ring, as the name
promises) — over one pack per batch (``num_packs=1``: the fastest packing measured,
docs/batch_reduce.md). AUTO on host replicas picks by topology: on one node the
shared-memory ``shm`` where it measured fastest (:data:`AUTO_SPEC_ONE_NODE`); across
nodes with several ranks per node ``shm/rechd`` (:data:`AUTO_SPEC_NODES`); otherwise
RING's spec. GPU replicas: AUTO and NCCL all-reduce with NCCL over every GPU of every
rank (spec ``nccl``); AUTO takes RING's algorithms on the device buffers instead where
NCCL cannot run (CuPy without NCCL, or ranks sharing a GPU, which NCCL refuses).
Any :class:`~mpistrat.CrossDeviceOps` may be given instead (e.g. a
``MultiWorkerAllReduce`` with a spec from ``mpistrat bench --recommend``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..backends.capabilities import GpuProbe, probe_gpus
from ..cluster import ClusterResolver, resolve_cluster
from ..communication import CommunicationImplementation, CommunicationOptions
from ..cross_device_ops import CrossDeviceOps, MultiWorkerAllReduce, ReductionToOneDevice
from ..errors import BackendUnavailable, DuplicateDeviceError, TopologyError
from ..runtime._mpi import Comm, mpi, world
from ..runtime.agreement import agree
from ..runtime.devices import DeviceAssignment, node_assignment, require_distinct_devices
from ..runtime.topology import get_topology
from ..values import default_devices, parse_device
from .base import Strategy, StrategyExtended
from .placement import GpuPlacement

__all__ = ["MultiWorkerMirroredStrategy", "MirroredStrategy", "OneDeviceStrategy",
           "RING_SPEC", "AUTO_SPEC_ONE_NODE", "AUTO_SPEC_NODES", "LOCAL_REPLICAS"]

RING_SPEC = "rechd:64K:xring"
# AUTO on host replicas. One node: shared memory up to 16 MiB, where it measured fastest
# (from a Source, 2-4 ranks: 2.0-5.9x rechd's speed at 1-64 KiB, its one-step path;
# 1.1-1.2x native's at 512 KiB - 8 MiB; docs/benchmarks.md), rechd above (MPICH's
# single-copy point-to-point beats shm's copy-in and copy-out there). Several nodes with
# several ranks on a node: shared memory inside each node, rechd across node leaders.
AUTO_SPEC_ONE_NODE = "shm:16M:rechd"
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


def _require_gpu_replicas(count: int) -> GpuProbe:
    """What this host has for ``count`` GPU replicas; BackendUnavailable when it has none."""
    probe = probe_gpus()
    if not probe.usable:
        raise BackendUnavailable(
            f"{count} GPU replica(s) per rank were asked for, but this host cannot run them "
            f"({probe.reason}); use CPU replicas (local_replicas=K / --local-replicas K) or "
            f"run on GPU nodes with CuPy installed (pip install 'mpistrat[gpu]')")
    return probe


def _gpu_spec(comm: Comm, implementation: CommunicationImplementation,
              assignment: DeviceAssignment, nccl: bool) -> str:
    """The all-reduce spec of GPU replicas (collective: every rank gets the same):
    ``nccl`` unless RING was asked for or NCCL cannot run; NCCL asked for but impossible
    raises on every rank."""
    if implementation is CommunicationImplementation.RING:
        return RING_SPEC
    usable = bool(comm.allreduce(int(nccl), op=mpi().MIN))
    if not usable and implementation is CommunicationImplementation.NCCL:
        raise BackendUnavailable(
            "communication=NCCL needs NCCL through CuPy on every rank, and some rank has "
            "CuPy without NCCL; use RING or AUTO, or install a CuPy built with NCCL")
    try:  # (collective: every rank raises or none)
        require_distinct_devices(comm, assignment.physical, purpose="communication=NCCL")
    except DuplicateDeviceError:  # ranks share a GPU, which NCCL refuses
        if implementation is CommunicationImplementation.NCCL:
            raise
        return RING_SPEC
    return "nccl" if usable else RING_SPEC


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
        gpus_per_rank: GPU replicas per rank (CuPy and CUDA GPUs on every rank); excludes
            ``local_replicas``. ``mpistrat run --gpus-per-rank G`` sets it.

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
        probe: GpuProbe | None = None
        replicas = 1
        implementation = CommunicationImplementation.AUTO
        if isinstance(gpus_per_rank, int) and not isinstance(gpus_per_rank, bool) \
                and gpus_per_rank == 0:
            gpus_per_rank = None  # (TF's num_gpus_per_worker=0: CPU replicas)
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
            if gpus_per_rank is not None:
                if local_replicas is not None:
                    raise ValueError(
                        f"local_replicas={local_replicas!r} (CPU replicas) and gpus_per_rank="
                        f"{gpus_per_rank!r} (GPU replicas) exclude each other: give one")
                if isinstance(gpus_per_rank, bool) or not isinstance(gpus_per_rank, int) \
                        or gpus_per_rank < 1:
                    raise ValueError(f"gpus_per_rank must be an integer >= 1 (GPU replicas "
                                     f"per rank), got {gpus_per_rank!r}")
                probe = _require_gpu_replicas(gpus_per_rank)
                replicas = gpus_per_rank
            else:
                if implementation is CommunicationImplementation.NCCL:
                    raise BackendUnavailable(
                        "communication=NCCL needs GPU replicas (gpus_per_rank=G, or mpistrat "
                        "run --gpus-per-rank G) with CuPy and NCCL on every rank; these ranks "
                        "reduce host arrays — use RING or AUTO")
                replicas = _local_replicas(local_replicas)
                devices = default_devices(replicas)
            kind = "GPU" if probe is not None else "CPU"
            signature = f"MultiWorkerMirroredStrategy {replicas} {kind} {implementation.name}"
        except (ValueError, TypeError, BackendUnavailable) as exc:
            error = exc
        agree(comm, signature, error, "MultiWorkerMirroredStrategy()",
              hint="the same number and kind of local replicas and the same communication")
        placement = None
        communication = implementation
        if probe is not None:  # every rank asked for GPUs and has some (agreed above)
            assignment = node_assignment(comm, replicas)  # (raises alike on every rank)
            placement = GpuPlacement(assignment.ordinals)
            devices = placement.devices
            spec = _gpu_spec(comm, implementation, assignment, probe.nccl is not None)
            if cross_device_ops is None:
                cross_device_ops = MultiWorkerAllReduce(
                    all_reduce_spec=spec, num_gpus_per_worker=replicas, num_packs=1, comm=comm)
            if implementation is CommunicationImplementation.AUTO:
                communication = CommunicationImplementation.NCCL if spec == "nccl" \
                    else CommunicationImplementation.RING
        elif implementation is CommunicationImplementation.AUTO:
            communication = CommunicationImplementation.RING  # AUTO on host replicas
        info = resolve_cluster(cluster_resolver, comm)
        if cross_device_ops is None:
            cross_device_ops = _host_ops(comm, implementation)
        self._cluster_resolver = info.resolver
        self._cluster = info
        self._communication = communication
        self._seed: int | None = None
        extended = StrategyExtended(self, cross_device_ops, devices, info.num_workers,
                                    info.worker_index, info.is_chief, communication_options,
                                    placement)
        super().__init__(extended, comm)

    @property
    def communication(self) -> CommunicationImplementation:
        """The implementation AUTO resolved to: RING on host replicas; on GPU replicas NCCL
        where every rank has NCCL and its own GPUs, else RING."""
        return self._communication

    def _shuffle_seed(self) -> int | None:
        if self._seed is None:  # one seed for unseeded shuffles, the same on every rank
            seed = int(np.random.SeedSequence().generate_state(1)[0])
            self._seed = int(self._comm.bcast(seed, root=0))
        return self._seed


class MirroredStrategy(Strategy):
    """One process over its local devices (TF's ``MirroredStrategy``).

    Args:
        devices: device names (``["/cpu:0", "/cpu:1"]`` for two CPU replicas, ``["/gpu:0",
            "/gpu:1"]`` for two GPUs by CUDA ordinal: CuPy arrays, each replica with its
            GPU current); all CPUs or all GPUs; default ``/cpu:0``.
        cross_device_ops: default :class:`~mpistrat.ReductionToOneDevice` on CPUs (TF's
            choice without NCCL); on GPUs the replicas' values summed on the first GPU
            and copied back (``MultiWorkerAllReduce`` over this one process).
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
        placement = None
        comm = mpi().COMM_SELF if comm is None else comm
        if gpus:
            if len(gpus) != len(parsed):
                raise ValueError(f"MirroredStrategy devices mix CPUs and GPUs: {list(names)}; "
                                 f"give only GPUs (CuPy replicas) or only CPUs")
            probe = _require_gpu_replicas(len(gpus))
            missing = sorted({d.index for d in gpus} - {i for i, _ in probe.devices})
            if missing:
                raise ValueError(f"MirroredStrategy devices {list(names)} name GPU ordinal(s) "
                                 f"{missing}, but this process sees {len(probe.devices)} "
                                 f"GPU(s); name visible GPUs (check CUDA_VISIBLE_DEVICES)")
            placement = GpuPlacement([d.index for d in gpus], [str(d) for d in parsed])
            if cross_device_ops is None:
                cross_device_ops = MultiWorkerAllReduce(
                    all_reduce_spec=RING_SPEC, num_gpus_per_worker=len(gpus), num_packs=1,
                    comm=comm)
        if cross_device_ops is None:
            cross_device_ops = ReductionToOneDevice(comm=comm)
        elif not isinstance(cross_device_ops, CrossDeviceOps):
            raise ValueError(f"cross_device_ops must be a CrossDeviceOps (e.g. "
                             f"ReductionToOneDevice() or MultiWorkerAllReduce(...)), got "
                             f"{cross_device_ops!r}")
        extended = StrategyExtended(self, cross_device_ops, [str(d) for d in parsed],
                                    comm.Get_size(), comm.Get_rank(), comm.Get_rank() == 0,
                                    placement=placement)
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
