"""Bus bandwidth as nccl-tests define it: what a collective's algorithm bandwidth means
for the links, so that sizes and rank counts compare (the standard library only: the MPI
runtime records it in each collective's span)."""

from __future__ import annotations

__all__ = ["bus_factor"]


def bus_factor(collective: str, size: int) -> float:
    """busbw / algbw for ``collective`` (Kineto's ``Collective name``: ``allreduce``,
    ``all_gather``, ``reduce_scatter_tensor``, ...) over ``size`` ranks: 2(n-1)/n for
    all-reduce, (n-1)/n for all-gather, reduce-scatter and all-to-all, 1 for the others,
    0 on one rank."""
    kind = collective.lower().replace("_", "").replace("-", "")
    if size <= 1:
        return 0.0
    if "allreduce" in kind:
        return 2 * (size - 1) / size
    if any(k in kind for k in ("allgather", "reducescatter", "alltoall")):
        return (size - 1) / size
    return 1.0
