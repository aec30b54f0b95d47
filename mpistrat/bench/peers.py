"""Peers measured beside mpistrat: ``torch.distributed`` over gloo and over mpistrat's own
``"mpistrat"`` backend (:mod:`mpistrat.torch.backend`).

PyTorch is optional and never installed by mpistrat. ``--compare torch`` joins two
:class:`TorchPeer` objects, the same torch calls on a process group of each backend over the
same ranks:

* ``torch-gloo``: torch's default group, gloo, built from the MPI world (same ranks, same
  size): rank 0 starts the group's ``TCPStore`` on a port the system picks when the store
  binds it (port 0), broadcasts its host and that port through MPI, and every other rank
  joins that store with its MPI rank. The port is never picked, closed and handed on:
  between the close and the store's own bind another process could take it. Checks are
  collective, so a rank without PyTorch is an error on every rank.
* ``torch-mpistrat``: ``dist.new_group(backend="mpistrat")`` over every rank of that
  default group, its calls given ``group=``. When it cannot be made (``mpistrat.torch``
  does not import on some rank, the communicator's ranks are not the MPI world's, the
  group's creation fails) only this column is left out, with a note saying why
  (:func:`mpistrat_backend_problem`).

With ``--batch`` each peer also reduces a whole batch of torch tensors three ways: one
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
from ..runtime._mpi import Comm, world

__all__ = ["TorchPeer", "TorchGloo", "BACKENDS", "torch_available", "require_torch",
           "mpistrat_backend_problem", "join_mpistrat"]

BACKENDS = ("gloo", "mpistrat")
"""The backends ``--compare torch`` measures, in column order (entry ``torch-<backend>``)."""

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


def _one_problem(problems: Sequence[str | None]) -> str | None:
    """The first rank's problem of an allgathered list, naming the ranks that had one."""
    failed = [r for r, problem in enumerate(problems) if problem is not None]
    if not failed:
        return None
    return f"rank(s) {failed}: {problems[failed[0]]}"


def mpistrat_backend_problem(comm: Comm) -> str | None:
    """Why a ``"mpistrat"`` group cannot be made over ``comm``'s ranks (None: it can).
    Collective over ``comm``: every rank gets the same answer.

    The backend's ranks are ``COMM_WORLD``'s, so ``comm`` must hold the world's ranks in
    the world's order; and ``mpistrat.torch`` (which registers the backend) must import."""
    problem: str | None = None
    everyone = world()
    if (comm.Get_size(), comm.Get_rank()) != (everyone.Get_size(), everyone.Get_rank()):
        problem = (f"rank {comm.Get_rank()} of {comm.Get_size()} here is MPI world rank "
                   f"{everyone.Get_rank()} of {everyone.Get_size()}: the backend's ranks are "
                   f"the world's")
    else:
        try:
            import mpistrat.torch  # noqa: F401 (registers the backend)
        except Exception as exc:  # noqa: BLE001 - any failure (an old torch) is a note
            problem = f"import mpistrat.torch failed ({type(exc).__name__}: {exc})"
    return _one_problem(comm.allgather(problem))


