"""What a cluster and a task imply for multi-worker training (TF's ``multi_worker_util``).

The rules, as TensorFlow applies them:

* task types are ``chief``, ``worker``, ``evaluator`` and ``ps``; at most one chief and
  one evaluator; the evaluator may be missing from the cluster (it runs on its own);
* the **workers** of a multi-worker strategy are the chief (if any) then the workers:
  ``chief`` has id 0 and ``worker:i`` has id ``i + (1 if there is a chief else 0)``;
* the **chief** is the ``chief`` task, or ``worker:0`` when there is none; an evaluator
  counts as its own chief (it saves its own summaries).

Deviations, each to give a clear error or answer instead of TF's ``KeyError`` or wrong
count: an empty cluster is **local mode** (one worker, which is the chief) in every
function; a task id must be a non-negative int; chief and worker jobs must have dense
task indices 0..n-1; an evaluator's worker count is 1 (TF: the evaluator job's length,
a ``KeyError`` when the job is absent).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import TopologyError
from .cluster_spec import ClusterSpec, normalize_cluster_spec

__all__ = [
    "TASK_TYPES",
    "validate_cluster_spec",
    "worker_count",
    "id_in_cluster",
    "is_chief",
    "collective_leader",
]

TASK_TYPES = ("chief", "worker", "evaluator", "ps")

ClusterLike = ClusterSpec | Mapping[str, Any]

_TASK_HINT = 'e.g. "task": {"type": "worker", "index": 0}'


def validate_cluster_spec(cluster_spec: ClusterLike, task_type: str | None,
                          task_id: int | None, source: str = "the cluster spec") -> None:
    """Check that ``(task_type, task_id)`` is a valid task of ``cluster_spec``.

    An empty cluster is local mode and always valid (the task, if any, is ignored).

    Args:
        cluster_spec: the cluster.
        task_type, task_id: this task.
        source: where the cluster came from, for messages (``"TF_CONFIG"``).

    Raises:
        TopologyError (a ValueError): the first rule broken, naming the values and the fix.
    """
    spec = normalize_cluster_spec(cluster_spec)
    if not spec:
        return
    if task_type is None or task_id is None:
        raise TopologyError(
            f"a cluster is given ({spec.as_dict()}, from {source}) but no task (task_type="
            f"{task_type!r}, task_id={task_id!r}): when a cluster is given, task_type and "
            f"task_id must be given too; fix: say which task this process is "
            f"({_TASK_HINT} in TF_CONFIG, or the resolver's task_type/task_id)"
        )
    if task_type not in TASK_TYPES:
        raise TopologyError(
            f"unrecognized task_type {task_type!r} (from {source}); valid task types are "
            f"'chief', 'worker', 'evaluator' and 'ps'"
        )
    if isinstance(task_id, bool) or not isinstance(task_id, int) or task_id < 0:
        raise TopologyError(
            f"task_id must be an integer >= 0, got {task_id!r} (task {task_type!r}, from "
            f"{source})"
        )
    if task_type not in spec.jobs and task_type != "evaluator":
        raise TopologyError(
            f"task_type {task_type!r} not found in the cluster (from {source}), whose jobs are "
            f"{spec.jobs}; fix: add a {task_type!r} job to the cluster or use one of its jobs"
        )
    for job in ("chief", "evaluator"):
        if job in spec.jobs and spec.num_tasks(job) > 1:
            raise TopologyError(
                f"there must be at most one {job!r} task, but the cluster (from {source}) has "
                f"{spec.num_tasks(job)}: {spec.job_tasks(job)}; fix: keep one {job} and "
                f"list the others under 'worker'"
            )
    for job in ("chief", "worker"):
        if job in spec.jobs and spec.task_indices(job) != list(range(spec.num_tasks(job))):
            raise TopologyError(
                f"job {job!r} of the cluster (from {source}) has task indices "
                f"{spec.task_indices(job)}; workers need indices 0..n-1; fix: list the "
                f"{job} addresses as a plain list"
            )
    if task_type in spec.jobs and task_id >= spec.num_tasks(task_type):
        count = spec.num_tasks(task_type)
        raise TopologyError(
            f"task_id {task_id} exceeds the maximum id of {task_type!r}: the cluster (from "
            f"{source}) has {count} {task_type} task(s), ids 0..{count - 1}; fix: use an "
            f"index below {count} or add the task's address to the {task_type!r} job"
        )


def worker_count(cluster_spec: ClusterLike, task_type: str | None) -> int:
    """The number of workers that train together, as seen by a task of ``task_type``.

    Chief plus workers for a chief or worker; 1 for an evaluator; 1 in local mode.

    Raises:
        TopologyError: an invalid cluster or task type, or ``ps`` (not a worker).
    """
    spec = normalize_cluster_spec(cluster_spec)
    if not spec:
        return 1
    validate_cluster_spec(spec, task_type, 0)
    if task_type == "evaluator":
        return 1
    if task_type == "ps":
        raise TopologyError(
            "unexpected task_type 'ps': a parameter server holds variables and is not one "
            "of the workers, so it has no worker count"
        )
    return _count(spec, "chief") + _count(spec, "worker")


def id_in_cluster(cluster_spec: ClusterLike, task_type: str | None, task_id: int | None) -> int:
    """This task's worker id: chief 0, ``worker:i`` ``i`` + number of chiefs, evaluator ``i``.

    Raises:
        TopologyError: an invalid task, or ``ps`` (which has no worker id).
    """
    spec = normalize_cluster_spec(cluster_spec)
    if not spec:
        return 0
    validate_cluster_spec(spec, task_type, task_id)
    index = int(task_id or 0)  # validated: a non-negative int
    if task_type == "chief":
        return 0
    if task_type == "worker":
        return index + _count(spec, "chief")
    if task_type == "evaluator":
        return index
    raise TopologyError(
        f"there is no worker id for task_type {task_type!r}: parameter servers are not "
        f"workers"
    )


def is_chief(cluster_spec: ClusterLike, task_type: str | None, task_id: int | None) -> bool:
    """True for the task that checkpoints and writes summaries (see the module docstring)."""
    spec = normalize_cluster_spec(cluster_spec)
    if not spec:
        return True
    validate_cluster_spec(spec, task_type, task_id)
    if task_type in ("chief", "evaluator"):
        return True
    return task_type == "worker" and task_id == 0 and "chief" not in spec.jobs


def collective_leader(cluster_spec: ClusterLike, task_type: str | None,
                      task_id: int | None) -> str:
    """TF's device name of the collective group leader: the chief, else ``worker:0``.

    ``""`` in local mode and for an evaluator (it is not part of the group). Under MPI
    the leader is worker id 0, which is rank 0.
    """
    spec = normalize_cluster_spec(cluster_spec)
    if not spec:
        return ""
    validate_cluster_spec(spec, task_type, task_id)
    if task_type == "evaluator":
        return ""
    job = "chief" if "chief" in spec.jobs else "worker"
    return f"/job:{job}/replica:0/task:0"


def _count(spec: ClusterSpec, job: str) -> int:
    return spec.num_tasks(job) if job in spec.jobs else 0
