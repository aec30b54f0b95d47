"""Checkpoints at 1-4 ranks: the chief writes, every rank restores the chief's values, and
every mistake (a missing or torn checkpoint, different objects, no single chief) raises
the same error on every rank instead of hanging."""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import pytest

from mpistrat.checkpoint import (
    Checkpoint,
    CheckpointCorruptError,
    CheckpointManager,
    CheckpointNotFoundError,
    Scalar,
    latest_checkpoint,
)
from mpistrat.errors import CollectiveMismatchError

MPI = pytest.importorskip("mpi4py.MPI")


@pytest.fixture
def shared_dir(comm):
    """A directory every rank of ``comm`` names the same (all ranks share this machine)."""
    path = comm.bcast(tempfile.mkdtemp(prefix="mpistrat-ckpt-") if comm.rank == 0 else None)
    yield path
    comm.Barrier()
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def _outcome(fn):
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001
        return None, exc


def test_every_rank_restores_the_chiefs_values(comm, shared_dir):
    rank = comm.rank
    w = np.full((3, 5), float(rank), dtype=np.float32)
    step = Scalar(10 + rank)
    manager = CheckpointManager(Checkpoint(comm=comm, w=w, step=step), shared_dir)
    path = manager.save()
    assert path == os.path.join(shared_dir, "ckpt-1")
    assert sorted(os.listdir(shared_dir)) == ["ckpt-1.json", "ckpt-1.npz"]
    w[...] = -1
    step.assign(-1)
    assert manager.restore_or_initialize() == path
    np.testing.assert_array_equal(w, np.zeros((3, 5), np.float32))  # rank 0 (the chief)'s
    assert int(step) == 10


def test_a_chosen_chief_writes_and_is_read(comm, shared_dir):
    last = comm.size - 1
    w = np.array([float(comm.rank)])
    ckpt = Checkpoint(comm=comm, is_chief=comm.rank == last, w=w)
    path = ckpt.write(os.path.join(shared_dir, "by-last"))
    w[...] = -5
    ckpt.restore(path)
    assert w[0] == float(last)
    assert latest_checkpoint(shared_dir, None, comm=comm) is None  # not numbered


@pytest.mark.mpi(min_size=2)
def test_two_chiefs_fail_on_every_rank(world, tmp_path):
    ckpt = Checkpoint(comm=world, is_chief=world.rank < 2, s=Scalar(0))
    path = world.bcast(str(tmp_path / "c") if world.rank == 0 else None)
    _, exc = _outcome(lambda: ckpt.save(path))
    assert isinstance(exc, ValueError) and "exactly one chief rank" in str(exc), exc
    assert "ranks [0, 1]" in str(exc)


@pytest.mark.parametrize("damage", ["missing", "torn"])
def test_missing_or_torn_is_the_same_error_everywhere(comm, shared_dir, damage):
    w = np.arange(50.0)
    ckpt = Checkpoint(comm=comm, w=w)
    path = ckpt.save(os.path.join(shared_dir, "ckpt"))
    if damage == "missing":
        path += "0"
    elif comm.rank == 0:
        with open(path + ".npz", "r+b") as f:
            f.truncate(100)
    comm.Barrier()
    _, exc = _outcome(lambda: ckpt.restore(path))
    want = CheckpointNotFoundError if damage == "missing" else CheckpointCorruptError
    assert type(exc) is want, exc
    messages = comm.allgather(str(exc))
    assert len(set(messages)) == 1 and "read on the chief, rank 0" in messages[0]


@pytest.mark.mpi(min_size=2)
def test_different_objects_fail_on_every_rank(world, tmp_path):
    shape = (2,) if world.rank != 1 else (3,)
    ckpt = Checkpoint(comm=world, w=np.zeros(shape))
    path = str(world.bcast(str(tmp_path) if world.rank == 0 else None))
    _, exc = _outcome(lambda: ckpt.save(os.path.join(path, "c")))
    assert isinstance(exc, CollectiveMismatchError), exc
    assert "Checkpoint.write" in str(exc) and "the same objects" in str(exc)
    assert ckpt.save_counter == 0


def test_restore_into_mismatched_objects_fails_everywhere(comm, shared_dir):
    path = Checkpoint(comm=comm, w=np.zeros(4)).save(os.path.join(shared_dir, "ckpt"))
    _, exc = _outcome(lambda: Checkpoint(comm=comm, w=np.zeros(5)).restore(path))
    assert isinstance(exc, ValueError) and "shape (4,)" in str(exc), exc


def test_manager_on_every_rank_sees_the_same_checkpoints(comm, shared_dir):
    step = Scalar(0)
    manager = CheckpointManager(Checkpoint(comm=comm, step=step), shared_dir, max_to_keep=2)
    for _ in range(3):
        step.assign_add(1)
        manager.save()
    names = [os.path.basename(p) for p in manager.checkpoints]
    assert names == ["ckpt-2", "ckpt-3"]
    assert len(set(comm.allgather(tuple(names)))) == 1
    assert latest_checkpoint(shared_dir, comm=comm) == os.path.join(shared_dir, "ckpt-3")
