"""``mpistrat bench`` options, entry selection and launch helpers (pure: no MPI)."""

from __future__ import annotations

import types

import numpy as np
import pytest

from mpistrat.bench import launch
from mpistrat.bench.config import (
    MAX_SIZES,
    BatchConfig,
    BenchConfig,
    parse_agg,
    parse_byte_count,
    parse_int_list,
    parse_shards_list,
    resolve_dtype,
    sizes,
)
from mpistrat.bench.entries import select_entries
from mpistrat.errors import UnknownAlgorithmError
from mpistrat.layout import Layout

# ------------------------------------------------------------------ sizes and values


def test_sizes_by_factor_like_nccl_tests():
    assert sizes(4, 1024, stepfactor=4) == [4, 16, 64, 256, 1024]
    assert sizes(8, 100, stepfactor=2) == [8, 16, 32, 64]


def test_sizes_by_step_bytes():
    assert sizes(1000, 4000, stepbytes=1000) == [1000, 2000, 3000, 4000]


@pytest.mark.parametrize("kwargs, message", [
    ({"minbytes": 8, "maxbytes": 4, "stepfactor": 2}, "below --minbytes"),
    ({"minbytes": 4, "maxbytes": 8}, "exactly one of --stepfactor"),
    ({"minbytes": 4, "maxbytes": 8, "stepfactor": 2, "stepbytes": 4}, "exactly one"),
    ({"minbytes": 4, "maxbytes": 8, "stepfactor": 1}, "at least 2"),
])
def test_sizes_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        sizes(**kwargs)


