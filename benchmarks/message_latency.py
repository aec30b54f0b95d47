#!/usr/bin/env python
"""What one message costs per size: rank ``r`` of the first half exchanges a message with
rank ``r + p/2`` (``comm.Sendrecv``) in a loop, so with the ranks of each host listed
together, every pair crosses a link. Run it across two hosts to see the transport's
thresholds, e.g. the largest message it sends inline (the cost model's ``inline``):

    eval "$(bin/cluster-local env)"
    mpiexec -n 2 -hosts node1,node2 python benchmarks/message_latency.py [--sizes 16,64,128,160,1K]
    [--repeats 5] [--calls 300] [--json FILE]

Each row is rank 0's best and median, over ``--repeats`` loops of ``--calls`` exchanges
(a barrier before each loop), of the time per exchange in µs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from mpi4py import MPI

from mpistrat.spec import parse_bytes

DEFAULT_SIZES = "16,32,64,96,128,160,192,256,512,1K,2K,4K"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=DEFAULT_SIZES,
                        help=f"message sizes in bytes, comma separated (default {DEFAULT_SIZES})")
    parser.add_argument("--repeats", type=int, default=5, help="loops per size (default 5)")
    parser.add_argument("--calls", type=int, default=300,
                        help="exchanges per loop (default 300)")
    parser.add_argument("--json", metavar="FILE", help="also write the rows to FILE")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if size < 2 or size % 2:
        if rank == 0:
            print(f"message_latency needs an even number of ranks, 2 or more; got {size}")
        raise SystemExit(2)
    half = size // 2
    peer = rank + half if rank < half else rank - half
    host, peer_host = MPI.Get_processor_name(), comm.sendrecv(MPI.Get_processor_name(),
                                                              dest=peer, source=peer)
    rows = []
    if rank == 0:
        print(f"# message_latency: {size} ranks, rank 0 on {host} exchanges with rank {peer} "
              f"on {peer_host}; {args.repeats} loops of {args.calls} Sendrecv per size")
        print(f"# {'size (B)':>10} {'best (us)':>10} {'median (us)':>12}")
    for nbytes in (parse_bytes(s) for s in args.sizes.split(",")):
        out = np.zeros(nbytes, np.uint8)
        into = np.empty_like(out)
        times = []
        for _ in range(args.repeats):
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(args.calls):
                comm.Sendrecv(out, peer, 0, into, peer, 0)
            times.append((time.perf_counter() - start) / args.calls)
        if rank == 0:
            row = {"bytes": nbytes, "best_us": min(times) * 1e6,
                   "median_us": statistics.median(times) * 1e6}
            rows.append(row)
            print(f"  {nbytes:>10} {row['best_us']:>10.1f} {row['median_us']:>12.1f}")
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": size, "host": host, "peer_host": peer_host, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
