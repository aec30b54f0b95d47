"""Data-parallel training of a small PyTorch CNN on scikit-learn's bundled digits (8x8
images, 10 classes; no download), with :mod:`mpistrat.torch`.

    mpistrat run -n 2 examples/digits_torch.py                # 2 ranks
    mpiexec -n 4 mpistrat run examples/digits_torch.py --epochs 10 --zero
    python examples/digits_torch.py                           # one process

Every rank starts from rank 0's model (``DistributedDataParallel`` broadcasts it), takes
its shard of each global batch, and ``loss.backward()`` leaves the gradient averaged over
the ranks in every ``.grad``. The loss of a rank is the mean over its shard, so with
equal shards the averaged gradient is the gradient of the global batch's mean loss: 1, 2
or 4 ranks with the same global batch train the same model (up to float rounding).
``--zero`` steps with ``ZeroRedundancyOptimizer`` instead of ``torch.optim.SGD``: each
rank of a node updates its share of the parameters, which the node's ranks hold in one
shared copy (the same bits). PyTorch uses one thread per rank. Rank 0 prints one line per
epoch.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

try:
    import torch
    from torch import nn
except ImportError:
    sys.exit("this example needs PyTorch: pip install 'mpistrat[torch]'")


def load_data(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Digits scaled to [0, 1] as 1x8x8 images, split 80/20 with a fixed permutation."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        sys.exit("this example reads scikit-learn's bundled digits: "
                 "pip install 'mpistrat[examples]'")
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    cut = int(0.8 * len(x))
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


def make_model(seed: int) -> nn.Module:
    """Two 3x3 convolutions, a 2x2 max-pool and two linear layers (38 k parameters)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10),
    )


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--zero", action="store_true",
                        help="step with mpistrat.torch.ZeroRedundancyOptimizer (the same "
                             "bits; it pays on models much larger than this one)")
    args = parser.parse_args(argv)

    from mpi4py import MPI

    import mpistrat.torch as mt

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if args.batch_size % size:
        sys.exit(f"--batch-size {args.batch_size} does not split evenly over {size} ranks: "
                 f"pass a multiple of {size}")
    x_train, y_train, x_test, y_test = load_data(args.seed)
    # rank 0's initial model reaches every rank (the same seed makes it the same anyway)
    model = mt.DistributedDataParallel(make_model(args.seed), comm=comm)
    if args.zero:  # each rank of a node steps its share of parameters the node holds once
        optimizer = mt.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD,
                                               comm=comm, lr=args.lr, momentum=args.momentum)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    loss_fn = nn.CrossEntropyLoss()
    shard = args.batch_size // size
    x_test_t, y_test_t = torch.from_numpy(x_test), torch.from_numpy(y_test)

    accuracy = 0.0
    for epoch in range(args.epochs):
        started = time.perf_counter()
        order = np.random.default_rng(args.seed * 1000 + epoch).permutation(len(x_train))
        totals = np.zeros(3)  # loss sum, correct, examples over this rank's shards
        model.train()
        # whole global batches only, so every rank runs the same number of steps
        for at in range(0, len(order) - args.batch_size + 1, args.batch_size):
            mine = order[at + rank * shard:at + (rank + 1) * shard]
            x, y = torch.from_numpy(x_train[mine]), torch.from_numpy(y_train[mine])
            optimizer.zero_grad()
            logits = model(x)
            loss = loss_fn(logits, y)
            loss.backward()  # .grad is now the mean over the ranks
            optimizer.step()
            totals += (float(loss.detach()) * len(y), float((logits.argmax(1) == y).sum()), len(y))
        comm.Allreduce(MPI.IN_PLACE, totals, op=MPI.SUM)
        model.eval()
        with torch.no_grad():
            accuracy = float((model(x_test_t).argmax(1) == y_test_t).float().mean())
        if rank == 0:
            print(f"epoch {epoch + 1:3d}/{args.epochs}  loss {totals[0] / totals[2]:.4f}"
                  f"  train acc {totals[1] / totals[2]:.4f}  test acc {accuracy:.4f}"
                  f"  ({time.perf_counter() - started:.2f} s, {size} ranks)", flush=True)
    if rank == 0:
        checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
        print(f"final test accuracy {accuracy:.4f}  parameter sum {checksum:.6f}", flush=True)
    return accuracy


if __name__ == "__main__":
    main()
