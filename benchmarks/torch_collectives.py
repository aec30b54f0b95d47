#!/usr/bin/env python
"""``torch.distributed.all_reduce`` over the ``"mpistrat"`` backend against gloo, the MPI
library's ``MPI_Allreduce`` and ``mpistrat.all_reduce``, per size.

    mpiexec -n 2 python benchmarks/torch_collectives.py [--sizes 1K,64K,1M,64M]
        [--iters N] [--warmup N] [--spec SPEC] [--no-gloo] [--json FILE]

Variants, each on a float32 buffer of its own, summed in place:

* ``MPI_Allreduce``: ``comm.Allreduce(MPI.IN_PLACE, buf)`` of a NumPy array (mpi4py), the
  reference of the ratios;
* ``mpistrat.all_reduce``: ``mpistrat.all_reduce(buf, "sum", SPEC, comm, inplace=True)``
  of a NumPy array (the public call, its agreement included);
* ``dist.all_reduce (mpistrat)``: ``dist.all_reduce(tensor, group=group)`` on a group of
  the ``"mpistrat"`` backend (``dist.new_group(backend="mpistrat")``), the tensor a
  ``torch.from_numpy`` view made once;
* ``dist.all_reduce (gloo)``: ``dist.all_reduce(tensor)`` on torch's default group, gloo
  (meeting through :class:`mpistrat.torch.store.MPIStore`, no TCP port of its own).

The backend and ``mpistrat.all_reduce`` use the same spec: ``--spec``, else
``MPISTRAT_TORCH_SPEC``, else the backend's default (``shm`` on one node, ``shm/rechd``
across nodes); the script sets ``MPISTRAT_TORCH_SPEC`` to it before the group is made.

Every call is timed alone: a barrier, then the call, on every rank; a call's time is its
slowest rank's. Each iteration runs every variant once, in an order that rotates (round
robin), so a burst of load hits every variant alike; each row is the median over
``--iters`` calls (default by size, from 1000 at 4 KiB and below to 20 at 64 MiB) after
``--warmup`` untimed rounds, with the 10th and 90th percentiles, its ratio to
``MPI_Allreduce``'s median and its bus bandwidth, busbw = 2(n-1)/n x bytes / time
(nccl-tests' definition). The timed buffers hold zeros (sums of zeros stay zeros); one
call of every variant on rank-dependent values is checked against the exact sum first.
PyTorch runs one thread per rank unless ``OMP_NUM_THREADS`` is set. Rank 0 prints a
Markdown table with the load average, which is worth reading before the numbers;
``--json`` keeps the rows.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

import mpistrat
import mpistrat.torch as mt
from mpistrat.runtime.topology import get_topology
from mpistrat.spec import format_bytes, parse_bytes
from mpistrat.torch.backend import TORCH_SPEC
from mpistrat.torch.store import MPIStore

from _interleave import interleaved  # (benchmarks/: the directory of the script)

REFERENCE = "MPI_Allreduce"


def _groups(comm: Any, gloo: bool) -> Any:
    """Gloo as torch's default group over the ranks of ``comm`` (``COMM_WORLD``), and a
    group of the ``"mpistrat"`` backend over the same ranks (returned); without gloo, the
    default group is the ``"mpistrat"`` one."""
    if not gloo:
        dist.init_process_group(mt.BACKEND_NAME)
        return dist.group.WORLD
    store = MPIStore(comm)  # gloo meets through a store served over MPI: no TCP port
    rank, size = comm.Get_rank(), comm.Get_size()
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
    return dist.new_group(backend=mt.BACKEND_NAME)


def _variants(comm: Any, group: Any, spec: str, count: int, gloo: bool
              ) -> tuple[dict[str, Callable[[], object]], dict[str, np.ndarray]]:
    """The calls to time, by name, and each one's buffer (its own, reduced in place)."""
    buffers = {name: np.zeros(count, np.float32) for name in
               (REFERENCE, "mpistrat.all_reduce", "dist.all_reduce (mpistrat)",
                "dist.all_reduce (gloo)")}
    mpi_buf, engine_buf = buffers[REFERENCE], buffers["mpistrat.all_reduce"]
    on_mpistrat = torch.from_numpy(buffers["dist.all_reduce (mpistrat)"])
    on_gloo = torch.from_numpy(buffers["dist.all_reduce (gloo)"])
    calls: dict[str, Callable[[], object]] = {
        REFERENCE: lambda: comm.Allreduce(MPI.IN_PLACE, mpi_buf),
        "mpistrat.all_reduce": lambda: mpistrat.all_reduce(engine_buf, "sum", spec, comm,
                                                           inplace=True),
        "dist.all_reduce (mpistrat)": lambda: dist.all_reduce(on_mpistrat, group=group),
        "dist.all_reduce (gloo)": lambda: dist.all_reduce(on_gloo),
    }
    if not gloo:
        del calls["dist.all_reduce (gloo)"], buffers["dist.all_reduce (gloo)"]
    return calls, buffers


