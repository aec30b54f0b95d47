"""Peers measured beside mpistrat: ``torch.distributed`` with the gloo backend.

PyTorch is optional and never installed by mpistrat. The process group is built from
the MPI world (same ranks, same size): rank 0 picks a free TCP port on its host and
broadcasts ``tcp://host:port`` through MPI, and every rank joins with its MPI rank.
Checks are collective, so a rank without PyTorch is an error on every rank.
"""

from __future__ import annotations

import importlib.util
import socket

import numpy as np

from ..errors import BackendUnavailable
from ..ops import ReduceOp
from ..runtime._mpi import Comm

__all__ = ["TorchGloo", "torch_available", "require_torch"]

_TORCH_DTYPES = {"float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8"}

INSTALL_HINT = ("pip install torch --index-url https://download.pytorch.org/whl/cpu "
                "(the CPU build is enough for gloo)")


def torch_available() -> bool:
    """True when ``torch.distributed`` can be imported here (does not import it)."""
    return importlib.util.find_spec("torch") is not None


def require_torch(comm: Comm, dtype: np.dtype) -> None:
    """Raise the same error on every rank unless every rank has PyTorch and gloo handles
    ``dtype``. Collective over ``comm``."""
    missing = [r for r, ok in enumerate(comm.allgather(torch_available())) if not ok]
    if missing:
        raise BackendUnavailable(
            f"--compare torch needs PyTorch on every rank; it is not importable on rank(s) "
            f"{missing}: {INSTALL_HINT}, or leave out --compare torch")
    if dtype.name not in _TORCH_DTYPES:
        raise ValueError(f"--compare torch: torch.distributed (gloo) cannot reduce dtype "
                         f"{dtype}; use one of {', '.join(sorted(_TORCH_DTYPES))}")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


class TorchGloo:
    """A gloo process group over the ranks of an MPI communicator.

    Args:
        comm: the MPI communicator whose ranks join (collective).
    """

    label = "torch.distributed gloo"

    def __init__(self, comm: Comm) -> None:
        # optional, and slow to import: only --compare torch needs it
        import torch
        import torch.distributed as dist

        self._torch, self._dist = torch, dist
        address = None
        if comm.Get_rank() == 0:
            address = f"tcp://{socket.gethostname()}:{_free_port()}"
        address = comm.bcast(address, root=0)
        dist.init_process_group("gloo", init_method=address, rank=comm.Get_rank(),
                                world_size=comm.Get_size())
        self._ops = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MIN: dist.ReduceOp.MIN,
                     ReduceOp.MAX: dist.ReduceOp.MAX}
        self.version = torch.__version__

    def all_reduce(self, buf: np.ndarray, op: ReduceOp, participants: int) -> None:
        """Reduce ``buf`` in place (MEAN: SUM, then divide, as mpistrat does)."""
        tensor = self._torch.from_numpy(buf)
        self._dist.all_reduce(tensor, op=self._ops[op.primitive])
        if op is ReduceOp.MEAN:
            tensor.div_(participants)

    def close(self) -> None:
        self._dist.destroy_process_group()
