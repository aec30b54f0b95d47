"""The cluster fixture itself: hosts of their own, and MPI bytes on the links."""

import sys

import pytest

pytestmark = pytest.mark.cluster

PROBE = ("-c", "import socket, numpy as np; from mpi4py import MPI; c = MPI.COMM_WORLD; "
         "a = np.ones(1 << 20, np.float32); c.Allreduce(MPI.IN_PLACE, a); "
         "import sys; sys.stdout.write(f'{c.rank} {socket.gethostname()} {a[0]}\\n'); sys.stdout.flush()")


def test_ranks_run_on_their_hosts_and_bytes_cross_the_links(cluster):
    before = cluster.bytes()
    result = cluster.mpiexec("node1:2,node2:2", [sys.executable, *PROBE])
    assert result.returncode == 0, result.stderr
    lines = sorted(result.stdout.splitlines())
    assert lines == ["0 node1 4.0", "1 node1 4.0", "2 node2 4.0", "3 node2 4.0"]
    moved = cluster.moved(before)
    assert all(sent > 4 << 20 for sent in moved.values()), moved
