"""``SlurmClusterResolver``: the cluster of a Slurm job step, from its ``SLURM_*`` variables.

Variables read (``env``, default ``os.environ``, read once by the constructor):

* ``SLURM_PROCID`` (required): this task's rank in the step;
* ``SLURM_STEP_NODELIST``, else ``SLURM_JOB_NODELIST`` / ``SLURM_NODELIST``: the hosts;
* ``SLURM_STEP_TASKS_PER_NODE``, else ``SLURM_TASKS_PER_NODE`` (``2(x3),1``), else
  ``SLURM_NTASKS_PER_NODE``: the tasks on each host (unless ``tasks_per_node`` is given);
* checked when present: ``SLURM_STEP_NUM_TASKS`` / ``SLURM_NTASKS`` (the total),
  ``SLURM_STEP_NUM_NODES`` / ``SLURM_NNODES`` (the host count), ``SLURM_LOCALID`` and
  ``SLURMD_NODENAME`` (this task's place); ``SLURM_DISTRIBUTION`` (``block``,
  ``cyclic``, ``plane=N``) says how ranks are spread over the hosts;
* GPUs: ``SLURM_GPUS_PER_TASK``, ``SLURM_GPUS_ON_NODE`` and ``CUDA_VISIBLE_DEVICES``.

These describe the tasks of an ``srun`` step. Under ``mpirun`` inside an allocation
they describe the batch step instead (every rank sees ``SLURM_PROCID=0``); use
:class:`~mpistrat.cluster.MPIClusterResolver` there.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from ..errors import TopologyError
from .base import ClusterResolver
from .cluster_spec import ClusterSpec
from .hostlist import expand_hostlist, expand_tasks_per_node

__all__ = ["SlurmStep", "read_slurm_step", "SlurmClusterResolver"]

CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"

# (host list, tasks-per-node variables in order of preference, task total, node count)
_LAYOUTS = (
    ("SLURM_STEP_NODELIST", ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"),
     "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NUM_NODES"),
    ("SLURM_JOB_NODELIST", ("SLURM_TASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE"),
     "SLURM_NTASKS", "SLURM_NNODES"),
    ("SLURM_NODELIST", ("SLURM_TASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE"),
     "SLURM_NTASKS", "SLURM_NNODES"),
)

_LAUNCH_HINT = (
    "fix: launch with srun (e.g. srun --mpi=pmi2 -n 4 python train.py), or use "
    "MPIClusterResolver (any MPI launcher, mpirun inside an allocation included) or "
    "TFConfigClusterResolver"
)


@dataclass(frozen=True)
class SlurmStep:
    """This task's view of its Slurm step.

    Attributes:
        hosts: the step's hosts, in node order.
        tasks_per_node: the number of tasks on each host.
        placement: ``(node index, local id)`` of every rank.
        rank: this task's rank (``SLURM_PROCID``).
        gpus_per_task: GPUs each task uses.
        gpu_ids: this task's GPUs, as ``CUDA_VISIBLE_DEVICES`` entries.
        gpus_bound: True when ``CUDA_VISIBLE_DEVICES`` already lists exactly this
            task's GPUs (Slurm bound them per task).
        described_by: the variables the layout came from, for messages.
    """

    hosts: tuple[str, ...]
    tasks_per_node: tuple[int, ...]
    placement: tuple[tuple[int, int], ...]
    rank: int
    gpus_per_task: int
    gpu_ids: tuple[str, ...]
    gpus_bound: bool
    described_by: str

    @property
    def num_tasks(self) -> int:
        """The number of tasks in the step."""
        return len(self.placement)

    @property
    def node(self) -> int:
        """This task's node index."""
        return self.placement[self.rank][0]

    @property
    def local_rank(self) -> int:
        """This task's index among the tasks of its node (``SLURM_LOCALID``)."""
        return self.placement[self.rank][1]

    def addresses(self, port_base: int) -> list[str]:
        """``host:port_base+local id`` of every rank, in rank order."""
        return [f"{self.hosts[node]}:{port_base + local}" for node, local in self.placement]


