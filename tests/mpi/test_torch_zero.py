"""``mpistrat.torch.ZeroRedundancyOptimizer``: each rank of a node steps its share of the
parameters, which the node's ranks share. Training with it gives the same bits as the
same optimizer unsharded, on every rank; its consolidated state is an ordinary
optimizer's; schedulers, parameter groups, loading a state and bad arguments.

Every test trains two copies of one model from the same start with
``DistributedDataParallel``: one with ``torch.optim.X`` as usual, one with
``ZeroRedundancyOptimizer(..., optimizer_class=X)``, and compares the parameters'
bytes after each step. Problems are recorded and asserted after one final allgather.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from _checks import digest, finish  # noqa: E402
from torch import nn  # noqa: E402

import mpistrat.torch as mt  # noqa: E402
from mpistrat import CollectiveMismatchError  # noqa: E402

torch.set_num_threads(1)


def model_for(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 6 * 6, 16), nn.ReLU(), nn.Linear(16, 3))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5, 1, 6, 6, generator=generator), torch.randint(0, 3, (5,),
                                                                       generator=generator)


def pair(comm, optimizer_class, groups=None, **options):
    """Two DistributedDataParallel copies of one model: an ordinary optimizer on one,
    the sharded one on the other."""
    plain_model = model_for(0)
    sharded_model = copy.deepcopy(plain_model)
    plain = mt.DistributedDataParallel(plain_model, comm=comm)
    sharded = mt.DistributedDataParallel(sharded_model, comm=comm)
    params_of = groups or (lambda m: m.parameters())
    plain_opt = optimizer_class(params_of(plain_model), **options)
    sharded_opt = mt.ZeroRedundancyOptimizer(params_of(sharded_model), optimizer_class,
                                             comm=comm, **options)
    return (plain, plain_opt), (sharded, sharded_opt)


def train(comm, runs, steps, first_step=0, schedulers=()):
    for step in range(first_step, first_step + steps):
        x, y = batch(comm.rank, step)
        for model, optimizer in runs:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        for scheduler in schedulers:
            scheduler.step()


def compare(runs, problems, label):
    (plain, _), (sharded, _) = runs
    digests = []
    for i, (a, b) in enumerate(zip(plain.parameters(), sharded.parameters())):
        if not torch.equal(a, b):
            problems.append(f"{label}: parameter {i} differs from the unsharded optimizer's "
                            f"by up to {float((a - b).abs().max()):.3g}")
        digests.append((f"{label}/{i}", digest(b.detach().numpy())))
    return digests


@pytest.mark.parametrize("optimizer_class, options", [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.01}),
])
def test_the_same_bits_as_the_optimizer_unsharded(comm, optimizer_class, options):
    runs = pair(comm, optimizer_class, **options)
    problems: list[str] = []
    digests = []
    for round_ in range(3):
        train(comm, runs, 2, first_step=2 * round_)
        digests += compare(runs, problems, f"{optimizer_class.__name__} after {2 * round_ + 2}")
    finish(comm, problems, digests)


def test_parameters_are_one_copy_per_node(comm):
    from mpistrat.runtime.topology import get_topology

    model = model_for(0)
    mt.DistributedDataParallel(model, comm=comm)
    mt.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, comm=comm, lr=0.1)
    node = get_topology(comm).node_comm
    weight = next(model.parameters())
    with torch.no_grad():
        if node.Get_rank() == node.Get_size() - 1:
            weight[0, 0, 0, 0] = 123.0 + comm.rank
    node.Barrier()
    last = node.bcast(comm.rank, root=node.Get_size() - 1)
    seen = float(weight.detach()[0, 0, 0, 0])
    problems = [] if seen == 123.0 + last else \
        [f"rank {comm.rank} sees {seen}, not what its node's last rank stored "
         f"({123.0 + last})"]
    finish(comm, problems, [])


def test_consolidated_state_is_the_unsharded_optimizers(comm):
    runs = pair(comm, torch.optim.SGD, lr=0.1, momentum=0.9)
    train(comm, runs, 3)
    (_, plain_opt), (sharded_model, sharded_opt) = runs
    problems: list[str] = []
    root = comm.size - 1
    with pytest.raises(RuntimeError, match="consolidate_state_dict"):
        sharded_opt.state_dict()
    sharded_opt.consolidate_state_dict(to=root)
    if comm.rank == root:
        got, want = sharded_opt.state_dict(), plain_opt.state_dict()
        if got["param_groups"] != want["param_groups"]:
            problems.append(f"param_groups {got['param_groups']} != {want['param_groups']}")
        if sorted(got["state"]) != sorted(want["state"]):
            problems.append(f"state of parameters {sorted(got['state'])}, expected "
                            f"{sorted(want['state'])}")
        for i, state in want["state"].items():
            if not torch.equal(got["state"].get(i, {}).get("momentum_buffer", torch.empty(0)),
                               state["momentum_buffer"]):
                problems.append(f"momentum of parameter {i} differs")
    else:
        with pytest.raises(RuntimeError, match="consolidate_state_dict"):
            sharded_opt.state_dict()
    train(comm, runs, 1, first_step=3)  # a step makes the gathered state stale
    with pytest.raises(RuntimeError, match="consolidate_state_dict"):
        sharded_opt.state_dict()
    if sharded_opt.state:
        problems.append("the gathered state outlived the next step")
    # a new sharded optimizer loading the plain one's state (a copy, as from a file: a
    # live state_dict's tensors are the optimizer's own) goes on with the same bits
    plain_state = copy.deepcopy(plain_opt.state_dict())
    fresh = mt.ZeroRedundancyOptimizer(sharded_model.parameters(), torch.optim.SGD,
                                       comm=comm, lr=0.5, momentum=0.9)
    fresh.load_state_dict(plain_state)
    runs = [runs[0], (runs[1][0], fresh)]
    train(comm, runs, 2, first_step=4)
    digests = compare(runs, problems, "after loading")
    finish(comm, problems, digests)


def test_a_scheduler_and_parameter_groups(comm):
    def groups(model):
        weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
        biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
        return [{"params": weights, "weight_decay": 0.1}, {"params": biases, "lr": 0.3}]

    runs = pair(comm, torch.optim.SGD, groups=groups, lr=0.1, momentum=0.5)
    schedulers = [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
                  for _, optimizer in runs]
    train(comm, runs, 3, schedulers=schedulers)
    problems: list[str] = []
    digests = compare(runs, problems, "groups and StepLR")
    lrs = [g["lr"] for g in runs[1][1].param_groups]
    if lrs != [g["lr"] for g in runs[0][1].param_groups]:
        problems.append(f"learning rates {lrs}")
    finish(comm, problems, digests)


def test_bad_arguments_raise_on_every_rank(comm):
    model = model_for(0)
    mt.DistributedDataParallel(model, comm=comm)
    with pytest.raises(TypeError, match="optimizer_class must be a torch.optim.Optimizer"):
        mt.ZeroRedundancyOptimizer(model.parameters(), "sgd", comm=comm, lr=0.1)
    with pytest.raises(ValueError, match="empty parameter list"):
        mt.ZeroRedundancyOptimizer([], torch.optim.SGD, comm=comm, lr=0.1)
    with pytest.raises(TypeError, match="not a leaf requiring grad"):
        mt.ZeroRedundancyOptimizer([p * 2 for p in model.parameters()], torch.optim.SGD,
                                   comm=comm, lr=0.1)
    if comm.size > 1:
        with pytest.raises(CollectiveMismatchError):
            mt.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, comm=comm,
                                       lr=0.1 if comm.rank else 0.2)
    optimizer = mt.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, comm=comm,
                                           lr=0.1)
    with pytest.raises(ValueError, match="takes its parameter groups at construction"):
        optimizer.add_param_group({"params": [torch.zeros(1, requires_grad=True)]})
    with pytest.raises(ValueError, match="to must be a rank"):
        optimizer.consolidate_state_dict(to=comm.size)
    if comm.size > 1:
        with pytest.raises(CollectiveMismatchError):
            optimizer.consolidate_state_dict(to=comm.rank)


def test_replaced_storage_raises_on_every_rank_of_the_node(comm):
    from mpistrat.runtime.topology import get_topology

    model = model_for(0)
    ddp = mt.DistributedDataParallel(model, comm=comm)
    optimizer = mt.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, comm=comm,
                                           lr=0.1)
    x, y = batch(comm.rank, 0)
    nn.functional.cross_entropy(ddp(x), y).backward()
    optimizer.step()  # fine
    node = get_topology(comm).node_comm
    if node.Get_rank() == 0:  # as module.to() or .double() would, on one rank only
        first = next(model.parameters())
        first.data = first.data.clone()
    optimizer.zero_grad()
    nn.functional.cross_entropy(ddp(x), y).backward()
    with pytest.raises(Exception) as raised:
        optimizer.step()
    if node.Get_rank() == 0:
        assert "was replaced after the ZeroRedundancyOptimizer was made" in str(raised.value)
    else:
        assert "ZeroRedundancyOptimizer.step" in str(raised.value), str(raised.value)


@pytest.mark.parametrize("ranks_per_node", ["1", "3"])
def test_virtual_nodes_each_hold_and_update_a_copy(world, monkeypatch, ranks_per_node):
    """Nodes of 1 rank (every rank steps everything) and uneven 3 + 1 (on 4 ranks): each
    node updates its copy alike, the same bits as unsharded."""
    from mpistrat.runtime.topology import get_topology

    monkeypatch.setenv("MPISTRAT_RANKS_PER_NODE", ranks_per_node)
    comm = world.Dup()
    try:
        problems: list[str] = []
        expected = min(int(ranks_per_node), comm.size - comm.rank // int(ranks_per_node)
                       * int(ranks_per_node))
        if get_topology(comm).node_comm.Get_size() != expected:
            problems.append(f"node group of {get_topology(comm).node_comm.Get_size()} ranks, "
                            f"expected {expected}")
        runs = pair(comm, torch.optim.SGD, lr=0.1, momentum=0.9)
        train(comm, runs, 3)
        digests = compare(runs, problems, f"nodes of {ranks_per_node}")
        finish(comm, problems, digests)
    finally:
        comm.Free()
