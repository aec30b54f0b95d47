"""Cluster resolvers: where this process sits among the workers (tf.distribute.cluster_resolver).

* :class:`MPIClusterResolver` (the default): the workers are the ranks of a communicator;
* :class:`TFConfigClusterResolver`: the cluster and task of ``TF_CONFIG``;
* :class:`SlurmClusterResolver`: the tasks of a Slurm step, from ``SLURM_*``;
* :class:`SimpleClusterResolver`: a cluster given in code;
* :class:`UnionResolver`: the union of other resolvers' clusters.

TF's ``GCEClusterResolver``, ``KubernetesClusterResolver`` and ``TPUClusterResolver`` are
named but raise ``UnsupportedError`` (they need services an MPI job does not have).

:func:`resolve_cluster` turns any of them into this rank's :class:`ClusterInfo`,
checked collectively against the MPI communicator. The TF rules on tasks and workers
are functions in :mod:`.multi_worker`. Importing this package does not initialise MPI.
"""

from __future__ import annotations

from .base import ClusterResolver, SimpleClusterResolver
from .cluster_spec import ClusterSpec, format_master_url, normalize_cluster_spec
from .hostlist import expand_hostlist, expand_tasks_per_node
from .mpi import MPIClusterResolver
from .multi_worker import (
    TASK_TYPES,
    collective_leader,
    id_in_cluster,
    is_chief,
    validate_cluster_spec,
    worker_count,
)
from .resolve import (
    ClusterInfo,
    check_against_world,
    match_world,
    resolve_cluster,
    should_checkpoint,
)
from .slurm import SlurmClusterResolver, SlurmStep, read_slurm_step
from .tfconfig import TF_CONFIG, TFConfig, TFConfigClusterResolver, parse_tf_config
from .union import UnionResolver
from .unsupported import GCEClusterResolver, KubernetesClusterResolver, TPUClusterResolver

__all__ = [
    "ClusterSpec", "normalize_cluster_spec", "format_master_url",
    "TASK_TYPES", "validate_cluster_spec", "worker_count", "id_in_cluster", "is_chief",
    "collective_leader",
    "ClusterResolver", "SimpleClusterResolver", "MPIClusterResolver",
    "TFConfigClusterResolver", "TF_CONFIG", "TFConfig", "parse_tf_config",
    "SlurmClusterResolver", "SlurmStep", "read_slurm_step", "expand_hostlist",
    "expand_tasks_per_node", "UnionResolver", "GCEClusterResolver", "KubernetesClusterResolver",
    "TPUClusterResolver",
    "ClusterInfo", "match_world", "check_against_world", "resolve_cluster",
    "should_checkpoint",
]
