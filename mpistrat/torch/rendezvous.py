"""``init_process_group`` without ``MASTER_ADDR``: the rank, the size and the store from MPI.

torch's default ``env://`` rendezvous needs ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` and opens a TCP store on rank 0. In an MPI job the ranks already know
each other, so :func:`install` (run by ``import mpistrat.torch``) wraps torch's ``env``
handler: when ``MASTER_ADDR`` is not set (or is the one ``mpistrat run`` set for scripts
that read it), the rank and the size are ``COMM_WORLD``'s and the store is an
:class:`~mpistrat.torch.store.MPIStore` (served over MPI, no socket). When the user set
``MASTER_ADDR`` (torchrun, or by hand), torch's own handler runs as before.
"""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, urlparse

from ..config import RUN_MASTER
from ..runtime._mpi import world

__all__ = ["install", "mpi_rendezvous"]

_INSTALLED: list[Any] = []


def mpi_rendezvous(url: str, timeout: datetime.timedelta | None = None,
                   **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
    """torch's rendezvous protocol (a generator of ``(store, rank, world_size)``) over
    ``COMM_WORLD``; a rank or world size in ``url``'s query must be MPI's."""
    from .store import MPIStore

    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    query = {key: values[-1] for key, values in parse_qs(urlparse(url).query).items()}
    for name, expected in (("rank", rank), ("world_size", size)):
        given = query.get(name, "-1")
        if given not in ("-1", str(expected)):
            raise ValueError(f"init_process_group got {name}={given}, but this is MPI rank "
                             f"{rank} of {size}: without MASTER_ADDR the rank and the world "
                             f"size are MPI's; pass neither (or MPI's)")
    store = MPIStore(comm) if timeout is None else MPIStore(comm, timeout)
    yield store, rank, size
    raise RuntimeError("an MPI job cannot re-rendezvous: its ranks are fixed at launch")


def _mpistrat_master() -> bool:
    """True when ``MASTER_ADDR`` is unset, or is the one ``mpistrat run`` chose."""
    addr = os.environ.get("MASTER_ADDR")
    if not addr:
        return True
    return os.environ.get(RUN_MASTER) == f"{addr}:{os.environ.get('MASTER_PORT', '')}"


def install() -> None:
    """Wrap torch's ``env://`` handler (once per process)."""
    if _INSTALLED:
        return
    handlers = sys.modules["torch.distributed.rendezvous"]._rendezvous_handlers
    original = handlers["env"]

    def env_or_mpi(url: str, timeout: Any = None, **kwargs: Any) -> Any:
        if not _mpistrat_master():
            return original(url, timeout, **kwargs) if timeout is not None \
                else original(url, **kwargs)
        return mpi_rendezvous(url, timeout, **kwargs)

    handlers["env"] = env_or_mpi
    _INSTALLED.append(original)
