"""Peers measured beside mpistrat: ``torch.distributed`` with the gloo backend.

PyTorch is optional and never installed by mpistrat. The process group is built from
the MPI world (same ranks, same size): rank 0 starts the group's ``TCPStore`` on a port
the system picks when the store binds it (port 0), broadcasts its host and that port
through MPI, and every other rank joins that store with its MPI rank. The port is never
picked, closed and handed on: between the close and the store's own bind another process
could take it. Checks are collective, so a rank without PyTorch is an error on every rank.

With ``--batch`` the peer also reduces a whole batch of torch tensors three ways: one
``all_reduce`` per tensor (a hand-written loop), one ``all_reduce_coalesced`` call, and
one ``all_reduce`` of the batch concatenated (``torch.cat``) and split back.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import BackendUnavailable
from ..ops import ReduceOp
from ..runtime._mpi import Comm

__all__ = ["TorchGloo", "torch_available", "require_torch"]

# what gloo reduces among the dtypes torch.from_numpy takes (int16: "Invalid scalar type")
_TORCH_DTYPES = {"float16", "float32", "float64", "int8", "int32", "int64", "uint8"}

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


class TorchGloo:
    """A gloo process group over the ranks of an MPI communicator.

    Without ``OMP_NUM_THREADS`` in the environment, torch's own operations (``torch.cat``,
    copies) run on one thread per rank, as under ``torchrun`` with several processes per
    host; ``threads`` says how many.

    Args:
        comm: the MPI communicator whose ranks join (collective).

    Attributes:
        address: ``host:port`` of the group's store (rank 0's, the port its store bound).
    """

    label = "torch.distributed gloo"

    def __init__(self, comm: Comm) -> None:
        # optional, and slow to import: only --compare torch needs it
        import torch
        import torch.distributed as dist

        self._torch, self._dist = torch, dist
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(1)
        self.threads = torch.get_num_threads()
        # the same on every rank, or no rank measures it (a collective left half-called)
        self.coalesced = all(comm.allgather(hasattr(dist, "all_reduce_coalesced")))
        rank, size = comm.Get_rank(), comm.Get_size()
        store, address = None, None
        if rank == 0:  # listening before anyone is told where: the others wait for nothing
            store = dist.TCPStore(socket.gethostname(), 0, size, is_master=True,
                                  wait_for_workers=False)
            address = (socket.gethostname(), store.port)
        host, port = comm.bcast(address, root=0)
        if store is None:
            store = dist.TCPStore(host, port, size, is_master=False)
        self.address = f"{host}:{port}"
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
        self._ops = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MIN: dist.ReduceOp.MIN,
                     ReduceOp.MAX: dist.ReduceOp.MAX}
        self.version = torch.__version__

    def all_reduce(self, buf: np.ndarray, op: ReduceOp, participants: int) -> None:
        """Reduce ``buf`` in place (MEAN: SUM, then divide, as mpistrat does)."""
        tensor = self._torch.from_numpy(buf)
        self._dist.all_reduce(tensor, op=self._ops[op.primitive])
        if op is ReduceOp.MEAN:
            tensor.div_(participants)

    # -- a batch of torch tensors (SUM, in place)

    def tensors(self, shapes: Sequence[tuple[int, ...]], dtype: np.dtype) -> list[Any]:
        """New torch tensors of these shapes and ``dtype``, uninitialised (the batch as a
        torch training loop holds its gradients); ``.numpy()`` views fill and read them."""
        torch_dtype = self._torch.from_numpy(np.empty(0, dtype=dtype)).dtype
        return [self._torch.empty(shape, dtype=torch_dtype) for shape in shapes]

    def all_reduce_each(self, tensors: Sequence[Any]) -> None:
        """One ``all_reduce`` per tensor, in order."""
        all_reduce, SUM = self._dist.all_reduce, self._dist.ReduceOp.SUM
        for tensor in tensors:
            all_reduce(tensor, op=SUM)

    def all_reduce_coalesced(self, tensors: Sequence[Any]) -> None:
        """One ``all_reduce_coalesced`` call for every tensor (torch 2.x warns it "will be
        deprecated"; that warning is silenced here)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*all_reduce_coalesced")
            self._dist.all_reduce_coalesced(list(tensors), op=self._dist.ReduceOp.SUM)

    def all_reduce_flat(self, tensors: Sequence[Any], sizes: Sequence[int]) -> None:
        """``torch.cat`` of the flattened tensors, one ``all_reduce``, and the pieces copied
        back (``split``): what bucketing does by hand."""
        flat = self._torch.cat([t.reshape(-1) for t in tensors])
        self._dist.all_reduce(flat, op=self._dist.ReduceOp.SUM)
        for tensor, piece in zip(tensors, flat.split(list(sizes))):
            tensor.copy_(piece.view(tensor.shape))

    def close(self) -> None:
        self._dist.destroy_process_group()
