"""The ``"mpistrat"`` backend of ``torch.distributed`` (:mod:`mpistrat.torch.backend`):
every collective against a reference computed locally from every rank's known inputs,
groups, mismatched calls that raise on every rank instead of hanging, and a group's
timeout. Training with torch's own machinery on top (DDP, ZeRO, FSDP2, DCP) is in
test_torch_backend_training.py.

The default process group is made once for the module (``init_process_group`` is
collective) and destroyed at its end. Rank ``r``'s inputs are a function of ``r`` (and
of the test's parameters), so every rank computes every rank's inputs and the exact
expected result. Tests record problems and assert after one final ``allgather``
(``_checks.finish``), which also checks that results meant to be the same everywhere are
bitwise the same on every rank.
"""

from __future__ import annotations

import datetime
import threading
import time
import warnings
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

import torch.distributed as dist  # noqa: E402
from _checks import digest, finish  # noqa: E402
from _torch_group import default_group, init, no_torchrun_env  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpistrat.torch  # noqa: E402, F401  (registers the backend)
from mpistrat import CollectiveMismatchError, CollectiveTimeoutError  # noqa: E402

torch.set_num_threads(1)

R = dist.ReduceOp
WORLD = MPI.COMM_WORLD


@pytest.fixture(scope="module")
def pg():
    """The default process group of the module (rank, size and store from MPI)."""
    with default_group() as group:
        yield group


def agreement_threads() -> int:
    return sum(t.name == "mpistrat-agreement" for t in threading.enumerate())


def idle_agreement_threads() -> int:
    from mpistrat.runtime.agreement import _Blocking
    with _Blocking._lock:
        return len(_Blocking._idle)


def seeded(*key) -> np.random.Generator:
    """A generator that every rank can make for any rank's inputs."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def bits(tensor: torch.Tensor) -> np.ndarray:
    """The bytes of a tensor (for digests), whatever its dtype."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


# --- the forms of init_process_group (first: before the module's group exists) ---------


@pytest.mark.parametrize("form", ["hashstore", "mpi"])
def test_init_process_group_forms(form):
    """Each form makes a default group of MPI's rank and size that reduces; destroyed,
    another can be made."""
    if dist.is_initialized():
        pytest.skip("the module's default group exists (run this test first)")
    with no_torchrun_env():
        init(form)
        try:
            problems = []
            if (dist.get_rank(), dist.get_world_size()) != (WORLD.rank, WORLD.size):
                problems.append(f"rank {dist.get_rank()} of {dist.get_world_size()}, MPI "
                                f"says {WORLD.rank} of {WORLD.size}")
            if dist.get_backend() != "mpistrat":
                problems.append(f"backend {dist.get_backend()!r}")
            t = torch.full((3,), float(WORLD.rank + 1))
            dist.all_reduce(t)
            if not torch.equal(t, torch.full((3,), WORLD.size * (WORLD.size + 1) / 2)):
                problems.append(f"all_reduce gave {t.tolist()}")
        finally:
            dist.destroy_process_group()
    if dist.is_initialized():
        problems.append("the default group outlived destroy_process_group")
    finish(WORLD, problems, [])


def test_init_with_a_rank_other_than_mpis_raises():
    if dist.is_initialized():
        pytest.skip("the module's default group exists (run this test first)")
    if WORLD.size < 2:
        pytest.skip("one rank: every rank is MPI's")
    with no_torchrun_env():
        with pytest.raises(ValueError, match="the torch ranks must be the MPI ranks"):
            dist.init_process_group("mpistrat", store=dist.HashStore(),
                                    rank=(WORLD.rank + 1) % WORLD.size,
                                    world_size=WORLD.size)
        assert not dist.is_initialized()
        # the plain form: the MPI rendezvous refuses it
        with pytest.raises(ValueError, match="the rank and the world size are MPI's"):
            dist.init_process_group("mpistrat", rank=(WORLD.rank + 1) % WORLD.size,
                                    world_size=WORLD.size)
        assert not dist.is_initialized()


# --- all_reduce -----------------------------------------------------------------------

FLOATS = ["float16", "bfloat16", "float32", "float64"]
INTS = ["int8", "int32", "int64", "uint8"]
SIZES = {"1": 1, "1KiB": 1024, "1MiB": 1 << 20}  # bytes (1: one element)
OPS = {"SUM": R.SUM, "AVG": R.AVG, "PRODUCT": R.PRODUCT, "MIN": R.MIN, "MAX": R.MAX,
       "BAND": R.BAND, "BOR": R.BOR, "BXOR": R.BXOR}
# the (dtype, op) pairs the backend defines
DEFINED = ([(d, op) for d in FLOATS for op in ("SUM", "AVG", "PRODUCT", "MIN", "MAX")]
           + [("complex64", op) for op in ("SUM", "AVG", "PRODUCT")]
           + [(d, op) for d in INTS for op in OPS if op != "AVG"]
           + [("bool", op) for op in OPS if op != "AVG"])
# a power of two each: products of any four are exact in every float dtype
_FACTORS = np.array([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0])


