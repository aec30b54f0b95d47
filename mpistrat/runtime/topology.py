"""Node groups of a communicator: who shares a node, who leads it, how nodes are ordered.

The topology model (docs/algorithms.md and docs/multihost.md show it at work):

* a **worker** is one MPI rank of the communicator;
* a **node group** is the set of ranks on one node, from
  ``Split_type(COMM_TYPE_SHARED)``; with ``ranks_per_node=k`` (or
  ``MPISTRAT_RANKS_PER_NODE=k``) each physical node is cut into virtual nodes of ``k``
  consecutive local ranks, so a single machine can exercise cross-node stages;
* the **leader** of a node is its local rank 0 (its lowest rank); leaders form the
  cross-node communicator; nodes are numbered by their leader's rank.

Building a topology is collective over the communicator. The result is cached on the
communicator itself as an MPI attribute, so later calls are free and the
sub-communicators are freed together with the communicator.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, cast

from ..config import RANKS_PER_NODE, Settings
from ..errors import TopologyError
from ._commcache import comm_cache
from ._mpi import Comm, mpi, world

__all__ = ["Topology", "get_topology", "env_ranks_per_node"]


@dataclass(frozen=True, eq=False)
class Topology:
    """The node structure of a communicator, as seen from one rank.

    Attributes:
        comm: the communicator this describes.
        rank, size: this rank and the number of ranks of ``comm``.
        node_comm: the ranks of this rank's node group (rank order kept).
        local_rank, local_size: this rank's place in, and the size of, its node group.
        node: index of this rank's node group (nodes ordered by leader rank).
        num_nodes: number of node groups.
        leader_comm: the node leaders (local rank 0 of each node), ordered by node index;
            None on ranks that are not leaders.
        node_of_rank: node index of every rank of ``comm``.
        hostnames: processor name of every rank of ``comm``.
        ranks_per_node: the virtual node size in force, or None for physical nodes.
        host_major: ``comm`` with its ranks ordered by node, then by rank (``comm`` itself
            when they already are): a flat ring over it crosses each link between nodes
            once per direction, and halving-doubling's first, largest exchanges stay
            inside nodes, whatever order the launcher placed the ranks in.
    """

    comm: Comm
    rank: int
    size: int
    node_comm: Comm
    local_rank: int
    local_size: int
    node: int
    num_nodes: int
    leader_comm: Comm | None
    node_of_rank: tuple[int, ...]
    hostnames: tuple[str, ...]
    ranks_per_node: int | None
    host_major: Any

    @property
    def is_leader(self) -> bool:
        """True on the lowest rank of each node group."""
        return self.local_rank == 0

    @property
    def node_ranks(self) -> tuple[tuple[int, ...], ...]:
        """The ranks of ``comm`` in each node group, by node index."""
        groups: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for rank, node in enumerate(self.node_of_rank):
            groups[node].append(rank)
        return tuple(tuple(g) for g in groups)

    def release(self) -> None:
        """Free the sub-communicators (called when ``comm`` is freed)."""
        for sub in (self.node_comm, self.leader_comm,
                    None if self.host_major is self.comm else self.host_major):
            if sub is not None and sub != mpi().COMM_NULL:
                sub.Free()


_PARSED: dict[str | None, int | None] = {}


def env_ranks_per_node() -> int | None:
    """``MPISTRAT_RANKS_PER_NODE`` parsed (once per distinct value: this runs on every
    collective, so it reads one variable instead of building the whole Settings)."""
    text = os.environ.get(RANKS_PER_NODE)
    try:
        return _PARSED[text]
    except KeyError:
        value = _PARSED[text] = Settings.from_env().ranks_per_node
        return value


def get_topology(comm: Comm | None = None, ranks_per_node: int | None = None) -> Topology:
    """Return the node topology of ``comm`` (collective on first call, cached after).

    Args:
        comm: an mpi4py intracommunicator (default ``COMM_WORLD``).
        ranks_per_node: cut each physical node into virtual nodes of this many ranks;
            None reads ``MPISTRAT_RANKS_PER_NODE`` and otherwise uses physical nodes.

    Raises:
        TopologyError: on every rank, when ranks disagree on ``ranks_per_node`` or it
            is not a positive integer.
    """
    comm = world() if comm is None else comm
    if ranks_per_node is None:
        ranks_per_node = env_ranks_per_node()
    local_ok = ranks_per_node is None or (
        isinstance(ranks_per_node, int) and not isinstance(ranks_per_node, bool)
        and ranks_per_node >= 1
    )
    key = ("topology", ranks_per_node if local_ok else "invalid")
    cache = comm_cache(comm)
    if key in cache:
        return cache[key]
    # Agree on the setting first, so a mistake on one rank is an error on every rank.
    settings = comm.allgather(ranks_per_node if local_ok else repr(ranks_per_node))
    if any(s != settings[0] for s in settings) or not local_ok:
        raise TopologyError(
            f"ranks_per_node must be the same positive integer (or None) on every rank; "
            f"got {settings} by rank; set MPISTRAT_RANKS_PER_NODE identically on every rank "
            f"(e.g. mpiexec -genv MPISTRAT_RANKS_PER_NODE 2) or not at all"
        )
    topology = _build(comm, ranks_per_node)
    cache[key] = topology
    return topology


def _build(comm: Comm, ranks_per_node: int | None) -> Topology:
    MPI = mpi()
    rank, size = comm.Get_rank(), comm.Get_size()
    physical = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    try:
        physical_leader = physical.bcast(rank, root=0)
        sub_node = physical.Get_rank() // ranks_per_node if ranks_per_node else 0
    finally:
        physical.Free()
    entries = comm.allgather((physical_leader, sub_node, MPI.Get_processor_name()))
    groups: dict[tuple[int, int], list[int]] = {}
    for r, (leader, sub, _host) in enumerate(entries):
        groups.setdefault((leader, sub), []).append(r)
    ordered = sorted(groups.values(), key=lambda members: members[0])
    node_of_rank = [0] * size
    for index, members in enumerate(ordered):
        for r in members:
            node_of_rank[r] = index
    node = node_of_rank[rank]
    node_comm = cast("Comm", comm.Split(node, key=rank))
    local_rank = node_comm.Get_rank()
    leader_comm: Comm | None = cast(
        "Comm", comm.Split(0 if local_rank == 0 else MPI.UNDEFINED, key=rank))
    if leader_comm == MPI.COMM_NULL:
        leader_comm = None
    if all(a <= b for a, b in zip(node_of_rank, node_of_rank[1:])):
        host_major = comm
    else:  # (collective: every rank sees the same node_of_rank)
        order = sorted(range(size), key=lambda r: (node_of_rank[r], r))
        host_major = cast("Comm", comm.Split(0, key=order.index(rank)))
    return Topology(
        comm=comm,
        rank=rank,
        size=size,
        node_comm=node_comm,
        local_rank=local_rank,
        local_size=node_comm.Get_size(),
        node=node,
        num_nodes=len(ordered),
        leader_comm=leader_comm,
        node_of_rank=tuple(node_of_rank),
        hostnames=tuple(host for _, _, host in entries),
        ranks_per_node=ranks_per_node,
        host_major=host_major,
    )
