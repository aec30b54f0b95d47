"""The default ``torch.distributed`` group of the ``"mpistrat"`` backend, for the torch
backend's MPI tests (test_torch_backend*.py): made with the torchrun variables a
launcher may have set cleared, so that the rendezvous is MPI's."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch.distributed as dist
from mpi4py import MPI

import mpistrat.torch  # noqa: F401  (registers the backend)

TORCHRUN_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


@contextlib.contextmanager
def no_torchrun_env() -> Iterator[None]:
    """Without MASTER_ADDR (and the rest): init_process_group meets over MPI."""
    with pytest.MonkeyPatch.context() as patch:
        for name in TORCHRUN_VARS:
            patch.delenv(name, raising=False)
        yield


def init(form: str = "mpi") -> None:
    """``init_process_group("mpistrat")`` plainly (``"mpi"``: rank, size and store from
    MPI) or with a local store and MPI's rank and size (``"hashstore"``)."""
    if form == "mpi":
        dist.init_process_group("mpistrat")
    else:
        world = MPI.COMM_WORLD
        dist.init_process_group("mpistrat", store=dist.HashStore(), rank=world.rank,
                                world_size=world.size)


@contextlib.contextmanager
def default_group() -> Iterator[object]:
    """The plain default group for a module's tests, destroyed at the end."""
    with no_torchrun_env():
        init()
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()
