#!/usr/bin/env python
"""What parameter-server training costs per step: scheduling a function on a worker, and
reading and updating a variable on a ps.

    mpistrat run -n 4 --num-ps 1 benchmarks/ps_dispatch.py [--closures 2000]
        [--sizes 4,4K,1M,16M] [--rounds 5] [--json FILE]

Rank 0 (the coordinator) prints two tables, medians over ``--rounds`` rounds:

* **dispatch**: ``--closures`` functions scheduled back to back, then ``join()``: the
  functions completed per second and the time per function, for an empty function, one
  that returns a 4 KiB array, and one that does ``v.assign_add`` of a 4-byte variable;
* **variables**, per size, from the coordinator and from inside a scheduled function (a
  worker): ``read`` (``numpy()``), ``assign_add`` (an MPI accumulate) and ``assign_add``
  with ``use_locking=True`` (a read-modify-write under the ps's exclusive lock), in µs.

The numbers mean something only with a core per rank: the ps ranks and the workers poll
inside MPI. On a machine with fewer cores than ranks they measure the scheduler.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import numpy as np

import mpistrat as ms
from mpistrat.spec import parse_bytes


def _time(fn: Any, repeat: int) -> float:
    """Mean seconds per call of ``fn`` over ``repeat`` calls."""
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--closures", type=int, default=2000)
    parser.add_argument("--sizes", default="4,4K,1M,16M")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    sizes = [parse_bytes(s) for s in args.sizes.split(",")]

    strategy = ms.ParameterServerStrategy()  # workers and ps serve inside
    coordinator = ms.ClusterCoordinator(strategy)
    with strategy.scope():
        counter = ms.Variable(np.zeros(1, np.float32))
        variables = {n: ms.Variable(np.zeros(max(1, n // 4), np.float32)) for n in sizes}

    payload = np.ones(1024, np.float32)
    cases = {
        "empty": lambda: None,
        "returns 4 KiB": lambda: payload,
        "assign_add 4 B": lambda: counter.assign_add(np.ones(1, np.float32)) and None,
    }
    dispatch: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, fn in cases.items():
            start = time.perf_counter()
            for _ in range(args.closures):
                coordinator.schedule(fn)
            coordinator.join()
            dispatch[name].append((time.perf_counter() - start) / args.closures)

    def on_worker(n: int, repeat: int) -> dict[str, float]:
        v, delta = variables[n], np.ones(max(1, n // 4), np.float32)
        return {"read": _time(v.numpy, repeat),
                "assign_add": _time(lambda: v.assign_add(delta), repeat),
                "assign_add locked": _time(lambda: v.assign_add(delta, use_locking=True),
                                           repeat)}

    rows: dict[tuple[int, str], list[dict[str, float]]] = {}
    for _ in range(args.rounds):
        for n in sizes:
            repeat = max(3, min(1000, (64 << 20) // max(n, 1) // 64))
            rows.setdefault((n, "coordinator"), []).append(on_worker(n, repeat))
            rows.setdefault((n, "worker"), []).append(
                coordinator.schedule(on_worker, args=(n, repeat)).fetch())

    print(f"# {strategy!r}; {os.cpu_count()} cores; load average "
          f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("| scheduled function | functions/s | µs per function |\n| --- | ---: | ---: |")
    result: dict[str, Any] = {"dispatch": {}, "variables": []}
    for name, times in dispatch.items():
        median = statistics.median(times)
        result["dispatch"][name] = median
        print(f"| {name} | {1 / median:,.0f} | {median * 1e6:.1f} |")
    print("\n| bytes | from | read (µs) | assign_add (µs) | assign_add locked (µs) |\n"
          "| ---: | --- | ---: | ---: | ---: |")
    for (n, where), samples in rows.items():
        med = {k: statistics.median(s[k] for s in samples) * 1e6 for k in samples[0]}
        result["variables"].append({"bytes": n, "from": where, **med})
        print(f"| {n} | {where} | {med['read']:.1f} | {med['assign_add']:.1f} | "
              f"{med['assign_add locked']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
