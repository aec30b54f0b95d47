"""Elastic data-parallel training of a PyTorch MLP: a lost rank costs one step.

    mpistrat run -n 4 --min-ranks 2 --timeout 20 examples/torch_elastic.py \\
        --checkpoint-dir /tmp/ckpt [--optimizer sgd|zero] [--epochs 3] [--workers N] \\
        [--hidden 16]

The loop is an ordinary torch loop over a ``DataLoader``; three things make it elastic:

* ``mpistrat.torch.DistributedBatchSampler`` cuts each epoch (its order fixed by the seed
  and the epoch) into the same global batches at any number of ranks, hands this rank its
  share, and marks a step boundary before each batch (``mpistrat.torch.DataLoader``, which
  is torch's, tells it how far ``--workers`` worker processes load ahead of the loop, so
  the boundary still falls where the loop takes its batch);
* a ``CheckpointManager`` over ``Checkpoint(model=net, optimizer=opt, epoch=...,
  rng=global_generators())``: in an elastic job it snapshots the model, the optimizer
  and the random generators (torch's, NumPy's, ``random``'s) into each host's RAM at every
  boundary, and after a relaunch ``restore_or_initialize()`` restores the newest snapshot
  and the sampler's position, so the relaunch, on the ranks left, takes up the global
  batch that was in progress;
* the loss is summed over the rank's samples and scaled by ``sampler.loss_scale``, so the
  gradient is the global batch's mean however the batch is shared out.

The model holds ``seen``, a per-sample counter each step adds the (all-reduced) ids of its
global batch to: after the run every sample has been applied exactly ``epochs`` times,
whatever was lost and redone. Rank 0 writes the final weights and ``seen`` to ``--out``.

``--kill-step K`` (tests): in the first launch the last rank kills itself (SIGKILL) in
global step K, after its forward pass. ``--reference``: train in this one process on the
same global batches (no MPI job, nothing elastic), for comparison.
"""

from __future__ import annotations

import argparse
import os
import signal

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

import mpistrat as ms
import mpistrat.torch as mt

SAMPLES, FEATURES, CLASSES, GLOBAL_BATCH = 96, 8, 3, 10


def dataset() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=generator)).argmax(dim=1)
    return torch.utils.data.TensorDataset(x, y, torch.arange(SAMPLES))


def model(hidden: int = 16) -> nn.Module:
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(FEATURES, hidden), nn.Tanh(), nn.Linear(hidden, CLASSES))
    # how many times each sample was trained on: part of the state, so restored with it
    net.register_buffer("seen", torch.zeros(SAMPLES, dtype=torch.float64))
    return net


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--optimizer", choices=["sgd", "zero"], default="sgd")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--kill-step", type=int, default=-1)
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    parser.add_argument("--hidden", type=int, default=16,
                        help="the hidden layer's width (100000: a 4.6 MiB model, whose "
                             "snapshots the ranks of a host copy side by side)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    comm = MPI.COMM_SELF if args.reference else MPI.COMM_WORLD
    launch = ms.elastic.info()
    restart = launch.restart if launch is not None else 0

    net = model(args.hidden)
    ddp = mt.DistributedDataParallel(net, comm=comm)
    if args.optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    else:
        opt = mt.ZeroRedundancyOptimizer(net.parameters(), torch.optim.Adam, comm=comm,
                                         lr=0.01)
    data = dataset()
    sampler = mt.DistributedBatchSampler(len(data), GLOBAL_BATCH, shuffle=True, seed=0,
                                         comm=comm)
    loader = mt.DataLoader(data, batch_sampler=sampler, num_workers=args.workers)
    epoch_var = ms.checkpoint.Scalar(0)
    first_step = 0
    if not args.reference:
        manager = ms.CheckpointManager(
            ms.Checkpoint(comm=comm, model=net, optimizer=opt, epoch=epoch_var,
                          rng=ms.checkpoint.global_generators()),
            args.checkpoint_dir or "/tmp/mpistrat-torch-elastic", max_to_keep=2)
        restored = manager.restore_or_initialize()
        snapshot = manager.restored_snapshot
        position = snapshot.position if snapshot is not None else None
        first_step = int(epoch_var) * len(sampler) + (position[1] if position else 0)
        if comm.rank == 0:
            print(f"@@ launch {restart} on {comm.size} ranks: restored "
                  f"{'snapshot' if snapshot is not None else restored} at step "
                  f"{first_step}", flush=True)

    step = first_step
    for epoch in range(int(epoch_var), args.epochs):
        sampler.set_epoch(epoch)
        for x, y, ids in loader:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(ddp(x), y, reduction="sum") * \
                sampler.loss_scale
            if step == args.kill_step and restart == 0 and comm.rank == comm.size - 1 \
                    and not args.reference:
                os.kill(os.getpid(), signal.SIGKILL)
            loss.backward()
            opt.step()
            counts = np.zeros(SAMPLES)
            np.add.at(counts, ids.numpy(), 1.0)
            comm.Allreduce(MPI.IN_PLACE, counts, op=MPI.SUM)
            with torch.no_grad():
                net.seen += torch.from_numpy(counts)
            step += 1
        epoch_var.assign(epoch + 1)
        if not args.reference:
            manager.save()
    if comm.rank == 0:
        print(f"@@ done on {comm.size} ranks after step {step}", flush=True)
        if args.out:
            np.savez(args.out, **{k: v.numpy() for k, v in net.state_dict().items()})


if __name__ == "__main__":
    main()
