"""Torch in checkpoints and elastic snapshots at 1-4 ranks: ``torch.Tensor`` leaves and
stateful leaves (a module, ``torch.optim.SGD``, mpistrat's ``ZeroRedundancyOptimizer``)
round-trip through disk checkpoints and snapshots on every rank (bfloat16 and float16
too); an optimizer state that appears after a snapshot changes the slot's shape without
making the older snapshot unrestorable; a damaged states index is skipped with its
reason; a ZeRO state taken at N ranks is restored into a ZeRO over half of them and
re-split. ``DistributedBatchSampler``: shares, order, resume skip, and the global batch's
gradient at any number of ranks equal to one process's.
"""

from __future__ import annotations

import contextlib
import os
import struct
import uuid
import warnings

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import mpistrat.torch as mt  # noqa: E402
from mpistrat.checkpoint import Checkpoint, CheckpointManager, Scalar  # noqa: E402
from mpistrat.checkpoint.snapshot import SnapshotStore  # noqa: E402
from mpistrat.elastic import hooks  # noqa: E402
from mpistrat.elastic.env import ElasticEnv, set_job_secret  # noqa: E402
from mpistrat.torch.sampler import share  # noqa: E402

MPI = pytest.importorskip("mpi4py.MPI")
pytestmark = pytest.mark.timeout(60)
torch.set_num_threads(1)
SECRET = b"the job's secret, 32 bytes long!"


def same_everywhere(comm, value) -> bool:
    return len({repr(v) for v in comm.allgather(value)}) == 1


def net(seed=0, width=5):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 3))
    model.register_buffer("seen", torch.zeros(7, dtype=torch.float64))
    return model


def make_optimizer(kind, model, comm):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return mt.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, comm=comm,
                                      lr=0.01)


def train(model, optimizer, steps, seed=0):
    for step in range(steps):
        generator = torch.Generator().manual_seed(seed * 100 + step)
        x, y = torch.randn(6, 4, generator=generator), torch.randn(6, 3, generator=generator)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        getattr(model, "module", model).seen += 1


def full_state(optimizer, comm):
    """The whole optimizer state as rank 0 sees it (consolidated for ZeRO), as bytes."""
    if isinstance(optimizer, mt.ZeroRedundancyOptimizer):
        optimizer.consolidate_state_dict(to=0)
        if comm.rank != 0:
            return comm.bcast(None)
    state = optimizer.state_dict()
    text = repr(sorted((k, sorted((n, v.numpy().tobytes() if torch.is_tensor(v) else v)
                                  for n, v in s.items()))
                       for k, s in state["state"].items())) + repr(state["param_groups"])
    return comm.bcast(text)


def weights(model):
    return [t.detach().clone() for t in model.state_dict().values()]


def equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


# --- disk checkpoints ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sgd", "zero"])
def test_a_disk_checkpoint_round_trips_module_optimizer_and_tensors(world, root, kind):
    model = net()
    ddp = mt.DistributedDataParallel(model, comm=world)
    optimizer = make_optimizer(kind, model, world)
    half = torch.arange(6, dtype=torch.float32).reshape(2, 3).to(torch.bfloat16) / 3
    small = torch.linspace(-1, 1, 5).to(torch.float16)
    epoch = Scalar(0)
    ckpt = Checkpoint(comm=world, model=model, optimizer=optimizer,
                      extra={"half": half, "small": small}, epoch=epoch)
    empty = ckpt.save(os.path.join(root, "ckpt"))  # no optimizer state yet
    train(ddp, optimizer, 2)
    epoch.assign(2)
    path = ckpt.save(os.path.join(root, "ckpt"))
    saved_w, saved_opt = weights(model), full_state(optimizer, world)
    saved_half, saved_small = half.clone(), small.clone()
    train(ddp, optimizer, 1, seed=5)
    half.mul_(2)
    small.add_(1)
    epoch.assign(7)
    assert not equal(weights(model), saved_w)
    assert ckpt.restore(path) == path
    assert equal(weights(model), saved_w) and full_state(optimizer, world) == saved_opt
    assert half.dtype == torch.bfloat16 and torch.equal(half, saved_half)
    assert small.dtype == torch.float16 and torch.equal(small, saved_small)
    assert int(epoch) == 2
    # the steps go on exactly as they would have
    train(ddp, optimizer, 1, seed=5)
    after = weights(model)
    ckpt.restore(path)
    train(ddp, optimizer, 1, seed=5)
    assert equal(weights(model), after)
    assert same_everywhere(world, [t.numpy().tobytes() for t in after])
    # the save before the first step: no optimizer state
    ckpt.restore(empty)
    assert int(epoch) == 0 and (kind == "zero" or not optimizer.state)


