#!/usr/bin/env python
"""What the public door costs: ``mpistrat.all_reduce`` against ``comm.Allreduce`` on the
same buffers, per size, in place and out of place, with the argument check on and off.

    mpiexec -n 2 python benchmarks/api_overhead.py [--sizes 4,1K,1M,64M] [--repeats 7]
    [--specs xring,native,rechd,shm] [--json FILE]

Each row is the median over ``--repeats`` rounds of the mean time of a loop of calls
(no barrier inside a loop; a barrier before each loop), in µs, and its ratio to
``comm.Allreduce`` of the same size in the same sitting; the rounds interleave the cases,
so a burst of load on the machine hits every case alike. "new result" is
``y = all_reduce(x)`` in a loop: the previous result is still referenced while the next
call runs, as in a training loop; "faults" is rank 0's minor page faults per call (fresh
memory touched by the call). Rank 0 prints the table (with the load average, which
is worth reading before the numbers); ``--json`` keeps the rows. Compare two trees by
running it with ``PYTHONPATH`` set to each, interleaved, in one sitting.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time

import numpy as np
from mpi4py import MPI

import mpistrat
from mpistrat.spec import parse_bytes


def _loop_time(call, seconds: float, comm) -> tuple[float, float]:
    """Mean seconds per call over a loop that lasts about ``seconds`` (rank 0 decides),
    and this rank's minor page faults per call in that loop."""
    call()
    comm.Barrier()
    start = time.perf_counter()
    call()
    once = comm.bcast(time.perf_counter() - start)
    n = max(3, min(20000, int(seconds / max(once, 1e-7))))
    comm.Barrier()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    for _ in range(n):
        call()
    elapsed = time.perf_counter() - start
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return comm.allreduce(elapsed, op=MPI.MAX) / n, faults / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4,1K,1M,64M")
    parser.add_argument("--specs", default="xring,native,rechd,shm")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=0.3, help="per loop")
    parser.add_argument("--json")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rows = []
    for size in [parse_bytes(s) for s in args.sizes.split(",")]:
        count = max(1, size // 4)
        x = np.zeros(count, np.float32)  # (in place, sums of zeros stay zeros: no overflow)
        held = [None]

        def new_result(spec: str, check: bool) -> None:
            held[0] = mpistrat.all_reduce(x, "sum", spec, check=check)  # y = all_reduce(x)

        cases = {"comm.Allreduce in place": lambda: comm.Allreduce(MPI.IN_PLACE, x)}
        for spec in args.specs.split(","):
            for check in (True, False):
                tag = f"{spec}, check {'on' if check else 'off'}"
                cases[f"all_reduce {tag}, in place"] = (
                    lambda s=spec, c=check: mpistrat.all_reduce(x, "sum", s, inplace=True,
                                                                check=c))
                cases[f"all_reduce {tag}, new result"] = (
                    lambda s=spec, c=check: new_result(s, c))
        times: dict[str, list[float]] = {name: [] for name in cases}
        faults: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.repeats):  # rounds interleave the cases
            for name, call in cases.items():
                seconds, faulted = _loop_time(call, args.seconds, comm)
                times[name].append(seconds)
                faults[name].append(faulted)
        held[0] = None
        raw = statistics.median(times["comm.Allreduce in place"])
        for name, samples in times.items():
            rows.append({"bytes": count * 4, "case": name,
                         "median_us": statistics.median(samples) * 1e6,
                         "min_us": min(samples) * 1e6,
                         "x_raw": statistics.median(samples) / raw,
                         "faults_per_call": statistics.median(faults[name])})
    if comm.rank == 0:
        load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
        print(f"# {comm.size} ranks, mpistrat {mpistrat.__version__} from "
              f"{mpistrat.__file__.rsplit('/', 2)[0]}; load average {load}")
        print(f"# {'bytes':>10}  {'median (us)':>12}  {'min (us)':>10}  {'x raw':>6}  "
              f"{'faults':>7}  case")
        for row in rows:
            print(f"  {row['bytes']:>10}  {row['median_us']:>12.2f}  {row['min_us']:>10.2f}  "
                  f"{row['x_raw']:>6.2f}  {row['faults_per_call']:>7.0f}  {row['case']}")
        if args.json:
            with open(args.json, "w") as file:
                json.dump(rows, file, indent=1)


if __name__ == "__main__":
    main()
