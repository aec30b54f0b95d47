#!/usr/bin/env python
"""Training-step time of PyTorch data-parallel recipes over MPI on the CPU, interleaved.

    mpiexec -n 2 python benchmarks/torch_train.py [--model resnet50,digits] [--rounds 15]
        [--steps N] [--batch N]
        [--variants local,mpi4py,ddp,torch-ddp-mpistrat,mpistrat,mpistrat-zero]
        [--bucket-bytes 8M[,25M...]] [--spec SPEC] [--json FILE]

Variants, each on its own copy of the same model with SGD (momentum 0.9):

* ``local``: no reduction at all, every rank steps alone (what the same computation costs
  with the other ranks busy on the other cores; ``-n 1`` gives one process on its own);
* ``mpi4py``: the hand-written loop, ``comm.Allreduce(MPI.IN_PLACE, p.grad.numpy())`` per
  parameter after backward, then a division by the number of ranks;
* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` over gloo (TCP on 127.0.0.1;
  rank 0 picks a free port and sends it through MPI), ``broadcast_buffers=False`` so it
  moves gradients only, like the others;
* ``torch-ddp-mpistrat``: the same torch DDP over the ``"mpistrat"`` backend of
  ``torch.distributed`` (:mod:`mpistrat.torch.backend`): a group made by
  ``dist.new_group(backend="mpistrat")`` beside gloo's default group, given to DDP as
  ``process_group=`` (torch's buckets, hooks and overlap; each bucket's all-reduce through
  mpistrat's engine); ``torch-ddp-mpistrat@SPEC`` the same over a group made with
  ``MPISTRAT_TORCH_SPEC=SPEC`` (e.g. ``@native``, the MPI library's own all-reduce);
* ``ddp+view``, ``torch-ddp-mpistrat+view`` (also ``...@SPEC+view``): the same with
  ``gradient_as_bucket_view=True``, torch's option that makes each gradient a view of
  its bucket, so DDP copies no bucket back into the gradients after the all-reduce;
* ``mpistrat``: :class:`mpistrat.torch.DistributedDataParallel` (``--spec``, default its
  own choice; one variant per ``--bucket-bytes`` size); ``mpistrat-hooks`` the same with
  every gradient through its hook, also where the model would take the fused pass at
  the end of backward (:data:`mpistrat.torch.FUSED_BYTES`), ``mpistrat-fused`` with the
  fused pass for a model in one bucket of any size, ``mpistrat-zero`` with
  :class:`mpistrat.torch.ZeroRedundancyOptimizer` (each rank of a node steps its share
  of the parameters, which the node's ranks share).

Models: ``resnet50``, ResNet-50's bottleneck network built here (25.6 M parameters in 161
tensors, 1000 classes) on 3x32x32 inputs; ``digits``, the CNN of
``examples/digits_torch.py`` on 1x8x8 inputs; ``mlp-1m``, ``mlp-4m``, ``mlp-16m``,
three-layer perceptrons with about 1, 4 and 16 MiB of gradients. PyTorch runs one
thread per rank.

Each round runs every variant for ``--steps`` steps, in turn; a step is timed from a
barrier to the end of ``optimizer.step()``, and its time is the slowest rank's. The
table gives the median step per variant over all rounds, its ratio to the ``mpi4py``,
``ddp`` and ``ddp+view`` variants, and the communication overhead (median step minus ``local``'s).
Like ``mpistrat run``, the script first restarts itself with malloc on transparent huge
pages and fixed mmap/trim thresholds (``MPISTRAT_MALLOC_HUGEPAGES=0`` leaves malloc as
it is; see mpistrat/launch/hugepages.py).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

import mpistrat.torch as mt
from mpistrat.launch.hugepages import describe_heap, restart_with_hugepages, thp_mode
from mpistrat.spec import parse_bytes

MPI: Any = None  # mpi4py.MPI, imported in main() after the restart onto huge pages

ROOT = Path(__file__).resolve().parents[1]


class Bottleneck(nn.Module):
    """ResNet's bottleneck block: 1x1, 3x3 (carrying the stride), 1x1 expanding 4x, each
    followed by batch norm, and a projection on the shortcut when the shape changes."""

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = 4 * width
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)))
        return torch.relu(self.bn3(self.conv3(y)) + self.shortcut(x))


def resnet50(classes: int = 1000) -> nn.Module:
    """ResNet-50: stem, stages of 3, 4, 6, 3 bottlenecks (widths 64-512), linear head."""
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                               nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            layers.append(Bottleneck(cin, width, stride if i == 0 else 1))
            cin = 4 * width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


def digits_cnn() -> nn.Module:
    spec = importlib.util.spec_from_file_location("digits_torch",
                                                  ROOT / "examples" / "digits_torch.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_model(0)


def mlp(width: int) -> Callable[[], nn.Module]:
    """A three-layer perceptron on ``width`` inputs: width, 2 width, width, 10."""
    return lambda: nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(),
                                 nn.Linear(2 * width, width), nn.ReLU(), nn.Linear(width, 10))


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], int]] = {
    "resnet50": (resnet50, (3, 32, 32), 1000),
    "digits": (digits_cnn, (1, 8, 8), 10),
    # about 1, 4 and 16 MiB of float32 gradients in 6 tensors each
    "mlp-1m": (mlp(256), (256,), 10),
    "mlp-4m": (mlp(512), (512,), 10),
    "mlp-16m": (mlp(1024), (1024,), 10),
}


def _gloo_group(comm: Any) -> None:
    """A gloo process group over the ranks of ``comm`` (TCP on 127.0.0.1), torch's default
    group (made once)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    port = 0
    if comm.Get_rank() == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    port = comm.bcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=comm.Get_rank(), world_size=comm.Get_size())


