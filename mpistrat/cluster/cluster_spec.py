"""``ClusterSpec``: the jobs of a cluster and the network address of each of their tasks.

The same data TensorFlow's ``tf.train.ClusterSpec`` holds, with the same methods, built
from a dict such as ``{"chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"]}`` (a
list gives tasks 0..n-1; a ``{index: address}`` dict gives sparse task indices). Under
MPI the addresses are informational: MPI carries the data, nothing listens on them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ClusterSpec", "normalize_cluster_spec", "format_master_url"]


class ClusterSpec:
    """An immutable map from job names to ``{task index: "host:port"}``.

    Args:
        cluster: a ``ClusterSpec``, or a mapping from job name to a list of addresses
            (task ``i`` is the ``i``-th) or to a ``{task index: address}`` mapping.

    Raises:
        TypeError: a job name, task list, task index or address of the wrong type; the
            message names the job and the value.
    """

    __slots__ = ("_jobs",)
    __hash__ = None  # type: ignore[assignment]  # compares equal to plain dicts

    def __init__(self, cluster: ClusterSpec | Mapping[str, Any]) -> None:
        if isinstance(cluster, ClusterSpec):
            self._jobs: dict[str, dict[int, str]] = {
                job: dict(tasks) for job, tasks in cluster._jobs.items()
            }
            return
        if not isinstance(cluster, Mapping):
            raise TypeError(
                f"a cluster must be a dict mapping job names to lists of 'host:port' "
                f"addresses (e.g. {{'worker': ['host1:2222', 'host2:2222']}}) or a "
                f"ClusterSpec, got {type(cluster).__name__}: {cluster!r}"
            )
        self._jobs = {}
        for job, tasks in cluster.items():
            name = _text(job, f"job name {job!r}")
            self._jobs[name] = _tasks(name, tasks)

    @property
    def jobs(self) -> list[str]:
        """The job names, in the order they were given."""
        return list(self._jobs)

    def num_tasks(self, job_name: str) -> int:
        """The number of tasks of ``job_name``."""
        return len(self._job(job_name))

    def task_indices(self, job_name: str) -> list[int]:
        """The task indices of ``job_name``, ascending."""
        return sorted(self._job(job_name))

    def task_address(self, job_name: str, task_index: int) -> str:
        """The ``host:port`` of task ``task_index`` of ``job_name``."""
        tasks = self._job(job_name)
        try:
            return tasks[task_index]
        except (KeyError, TypeError):
            raise ValueError(
                f"no task with index {task_index!r} in job {job_name!r}; that job has "
                f"task indices {sorted(tasks)}"
            ) from None

    def job_tasks(self, job_name: str) -> list[str | None]:
        """The addresses of ``job_name`` by task index; None where an index is missing."""
        tasks = self._job(job_name)
        listed: list[str | None] = [None] * (max(tasks) + 1 if tasks else 0)
        for index, address in tasks.items():
            listed[index] = address
        return listed

    def as_dict(self) -> dict[str, list[str] | dict[int, str]]:
        """The cluster as a dict: a list per dense job (indices 0..n-1), else a dict."""
        result: dict[str, list[str] | dict[int, str]] = {}
        for job, tasks in self._jobs.items():
            if sorted(tasks) == list(range(len(tasks))):
                result[job] = [tasks[i] for i in range(len(tasks))]
            else:
                result[job] = dict(sorted(tasks.items()))
        return result

    def _job(self, job_name: str) -> dict[int, str]:
        try:
            return self._jobs[job_name]
        except (KeyError, TypeError):
            raise ValueError(
                f"no job {job_name!r} in the cluster; its jobs are {self.jobs}"
            ) from None

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            try:
                other = ClusterSpec(other)
            except TypeError:
                return False
        if not isinstance(other, ClusterSpec):
            return NotImplemented
        return self._jobs == other._jobs

    def __repr__(self) -> str:
        return f"ClusterSpec({self.as_dict()!r})"


def normalize_cluster_spec(cluster_spec: ClusterSpec | Mapping[str, Any]) -> ClusterSpec:
    """Return ``cluster_spec`` as a :class:`ClusterSpec` (a dict is converted)."""
    if isinstance(cluster_spec, ClusterSpec):
        return cluster_spec
    return ClusterSpec(cluster_spec)


def format_master_url(master: str, rpc_layer: str | None = None) -> str:
    """``"<rpc_layer>://<master>"``, or ``master`` unchanged when no rpc layer is given."""
    return f"{rpc_layer}://{master}" if rpc_layer else master


def _text(value: Any, what: str) -> str:
    if isinstance(value, bytes):
        return value.decode()
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a string, got {type(value).__name__}")
    return value


def _tasks(job: str, tasks: Any) -> dict[int, str]:
    if isinstance(tasks, Mapping):
        result = {}
        for index, address in tasks.items():
            if isinstance(index, bool) or not isinstance(index, (int, str)):
                raise TypeError(
                    f"task index {index!r} of job {job!r} must be an integer, got "
                    f"{type(index).__name__}"
                )
            try:
                number = int(index)
            except ValueError:
                raise TypeError(
                    f"task index {index!r} of job {job!r} must be an integer"
                ) from None
            if number < 0:
                raise TypeError(f"task index {number} of job {job!r} must be >= 0")
            result[number] = _text(address, f"address {address!r} of task {job}:{number}")
        return result
    if isinstance(tasks, Sequence) and not isinstance(tasks, (str, bytes)):
        return {
            i: _text(address, f"address {address!r} of task {job}:{i}")
            for i, address in enumerate(tasks)
        }
    raise TypeError(
        f"the tasks of job {job!r} must be a list of 'host:port' addresses or a dict "
        f"from task index to address, got {type(tasks).__name__}: {tasks!r}"
    )
