"""Input pipelines for mpistrat: a small ``Dataset`` (the part of ``tf.data`` training
scripts use), its options, and the machinery that splits input across workers and
replicas for the strategies (``experimental_distribute_dataset``,
``distribute_datasets_from_function``, ``experimental_make_numpy_dataset``).

See docs/datasets.md for the sharding and splitting rules and where they differ from TF.
"""

from __future__ import annotations

from .dataset import AUTOTUNE, INFINITE_CARDINALITY, UNKNOWN_CARDINALITY, ArraySpec, Dataset
from .distribute import (
    DistributedDataset,
    DistributedDatasetsFromFunction,
    batch_sizes_for_worker,
    make_numpy_dataset,
)
from .input_context import InputContext
from .iterator import DistributedIterator, Optional
from .options import (
    AutoShardPolicy,
    AutoShardWarning,
    DistributeOptions,
    InputOptions,
    InputReplicationMode,
    Options,
)

__all__ = [
    "Dataset",
    "ArraySpec",
    "AUTOTUNE",
    "INFINITE_CARDINALITY",
    "UNKNOWN_CARDINALITY",
    "Options",
    "DistributeOptions",
    "AutoShardPolicy",
    "AutoShardWarning",
    "InputOptions",
    "InputReplicationMode",
    "InputContext",
    "DistributedDataset",
    "DistributedDatasetsFromFunction",
    "DistributedIterator",
    "Optional",
    "batch_sizes_for_worker",
    "make_numpy_dataset",
]
