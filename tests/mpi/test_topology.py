"""Node groups, leaders and the virtual-node override, at every rank count."""

from __future__ import annotations

import pytest
from mpi4py import MPI

from mpistrat.layout import Layout
from mpistrat.errors import TopologyError
from mpistrat.runtime.topology import get_topology


def _check_consistent(topo, comm):
    assert topo.rank == comm.rank and topo.size == comm.size
    assert sum(len(g) for g in topo.node_ranks) == comm.size
    assert comm.rank in topo.node_ranks[topo.node]
    assert topo.node_comm.size == topo.local_size == len(topo.node_ranks[topo.node])
    assert topo.local_rank == topo.node_ranks[topo.node].index(comm.rank)
    assert topo.is_leader == (topo.local_rank == 0)
    assert (topo.leader_comm is not None) == topo.is_leader
    if topo.is_leader:
        assert topo.leader_comm.size == topo.num_nodes
        assert topo.leader_comm.rank == topo.node
    # nodes are numbered by their leader's (lowest) rank
    leaders = [group[0] for group in topo.node_ranks]
    assert leaders == sorted(leaders)
    # every rank agrees on the whole picture
    assert comm.allgather(topo.node_of_rank) == [topo.node_of_rank] * comm.size


def test_physical_nodes(comm):
    topo = get_topology(comm, ranks_per_node=None)
    _check_consistent(topo, comm)
    hosts_of_node = {}
    for rank, node in enumerate(topo.node_of_rank):
        hosts_of_node.setdefault(node, set()).add(topo.hostnames[rank])
    assert all(len(h) == 1 for h in hosts_of_node.values()), "a node group spans hosts"
    if len(set(topo.hostnames)) == 1:  # one machine: one node group
        assert topo.num_nodes == 1 and topo.local_rank == comm.rank


@pytest.mark.parametrize("k", [1, 2, 3])
def test_virtual_nodes(comm, k):
    topo = get_topology(comm, ranks_per_node=k)
    _check_consistent(topo, comm)
    assert topo.ranks_per_node == k
    if len(set(topo.hostnames)) == 1:
        assert topo.num_nodes == -(-comm.size // k)
        assert topo.node == comm.rank // k
        assert topo.local_rank == comm.rank % k
    # the cross-node communicator really connects the leaders
    if topo.is_leader:
        assert topo.leader_comm.allreduce(1) == topo.num_nodes
    assert topo.node_comm.allreduce(1) == topo.local_size


def test_cached_per_communicator_and_setting(comm):
    assert get_topology(comm, 2) is get_topology(comm, 2)
    assert get_topology(comm, 1) is not get_topology(comm, 2)


def test_freed_with_its_communicator(world):
    dup = world.Dup()
    topo = get_topology(dup, 2)
    node_comm = topo.node_comm
    dup.Free()  # the attribute's delete callback frees the sub-communicators
    assert node_comm == MPI.COMM_NULL


def test_environment_override(comm, monkeypatch):
    monkeypatch.setenv("MPISTRAT_RANKS_PER_NODE", "2")
    fresh = comm.Dup()
    try:
        topo = get_topology(fresh)
        assert topo.ranks_per_node == 2
        assert topo.num_nodes == -(-comm.size // 2) or len(set(topo.hostnames)) > 1
    finally:
        fresh.Free()


@pytest.mark.mpi(min_size=2)
def test_disagreement_raises_on_every_rank(world):
    fresh = world.Dup()
    try:
        with pytest.raises(TopologyError, match="same positive integer"):
            get_topology(fresh, ranks_per_node=2 if world.rank == 0 else 1)
    finally:
        fresh.Free()


def test_invalid_value_raises_on_every_rank(world):
    fresh = world.Dup()
    try:
        with pytest.raises(TopologyError, match="ranks_per_node"):
            get_topology(fresh, ranks_per_node=0)
    finally:
        fresh.Free()


def test_layout_for_spec_checks(comm):
    topo = get_topology(comm, ranks_per_node=2)
    layout = Layout.of(topo, devices_per_worker=2)
    assert (layout.workers, layout.devices_per_worker, layout.nodes) == (
        comm.size, 2, topo.num_nodes)