def test_sizes_by_step_bytes_are_counted_before_the_list_is_built():
    """``-i`` walks a range linearly: more than MAX_SIZES sizes is an error that names the
    count and the smallest -i that fits, raised before the list exists (``-b 4 -e 1G -i 1``
    would be a billion sizes)."""
    assert MAX_SIZES == 4096
    assert sizes(1, MAX_SIZES, stepbytes=1) == list(range(1, MAX_SIZES + 1))
    with pytest.raises(ValueError, match=rf"gives {MAX_SIZES + 1} sizes, more than the "
                                         rf"{MAX_SIZES} a sweep measures; give -i 2 or more"):
        sizes(1, MAX_SIZES + 1, stepbytes=1)
    with pytest.raises(ValueError, match=r"--stepbytes 1 from 4 B to 1 GiB gives 1073741821 "
                                         r"sizes.*give -i 262209 or more"):
        sizes(4, 1 << 30, stepbytes=1)
    fewest = -(-((1 << 30) - 4) // (MAX_SIZES - 1))
    assert len(sizes(4, 1 << 30, stepbytes=fewest)) <= MAX_SIZES
    with pytest.raises(ValueError, match="gives 1073741821 sizes"):
        BenchConfig(minbytes=4, maxbytes=1 << 30, stepfactor=None, stepbytes=1)
    # rounded down to whole elements, each size is kept once, ascending (a repeat is always
    # the last size kept: one comparison per size, not a search of the list)
    config = BenchConfig(minbytes=1, maxbytes=4 * MAX_SIZES - 1, stepfactor=None,
                         stepbytes=4, dtype="float64")
    assert config.sizes() == list(range(8, 4 * MAX_SIZES, 8))
    config = BenchConfig(minbytes=3, maxbytes=40, stepfactor=None, stepbytes=3,
                         dtype="float32")
    assert config.sizes() == [4, 8, 12, 16, 20, 24, 28, 32, 36]


def test_shard_counts_are_bounded_like_specs():
    assert parse_shards_list("1,1024,all") == (1, 1024, None)
    with pytest.raises(ValueError, match="--shards values must be at most 1024, got 1025"):
        parse_shards_list("1,1025")
    with pytest.raises(ValueError, match=r"--shards value 9{18}\.\.\. \(5000 digits\) is too "
                                         r"large; give integers from 1 to 1024"):
        parse_shards_list("9" * 5000)
    with pytest.raises(ValueError, match=r"\(5000 digits\) is too large"):
        parse_int_list("9" * 5000, "--num-packs")


def test_all_shards_stop_at_the_spec_bound():
    entries, notes = select_entries(Layout(2000), ["pscpu", "xring"], [None, 2])
    assert [e.label for e in entries] == ["native", "pscpu#1024", "pscpu#2", "xring#2"]
    assert any("pscpu#1024: 'all' of its pool (2000 ranks) stops at 1024" in n for n in notes)


def test_byte_counts_take_binary_suffixes():
    assert parse_byte_count("32K", "-b") == 32 * 1024
    assert parse_byte_count("256M", "-e") == 256 << 20
    for bad in ("0", "-1", "1.5K", "lots"):
        with pytest.raises(ValueError, match="-b must be a byte count"):
            parse_byte_count(bad, "-b")


def test_lists():
    assert parse_int_list("1, 2,4,2", "--num-packs") == (1, 2, 4)
    with pytest.raises(ValueError, match=">= 1"):
        parse_int_list("0,1", "--num-packs")
    with pytest.raises(ValueError, match="integers"):
        parse_int_list("one", "--num-packs")
    assert parse_shards_list("1,all,2,ALL") == (1, None, 2)
    with pytest.raises(ValueError, match="at least one"):
        parse_shards_list(" , ")


def test_agg_small_grads():
    assert parse_agg("64K:16") == (65536, 16)
    assert parse_agg("0") == (0, 0)
    for bad in ("64K", "64K:0", "x:2", "64K:y"):
        with pytest.raises(ValueError, match="BYTES:GROUP|byte count"):
            parse_agg(bad)


def test_dtypes():
    assert resolve_dtype("float") == np.float32
    assert resolve_dtype("int64") == np.int64
    assert resolve_dtype("bfloat16").name == "bfloat16"
    with pytest.raises(ValueError, match="unknown dtype 'floaty'"):
        resolve_dtype("floaty")
    with pytest.raises(ValueError, match="not numeric"):
        resolve_dtype("bool")


def test_config_sizes_round_to_whole_elements():
    config = BenchConfig(minbytes=2, maxbytes=64, stepfactor=2, dtype="float64")
    assert config.sizes() == [8, 16, 32, 64]  # 2 and 4 B hold no float64
    with pytest.raises(ValueError, match="holds one float64 element"):
        BenchConfig(minbytes=2, maxbytes=4, stepfactor=2, dtype="float64")


@pytest.mark.parametrize("kwargs, message", [
    ({"op": "mean", "dtype": "int32"}, "mean of integer dtype"),
    ({"op": "max", "dtype": "complex64"}, "not defined for complex"),
    ({"min_iters": 10, "max_iters": 5}, "--min-iters"),
    ({"local_replicas": 2, "gpus_per_rank": 1}, "exclude each other"),
    ({"compare": ("horovod",)}, "--compare knows 'torch'"),
    ({"compare": ("torch",), "local_replicas": 2}, "one buffer per rank"),
    ({"op": "avg"}, "unknown reduce op"),
])
def test_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BenchConfig(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"compare": ("horovod",)}, "--compare knows 'torch'"),
    ({"compare": ("torch",), "local_replicas": 2}, "got 2 replicas per rank"),
    ({"shapes": ()}, "has no tensors"),
])
def test_batch_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BatchConfig(**{"shapes": ((4,), (2, 3)), **kwargs})


def test_batch_config_takes_compare_torch():
    config = BatchConfig(shapes=((4,),), compare=("torch",))
    assert config.compare == ("torch",) and config.local_replicas == 1


# ------------------------------------------------------------------ entries


def labels(entries):
    return [e.label for e in entries]


def test_default_entries_on_two_ranks_one_node():
    entries, notes = select_entries(Layout(2, 1, False, 1))
    assert labels(entries) == ["native", "xring", "xring#2", "rechd", "pscpu", "pscpu#2",
                               "shm", "pscpu/pscpu"]
    assert any("GPU algorithms not measured" in n and "nccl" in n for n in notes)
    assert any("pscpu/pscpu" in n and "one node" in n for n in notes)


def test_default_entries_on_four_ranks_two_nodes_use_every_gather_rank():
    entries, notes = select_entries(Layout(4, 1, False, 2))
    assert "pscpu#4" in labels(entries)
    assert "pscpu/pscpu#2" in labels(entries)  # 'all' = the 2 node leaders
    # shared memory only inside nodes: the hierarchical forms, not plain shm
    assert "shm" not in labels(entries)
    assert {"shm/xring", "shm/rechd", "shm/pscpu", "shm/pscpu#2"} <= set(labels(entries))
    assert any("single-node algorithms not measured" in n and "shm" in n for n in notes)


