"""Who is who in parameter-server training: the coordinator, the ps and the workers.

Parameter-server training splits the ranks of the job into three roles (TF's task types):

* the **coordinator** (TF's ``chief``): rank 0; runs the user's program, creates the
  variables and schedules functions;
* **ps** ranks: hold the variables (:class:`~mpistrat.ps.store.VariableStore`);
* **workers**: run the scheduled functions.

The roles come from one of two places:

* a cluster resolver whose cluster has a ``ps`` job (``TF_CONFIG``, a
  ``SimpleClusterResolver``): ``chief:0`` is rank 0, ``ps:i`` rank ``1 + i`` and
  ``worker:i`` rank ``1 + P + i`` (the order ``mpirun`` and Slurm number the tasks of
  such a ``TF_CONFIG`` in), and the resolver's task must be this rank's;
* the MPI world and a number of ps ranks (``num_ps``, or ``MPISTRAT_NUM_PS``, which
  ``mpistrat run --num-ps P`` sets): rank 0 coordinates, ranks ``1..P`` are ps, the rest
  workers.

:func:`resolve_roles` decides collectively, so a bad setting on one rank is the same
error on every rank.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..cluster.base import ClusterResolver
from ..cluster.mpi import MPIClusterResolver
from ..runtime._mpi import Comm
from ..runtime.agreement import agree

__all__ = ["NUM_PS_ENV", "Roles", "roles_from", "resolve_roles"]

NUM_PS_ENV = "MPISTRAT_NUM_PS"

_PS_JOBS = ("chief", "ps", "worker")


@dataclass(frozen=True)
class Roles:
    """The ranks of each role, in a communicator of ``coordinator + ps + workers`` ranks.

    Attributes:
        coordinator: the coordinator's rank (0).
        ps: the ps ranks, in placement (round-robin) order.
        workers: the worker ranks; worker ``i`` is ``workers[i]``.
    """

    coordinator: int
    ps: tuple[int, ...]
    workers: tuple[int, ...]

    def task_of(self, rank: int) -> tuple[str, int]:
        """``rank``'s task as TF names it: ``("chief", 0)``, ``("ps", i)`` or
        ``("worker", i)``."""
        if rank == self.coordinator:
            return "chief", 0
        if rank in self.ps:
            return "ps", self.ps.index(rank)
        return "worker", self.workers.index(rank)

    @property
    def size(self) -> int:
        return 1 + len(self.ps) + len(self.workers)


def _num_ps_from_env(environ: Mapping[str, str]) -> int | None:
    text = environ.get(NUM_PS_ENV, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{NUM_PS_ENV}={text!r} is not an integer; set it to the number of "
                         f"parameter-server ranks (e.g. {NUM_PS_ENV}=1) or unset it") from None
    return value


def _from_ranks(num_ps: int, size: int) -> Roles:
    if num_ps < 1:
        raise ValueError("There must be at least one ps. (num_ps is "
                         f"{num_ps}; pass num_ps=P, or run with mpistrat run --num-ps P)")
    if size - 1 - num_ps < 1:
        raise ValueError(
            f"There must be at least one worker. ({size} rank(s): 1 coordinator and "
            f"{num_ps} ps leave {max(0, size - 1 - num_ps)}; start at least "
            f"{num_ps + 2} ranks, or fewer ps)")
    return Roles(0, tuple(range(1, 1 + num_ps)), tuple(range(1 + num_ps, size)))


def _from_cluster(resolver: ClusterResolver, rank: int, size: int) -> Roles:
    spec = resolver.cluster_spec()
    jobs = spec.as_dict()
    unknown = sorted(set(jobs) - set(_PS_JOBS))
    if unknown:
        raise ValueError(
            f"the cluster ({jobs}) has job(s) {unknown} that parameter-server training "
            f"does not run; allowed task types are ('chief', 'worker', 'ps') (run an "
            f"evaluator as its own process, outside the MPI job)")
    chiefs, num_ps, workers = (spec.num_tasks(j) if j in jobs else 0 for j in _PS_JOBS)
    if chiefs != 1:
        raise ValueError(f"the cluster ({jobs}) must have exactly one chief, the "
                         f"coordinator, got {chiefs}; add a 'chief' job with one task")
    roles = _from_ranks(num_ps, 1 + num_ps + workers)
    if roles.size != size:
        raise ValueError(
            f"the cluster ({jobs}) has {roles.size} tasks (1 chief, {num_ps} ps, {workers} "
            f"worker(s)) but the MPI communicator has {size} ranks; start one rank per task")
    task = (resolver.task_type, resolver.task_id)
    if task != (None, None) and task != roles.task_of(rank):
        expected = roles.task_of(rank)
        raise ValueError(
            f"rank {rank} is task {task[0]}:{task[1]} in the cluster resolver, but ranks are "
            f"the tasks in the order chief, ps, worker, so rank {rank} is "
            f"{expected[0]}:{expected[1]}; give each rank that task (e.g. in TF_CONFIG)")
    return roles


def roles_from(cluster_resolver: ClusterResolver | None, num_ps: int | None, rank: int,
               size: int, environ: Mapping[str, str] | None = None) -> Roles:
    """The roles of a communicator of ``size`` ranks, seen from ``rank`` (local).

    A resolver with a ``ps`` job decides (``num_ps`` must then be None or agree); else
    ``num_ps``, else ``MPISTRAT_NUM_PS``.

    Raises:
        ValueError: TF's messages ("There must be at least one ps.", "There must be at
            least one worker.", "Cluster spec must be non-empty ..."), or roles that do
            not fit the communicator.
    """
    environ = os.environ if environ is None else environ
    if num_ps is not None and (isinstance(num_ps, bool) or not isinstance(num_ps, int)):
        raise TypeError(f"num_ps must be an int, got {num_ps!r}")
    if cluster_resolver is not None and not isinstance(cluster_resolver, MPIClusterResolver):
        if not isinstance(cluster_resolver, ClusterResolver):
            raise TypeError(f"cluster_resolver must be a ClusterResolver, got a "
                            f"{type(cluster_resolver).__name__}")
        spec = cluster_resolver.cluster_spec()
        if not spec:
            raise ValueError("Cluster spec must be non-empty in "
                             "`tf.distribute.cluster_resolver.ClusterResolver`.")
        if "ps" in spec.as_dict():
            roles = _from_cluster(cluster_resolver, rank, size)
            if num_ps is not None and num_ps != len(roles.ps):
                raise ValueError(f"num_ps={num_ps} but the cluster has {len(roles.ps)} ps "
                                 f"task(s); leave num_ps out")
            return roles
        raise ValueError("There must be at least one ps. (the cluster "
                         f"{spec.as_dict()} has no 'ps' job; add one)")
    if num_ps is None:
        num_ps = _num_ps_from_env(environ)
    return _from_ranks(0 if num_ps is None else num_ps, size)


def resolve_roles(cluster_resolver: Any, num_ps: int | None, comm: Comm,
                  problem: BaseException | None = None) -> Roles:
    """:func:`roles_from` on every rank of ``comm``, agreed: every rank gets the same roles
    or raises the same error (``problem``: another error of this rank's arguments, agreed
    with the roles)."""
    roles = error = None
    try:
        if problem is not None:
            raise problem
        roles = roles_from(cluster_resolver, num_ps, comm.Get_rank(), comm.Get_size())
    except (TypeError, ValueError) as exc:
        error = exc
    agree(comm, None if roles is None else repr(roles), error, "ParameterServerStrategy",
          "the same cluster and number of ps on every rank")
    assert roles is not None  # (agree raised otherwise)
    return roles
