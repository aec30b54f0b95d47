#!/usr/bin/env python
"""What the public door costs: ``mpistrat.all_reduce`` against ``comm.Allreduce`` on the
same buffers, per size, in place and out of place, with the argument check on and off.

    mpiexec -n 2 python benchmarks/api_overhead.py [--sizes 4,1K,1M,64M] [--repeats 7]
    [--specs native,rechd,shm] [--json FILE]

Each row is the median over ``--repeats`` rounds of the mean time of a loop of calls
(no barrier inside a loop; a barrier before each loop), in µs. Rank 0 prints the table;
``--json`` keeps the rows. Compare two trees by running it with ``PYTHONPATH`` set to
each, interleaved, in one sitting.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from mpi4py import MPI

import mpistrat
from mpistrat.spec import parse_bytes


def _loop_time(call, seconds: float, comm) -> float:
    """Mean seconds per call over a loop that lasts about ``seconds`` (rank 0 decides)."""
    call()
    comm.Barrier()
    start = time.perf_counter()
    call()
    once = comm.bcast(time.perf_counter() - start)
    n = max(3, min(20000, int(seconds / max(once, 1e-7))))
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(n):
        call()
    elapsed = time.perf_counter() - start
    return comm.allreduce(elapsed, op=MPI.MAX) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4,1K,1M,64M")
    parser.add_argument("--specs", default="native,rechd,shm")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=0.3, help="per loop")
    parser.add_argument("--json")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rows = []
    for size in [parse_bytes(s) for s in args.sizes.split(",")]:
        count = max(1, size // 4)
        x = np.zeros(count, np.float32)  # (in place, sums of zeros stay zeros: no overflow)
        cases = {"comm.Allreduce in place": lambda: comm.Allreduce(MPI.IN_PLACE, x)}
        for spec in args.specs.split(","):
            for check in (True, False):
                tag = f"{spec}, check {'on' if check else 'off'}"
                cases[f"all_reduce {tag}, in place"] = (
                    lambda s=spec, c=check: mpistrat.all_reduce(x, "sum", s, inplace=True,
                                                                check=c))
                cases[f"all_reduce {tag}, new result"] = (
                    lambda s=spec, c=check: mpistrat.all_reduce(x, "sum", s, check=c))
        for name, call in cases.items():
            times = [_loop_time(call, args.seconds, comm) for _ in range(args.repeats)]
            rows.append({"bytes": count * 4, "case": name,
                         "median_us": statistics.median(times) * 1e6,
                         "min_us": min(times) * 1e6})
    if comm.rank == 0:
        print(f"# {comm.size} ranks, mpistrat {mpistrat.__version__} from "
              f"{mpistrat.__file__.rsplit('/', 2)[0]}")
        print(f"# {'bytes':>10}  {'median (us)':>12}  {'min (us)':>10}  case")
        for row in rows:
            print(f"  {row['bytes']:>10}  {row['median_us']:>12.2f}  {row['min_us']:>10.2f}  "
                  f"{row['case']}")
        if args.json:
            with open(args.json, "w") as file:
                json.dump(rows, file, indent=1)


if __name__ == "__main__":
    main()