def _check(comm: Any, calls: dict[str, Callable[[], object]],
           buffers: dict[str, np.ndarray]) -> dict[str, bool]:
    """One call of every variant on rank + 1 (and a ramp), against the exact sum; the
    buffers are zeros again afterwards. True where every rank got the sum."""
    n, rank = comm.Get_size(), comm.Get_rank()
    ramp = np.arange(buffers[REFERENCE].size, dtype=np.float32) % 251
    expected = ramp * n + n * (n + 1) / 2
    ok = {}
    for name, call in calls.items():
        buf = buffers[name]
        buf[...] = ramp + (rank + 1)
        call()
        ok[name] = bool(comm.allreduce(bool(np.array_equal(buf, expected)), op=MPI.LAND))
        buf[...] = 0
    return ok


def _default_iters(nbytes: int) -> int:
    return min(1000, max(20, (256 << 20) // max(nbytes, 1)))


def measure(comm: Any, group: Any, spec: str, nbytes: int, iters: int | None,
            warmup: int | None, gloo: bool = True) -> list[dict[str, Any]]:
    """The rows of one size (collective)."""
    count = max(1, nbytes // 4)
    calls, buffers = _variants(comm, group, spec, count, gloo)
    ok = _check(comm, calls, buffers)
    iters = iters or _default_iters(count * 4)
    warmup = warmup if warmup is not None else max(2, iters // 10)
    stats = interleaved(comm, calls, iters, warmup)
    medians = {name: found["median"] for name, found in stats.items()}
    n, size = comm.Get_size(), count * 4
    return [{"bytes": size, "variant": name, "iters": iters, "warmup": warmup,
             "median_us": medians[name] * 1e6,
             "p10_us": stats[name]["p10"] * 1e6, "p90_us": stats[name]["p90"] * 1e6,
             "x_mpi": medians[name] / medians[REFERENCE],
             "busbw_GBps": 2 * (n - 1) / n * size / medians[name] / 1e9,
             "correct": ok[name]}
            for name in calls]


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| size | variant | median (us) | p10 (us) | p90 (us) | x MPI_Allreduce | "
             "busbw (GB/s) | correct |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for row in rows:
        lines.append(f"| {format_bytes(row['bytes'])} | {row['variant']} | "
                     f"{row['median_us']:.1f} | {row['p10_us']:.1f} | {row['p90_us']:.1f} | "
                     f"{row['x_mpi']:.2f} | {row['busbw_GBps']:.3g} | "
                     f"{'yes' if row['correct'] else 'NO'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1K,64K,1M,64M", help="bytes of float32")
    parser.add_argument("--iters", type=int, default=None,
                        help="timed calls per variant and size (default: by size)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed rounds per size (default: a tenth of --iters, >= 2)")
    parser.add_argument("--spec", default=None,
                        help="the spec of the backend and of mpistrat.all_reduce (default: "
                             "MPISTRAT_TORCH_SPEC, else shm on one node, shm/rechd across)")
    parser.add_argument("--no-gloo", action="store_true",
                        help="leave gloo out (its threads disturb the small calls of the "
                             "others on a machine with one core per rank)")
    parser.add_argument("--json")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    nodes = get_topology(comm).num_nodes
    spec = args.spec or os.environ.get(TORCH_SPEC) or ("shm" if nodes == 1 else "shm/rechd")
    os.environ[TORCH_SPEC] = spec  # the backend's group reads it when it is made
    group = _groups(comm, not args.no_gloo)
    rows = []
    for text in args.sizes.split(","):
        rows.extend(measure(comm, group, spec, parse_bytes(text), args.iters, args.warmup,
                            not args.no_gloo))
    if comm.Get_rank() == 0:
        load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
        library = " ".join(MPI.Get_library_version().splitlines()[0].split())
        print(f"# {comm.Get_size()} ranks on {nodes} node(s), float32 sum in place, spec "
              f"{spec}; torch {torch.__version__} ({torch.get_num_threads()} thread(s) per "
              f"rank), mpistrat {mpistrat.__version__}, {library}")
        print("# a barrier before each call, the slowest rank's time, variants round robin; "
              f"load average at the end {load}\n")
        print(table(rows))
        if args.json:
            with open(args.json, "w") as file:
                json.dump({"ranks": comm.Get_size(), "nodes": nodes, "spec": spec,
                           "torch": torch.__version__, "mpistrat": mpistrat.__version__,
                           "rows": rows}, file, indent=1)
    if not args.no_gloo:
        dist.destroy_process_group(group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
