"""From a cluster resolver to this rank's place among the workers, checked against MPI.

Under MPI the ranks of the communicator *are* the workers, so whatever a resolver says
(TF_CONFIG, Slurm) must agree with it: as many workers as ranks, and this rank's worker
id equal to its rank. :func:`resolve_cluster` is what a strategy calls; it checks that
collectively, so a mismatch, or a bad ``TF_CONFIG`` on a single rank, is an error on
every rank instead of a hang.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from ..errors import TopologyError
from ..runtime._mpi import Comm, world
from ..runtime.agreement import agree
from .base import ClusterResolver
from .mpi import MPIClusterResolver
from .slurm import SlurmClusterResolver
from .tfconfig import TFConfigClusterResolver

__all__ = ["ClusterInfo", "match_world", "check_against_world", "resolve_cluster",
           "should_checkpoint"]


@dataclass(frozen=True)
class ClusterInfo:
    """This rank's place in the cluster, as a strategy needs it.

    Attributes:
        num_workers: the number of workers (= ranks of the communicator).
        worker_index: this rank's worker id (= its rank; 0 is the chief).
        is_chief: True on the task that checkpoints and writes summaries.
        task_type, task_id: this task as the resolver names it (``("chief", 0)``,
            ``("worker", 2)``, ...; None in local mode).
        hostnames: every rank's processor name when the resolver is an
            :class:`MPIClusterResolver`, else None.
        resolver: the resolver this came from.
    """

    num_workers: int
    worker_index: int
    is_chief: bool
    task_type: str | None
    task_id: int | None
    hostnames: tuple[str, ...] | None
    resolver: ClusterResolver


def match_world(resolver: ClusterResolver, rank: int, size: int) -> ClusterInfo:
    """Check ``resolver`` against an MPI world of ``size`` ranks seen from ``rank`` (local).

    Raises:
        TopologyError (a ValueError): the resolver's cluster or task is invalid, the
            task is an evaluator or parameter server, or the worker count or id differs
            from the world's; the message names both sides and the fix.
    """
    resolver.validate()
    task_type, task_id = resolver.task_type, resolver.task_id
    in_cluster = isinstance(resolver, MPIClusterResolver) or bool(resolver.cluster_spec())
    if in_cluster and task_type == "evaluator":
        raise TopologyError(
            f"{resolver.source} makes this task an evaluator (evaluator:{task_id}): an "
            f"evaluator is not a worker and cannot be one of the MPI ranks; fix: run the "
            f"evaluator as its own process outside the MPI job and give every rank a "
            f"chief or worker task"
        )
    if in_cluster and task_type == "ps":
        raise TopologyError(
            f"{resolver.source} makes this task a parameter server (ps:{task_id}): "
            f"synchronous strategies all-reduce over MPI and have no parameter servers; "
            f"fix: give every rank a chief or worker task, or train with "
            f"ParameterServerStrategy (mpistrat run --num-ps P)"
        )
    info = ClusterInfo(resolver.num_workers, resolver.worker_index, resolver.is_chief,
                       task_type, task_id, None, resolver)
    if info.num_workers != size or info.worker_index != rank:
        raise TopologyError(
            f"{_describe(resolver, info)}, but the MPI communicator has {size} rank"
            f"{'s' if size != 1 else ''} and this is rank {rank}; fix: {_fix(resolver)}"
        )
    return info


def check_against_world(resolver: ClusterResolver, comm: Comm | None = None) -> None:
    """Check on every rank of ``comm`` that ``resolver`` describes its ranks.

    Collective over ``comm`` (default ``COMM_WORLD``). Every rank must also describe
    the same cluster (e.g. identical ``TF_CONFIG`` clusters).

    Raises:
        TopologyError: on the ranks whose resolver does not match (see
            :func:`match_world`); every other rank raises a ``CollectiveMismatchError``
            (also a ValueError) naming them, so no rank is left waiting.
    """
    _checked(resolver, world() if comm is None else comm, "check_against_world")


def resolve_cluster(cluster_resolver: ClusterResolver | None = None,
                    comm: Comm | None = None) -> ClusterInfo:
    """This rank's :class:`ClusterInfo`; what a multi-worker strategy calls (collective).

    Args:
        cluster_resolver: None (the default) for :class:`MPIClusterResolver` over
            ``comm``, or any :class:`ClusterResolver`, checked against ``comm``.
        comm: the strategy's communicator (default ``COMM_WORLD``).

    Raises:
        TopologyError: ``cluster_resolver`` is not a ClusterResolver, or does not match
            the communicator; raised on every rank (see :func:`check_against_world`).
    """
    comm = world() if comm is None else comm
    resolver = MPIClusterResolver(comm) if cluster_resolver is None else cluster_resolver
    info = _checked(resolver, comm, "resolve_cluster")
    if isinstance(resolver, MPIClusterResolver):
        info = replace(info, hostnames=resolver.hostnames())
    return info


def should_checkpoint(resolver: ClusterResolver | ClusterInfo) -> bool:
    """True on the chief only: the one task that saves checkpoints and summaries."""
    return bool(resolver.is_chief)


def _checked(resolver: Any, comm: Comm, what: str) -> ClusterInfo:
    info, signature, error = None, None, None
    try:
        if not isinstance(resolver, ClusterResolver):
            raise TopologyError(
                f"cluster_resolver must be an instance of mpistrat.ClusterResolver "
                f"(MPIClusterResolver, TFConfigClusterResolver, SlurmClusterResolver, ...), "
                f"got {type(resolver).__name__}: {resolver!r}; fix: pass one of them, or "
                f"None to take the workers from the MPI communicator"
            )
        info = match_world(resolver, comm.Get_rank(), comm.Get_size())
        signature = _signature(resolver, info)
    except Exception as exc:  # any failure on one rank must fail every rank
        error = exc
    agree(comm, signature, error, what,
          "the same kind of resolver describing the same cluster (e.g. the same TF_CONFIG "
          '"cluster" on every rank)')
    assert info is not None  # agree raised otherwise
    return info


def _signature(resolver: ClusterResolver, info: ClusterInfo) -> str:
    if isinstance(resolver, MPIClusterResolver):
        return f"MPIClusterResolver over {info.num_workers} ranks"
    cluster = json.dumps(resolver.cluster_spec().as_dict(), sort_keys=True)
    return f"{type(resolver).__name__} with cluster {cluster}"


def _describe(resolver: ClusterResolver, info: ClusterInfo) -> str:
    if isinstance(resolver, MPIClusterResolver):
        return (f"the MPIClusterResolver's communicator has {info.num_workers} ranks and "
                f"this task is its worker {info.worker_index}")
    spec = resolver.cluster_spec()
    if not spec:
        return f"{resolver.source} describes no cluster (local mode: 1 worker)"
    parts = []
    for job in ("chief", "worker"):
        count = spec.num_tasks(job) if job in spec.jobs else 0
        if count:
            parts.append(f"{count} {job}{'s' if count != 1 else ''}")
    return (f"{resolver.source} describes {info.num_workers} worker"
            f"{'s' if info.num_workers != 1 else ''} ({' + '.join(parts)}), task "
            f"{info.task_type}:{info.task_id} = worker id {info.worker_index}")


def _fix(resolver: ClusterResolver) -> str:
    if isinstance(resolver, TFConfigClusterResolver):
        return ("give every rank a TF_CONFIG with one chief or worker task per rank, in "
                "rank order (the chief is rank 0, then worker:0, worker:1, ...; without a "
                "chief, worker:i is rank i), or pass cluster_resolver=None to take the "
                "workers from MPI")
    if isinstance(resolver, SlurmClusterResolver):
        return ("launch one task per rank with srun, so that SLURM_PROCID is the rank; "
                "under mpirun inside an allocation the SLURM_* variables describe the batch "
                "step, not the ranks: pass cluster_resolver=None there")
    if isinstance(resolver, MPIClusterResolver):
        return "build the MPIClusterResolver on the communicator the strategy uses"
    return ("make the resolver describe one worker per rank, in rank order, or pass "
            "cluster_resolver=None to take the workers from MPI")
