"""Device assignment: the pure rule (CUDA_VISIBLE_DEVICES x local rank) and duplicate detection."""

from __future__ import annotations

import pytest

from mpistrat.runtime.devices import (
    DuplicateDeviceError, assign_devices, duplicate_devices, parse_visible_devices,
)
from mpistrat.errors import TopologyError


@pytest.mark.parametrize(("value", "entries"), [
    (None, None), ("", ()), ("0", ("0",)), ("0,1, 2", ("0", "1", "2")),
    ("3,-1,4", ("3",)), ("1,,2", ("1",)), ("GPU-aa,GPU-bb", ("GPU-aa", "GPU-bb")),
    ("NoDevFiles", ()),
])
def test_parse_visible_devices(value, entries):
    assert parse_visible_devices(value) == entries


@pytest.mark.parametrize(("local_rank", "ordinals"), [(0, (0,)), (1, (1,)), (3, (3,))])
def test_shared_visibility_one_gpu_each(local_rank, ordinals):
    a = assign_devices(local_rank, 4, 1, None, 4)
    assert a.ordinals == ordinals and a.mode == "shared"
    assert a.physical == (f"ordinal {ordinals[0]}",)


def test_shared_visibility_two_gpus_each():
    got = [assign_devices(r, 4, 2, "0,1,2,3,4,5,6,7", 8).ordinals for r in range(4)]
    assert got == [(0, 1), (2, 3), (4, 5), (6, 7)]


def test_shared_visibility_resolves_entries():
    a = assign_devices(1, 2, 1, "5,7", 2)
    # the process sees two devices for two ranks of one GPU each: slice by local rank
    assert a.ordinals == (1,) and a.physical == ("CUDA_VISIBLE_DEVICES[1]=7",)


def test_extra_devices_are_left_unused():
    assert assign_devices(1, 2, 1, None, 8).ordinals == (1,)


def test_per_rank_visibility():
    """Slurm --gpus-per-task: every rank sees exactly its own G devices."""
    for r in range(4):
        a = assign_devices(r, 4, 2, f"{2 * r},{2 * r + 1}", 2)
        assert a.ordinals == (0, 1) and a.mode == "per-rank"
        assert a.physical == (f"CUDA_VISIBLE_DEVICES[0]={2 * r}",
                              f"CUDA_VISIBLE_DEVICES[1]={2 * r + 1}")


def test_one_gpu_shared_by_two_ranks_is_allowed_here():
    """Assignment allows it (MPI-staged algorithms may share a GPU); NCCL's check does not."""
    a, b = (assign_devices(r, 2, 1, None, 1) for r in range(2))
    assert a.ordinals == b.ordinals == (0,)
    assert duplicate_devices([("h", a.physical), ("h", b.physical)]) == {
        ("h", "ordinal 0"): [0, 1]}


def test_uuids_win_over_entries():
    a = assign_devices(0, 1, 2, "0,1", 2, uuids=["GPU-a", None])
    assert a.physical == ("GPU-a", "CUDA_VISIBLE_DEVICES[1]=1")
    assert a.describe() == "0 (GPU-a), 1 (CUDA_VISIBLE_DEVICES[1]=1)"


@pytest.mark.parametrize(("local_size", "g", "count", "fragment"), [
    (1, 2, 1, "needs 2 GPU(s) per rank"),
    (4, 1, 2, "4 rank(s) x 1 GPU(s) = 4 on this node"),
    (2, 2, 3, "2 rank(s) x 2 GPU(s) = 4"),
    (1, 1, 0, "sees 0 CUDA device(s)"),
])
def test_not_enough_devices(local_size, g, count, fragment):
    with pytest.raises(TopologyError, match="cannot get") as info:
        assign_devices(0, local_size, g, "0,1,2"[:2 * count - 1] if count else "", count)
    assert fragment in str(info.value) and "--gpus-per-task" in str(info.value)


@pytest.mark.parametrize("g", [0, -1, 1.5, True, "1"])
def test_bad_gpus_per_rank(g):
    with pytest.raises(TopologyError, match="gpus_per_rank must be an integer >= 1"):
        assign_devices(0, 1, g, None, 4)


def test_bad_local_rank():
    with pytest.raises(TopologyError, match="local rank 2 is not in 0..1"):
        assign_devices(2, 2, 1, None, 4)


def test_duplicates_need_the_same_host():
    claims = [("a", ("0",)), ("b", ("0",)), ("a", ("1",)), ("a", ("0", "2"))]
    assert duplicate_devices(claims) == {("a", "0"): [0, 3]}
    assert duplicate_devices([("a", ("x", "x"))]) == {("a", "x"): [0, 0]}
    assert duplicate_devices(claims[:3]) == {}


def test_duplicate_error_is_a_topology_error():
    assert issubclass(DuplicateDeviceError, TopologyError)
