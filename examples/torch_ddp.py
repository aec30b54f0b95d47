"""An ordinary ``torch.distributed`` DDP script — torch's own ``DistributedDataParallel``,
``DistributedSampler`` and ``DataLoader`` — on scikit-learn's bundled digits (8x8 images,
10 classes; no download). The only mpistrat in it is the backend's name.

    mpistrat run -n 2 examples/torch_ddp.py                     # the "mpistrat" backend
    mpiexec -n 4 python examples/torch_ddp.py --epochs 10
    mpistrat run -n 2 examples/torch_ddp.py --backend gloo      # torch's gloo, to compare
    python examples/torch_ddp.py                                # one process

``init_process_group("mpistrat")`` takes the rank and the world size from MPI: no
``MASTER_ADDR``, no store to set up. Under ``mpistrat run`` the torchrun variables
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ...) are set too, so
``--backend gloo`` runs as it would under torchrun. Each rank loads ``batch / world``
samples of each global batch through a ``DistributedSampler``; DDP averages the
gradients, so the global batch and the learning rate are those of one process. Rank 0
prints one line per epoch.
"""

from __future__ import annotations

import argparse
import sys
import time

try:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
except ImportError:
    sys.exit("this example needs PyTorch: pip install 'mpistrat[torch]'")

import mpistrat.torch  # noqa: F401  (registers the "mpistrat" backend)


def datasets(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """Digits scaled to [0, 1] as 1x8x8 images, split 80/20 with a fixed permutation."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        sys.exit("this example reads scikit-learn's bundled digits: "
                 "pip install 'mpistrat[examples]'")
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(x))
    train, test = order[:cut], order[cut:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10),
    )


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="mpistrat", help="torch.distributed backend")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch_size % world:
        sys.exit(f"--batch-size {args.batch_size} does not split over {world} ranks")
    train, test = datasets(args.seed)
    sampler = DistributedSampler(train, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train, batch_size=args.batch_size // world, sampler=sampler,
                        drop_last=True)
    model = DDP(make_model(args.seed))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    x_test, y_test = test.tensors

    accuracy = 0.0
    for epoch in range(args.epochs):
        started = time.perf_counter()
        sampler.set_epoch(epoch)
        totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, examples
        model.train()
        for x, y in loader:
            optimizer.zero_grad()
            logits = model(x)
            loss = loss_fn(logits, y)
            loss.backward()  # DDP averages the gradients over the ranks
            optimizer.step()
            totals += torch.tensor([loss.item() * len(y), (logits.argmax(1) == y).sum().item(),
                                    len(y)], dtype=torch.float64)
        dist.all_reduce(totals)
        model.eval()
        with torch.no_grad():
            accuracy = float((model(x_test).argmax(1) == y_test).float().mean())
        if rank == 0:
            print(f"epoch {epoch + 1:3d}/{args.epochs}  loss {totals[0] / totals[2]:.4f}"
                  f"  train acc {totals[1] / totals[2]:.4f}  test acc {accuracy:.4f}"
                  f"  ({time.perf_counter() - started:.2f} s, {world} ranks, "
                  f"{dist.get_backend()})", flush=True)
    if rank == 0:
        print(f"final test accuracy {accuracy:.4f}", flush=True)
    dist.destroy_process_group()
    return accuracy


if __name__ == "__main__":
    main()
