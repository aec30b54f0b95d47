"""TF's cluster resolvers that need a service an MPI job does not have: named, so that code
which mentions them imports and its ``isinstance`` checks work, but creating one raises
:class:`~mpistrat.errors.UnsupportedError` saying what to use instead."""

from __future__ import annotations

from typing import Any, NoReturn

from ..errors import UnsupportedError
from .base import ClusterResolver
from .cluster_spec import ClusterSpec

__all__ = ["GCEClusterResolver", "KubernetesClusterResolver", "TPUClusterResolver"]

_DEFAULT = ("the default MPIClusterResolver (the workers are the ranks that mpirun, srun or "
            "`mpistrat run -n N` started)")


def _refuse(name: str, why: str, instead: str) -> NoReturn:
    raise UnsupportedError(f"{name} {why}, which an MPI job does not use; use {instead}")


class _Unsupported(ClusterResolver):
    def cluster_spec(self) -> ClusterSpec:  # (never reached: the constructor raises)
        raise UnsupportedError(f"{type(self).__name__} cannot be used over MPI")


class GCEClusterResolver(_Unsupported):
    """TF's resolver of a Google Compute Engine instance group. Raises
    :class:`~mpistrat.errors.UnsupportedError`: launch the VMs' ranks with mpirun or Slurm."""

    def __init__(self, project: Any = None, zone: Any = None, instance_group: Any = None,
                 port: Any = None, task_type: str = "worker", task_id: int = 0,
                 rpc_layer: str = "grpc", credentials: str = "default",
                 service: Any = None) -> None:
        _refuse("GCEClusterResolver", "lists an instance group through Google Cloud's API",
                f"mpirun --hostfile or Slurm on the VMs and {_DEFAULT}")


class KubernetesClusterResolver(_Unsupported):
    """TF's resolver of Kubernetes pods. Raises :class:`~mpistrat.errors.UnsupportedError`:
    run the job with the MPI Operator and the default resolver, or set ``TF_CONFIG``."""

    def __init__(self, job_to_label_mapping: Any = None, tf_server_port: int = 8470,
                 rpc_layer: str = "grpc", override_client: Any = None) -> None:
        _refuse("KubernetesClusterResolver", "lists pods through the Kubernetes API client",
                f"the MPI Operator (or any launcher that starts MPI ranks in the pods) with "
                f"{_DEFAULT}, or TF_CONFIG in each pod with TFConfigClusterResolver")


class TPUClusterResolver(_Unsupported):
    """TF's resolver of Cloud TPUs. Raises :class:`~mpistrat.errors.UnsupportedError`,
    and so does :meth:`connect`: there are no TPUs over MPI."""

    def __init__(self, tpu: Any = None, zone: Any = None, project: Any = None,
                 job_name: str = "worker", coordinator_name: Any = None,
                 coordinator_address: Any = None, credentials: str = "default",
                 service: Any = None, discovery_url: Any = None) -> None:
        _refuse_tpu("TPUClusterResolver")

    @staticmethod
    def connect(tpu: Any = None, zone: Any = None, project: Any = None) -> NoReturn:
        """TF's ``TPUClusterResolver.connect()`` (find the TPUs and initialise them):
        raises :class:`~mpistrat.errors.UnsupportedError`, as the constructor does."""
        _refuse_tpu("TPUClusterResolver.connect()")


def _refuse_tpu(name: str) -> NoReturn:
    _refuse(name, "finds Cloud TPUs through Google Cloud's API (there are no TPUs over MPI)",
            f"GPUs or CPU replicas with MultiWorkerMirroredStrategy and {_DEFAULT}")