_MPISTRAT_GROUP: dict[str | None, Any] = {}


def _mpistrat_group(comm: Any, spec: str | None = None) -> Any:
    """A group of the ``"mpistrat"`` backend (registered by ``import mpistrat.torch``) over
    every rank of gloo's default group, which it joins first (made once per ``spec``,
    collectively; ``spec``: the group's ``MPISTRAT_TORCH_SPEC``, None: the environment's)."""
    import torch.distributed as dist

    if spec not in _MPISTRAT_GROUP:
        _gloo_group(comm)
        before = os.environ.get("MPISTRAT_TORCH_SPEC")
        if spec is not None:
            os.environ["MPISTRAT_TORCH_SPEC"] = spec
        try:
            _MPISTRAT_GROUP[spec] = dist.new_group(backend=mt.BACKEND_NAME)
        finally:
            if before is None:
                os.environ.pop("MPISTRAT_TORCH_SPEC", None)
            else:
                os.environ["MPISTRAT_TORCH_SPEC"] = before
    return _MPISTRAT_GROUP[spec]


class Variant:
    """One recipe: its own model copy, optimizer and per-step times."""

    def __init__(self, name: str, model: nn.Module, comm: Any, args: argparse.Namespace,
                 bucket_bytes: int = mt.DEFAULT_BUCKET_BYTES):
        self.name, self.comm = name, comm
        size = comm.Get_size()
        self.params = [p for p in model.parameters() if p.requires_grad]
        recipe, view = name.removesuffix("+view"), name.endswith("+view")
        if recipe == "ddp":
            _gloo_group(comm)
            model = nn.parallel.DistributedDataParallel(model, broadcast_buffers=False,
                                                        gradient_as_bucket_view=view)
        elif recipe.split("@")[0] == "torch-ddp-mpistrat":
            spec = recipe.split("@", 1)[1] if "@" in recipe else None
            model = nn.parallel.DistributedDataParallel(
                model, broadcast_buffers=False, process_group=_mpistrat_group(comm, spec),
                gradient_as_bucket_view=view)
        elif name.startswith("mpistrat"):
            fused = mt.FUSED_BYTES
            if name.startswith("mpistrat-hooks"):  # every model through the hooks
                mt.FUSED_BYTES = 0
            elif name.startswith("mpistrat-fused"):  # a one-bucket model fused at any size
                mt.FUSED_BYTES = bucket_bytes
            try:
                model = mt.DistributedDataParallel(model, comm=comm, spec=args.spec,
                                                   bucket_bytes=bucket_bytes)
            finally:
                mt.FUSED_BYTES = fused
        self.model = model
        if name.startswith("mpistrat-zero"):  # each rank of a node steps its share
            self.optimizer = mt.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD,
                                                        comm=comm, lr=1e-3, momentum=0.9)
        else:
            self.optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        self.reduce = name == "mpi4py" and size > 1
        self.size = size
        self.times: list[float] = []

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.comm.Barrier()
        start = time.perf_counter()
        self.optimizer.zero_grad()
        loss = nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        if self.reduce:
            for p in self.params:
                if p.grad is not None:
                    self.comm.Allreduce(MPI.IN_PLACE, p.grad.numpy(), op=MPI.SUM)
                    p.grad.div_(self.size)
        self.optimizer.step()
        return time.perf_counter() - start