def read_slurm_step(env: Mapping[str, str], gpus_per_node: int | None = None,
                    gpus_per_task: int | None = None,
                    tasks_per_node: int | Mapping[str, int] | None = None) -> SlurmStep:
    """Read this task's step from ``env`` (see the module docstring for the variables).

    Raises:
        RuntimeError: a required variable is missing (not inside a Slurm step).
        TopologyError: a variable is malformed or contradicts another; the message
            names both and the value.
    """
    if "SLURM_PROCID" not in env:
        raise RuntimeError(f"SLURM_PROCID is not set: this process is not a task of a "
                           f"Slurm job step; {_LAUNCH_HINT}")
    rank = _int(env, "SLURM_PROCID")
    layout = next((entry for entry in _LAYOUTS if entry[0] in env), None)
    if layout is None:
        raise RuntimeError(f"neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is set "
                           f"(SLURM_PROCID={env['SLURM_PROCID']}): this process is not "
                           f"inside a Slurm job step; {_LAUNCH_HINT}")
    nodes_var, tasks_vars, total_var, count_var = layout
    hosts = expand_hostlist(env[nodes_var], nodes_var)
    counts, tasks_from = _tasks_per_node(env, hosts, tasks_per_node, tasks_vars, nodes_var)
    described_by = f"{nodes_var}={env[nodes_var]!r}, {tasks_from}"
    if len(counts) != len(hosts):
        raise TopologyError(f"{tasks_from} gives {len(counts)} node(s) but {nodes_var}="
                            f"{env[nodes_var]!r} lists {len(hosts)}; they must describe the "
                            f"same nodes")
    for name, expected, what in ((count_var, len(hosts), "hosts"),
                                 (total_var, sum(counts), "tasks")):
        if name in env and _int(env, name) != expected:
            raise TopologyError(f"{name}={env[name]} but {described_by} give {expected} "
                                f"{what}; these variables come from different steps or "
                                f"were changed by hand")
    if not 0 <= rank < sum(counts):
        raise TopologyError(f"SLURM_PROCID={rank} is not below the {sum(counts)} tasks of "
                            f"{described_by}")
    distribution = env.get("SLURM_DISTRIBUTION", "block")
    placement = _place(counts, distribution)
    node, local = placement[rank]
    _check_place(env, rank, hosts[node], local, distribution, described_by)
    gpt, ids, bound = _gpus(env, counts, node, local, gpus_per_node, gpus_per_task)
    return SlurmStep(tuple(hosts), tuple(counts), tuple(placement), rank, gpt, ids, bound,
                     described_by)


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        value = int(env[name].strip())
    except ValueError:
        value = -1
    if value < 0:
        raise TopologyError(f"{name}={env[name]!r} is not a non-negative integer")
    return value


def _tasks_per_node(env: Mapping[str, str], hosts: list[str], given: Any,
                    variables: tuple[str, ...], nodes_var: str) -> tuple[list[int], str]:
    if isinstance(given, int):
        return [given] * len(hosts), f"tasks_per_node={given}"
    if isinstance(given, Mapping):
        missing = [host for host in hosts if host not in given]
        if missing:
            raise TopologyError(f"tasks_per_node has no count for host(s) {missing} of "
                                f"{nodes_var}={env[nodes_var]!r}; give a count for every host")
        return [given[host] for host in hosts], f"tasks_per_node={dict(given)}"
    for name in variables:
        if name in env:
            return expand_tasks_per_node(env[name], name), f"{name}={env[name]!r}"
    if "SLURM_NTASKS_PER_NODE" in env:
        count = _int(env, "SLURM_NTASKS_PER_NODE")
        return [count] * len(hosts), f"SLURM_NTASKS_PER_NODE={count}"
    raise RuntimeError(f"{' / '.join(variables)} is not set, so the tasks on each node of "
                       f"{nodes_var} are unknown; pass tasks_per_node= or {_LAUNCH_HINT}")


def _place(counts: list[int], distribution: str) -> list[tuple[int, int]]:
    """``(node, local id)`` of each rank: ranks fill nodes in rounds of ``block`` tasks."""
    kind = distribution.split(":")[0].split(",")[0].strip()
    if kind in ("block", "*", ""):
        block = max(counts, default=0)
    elif kind == "cyclic":
        block = 1
    elif kind.startswith("plane=") and kind[6:].isdigit() and int(kind[6:]) > 0:
        block = int(kind[6:])
    else:
        raise TopologyError(f"SLURM_DISTRIBUTION={distribution!r}: cannot tell which node "
                            f"each rank runs on (known: block, cyclic, plane=N); use "
                            f"MPIClusterResolver, which asks MPI")
    placed = [0] * len(counts)
    order: list[tuple[int, int]] = []
    while len(order) < sum(counts):
        for node, count in enumerate(counts):
            take = min(block, count - placed[node])
            order.extend((node, placed[node] + i) for i in range(take))
            placed[node] += take
    return order


def _check_place(env: Mapping[str, str], rank: int, host: str, local: int,
                 distribution: str, described_by: str) -> None:
    found = []
    if "SLURM_LOCALID" in env and _int(env, "SLURM_LOCALID") != local:
        found.append(f"SLURM_LOCALID={env['SLURM_LOCALID']}")
    if env.get("SLURMD_NODENAME", host) != host:
        found.append(f"SLURMD_NODENAME={env['SLURMD_NODENAME']}")
    if found:
        raise TopologyError(
            f"SLURM_PROCID={rank} should be task {local} on host {host} ({distribution} "
            f"distribution of {described_by}), but {' and '.join(found)}: the tasks are "
            f"not laid out as assumed; use MPIClusterResolver, which asks MPI"
        )


