"""What the code behind an algorithm name offers: :class:`Implementation`.

The table from names to implementations is :data:`mpistrat.dispatch.IMPLEMENTATIONS`;
the names themselves, and what they mean, are in :mod:`.registry`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Implementation"]


@dataclass(frozen=True)
class Implementation:
    """The code behind an algorithm name.

    Attributes:
        all_reduce: ``f(comm, buf, *, op, shards, backend, rotation)``, in place.
        reduce_to_root: ``f(comm, buf, *, op, backend, root)`` leaving the reduction on
            ``root`` only, when the algorithm has a cheaper form for that (used as the
            intra-node stage of hierarchical algorithms).
        broadcast: ``f(comm, buf, *, backend, root)`` copying ``root``'s buffer to every
            rank, when the algorithm has a faster way than ``MPI_Bcast`` (shared memory,
            NCCL); used for the last stage of hierarchical algorithms.
        out_of_place: ``all_reduce`` also takes ``source=`` (a :class:`.source.Source`)
            and reduces it into ``buf`` without first copying it there.
        root_out_of_place: ``reduce_to_root`` takes ``source=`` likewise.
    """

    all_reduce: Callable[..., None]
    reduce_to_root: Callable[..., None] | None = None
    out_of_place: bool = False
    broadcast: Callable[..., None] | None = None
    root_out_of_place: bool = False
