"""Run a ``--batch`` benchmark: validate on every rank, time every method, report on rank 0.

Timing follows the sweep (:mod:`.timing`): one checked call of every method, warm-up
rounds, then timed rounds in which every method runs once with a rotating start; an
iteration's time is its slowest rank's, reported as median with min and max. With
``--compare torch`` the torch.distributed rows (gloo, and the "mpistrat" backend) take part
in the same rounds.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any, TextIO

import numpy as np

from ..launch.hugepages import describe_heap
from ..layout import Layout, check_spec
from ..runtime._mpi import Comm, mpi, world
from ..runtime.topology import get_topology
from ..spec import format_bytes
from . import files
from .batch import BatchBench, batch_table, build_methods
from .config import BatchConfig
from .metadata import collect
from .progress import Progress
from .recommend import resolve_spec
from .results import Point
from .runner import (
    Outputs,
    abort_on_error,
    close_peers,
    collective_check,
    command_line,
    join_torch,
)

__all__ = ["run_batch"]


def _validate(config: BatchConfig, comm: Comm, outputs: Outputs) -> Any:
    if outputs.plot or outputs.recommend or outputs.save or outputs.model \
            or outputs.predict_ranks:
        raise ValueError("--plot, --recommend, --save, --model and --predict-ranks work on "
                         "size sweeps; leave them out with --batch")
    spec = resolve_spec(config.spec)
    layout = Layout.of(get_topology(comm), config.local_replicas)
    for finding in check_spec(spec, layout):
        if finding.level == "error":
            raise ValueError(f"--spec {config.spec!r}: {finding.message}")
    return spec


def run_batch(config: BatchConfig, outputs: Outputs | None = None, comm: Comm | None = None,
              out: TextIO | None = None, mpi_env: Mapping[str, str] | None = None
              ) -> dict[str, Any] | None:
    """Time the batch's methods (collective over ``comm``, default a duplicate of
    ``COMM_WORLD``).

    Returns:
        On rank 0: ``{"meta", "points", "methods", "inputs_modified"}``; None elsewhere.

    Raises:
        ValueError, MpistratError, RuntimeError: invalid options, on every rank alike.
    """
    outputs = outputs or Outputs()
    out = out or sys.stdout
    MPI = mpi()
    comm = (world() if comm is None else comm).Dup()
    try:
        spec = collective_check(comm, lambda: _validate(config, comm, outputs))
        rank, size, G = comm.Get_rank(), comm.Get_size(), config.local_replicas
        notes: list[str] = []
        peers = join_torch(comm, config.np_dtype, notes) if config.compare else []
        if peers and not peers[0].coalesced:
            notes.append("torch.distributed.all_reduce_coalesced is missing on some rank; "
                         "its rows are left out")
        with abort_on_error(comm):
            methods = build_methods(config, spec, comm, peers)
            dtype = config.np_dtype
            total = sum(int(np.prod(s, dtype=np.int64)) for s in config.shapes)
            options = asdict(config)
            options.update({"shapes": [list(s) for s in config.shapes], "spec": str(spec),
                            "dtype": str(dtype), "op": "sum", "replicas_per_rank": G,
                            "tensors": len(config.shapes), "elements": total})
            meta = collect(comm, options, mpi_env=mpi_env, notes=notes)
            if rank == 0:
                print(f"# mpistrat bench --batch {config.name}: {len(config.shapes)} {dtype} "
                      f"tensors, {total:,} elements ({format_bytes(total * dtype.itemsize)}); "
                      f"{size} rank(s) x {G} replica(s) on {', '.join(meta['hosts'])}; "
                      f"{meta['mpi_library']}", file=out)
                print(f"# spec {spec}; {config.iters} rounds after {config.warmup} warm-up; "
                      f"check {'every iteration' if config.check_every else 'one call'}",
                      file=out)
                print(f"# memory: {describe_heap(meta['glibc_tunables'], meta['thp_mode'])}",
                      file=out)
                for m in methods:
                    print(f"#   {m.label}: {m.plan}", file=out)
                for note in notes:
                    print(f"# {note}", file=out)
                out.flush()
            started = time.perf_counter()
            bench = BatchBench(comm, config, spec, methods)
            E = len(methods)
            checks = [[w] for w in bench.check_all()]
            wrong: Any  # one call's wrong count in the loop, then all: (checks, methods)
            times = np.zeros((config.iters, E), dtype=np.float64)
            progress = Progress(config.warmup + config.iters, rank == 0 and not config.quiet,
                                unit="round")
            gc.collect()
            gc.disable()
            try:
                for r in range(config.warmup + config.iters):
                    for e in range(E):
                        k = (e + r) % E
                        t, wrong = bench.timed(k, r, config.check_every)
                        if config.check_every:
                            checks[k].append(wrong)
                        if r >= config.warmup:
                            times[r - config.warmup, k] = t
                    progress.step("warm-up" if r < config.warmup else "round")
            finally:
                gc.enable()
                progress.close()
            modified = bench.inputs_modified()
            local_median = np.median(times, axis=0)
            comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
            medians = comm.gather(local_median, root=0) or []  # (rank 0 gets every rank's)
            wrong = np.array(checks, dtype=np.int64).T.copy()
            comm.Allreduce(MPI.IN_PLACE, wrong, op=MPI.SUM)
            modified = comm.allreduce(modified)
            del bench
            close_peers(peers)
    finally:
        comm.Free()
    if rank != 0:
        return None
    # every collective is done: reporting is rank 0's alone
    points = [Point(
        nbytes=total * dtype.itemsize, count=total, dtype=str(dtype), op="sum",
        label=m.label, kind=f"batch-{m.kind}", alg=None, shards=1,
        participants=size * G, samples=tuple(float(t) for t in times[:, e]),
        warmup=config.warmup, wrong=int(wrong[:, e].max()), checked=int(wrong.shape[0]),
        wrong_iterations=int(np.count_nonzero(wrong[:, e])),
        per_rank_median=tuple(float(md[e]) for md in medians))
        for e, m in enumerate(methods)]
    meta["seconds"] = time.perf_counter() - started
    _report(config, spec, meta, points, methods, modified, outputs, out)
    return {"meta": meta, "points": points, "methods": methods, "inputs_modified": modified}


def _report(config: BatchConfig, spec: Any, meta: dict[str, Any], points: list[Point],
            methods: list[Any], modified: int, outputs: Outputs, out: TextIO) -> None:
    size, G = meta["ranks"], config.local_replicas
    print(batch_table(points, methods), file=out)
    total_wrong = sum(p.wrong for p in points)
    print(f"# #wrong total : {total_wrong} "
          + ("OK" if not total_wrong else "WRONG RESULTS (see the #wrong column)"), file=out)
    if modified:
        print(f"# WARNING: batch_reduce modified {modified} input elements", file=out)
    print(f"# took {meta['seconds']:.1f} s", file=out, flush=True)
    extra = {"methods": [m.as_dict() for m in methods], "inputs_modified": modified}
    if outputs.json:
        files.write_json(outputs.json, meta, points, complete=True, extra=extra)
    if outputs.csv:
        files.write_csv(outputs.csv, meta, points)
    if outputs.markdown:
        files.write_text(outputs.markdown, "\n".join([
            f"### mpistrat bench --batch {config.name}: {size} rank(s) x {G} "
            f"replica(s), spec `{spec}`", "",
            f"- {meta['mpi_library']}; mpistrat {meta['mpistrat']}; {meta['date']}",
            f"- command: `{command_line(meta)}`", "",
            batch_table(points, methods, markdown=True), "",
            *[f"- {m.label}: {m.plan}" for m in methods], ""]))
