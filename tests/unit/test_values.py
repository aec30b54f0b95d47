"""Distributed values (``PerReplica``, ``Mirrored``, device names), ``CommunicationOptions``,
and the ``Mirrored`` results of the CrossDeviceOps on one process (COMM_SELF).

The multi-rank behaviour of the CrossDeviceOps is in tests/mpi/test_cross_device_ops.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import pytest

from mpistrat import (
    CollectiveCommunication,
    CommunicationImplementation,
    CommunicationOptions,
    DistributedValues,
    Mirrored,
    PerReplica,
)
from mpistrat.values import Device, default_devices, parse_device

# --- device names ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "device"),
    [
        ("/cpu:0", Device("cpu", 0)),
        ("cpu:0", Device("cpu", 0)),
        ("CPU:0", Device("cpu", 0)),
        ("/CPU:3", Device("cpu", 3)),
        ("/device:CPU:0", Device("cpu", 0)),
        ("device:cpu:2", Device("cpu", 2)),
        ("/gpu:0", Device("gpu", 0)),
        ("GPU:1", Device("gpu", 1)),
        ("/device:GPU:1", Device("gpu", 1)),
        ("/job:worker/replica:0/task:2/device:CPU:0", Device("cpu", 0, 2)),
        ("/job:worker/task:0/device:CPU:0", Device("cpu", 0, 0)),
        ("/job:worker/task:1/device:GPU:3", Device("gpu", 3, 1)),
        ("/job:localhost/replica:0/task:0/device:CPU:1", Device("cpu", 1, 0)),
        ("/job:worker/task:12/cpu:0", Device("cpu", 0, 12)),
        ("/task:1/device:CPU:0", Device("cpu", 0, 1)),
        ("/replica:0/device:GPU:0", Device("gpu", 0)),
        ("/job:worker/device:CPU:0", Device("cpu", 0)),
        ("  /cpu:0 ", Device("cpu", 0)),
    ],
)
def test_parse_device_spellings(name, device):
    assert parse_device(name) == device


def test_parse_device_passes_devices_through():
    device = Device("gpu", 2, 1)
    assert parse_device(device) is device


@pytest.mark.parametrize(
    "name",
    ["", "   ", "tpu:0", "/tpu:0", "/device:TPU:0", "/job:worker", "/job:worker/task:1", "cpu",
     "/cpu:", "/cpu:x", "/cpu:-1", "gpu0", "/cpu:0/gpu:0", "/cpu:0/job:worker", "/cpu:0 junk"],
)
def test_parse_device_rejects_non_device_names(name):
    with pytest.raises(ValueError, match="is not a device name") as info:
        parse_device(name)
    assert repr(name) in str(info.value)
    assert not isinstance(info.value, TypeError)


@pytest.mark.parametrize("name", [5, None, 1.5, b"/cpu:0", ["/cpu:0"], ("cpu", 0)])
def test_parse_device_rejects_non_strings(name):
    with pytest.raises(TypeError, match="a device name must be a str") as info:
        parse_device(name)
    assert repr(name) in str(info.value)


@pytest.mark.parametrize(
    ("device", "text"),
    [
        (Device("cpu", 0), "/cpu:0"),
        (Device("gpu", 3), "/gpu:3"),
        (Device("cpu", 1, 2), "/job:worker/task:2/device:CPU:1"),
        (Device("gpu", 0, 0), "/job:worker/task:0/device:GPU:0"),
    ],
)
def test_device_str_is_canonical_and_parses_back(device, text):
    assert str(device) == text
    assert parse_device(text) == device


def test_device_on_fills_in_the_task():
    assert Device("cpu", 1).on(3) == Device("cpu", 1, 3)
    assert Device("cpu", 1, 0).on(3) == Device("cpu", 1, 0)  # a task stays
    assert Device("cpu", 0) != Device("cpu", 0, 0)
    assert Device("cpu", 0).on(0) == Device("cpu", 0, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        Device("cpu", 0).index = 1  # type: ignore[misc]


def test_default_devices():
    assert default_devices(1) == ("/cpu:0",)
    assert default_devices(3) == ("/cpu:0", "/cpu:1", "/cpu:2")
    assert default_devices(2, gpus=True) == ("/gpu:0", "/gpu:1")
    assert default_devices(0) == ()


# --- PerReplica and Mirrored -------------------------------------------------------------


@pytest.mark.parametrize("cls", [PerReplica, Mirrored])
def test_construction_with_default_devices(cls):
    a, b, c = np.zeros(2), np.ones(2), np.full(2, 2.0)
    value = cls([a, b, c])
    assert isinstance(value, DistributedValues)
    assert value.devices == ("/cpu:0", "/cpu:1", "/cpu:2")
    assert value.device_set == (Device("cpu", 0), Device("cpu", 1), Device("cpu", 2))
    assert all(x is y for x, y in zip(value.values, (a, b, c)))  # no copies
    assert isinstance(value.values, tuple)
    assert value.primary is a
    assert len(value) == 3


def test_perreplica_and_mirrored_are_different_kinds():
    assert not isinstance(PerReplica([1]), Mirrored)
    assert not isinstance(Mirrored([1]), PerReplica)
    assert issubclass(PerReplica, DistributedValues) and issubclass(Mirrored, DistributedValues)


def test_values_may_be_a_tuple_and_anything_array_like():
    value = PerReplica((1, 2.5, np.float32(3)))
    assert value.values == (1, 2.5, np.float32(3))
    assert value.devices == ("/cpu:0", "/cpu:1", "/cpu:2")


def test_explicit_devices_any_spelling_become_canonical():
    value = PerReplica(
        ["a", "b", "c", "d"],
        ["/device:GPU:1", "CPU:0", "/job:worker/replica:0/task:2/device:CPU:0",
         Device("gpu", 0)],
    )
    assert value.devices == ("/gpu:1", "/cpu:0", "/job:worker/task:2/device:CPU:0", "/gpu:0")
    assert value.device_set == (Device("gpu", 1), Device("cpu", 0), Device("cpu", 0, 2),
                                Device("gpu", 0))
    assert value.primary == "a"


@pytest.mark.parametrize(
    "spelling", ["/cpu:1", "cpu:1", "CPU:1", "/device:CPU:1", "/job:worker/cpu:1",
                 Device("cpu", 1)])
def test_get_with_any_spelling(spelling):
    a, b = np.zeros(3), np.ones(3)
    value = Mirrored([a, b])
    assert value.get(spelling) is b
    assert value[spelling] is b


def test_get_task_qualified_device():
    value = PerReplica(["x", "y"], ["/job:worker/task:1/device:CPU:0", "/cpu:0"])
    assert value.get("/job:worker/replica:0/task:1/device:CPU:0") == "x"
    assert value.get("/cpu:0") == "y"
    with pytest.raises(KeyError):
        value.get("/job:worker/task:0/device:CPU:0")  # a task is not "this rank"


def test_get_missing_device_raises_key_error_naming_the_devices():
    value = PerReplica([1, 2])
    with pytest.raises(KeyError, match="/gpu:0") as info:
        value.get("/gpu:0")
    assert "/cpu:0" in str(info.value) and "/cpu:1" in str(info.value)
    with pytest.raises(KeyError):
        value["/cpu:2"]
    with pytest.raises(ValueError, match="is not a device name"):
        value.get("tpu:0")
    with pytest.raises(TypeError):
        value.get(None)


def test_indexing_by_position():
    a, b = np.zeros(1), np.ones(1)
    value = PerReplica([a, b])
    assert value[0] is a and value[1] is b
    assert value[-1] is b
    with pytest.raises(IndexError):
        value[2]


def test_repr_names_class_devices_and_values():
    value = PerReplica([np.array([1, 2]), np.array([3, 4])])
    text = repr(value)
    assert text.startswith("PerReplica({") and text.endswith("})")
    assert "'/cpu:0': array([1, 2])" in text and "'/cpu:1': array([3, 4])" in text
    mirrored = Mirrored([1.5], ["/job:worker/task:1/device:GPU:0"])
    assert repr(mirrored) == "Mirrored({'/job:worker/task:1/device:GPU:0': 1.5})"


@pytest.mark.parametrize("cls", [PerReplica, Mirrored])
def test_no_values(cls):
    with pytest.raises(ValueError, match="at least one value"):
        cls([])
    with pytest.raises(ValueError, match="at least one value"):
        cls((), [])


@pytest.mark.parametrize(
    ("values", "devices"),
    [([1, 2], ["/cpu:0"]), ([1], ["/cpu:0", "/cpu:1"]), ([1, 2, 3], []), ([1], ())],
)
def test_device_count_mismatch(values, devices):
    with pytest.raises(ValueError, match=f"got {len(values)} values but {len(devices)} devices"):
        PerReplica(values, devices)


@pytest.mark.parametrize(
    "devices",
    [["/cpu:0", "/cpu:0"], ["/cpu:0", "CPU:0"], ["/device:GPU:1", "/gpu:1"],
     ["/cpu:0", "/cpu:1", "/cpu:0"],
     ["/job:worker/task:1/device:CPU:0", "/job:worker/replica:0/task:1/cpu:0"]],
)
def test_repeated_device(devices):
    with pytest.raises(ValueError, match="devices repeat"):
        Mirrored(list(range(len(devices))), devices)


def test_same_index_on_different_tasks_or_kinds_is_not_a_repeat():
    value = PerReplica([1, 2, 3], ["/cpu:0", "/gpu:0", "/job:worker/task:0/device:CPU:0"])
    assert len(value) == 3


@pytest.mark.parametrize("devices", [["tpu:0"], [""], [5]])
def test_bad_device_names_in_construction(devices):
    with pytest.raises((ValueError, TypeError)) as info:
        PerReplica([1], devices)
    assert type(info.value) is (TypeError if devices == [5] else ValueError)


@pytest.mark.parametrize("values", [np.ones(3), "ab", b"ab", 5, None, (x for x in [1]),
                                    {"/cpu:0": 1}])
def test_values_must_be_a_list_or_tuple(values):
    assert not isinstance(values, (list, tuple))
    with pytest.raises(TypeError, match="list or tuple of per-device values"):
        PerReplica(values)


def test_values_are_read_only_views_of_the_components():
    value = PerReplica([np.zeros(2)])
    with pytest.raises(AttributeError):
        value.values = (np.ones(2),)  # type: ignore[misc]
    with pytest.raises(AttributeError):
        value.extra = 1  # type: ignore[attr-defined]
    assert isinstance(value.values, Sequence)


# --- CommunicationOptions ----------------------------------------------------------------


def test_communication_options_defaults():
    options = CommunicationOptions()
    assert options.bytes_per_pack == 0
    assert options.timeout_seconds is None
    assert options.implementation is CommunicationImplementation.AUTO
    assert CollectiveCommunication is CommunicationImplementation


@pytest.mark.parametrize(
    ("kwargs", "field", "value"),
    [
        ({"bytes_per_pack": 1024}, "bytes_per_pack", 1024),
        ({"timeout_seconds": 0.5}, "timeout_seconds", 0.5),
        ({"timeout_seconds": 3}, "timeout_seconds", 3),
        ({"implementation": "ring"}, "implementation", CommunicationImplementation.RING),
        ({"implementation": " NCCL "}, "implementation", CommunicationImplementation.NCCL),
        ({"implementation": "Auto"}, "implementation", CommunicationImplementation.AUTO),
        ({"implementation": CollectiveCommunication.RING}, "implementation",
         CommunicationImplementation.RING),
    ],
)
def test_communication_options_valid(kwargs, field, value):
    assert getattr(CommunicationOptions(**kwargs), field) == value


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"bytes_per_pack": -1}, "bytes_per_pack must be an integer >= 0"),
        ({"bytes_per_pack": 1.5}, "bytes_per_pack must be an integer >= 0"),
        ({"bytes_per_pack": True}, "bytes_per_pack must be an integer >= 0"),
        ({"bytes_per_pack": "1K"}, "bytes_per_pack must be an integer >= 0"),
        ({"timeout_seconds": 0}, "timeout_seconds must be a number > 0"),
        ({"timeout_seconds": -1.0}, "timeout_seconds must be a number > 0"),
        ({"timeout_seconds": float("nan")}, "timeout_seconds must be a number > 0"),
        ({"timeout_seconds": True}, "timeout_seconds must be a number > 0"),
        ({"timeout_seconds": "5"}, "timeout_seconds must be a number > 0"),
        ({"implementation": "bogus"}, "implementation must be one of AUTO, RING, NCCL"),
        ({"implementation": 1}, "implementation must be one of"),
        ({"implementation": None}, "implementation must be one of"),
    ],
)
def test_communication_options_invalid(kwargs, text):
    with pytest.raises(ValueError, match=text) as info:
        CommunicationOptions(**kwargs)
    assert repr(next(iter(kwargs.values()))) in str(info.value)


def test_communication_options_are_frozen_and_comparable():
    options = CommunicationOptions(bytes_per_pack=8, timeout_seconds=2.0, implementation="ring")
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.bytes_per_pack = 16  # type: ignore[misc]
    assert options == CommunicationOptions(8, 2.0, CommunicationImplementation.RING)
    assert options != CommunicationOptions(8, 2.0)


# --- the Mirrored results of CrossDeviceOps on one process (COMM_SELF) --------------------


@pytest.fixture
def self_comm():
    MPI = pytest.importorskip("mpi4py.MPI")
    return MPI.COMM_SELF


def _ops(comm):
    from mpistrat import (
        AllReduceCrossDeviceOps,
        HierarchicalCopyAllReduce,
        MultiWorkerAllReduce,
        ReductionToOneDevice,
    )

    return {
        "ReductionToOneDevice": ReductionToOneDevice(comm=comm),
        "MultiWorkerAllReduce": MultiWorkerAllReduce(all_reduce_spec="xring:1K:pscpu",
                                                     num_packs=2, comm=comm),
        "AllReduceCrossDeviceOps": AllReduceCrossDeviceOps("hierarchical_copy", comm=comm),
        "HierarchicalCopyAllReduce": HierarchicalCopyAllReduce(0, comm=comm),
    }


@pytest.mark.parametrize("name", ["ReductionToOneDevice", "MultiWorkerAllReduce",
                                  "AllReduceCrossDeviceOps", "HierarchicalCopyAllReduce"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.float16])
def test_one_process_reduction_matrix(self_comm, name, dtype):
    """One rank, two replicas: SUM and MEAN to every kind of destination; MEAN of int32 is
    float64; results fresh, on the destination devices, one array per device."""
    ops = _ops(self_comm)[name]
    a = np.arange(6, dtype=dtype).reshape(2, 3)
    b = (a * 3).astype(dtype)
    value = PerReplica([a, b])
    for dest, devices in [(value, {"/cpu:0", "/cpu:1"}), ("/cpu:0", {"/cpu:0"}),
                          (["CPU:1", "/device:CPU:0"], {"/cpu:0", "/cpu:1"}),
                          (["/cpu:4"], {"/cpu:4"}),
                          ("/job:worker/task:0/device:CPU:0", {"/job:worker/task:0/device:CPU:0"})]:
        for op in ("sum", "mean"):
            out = ops.reduce(op, value, dest)
            if len(devices) == 1:  # one destination device: the array itself, as TF
                assert isinstance(out, np.ndarray)
                parts: tuple = (out,)
            else:
                assert isinstance(out, Mirrored)
                assert {str(parse_device(d).on(0)) for d in out.devices} == \
                    {str(parse_device(d).on(0)) for d in devices}
                parts = out.values
            want = (a.astype(np.float64) + b) / (2 if op == "mean" else 1)
            out_dtype = np.float64 if op == "mean" and np.dtype(dtype).kind == "i" else dtype
            for i, result in enumerate(parts):
                assert result.dtype == out_dtype and result.shape == (2, 3)
                np.testing.assert_array_equal(result, want.astype(out_dtype))
                assert not np.shares_memory(result, a) and not np.shares_memory(result, b)
                assert not any(np.shares_memory(result, other) for other in parts[i + 1:])
    np.testing.assert_array_equal(a, np.arange(6).reshape(2, 3))


@pytest.mark.parametrize("name", ["ReductionToOneDevice", "MultiWorkerAllReduce",
                                  "AllReduceCrossDeviceOps", "HierarchicalCopyAllReduce"])
def test_one_process_shortcut(self_comm, name):
    """TF's shortcut: one component whose device is the destination comes back as is (the
    array itself: a single destination device gives the tensor, not a Mirrored)."""
    ops = _ops(self_comm)[name]
    a = np.arange(4, dtype=np.int32)
    value = PerReplica([a])
    for dest in (value, "/cpu:0", ["CPU:0"], "/job:worker/task:0/device:CPU:0"):
        for op in ("sum", "mean"):
            out = ops.reduce(op, value, dest)
            assert out is a
            batch = ops.batch_reduce(op, [(value, dest), (value, value)])
            assert [b is a for b in batch] == [True, True]