def _visible(env: Mapping[str, str]) -> list[str] | None:
    raw = env.get(CUDA_VISIBLE_DEVICES)
    if raw is None:
        return None
    if raw.strip() in ("", "NoDevFiles"):
        return []
    return [entry.strip() for entry in raw.split(",") if entry.strip()]


def _gpus(env: Mapping[str, str], counts: list[int], node: int, local: int,
          gpus_per_node: int | None, gpus_per_task: int | None,
          ) -> tuple[int, tuple[str, ...], bool]:
    """(GPUs per task, this task's GPU ids, whether Slurm already bound them)."""
    visible = _visible(env)
    on_node, on_node_from = gpus_per_node, f"gpus_per_node={gpus_per_node}"
    if on_node is None and "SLURM_GPUS_ON_NODE" in env:
        on_node, on_node_from = _int(env, "SLURM_GPUS_ON_NODE"), "SLURM_GPUS_ON_NODE"
    gpt, gpt_from = gpus_per_task, f"gpus_per_task={gpus_per_task}"
    if gpt is None and "SLURM_GPUS_PER_TASK" in env:
        gpt, gpt_from = _gpus_per_task(env["SLURM_GPUS_PER_TASK"]), "SLURM_GPUS_PER_TASK"
    if gpt is None:
        pool = on_node if on_node is not None else len(visible or ())
        gpt = pool // max(counts)
        gpt_from = f"{pool} GPUs per node / {max(counts)} tasks per node"
    here = counts[node]
    if gpt == 0:
        return 0, (), False
    if visible is not None:
        if len(visible) == gpt:
            return gpt, tuple(visible), True
        if len(visible) >= gpt * here:
            return gpt, tuple(visible[local * gpt:(local + 1) * gpt]), False
        raise TopologyError(
            f"{CUDA_VISIBLE_DEVICES}={env[CUDA_VISIBLE_DEVICES]!r} lists {len(visible)} "
            f"GPU(s): neither this task's {gpt} ({gpt_from}) nor enough for the {here} "
            f"tasks on this node ({here} x {gpt} = {gpt * here}); fix: request {gpt} GPU(s) "
            f"per task (srun --gpus-per-task={gpt}) or pass gpus_per_task="
        )
    if on_node is not None and gpt * here > on_node:
        raise TopologyError(
            f"requested more GPUs per node than available: {here} tasks on this node x "
            f"{gpt} GPUs per task ({gpt_from}) = {gpt * here} > {on_node} ({on_node_from}); "
            f"fix: lower gpus_per_task or run fewer tasks per node"
        )
    return gpt, tuple(str(i) for i in range(local * gpt, (local + 1) * gpt)), False


def _gpus_per_task(text: str) -> int:
    total = 0
    for item in text.split(","):
        count = item.rsplit(":", 1)[-1].strip()
        if not count.isdigit():
            raise TopologyError(f"SLURM_GPUS_PER_TASK={text!r} is not [type:]N; expected "
                                f"e.g. '1' or 'a100:2'")
        total += int(count)
    return total


