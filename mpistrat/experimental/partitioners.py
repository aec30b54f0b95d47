"""``tf.distribute.experimental.partitioners``: how ``ParameterServerStrategy`` splits a
variable into shards. The same classes as :mod:`mpistrat.partitioners`, which also has the
shard-size helpers (see docs/partitioners.md)."""

from __future__ import annotations

from ..partitioners import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    Partitioner,
)

__all__ = ["Partitioner", "FixedShardsPartitioner", "MinSizePartitioner", "MaxSizePartitioner"]
