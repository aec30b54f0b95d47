"""torch's own training machinery over the ``"mpistrat"`` backend of ``torch.distributed``:
``DistributedDataParallel`` (its variants and a comm hook), ``ZeroRedundancyOptimizer``,
FSDP2's ``fully_shard``, ``torch.distributed.checkpoint`` and ``DistributedSampler``.

Every rank trains on its own data (a function of its rank and the step), so every rank
can also train one process's reference model on the concatenation of every rank's
batches: data-parallel training must end with parameters bitwise the same on every
rank (``_checks.finish`` compares their digests) and equal, up to float rounding, to the
reference. The default process group is made once for the module and destroyed at its
end; the collectives themselves are tested in test_torch_backend.py.
"""

from __future__ import annotations

import copy
import math
import shutil
import tempfile
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

import torch.distributed as dist  # noqa: E402
from _checks import digest, finish  # noqa: E402
from _torch_group import default_group  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import mpistrat.torch  # noqa: E402, F401  (registers the backend)

torch.set_num_threads(1)

WORLD = MPI.COMM_WORLD


@pytest.fixture(scope="module")
def pg():
    """The default process group of the module (rank, size and store from MPI)."""
    with default_group() as group:
        yield group


# --- models, data, the reference ------------------------------------------------------------


class MLP(nn.Module):
    """A small MLP; ``unused`` adds a branch that forward never touches."""

    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.hidden = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)
        self.unused = nn.Linear(16, 4) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.inp(x))
        x = torch.relu(self.hidden(x))
        return self.out(x)


def mlp(seed: int = 0, unused: bool = False) -> MLP:
    torch.manual_seed(seed)
    return MLP(unused)