class SlurmClusterResolver(ClusterResolver):
    """One task per Slurm rank, ``host:port_base+local id`` each (TF's ``SlurmClusterResolver``).

    Args:
        jobs: job name -> number of tasks; jobs take consecutive ranks in job-name order
            (``{"chief": 1, "worker": 3}``: rank 0 is the chief). Default: every task is
            a ``"worker"``. The counts must add up to the step's tasks.
        port_base: the port of each node's first task; later tasks count up.
        gpus_per_node: GPUs on each node (default ``SLURM_GPUS_ON_NODE``).
        gpus_per_task: GPUs per task (default ``SLURM_GPUS_PER_TASK``, else the GPUs per
            node divided by the most tasks on a node).
        tasks_per_node: an int for every node, or ``{host: count}``; default from Slurm.
        auto_set_gpu: write this task's GPUs into ``CUDA_VISIBLE_DEVICES`` of ``env``
            (``os.environ`` by default) here, so the process sees only them; construct
            the resolver before anything touches CUDA.
        rpc_layer: the protocol of :meth:`master` URLs.
        env: the environment to read (default ``os.environ``).

    Raises:
        ValueError: an argument of the wrong type or range. Problems with the
            environment are raised by the first method that needs it, not here.
    """

    source = "the Slurm step"

    def __init__(self, jobs: Mapping[str, int] | None = None, port_base: int = 8888,
                 gpus_per_node: int | None = None, gpus_per_task: int | None = None,
                 tasks_per_node: int | Mapping[str, int] | None = None,
                 auto_set_gpu: bool = True, rpc_layer: str | None = "grpc",
                 env: Mapping[str, str] | None = None) -> None:
        _check_args(jobs, port_base, gpus_per_node, gpus_per_task, tasks_per_node)
        environ = os.environ if env is None else env
        self._jobs = None if jobs is None else dict(jobs)
        self._port_base = port_base
        self._rpc_layer = rpc_layer
        self._error: Exception | None = None
        self._gpus_set = False
        try:
            self._step = read_slurm_step(environ, gpus_per_node, gpus_per_task, tasks_per_node)
            self._spec, self._found = _allocate(self._step, self._jobs, port_base)
        except (RuntimeError, ValueError) as exc:
            self._error = exc
            return
        if auto_set_gpu and self._step.gpus_per_task and isinstance(environ, MutableMapping):
            environ[CUDA_VISIBLE_DEVICES] = ",".join(self._step.gpu_ids)
            self._gpus_set = True

    @property
    def step(self) -> SlurmStep:
        """What the environment says about this task's step (raises its error, if any)."""
        return self._resolved()[0]

    def _resolved(self) -> tuple[SlurmStep, ClusterSpec, tuple[str, int]]:
        if self._error is not None:
            raise self._error
        return self._step, self._spec, self._found

    def cluster_spec(self) -> ClusterSpec:
        """Every task of the step, by job, as ``host:port``."""
        return self._resolved()[1]

    def _default_task_type(self) -> str | None:
        return self._resolved()[2][0]

    def _default_task_id(self) -> int | None:
        return self._resolved()[2][1]

    @property
    def local_rank(self) -> int:
        """This task's index on its node (``SLURM_LOCALID``)."""
        return self.step.local_rank

    @property
    def gpu_ids(self) -> tuple[str, ...]:
        """This task's GPUs as ``CUDA_VISIBLE_DEVICES`` entries (see the docs)."""
        return self.step.gpu_ids

    @property
    def device_ordinals(self) -> tuple[int, ...]:
        """The CUDA device numbers of this task's GPUs in this process, as it is now.

        ``0..n-1`` when ``CUDA_VISIBLE_DEVICES`` lists exactly them (Slurm bound them, or
        ``auto_set_gpu`` set it); otherwise their positions among the node's GPUs the
        process sees, ``local_rank * n`` onwards.
        """
        step = self.step
        if self._gpus_set or step.gpus_bound:
            return tuple(range(step.gpus_per_task))
        start = step.local_rank * step.gpus_per_task
        return tuple(range(start, start + step.gpus_per_task))

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                         config_proxy: Any = None) -> dict[str, int]:
        """``{"GPU": gpus_per_task}``: every task of a step has the same GPU count."""
        return {"GPU": self.step.gpus_per_task}


def _allocate(step: SlurmStep, jobs: dict[str, int] | None,
              port_base: int) -> tuple[ClusterSpec, tuple[str, int]]:
    addresses = step.addresses(port_base)
    if jobs is None:
        return ClusterSpec({"worker": addresses}), ("worker", step.rank)
    if sum(jobs.values()) != step.num_tasks:
        raise TopologyError(f"jobs={jobs} ask for {sum(jobs.values())} tasks but the Slurm "
                            f"step has {step.num_tasks} ({step.described_by}); make the "
                            f"counts add up to {step.num_tasks}")
    cluster, start, found = {}, 0, ("", 0)
    for name in sorted(jobs):
        cluster[name] = addresses[start:start + jobs[name]]
        if start <= step.rank < start + jobs[name]:
            found = (name, step.rank - start)
        start += jobs[name]
    return ClusterSpec(cluster), found


def _check_args(jobs: Any, port_base: Any, gpus_per_node: Any, gpus_per_task: Any,
                tasks_per_node: Any) -> None:
    def count(value: Any, minimum: int = 0) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= minimum

    if jobs is not None and not (isinstance(jobs, Mapping) and all(
            isinstance(k, str) and count(v) for k, v in jobs.items())):
        raise ValueError(f"jobs must map job names to task counts >= 0, e.g. "
                         f"{{'chief': 1, 'worker': 3}}, got {jobs!r}")
    if not count(port_base) or port_base > 65535:
        raise ValueError(f"port_base must be a port number (0-65535), got {port_base!r}")
    for name, value in (("gpus_per_node", gpus_per_node), ("gpus_per_task", gpus_per_task)):
        if value is not None and not count(value):
            raise ValueError(f"{name} must be an integer >= 0 or None, got {value!r}")
    per_node_ok = tasks_per_node is None or count(tasks_per_node, 1) or (
        isinstance(tasks_per_node, Mapping) and all(count(v, 1) for v in tasks_per_node.values()))
    if not per_node_ok:
        raise ValueError(f"tasks_per_node must be an integer >= 1, a dict host -> integer "
                         f">= 1, or None, got {tasks_per_node!r}")
