"""``mpistrat.torch``: broadcasting a module's state, and ``DistributedDataParallel``'s
gradients — the mean (or sum) of every rank's gradient, bitwise identical on every rank,
with unused and frozen parameters, several dtypes, small buckets and ``no_sync``.

Rank ``r``'s gradients are made rank-dependent by its input; the expected values are the
float64 mean of every rank's local gradients (``comm.allgather``), computed on a copy of
the model by ``torch.autograd.grad``. Tests record problems and assert after one final
``allgather`` of the gradients' sha256, so that one rank's failure never leaves the others
in a collective.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from _checks import digest, finish  # noqa: E402
from torch import nn  # noqa: E402

import mpistrat.torch as mt  # noqa: E402
from mpistrat import CollectiveMismatchError  # noqa: E402

torch.set_num_threads(1)


def small_cnn(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Flatten(), nn.Linear(4 * 6 * 6, 8), nn.ReLU(), nn.Linear(8, 3))


def batch(rank: int, n: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(n, 1, 6, 6, generator=generator),
            torch.randint(0, 3, (n,), generator=generator))


def local_grads(model: nn.Module, loss_of) -> list[np.ndarray | None]:
    """This rank's own gradients (float64), computed on a copy of ``model``."""
    twin = copy.deepcopy(model)
    params = [p for p in twin.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss_of(twin), params, allow_unused=True)
    return [None if g is None else g.double().numpy() for g in grads]


def check_mean(comm, model: nn.Module, mine: list, problems: list[str],
               label: str, op: str = "mean") -> list[tuple[str, str]]:
    """Compare every trainable parameter's .grad with the mean over the ranks' local
    gradients (zeros for a rank without one; None where no rank had one)."""
    everyone = comm.allgather(mine)
    digests = []
    params = [p for p in model.parameters() if p.requires_grad]
    for i, p in enumerate(params):
        theirs = [g[i] for g in everyone]
        if all(g is None for g in theirs):
            if p.grad is not None:
                problems.append(f"{label}: parameter {i} has a gradient, no rank had one")
            digests.append((f"{label}/{i}", "None" if p.grad is None else "grad"))
            continue
        stack = np.stack([np.zeros(p.shape) if g is None else g for g in theirs])
        ref = stack.sum(axis=0) / (comm.size if op == "mean" else 1)
        if p.grad is None:
            problems.append(f"{label}: parameter {i} has no gradient")
            continue
        eps = float(torch.finfo(p.dtype).eps)
        tol = (comm.size + 2) * eps * np.abs(stack).sum(axis=0) + 1e-300
        got = p.grad.double().numpy()
        if got.shape != ref.shape or not np.all(np.abs(got - ref) <= tol):
            problems.append(f"{label}: parameter {i} ({p.dtype}): max error "
                            f"{np.abs(got - ref).max():.3g}")
        if p.grad.dtype != p.dtype:
            problems.append(f"{label}: parameter {i}'s gradient is {p.grad.dtype}")
        digests.append((f"{label}/{i}", digest(p.grad.view(torch.uint8).numpy())))
    return digests