def batch(rank: int, step: int, n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of step ``step``: different on every rank."""
    generator = torch.Generator().manual_seed(7919 * step + rank)
    return torch.randn(n, 8, generator=generator), torch.randn(n, 4, generator=generator)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's batch of step ``step``, concatenated in rank order."""
    xs, ys = zip(*(batch(r, step) for r in range(WORLD.size)))
    return torch.cat(xs), torch.cat(ys)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def reference(model: nn.Module, optimizer_class, steps: int, micro: int = 1,
              **options) -> nn.Module:
    """One process training ``model`` (a copy) on the concatenated batches: the mean loss
    over every rank's samples, ``micro`` batches accumulated per step."""
    model = copy.deepcopy(model)
    optimizer = optimizer_class(model.parameters(), **options)
    for step in range(steps):
        optimizer.zero_grad()
        for m in range(micro):
            loss_of(model, *global_batch(micro * step + m)).backward()
        optimizer.step()
    return model


def check_params(trained, want, problems: list[str], label: str, rtol: float = 1e-5,
                 atol: float = 1e-6) -> list[tuple[str, str]]:
    """Compare named parameters (allclose to the reference); return their digests."""
    digests = []
    want = dict(want)
    for name, p in trained:
        p = p.detach()
        ref = want[name].detach()
        if not torch.allclose(p, ref, rtol=rtol, atol=atol):
            problems.append(f"{label}: {name} differs from one process's training on the "
                            f"concatenated batch by up to {float((p - ref).abs().max()):.3g}")
        digests.append((f"{label}/{name}", digest(p.numpy())))
    return digests


def names(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Named parameters without DDP's ``module.`` prefix."""
    return [(n.removeprefix("module."), p) for n, p in module.named_parameters()]


# --- DistributedDataParallel ---------------------------------------------------------------

VARIANTS = ["plain", "gradient_as_bucket_view", "static_graph", "find_unused_parameters",
            "tiny_buckets", "no_sync", "fp16_compress_hook"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_ddp_training_equals_one_process_on_the_whole_batch(pg, variant, monkeypatch):
    steps, micro = 3, (3 if variant == "no_sync" else 1)
    start = mlp(0, unused=variant == "find_unused_parameters")
    options = {"gradient_as_bucket_view": {"gradient_as_bucket_view": True},
               "static_graph": {"static_graph": True},
               "find_unused_parameters": {"find_unused_parameters": True},
               "tiny_buckets": {"bucket_cap_mb": 0.0002}}.get(variant, {})
    model = DDP(copy.deepcopy(start), **options)
    if variant == "fp16_compress_hook":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
            fp16_compress_hook,
        )

        model.register_comm_hook(None, fp16_compress_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # count the backend's all_reduce calls (DDP's C++ reducer calls it once per bucket)
    calls = []
    real = type(pg).allreduce

    def counted(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(pg), "allreduce", counted)
    for step in range(steps):
        optimizer.zero_grad()
        calls.clear()
        for m in range(micro):
            x, y = batch(WORLD.rank, micro * step + m)
            if m < micro - 1:
                with model.no_sync():
                    loss_of(model, x, y).backward()
            else:
                loss_of(model, x, y).backward()
        optimizer.step()
    want = reference(start, torch.optim.SGD, steps, micro, lr=0.1, momentum=0.9)
    problems: list[str] = []
    # fp16 gradients: within float16's rounding of the float32 reference
    tolerance = {"rtol": 2e-3, "atol": 2e-3} if variant == "fp16_compress_hook" else {}
    digests = check_params(names(model), want.named_parameters(), problems, variant,
                           **tolerance)
    if variant == "find_unused_parameters":
        for (name, p), (_, p0) in zip(model.module.unused.named_parameters(),
                                      start.unused.named_parameters()):
            if not torch.equal(p, p0) or p.grad is not None:
                problems.append(f"the unused branch's {name} changed or has a gradient")
    # the last step's buckets (DDP rebuilds them after the first step): one for the whole
    # model by default, several below a 209-byte cap (each weight is 512 bytes or more)
    if variant == "tiny_buckets" and len(calls) < 2:
        problems.append(f"bucket_cap_mb=0.0002: {len(calls)} all_reduce(s) in a step")
    if variant == "plain" and len(calls) != 1:
        problems.append(f"{len(calls)} all_reduces in a step, expected one bucket")
    finish(WORLD, problems, digests)


# --- ZeroRedundancyOptimizer ----------------------------------------------------------------


def test_zero_redundancy_optimizer_trains_as_adam_and_round_trips_its_state(pg):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    start = mlp(1)
    plain = DDP(copy.deepcopy(start))
    sharded = DDP(copy.deepcopy(start))
    plain_opt = torch.optim.Adam(plain.parameters(), lr=0.01)
    zero_opt = ZeroRedundancyOptimizer(sharded.parameters(), optimizer_class=torch.optim.Adam,
                                       lr=0.01)

    def train(runs, first, steps):
        for step in range(first, first + steps):
            x, y = batch(WORLD.rank, step)
            for model, optimizer in runs:
                optimizer.zero_grad()
                loss_of(model, x, y).backward()
                optimizer.step()

    train([(plain, plain_opt), (sharded, zero_opt)], 0, 3)
    problems: list[str] = []
    digests = check_params(names(sharded), names(plain), problems, "ZeRO vs Adam")
    want = reference(start, torch.optim.Adam, 3, lr=0.01)
    digests += check_params(names(sharded), want.named_parameters(), problems,
                            "ZeRO vs one process", rtol=1e-4, atol=1e-5)
    # the consolidated state is plain Adam's, on the rank it was consolidated to
    root = WORLD.size - 1
    zero_opt.consolidate_state_dict(to=root)
    state = zero_opt.state_dict() if WORLD.rank == root else None
    if WORLD.rank == root:
        want_state = plain_opt.state_dict()["state"]
        if sorted(state["state"]) != sorted(want_state):
            problems.append(f"consolidated state of parameters {sorted(state['state'])}, "
                            f"expected {sorted(want_state)}")
        for i, entry in want_state.items():
            for key in ("step", "exp_avg", "exp_avg_sq"):
                got = state["state"].get(i, {}).get(key)
                if got is None or not torch.allclose(torch.as_tensor(got),
                                                     torch.as_tensor(entry[key]),
                                                     rtol=1e-5, atol=1e-7):
                    problems.append(f"consolidated {key} of parameter {i} differs from "
                                    f"Adam's")
    else:
        try:  # only the rank it was consolidated to has it
            zero_opt.state_dict()
            problems.append(f"rank {WORLD.rank} has a state_dict consolidated to {root}")
        except RuntimeError:
            pass
    # a fresh ZeRO on a copy of the model loads that state (sent to every rank) and goes
    # on exactly as the one it came from
    box = [copy.deepcopy(state)]
    dist.broadcast_object_list(box, src=root)
    resumed_module = mlp(9)
    resumed_module.load_state_dict(sharded.module.state_dict())
    resumed = DDP(resumed_module)
    resumed_opt = ZeroRedundancyOptimizer(resumed.parameters(),
                                          optimizer_class=torch.optim.Adam, lr=0.5)
    resumed_opt.load_state_dict(box[0])
    if resumed_opt.param_groups[0]["lr"] != 0.01:
        problems.append(f"the loaded lr is {resumed_opt.param_groups[0]['lr']}")
    train([(sharded, zero_opt), (resumed, resumed_opt)], 3, 2)
    for (name, a), (_, b) in zip(names(sharded), names(resumed)):
        if not torch.equal(a, b):
            problems.append(f"after loading the state, {name} differs from the original run "
                            f"by {float((a - b).abs().max()):.3g}")
    finish(WORLD, problems, digests)


# --- FSDP2 ------------------------------------------------------------------------------------


def _fsdp_model(seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD.size,))
    model = mlp(seed)
    for layer in (model.inp, model.hidden, model.out):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The full parameters of an FSDP model (an all-gather of each one's shards)."""
    return [(n, p.full_tensor() if hasattr(p, "full_tensor") else p)
            for n, p in model.named_parameters()]


def test_fsdp2_fully_shard_trains_as_ddp(pg):
    fsdp = _fsdp_model(2)
    ddp = DDP(mlp(2))
    problems: list[str] = []
    local = [p.to_local().numel() for p in fsdp.parameters()]
    full = [p.numel() for p in ddp.parameters()]
    if WORLD.size > 1 and sum(local) >= sum(full):
        problems.append(f"rank {WORLD.rank} holds {sum(local)} of the {sum(full)} "
                        f"parameters: not sharded")
    runs = [(fsdp, torch.optim.SGD(fsdp.parameters(), lr=0.1, momentum=0.9)),
            (ddp, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9))]
    for step in range(3):
        x, y = batch(WORLD.rank, step)
        for model, optimizer in runs:
            optimizer.zero_grad()
            loss_of(model, x, y).backward()
            optimizer.step()
    digests = check_params(_full(fsdp), names(ddp), problems, "FSDP2 vs DDP")
    finish(WORLD, problems, digests)


# --- torch.distributed.checkpoint -------------------------------------------------------------


class _SharedDir:
    """A temporary directory made by rank 0, its path broadcast; removed at the end."""

    def __enter__(self) -> str:
        box = [tempfile.mkdtemp(prefix="mpistrat-dcp-") if WORLD.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        self.path = box[0]
        return self.path

    def __exit__(self, *exc) -> None:
        WORLD.Barrier()
        if WORLD.rank == 0:
            shutil.rmtree(self.path, ignore_errors=True)


def test_checkpoint_of_a_ddp_model_round_trips(pg):
    import torch.distributed.checkpoint as dcp

    model = DDP(mlp(3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        optimizer.zero_grad()
        loss_of(model, *batch(WORLD.rank, step)).backward()
        optimizer.step()
    problems: list[str] = []
    with _SharedDir() as path, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict()}, checkpoint_id=path)
        fresh = DDP(mlp(4))  # other values
        state = {"model": fresh.state_dict()}
        dcp.load(state, checkpoint_id=path)
        fresh.load_state_dict(state["model"])
    for (name, a), (_, b) in zip(names(model), names(fresh)):
        if not torch.equal(a, b):
            problems.append(f"{name} did not come back from the checkpoint")
    finish(WORLD, problems, [(n, digest(p.detach().numpy())) for n, p in names(fresh)])


def test_checkpoint_of_an_fsdp_model_round_trips(pg):
    """Saved sharded, loaded into another sharded model and into a plain one (every
    rank the whole tensors): the same values as the saved model's full parameters."""
    import torch.distributed.checkpoint as dcp

    model = _fsdp_model(5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.zero_grad()
    loss_of(model, *batch(WORLD.rank, 0)).backward()
    optimizer.step()
    saved = _full(model)
    problems: list[str] = []
    with _SharedDir() as path, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(model.state_dict(), checkpoint_id=path)
        sharded = _fsdp_model(6)
        state = sharded.state_dict()
        dcp.load(state, checkpoint_id=path)
        sharded.load_state_dict(state)
        plain = mlp(7)
        state = plain.state_dict()
        dcp.load(state, checkpoint_id=path)
        plain.load_state_dict(state)
    for label, loaded in (("sharded", _full(sharded)), ("plain", names(plain))):
        for (name, a), (_, b) in zip(saved, loaded):
            if not torch.equal(a, b.detach()):
                problems.append(f"{label}: {name} did not come back from the checkpoint")
    finish(WORLD, problems, [(n, digest(p.detach().numpy())) for n, p in saved])


# --- DistributedSampler -----------------------------------------------------------------------


@pytest.mark.parametrize("extra", [0, 1], ids=["divisible", "padded"])
def test_distributed_sampler_partitions_the_dataset(pg, extra):
    """Each rank gets its share (its rank and the group's size from the process group);
    together the shares cover the dataset, disjoint when it divides evenly; set_epoch
    reshuffles alike on every rank."""
    from torch.utils.data import DistributedSampler

    size = WORLD.size
    n = 5 * size + extra
    dataset = list(range(n))
    problems: list[str] = []
    orders = []
    for epoch in (0, 1):
        sampler = DistributedSampler(dataset, shuffle=True, seed=11)
        sampler.set_epoch(epoch)
        mine = list(sampler)
        shares = [None] * size
        dist.all_gather_object(shares, mine)
        share = math.ceil(n / size)
        if any(len(s) != share for s in shares):
            problems.append(f"epoch {epoch}: shares of {[len(s) for s in shares]}, "
                            f"expected {share} each")
        everything = [i for s in shares for i in s]
        if set(everything) != set(dataset):
            problems.append(f"epoch {epoch}: the shares miss "
                            f"{sorted(set(dataset) - set(everything))}")
        if extra == 0 and sorted(everything) != dataset:
            problems.append(f"epoch {epoch}: the shares overlap")
        # the same as a sampler told this rank and size explicitly
        told = list(DistributedSampler(dataset, num_replicas=size, rank=WORLD.rank,
                                       shuffle=True, seed=11).__iter__()) \
            if epoch == 0 else None
        if told is not None and told != mine:
            problems.append("the sampler's rank or size is not the process group's")
        orders.append(everything)
    if n > 2 and orders[0] == orders[1]:
        problems.append("set_epoch did not reshuffle")
    finish(WORLD, problems, [("orders", digest(torch.tensor(orders).numpy()))])