def test_a_checkpoint_of_another_model_is_the_same_error_everywhere(world, root):
    model = net(width=5)
    ckpt = Checkpoint(comm=world, model=model)
    path = ckpt.save(os.path.join(root, "ckpt"))
    other = Checkpoint(comm=world, model=net(width=6))
    with pytest.raises(ValueError, match=r"entry 'model': 0.weight holds float32 of shape "
                                         r"\[5, 4\], the module's is float32 of shape \[6, 4\]"):
        other.restore(path)


def test_a_forged_state_tree_is_a_corrupt_checkpoint(world, root):
    import json

    from mpistrat.checkpoint import CheckpointCorruptError

    model = net()
    ckpt = Checkpoint(comm=world, model=model)
    path = ckpt.save(os.path.join(root, "ckpt"))
    world.Barrier()
    if world.rank == 0:
        with open(path + ".json") as file:
            manifest = json.load(file)
        manifest["entries"][0]["tree"] = {"d": [["0.weight", {"T": 0}], ["x", {"T": 0}]]}
        with open(path + ".json", "w") as file:
            json.dump(manifest, file)
    world.Barrier()
    with pytest.raises(CheckpointCorruptError, match="one named twice"):
        ckpt.restore(path)


# --- snapshots ----------------------------------------------------------------------------


def store_for(ckpt, job, root, comm, restart=0):
    return SnapshotStore(ckpt, ElasticEnv(job, restart, (comm.size,)), SECRET, comm=comm,
                         root=root)


def new_job(comm):
    return comm.bcast(uuid.uuid4().hex if comm.rank == 0 else None)


def store_slot(store, sequence):
    """The store's slot file that holds snapshot ``sequence`` (on this host)."""
    for slot in store._slots:
        with open(slot.path, "rb") as file:
            magic, found = struct.unpack("<8sQ", file.read(16))
        if magic == b"MPSNAP01" and found == sequence:
            return slot.path
    raise AssertionError(f"no slot holds snapshot {sequence}")


@pytest.mark.parametrize("kind", ["sgd", "zero"])
def test_snapshots_follow_an_optimizer_state_that_appears(world, root, kind):
    model = net()
    ddp = mt.DistributedDataParallel(model, comm=world)
    optimizer = make_optimizer(kind, model, world)
    half = torch.ones(3, dtype=torch.bfloat16) / 3
    ckpt = Checkpoint(comm=world, model=model, optimizer=optimizer, half=half)
    job = new_job(world)
    store = store_for(ckpt, job, root, world)
    store.take(("k", 0))  # before the first step: no optimizer state
    first_w, first_opt = weights(model), full_state(optimizer, world)
    train(ddp, optimizer, 2)
    half.mul_(3)
    store.take(("k", 2))  # the state is there now: the other slot, larger
    second_w, second_opt, second_half = weights(model), full_state(optimizer, world), \
        half.clone()
    train(ddp, optimizer, 1, seed=3)
    info = store.restore()
    assert info.sequence == 2 and info.position == ("k", 2) and info.skipped == ()
    assert equal(weights(model), second_w) and full_state(optimizer, world) == second_opt
    assert torch.equal(half, second_half)
    # the older snapshot, of the other structure, is still restorable on its own
    world.Barrier()
    if store.writer:
        os.unlink(info.path)
    world.Barrier()
    info = store.restore()
    assert info.sequence == 1 and equal(weights(model), first_w)
    assert full_state(optimizer, world) == first_opt
    # a snapshot taken again after that restore goes on from it
    train(ddp, optimizer, 2)
    store.take(("k", 2))
    store.take(("k", 3))
    assert store.restore().sequence == 3
    assert same_everywhere(world, [t.numpy().tobytes() for t in weights(model)])
    store.close()
    # a relaunch finds it with a new store
    store2 = store_for(ckpt, job, root, world, restart=1)
    assert store2.restore().sequence == 3
    store2.close()