def test_plain_shm_across_nodes_is_an_error_naming_the_hierarchical_forms():
    with pytest.raises(ValueError, match="works inside one node.*'shm/xring', 'shm/rechd', "
                                         "'shm/pscpu'"):
        select_entries(Layout(4, 1, False, 2), ["shm"])
    entries, _ = select_entries(Layout(4, 1, False, 1), ["shm"])
    assert labels(entries) == ["native", "shm"]


def test_named_algorithms_with_shards():
    entries, notes = select_entries(Layout(3), ["xring", "pscpu", "rechd"], [1, 4, None])
    assert labels(entries) == ["native", "xring", "xring#4", "pscpu", "pscpu#3", "rechd"]
    assert any("pscpu#4 skipped" in n for n in notes)


def test_explicit_shards_are_kept_and_checked():
    entries, _ = select_entries(Layout(2), ["xring#3", "native"])
    assert labels(entries) == ["native", "xring#3"]
    with pytest.raises(ValueError, match="shards=5 but its gather pool"):
        select_entries(Layout(2), ["pscpu#5"])


def test_unknown_and_gpu_algorithms_are_errors():
    with pytest.raises(UnknownAlgorithmError, match="did you mean 'xring'"):
        select_entries(Layout(2), ["xrng"])
    with pytest.raises(ValueError, match="needs GPUs"):
        select_entries(Layout(2), ["nccl"])
    with pytest.raises(ValueError, match="spec with 2 entries"):
        select_entries(Layout(2), ["xring:1K:rechd"])
    with pytest.raises(ValueError, match="empty"):
        select_entries(Layout(2), [])


def test_specs_and_peers_are_entries():
    entries, _ = select_entries(Layout(2), None, specs=["rechd:1K:xring#2"],
                                compare=["torch"])
    assert labels(entries) == ["native", "spec:rechd:1K:xring#2", "torch-gloo", "torch-mpistrat"]
    spec = entries[1]
    assert spec.route(1024) == ("rechd", 1) and spec.route(1025) == ("xring", 2)
    assert not spec.recommendable and entries[0].recommendable
    with pytest.raises(ValueError, match="not an mpistrat algorithm"):
        entries[2].route(8)


def test_ignored_shards_are_normalised():
    entries, notes = select_entries(Layout(2), ["rechd#2"])
    assert labels(entries) == ["native", "rechd"]
    assert any("rechd ignores shards" in n for n in notes)


# ------------------------------------------------------------------ launch helpers


def test_relaunch_command_drops_launch_options():
    args = ["--np", "2", "-b", "4", "--mpiexec=/x/mpiexec", "-np", "3", "--np=2", "-n", "5"]
    assert launch.relaunch_command(args, python="py") == [
        "py", "-m", "mpistrat", "bench", "-b", "4", "-n", "5"]


def test_transport_and_env():
    assert launch.transport_env("auto") == {}
    assert launch.transport_env("net")["MPIR_CVAR_NOLOCAL"] == "1"
    with pytest.raises(ValueError, match="--transport must be one of"):
        launch.transport_env("ib")
    assert launch.parse_env(["A=1", "B=x=y"]) == {"A": "1", "B": "x=y"}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        launch.parse_env(["novalue"])


def test_apply_env_before_mpi_only(monkeypatch):
    environ: dict[str, str] = {}
    monkeypatch.setitem(__import__("sys").modules, "mpi4py.MPI",
                        types.SimpleNamespace(Is_initialized=lambda: False))
    launch.apply_env({"MPIR_CVAR_NOLOCAL": "1"}, environ)
    assert environ == {"MPIR_CVAR_NOLOCAL": "1"}
    monkeypatch.setitem(__import__("sys").modules, "mpi4py.MPI",
                        types.SimpleNamespace(Is_initialized=lambda: True))
    with pytest.raises(RuntimeError, match="already initialised"):
        launch.apply_env({"MPIR_CVAR_NOLOCAL": "1"}, environ)
    launch.apply_env({}, environ)  # nothing to set: fine at any time
