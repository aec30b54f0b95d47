"""``mpistrat bench --compare torch``'s peer, joined on one rank in this process (no MPI:
a one-rank stand-in for the communicator); the runs on several ranks are in
``tests/launch/test_bench_launch.py``."""

from __future__ import annotations

import socket
import types

import numpy as np
import pytest

from mpistrat.bench import peers
from mpistrat.ops import ReduceOp

dist = pytest.importorskip("torch.distributed")


class OneRank:
    """The communicator calls the peer makes, for a job of one rank."""

    def Get_rank(self):  # noqa: N802 (mpi4py's names)
        return 0

    def Get_size(self):  # noqa: N802
        return 1

    def bcast(self, value, root=0):
        return value

    def allgather(self, value):
        return [value]


def test_the_store_binds_its_own_port(monkeypatch):
    """Rank 0's store listens on a port the system gives it when it binds (port 0), and that
    port is what the ranks are told: no port is picked by a throwaway socket, closed and
    handed on, which another process could take in between (the module may use no socket
    but for the host name)."""
    monkeypatch.setattr(peers, "socket", types.SimpleNamespace(gethostname=socket.gethostname))
    stores = []
    real = dist.TCPStore

    def recording(*args, **kwargs):
        store = real(*args, **kwargs)
        stores.append((args, kwargs, store))
        return store

    monkeypatch.setattr(dist, "TCPStore", recording)
    peer = peers.TorchGloo(OneRank())
    try:
        (args, kwargs, store), = stores
        assert args[1] == 0 and kwargs["is_master"] is True
        assert kwargs["wait_for_workers"] is False  # (the others learn the port after)
        assert store.port > 0 and peer.address == f"{socket.gethostname()}:{store.port}"
        buf = np.arange(4, dtype=np.float32)
        peer.all_reduce(buf, ReduceOp.MEAN, 1)
        assert np.array_equal(buf, np.arange(4, dtype=np.float32))
    finally:
        peer.close()
