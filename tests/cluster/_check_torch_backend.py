"""torch.distributed's collectives over the "mpistrat" backend across the hosts of the
cluster, in one MPI job (run by tests/cluster/test_torch_backend.py under ``mpiexec``).

``init_process_group("mpistrat")`` with nothing else (no MASTER_ADDR: rank, size and store
from MPI); then every collective against a reference computed from every rank's known
input, a subgroup of one rank per host, and torch's DDP trained for a few steps (the
parameters must be the same bits on every rank). A rank never stops in the middle: it
records what was wrong and goes on. Rank 0 prints ``RESULT {json}`` with the ranks'
hosts and the problems (``[]`` when all is well).
"""

from __future__ import annotations

import json
import os
import socket
import sys

import torch
import torch.distributed as dist
from mpi4py import MPI

import mpistrat.torch  # noqa: F401  (registers the backend)

torch.set_num_threads(1)
os.environ.pop("MASTER_ADDR", None)
dist.init_process_group("mpistrat")
rank, size = dist.get_rank(), dist.get_world_size()
problems: list[str] = []


def check(label: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    if got.dtype != expected.dtype or not torch.equal(got, expected):
        problems.append(f"rank {rank}: {label}: got {got.flatten()[:6].tolist()}..., "
                        f"expected {expected.flatten()[:6].tolist()}...")


def value(r: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank r's input: small integers, exact in every dtype."""
    return ((torch.arange(n) + 3 * r) % 7 - 3).to(dtype)


for n in (1, 257, 1 << 20):  # the engine's small path, and the hierarchical large one
    for dtype in (torch.float32, torch.float64, torch.int32, torch.bfloat16):
        t = value(rank, n, dtype)
        dist.all_reduce(t)
        check(f"all_reduce sum {n} {dtype}", t,
              sum(value(r, n, torch.float64) for r in range(size)).to(dtype))
    t = value(rank, n, torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    check(f"all_reduce max {n}", t, torch.stack([value(r, n, torch.int64)
                                                 for r in range(size)]).amax(0))

for root in range(size):
    t = value(rank, 1000, torch.float32) if rank == root else torch.zeros(1000)
    dist.broadcast(t, root)
    check(f"broadcast from {root}", t, value(root, 1000, torch.float32))

outs = [torch.zeros(100) for _ in range(size)]
dist.all_gather(outs, value(rank, 100, torch.float32))
check("all_gather", torch.stack(outs), torch.stack([value(r, 100, torch.float32)
                                                   for r in range(size)]))
out = torch.zeros(1000)
inputs = torch.stack([value(rank + k, 1000, torch.float32) for k in range(size)])
dist.reduce_scatter_tensor(out, inputs.reshape(-1))
check("reduce_scatter_tensor", out, sum(value(r + rank, 1000, torch.float32)
                                        for r in range(size)))
# uneven all_to_all_single: rank r sends r + k + 1 rows to rank k
send = torch.cat([torch.full((rank + k + 1, 3), float(100 * rank + k)) for k in range(size)])
receive = torch.zeros(sum(r + rank + 1 for r in range(size)), 3)
dist.all_to_all_single(receive, send, [r + rank + 1 for r in range(size)],
                       [rank + k + 1 for k in range(size)])
check("all_to_all_single", receive, torch.cat([torch.full((r + rank + 1, 3),
                                                          float(100 * r + rank))
                                               for r in range(size)]))
ring = torch.zeros(5)
requests = [dist.isend(value(rank, 5, torch.float32), (rank + 1) % size),
            dist.irecv(ring, (rank - 1) % size)]
for request in requests:
    request.wait()
check("isend/irecv ring", ring, value((rank - 1) % size, 5, torch.float32))
hosts: list = [None] * size
dist.all_gather_object(hosts, socket.gethostname())

# one rank per host (every second rank), its own communicator
firsts = list(range(0, size, 2))
group = dist.new_group(firsts)
if rank in firsts:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=group)
    check("subgroup all_reduce", t, torch.tensor([float(sum(firsts))]))
dist.barrier()

torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    torch.manual_seed(100 + step * size + rank)
    optimizer.zero_grad()
    model(torch.randn(16, 64)).square().mean().backward()
    optimizer.step()
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
everyone = [torch.zeros_like(flat) for _ in range(size)]
dist.all_gather(everyone, flat)
if not all(torch.equal(everyone[0], other) for other in everyone):
    problems.append(f"rank {rank}: DDP parameters differ between ranks")

all_problems = MPI.COMM_WORLD.gather(problems, root=0)
dist.destroy_process_group()
if rank == 0:
    assert all_problems is not None
    print("RESULT " + json.dumps({"hosts": hosts,
                                  "problems": [p for ps in all_problems for p in ps]}))
sys.stdout.flush()
