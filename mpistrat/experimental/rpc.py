"""``tf.distribute.experimental.rpc``: named so that code mentioning it imports, but not
usable: TF's RPC calls registered ``tf.function``\\ s between TF servers over gRPC, and an
MPI job has neither. Processes of an mpistrat job talk over MPI: mpi4py's point-to-point
calls (``comm.send``/``comm.recv``) between ranks, or, to run functions on workers,
:class:`mpistrat.coordinator.ClusterCoordinator` (``schedule`` / ``fetch``)."""

from __future__ import annotations

from typing import Any, NoReturn

from ..errors import UnsupportedError

__all__ = ["Client", "Server"]

_WHY = ("TF's tf.distribute.experimental.rpc calls tf.functions on TF servers over gRPC; an "
        "mpistrat job has no TF servers and its processes talk over MPI. To run a function on "
        "a worker use mpistrat.coordinator.ClusterCoordinator(strategy).schedule(fn) and "
        ".fetch(); to send data between ranks use mpi4py (comm.send / comm.recv)")


def _unsupported(name: str) -> NoReturn:
    raise UnsupportedError(f"rpc.{name}: {_WHY}")


class Server:
    """TF's ``rpc.Server``. Raises :class:`~mpistrat.errors.UnsupportedError`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _unsupported("Server")

    @staticmethod
    def create(rpc_layer: str, address: str) -> Server:
        """Raises :class:`~mpistrat.errors.UnsupportedError`."""
        _unsupported("Server.create")


class Client:
    """TF's ``rpc.Client``. Raises :class:`~mpistrat.errors.UnsupportedError`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _unsupported("Client")

    @staticmethod
    def create(rpc_layer: str, address: str, name: str = "",
               timeout_in_ms: int = 0) -> Client:
        """Raises :class:`~mpistrat.errors.UnsupportedError`."""
        _unsupported("Client.create")
