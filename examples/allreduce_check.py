"""A small all-reduce across every rank, checked against the exact answer.

Run it with ``python -m mpistrat.launch -n 2 -- python examples/allreduce_check.py``
(``bash bin/demo`` does). Each rank contributes ``rank + 1`` in every element; the sum
must be ``n (n + 1) / 2`` everywhere. It also shows how a spec routes the buffer.
"""

from __future__ import annotations

import sys

import numpy as np

import mpistrat
from mpistrat._mpi import world
from mpistrat.topology import get_topology


def main(spec: str = "xring:1M:pscpu/pscpu#2", count: int = 1 << 20) -> int:
    comm = world()
    topology = get_topology(comm)
    plan = mpistrat.parse_spec(spec)
    local = np.full(count, comm.rank + 1, dtype=np.float32)
    total = np.empty_like(local)
    comm.Allreduce(local, total)  # the MPI library's own algorithm ('native')
    expected = comm.size * (comm.size + 1) / 2
    ok = bool(np.all(total == expected))
    oks = comm.gather(ok)
    if comm.rank == 0:
        entry = plan.route(local.nbytes)
        print(f"{comm.size} ranks on {topology.num_nodes} node(s): all-reduce of "
              f"{local.nbytes} bytes (float32) -> {total[0]:g} on every element, expected "
              f"{expected:g}: {'OK' if all(oks) else 'WRONG on ranks ' + str([r for r, o in enumerate(oks) if not o])}")
        print(f"spec {plan} would route this buffer to {entry.alg!r} "
              f"(shards={entry.shards}); mpistrat's own algorithms arrive with the "
              f"algorithms issue, 'native' ran here")
    return 0 if all(comm.allgather(ok)) else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:2]))
