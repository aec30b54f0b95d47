"""Dataset options, InputOptions and InputContext: TF's names, values and errors."""

from __future__ import annotations

import dataclasses

import pytest

from mpistrat.data import (
    AutoShardPolicy,
    Dataset,
    DistributeOptions,
    InputContext,
    InputOptions,
    InputReplicationMode,
    Options,
)


def test_auto_shard_policy_has_tf_values():
    assert {p.name: p.value for p in AutoShardPolicy} == {"OFF": -1, "AUTO": 0, "FILE": 1,
                                                          "DATA": 2}


def test_options_default_and_set():
    options = Options()
    assert options.experimental_distribute.auto_shard_policy is AutoShardPolicy.AUTO
    options.experimental_distribute.auto_shard_policy = AutoShardPolicy.DATA
    assert options.experimental_distribute.auto_shard_policy is AutoShardPolicy.DATA
    options.experimental_distribute.auto_shard_policy = 1  # TF's integer value
    assert options.experimental_distribute.auto_shard_policy is AutoShardPolicy.FILE


def test_options_reject_bad_values_and_misspelt_names():
    options = Options()
    with pytest.raises(ValueError, match="7 is not a policy.*OFF=-1"):
        options.experimental_distribute.auto_shard_policy = 7
    with pytest.raises(TypeError, match="AutoShardPolicy"):
        options.experimental_distribute.auto_shard_policy = "DATA"
    with pytest.raises(AttributeError):
        options.experimental_distribute.auto_shard_polcy = AutoShardPolicy.OFF
    with pytest.raises(AttributeError):
        options.experimental_distrbute = DistributeOptions()
    with pytest.raises(TypeError, match="DistributeOptions"):
        options.experimental_distribute = {"auto_shard_policy": 1}


def test_with_options_merges_and_newer_set_options_win():
    off = Options()
    off.experimental_distribute.auto_shard_policy = AutoShardPolicy.OFF
    data = Options()
    data.experimental_distribute.auto_shard_policy = AutoShardPolicy.DATA
    ds = Dataset.range(4).with_options(off)
    assert ds.options().experimental_distribute.auto_shard_policy is AutoShardPolicy.OFF
    # an option left unset does not override; later steps inherit the options
    kept = ds.with_options(Options()).batch(2).prefetch(1)
    assert kept.options().experimental_distribute.auto_shard_policy is AutoShardPolicy.OFF
    assert kept.with_options(data).options() == data
    loose = Options()
    loose.experimental_deterministic = False
    merged = kept.with_options(loose).options()
    assert merged.experimental_deterministic is False
    assert merged.experimental_distribute.auto_shard_policy is AutoShardPolicy.OFF
    with pytest.raises(TypeError, match="experimental_deterministic must be a bool"):
        loose.experimental_deterministic = 0
    assert Dataset.range(4).options() == Options()
    # options() is a copy: changing it does not change the dataset
    ds.options().experimental_distribute.auto_shard_policy = AutoShardPolicy.FILE
    assert ds.options() == off


def test_input_options_defaults_and_fetch_rule():
    options = InputOptions()
    assert options.experimental_replication_mode is InputReplicationMode.PER_WORKER
    assert options.experimental_prefetch_to_device is True
    assert options.experimental_fetch_to_device is None and options.fetch_to_device
    assert not InputOptions(experimental_prefetch_to_device=False).fetch_to_device
    assert not InputOptions(experimental_fetch_to_device=False).fetch_to_device
    assert InputOptions(experimental_prefetch_to_device=False,
                        experimental_fetch_to_device=True).fetch_to_device
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.experimental_fetch_to_device = True  # type: ignore[misc]


def test_input_options_type_errors():
    with pytest.raises(TypeError, match="PER_WORKER or PER_REPLICA"):
        InputOptions(experimental_replication_mode="PER_REPLICA")
    with pytest.raises(TypeError, match="experimental_prefetch_to_device must be a bool"):
        InputOptions(experimental_prefetch_to_device=1)
    with pytest.raises(TypeError, match="experimental_fetch_to_device must be a bool or None"):
        InputOptions(experimental_fetch_to_device="yes")


def test_input_context_defaults_and_batch_size():
    ctx = InputContext()
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (1, 0, 1)
    ctx = InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)
    assert ctx.get_per_replica_batch_size(64) == 16
    assert ctx.get_per_replica_batch_size(0) == 0
    assert ctx == InputContext(2, 1, 4) and ctx != InputContext(2, 0, 4)
    assert repr(ctx) == ("InputContext(num_input_pipelines=2, input_pipeline_id=1, "
                         "num_replicas_in_sync=4)")


def test_input_context_errors():
    ctx = InputContext(2, 0, 4)
    with pytest.raises(ValueError, match=r"The `global_batch_size` 10 is not divisible by "
                                         r"`num_replicas_in_sync` 4.*e\.g\. 12"):
        ctx.get_per_replica_batch_size(10)
    with pytest.raises(ValueError, match=r"input_pipeline_id must be in \[0, 1\].*got 2"):
        InputContext(2, 2, 4)
    with pytest.raises(ValueError, match="num_replicas_in_sync must be an integer >= 1"):
        InputContext(1, 0, 0)
    with pytest.raises(TypeError, match="num_input_pipelines must be an integer"):
        InputContext("2", 0, 1)