@pytest.mark.parametrize("width", [9, 160_000])  # (the module's state shared too: 4.3 MiB)
def test_each_rank_copies_its_own_share_of_a_zero_state(world, root, monkeypatch, width):
    """mpistrat's ZeroRedundancyOptimizer (Adam) over the host's ranks: a snapshot gathers
    nothing (no consolidate_state_dict); each rank copies the arrays of the parameters it
    steps, the index names the share that holds each (every rank's share there), and
    the whole state comes back on every rank. A byte flipped after the commit in an array
    of the last rank's share: that snapshot is skipped, naming the share, the one before
    restored. With a module of 4.3 MiB, the host's ranks share the copy of its state
    too."""
    model = net(width=width)
    ddp = mt.DistributedDataParallel(model, comm=world)
    optimizer = make_optimizer("zero", model, world)
    ckpt = Checkpoint(comm=world, model=model, optimizer=optimizer)
    store = store_for(ckpt, new_job(world), root, world)
    train(ddp, optimizer, 2)
    gathered = []
    consolidate = mt.ZeroRedundancyOptimizer.consolidate_state_dict
    monkeypatch.setattr(mt.ZeroRedundancyOptimizer, "consolidate_state_dict",
                        lambda self, to=0: gathered.append(to))
    store.take(("k", 2))
    store.wait()
    assert gathered == []
    monkeypatch.setattr(mt.ZeroRedundancyOptimizer, "consolidate_state_dict", consolidate)
    first_w, first_opt = weights(model), full_state(optimizer, world)
    train(ddp, optimizer, 1, seed=4)
    store.take(("k", 3))
    store.wait()
    last = world.size - 1
    world.Barrier()
    if store.writer:
        path = store_slot(store, 1)
        record = store.check(path, store.check_layout(store.layout_path))
        (_, _, entries), = [s for s in record["states"] if s[0] == "optimizer"]
        owners = [e.get("owner") for e in entries]
        assert record["parts"] == world.size and set(owners) - {None} == set(range(world.size))
        assert record["state_parts"] == (world.size if width > 9 else 1)
        # the newest: a byte of the last share's largest array flipped
        record = store.check(store_slot(store, 2), store.check_layout(store.layout_path))
        (_, _, entries), = [s for s in record["states"] if s[0] == "optimizer"]
        entry = max((e for e in entries if e.get("owner") == last), key=lambda e: e["nbytes"])
        with open(store_slot(store, 2), "r+b") as file:
            file.seek(entry["offset"] + entry["nbytes"] // 2)
            byte = file.read(1)
            file.seek(entry["offset"] + entry["nbytes"] // 2)
            file.write(bytes([byte[0] ^ 1]))
    world.Barrier()
    info = store.restore()
    assert info.sequence == 1 and equal(weights(model), first_w)
    assert full_state(optimizer, world) == first_opt
    assert len(info.skipped) == 1 and "does not match its checksum" in info.skipped[0] \
        and f"share {last}'s own" in info.skipped[0], info.skipped
    # training goes on from it as from the state it holds
    train(ddp, optimizer, 1, seed=4)
    assert same_everywhere(world, [t.numpy().tobytes() for t in weights(model)])
    store.close()


@pytest.mark.parametrize("where, reason", [
    ("index", "states' index does not match its checksum"),
    ("checksums", "states' checksums do not match their digest")])
def test_a_damaged_states_index_is_skipped_with_its_reason(world, root, where, reason):
    """A byte flipped in the newest slot's states index (its end), or in the states'
    checksums that follow it: that snapshot is skipped with the reason, the one before
    restored."""
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ckpt = Checkpoint(comm=world, model=model, optimizer=optimizer)
    store = store_for(ckpt, new_job(world), root, world)
    train(model, optimizer, 1)
    store.take(None)
    first = weights(model)
    train(model, optimizer, 1)
    store.take(None)
    world.Barrier()
    if store.writer:  # flip the last byte of the newest slot's index
        import json
        import struct

        newest = next(p for p in (os.path.join(store.directory, f"slot-{i}.data")
                                  for i in (0, 1))
                      if struct.unpack_from("<8sQ", open(p, "rb").read(16))[1] == 2)
        with open(newest, "r+b") as file:
            head = file.read(4096)
            length = struct.unpack_from("<Q", head, 16)[0]
            record = json.loads(head[56:56 + length])
            end = record["states"]["size"]
            at = end - 2 if where == "index" else end + 2
            file.seek(at)
            byte = file.read(1)
            file.seek(at)
            file.write(bytes([byte[0] ^ 1]))
    world.Barrier()
    info = store.restore()
    assert info.sequence == 1 and equal(weights(model), first)
    assert len(info.skipped) == 1 and reason in info.skipped[0], info.skipped
    store.close()


def test_a_zero_state_taken_at_n_ranks_is_resplit_over_half_of_them(world, root):
    """The snapshot of a ZeRO (Adam) at N ranks, restored into a ZeRO over the first
    ceil(N/2) ranks: the same consolidated state, each rank holding its new share, and
    the next step the same as an unsharded Adam's from the same state."""
    model = net()
    ddp = mt.DistributedDataParallel(model, comm=world)
    optimizer = make_optimizer("zero", model, world)
    ckpt = Checkpoint(comm=world, model=model, optimizer=optimizer)
    job = new_job(world)
    train(ddp, optimizer, 3)
    store = store_for(ckpt, job, root, world)
    store.take(("k", 3))
    taken_w, taken_opt = weights(model), full_state(optimizer, world)
    store.close()
    half = (world.size + 1) // 2
    sub = world.Split(0 if world.rank < half else MPI.UNDEFINED, world.rank)
    problems = []
    if sub != MPI.COMM_NULL:
        model2 = net(seed=9)
        ddp2 = mt.DistributedDataParallel(model2, comm=sub)
        optimizer2 = make_optimizer("zero", model2, sub)
        ckpt2 = Checkpoint(comm=sub, model=model2, optimizer=optimizer2)
        store2 = SnapshotStore(ckpt2, ElasticEnv(job, 1, (world.size, half)), SECRET,
                               comm=sub, root=root)
        info = store2.restore()
        if info is None or info.world_size != world.size:
            problems.append(f"restored {info}")
        if not equal(weights(model2), taken_w):
            problems.append("weights differ")
        if full_state(optimizer2, sub) != taken_opt:
            problems.append("the consolidated state differs")
        mine = {id(p) for g in optimizer2.optim.param_groups for p in g["params"]} \
            if optimizer2.optim is not None else set()
        held = {id(p) for p in optimizer2.optim.state} if optimizer2.optim else set()
        if held != mine:
            problems.append("a rank holds state outside its share")
        # one more step against an unsharded Adam loaded with the same state
        plain_model = net(seed=9)
        plain_model.load_state_dict(model2.state_dict())
        plain = torch.optim.Adam(plain_model.parameters(), lr=0.01)
        optimizer2.consolidate_state_dict(to=0)
        consolidated = sub.bcast(optimizer2.state_dict() if sub.rank == 0 else None)
        plain.load_state_dict(consolidated)
        train(ddp2, optimizer2, 1, seed=4)
        train(plain_model, plain, 1, seed=4)
        if not all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in
                   zip(weights(model2)[:4], weights(plain_model)[:4])):
            problems.append("the step after the re-split differs from an unsharded Adam's")
        store2.close()
        sub.Free()
    everyone = world.allgather(problems)
    assert everyone == [[]] * world.size, everyone


def test_the_manager_snapshots_at_the_samplers_boundaries_and_resumes_there(world, root,
                                                                            monkeypatch):
    """In an elastic job the sampler's batches are the step boundaries: after a relaunch
    the manager restores the snapshot and the sampler skips the batches trained on."""
    job = new_job(world)
    monkeypatch.setenv("MPISTRAT_ELASTIC_DIR", root)
    for name, value in ElasticEnv(job, 0, (world.size,), (), 1).as_env().items():
        monkeypatch.setenv(name, value)
    set_job_secret(SECRET)
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    epoch = Scalar(0)
    manager = CheckpointManager(Checkpoint(comm=world, model=model, optimizer=optimizer,
                                           epoch=epoch), os.path.join(root, "ckpt"))
    sampler = mt.DistributedBatchSampler(40, 8, comm=world)
    handed = []
    for batch in sampler:  # a snapshot before each batch; stop during batch 3
        handed.append(batch)
        if len(handed) == 4:
            break
        train(model, optimizer, 1, seed=len(handed))
    expected_w = weights(model)  # after batches 0, 1, 2
    manager._snapshots.close()
    hooks.set_taker(None)
    for name, value in ElasticEnv(job, 1, (world.size, world.size), (), 1).as_env().items():
        monkeypatch.setenv(name, value)
    model2 = net(seed=3)
    optimizer2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    manager2 = CheckpointManager(Checkpoint(comm=world, model=model2, optimizer=optimizer2,
                                            epoch=Scalar(0)), os.path.join(root, "ckpt"))
    assert manager2.restore_or_initialize() is not None
    assert manager2.restored_snapshot.position == (sampler.kind, 3)
    assert equal(weights(model2), expected_w)
    sampler2 = mt.DistributedBatchSampler(40, 8, comm=world)
    resumed = list(sampler2)
    assert resumed[0] == handed[3] and len(resumed) == 2
    manager2._snapshots.close()


# --- the sampler --------------------------------------------------------------------------


def test_shares_are_contiguous_and_even():
    for count in range(1, 30):
        for ranks in range(1, 6):
            spans = [share(count, ranks, r) for r in range(ranks)]
            assert spans[0][0] == 0 and spans[-1][1] == count
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            sizes = [b - a for a, b in spans]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("drop_last", [False, True])
def test_the_sampler_cuts_the_same_global_batches_at_any_number_of_ranks(world, drop_last):
    size, global_batch = 53, 10 if drop_last else 12  # 53 % 12 = 5 >= 4 ranks
    sampler = mt.DistributedBatchSampler(size, global_batch, seed=3, drop_last=drop_last,
                                         comm=world)
    sampler.set_epoch(2)
    mine = list(sampler)
    assert len(mine) == len(sampler) == (size // global_batch if drop_last
                                         else -(-size // global_batch))
    everyone = world.allgather(mine)
    alone = mt.DistributedBatchSampler(size, global_batch, seed=3, drop_last=drop_last,
                                       comm=MPI.COMM_SELF)
    alone.set_epoch(2)
    for step, whole in enumerate(alone):
        assert [i for part in everyone for i in part[step]] == whole
        assert whole == sampler.global_batch(step)
    order = sampler.order()
    assert sorted(order.tolist()) == list(range(size))
    alone.set_epoch(3)
    assert alone.order().tolist() != order.tolist()  # a new order each epoch
    covered = sorted(i for part in everyone for batch in part for i in batch)
    assert covered == sorted(order[:len(sampler) * global_batch].tolist())


def test_the_sampler_skips_the_restored_batches_once(world):
    sampler = mt.DistributedBatchSampler(40, 8, comm=world)
    everything = list(sampler)
    hooks.set_resume((sampler.kind, 3))
    assert list(sampler) == everything[3:]
    assert list(sampler) == everything  # (the next epoch starts at its beginning)
    hooks.set_resume(("DistributedBatchSampler/41/8/0", 3))  # another sampler's
    assert list(sampler) == everything


def test_the_sampler_marks_a_boundary_before_each_batch(world):
    seen = []
    hooks.set_taker(seen.append)
    sampler = mt.DistributedBatchSampler(24, 8, comm=world)
    for _ in sampler:
        pass
    assert seen == [(sampler.kind, i) for i in range(3)]


@pytest.mark.parametrize("workers, prefetch, resume", [(0, None, 0), (2, 2, 0), (2, 3, 5),
                                                     (1, 1, 0), (2, 4, 2)])
def test_with_worker_processes_the_sampler_follows_the_batch_the_loop_takes(
        world, workers, prefetch, resume):
    """torch's DataLoader with worker processes asks the sampler for batches ahead of the
    loop; through mpistrat.torch.DataLoader every boundary the sampler marks says exactly
    the batches the loop has taken (those trained), and its global_size is the size of the
    batch the loop trains on, whatever the workers, the prefetch and a restored
    position."""
    steps, size = 12, 8
    data = torch.utils.data.TensorDataset(torch.arange(size * steps - 3))  # (last: 5)
    sampler = mt.DistributedBatchSampler(len(data), size, shuffle=False, comm=MPI.COMM_SELF)
    options = {} if prefetch is None else {"prefetch_factor": prefetch}
    loader = mt.DataLoader(data, batch_sampler=sampler, num_workers=workers, **options)
    taken, marks, sizes = [], [], []
    hooks.set_taker(lambda position: marks.append((position, len(taken))))
    try:
        if resume:
            hooks.set_resume((sampler.kind, resume))
        for (batch,) in loader:
            taken.append(int(batch[0]) // size)
            sizes.append((len(batch), sampler.global_size))
    finally:
        hooks.set_taker(None)
    assert taken == list(range(resume, steps))
    # each boundary (kind, i) comes when the loop has taken batches resume .. i - 1
    assert marks == [((sampler.kind, i), i - resume) for i in range(resume, steps)], marks
    assert all(got == want for got, want in sizes), sizes
    assert sizes[-1] == (5, 5)
    # the sampler iterated directly afterwards marks its own boundaries again
    marks.clear()
    hooks.set_taker(lambda position: marks.append((position, 0)))
    try:
        assert len(list(sampler)) == steps
    finally:
        hooks.set_taker(None)
    assert [m[0] for m in marks] == [(sampler.kind, i) for i in range(steps)]


def test_the_data_loader_refuses_batches_out_of_order():
    import inspect

    if "in_order" not in inspect.signature(torch.utils.data.DataLoader).parameters:
        pytest.skip("this torch has no DataLoader(in_order=...)")
    sampler = mt.DistributedBatchSampler(16, 8, comm=MPI.COMM_SELF)
    with pytest.raises(ValueError, match="in_order=False"):
        mt.DataLoader(torch.utils.data.TensorDataset(torch.arange(16)),
                      batch_sampler=sampler, num_workers=1, in_order=False)


def test_bad_sampler_arguments_say_what_to_give(world):
    with pytest.raises(ValueError, match="global_batch_size must be an integer >= 1"):
        mt.DistributedBatchSampler(10, 0, comm=world)
    if world.size > 1:
        with pytest.raises(ValueError, match="below the number of ranks"):
            mt.DistributedBatchSampler(10, world.size - 1, comm=world)
        with pytest.raises(ValueError, match="give drop_last=True"):
            mt.DistributedBatchSampler(8 * world.size + 1, 8 * world.size, comm=world)


@pytest.mark.parametrize("global_batch", [7, 10])  # not divisible by 3 (nor 4)
def test_the_gradient_is_the_global_batchs_mean_whatever_the_shares(world, global_batch):
    data = torch.randn(30, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    target = torch.randn(30, 3, generator=torch.Generator().manual_seed(1),
                         dtype=torch.float64)
    model = net().double()
    ddp = mt.DistributedDataParallel(model, comm=world)
    sampler = mt.DistributedBatchSampler(30, global_batch, comm=world, drop_last=True)
    reference = net().double()
    alone = mt.DistributedBatchSampler(30, global_batch, comm=MPI.COMM_SELF, drop_last=True)
    for mine, whole in zip(sampler, alone):
        model.zero_grad()
        loss = nn.functional.mse_loss(ddp(data[mine]), target[mine], reduction="sum")
        (loss * sampler.loss_scale).backward()
        reference.zero_grad()
        nn.functional.mse_loss(reference(data[whole]), target[whole],
                               reduction="sum").div(len(whole)).backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)


def test_auto_snapshots_of_a_sharded_optimizer_are_taken_by_every_rank_or_none(
        world, root, monkeypatch):
    """``--snapshot-every auto`` with a ZeroRedundancyOptimizer, whose snapshot is
    collective on a host of several ranks (each copies its own share): rank 0 decides for
    every rank (only writers know a snapshot's cost), so a skipped snapshot is skipped
    everywhere, never one some ranks wait in."""
    monkeypatch.setenv("MPISTRAT_ELASTIC_DIR", root)
    for name, value in ElasticEnv(new_job(world), 0, (world.size,), (), 0).as_env().items():
        monkeypatch.setenv(name, value)
    set_job_secret(SECRET)
    model = net()
    optimizer = make_optimizer("zero", model, world)
    manager = CheckpointManager(Checkpoint(comm=world, model=model, optimizer=optimizer),
                                os.path.join(root, "ckpt"))
    sampler = mt.DistributedBatchSampler(40, 8, comm=world)
    for index, _ in enumerate(sampler):
        store = manager._snapshots
        assert store is not None and store.collective == (world.size > 1)
        if index == 1:  # the writers find snapshots too costly now; the others cannot know
            store.last_cost = 1e9 if store.writer else 0.0
            taken = store.sequence  # (a slot's first snapshot does not count as a cost)
    assert store.sequence == taken  # none after: too costly, on rank 0 and so everywhere
    assert same_everywhere(world, store.sequence)
    store.close()


# --- a large replicated state: each rank of a host copies a share of it -------------------


def test_a_large_replicated_state_is_shared_by_the_hosts_ranks(world, root):
    """A module of 4.3 MiB and its SGD momentum (every rank's replica the same): every
    rank of the host copies a share of the states' arrays, the record says so, and the
    newest snapshot comes back on every rank, an optimizer state that appeared in between
    included."""
    model = net(width=160_000)
    ddp = mt.DistributedDataParallel(model, comm=world)
    optimizer = make_optimizer("sgd", model, world)
    ckpt = Checkpoint(comm=world, model=model, optimizer=optimizer)
    store = store_for(ckpt, new_job(world), root, world)
    store.take(("k", 0))
    train(ddp, optimizer, 2)
    store.take(("k", 2))  # (the momentum is there now)
    second_w, second_opt = weights(model), full_state(optimizer, world)
    store.wait()
    world.Barrier()
    record = store.check(store_slot(store, 2), store.check_layout(store.layout_path)) \
        if store.writer else None
    parts = world.bcast(record and (record["parts"], record["state_parts"]))
    assert parts == (world.size, world.size)
    train(ddp, optimizer, 1, seed=3)
    info = store.restore()
    assert info.sequence == 2 and info.skipped == ()
    assert equal(weights(model), second_w) and full_state(optimizer, world) == second_opt
    store.close()


def test_a_zero_state_whose_ranks_are_not_the_hosts_is_gathered(world, root, monkeypatch):
    """ZeroRedundancyOptimizer on virtual nodes of one rank (MPISTRAT_RANKS_PER_NODE=1):
    each rank holds the whole state, but the host's ranks are not the optimizer's, so
    the state is gathered on the host's writer at each snapshot (as for torch's own
    ZeroRedundancyOptimizer), and round-trips on every rank."""
    monkeypatch.setenv("MPISTRAT_RANKS_PER_NODE", "1")
    model = net(width=9)
    ddp = mt.DistributedDataParallel(model, comm=world)
    optimizer = make_optimizer("zero", model, world)
    store = store_for(Checkpoint(comm=world, model=model, optimizer=optimizer),
                      new_job(world), root, world)
    assert store._gathered == (world.size > 1) and bool(store._sharded) == (world.size == 1)
    train(ddp, optimizer, 2)
    store.take(("k", 2))
    saved_w, saved_opt = weights(model), full_state(optimizer, world)
    train(ddp, optimizer, 1, seed=3)
    info = store.restore()
    assert info.sequence == 1 and info.skipped == ()
    assert equal(weights(model), saved_w) and full_state(optimizer, world) == saved_opt
    store.close()


def test_an_index_naming_a_share_that_was_not_is_skipped(world, root):
    """The newest ZeRO snapshot's index, rewritten to say that one of its arrays is held
    by share 7 of a host that had fewer, and authenticated again (as a faulty writer
    would have committed it): the restore skips it with the reason on every rank and
    restores the one before, never reading a share that is not there."""
    import hashlib
    import json

    model = net(width=9)
    ddp = mt.DistributedDataParallel(model, comm=world)
    optimizer = make_optimizer("zero", model, world)
    store = store_for(Checkpoint(comm=world, model=model, optimizer=optimizer),
                      new_job(world), root, world)
    train(ddp, optimizer, 1)
    store.take(("k", 1))
    first_w, first_opt = weights(model), full_state(optimizer, world)
    train(ddp, optimizer, 1, seed=2)
    store.take(("k", 2))
    store.wait()
    world.Barrier()
    if store.writer:
        layout = store.check_layout(store.layout_path)
        with open(store_slot(store, 2), "r+b") as file:
            head = file.read(4096)
            length = struct.unpack_from("<Q", head, 16)[0]
            record = json.loads(head[56:56 + length])
            at, size = record["states"]["index"]
            file.seek(at)
            index = file.read(size)
            owner = f'"owner":{world.size - 1}'.encode()
            assert owner in index
            index = index.replace(owner, b'"owner":7', 1)
            file.seek(at)
            file.write(index)
            record["states"]["sha256"] = hashlib.sha256(index).hexdigest()
            body = json.dumps(record, separators=(",", ":")).encode()
            assert len(body) == length
            file.seek(24)
            file.write(store._mac(layout["digest"], 2, body) + body)
    world.Barrier()
    info = store.restore()
    assert info.sequence == 1 and equal(weights(model), first_w)
    assert full_state(optimizer, world) == first_opt
    assert len(info.skipped) == 1 and "is held by share 7, not one of its " \
        f"{world.size}" in info.skipped[0], info.skipped
    store.close()


def take_as_if_on_a_device(store, comm, monkeypatch, total):
    """Take a snapshot with every tensor taken for a device one, and check that the
    bytes brought to host memory over the host's ranks (all of ``comm``) are the
    ``total`` bytes of the state once, each rank about its share."""
    from mpistrat.checkpoint import _torch as torch_leaves

    asked = []
    monkeypatch.setattr(torch_leaves, "on_device", lambda tensor: True)
    host_value = torch_leaves.host_value
    monkeypatch.setattr(torch_leaves, "host_value", lambda tensor: asked.append(
        tensor.numel() * tensor.element_size()) or host_value(tensor))
    store.take(("k", 1))
    store.wait()
    monkeypatch.undo()
    assert comm.allreduce(sum(asked)) == total
    assert abs(sum(asked) - total / comm.size) <= 4096 * comm.size


def test_each_rank_brings_only_its_pieces_of_the_states_to_the_host(world, root,
                                                                    monkeypatch):
    """The states are expanded as tensors, and a rank brings to host memory only the
    pieces it copies of a device tensor (only those bytes cross the bus; the tensors here
    taken for device ones): over the host's ranks, the states' bytes once, each rank
    about its share."""
    from mpistrat.checkpoint import _torch as torch_leaves

    model = net(width=160_000)
    ddp = mt.DistributedDataParallel(model, comm=world)
    optimizer = make_optimizer("sgd", model, world)
    train(ddp, optimizer, 1)
    total = torch_leaves.nbytes(model) + torch_leaves.nbytes(optimizer)
    store = store_for(Checkpoint(comm=world, model=model, optimizer=optimizer),
                      new_job(world), root, world)
    take_as_if_on_a_device(store, world, monkeypatch, total)
    saved = weights(model)
    train(ddp, optimizer, 1, seed=2)
    assert store.restore().sequence == 1 and equal(weights(model), saved)
    store.close()


def test_each_rank_brings_only_its_pieces_of_a_device_tensor_value_to_the_host(
        world, root, monkeypatch):
    """A tensor of 4.6 MiB as a value of the checkpoint (taken for a device one): it stays
    where it is, and each rank brings over only the bytes of its share of the copy."""
    table = torch.arange(1_200_000, dtype=torch.float32)
    store = store_for(Checkpoint(comm=world, table=table), new_job(world), root, world)
    take_as_if_on_a_device(store, world, monkeypatch, table.numel() * 4)
    saved = table.clone()
    table.mul_(-1)
    assert store.restore().sequence == 1 and torch.equal(table, saved)
    store.close()


def test_a_sharer_whose_state_is_not_the_writers_leaves_the_previous_snapshot(world, root):
    """A sharer's optimizer holding one more state than the writer's: the writer finds
    that its structure is another (the digest posted with its checksums), warns, and
    leaves that snapshot uncommitted; the previous one is restored."""
    if world.size == 1:
        pytest.skip("one rank: nothing is shared")
    model = net(width=160_000)
    ddp = mt.DistributedDataParallel(model, comm=world)
    optimizer = make_optimizer("sgd", model, world)
    ckpt = Checkpoint(comm=world, model=model, optimizer=optimizer)
    store = store_for(ckpt, new_job(world), root, world)
    train(ddp, optimizer, 1)
    store.take(("k", 1))
    first_w = weights(model)
    train(ddp, optimizer, 1, seed=2)
    if world.rank == world.size - 1:
        optimizer.state[next(model.parameters())]["extra"] = torch.zeros(3)
    with pytest.warns(RuntimeWarning, match="share .* stateful objects are not structured "
                      "as the writer's") if store.writer else contextlib.nullcontext():
        store.take(("k", 2))
        store.wait()
    info = store.restore()
    assert info.sequence == 1 and equal(weights(model), first_w)
    assert same_everywhere(world, info.skipped)
    store.close()


def test_a_model_of_hundreds_of_tensors_commits_its_snapshots(world, root):
    """300 parameters of 16 KiB and their momentum (600 arrays, each with a checksum of
    up to 58 digits: far more than a commit record holds): the states' checksums go past
    their index, every snapshot commits, and the newest is restored on every rank."""
    torch.manual_seed(0)
    model = nn.ParameterList([nn.Parameter(torch.randn(4096)) for _ in range(300)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ckpt = Checkpoint(comm=world, model=model, optimizer=optimizer)
    store = store_for(ckpt, new_job(world), root, world)

    def step():
        optimizer.zero_grad()
        sum((p * p).sum() for p in model).backward()
        optimizer.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step()
        store.take(("k", 1))
        step()
        store.take(("k", 2))
        kept, momentum = weights(model), full_state(optimizer, world)
        store.wait()
    assert [str(w.message) for w in caught] == []
    step()
    info = store.restore()
    assert info.sequence == 2 and info.skipped == ()
    assert equal(weights(model), kept) and full_state(optimizer, world) == momentum
    store.close()