def test_import_mpistrat_leaves_torch_out_and_names_the_extra():
    code = ("import sys, mpistrat; assert 'torch' not in sys.modules, 'torch imported'\n"
            "sys.modules['torch'] = None\n"
            "try:\n    import mpistrat.torch\nexcept ImportError as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "pip install 'mpistrat[torch]'" in done.stdout


def test_broadcast_parameters_copies_params_and_buffers_from_root(comm):
    root = comm.size - 1
    model = small_cnn(seed=comm.rank)
    model.train()
    model(batch(comm.rank)[0])  # rank-dependent BatchNorm running statistics
    mt.broadcast_parameters(model, root=root, comm=comm)
    state = [digest(t.detach().numpy()) for t in model.state_dict().values()]
    expected = small_cnn(seed=root)
    expected(batch(root)[0])
    assert state == [digest(t.detach().numpy()) for t in expected.state_dict().values()]
    assert len(set(map(tuple, comm.allgather(state)))) == 1


def test_broadcast_parameters_takes_a_state_dict_or_tensors(comm):
    tensors = [torch.full((3,), float(comm.rank)), torch.tensor(comm.rank),
               torch.tensor([comm.rank % 2 == 0])]
    mt.broadcast_parameters(tensors, root=0, comm=comm)
    assert [t.tolist() for t in tensors] == [[0.0] * 3, 0, [True]]
    state = {"w": torch.full((2, 2), float(comm.rank), dtype=torch.float64)}
    mt.broadcast_parameters(state, root=0, comm=comm)
    assert state["w"].tolist() == [[0.0, 0.0], [0.0, 0.0]]


def test_broadcast_parameters_mismatch_raises_on_every_rank(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks")
    tensors = [torch.zeros(2 + (comm.rank == comm.size - 1))]
    with pytest.raises(CollectiveMismatchError):
        mt.broadcast_parameters(tensors, comm=comm)
    with pytest.raises(ValueError, match="root must be a rank"):
        mt.broadcast_parameters([torch.zeros(2)], root=comm.size, comm=comm)


def test_broadcast_optimizer_state(comm):
    model = small_cnn(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * (comm.rank + 1), momentum=0.9)
    if comm.rank == 0:
        x, y = batch(0)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    mt.broadcast_optimizer_state(optimizer, root=0, comm=comm)
    state = optimizer.state_dict()
    assert state["param_groups"][0]["lr"] == pytest.approx(0.1)
    buffers = [digest(s["momentum_buffer"].numpy()) for s in state["state"].values()]
    assert len(buffers) == len(list(model.parameters()))
    assert len(set(map(tuple, comm.allgather(buffers)))) == 1


@pytest.mark.parametrize("bucket_bytes", [1, mt.DEFAULT_BUCKET_BYTES])
def test_gradients_are_the_mean_and_identical_on_every_rank(comm, bucket_bytes):
    model = small_cnn(seed=comm.rank)  # DistributedDataParallel broadcasts rank 0's
    ddp = mt.DistributedDataParallel(model, comm=comm, bucket_bytes=bucket_bytes)
    if bucket_bytes == 1:
        assert len(ddp.buckets) == len(list(model.parameters()))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    problems: list[str] = []
    digests = []
    for step in range(3):  # buckets are reused: the second step must not add to the first
        x, y = batch(comm.rank + 7 * step)
        mine = local_grads(model, lambda m: nn.functional.cross_entropy(m(x), y))
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        digests += check_mean(comm, model, mine, problems, f"step {step}")
        optimizer.step()
    finish(comm, problems, digests)


def test_fused_and_per_bucket_passes_give_the_same_bits(comm):
    # one small bucket is filled and reduced at the end of backward in one pass; one
    # bucket per parameter goes through the hooks: the gradients must be the same bits
    models = [small_cnn(seed=0), small_cnn(seed=0)]
    fused = mt.DistributedDataParallel(models[0], comm=comm)
    hooked = mt.DistributedDataParallel(models[1], comm=comm, bucket_bytes=1)
    assert fused._fused and not hooked._fused
    problems: list[str] = []
    for step in range(2):
        x, y = batch(comm.rank + 3 * step)
        for ddp in (fused, hooked):
            ddp.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
        for i, (a, b) in enumerate(zip(models[0].parameters(), models[1].parameters())):
            if not torch.equal(a.grad, b.grad):
                problems.append(f"step {step}: parameter {i} differs between the two passes")
    finish(comm, problems, [])


def test_op_sum_and_zero_grad_without_none(comm):
    model = small_cnn(seed=0)
    ddp = mt.DistributedDataParallel(model, comm=comm, op="sum", spec="rechd")
    problems: list[str] = []
    digests = []
    for step in range(2):
        x, y = batch(comm.rank + step)
        mine = local_grads(model, lambda m: nn.functional.cross_entropy(m(x), y))
        ddp.zero_grad(set_to_none=False)  # .grad stays the bucket slice, zeroed
        nn.functional.cross_entropy(ddp(x), y).backward()
        digests += check_mean(comm, model, mine, problems, f"step {step}", op="sum")
    finish(comm, problems, digests)


class Branches(nn.Module):
    """Rank 0 uses branch ``a`` only; the other ranks use ``a`` and ``b``; ``never`` is
    never used; ``frozen`` does not require grad."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.never = nn.Linear(4, 2), nn.Linear(4, 2), nn.Linear(4, 2)
        self.frozen = nn.Parameter(torch.ones(2), requires_grad=False)

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        out = self.a(x) * self.frozen
        return out if rank == 0 else out + self.b(x)


@pytest.mark.parametrize("bucket_bytes", [32, 1 << 20])
def test_unused_parameters_are_zero_or_none_alike_on_every_rank(comm, bucket_bytes):
    model = Branches()
    ddp = mt.DistributedDataParallel(model, comm=comm, bucket_bytes=bucket_bytes)
    assert sum(n for _, _, n in ddp.buckets) == 6  # a, b, never: weight and bias each
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(comm.rank))
    problems: list[str] = []
    digests = []
    for step in range(2):
        mine = local_grads(model, lambda m: m(x, comm.rank).square().sum())
        ddp.zero_grad()
        ddp(x, comm.rank).square().sum().backward()
        digests += check_mean(comm, model, mine, problems, f"step {step}")
        if model.frozen.grad is not None or model.never.weight.grad is not None:
            problems.append("a frozen or never used parameter has a gradient")
    finish(comm, problems, digests)


class Mixed(nn.Module):
    """One parameter per dtype; the loss is sum(w * c) with c rank-dependent, so the
    local gradient is exactly c."""

    DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

    def __init__(self) -> None:
        super().__init__()
        self.ws = nn.ParameterList(nn.Parameter(torch.zeros(5 + i, dtype=d))
                                   for i, d in enumerate(self.DTYPES))

    def forward(self, rank: int) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64)
        for i, w in enumerate(self.ws):
            c = (torch.arange(w.numel(), dtype=torch.float64) % 5 + rank + i) / 4
            total = total + (w * c.to(w.dtype)).sum().double()
        return total


def test_several_dtypes_get_a_bucket_each(comm):
    pytest.importorskip("ml_dtypes")
    model = Mixed()
    ddp = mt.DistributedDataParallel(model, comm=comm, bucket_bytes=1 << 20)
    assert sorted(str(d) for d, _, _ in ddp.buckets) == sorted(str(d) for d in Mixed.DTYPES)
    problems: list[str] = []
    mine = local_grads(model, lambda m: m(comm.rank))
    model(comm.rank).backward()
    digests = check_mean(comm, model, mine, problems, "dtypes")
    finish(comm, problems, digests)


def test_no_sync_accumulates_then_reduces_the_sum_of_micro_batches(comm):
    model = small_cnn(seed=0)
    ddp = mt.DistributedDataParallel(model, comm=comm)
    first, second = batch(comm.rank), batch(comm.rank + 50)

    def loss_of(m):
        return sum(nn.functional.cross_entropy(m(x), y) for x, y in (first, second))

    mine = local_grads(model, loss_of)
    with ddp.no_sync():
        nn.functional.cross_entropy(ddp(first[0]), first[1]).backward()
    nn.functional.cross_entropy(ddp(second[0]), second[1]).backward()
    problems: list[str] = []
    digests = check_mean(comm, model, mine, problems, "no_sync")
    finish(comm, problems, digests)


def test_bad_arguments_raise_on_every_rank(comm):
    with pytest.raises(ValueError, match="op must be 'mean' or 'sum'"):
        mt.DistributedDataParallel(small_cnn(0), comm=comm, op="max")
    with pytest.raises(ValueError, match="bucket_bytes must be a positive int"):
        mt.DistributedDataParallel(small_cnn(0), comm=comm, bucket_bytes=0)
    if comm.size > 1:
        layers = 2 if comm.rank == 0 else 3
        with pytest.raises(CollectiveMismatchError):
            mt.DistributedDataParallel(
                nn.Sequential(*[nn.Linear(2, 2) for _ in range(layers)]), comm=comm)
