#!/usr/bin/env python
"""What ``mpistrat run --trace`` costs a training step (docs/trace.md).

    mpiexec -n 2 .venv/bin/python benchmarks/trace_overhead.py [--state digits|resnet50]

The states and steps of ``benchmarks/elastic_snapshot.py`` (digits: ``examples/
digits_mlp.py``'s step on a global batch of 64; resnet50: one batched all-reduce of
ResNet-50's 161 gradients and the SGD update, ``--compute-ms`` adds computation), timed
per step in blocks of consecutive steps, interleaved (round robin, a barrier before each
block, its slowest rank's time; ``benchmarks/_interleave.py``):

* ``off``: no trace (the instrumented code's one branch per event);
* ``on``: every step recorded into ``rank-R.json``; the block ends by handing the rest
  over and waiting for the writer thread to have written it, so that the formatting
  (on the training thread, between steps) and the writes count in full;
* ``outside``: tracing started, these steps outside its window (``--trace-steps``).

Each variant's median and mean block (a block of ``--block 256`` or more holds the
chunks the recorder hands over on its own, every 512 events, and the mean counts them).

Each step is marked with ``mpistrat.trace.step()``, as a plain loop would.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from _interleave import interleaved  # noqa: E402
from elastic_snapshot import compute, digits_state, resnet50_state  # noqa: E402

import mpistrat as ms  # noqa: E402
from mpistrat.runtime import recorder  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state", choices=("digits", "resnet50"), default="digits")
    parser.add_argument("--iters", type=int, default=0, help="default: 60 digits, 12 resnet50")
    parser.add_argument("--compute-ms", type=float, default=0.0)
    parser.add_argument("--block", type=int, default=0,
                        help="steps a block (default: 20 digits, 3 resnet50); 256 or more "
                             "holds the chunks a run hands over on its own")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    strategy = ms.MultiWorkerMirroredStrategy()
    _, update = (digits_state if args.state == "digits" else resnet50_state)(strategy)
    work = compute(args.compute_ms)
    directory = comm.bcast(tempfile.mkdtemp(prefix="trace-bench-") if comm.rank == 0 else None)
    ms.trace.start(directory, "0:")
    recording = recorder.current()
    writer = ms.trace._SESSION[0].writer
    window = (recording.first, recording.stop)
    block = args.block or (20 if args.state == "digits" else 3)

    def steps(mode: str) -> Any:
        def call() -> None:
            if mode == "off":
                recorder.install(None)
            else:
                recording.first, recording.stop = window if mode == "on" else (0, 1)
                recorder.install(recording)
            for _ in range(block):
                ms.trace.step()
                work()
                update()
            if mode == "on":  # the writer's work on these steps counts here, in full
                recording.hand_over()
                writer.flush()
            recorder.install(recording)
        return call

    iters = args.iters or (60 if args.state == "digits" else 12)
    times = interleaved(comm, {m: steps(m) for m in ("off", "on", "outside")}, iters,
                        warmup=2)
    recording.first, recording.stop = window
    path = ms.trace.stop()
    size = comm.gather(os.path.getsize(path) if path else 0)
    if comm.rank == 0:
        base = times["off"]["median"]
        recorded = (iters + 2) * block
        print(f"{args.state}: {comm.Get_size()} ranks, {args.compute_ms:g} ms of computation "
              f"a step, median of {iters} blocks of {block} steps each, interleaved")
        print(f"{'variant':10} {'step ms':>9} {'p10':>8} {'p90':>8} {'x off':>7} "
              f"{'mean ms':>9} {'x off':>7}")
        for name, t in times.items():
            print(f"{name:10} {t['median'] / block * 1e3:9.3f} {t['p10'] / block * 1e3:8.3f} "
                  f"{t['p90'] / block * 1e3:8.3f} {t['median'] / base:7.3f} "
                  f"{t['mean'] / block * 1e3:9.3f} {t['mean'] / times['off']['mean']:7.3f}")
        print(f"trace file of rank 0: {size[0] / 1e3:.0f} kB for {recorded} recorded steps "
              f"({size[0] / recorded / 1e3:.1f} kB a step)")
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
