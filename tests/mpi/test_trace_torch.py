"""What the torch adapter puts into a trace, at 1-4 ranks: torch's
``DistributedDataParallel`` over the ``"mpistrat"`` backend for 3 steps gives one
``cpu_op`` per backend collective, with Kineto's args and the process group's name, and
the ``mpistrat.all_reduce`` it calls as a phase inside it (never a second collective);
the backend's other collectives likewise; ``mpistrat.torch.DistributedDataParallel`` with
``ZeroRedundancyOptimizer`` for 3 steps gives each bucket's ``bucket all_reduce`` and
each ``ZeRO step`` with the node's barrier inside. Every file is read back with
``json.load``."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

import torch.distributed as dist  # noqa: E402
from _torch_group import default_group  # noqa: E402
from _trace import inside, traced  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch import nn  # noqa: E402

import mpistrat.torch as mt  # noqa: E402
from mpistrat import trace  # noqa: E402
from mpistrat.runtime.agreement import DOORS  # noqa: E402

torch.set_num_threads(1)

KINETO = ("Collective name", "dtype", "In msg nelems", "Out msg nelems", "Group size",
          "algorithm", "bytes", "seq", "algbw (GB/s)", "busbw (GB/s)")
STEPS = 3


@pytest.fixture(scope="module")
def pg():
    with default_group() as group:
        yield group


def _within(events, outer, name=None):
    return [e for e in events if e is not outer and e["tid"] == outer["tid"]
            and inside(e, outer) and (name is None or e["name"] == name)]


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 3))


def _data(step):
    generator = torch.Generator().manual_seed(100 * step + MPI.COMM_WORLD.rank)
    return torch.randn(4, 8, generator=generator)


def _same_everywhere(value):
    values = MPI.COMM_WORLD.allgather(value)
    assert all(v == values[0] for v in values), values


def _train(ddp, optimizer):
    """STEPS traced training steps of ``ddp`` (each marked with ``trace.step()``)."""
    for step in range(STEPS):
        trace.step()
        optimizer.zero_grad()
        ddp(_data(step)).sum().backward()
        optimizer.step()


@pytest.mark.timeout(120)
def test_torch_ddp_over_the_backend_records_one_cpu_op_per_collective(pg, root):
    size = MPI.COMM_WORLD.size
    model = _model()
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    params = sum(p.numel() for p in model.parameters())

    def calls():
        _train(ddp, optimizer)
        flag = torch.ones(3, dtype=torch.float64)
        dist.all_reduce(flag)
        dist.broadcast(flag, 0)
        gathered = [torch.empty(3, dtype=torch.float64) for _ in range(size)]
        dist.all_gather(gathered, flag)
        dist.barrier()

    events = traced(root, MPI.COMM_WORLD, calls)
    ops = sorted((e for e in events if e["cat"] == "cpu_op"), key=lambda e: e["ts"])
    assert all(op["name"].startswith("torch.distributed.") for op in ops), \
        sorted({op["name"] for op in ops})
    for op in ops:
        missing = [key for key in KINETO if key not in op["args"]]
        assert not missing, (op["name"], missing)
        assert op["args"]["Group size"] == size
        assert op["args"]["Process Group Name"] == pg.group_name
        (agreement,) = _within(events, op, "agreement")
        assert agreement["args"]["seq"] == op["args"]["seq"]
    seqs = [op["args"]["seq"] for op in ops]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    _same_everywhere([(op["name"], op["args"]["seq"]) for op in ops])
    # DDP's gradient buckets: the backend's all_reduce, mpistrat's all_reduce a phase in it
    buckets = [op for op in ops if op["name"] == "torch.distributed.all_reduce"
               and op["args"]["In msg nelems"] == params]
    assert len(buckets) == STEPS, [(op["name"], op["args"]["In msg nelems"]) for op in ops]
    for op in buckets:
        assert op["args"]["Collective name"] == "allreduce"
        assert op["args"]["dtype"] == "float32" and op["args"]["bytes"] == 4 * params
        (inner,) = _within(events, op, "all_reduce")
        assert inner["cat"] == "mpistrat_phase" and inner["args"]["seq"] == op["args"]["seq"]
    named = {(op["name"], op["args"]["Collective name"], op["args"]["In msg nelems"],
              op["args"]["Out msg nelems"]) for op in ops[-4:]}
    assert named == {("torch.distributed.all_reduce", "allreduce", 3, 3),
                     ("torch.distributed.broadcast", "broadcast", 3, 3),
                     ("torch.distributed.all_gather", "allgather", 3, 3 * size),
                     ("torch.distributed.barrier", "barrier", 0, 0)}, named
    assert DOORS.depth == 0


@pytest.mark.timeout(120)
def test_mpistrat_ddp_and_zero_record_buckets_and_steps(root):
    world = MPI.COMM_WORLD
    model = _model(1)
    ddp = mt.DistributedDataParallel(model, comm=world, bucket_bytes=512)
    optimizer = mt.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, comm=world,
                                           lr=0.1)
    buckets = ddp.buckets

    def calls():
        _train(ddp, optimizer)

    events = traced(root, MPI.COMM_WORLD, calls)
    reduced = sorted((e for e in events if e["name"] == "bucket all_reduce"),
                     key=lambda e: e["ts"])
    assert len(reduced) == STEPS * len(buckets) and len(buckets) > 1
    for k, op in enumerate(reduced):
        index = k % len(buckets)
        dtype, nbytes, _ = buckets[index]
        assert op["cat"] == "cpu_op"
        assert op["args"]["bucket"] == index
        assert op["args"]["Group size"] == world.size
        assert op["args"]["dtype"] == str(dtype).removeprefix("torch.")
        # (the last bucket also carries one count per parameter)
        assert op["args"]["bytes"] >= nbytes and op["args"]["bytes"] % 4 == 0
        algorithm = _within(events, op, "algorithm")
        assert len(algorithm) == (world.size > 1)
    zero = sorted((e for e in events if e["name"] == "ZeRO step"), key=lambda e: e["ts"])
    assert len(zero) == STEPS and {e["cat"] for e in zero} == {"user_annotation"}
    for step in zero:
        (barrier,) = _within(events, step, "ZeRO barrier")
        assert barrier["cat"] == "cpu_op" and barrier["args"]["Collective name"] == "barrier"
        (agreement,) = _within(events, barrier, "agreement")
        assert agreement["args"]["seq"] == barrier["args"]["seq"]
    _same_everywhere([(op["name"], op["args"]["seq"]) for op in reduced])


@pytest.mark.timeout(120)
def test_sends_and_receives_record_their_post_and_the_wait(pg, root):
    """A ring of ``dist.send``/``dist.recv`` (blocking: each waits) and of
    ``isend``/``irecv`` with a late ``wait()``: every post is a ``cpu_op``
    ``torch.distributed.send``/``recv`` with Kineto's args, the peer and the tag; every
    wait that had to wait is ``... wait``, naming the peer (the actual sender for a
    receive from any rank)."""
    world = MPI.COMM_WORLD
    size, rank = world.size, world.rank
    if size < 2:
        pytest.skip("a send needs a peer")
    right, left = (rank + 1) % size, (rank - 1) % size
    got = torch.zeros(5, dtype=torch.float64)

    def calls():
        trace.step()
        if rank % 2 == 0:  # (even ranks send first: no deadlock at any size)
            dist.send(torch.full((5,), float(rank), dtype=torch.float64), right, tag=7)
            dist.recv(got, left, tag=7)
        else:
            dist.recv(got, left, tag=7)
            dist.send(torch.full((5,), float(rank), dtype=torch.float64), right, tag=7)
        world.Barrier()
        request = dist.irecv(got, tag=9)  # from any rank
        if rank == 0:
            world.Barrier()  # (the receive is posted everywhere before the sends)
        sent = dist.isend(torch.full((5,), 1.0, dtype=torch.float64), right, tag=9)
        if rank != 0:
            world.Barrier()
        request.wait()
        sent.wait()

    events = traced(root, world, calls)
    ops = sorted((e for e in events if e["name"].startswith(("torch.distributed.send",
                                                             "torch.distributed.recv"))),
                 key=lambda e: e["ts"])
    posts = [(e["name"], e["args"]["peer"], e["args"]["tag"]) for e in ops
             if not e["name"].endswith(" wait")]
    first = [("torch.distributed.send", right, 7), ("torch.distributed.recv", left, 7)]
    assert posts[:2] == (first if rank % 2 == 0 else first[::-1]), posts
    assert sorted(posts[2:]) == [("torch.distributed.recv", -1, 9),
                                 ("torch.distributed.send", right, 9)], posts
    for e in ops:
        assert e["cat"] == "cpu_op"
        args = e["args"]
        assert args["Collective name"] == e["name"].split(".")[-1].split()[0], e
        assert args["dtype"] == "float64" and args["bytes"] == 40, e
        assert args["Group size"] == size and args["Process Group Name"] == pg.group_name
        assert (args["In msg nelems"], args["Out msg nelems"]) == \
            ((5, 0) if args["Collective name"] == "send" else (0, 5)), e
    waits = [e for e in ops if e["name"] == "torch.distributed.recv wait"]
    # the blocking receive waited for its sender; the one from any rank names it
    assert any(e["args"]["tag"] == 7 and e["args"]["peer"] == left for e in waits), waits
    assert all(e["args"]["peer"] == left for e in waits if e["args"]["tag"] == 9), waits
    assert torch.equal(got, torch.ones(5, dtype=torch.float64))
