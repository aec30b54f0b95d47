#!/usr/bin/env python
"""What the strategy API's small calls cost, against ``comm.Allreduce`` of the same array.

    mpiexec -n 2 python benchmarks/strategy_overhead.py [--size 1K] [--repeats 7]
    [--seconds 0.2] [--json FILE]

Cases, each on one float32 array of ``--size`` bytes per rank (a loss, a metric, a small
gradient), with ``MultiWorkerMirroredStrategy()``'s defaults:

* ``comm.Allreduce``: the raw in-place MPI call;
* ``mpistrat.all_reduce``: the public call, default options;
* ``strategy.reduce``: ``strategy.reduce(SUM, x, axis=None)`` (also of a Python float);
* ``extended.reduce_to``, ``extended.batch_reduce_to`` of one and of three values;
* ``strategy.run(noop)`` and ``strategy.run(ctx.all_reduce)``: a replica function that does
  nothing, and one that all-reduces ``x`` in replica context (``merge_call`` included).

Each row is the median over ``--repeats`` rounds of the mean time of a loop of calls
(a barrier before each loop), in µs, and its ratio to ``comm.Allreduce`` in the same
sitting; the rounds interleave the cases. Rank 0 prints the table. Compare two trees by
running it with ``PYTHONPATH`` set to each, interleaved, in one sitting.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
from mpi4py import MPI

import mpistrat as ms
from mpistrat.spec import parse_bytes


def _loop_time(call, seconds: float, comm) -> float:
    """Mean seconds per call over a loop that lasts about ``seconds`` (rank 0 decides)."""
    call()
    comm.Barrier()
    start = time.perf_counter()
    count = 0
    while True:
        for _ in range(50):
            call()
        count += 50
        done = comm.bcast(time.perf_counter() - start >= seconds, root=0)
        if done:
            break
    return (time.perf_counter() - start) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1K", help="bytes per array (default 1K)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=0.2)
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()

    comm = MPI.COMM_WORLD
    strategy = ms.MultiWorkerMirroredStrategy()
    extended = strategy.extended
    device = extended.worker_devices[0]
    count = max(1, parse_bytes(args.size) // 4)
    x = np.ones(count, np.float32)
    raw = np.zeros(count, np.float32)
    sum_ = ms.ReduceOp.SUM

    def replica_all_reduce():
        return ms.get_replica_context().all_reduce(sum_, x)

    cases = {
        "comm.Allreduce": lambda: comm.Allreduce(MPI.IN_PLACE, raw),
        "mpistrat.all_reduce(x)": lambda: ms.all_reduce(x),
        "strategy.reduce(SUM, x)": lambda: strategy.reduce(sum_, x, axis=None),
        "strategy.reduce(SUM, 1.0)": lambda: strategy.reduce(sum_, 1.0, axis=None),
        "extended.reduce_to": lambda: extended.reduce_to(sum_, x, device),
        "extended.batch_reduce_to, 1 value": lambda: extended.batch_reduce_to(
            sum_, [(x, device)]),
        "extended.batch_reduce_to, 3 values": lambda: extended.batch_reduce_to(
            sum_, [(x, device)] * 3),
        "strategy.run(noop)": lambda: strategy.run(lambda: None),
        "strategy.run(ctx.all_reduce)": lambda: strategy.run(replica_all_reduce),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, call in cases.items():
            times[name].append(_loop_time(call, args.seconds, comm))
    if comm.rank != 0:
        return
    base = statistics.median(times["comm.Allreduce"])
    rows = [{"case": name, "us": statistics.median(t) * 1e6,
             "ratio": statistics.median(t) / base} for name, t in times.items()]
    print(f"# {comm.size} ranks, {count * 4} bytes float32, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.2f}; {extended.cross_device_ops.spec}")
    print(f"{'case':40s} {'µs':>9s} {'vs Allreduce':>13s}")
    for row in rows:
        print(f"{row['case']:40s} {row['us']:9.1f} {row['ratio']:12.1f}x")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(rows, file, indent=1)


if __name__ == "__main__":
    main()
