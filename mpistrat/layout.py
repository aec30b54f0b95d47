"""The shape of a job (workers, local devices, nodes) and the spec checks that depend on it.

A :class:`Layout` is plain data: ``mpistrat validate --workers ...`` builds one from
its options, and a running job builds one from its communicator (see
:mod:`mpistrat.runtime.topology`), so the same :func:`check_spec` serves both. Nothing here
touches MPI.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from . import algorithms
from .algorithms.registry import Pool, Shards
from .errors import TopologyError
from .spec import AllReduceSpec, SpecLike, parse_spec

__all__ = ["Layout", "Finding", "check_spec", "entry_findings", "require_fits",
           "require_entry_fits"]


@dataclass(frozen=True)
class Layout:
    """How many workers, devices per worker and nodes a job has.

    Attributes:
        workers: number of MPI ranks (W).
        devices_per_worker: local devices per rank (G): GPUs, or CPU replicas.
        gpus: True when the local devices are GPUs, False for CPU replicas.
        nodes: number of node groups (hierarchical algorithms run their second
            stage across one leader per node).
    """

    workers: int
    devices_per_worker: int = 1
    gpus: bool = False
    nodes: int = 1

    def __post_init__(self) -> None:
        for name in ("workers", "devices_per_worker", "nodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TopologyError(f"{name} must be an integer >= 1, got {value!r}")
        if self.nodes > self.workers:
            raise TopologyError(
                f"nodes ({self.nodes}) cannot exceed workers ({self.workers}): every node "
                f"holds at least one rank"
            )

    @classmethod
    def from_ranks_per_node(
        cls, workers: int, ranks_per_node: int, devices_per_worker: int = 1, gpus: bool = False
    ) -> Layout:
        """A layout whose nodes each hold ``ranks_per_node`` ranks (the last may hold fewer)."""
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) \
                or ranks_per_node < 1:
            raise TopologyError(f"ranks_per_node must be an integer >= 1, got {ranks_per_node!r}")
        nodes = -(-workers // ranks_per_node) if workers >= 1 else 1
        return cls(workers, devices_per_worker, gpus, nodes)

    @classmethod
    def of(cls, topology: Any, devices_per_worker: int = 1, gpus: bool = False) -> Layout:
        """The layout of a running job from its :class:`~mpistrat.runtime.topology.Topology`
        (its size and node groups)."""
        return cls(topology.size, devices_per_worker, gpus, topology.num_nodes)

    @property
    def replicas(self) -> int:
        """Number of replicas in sync, ``W * G``."""
        return self.workers * self.devices_per_worker

    def pool_size(self, pool: Pool) -> int:
        """How many gather ranks/devices a shuffle over ``pool`` can use."""
        if pool is Pool.RANKS:
            return self.workers
        if pool is Pool.GPUS:
            return self.replicas if self.gpus else 0
        return self.nodes

    def describe(self) -> str:
        kind = "GPU" if self.gpus else "CPU replica"
        plural = "s" if self.devices_per_worker != 1 else ""
        return (f"{self.workers} worker(s) x {self.devices_per_worker} {kind}{plural} "
                f"on {self.nodes} node(s)")


@dataclass(frozen=True)
class Finding:
    """One result of :func:`check_spec`: an error (the spec cannot run) or a warning."""

    level: Literal["error", "warning"]
    entry: int | None
    message: str

    def as_dict(self) -> dict:
        return {"level": self.level, "entry": self.entry, "message": self.message}


def entry_findings(index: int | None, alg: str, shards: int,
                   layout: Layout) -> tuple[list[Finding], list[Finding]]:
    """What :func:`check_spec` finds for one spec entry ``alg#shards``: (errors, warnings).

    Errors: a GPU algorithm on CPU replicas; a shared-memory algorithm across nodes;
    ``shards`` above the number of gather ranks of a shuffle. Warnings: a ``shards``
    value the algorithm ignores; a hierarchical algorithm on one node (its cross-node
    stage is skipped).
    """
    info = algorithms.get(alg)
    where = f"entry {index} {alg!r}" if index is not None else repr(alg)
    errors: list[Finding] = []
    warnings: list[Finding] = []
    if info.needs_gpu and not layout.gpus:
        errors.append(Finding("error", index, (
            f"{where} needs GPUs, but the job has CPU replicas only "
            f"({layout.describe()}); use a CPU algorithm such as 'xring', 'rechd', "
            f"'pscpu' or 'pscpu/pscpu', or give the workers GPUs (--gpus-per-worker)"
        )))
    if info.single_node and layout.nodes > 1:
        across = ", ".join(repr(n) for n in algorithms.names()
                           if algorithms.get(n).intra == alg)
        errors.append(Finding("error", index, (
            f"{where} works inside one node (shared memory), but the job has "
            f"{layout.nodes} nodes ({layout.describe()}); use a hierarchical form "
            f"({across}: {alg} inside each node, the second algorithm across nodes)"
        )))
    if info.pool is not None and not (info.hierarchical and layout.nodes == 1):
        # (on one node a hierarchical algorithm skips its cross-node stage, where
        # the shards apply: the warning below says so)
        available = layout.pool_size(info.pool)
        if available and shards > available:
            errors.append(Finding("error", index, (
                f"{where} has shards={shards} but its gather pool ({info.pool.value}) "
                f"has only {available} ({layout.describe()}); use shards <= {available}"
            )))
    if info.shards is Shards.IGNORED and shards > 1:
        warnings.append(Finding("warning", index, (
            f"{where} ignores shards (got {shards}); write it without '#{shards}'"
        )))
    if info.hierarchical and layout.nodes == 1:
        warnings.append(Finding("warning", index, (
            f"{where} is hierarchical but the job has one node: only its intra-node "
            f"stage {info.intra!r} runs (set MPISTRAT_RANKS_PER_NODE to form virtual "
            f"nodes, or use a flat algorithm)"
        )))
    return errors, warnings


def check_spec(spec: SpecLike, layout: Layout) -> list[Finding]:
    """Check a spec against a job's layout: :func:`entry_findings` for every entry, and
    a warning for a single replica (nothing to reduce).

    Returns:
        The findings, errors first, in entry order.
    """
    errors: list[Finding] = []
    warnings: list[Finding] = []
    for index, (alg, shards, _limit) in enumerate(parse_spec(spec)):
        entry_errors, entry_warnings = entry_findings(index, alg, shards, layout)
        errors += entry_errors
        warnings += entry_warnings
    if layout.replicas == 1:
        warnings.append(Finding("warning", None, (
            "the job has a single replica (1 worker x 1 device): every all-reduce is a copy"
        )))
    return errors + warnings


def require_fits(spec: SpecLike, layout: Layout) -> AllReduceSpec:
    """Parse ``spec`` and raise :class:`TopologyError` on the first error :func:`check_spec` finds.

    Every rank of a job calls this with the same spec and layout, so every rank raises
    the same error.
    """
    parsed = parse_spec(spec)
    for finding in check_spec(parsed, layout):
        if finding.level == "error":
            raise TopologyError(finding.message)
    return parsed


def require_entry_fits(alg: str, shards: int, layout: Layout, index: int = 0) -> None:
    """Raise :class:`TopologyError` on the first error of the spec entry ``alg#shards``
    (:func:`entry_findings`; named as entry ``index``), without parsing a spec."""
    errors, _ = entry_findings(index, alg, shards, layout)
    if errors:
        raise TopologyError(errors[0].message)
