"""Per-communicator state cached on the communicator itself (an MPI attribute).

Objects derived from a communicator (its topology and sub-communicators, call counters)
live in a dict attached with ``Set_attr``; MPI calls the delete callback when the
communicator is freed, so derived communicators are freed with it. ``Dup`` does not copy
the cache: a duplicate starts fresh.
"""

from __future__ import annotations

from typing import Any, cast

from ._mpi import Comm, mpi

__all__ = ["comm_cache"]

_KEYVAL: int | None = None


def _on_free(comm: Comm, keyval: int, cache: dict) -> None:
    MPI = mpi()
    if MPI.Is_finalized():
        return
    for value in cache.values():
        release = getattr(value, "release", None)
        if release is not None:
            release()


def comm_cache(comm: Comm) -> dict:
    """The cache dict attached to ``comm`` (created empty on first use).

    Values with a ``release()`` method have it called when ``comm`` is freed.
    """
    global _KEYVAL
    MPI = mpi()
    if _KEYVAL is None:
        _KEYVAL = MPI.Comm.Create_keyval(delete_fn=_on_free)
    cache = cast("dict[Any, Any] | None", comm.Get_attr(_KEYVAL))
    if cache is None:
        cache = {}
        comm.Set_attr(_KEYVAL, cache)
    return cache