def measure(model_name: str, args: argparse.Namespace, comm: Any) -> dict[str, Any]:
    build, shape, classes = MODELS[model_name]
    torch.manual_seed(0)
    base = build()
    rank = comm.Get_rank()
    generator = torch.Generator().manual_seed(1 + rank)
    x = torch.randn((args.batch, *shape), generator=generator)
    y = torch.randint(0, classes, (args.batch,), generator=generator)
    variants = []
    for name in args.variants:
        if not name.startswith("mpistrat"):
            variants.append(Variant(name, copy.deepcopy(base), comm, args))
            continue
        for text in args.bucket_bytes.split(","):  # one variant per bucket size
            label = name if "," not in args.bucket_bytes else f"{name} {text}"
            variants.append(Variant(label, copy.deepcopy(base), comm, args,
                                    parse_bytes(text)))
    for variant in variants:  # warm-up: allocations, first-touch, buckets
        for _ in range(2):
            variant.step(x, y)
    for _ in range(args.rounds):
        for variant in variants:
            for _ in range(args.steps):
                variant.times.append(variant.step(x, y))
    medians = {}
    for variant in variants:
        slowest = np.array(variant.times)
        comm.Allreduce(MPI.IN_PLACE, slowest, op=MPI.MAX)
        medians[variant.name] = statistics.median(slowest.tolist())
    params = variants[0].params
    return {"model": model_name, "ranks": comm.Get_size(), "batch_per_rank": args.batch,
            "tensors": len(params), "parameters": sum(p.numel() for p in params),
            "steps": args.rounds * args.steps, "median_step_s": medians}


def table(result: dict[str, Any]) -> str:
    med = result["median_step_s"]
    local = med.get("local")
    lines = [(f"{result['model']}: {result['parameters'] / 1e6:.2f} M parameters in "
              f"{result['tensors']} tensors, {result['ranks']} ranks, batch "
              f"{result['batch_per_rank']} per rank, {result['steps']} steps per variant"),
             ("| variant | median step (ms) | vs mpi4py | vs ddp | vs ddp+view "
              "| overhead vs local (ms) |"),
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, value in med.items():
        ratios = [f"{value / med[other]:.2f}" if other in med else "" for other in
                  ("mpi4py", "ddp", "ddp+view")]
        overhead = f"{(value - local) * 1e3:.1f}" if local is not None else ""
        lines.append(f"| {name} | {value * 1e3:.1f} | {' | '.join(ratios)} | {overhead} |")
    if local is not None and "mpi4py" in med and med["mpi4py"] > local:
        for name, value in med.items():
            if name.startswith("mpistrat"):
                lines.append(f"overhead {name} / mpi4py: "
                             f"{(value - local) / (med['mpi4py'] - local):.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50,digits")
    parser.add_argument("--variants",
                        default="local,mpi4py,ddp,torch-ddp-mpistrat,mpistrat,mpistrat-zero")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=0,
                        help="per variant per round (default: 2 for resnet50, 20 for digits)")
    parser.add_argument("--batch", type=int, default=0,
                        help="per rank (default: 4 for resnet50, 32 for digits)")
    parser.add_argument("--bucket-bytes", default=str(mt.DEFAULT_BUCKET_BYTES),
                        help="mpistrat's bucket size; a comma list measures each (8M,25M)")
    parser.add_argument("--spec", default=None)
    parser.add_argument("--json")
    args = parser.parse_args()
    args.variants = args.variants.split(",")
    restart_with_hugepages()  # the heap mpistrat run gives a training script (before MPI)
    global MPI
    from mpi4py import MPI

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    if comm.Get_rank() == 0:
        print(describe_heap(os.environ.get("GLIBC_TUNABLES"), thp_mode()) + "\n")
    if comm.Get_size() == 1:  # (no torch DDP of one process)
        args.variants = [v for v in args.variants
                         if not v.startswith(("ddp", "torch-ddp-mpistrat"))]
    results = []
    explicit_batch, explicit_steps = args.batch, args.steps
    for name in args.model.split(","):
        args.batch = explicit_batch or (4 if name == "resnet50" else 32)
        args.steps = explicit_steps or (2 if name == "resnet50" else 20)
        result = measure(name, args, comm)
        results.append(result)
        if comm.Get_rank() == 0:
            print(table(result) + "\n", flush=True)
    if comm.Get_rank() == 0:
        load = os.getloadavg()
        print(f"load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except ImportError:
        pass


if __name__ == "__main__":
    main()
