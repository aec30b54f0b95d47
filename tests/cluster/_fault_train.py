"""The training loop of tests/cluster/test_faults.py: all-reduces with mpistrat
checkpoints, run under ``mpistrat run`` across the cluster's hosts while a host is killed or
cut off.

    mpistrat run -n 4 tests/cluster/_fault_train.py --checkpoint-dir DIR [--steps N]

Every step all-reduces a gradient whose sum is the same known vector on every rank, adds
it to the weights, and every ``--save-every`` steps the chief writes a checkpoint. The
weights are then exactly ``step`` in every element, so a restored checkpoint that is torn
or mixes two steps shows: the script checks it after restoring and exits with status 3
if it does not hold. Rank 0 prints ``started fresh`` or ``resumed from PATH at step S``,
``saved step S`` after each checkpoint and ``finished at step S``; every rank prints
``rank R host H pid P`` once.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

import numpy as np

import mpistrat as ms
from mpistrat.checkpoint import Checkpoint, CheckpointManager, Scalar


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--steps", type=int, default=1_000_000,
                        help="stop at this step (counted from the start, not the resume)")
    parser.add_argument("--more-steps", type=int, default=None,
                        help="stop this many steps after the restored one instead")
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--size", type=int, default=1 << 16, help="elements per all-reduce")
    parser.add_argument("--spec", default="shm/rechd")
    parser.add_argument("--step-sleep", type=float, default=0.01,
                        help="seconds each step sleeps (keeps the 2-core test machine usable)")
    args = parser.parse_args()

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    weights = np.zeros(args.size, np.float32)
    step = Scalar(0)
    manager = CheckpointManager(Checkpoint(weights=weights, step=step), args.checkpoint_dir,
                                max_to_keep=3)
    restored = manager.restore_or_initialize()
    if not np.array_equal(weights, np.full(args.size, int(step), np.float32)):
        print(f"rank {rank}: checkpoint {restored} is inconsistent: step {int(step)} but "
              f"weights {weights[:4]}...", file=sys.stderr, flush=True)
        return 3
    if rank == 0:
        print(f"resumed from {restored} at step {int(step)}" if restored else "started fresh",
              flush=True)
    print(f"rank {rank} host {socket.gethostname()} pid {os.getpid()}", flush=True)
    last = int(step) + args.more_steps if args.more_steps is not None else args.steps
    grad = np.full(args.size, rank + 1, np.float32)
    expected = np.float32(size * (size + 1) // 2)
    while int(step) < last:
        total = ms.all_reduce(grad, spec=args.spec)
        weights += total / expected  # exactly 1.0 per element and step
        step.assign_add(1)
        if int(step) % args.save_every == 0:
            manager.save()
            if rank == 0:
                print(f"saved step {int(step)}", flush=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)
    if rank == 0:
        print(f"finished at step {int(step)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
