"""``tf.distribute.cluster_resolver`` under mpistrat: ``import mpistrat as tfd`` then
``tfd.cluster_resolver.TFConfigClusterResolver()``, as in TF. The resolvers live in
:mod:`mpistrat.cluster` (see docs/cluster_resolvers.md); ``MPIClusterResolver``, the
default, is mpistrat's own."""

from __future__ import annotations

from .cluster import (
    ClusterResolver,
    GCEClusterResolver,
    KubernetesClusterResolver,
    MPIClusterResolver,
    SimpleClusterResolver,
    SlurmClusterResolver,
    TFConfigClusterResolver,
    TPUClusterResolver,
    UnionResolver,
)

__all__ = ["ClusterResolver", "GCEClusterResolver", "KubernetesClusterResolver",
           "SimpleClusterResolver", "SlurmClusterResolver", "TFConfigClusterResolver",
           "TPUClusterResolver", "UnionResolver", "MPIClusterResolver"]
