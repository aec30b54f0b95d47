"""The registry of all-reduce algorithm names: the single source of truth.

The spec parser, ``mpistrat validate``, the CLI choices, the error messages and the
docs all take the list of algorithms from here. This module is pure (no MPI, no
CuPy) so that parsing a spec never initialises MPI or CUDA.

An entry describes *what* an algorithm is (its stages, whether it needs GPUs,
what its ``shards`` count means and which pool of ranks or devices bounds it);
the implementations attach themselves to the same names.
"""

from __future__ import annotations

import difflib
import enum
from dataclasses import dataclass

from ..errors import UnknownAlgorithmError

__all__ = ["AlgorithmInfo", "Shards", "Pool", "register", "get", "names"]


class Shards(enum.Enum):
    """What the ``shards`` number of a spec entry means for an algorithm."""

    PIPELINES = "ring pipelines in flight"
    GATHER_RANKS = "gather ranks (one reduced piece each)"
    IGNORED = "ignored"


class Pool(enum.Enum):
    """Where gather shards live, which bounds ``shards`` for shuffle algorithms."""

    RANKS = "ranks"  # one gather rank per MPI rank (host memory)
    GPUS = "GPUs"  # every GPU of every rank
    NODES = "node leaders"  # one gather rank per node (the cross-node stage)


@dataclass(frozen=True)
class AlgorithmInfo:
    """Static description of one registered algorithm name.

    Attributes:
        name: the name used in specs (``"xring"``, ``"nccl/rechd"``).
        summary: one line for ``--help``, ``validate`` and the docs.
        shards: what a spec entry's ``shards`` means for this algorithm.
        needs_gpu: True when it can only run on GPU buffers (NCCL, GPU gather).
        pool: for shuffle algorithms, the set of gather ranks/devices; ``shards`` may not
            exceed its size.
        intra: for a hierarchical ``a/b`` name, the stage run inside each node.
        inter: for a hierarchical ``a/b`` name, the stage run across node leaders.
        from_tf: True for the names TensorFlow's ``MultiWorkerAllReduce`` accepted.
        single_node: True when every rank must be on one node (shared memory); across
            nodes it runs as the intra-node stage of a hierarchical name.
    """

    name: str
    summary: str
    shards: Shards
    needs_gpu: bool = False
    pool: Pool | None = None
    intra: str | None = None
    inter: str | None = None
    from_tf: bool = True
    single_node: bool = False

    @property
    def hierarchical(self) -> bool:
        """True for ``a/b`` names: stage ``a`` inside nodes, ``b`` across node leaders."""
        return self.intra is not None


_REGISTRY: dict[str, AlgorithmInfo] = {}


def register(info: AlgorithmInfo) -> AlgorithmInfo:
    """Add an algorithm description; names are unique."""
    if info.name in _REGISTRY:
        raise ValueError(f"algorithm {info.name!r} is already registered")
    if info.hierarchical and (info.intra not in _REGISTRY or info.inter not in _REGISTRY):
        raise ValueError(
            f"hierarchical algorithm {info.name!r} needs its stages {info.intra!r} and "
            f"{info.inter!r} registered first"
        )
    _REGISTRY[info.name] = info
    return info


def names() -> tuple[str, ...]:
    """All registered algorithm names, in registration order."""
    return tuple(_REGISTRY)


def get(name: str) -> AlgorithmInfo:
    """Look up an algorithm by name.

    Raises:
        UnknownAlgorithmError: the name is not registered; the message suggests the
            closest names and lists every valid one.
    """
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        pass
    hint = ""
    if isinstance(name, str):
        close = difflib.get_close_matches(name.lower(), _REGISTRY, n=3, cutoff=0.5)
        if close:
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?"
    raise UnknownAlgorithmError(
        f"unknown all-reduce algorithm {name!r}{hint} "
        f"(valid algorithms: {', '.join(_REGISTRY)})"
    )


def _hierarchical(intra: str, inter: str, *, from_tf: bool = True) -> AlgorithmInfo:
    inner, outer = _REGISTRY[intra], _REGISTRY[inter]
    pool = Pool.NODES if outer.pool is not None else None
    return AlgorithmInfo(
        name=f"{intra}/{inter}",
        summary=f"{intra} inside each node, {inter} across node leaders, then a broadcast "
        f"inside the node",
        shards=outer.shards,
        needs_gpu=inner.needs_gpu or outer.needs_gpu,
        pool=pool,
        intra=intra,
        inter=inter,
        from_tf=from_tf,
    )


# The flat algorithms. Order here is the order users see in help and errors.
register(AlgorithmInfo(
    "nccl", "NCCL all-reduce over every GPU of every rank (one NCCL communicator)",
    Shards.IGNORED, needs_gpu=True))
register(AlgorithmInfo(
    "xring", "ring reduce-scatter then all-gather over all ranks",
    Shards.PIPELINES))
register(AlgorithmInfo(
    "rechd", "recursive halving-doubling, any rank count (extra ranks folded in and out)",
    Shards.IGNORED, from_tf=False))
register(AlgorithmInfo(
    "pscpu", "shuffle: piece k reduced in host memory on gather rank k, then sent back",
    Shards.GATHER_RANKS, pool=Pool.RANKS))
register(AlgorithmInfo(
    "psgpu", "shuffle: piece k reduced on gather GPU k, then sent back",
    Shards.GATHER_RANKS, needs_gpu=True, pool=Pool.GPUS))
register(AlgorithmInfo(
    "native", "the MPI library's own Allreduce (the baseline)",
    Shards.IGNORED, from_tf=False))
register(AlgorithmInfo(
    "shm", "shared memory inside one node: each rank reduces its slice of every rank's "
    "buffer in place, then copies the others' (MPI-3 shared windows)",
    Shards.IGNORED, from_tf=False, single_node=True))

# The hierarchical combinations TensorFlow offered.
register(_hierarchical("nccl", "xring"))
register(_hierarchical("nccl", "rechd"))
register(_hierarchical("nccl", "pscpu"))
register(_hierarchical("pscpu", "pscpu"))
# Shared memory inside each node, any host algorithm across node leaders.
register(_hierarchical("shm", "xring", from_tf=False))
register(_hierarchical("shm", "rechd", from_tf=False))
register(_hierarchical("shm", "pscpu", from_tf=False))
