"""Timing calls interleaved across ranks, shared by the micro-benchmarks.

:func:`interleaved` runs every call once per iteration, in an order that rotates (round
robin, so a burst of load hits every variant alike), each alone: a barrier, then the
call, on every rank. A call's time is its slowest rank's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from mpi4py import MPI


def interleaved(comm: Any, calls: Mapping[str, Callable[[], object]], iters: int,
                warmup: int) -> dict[str, dict[str, float]]:
    """Median, 10th and 90th percentile (seconds) of each call, by name (collective)."""
    names = list(calls)
    for _ in range(warmup):
        for call in calls.values():
            call()
    times = np.zeros((len(names), iters))
    for i in range(iters):
        shift = i % len(names)
        for k in names[shift:] + names[:shift]:
            call = calls[k]
            comm.Barrier()
            start = time.perf_counter()
            call()
            times[names.index(k), i] = time.perf_counter() - start
    slowest = np.empty_like(times)
    comm.Allreduce(times, slowest, op=MPI.MAX)  # each call's slowest rank
    return {name: {"median": float(np.median(slowest[k])),
                   "mean": float(np.mean(slowest[k])),
                   "p10": float(np.percentile(slowest[k], 10)),
                   "p90": float(np.percentile(slowest[k], 90))}
            for k, name in enumerate(names)}