def reduce_input(name: str, op: str, n: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s input, chosen so that the reduction over up to four ranks is exact
    in ``name`` (no rounding, no overflow): quarters for sums, powers of two for products,
    any bits for the bitwise ops."""
    gen = seeded("all_reduce", name, op, n, rank)
    if name == "bool":
        return gen.random(n) < 0.5
    if name == "complex64":
        if op == "PRODUCT":  # Gaussian integers, parts in {-1, 0, 1}, never 0
            choices = np.array([1, -1, 1j, -1j, 1 + 1j, 1 - 1j, -1 + 1j])
            return gen.choice(choices, n)
        return (gen.integers(-8, 9, n) + 1j * gen.integers(-8, 9, n)) / 4
    if name in FLOATS:
        if op == "PRODUCT":
            return gen.choice(_FACTORS, n)
        return gen.integers(-8, 9, n) / 4
    info = np.iinfo(name)
    if op in ("BAND", "BOR", "BXOR"):
        return gen.integers(info.min, info.max, n, dtype=name, endpoint=True)
    if op == "PRODUCT":
        low, high = {"int8": (-2, 2), "uint8": (0, 3), "int32": (-20, 20),
                     "int64": (-1000, 1000)}[name]
    else:
        low, high = max(info.min // 8, -(1 << 40)), min(info.max // 8, 1 << 40)
    return gen.integers(low, high, n, endpoint=True).astype(name)


def reduce_reference(stacked: np.ndarray, op: str, size: int) -> np.ndarray:
    """The exact reduction of the ranks' inputs (stacked along axis 0)."""
    if stacked.dtype == np.bool_:
        return {"SUM": np.any, "MAX": np.any, "BOR": np.any, "MIN": np.all,
                "PRODUCT": np.all, "BAND": np.all,
                "BXOR": lambda a, axis: np.logical_xor.reduce(a, axis=axis)}[op](stacked,
                                                                                   axis=0)
    if op in ("BAND", "BOR", "BXOR"):
        return {"BAND": np.bitwise_and, "BOR": np.bitwise_or,
                "BXOR": np.bitwise_xor}[op].reduce(stacked, axis=0)
    wide = stacked.astype(np.complex128 if stacked.dtype.kind == "c" else
                          np.float64 if stacked.dtype.kind == "f" else np.int64)
    if op == "SUM":
        return wide.sum(axis=0)
    if op == "AVG":
        return wide.sum(axis=0) / size
    if op == "PRODUCT":
        return wide.prod(axis=0)
    return wide.min(axis=0) if op == "MIN" else wide.max(axis=0)


def to_tensor(array: np.ndarray, name: str) -> torch.Tensor:
    """A new tensor (never sharing ``array``'s memory) of dtype ``name``."""
    return torch.from_numpy(np.array(array)).to(getattr(torch, name))


def backend_all_reduce(tensor: torch.Tensor, op, group=None) -> None:
    """The backend's own allreduce, below torch's front door (which refuses complex
    PRODUCT and views complex tensors as real ones)."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    (group or dist.group.WORLD).allreduce([tensor], opts).wait()


def compare(got: torch.Tensor, ref: np.ndarray, name: str, op: str, label: str,
            problems: list[str]) -> None:
    """Exact, except AVG: the float64 mean within a few units of ``name``'s last place."""
    want = to_tensor(ref, name)
    if got.dtype != want.dtype or got.shape != want.shape:
        problems.append(f"{label}: got {got.dtype} {tuple(got.shape)}, expected "
                        f"{want.dtype} {tuple(want.shape)}")
        return
    if op == "AVG":
        eps = torch.finfo(torch.float32 if name == "complex64" else want.dtype).eps
        wide = torch.complex128 if name == "complex64" else torch.float64
        error = (got.to(wide) - torch.from_numpy(ref)).abs()
        bad = error > 4 * eps * (torch.from_numpy(np.abs(ref)) + 1)
    else:
        bad = got != want
    if bad.any():
        i = int(torch.nonzero(bad.reshape(-1))[0])
        problems.append(f"{label}: {int(bad.sum())} of {bad.numel()} elements wrong, first "
                        f"at {i}: got {got.reshape(-1)[i].item()!r}, expected "
                        f"{ref.reshape(-1)[i]!r}")


def _reduce_case(name, op, nbytes):
    size = WORLD.size
    itemsize = 1 if name == "bool" else torch.empty(0, dtype=getattr(torch, name)).element_size()
    n = max(1, nbytes // itemsize)
    stacked = np.stack([reduce_input(name, op, n, r) for r in range(size)])
    return to_tensor(stacked[WORLD.rank], name), reduce_reference(stacked, op, size)


@pytest.mark.parametrize("nbytes", list(SIZES.values()), ids=list(SIZES))
@pytest.mark.parametrize("name, op", DEFINED, ids=[f"{d}-{op}" for d, op in DEFINED])
def test_all_reduce(pg, name, op, nbytes):
    tensor, ref = _reduce_case(name, op, nbytes)
    if name == "complex64" and op == "PRODUCT":
        backend_all_reduce(tensor, OPS[op])  # torch's front door refuses it
    else:
        dist.all_reduce(tensor, op=OPS[op])
    problems: list[str] = []
    compare(tensor, ref, name, op, f"{name} {op} of {tensor.numel()}", problems)
    finish(WORLD, problems, [(f"{name}-{op}", digest(bits(tensor)))])


@pytest.mark.parametrize("op", ["SUM", "AVG"])
def test_all_reduce_complex_in_the_backend(pg, op):
    """Complex SUM and AVG reach the backend as complex tensors below torch's front door
    (which views them as real ones)."""
    tensor, ref = _reduce_case("complex64", op, 1024)
    backend_all_reduce(tensor, OPS[op])
    problems: list[str] = []
    compare(tensor, ref, "complex64", op, f"complex64 {op} (backend)", problems)
    finish(WORLD, problems, [("c", digest(bits(tensor)))])


@pytest.mark.parametrize("name, op", [("float32", "SUM"), ("float16", "MAX"),
                                      ("bfloat16", "AVG"), ("int64", "PRODUCT"),
                                      ("uint8", "BXOR"), ("bool", "MIN")])
def test_all_reduce_of_a_transposed_view(pg, name, op):
    """A non-contiguous tensor (a transposed view) is reduced in place: its base gets the
    result at the transposed positions."""
    size = WORLD.size
    stacked = np.stack([reduce_input(name, op, 6 * 5, r).reshape(6, 5) for r in range(size)])
    base = to_tensor(stacked[WORLD.rank], name)
    view = base.t()
    assert not view.is_contiguous()
    dist.all_reduce(view, op=OPS[op])
    problems: list[str] = []
    compare(base, reduce_reference(stacked, op, size), name, op, f"{name} {op} transposed",
            problems)
    finish(WORLD, problems, [("t", digest(bits(base)))])


@pytest.mark.parametrize("name, op", [("float32", "SUM"), ("float64", "PRODUCT"),
                                      ("float32", "AVG")])
def test_all_reduce_of_a_tensor_that_requires_grad(pg, name, op):
    """A leaf that requires grad (as a parameter) is reduced in place and still requires
    grad; its autograd history is untouched."""
    size = WORLD.size
    stacked = np.stack([reduce_input(name, op, 300, r) for r in range(size)])
    leaf = to_tensor(stacked[WORLD.rank], name).requires_grad_()
    dist.all_reduce(leaf, op=OPS[op])
    problems: list[str] = []
    if not leaf.requires_grad or not leaf.is_leaf or leaf.grad_fn is not None:
        problems.append("the tensor lost requires_grad or gained a history")
    compare(leaf.detach(), reduce_reference(stacked, op, size), name, op,
            f"{name} {op} requires_grad", problems)
    finish(WORLD, problems, [("g", digest(bits(leaf)))])


@pytest.mark.parametrize("name, op", [("float32", "SUM"), ("float64", "PRODUCT"),
                                      ("bool", "MIN"), ("bool", "SUM"), ("int64", "BOR"),
                                      ("uint8", "BXOR"), ("bfloat16", "MAX")])
def test_all_reduce_of_a_0_dim_tensor(pg, name, op):
    """A scalar tensor (``torch.tensor(done)``, a loss): every path, the engine's and the
    gathering one (PRODUCT, bitwise, every bool op)."""
    size = WORLD.size
    stacked = np.stack([reduce_input(name, op, 1, r).reshape(()) for r in range(size)])
    scalar = to_tensor(stacked[WORLD.rank], name)
    assert scalar.dim() == 0
    dist.all_reduce(scalar, op=OPS[op])
    problems: list[str] = []
    compare(scalar, reduce_reference(stacked, op, size), name, op, f"0-dim {name} {op}",
            problems)
    finish(WORLD, problems, [("s", digest(bits(scalar)))])


UNDEFINED = ([(d, "AVG") for d in [*INTS, "bool"]]
             + [(d, op) for d in FLOATS for op in ("BAND", "BOR", "BXOR")]
             + [("complex64", op) for op in ("MIN", "MAX", "BAND")])


@pytest.mark.parametrize("name, op", UNDEFINED, ids=[f"{d}-{op}" for d, op in UNDEFINED])
def test_undefined_reductions_raise_on_every_rank(pg, name, op):
    """AVG of integers, bitwise ops of floats, MIN/MAX of complex: the same error on every
    rank (from torch's front door for complex, from the backend otherwise, also below the
    front door), and the group goes on working."""
    tensor = torch.ones(4, dtype=getattr(torch, name))
    errors = []
    for call in (dist.all_reduce, backend_all_reduce):
        try:
            call(tensor, op=OPS[op])
            errors.append("no error")
        except (TypeError, ValueError, RuntimeError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    problems = []
    backend_error = errors[1]
    expected = ("not defined for complex" if op in ("MIN", "MAX") and name == "complex64"
                else "AVG needs a floating-point or complex tensor" if op == "AVG"
                else f"{op} needs an integer or bool tensor")
    if expected not in backend_error or name not in backend_error.replace("torch.", ""):
        problems.append(f"the backend's error: {backend_error}")
    if name == "complex64" and "does not support" not in errors[0]:
        problems.append(f"torch's front door: {errors[0]}")
    everyone = WORLD.allgather(errors)
    if any(e != errors for e in everyone):
        problems.append(f"the ranks' errors differ: {everyone}")
    after = torch.ones(3)
    dist.all_reduce(after)
    if not torch.equal(after, torch.full((3,), float(WORLD.size))):
        problems.append(f"all_reduce after the error: {after.tolist()}")
    finish(WORLD, problems, [])


def test_all_reduce_coalesced(pg):
    size, rank = WORLD.size, WORLD.rank
    shapes = [(3,), (2, 5), (1,), (700,)]
    inputs = [[torch.arange(float(np.prod(s))).reshape(s) * (r + 1) + k for k, s
               in enumerate(shapes)] for r in range(size)]
    tensors = [t.clone() for t in inputs[rank]]
    with warnings.catch_warnings():  # deprecated in torch, still callable
        warnings.simplefilter("ignore")
        dist.all_reduce_coalesced(tensors, op=R.SUM)
    problems = []
    for k, t in enumerate(tensors):
        want = sum(inputs[r][k] for r in range(size))
        if not torch.equal(t, want):
            problems.append(f"tensor {k}: {t.reshape(-1)[:4].tolist()}..., expected "
                            f"{want.reshape(-1)[:4].tolist()}...")
    maxed = [t.clone() for t in inputs[rank]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dist.all_reduce_coalesced(maxed, op=R.MAX)
    for k, t in enumerate(maxed):
        if not torch.equal(t, inputs[size - 1][k]):
            problems.append(f"MAX of tensor {k} is not the last rank's")
    finish(WORLD, problems, [(f"{k}", digest(bits(t))) for k, t in enumerate(tensors)])


# --- data movement ----------------------------------------------------------------------

DTYPES = ["float32", "bfloat16", "int64", "bool"]


def data(rank: int, shape: tuple, name: str = "float32", salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s tensor: distinct per rank, per salt and per element."""
    gen = seeded("data", rank, shape, name, salt)
    if name == "bool":
        return torch.from_numpy(gen.random(shape) < 0.5)
    return to_tensor(gen.integers(-100, 100, shape), name)


@pytest.mark.parametrize("name", DTYPES)
def test_broadcast_from_every_root(pg, name):
    problems = []
    for root in range(WORLD.size):
        t = data(WORLD.rank, (3, 7), name, root)
        dist.broadcast(t, src=root)
        if not torch.equal(t, data(root, (3, 7), name, root)):
            problems.append(f"root {root}: not the root's tensor")
        # into a transposed view: the base gets the root's values, transposed
        base = data(WORLD.rank, (7, 3), name, root + 100)
        dist.broadcast(base.t(), src=root)
        if not torch.equal(base, data(root, (7, 3), name, root + 100)):
            problems.append(f"root {root}: a transposed view did not get the root's tensor")
    finish(WORLD, problems, [])


@pytest.mark.parametrize("name", DTYPES)
def test_all_gather(pg, name):
    size, rank = WORLD.size, WORLD.rank
    outputs = [torch.zeros(2, 9, dtype=getattr(torch, name)) for _ in range(size)]
    dist.all_gather(outputs, data(rank, (2, 9), name))
    problems = [f"slot {r} is not rank {r}'s tensor" for r, t in enumerate(outputs)
                if not torch.equal(t, data(r, (2, 9), name))]
    finish(WORLD, problems, [(str(r), digest(bits(t))) for r, t in enumerate(outputs)])


@pytest.mark.parametrize("name", DTYPES)
def test_all_gather_into_tensor(pg, name):
    size, rank = WORLD.size, WORLD.rank
    want = torch.cat([data(r, (5,), name) for r in range(size)])
    flat = torch.zeros(size * 5, dtype=getattr(torch, name))
    dist.all_gather_into_tensor(flat, data(rank, (5,), name))
    stacked = torch.zeros(size, 5, dtype=getattr(torch, name))
    dist.all_gather_into_tensor(stacked, data(rank, (5,), name))
    # as FSDP does: the input is this rank's slice of the output
    aliased = torch.zeros(size * 5, dtype=getattr(torch, name))
    shard = aliased[rank * 5:(rank + 1) * 5]
    shard.copy_(data(rank, (5,), name))
    dist.all_gather_into_tensor(aliased, shard)
    problems = [f"{label}: {got.reshape(-1).tolist()}, expected {want.tolist()}"
                for label, got in (("flat", flat), ("stacked", stacked),
                                   ("aliased", aliased))
                if not torch.equal(got.reshape(-1), want)]
    finish(WORLD, problems, [("g", digest(bits(flat)))])


@pytest.mark.parametrize("op", ["SUM", "AVG", "MAX"])
def test_reduce_scatter(pg, op):
    size, rank = WORLD.size, WORLD.rank
    # rank r's input for rank j: data(r, (4,), salt=j); sizes differ per destination
    inputs = [[data(r, (j + 1, 3), "float64", j) for j in range(size)] for r in range(size)]
    output = torch.zeros(rank + 1, 3, dtype=torch.float64)
    dist.reduce_scatter(output, [t.clone() for t in inputs[rank]], op=OPS[op])
    stacked = np.stack([inputs[r][rank].numpy() for r in range(size)])
    problems: list[str] = []
    compare(output, reduce_reference(stacked, op, size), "float64", op,
            f"reduce_scatter {op}", problems)
    finish(WORLD, problems, [])


@pytest.mark.parametrize("op", ["SUM", "AVG"])
@pytest.mark.parametrize("aliased", [False, True], ids=["apart", "aliased"])
def test_reduce_scatter_tensor(pg, op, aliased):
    """Also with the output a slice of the input, as FSDP reduce-scatters."""
    size, rank = WORLD.size, WORLD.rank
    n = 6
    inputs = [data(r, (size * n,), "float32") for r in range(size)]
    input = inputs[rank].clone()
    output = input[rank * n:(rank + 1) * n] if aliased else torch.zeros(n)
    dist.reduce_scatter_tensor(output, input, op=OPS[op])
    stacked = np.stack([inputs[r][rank * n:(rank + 1) * n].numpy() for r in range(size)])
    problems: list[str] = []
    compare(output, reduce_reference(stacked, op, size), "float32", op,
            f"reduce_scatter_tensor {op}", problems)
    # a 2-D input of one row per rank into a 1-D output
    rows = torch.stack([inputs[rank][k * n:(k + 1) * n] for k in range(size)])
    out = torch.zeros(n)
    dist.reduce_scatter_tensor(out, rows, op=OPS[op])
    compare(out, reduce_reference(stacked, op, size), "float32", op,
            f"reduce_scatter_tensor {op} of rows", problems)
    finish(WORLD, problems, [])


@pytest.mark.parametrize("op", ["SUM", "MIN", "PRODUCT"])
def test_reduce_to_every_root(pg, op):
    """The root gets the reduction; the other ranks' tensors are left as they were."""
    size, rank = WORLD.size, WORLD.rank
    problems: list[str] = []
    for root in range(size):
        stacked = np.stack([reduce_input("float32", op, 50, r) for r in range(size)])
        mine = to_tensor(stacked[rank], "float32")
        dist.reduce(mine, dst=root, op=OPS[op])
        if rank == root:
            compare(mine, reduce_reference(stacked, op, size), "float32", op,
                    f"reduce {op} to {root}", problems)
        elif not torch.equal(mine, to_tensor(stacked[rank], "float32")):
            problems.append(f"reduce {op} to {root} changed non-root rank {rank}'s tensor")
    finish(WORLD, problems, [])


@pytest.mark.parametrize("name", ["float32", "bfloat16", "int64"])
def test_gather_to_every_root(pg, name):
    size, rank = WORLD.size, WORLD.rank
    problems = []
    for root in range(size):
        outputs = [torch.zeros(4, 3, dtype=getattr(torch, name)) for _ in range(size)] \
            if rank == root else None
        dist.gather(data(rank, (4, 3), name, root), outputs, dst=root)
        if rank == root:
            problems += [f"root {root}: slot {r} is not rank {r}'s tensor"
                         for r, t in enumerate(outputs)
                         if not torch.equal(t, data(r, (4, 3), name, root))]
    finish(WORLD, problems, [])


@pytest.mark.parametrize("name", ["float32", "bfloat16", "int64"])
def test_scatter_from_every_root(pg, name):
    size, rank = WORLD.size, WORLD.rank
    problems = []
    for root in range(size):
        inputs = [data(root, (2, 5), name, 10 * r) for r in range(size)] \
            if rank == root else None
        output = torch.zeros(2, 5, dtype=getattr(torch, name))
        dist.scatter(output, inputs, src=root)
        if not torch.equal(output, data(root, (2, 5), name, 10 * rank)):
            problems.append(f"root {root}: rank {rank} did not get its piece")
    finish(WORLD, problems, [])


def test_all_to_all(pg):
    """Tensors of a different length for each (sender, receiver) pair."""
    size, rank = WORLD.size, WORLD.rank

    def piece(sender, receiver):
        return data(sender, (sender + 2 * receiver + 1,), "float32", receiver)

    outputs = [torch.zeros(r + 2 * rank + 1) for r in range(size)]
    dist.all_to_all(outputs, [piece(rank, j) for j in range(size)])
    problems = [f"from rank {r}: {t.tolist()}, expected {piece(r, rank).tolist()}"
                for r, t in enumerate(outputs) if not torch.equal(t, piece(r, rank))]
    finish(WORLD, problems, [])


@pytest.mark.parametrize("even", [True, False], ids=["even", "uneven"])
def test_all_to_all_single(pg, even):
    size, rank = WORLD.size, WORLD.rank

    def rows(sender, receiver):  # rows sender sends receiver
        return 2 if even else (sender + 2 * receiver) % 3 + (sender == receiver)

    def piece(sender, receiver):
        return data(sender, (rows(sender, receiver), 3), "float64", receiver)

    input = torch.cat([piece(rank, j) for j in range(size)])
    output = torch.full((sum(rows(r, rank) for r in range(size)), 3), -1.0,
                        dtype=torch.float64)
    if even:
        dist.all_to_all_single(output, input)
    else:
        dist.all_to_all_single(output, input,
                               output_split_sizes=[rows(r, rank) for r in range(size)],
                               input_split_sizes=[rows(rank, j) for j in range(size)])
    want = torch.cat([piece(r, rank) for r in range(size)])
    problems = [] if torch.equal(output, want) else \
        [f"got {output.tolist()}, expected {want.tolist()}"]
    finish(WORLD, problems, [])


def test_barrier_waits_for_every_rank(pg):
    """No rank leaves the barrier before the last one (rank 0, late) enters it."""
    if WORLD.size < 2:
        dist.barrier()
        return
    WORLD.Barrier()
    if WORLD.rank == 0:
        time.sleep(0.4)
    entered = time.monotonic()
    dist.barrier()
    waited = time.monotonic() - entered
    problems = [] if WORLD.rank == 0 or waited > 0.3 else \
        [f"rank {WORLD.rank} left the barrier after {waited:.3f} s, before rank 0 came"]
    finish(WORLD, problems, [])


# --- point to point ---------------------------------------------------------------------


def _needs_two():
    if WORLD.size < 2:
        pytest.skip("point to point needs two ranks")


@pytest.mark.parametrize("n", [5, 300_000], ids=["small", "large"])
def test_send_recv_in_a_ring(pg, n):
    """Blocking send/recv (even ranks send first) and isend/irecv, both around the ring."""
    _needs_two()
    size, rank = WORLD.size, WORLD.rank
    right, left = (rank + 1) % size, (rank - 1) % size
    problems = []
    received = torch.zeros(n)
    if rank % 2 == 0:
        dist.send(data(rank, (n,), salt=1), dst=right)
        dist.recv(received, src=left)
    else:
        dist.recv(received, src=left)
        dist.send(data(rank, (n,), salt=1), dst=right)
    if not torch.equal(received, data(left, (n,), salt=1)):
        problems.append("blocking: not the left neighbour's tensor")
    into = torch.zeros(n, dtype=torch.float64)
    works = [dist.irecv(into, src=left),
             dist.isend(data(rank, (n,), "float64", salt=2), dst=right)]
    for work in works:
        work.wait()
    if not torch.equal(into, data(left, (n,), "float64", salt=2)):
        problems.append("isend/irecv: not the left neighbour's tensor")
    finish(WORLD, problems, [])


def test_recv_from_any_source_returns_the_sender(pg):
    _needs_two()
    size, rank = WORLD.size, WORLD.rank
    problems = []
    if rank == 0:
        senders = []
        for _ in range(size - 1):
            t = torch.zeros(4, dtype=torch.int64)
            sender = dist.recv(t)
            senders.append(sender)
            if not torch.equal(t, data(sender, (4,), "int64")):
                problems.append(f"recv said rank {sender} sent it, but it holds "
                                f"{t.tolist()}")
        if sorted(senders) != list(range(1, size)):
            problems.append(f"senders {senders}, expected each of 1..{size - 1} once")
    else:
        dist.send(data(rank, (4,), "int64"), dst=0)
    finish(WORLD, problems, [])


def test_batch_isend_irecv(pg):
    """Both directions around the ring in one batch, tensors of two dtypes."""
    _needs_two()
    size, rank = WORLD.size, WORLD.rank
    right, left = (rank + 1) % size, (rank - 1) % size
    from_left = torch.zeros(6)
    from_right = torch.zeros(3, dtype=torch.int64)
    ops = [dist.P2POp(dist.irecv, from_left, left),
           dist.P2POp(dist.irecv, from_right, right),
           dist.P2POp(dist.isend, data(rank, (6,), salt=3), right),
           dist.P2POp(dist.isend, data(rank, (3,), "int64", salt=4), left)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    problems = []
    if not torch.equal(from_left, data(left, (6,), salt=3)):
        problems.append("the left neighbour's tensor did not come")
    if not torch.equal(from_right, data(right, (3,), "int64", salt=4)):
        problems.append("the right neighbour's tensor did not come")
    finish(WORLD, problems, [])


# --- objects -----------------------------------------------------------------------------


def obj(rank: int) -> dict:
    return {"rank": rank, "text": "x" * (10 * rank), "array": list(range(rank + 1))}


def test_object_collectives(pg):
    size, rank = WORLD.size, WORLD.rank
    problems = []
    for root in range(size):
        objects = [obj(rank), rank] if rank == root else [None, None]
        dist.broadcast_object_list(objects, src=root)
        if objects != [obj(root), root]:
            problems.append(f"broadcast_object_list from {root}: {objects}")
    gathered = [None] * size
    dist.all_gather_object(gathered, obj(rank))
    if gathered != [obj(r) for r in range(size)]:
        problems.append(f"all_gather_object: {gathered}")
    root = size - 1
    into = [None] * size if rank == root else None
    dist.gather_object(obj(rank), into, dst=root)
    if rank == root and into != [obj(r) for r in range(size)]:
        problems.append(f"gather_object: {into}")
    out = [None]
    dist.scatter_object_list(out, [obj(10 + r) for r in range(size)] if rank == 0 else None,
                             src=0)
    if out != [obj(10 + rank)]:
        problems.append(f"scatter_object_list: {out}")
    finish(WORLD, problems, [])


# --- asynchronous calls ----------------------------------------------------------------------


def test_async_op_work_and_future(pg):
    size, rank = WORLD.size, WORLD.rank
    problems = []
    total = sum(float(r + 1) for r in range(size))
    t = torch.full((5,), float(rank + 1))
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    if not torch.equal(t, torch.full((5,), total)):
        problems.append(f"all_reduce after wait(): {t.tolist()}")
    value = work.get_future().wait()
    if not (isinstance(value, list) and len(value) == 1 and torch.equal(value[0], t)):
        problems.append(f"all_reduce's future holds {value!r}")
    # a slow-path reduction (PRODUCT) and a broadcast
    p = torch.full((3,), 2.0)
    work = dist.all_reduce(p, op=R.PRODUCT, async_op=True)
    value = work.get_future().wait()
    if not torch.equal(value[0], torch.full((3,), 2.0 ** size)) or value[0] is not p:
        problems.append(f"PRODUCT's future holds {value!r}")
    b = data(rank, (4,), salt=5)
    work = dist.broadcast(b, src=size - 1, async_op=True)
    work.wait()
    value = work.get_future().wait()
    if not torch.equal(b, data(size - 1, (4,), salt=5)) or not torch.equal(value[0], b):
        problems.append(f"broadcast: {b.tolist()}, future {value!r}")
    if not work.is_completed():
        problems.append("a waited work is not completed")
    # a future chained as DDP's comm hooks chain them
    c = torch.full((2,), float(rank))
    chained = dist.all_reduce(c, async_op=True).get_future().then(
        lambda fut: fut.value()[0] * 2)
    if not torch.equal(chained.wait(), torch.full((2,), 2.0 * sum(range(size)))):
        problems.append(f"then(): {chained.wait().tolist()}")
    # point to point: wait() completes the request
    if size > 1:
        right, left = (rank + 1) % size, (rank - 1) % size
        got = torch.zeros(3)
        works = [dist.irecv(got, src=left), dist.isend(torch.full((3,), float(rank)), right)]
        works[0].wait()
        works[1].wait()
        if not torch.equal(got, torch.full((3,), float(left))):
            problems.append(f"irecv: {got.tolist()}")
    finish(WORLD, problems, [])


# --- groups -------------------------------------------------------------------------------


def test_get_backend(pg):
    assert dist.get_backend() == "mpistrat"
    assert dist.get_backend(pg) == "mpistrat"
    assert (dist.get_rank(), dist.get_world_size()) == (WORLD.rank, WORLD.size)


def test_new_group_of_the_even_ranks(pg):
    """A collective on the even ranks' group while the odd ranks run one on theirs;
    group ranks and sizes; a broadcast from a group member by its global rank."""
    size, rank = WORLD.size, WORLD.rank
    evens = list(range(0, size, 2))
    odds = list(range(1, size, 2))
    even_group = dist.new_group(evens)
    odd_group = dist.new_group(odds) if odds else None
    problems = []
    mine, group = (evens, even_group) if rank % 2 == 0 else (odds, odd_group)
    for other in (even_group, odd_group):
        if other is not None and other is not group and dist.get_rank(other) != -1:
            problems.append(f"rank {rank} is rank {dist.get_rank(other)} of a group it "
                            f"is not in")
    if dist.get_rank(group) != mine.index(rank) or dist.get_world_size(group) != len(mine):
        problems.append(f"rank {dist.get_rank(group)} of {dist.get_world_size(group)}, "
                        f"expected {mine.index(rank)} of {len(mine)}")
    if (group.rank(), group.size()) != (mine.index(rank), len(mine)):
        problems.append(f"group.rank()/size(): {group.rank()}/{group.size()}")
    if dist.get_backend(group) != "mpistrat":
        problems.append(f"the group's backend is {dist.get_backend(group)!r}")
    # the evens sum, the odds take the max, at the same time
    op = "SUM" if rank % 2 == 0 else "MAX"
    stacked = np.stack([reduce_input("float64", op, 100, r) for r in mine])
    t = to_tensor(stacked[mine.index(rank)], "float64")
    dist.all_reduce(t, op=OPS[op], group=group)
    compare(t, reduce_reference(stacked, op, len(mine)), "float64", op,
            f"{op} on the group {mine}", problems)
    # a broadcast from the group's last member, named by its global rank
    b = data(rank, (3,), salt=6)
    dist.broadcast(b, src=mine[-1], group=group)
    if not torch.equal(b, data(mine[-1], (3,), salt=6)):
        problems.append(f"broadcast from global rank {mine[-1]} on {mine}: {b.tolist()}")
    outputs = [torch.zeros(2) for _ in mine]
    dist.all_gather(outputs, torch.full((2,), float(rank)), group=group)
    if [int(o[0]) for o in outputs] != mine:
        problems.append(f"all_gather on {mine}: {[o.tolist() for o in outputs]}")
    for g in (even_group, odd_group):
        if g is not None and dist.get_rank(g) >= 0:
            dist.destroy_process_group(g)
    finish(WORLD, problems, [])


def test_new_subgroups(pg):
    size, rank = WORLD.size, WORLD.rank
    group_size = 2 if size % 2 == 0 else 1
    subgroup, subgroups = dist.new_subgroups(group_size=group_size)
    members = list(range(rank - rank % group_size, rank - rank % group_size + group_size))
    problems = []
    if len(subgroups) != size // group_size:
        problems.append(f"{len(subgroups)} subgroups, expected {size // group_size}")
    if (dist.get_rank(subgroup), dist.get_world_size(subgroup)) != \
            (rank % group_size, group_size):
        problems.append(f"rank {dist.get_rank(subgroup)} of "
                        f"{dist.get_world_size(subgroup)} in its subgroup")
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t, group=subgroup)
    if not torch.equal(t, torch.full((4,), float(sum(m + 1 for m in members)))):
        problems.append(f"the subgroup {members} summed to {t.tolist()}")
    # uneven groups: [0, 1], [2, ...]
    if size >= 3:
        groups = [[0, 1], list(range(2, size))]
        cur, _ = dist.new_subgroups_by_enumeration(groups)
        members = groups[0] if rank < 2 else groups[1]
        t = torch.full((2,), float(rank))
        dist.all_reduce(t, op=R.MAX, group=cur)
        if not torch.equal(t, torch.full((2,), float(members[-1]))):
            problems.append(f"MAX on {members}: {t.tolist()}")
    finish(WORLD, problems, [])


# --- mismatched calls never hang ----------------------------------------------------------


def _mismatch(call_on_rank0, call_elsewhere, *names: str) -> None:
    """Run a call that differs on rank 0: every rank must raise a mismatch naming every
    rank's call and ``names``; then the group must go on working. (Problems are recorded,
    not raised at once, so that a rank that did not raise never leaves the others
    waiting in the next collective.)"""
    problems = []
    try:
        (call_on_rank0 if WORLD.rank == 0 else call_elsewhere)()
        problems.append(f"rank {WORLD.rank}: no error")
    except (CollectiveMismatchError, RuntimeError) as exc:
        text = str(exc)
        wanted = ["different arguments", *(f"rank {r}:" for r in range(WORLD.size)), *names]
        missing = [w for w in wanted if w not in text]
        if missing:
            problems.append(f"rank {WORLD.rank}: {missing} not in the error: {text}")
    t = torch.full((3,), float(WORLD.rank))
    dist.all_reduce(t)
    if not torch.equal(t, torch.full((3,), float(sum(range(WORLD.size))))):
        problems.append(f"all_reduce after the mismatch: {t.tolist()}")
    finish(WORLD, problems, [])


def _needs_a_peer():
    if WORLD.size < 2:
        pytest.skip("a mismatch needs two ranks")


def test_mismatched_shapes_raise_on_every_rank(pg):
    _needs_a_peer()
    _mismatch(lambda: dist.all_reduce(torch.ones(4)),
              lambda: dist.all_reduce(torch.ones(3)),
              "shape=(4,)", "shape=(3,)")


def test_mismatched_dtypes_raise_on_every_rank(pg):
    _needs_a_peer()
    _mismatch(lambda: dist.all_reduce(torch.ones(3, dtype=torch.float64)),
              lambda: dist.all_reduce(torch.ones(3)),
              "<f8", "<f4")


def test_mismatched_ops_raise_on_every_rank(pg):
    _needs_a_peer()
    _mismatch(lambda: dist.all_reduce(torch.ones(3), op=R.MAX),
              lambda: dist.all_reduce(torch.ones(3), op=R.SUM),
              "op=MAX", "op=SUM")


def test_mismatched_slow_path_ops_raise_on_every_rank(pg):
    """PRODUCT on one rank, BXOR on the others (the backend's own gathering path)."""
    _needs_a_peer()
    _mismatch(lambda: dist.all_reduce(torch.ones(3, dtype=torch.int8), op=R.PRODUCT),
              lambda: dist.all_reduce(torch.ones(3, dtype=torch.int8), op=R.BXOR),
              "multiply", "bitwise_xor")


def test_all_reduce_against_broadcast_raises_on_every_rank(pg):
    _needs_a_peer()
    _mismatch(lambda: dist.all_reduce(torch.ones(3)),
              lambda: dist.broadcast(torch.ones(3), src=0),
              "op=SUM", "broadcast root=0")


@pytest.mark.parametrize("other", ["shape", "op", "broadcast"])
def test_a_repeated_call_on_its_cached_plan_still_agrees(pg, other):
    """A tensor all-reduced again and again takes the backend's cached plan (its third
    call on rank 0 here): a different call on the other ranks still raises on every
    rank."""
    _needs_a_peer()
    t = torch.ones(5)
    for _ in range(2):  # (the first call makes the plan, the second finds it)
        dist.all_reduce(t)
    elsewhere = {"shape": lambda: dist.all_reduce(torch.ones(6)),
                 "op": lambda: dist.all_reduce(t, op=R.MAX),
                 "broadcast": lambda: dist.broadcast(torch.ones(5), src=0)}[other]
    names = {"shape": ("shape=(5,)", "shape=(6,)"), "op": ("op=SUM", "op=MAX"),
             "broadcast": ("op=SUM", "broadcast root=0")}[other]
    _mismatch(lambda: dist.all_reduce(t), elsewhere, *names)


def test_broadcasts_from_different_roots_raise_on_every_rank(pg):
    _needs_a_peer()
    _mismatch(lambda: dist.broadcast(torch.ones(3), src=0),
              lambda: dist.broadcast(torch.ones(3), src=1),
              "broadcast root=0", "broadcast root=1")


@pytest.mark.parametrize("pair", ["all_gather/reduce_scatter_tensor", "barrier/all_to_all",
                                  "gather/scatter"])
def test_other_mismatched_collectives_raise_on_every_rank(pg, pair):
    _needs_a_peer()
    size = WORLD.size
    calls = {
        "all_gather": lambda: dist.all_gather_into_tensor(torch.zeros(2 * size),
                                                          torch.ones(2)),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.zeros(2),
                                                                    torch.ones(2 * size)),
        "barrier": lambda: dist.barrier(),
        "all_to_all": lambda: dist.all_to_all_single(torch.zeros(size), torch.ones(size)),
        "gather": lambda: dist.gather(torch.ones(2), [torch.zeros(2) for _ in range(size)]
                                      if WORLD.rank == 0 else None, dst=0),
        "scatter": lambda: dist.scatter(torch.zeros(2), None, src=0),
    }
    first, second = pair.split("/")
    _mismatch(calls[first], calls[second], first, second)


def test_a_mismatch_through_torchs_cpp_raises_on_every_rank(pg):
    """torch's C++ calling the backend (``_broadcast_coalesced``, as DDP syncs its
    module's state): the mismatch reaches every rank through it."""
    _needs_a_peer()
    if not hasattr(dist, "_broadcast_coalesced"):
        pytest.skip("this torch has no dist._broadcast_coalesced")
    _mismatch(lambda: dist._broadcast_coalesced(pg, [torch.ones(3)], 1 << 20, 0),
              lambda: dist._broadcast_coalesced(pg, [torch.ones(4)], 1 << 20, 0),
              "(3,)", "(4,)")


# --- a group's timeout ---------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_timeout_names_the_rank_that_did_not_come(pg):
    """A group made with a 2 s timeout: rank 0 skips a barrier, the others raise a
    timeout naming rank 0 within a few seconds. Rank 0 then joins that barrier late (the
    clean-up: the others' abandoned collective completes), the group is destroyed, and
    the default group goes on working."""
    _needs_a_peer()
    size, rank = WORLD.size, WORLD.rank
    timed = dist.new_group(list(range(size)), timeout=datetime.timedelta(seconds=2))
    problems = []
    # it works while every rank comes
    t = torch.full((3,), float(rank))
    dist.all_reduce(t, group=timed)
    if not torch.equal(t, torch.full((3,), float(sum(range(size))))):
        problems.append(f"all_reduce on the timed group: {t.tolist()}")
    b = data(rank, (5,), salt=7)
    dist.broadcast(b, src=size - 1, group=timed)
    if not torch.equal(b, data(size - 1, (5,), salt=7)):
        problems.append("broadcast on the timed group")
    WORLD.Barrier()
    if rank == 0:
        time.sleep(4.0)
        dist.barrier(group=timed)  # late: completes the others' abandoned agreement
    else:
        started = time.monotonic()
        try:
            dist.barrier(group=timed)
            problems.append(f"rank {rank}: the barrier returned without rank 0")
        except (CollectiveTimeoutError, RuntimeError) as exc:
            took = time.monotonic() - started
            text = str(exc)
            if not 1.9 <= took <= 3.9:
                problems.append(f"rank {rank} raised after {took:.2f} s, not at the 2 s "
                                f"timeout")
            if "rank(s) [0] did not arrive" not in text or "timed out after 2 s" not in text:
                problems.append(f"rank {rank}: the error does not name rank 0: {text}")
            if isinstance(exc, CollectiveTimeoutError) and exc.missing != [0]:
                problems.append(f"rank {rank}: missing {exc.missing}, expected [0]")
    WORLD.Barrier()
    # the others' abandoned agreement returned with rank 0's late barrier: its thread is
    # idle again, ready for the next timed call (none is still in a collective)
    deadline = time.monotonic() + 10
    while idle_agreement_threads() != agreement_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    if idle_agreement_threads() != agreement_threads():
        problems.append(f"rank {rank}: an agreement thread is still waiting "
                        f"({idle_agreement_threads()} of {agreement_threads()} idle)")
    dist.destroy_process_group(timed)
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    if not torch.equal(t, torch.full((3,), float(sum(range(1, size + 1))))):
        problems.append(f"the default group after the timeout: {t.tolist()}")
    finish(WORLD, problems, [])


@pytest.mark.timeout(60)
def test_a_timed_groups_repeated_all_reduce_keeps_every_check(pg):
    """The fast path of a timed group's all_reduce (the same tensor again: its agreed text
    and views kept) still agrees within the timeout on every call: correct sums call
    after call; a contiguous tensor on some ranks and a transposed one on others (the
    generic path) agree and reduce together; a second call that differs on one rank (a
    repeat there, another shape or op elsewhere) raises a mismatch on every rank; and a
    rank that does not come is named by the others at the timeout."""
    _needs_a_peer()
    size, rank = WORLD.size, WORLD.rank
    timed = dist.new_group(list(range(size)), timeout=datetime.timedelta(seconds=2))
    problems = []
    t = torch.zeros(6)
    for k in range(4):  # (calls 2-4 on rank 0's side take the kept text)
        t.fill_(float(rank + k))
        dist.all_reduce(t, group=timed)
        want = float(sum(range(size)) + k * size)
        if not torch.equal(t, torch.full((6,), want)):
            problems.append(f"call {k}: {t.tolist()}, expected {want}")
    mixed = torch.full((3, 2), float(rank)).t() if rank % 2 else torch.full((2, 3), float(rank))
    dist.all_reduce(mixed, group=timed)  # (odd ranks: non-contiguous, the generic path)
    if not torch.equal(mixed, torch.full((2, 3), float(sum(range(size))))):
        problems.append(f"contiguous and transposed tensors together: {mixed.tolist()}")
    for other, names in ((lambda: dist.all_reduce(torch.ones(7), group=timed), ["(7,)"]),
                         (lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=timed),
                          ["max"])):
        try:
            if rank == 0:
                dist.all_reduce(t, group=timed)  # the kept text
            else:
                other()
            problems.append(f"rank {rank}: no error for {names}")
        except (CollectiveMismatchError, RuntimeError) as exc:
            text = str(exc)
            missing = [w for w in ["different arguments", "(6,)", *names] if w not in text]
            if missing:
                problems.append(f"rank {rank}: {missing} not in the error: {text}")
    dist.all_reduce(t, group=timed)  # (every rank keeps t's text again: the next call
    WORLD.Barrier()                  # on t takes the fast path)
    if rank == 0:
        time.sleep(4.0)
        # late, the agreement alone, with the text kept (the others abandoned theirs: a
        # late all_reduce would go on to its data, which they never send)
        group = timed if hasattr(timed, "_agree") else timed._get_backend(torch.device("cpu"))
        group._agree("all_reduce", group._last[8])
    else:
        started = time.monotonic()
        try:
            dist.all_reduce(t, group=timed)  # (the same tensor: the kept text)
            problems.append(f"rank {rank}: the all_reduce returned without rank 0")
        except (CollectiveTimeoutError, RuntimeError) as exc:
            took = time.monotonic() - started
            if not 1.9 <= took <= 3.9 or "rank(s) [0] did not arrive" not in str(exc):
                problems.append(f"rank {rank} after {took:.2f} s: {exc}")
    WORLD.Barrier()
    dist.destroy_process_group(timed)
    finish(WORLD, problems, [])


def test_a_timed_groups_agreements_need_no_thread(pg, monkeypatch):
    """A group with a timeout agrees, at its creation, to poll non-blocking agreements:
    its collectives hand no blocking collective to an agreement thread (which a timed
    agreement needs elsewhere, without a stall watch), and they still work."""
    from mpistrat.runtime import agreement

    handed = []

    class Counted(agreement._Blocking):
        def __init__(self, call, args):
            handed.append(call)
            super().__init__(call, args)

    monkeypatch.setattr(agreement, "_Blocking", Counted)
    size, rank = WORLD.size, WORLD.rank
    timed = dist.new_group(list(range(size)), timeout=datetime.timedelta(seconds=30))
    problems = []
    t = torch.full((4,), float(rank))
    dist.all_reduce(t, group=timed)
    dist.all_reduce(t, group=timed)
    if not torch.equal(t, torch.full((4,), float(size * sum(range(size))))):
        problems.append(f"all_reduce: {t.tolist()}")
    b = data(rank, (3,), salt=9)
    dist.broadcast(b, src=0, group=timed)
    if not torch.equal(b, data(0, (3,), salt=9)):
        problems.append("broadcast")
    gathered = [torch.zeros(2) for _ in range(size)]
    dist.all_gather(gathered, torch.full((2,), float(rank)), group=timed)
    if [g[0].item() for g in gathered] != [float(r) for r in range(size)]:
        problems.append(f"all_gather: {gathered}")
    dist.barrier(group=timed)
    if handed:
        problems.append(f"rank {rank}: {len(handed)} agreement(s) handed to a thread")
    dist.destroy_process_group(timed)
    finish(WORLD, problems, [])


def test_different_timeouts_of_one_group_raise_when_it_is_made(pg):
    """Ranks that make one group with different timeouts (or one without) get the same
    error on every rank, naming each rank's, when the group is made."""
    _needs_a_peer()
    rank = WORLD.rank
    timeout = None if rank == 1 else datetime.timedelta(seconds=20 + (rank == 0))
    problems = []
    try:
        if timeout is None:
            dist.new_group(list(range(WORLD.size)))
        else:
            dist.new_group(list(range(WORLD.size)), timeout=timeout)
        problems.append(f"rank {rank}: the group was made")
    except (CollectiveMismatchError, RuntimeError) as exc:
        wanted = ["timeout=21.0", "timeout=None", "the same MPISTRAT_TORCH_SPEC and timeout"]
        if WORLD.size > 2:
            wanted.append("timeout=20.0")
        missing = [w for w in wanted if w not in str(exc)]
        if missing:
            problems.append(f"rank {rank}: {missing} not in the error: {exc}")
    t = torch.full((3,), float(rank))
    dist.all_reduce(t)
    if not torch.equal(t, torch.full((3,), float(sum(range(WORLD.size))))):
        problems.append(f"the default group afterwards: {t.tolist()}")
    finish(WORLD, problems, [])


@pytest.mark.timeout(60)
def test_point_to_point_wait_times_out_naming_the_peer(pg):
    """On a group with a 2 s timeout, rank 1's irecv from rank 0, which sends nothing yet,
    raises naming rank 0 when waited for; once rank 0 sends, a second wait completes it
    with rank 0's tensor."""
    _needs_a_peer()
    rank = WORLD.rank
    timed = dist.new_group(list(range(WORLD.size)), timeout=datetime.timedelta(seconds=2))
    problems = []
    got = torch.zeros(5)
    work = dist.irecv(got, src=0, group=timed) if rank == 1 else None
    if rank == 1:
        started = time.monotonic()
        try:
            work.wait()
            problems.append("the irecv completed without a send")
        except (CollectiveTimeoutError, RuntimeError) as exc:
            took = time.monotonic() - started
            if "recv from rank 0" not in str(exc) or not 1.9 <= took <= 10:
                problems.append(f"after {took:.2f} s: {exc}")
            if isinstance(exc, CollectiveTimeoutError) and exc.missing != [0]:
                problems.append(f"missing {exc.missing}, expected [0]")
    WORLD.Barrier()
    if rank == 0:
        dist.send(data(0, (5,), salt=8), dst=1, group=timed)
    elif rank == 1:
        work.wait()
        if not torch.equal(got, data(0, (5,), salt=8)):
            problems.append(f"the late send gave {got.tolist()}")
    WORLD.Barrier()
    dist.destroy_process_group(timed)
    finish(WORLD, problems, [])


# --- found by PyTorch's own distributed tests (bin/torch-upstream-check) and review -----

def test_all_gather_coalesced_fills_torchs_layout(pg):
    """``outputs[r][i]`` is rank r's ``inputs[i]`` (gloo's layout), with as many inputs
    as ranks so that the transposed layout would also fit, and with other shapes."""
    size, rank = WORLD.size, WORLD.rank
    for shapes in ([(2,)] * size, [(1,), (3, 2)]):
        inputs = [data(rank, s, salt=i) for i, s in enumerate(shapes)]
        outputs = [[torch.zeros(s) for s in shapes] for _ in range(size)]
        with warnings.catch_warnings():  # deprecated in torch, still callable
            warnings.simplefilter("ignore")
            dist.all_gather_coalesced(outputs, inputs)
        problems = [f"outputs[{r}][{i}] = {outputs[r][i].tolist()}, expected rank {r}'s "
                    f"input {i}" for r in range(size) for i, s in enumerate(shapes)
                    if not torch.equal(outputs[r][i], data(r, s, salt=i))]
        finish(WORLD, problems, [])


def test_sparse_all_reduce_sums_every_ranks_entries(pg):
    """SUM of COO tensors whose entries overlap between ranks (DDP's sparse gradients)."""
    size, rank = WORLD.size, WORLD.rank

    def entries(r):
        return [[r % 4, 5], [1.0 + r, 2.0]]

    index, values = entries(rank)
    t = torch.sparse_coo_tensor([index], values, (8,))
    dist.all_reduce(t)
    want = sum(torch.sparse_coo_tensor([entries(r)[0]], entries(r)[1], (8,)).to_dense()
               for r in range(size))
    problems = [] if torch.equal(t.to_dense(), want) else \
        [f"got {t.to_dense().tolist()}, expected {want.tolist()}"]
    finish(WORLD, problems, [digest(bits(t.to_dense()))])


def test_mismatched_all_to_all_splits_raise_on_every_rank(pg):
    """Rank 0 expects no row from itself and two from the last rank, which send it one
    each: every rank raises (rank 0 its own error, the others a mismatch naming it)
    instead of garbage on one side, and the group goes on working."""
    _needs_a_peer()
    size, rank = WORLD.size, WORLD.rank
    input = torch.full((size, 2), float(rank))
    output = torch.zeros(size, 2)
    splits = [1] * size
    if rank == 0:
        splits[0], splits[-1] = 0, 2
    problems = []
    try:
        dist.all_to_all_single(output, input, output_split_sizes=splits,
                               input_split_sizes=[1] * size)
        problems.append(f"rank {rank}: no error")
    except (CollectiveMismatchError, ValueError, RuntimeError) as exc:
        if "all_to_all" not in str(exc) or (rank != 0 and "rank(s) [0]" not in str(exc)):
            problems.append(f"rank {rank}: the error does not name the call or rank 0: "
                            f"{exc}")
    dist.all_to_all_single(output, input)
    if not torch.equal(output[:, 0], torch.arange(size, dtype=torch.float32)):
        problems.append(f"all_to_all_single after the mismatch: {output.tolist()}")
    finish(WORLD, problems, [])


def test_a_receives_future_completes_without_wait(pg):
    """``irecv(...).get_future().wait()`` alone (no ``Work.wait()``) returns once the
    peer has sent, as with gloo."""
    _needs_a_peer()
    rank = WORLD.rank
    got = torch.zeros(2)
    problems = []
    if rank == 1:
        value = dist.irecv(got, src=0).get_future().wait()
        if not (torch.equal(got, torch.full((2,), 7.0)) and value[0] is got):
            problems.append(f"received {got.tolist()}, future {value!r}")
    elif rank == 0:
        time.sleep(0.2)  # the future is waited on before the message leaves
        dist.send(torch.full((2,), 7.0), dst=1)
    finish(WORLD, problems, [])


def test_the_same_tensor_resized_or_given_new_storage_is_reduced_whole(pg):
    """The fast all_reduce keeps the last tensor's NumPy view: a tensor shrunk in place
    (same storage), grown, or set to another storage must be reduced as it is now."""
    size = WORLD.size
    t = torch.ones(8)
    dist.all_reduce(t)
    problems = []
    for change in (lambda: t.resize_(4), lambda: t.resize_(64),
                   lambda: t.set_(torch.zeros(16).untyped_storage())):
        change()
        t.fill_(1.0)
        dist.all_reduce(t)
        if not torch.equal(t, torch.full(t.shape, float(size))):
            problems.append(f"after a change to {tuple(t.shape)}: {t.tolist()}")
    u = torch.ones(3, dtype=torch.float64)
    for op, want in ((R.SUM, float(size)), (R.MAX, float(size)), (R.SUM, float(size) ** 2)):
        dist.all_reduce(u, op=op)  # the same tensor, another op: not the cached one
        if not torch.equal(u, torch.full((3,), want, dtype=torch.float64)):
            problems.append(f"{op}: {u.tolist()}, expected {want}")
    finish(WORLD, problems, [])


# --- found by PyTorch's test_c10d_gloo.py (bin/torch-upstream-check --suite c10d-gloo) ---

def _the_same(got, want) -> bool:
    """``got`` holds the very tensors (or lists of them) of ``want``, in order."""
    return len(got) == len(want) and all(
        g is w or (isinstance(w, list) and _the_same(g, w)) for g, w in zip(got, want))


def test_calls_without_options_and_torchs_other_forms(pg):
    """The group's methods called as torch's ``ProcessGroup`` takes them (its C++
    overloads): without options (all_gather's own options class is not in
    ``torch.distributed``), with one tensor and ``op=``/``root=``/``timeout=``, or those
    in the options' place."""
    size, rank = WORLD.size, WORLD.rank
    group, problems = dist.group.WORLD, []
    wait = datetime.timedelta(seconds=60)

    def expect(label, ok):
        if not ok:
            problems.append(label)

    t = torch.full((3,), rank + 1.0)
    value = group.allreduce(t).get_future().wait()
    expect("allreduce(tensor)", torch.equal(t, torch.full((3,), size * (size + 1) / 2))
           and value[0] is t)
    t = torch.full((2,), rank + 1.0)
    group.allreduce([t], R.MAX).wait()
    expect("allreduce(tensors, op)", torch.equal(t, torch.full((2,), float(size))))
    t = torch.full((2,), rank + 1.0)
    group.allreduce(t, op=R.MIN, timeout=wait).wait()
    expect("allreduce(tensor, op=, timeout=)", torch.equal(t, torch.ones(2)))
    for root in range(size):
        t = data(rank, (4,), salt=root)
        group.broadcast(t, root).wait()
        expect(f"broadcast(tensor, {root})", torch.equal(t, data(root, (4,), salt=root)))
        t = data(rank, (4,), salt=root)
        group.broadcast(t, root=root).wait()
        expect(f"broadcast(tensor, root={root})", torch.equal(t, data(root, (4,), salt=root)))
        t = torch.full((2,), rank + 1.0)
        group.reduce(t, root, R.SUM).wait()
        expect(f"reduce(tensor, {root}, SUM)", rank != root or
               torch.equal(t, torch.full((2,), size * (size + 1) / 2)))
        outputs = [torch.zeros(3) for _ in range(size)] if rank == root else []
        value = group.gather(outputs, data(rank, (3,), salt=root), root).get_future().wait()
        expect(f"gather(outputs, input, {root})", rank != root or (
            all(torch.equal(o, data(r, (3,), salt=root)) for r, o in enumerate(outputs))
            and _the_same(value, outputs)))
        inputs = [data(root, (3,), salt=r) for r in range(size)] if rank == root else []
        output = torch.zeros(3)
        group.scatter(output, inputs, root).wait()
        expect(f"scatter(output, inputs, {root})", torch.equal(output, data(root, (3,),
                                                                             salt=rank)))
    outputs = [torch.zeros(3) for _ in range(size)]
    value = group.allgather(outputs, data(rank, (3,))).get_future().wait()
    expect("allgather(outputs, input)", _the_same(value, outputs) and all(
        torch.equal(o, data(r, (3,))) for r, o in enumerate(outputs)))
    outputs = [[torch.zeros(3) for _ in range(size)]]
    value = group.allgather(outputs, [data(rank, (3,))]).get_future().wait()
    expect("allgather without options (gloo's result: the output list)",
           _the_same(value, outputs[0]) and all(torch.equal(o, data(r, (3,)))
                                       for r, o in enumerate(outputs[0])))
    flat = torch.zeros(size * 3)
    group._allgather_base(flat, data(rank, (3,))).wait()
    expect("_allgather_base without options",
           torch.equal(flat, torch.cat([data(r, (3,)) for r in range(size)])))
    output = torch.zeros(2)
    group.reduce_scatter(output, [torch.full((2,), float(r + rank)) for r in range(size)],
                         R.MAX).wait()
    expect("reduce_scatter(output, inputs, MAX)",
           torch.equal(output, torch.full((2,), float(rank + size - 1))))
    rows = torch.arange(size * 2.0).reshape(size, 2) + 100 * rank
    got = torch.zeros(size, 2)
    group.alltoall_base(got, rows, [], [], wait).wait()
    expect("alltoall_base(..., timeout)", torch.equal(
        got[:, 0], torch.tensor([100.0 * r + 2 * rank for r in range(size)])))
    expect("barrier(timeout=)", group.barrier(timeout=wait).get_future().wait() == [])
    try:
        group.allreduce([torch.zeros(1)], R.SUM, R.MAX)
        problems.append("allreduce with too many arguments did not raise")
    except TypeError:
        pass
    finish(WORLD, problems, [])


def test_several_tensors_are_reduced_into_one_as_gloo(pg):
    """c10d's multi-device form (gloo's): every tensor of every rank's list is reduced
    into one result that each receives; broadcast sends the root's tensor rootTensor to
    every tensor; all_gather of n inputs fills each of the n output lists with every
    rank's n inputs. A mismatch inside one list raises on every rank."""
    size, rank = WORLD.size, WORLD.rank
    group, problems = dist.group.WORLD, []

    def options(kind, **fields):
        opts = kind()
        for name, value in fields.items():
            setattr(opts, name, value)
        return opts

    mine = [data(rank, (2, 3), "float64", k) for k in range(3)]
    want = sum(data(r, (2, 3), "float64", k) for r in range(size) for k in range(3))
    results = []
    for op, expected in ((R.SUM, want), (R.AVG, want / size)):
        tensors = [t.clone() for t in mine]
        results.append(tensors[0])
        value = group.allreduce(tensors, options(dist.AllreduceOptions, reduceOp=op))
        value = value.get_future().wait()
        if not all(torch.allclose(t, expected, rtol=1e-12, atol=0) for t in tensors) or \
                not _the_same(value, tensors):
            problems.append(f"allreduce of 3 tensors, {op}: {tensors[1].tolist()}, "
                            f"expected {expected.tolist()}")
    bits_in = [torch.tensor([1 << (rank % 8)], dtype=torch.int32),
               torch.tensor([1 << (8 + rank % 8)], dtype=torch.int32)]
    group.allreduce(bits_in, options(dist.AllreduceOptions, reduceOp=R.BOR)).wait()
    expected = 0
    for r in range(size):
        expected |= (1 << (r % 8)) | (1 << (8 + r % 8))
    if any(t.item() != expected for t in bits_in):
        problems.append(f"BOR of 2 tensors: {[t.item() for t in bits_in]}, expected "
                        f"{expected}")
    sparse = [torch.sparse_coo_tensor([[rank % 5]], [1.0 + rank], (6,)),
              torch.sparse_coo_tensor([[5]], [2.0], (6,))]
    group.allreduce(sparse).wait()
    dense = sum(torch.sparse_coo_tensor([[r % 5]], [1.0 + r], (6,)).to_dense()
                for r in range(size)) + torch.tensor([0, 0, 0, 0, 0, 2.0 * size])
    if not all(torch.equal(t.to_dense(), dense) for t in sparse):
        problems.append(f"sparse allreduce of 2 tensors: {sparse[0].to_dense().tolist()}")
    for root in range(size):
        tensors = [data(rank, (5,), salt=k) for k in range(3)]
        group.broadcast(tensors, options(dist.BroadcastOptions, rootRank=root,
                                         rootTensor=2)).wait()
        if not all(torch.equal(t, data(root, (5,), salt=2)) for t in tensors):
            problems.append(f"broadcast of 3 tensors from root {root}: not its tensor 2")
    inputs = [data(rank, (2,), salt=j) for j in range(2)]
    outputs = [[torch.zeros(2) for _ in range(2 * size)] for _ in range(2)]
    value = group.allgather(outputs, inputs).get_future().wait()
    for i, listed in enumerate(outputs):
        for r in range(size):
            for j in range(2):
                if not torch.equal(listed[r * 2 + j], data(r, (2,), salt=j)):
                    problems.append(f"allgather of 2 inputs: outputs[{i}][{r * 2 + j}] is "
                                    f"not rank {r}'s input {j}")
    if not _the_same(value, outputs):
        problems.append("allgather of 2 inputs: its work's result is not the output lists")
    try:  # rank 0 alone has a wrong list: every rank raises
        wrong = [torch.zeros(2), torch.zeros(3 if rank == 0 else 2)]
        group.allreduce(wrong).wait()
        problems.append(f"rank {rank}: a list of two shapes did not raise")
    except (ValueError, CollectiveMismatchError):
        pass
    after = torch.ones(2)
    dist.all_reduce(after)
    if not torch.equal(after, torch.full((2,), float(size))):
        problems.append(f"all_reduce after the error: {after.tolist()}")
    finish(WORLD, problems, [(f"{k}", digest(bits(t))) for k, t in enumerate(results)])
