#!/usr/bin/env python
"""What the form of a spec costs: ``mpistrat.all_reduce`` of one small array with the spec
as a string (``"xring"``), as TF's tuple (``("xring", 1, -1)``, the same object every
call, and a new equal tuple every call) and as an ``AllReduceSpec``, against the MPI
library's own ``comm.Allreduce`` of the same buffer.

    mpiexec -n 2 python benchmarks/spec_forms.py [--bytes 1K] [--iters 3000]
    [--warmup 200] [--json FILE]

Every call is timed alone: a barrier, then the call, on every rank; a call's time is its
slowest rank's, and each row is the median over ``--iters`` calls (with the 10th and 90th
percentiles), in µs, with its ratio to the string spec and to ``comm.Allreduce``. The
variants are interleaved (each iteration runs every variant once, in an order that
rotates), so a burst of load on the machine hits every variant alike. Every form should
run from the plan that ``all_reduce`` keeps, so the tuple rows should be within a few
percent of the string row. Rank 0 prints the table, with the load average, which is
worth reading before the numbers; ``--json`` keeps the rows.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

import mpistrat
from mpistrat.spec import parse_bytes

from _interleave import interleaved  # (benchmarks/: the directory of the script)


def _variants(comm, x: np.ndarray) -> dict[str, Callable[[], object]]:
    """The calls to time, by name: each reduces ``x`` into a new array."""
    held: list[object] = [None]  # the previous result stays referenced, as in a loop
    out = np.empty_like(x)
    parsed = mpistrat.parse_spec("xring")
    as_tuple = ("xring", 1, -1)
    parts = ["xring", 1, -1]

    def string() -> None:
        held[0] = mpistrat.all_reduce(x, "sum", "xring", comm)

    def same_tuple() -> None:
        held[0] = mpistrat.all_reduce(x, "sum", as_tuple, comm)

    def new_tuple() -> None:  # an equal tuple built for each call (no identity hit)
        held[0] = mpistrat.all_reduce(x, "sum", tuple(parts), comm)

    def spec_object() -> None:
        held[0] = mpistrat.all_reduce(x, "sum", parsed, comm)

    return {
        "comm.Allreduce": lambda: comm.Allreduce(x, out),
        "spec 'xring'": string,
        "spec ('xring', 1, -1)": same_tuple,
        "spec tuple(...) each call": new_tuple,
        "spec AllReduceSpec": spec_object,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bytes", default="1K", help="the array's size (float32)")
    parser.add_argument("--iters", type=int, default=3000, help="timed calls per variant")
    parser.add_argument("--warmup", type=int, default=200, help="untimed calls per variant")
    parser.add_argument("--json")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    count = max(1, parse_bytes(args.bytes) // 4)
    x = np.full(count, comm.rank + 1.0, np.float32)
    variants = _variants(comm, x)
    stats = interleaved(comm, variants, args.iters, args.warmup)
    medians = {name: found["median"] for name, found in stats.items()}
    rows = [{"bytes": count * 4, "case": name,
             "median_us": medians[name] * 1e6,
             "p10_us": stats[name]["p10"] * 1e6, "p90_us": stats[name]["p90"] * 1e6,
             "x_string": medians[name] / medians["spec 'xring'"],
             "x_raw": medians[name] / medians["comm.Allreduce"]}
            for name in variants]
    if comm.rank == 0:
        load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
        print(f"# {comm.size} ranks, {count * 4} B float32, {args.iters} calls per variant "
              f"(barrier before each, slowest rank), mpistrat {mpistrat.__version__} from "
              f"{mpistrat.__file__.rsplit('/', 2)[0]}; load average {load}")
        print(f"# {'median (us)':>12}  {'p10':>8}  {'p90':>8}  {'x string':>8}  "
              f"{'x raw':>6}  case")
        for row in rows:
            print(f"  {row['median_us']:>12.2f}  {row['p10_us']:>8.2f}  {row['p90_us']:>8.2f}  "
                  f"{row['x_string']:>8.2f}  {row['x_raw']:>6.2f}  {row['case']}")
        if args.json:
            with open(args.json, "w") as file:
                json.dump(rows, file, indent=1)


if __name__ == "__main__":
    main()