class TorchPeer:
    """``torch.distributed``'s all-reduce on a process group of one backend, over the ranks
    of an MPI communicator.

    Without ``OMP_NUM_THREADS`` in the environment, torch's own operations (``torch.cat``,
    copies) run on one thread per rank, as under ``torchrun`` with several processes per
    host; ``threads`` says how many.

    Args:
        comm: the MPI communicator whose ranks join (collective).
        backend: ``"gloo"`` or ``"mpistrat"`` (``import mpistrat.torch`` registers it;
            :func:`mpistrat_backend_problem` says first whether it can be made).
        default: make torch's default group with this backend from the MPI world (the
            first peer of a process); False: ``dist.new_group(backend=backend)`` over every
            rank of the default group, which a first peer made from the same ``comm``.

    Attributes:
        label: the entry's name, ``torch-<backend>``.
        group: the process group the calls are given (None: the default group).
        address: ``host:port`` of the default group's store (rank 0's, the port its store
            bound); None for a group made by ``new_group`` (it uses the default's store).
    """

    def __init__(self, comm: Comm, backend: str = "gloo", *, default: bool = True) -> None:
        # optional, and slow to import: only --compare torch needs it
        import torch
        import torch.distributed as dist

        if backend == "mpistrat":
            import mpistrat.torch  # noqa: F401 (registers the backend)
        self._torch, self._dist = torch, dist
        self.backend, self.label = backend, f"torch-{backend}"
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(1)
        self.threads = torch.get_num_threads()
        # the same on every rank, or no rank measures it (a collective left half-called)
        self.coalesced = all(comm.allgather(hasattr(dist, "all_reduce_coalesced")))
        self.group: Any = None
        self.address: str | None = None
        if default:
            self.address = self._init_default(comm, backend)
        else:
            self.group = dist.new_group(backend=backend)
        # the calls' group= (none for the default group: the call as a script writes it)
        self._on: dict[str, Any] = {} if self.group is None else {"group": self.group}
        self._ops = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MIN: dist.ReduceOp.MIN,
                     ReduceOp.MAX: dist.ReduceOp.MAX}
        self.version = torch.__version__

    def _init_default(self, comm: Comm, backend: str) -> str:
        dist = self._dist
        rank, size = comm.Get_rank(), comm.Get_size()
        store, address = None, None
        if rank == 0:  # listening before anyone is told where: the others wait for nothing
            store = dist.TCPStore(socket.gethostname(), 0, size, is_master=True,
                                  wait_for_workers=False)
            address = (socket.gethostname(), store.port)
        host, port = comm.bcast(address, root=0)
        if store is None:
            store = dist.TCPStore(host, port, size, is_master=False)
        dist.init_process_group(backend, store=store, rank=rank, world_size=size)
        return f"{host}:{port}"

    def note(self) -> str:
        """The run's note on this peer: torch's version, the group, torch's threads."""
        if self.backend == "mpistrat":
            # (the spec of the group's all_reduce: MPISTRAT_TORCH_SPEC, else by topology)
            spec = getattr(self.group, "_spec", None)
            what = "mpistrat backend (mpistrat.torch" + (f", all_reduce spec {spec}" if spec
                                                         else "") + ")"
        else:
            what = f"{self.backend} backend"
        where = ("process group over the MPI world" if self.group is None else
                 "dist.new_group over the same ranks")
        return (f"{self.label}: torch.distributed {self.version}, {what}, {where}, "
                f"{self.threads} torch thread(s) per rank")

    def all_reduce(self, buf: np.ndarray, op: ReduceOp, participants: int) -> None:
        """Reduce ``buf`` in place (MEAN: SUM, then divide, as mpistrat does)."""
        tensor = self._torch.from_numpy(buf)
        self._dist.all_reduce(tensor, op=self._ops[op.primitive], **self._on)
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
        all_reduce, SUM, on = self._dist.all_reduce, self._dist.ReduceOp.SUM, self._on
        for tensor in tensors:
            all_reduce(tensor, op=SUM, **on)

    def all_reduce_coalesced(self, tensors: Sequence[Any]) -> None:
        """One ``all_reduce_coalesced`` call for every tensor (torch 2.x warns it "will be
        deprecated"; that warning is silenced here)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*all_reduce_coalesced")
            self._dist.all_reduce_coalesced(list(tensors), op=self._dist.ReduceOp.SUM,
                                            **self._on)

    def all_reduce_flat(self, tensors: Sequence[Any], sizes: Sequence[int]) -> None:
        """``torch.cat`` of the flattened tensors, one ``all_reduce``, and the pieces copied
        back (``split``): what bucketing does by hand."""
        flat = self._torch.cat([t.reshape(-1) for t in tensors])
        self._dist.all_reduce(flat, op=self._dist.ReduceOp.SUM, **self._on)
        for tensor, piece in zip(tensors, flat.split(list(sizes))):
            tensor.copy_(piece.view(tensor.shape))

    def close(self) -> None:
        """Destroy the peer's group (the default group: every group of the process; close
        peers made by ``new_group`` first)."""
        if self.group is None:
            self._dist.destroy_process_group()
        else:
            self._dist.destroy_process_group(self.group)


def join_mpistrat(comm: Comm) -> tuple[TorchPeer | None, str | None]:
    """The ``torch-mpistrat`` peer beside a default group made from ``comm``, or None and
    why it cannot be made (collective over ``comm``; the same outcome on every rank)."""
    problem = mpistrat_backend_problem(comm)
    if problem is not None:
        return None, problem
    peer, error = None, None
    try:  # (the backend agrees on its creation: a failure there is every rank's)
        peer = TorchPeer(comm, "mpistrat", default=False)
    except Exception as exc:  # noqa: BLE001 - the gloo column goes on without it
        error = f"dist.new_group(backend='mpistrat') failed ({type(exc).__name__}: {exc})"
    problem = _one_problem(comm.allgather(error))
    if problem is not None and peer is not None:
        peer.close()
        peer = None
    return peer, problem


TorchGloo = TorchPeer
"""The gloo peer's earlier name (``TorchPeer(comm)`` is gloo's default group)."""
