"""Collective device checks: every rank raises the same error when two ranks claim one GPU,
or when one rank cannot get its share. The device inputs are faked: no GPU is needed."""

from __future__ import annotations

import pytest

from mpistrat.runtime.devices import DuplicateDeviceError, node_assignment, require_distinct_devices
from mpistrat.errors import BackendUnavailable, TopologyError
from mpistrat.runtime.topology import get_topology


def _same_everywhere(comm, text):
    assert comm.allgather(text) == [text] * comm.size


def test_distinct_devices_pass(comm):
    require_distinct_devices(comm, [f"GPU-{comm.rank}"], host="node")


def test_duplicate_raises_on_every_rank(comm):
    # the last rank claims rank 0's GPU (at size 1: the same GPU twice)
    mine = [f"GPU-{comm.rank}"] if comm.rank < comm.size - 1 else ["GPU-0"]
    if comm.size == 1:
        mine = ["GPU-0", "GPU-0"]
    with pytest.raises(DuplicateDeviceError) as info:
        require_distinct_devices(comm, mine, host="node")
    text = str(info.value)
    assert "GPU GPU-0 on node" in text and "Duplicate GPU detected" in text
    expected = f"[0, {comm.size - 1}]" if comm.size > 1 else "[0] (one rank twice)"
    assert expected in text
    _same_everywhere(comm, text)


def test_same_gpu_on_different_hosts_is_fine(comm):
    require_distinct_devices(comm, ["GPU-0"], host=f"host{comm.rank}")


def test_node_assignment_shared_visibility(comm):
    topology = get_topology(comm)
    count = topology.local_size
    a = node_assignment(comm, 1, environ={}, probe=lambda: (count, [None] * count))
    assert a.ordinals == (topology.local_rank,)
    require_distinct_devices(comm, a.physical)  # one device per rank: no clash


def test_node_assignment_failure_on_one_rank_raises_everywhere(comm):
    def probe():
        return (0, []) if comm.rank == comm.size - 1 else (4 * comm.size, [None] * 4 * comm.size)

    with pytest.raises(TopologyError, match="GPU assignment failed on 1 rank") as info:
        node_assignment(comm, 1, environ={"CUDA_VISIBLE_DEVICES": ""}, probe=probe)
    assert f"rank {comm.size - 1}: TopologyError" in str(info.value)
    _same_everywhere(comm, str(info.value))


def test_node_assignment_without_cupy_raises_everywhere(comm):
    def probe():
        raise BackendUnavailable("GPU workers need CuPy (faked)")

    with pytest.raises(BackendUnavailable, match="need CuPy") as info:
        node_assignment(comm, 1, environ={}, probe=probe)
    _same_everywhere(comm, str(info.value))


def test_shared_single_gpu_is_a_duplicate_for_nccl(comm):
    """Two ranks on one node seeing one GPU both take it; the NCCL check refuses."""
    a = node_assignment(comm, 1, environ={"CUDA_VISIBLE_DEVICES": "0"},
                        probe=lambda: (1, [None]))
    assert a.ordinals == (0,) and a.physical == ("CUDA_VISIBLE_DEVICES[0]=0",)
    if get_topology(comm).local_size == 1 and get_topology(comm).num_nodes == comm.size:
        require_distinct_devices(comm, a.physical)
    else:
        with pytest.raises(DuplicateDeviceError):
            require_distinct_devices(comm, a.physical)
