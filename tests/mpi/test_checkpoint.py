"""Checkpoints at 1-4 ranks: the chief writes, every rank restores the chief's values, and
every mistake (a missing, torn or forged checkpoint, different objects, no single chief,
an error on the chief alone) raises the same error on every rank instead of hanging, so a
script that catches it and starts fresh goes on to its next collective."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
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
from mpistrat.checkpoint import _files
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


def _names(directory):
    """The directory's entries, the lock file left out and data files' hashes as ``*``."""
    return sorted(re.sub(r"\.[0-9a-f]{16}\.npz$", ".*.npz", name)
                  for name in os.listdir(directory) if name != _files.LOCK_NAME)


def _manifest(path):
    with open(f"{path}.json") as file:
        return json.load(file)


def _npz(arrays):
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def test_every_rank_restores_the_chiefs_values(comm, shared_dir):
    rank = comm.rank
    w = np.full((3, 5), float(rank), dtype=np.float32)
    step = Scalar(10 + rank)
    manager = CheckpointManager(Checkpoint(comm=comm, w=w, step=step), shared_dir)
    path = manager.save()
    assert path == os.path.join(shared_dir, "ckpt-1")
    assert _names(shared_dir) == ["ckpt-1.*.npz", "ckpt-1.json"]
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
        with open(os.path.join(shared_dir, _manifest(path)["data"]), "r+b") as f:
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
    assert "Checkpoint.save" in str(exc) and "the same objects" in str(exc)
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


# --- forged and damaged checkpoints: the same error everywhere, then start fresh -----------
# Each damage is made by rank 0 of the communicator, the data's size and checksum matching
# the manifest (someone with write access, or a buggy writer), so only the checks of what
# the manifest and the data say catch it. Before, most of these raised on the chief only
# (or restored garbage) while the other ranks waited in a broadcast forever.


def _forge(path, arrays=None, content=None, **fields):
    manifest = _manifest(path)
    directory = os.path.dirname(path)
    if arrays is not None or content is not None:
        content = _npz(arrays) if content is None else content
        sha256 = hashlib.sha256(content).hexdigest()
        old = manifest["data"]
        new = re.sub(r"\.[0-9a-f]{16}\.npz$", f".{sha256[:16]}.npz", old)
        os.unlink(os.path.join(directory, old))
        with open(os.path.join(directory, new), "wb") as file:
            file.write(content)
        manifest.update(data=new, bytes=len(content), sha256=sha256)
    manifest.update(fields)
    with open(f"{path}.json", "w") as file:
        json.dump(manifest, file)


def _outside(directory):
    """A valid npz beside the checkpoint directory; (path, size, sha256)."""
    content = _npz({"a2": np.full(6, 9.0), "a1": np.array(9)})
    path = os.path.join(os.path.dirname(directory), os.path.basename(directory) + ".npz")
    with open(path, "wb") as file:
        file.write(content)
    return path, len(content), hashlib.sha256(content).hexdigest()


def _symlink_to_outside(path):
    outside, _, _ = _outside(os.path.dirname(path))
    _forge(path, content=open(outside, "rb").read())
    data = os.path.join(os.path.dirname(path), _manifest(path)["data"])
    os.unlink(data)
    os.symlink(outside, data)


def _entries(path, change):
    entries = _manifest(path)["entries"]
    change({e["name"]: e for e in entries})
    _forge(path, entries=entries)


DAMAGES = {
    # name: (make it on rank 0, the error every rank raises, what its message says)
    "data is 5": (lambda p: _forge(p, data=5), CheckpointCorruptError, '"data": 5'),
    "data is null": (lambda p: _forge(p, data=None), CheckpointCorruptError, '"data": None'),
    "data is a list": (lambda p: _forge(p, data=["x"]), CheckpointCorruptError, '"data": '),
    "data is a dict": (lambda p: _forge(p, data={"a": 1}), CheckpointCorruptError, '"data": '),
    "data is /etc/passwd": (lambda p: _forge(p, data="/etc/passwd"), CheckpointCorruptError,
                            "'/etc/passwd'"),
    "data outside": (lambda p: _forge(p, data="../" + os.path.basename(_outside(
        os.path.dirname(p))[0]), bytes=_outside(os.path.dirname(p))[1],
        sha256=_outside(os.path.dirname(p))[2]), CheckpointCorruptError, "'../"),
    "symlink at the data name": (_symlink_to_outside, CheckpointCorruptError,
                                 "is a symbolic link"),
    "member of another dtype": (lambda p: _forge(p, arrays={
        "a2": np.arange(6, dtype=np.int64), "a1": np.array(3)}), CheckpointCorruptError,
        "holds int64, the manifest says float64"),
    "member missing": (lambda p: _forge(p, arrays={"a1": np.array(3)}),
                       CheckpointCorruptError, "has no member 'a2'"),
    "member of another shape": (lambda p: _forge(p, arrays={
        "a2": np.zeros((2, 3)), "a1": np.array(3)}), CheckpointCorruptError,
        r"has shape (2, 3), the manifest says (6,)"),
    "truncated npz, checksum matching": (lambda p: _forge(p, content=b"PK\x03\x04 torn"),
                                         CheckpointCorruptError, "cannot be read"),
    "entries not a list": (lambda p: _forge(p, entries={"w": 1}), CheckpointCorruptError,
                           '"entries"'),
    "entry name not a string": (lambda p: _entries(p, lambda e: e["w"].update(name=7)),
                                CheckpointCorruptError, '"name" 7'),
    "entry dtype object": (lambda p: _entries(p, lambda e: e["w"].update(dtype="object")),
                           CheckpointCorruptError, "\"dtype\" 'object'"),
    "entry shape negative": (lambda p: _entries(p, lambda e: e["w"].update(shape=[-6])),
                             CheckpointCorruptError, '"shape" [-6]'),
    "generator state": (lambda p: _entries(p, lambda e: e["rng"].update(state={
        "bit_generator": "PCG64", "state": "x"})), CheckpointCorruptError,
        "expected a state PCG64 accepts"),
    "save_counter text": (lambda p: _forge(p, save_counter="x"), CheckpointCorruptError,
                          '"save_counter"'),
    "version true": (lambda p: _forge(p, version=True), CheckpointCorruptError, '"version"'),
    "manifest missing": (lambda p: os.unlink(p + ".json"), CheckpointNotFoundError,
                         "no checkpoint at"),
    "other objects": (lambda p: _entries(p, lambda e: e["w"].update(name="v")), ValueError,
                      r"missing ['w'], unexpected ['v']"),
}


def _state(rank):
    return {"w": np.full(6, float(rank)), "step": Scalar(rank),
            "rng": np.random.default_rng(rank)}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_bad_checkpoint_is_the_same_error_everywhere_then_start_fresh(comm, shared_dir,
                                                                         damage):
    make, error, says = DAMAGES[damage]
    directory = os.path.join(shared_dir, "ckpts")
    state = _state(comm.rank)
    manager = CheckpointManager(Checkpoint(comm=comm, **state), directory)
    path = manager.save()
    if comm.rank == 0:
        make(path)
    comm.Barrier()
    state["w"][...] = -1
    # the documented pattern: resume, or start fresh when the checkpoint cannot be used
    _, exc = _outcome(lambda: manager.checkpoint.restore(path))
    assert type(exc) is error, exc
    messages = comm.allgather(f"{type(exc).__name__}: {exc}")
    assert len(set(messages)) == 1, messages
    assert says in messages[0] and "read on the chief, rank 0" in messages[0], messages[0]
    assert (state["w"] == -1).all() and int(state["step"]) == comm.rank  # nothing restored
    # ... and every rank goes on to its next collectives, which complete
    assert comm.allreduce(1) == comm.size
    assert manager.save() == os.path.join(directory, "ckpt-2")
    assert manager.restore_or_initialize() == os.path.join(directory, "ckpt-2")
    np.testing.assert_array_equal(state["w"], np.full(6, -1.0))  # the chief's own values


@pytest.mark.mpi(min_size=2)
def test_a_chosen_chief_reports_a_bad_checkpoint_everywhere(world, tmp_path):
    last = world.size - 1
    directory = world.bcast(str(tmp_path) if world.rank == 0 else None)
    ckpt = Checkpoint(comm=world, is_chief=world.rank == last, **_state(world.rank))
    path = ckpt.write(os.path.join(directory, "c"))
    if world.rank == last:
        _forge(path, arrays={"a1": np.array(3)})  # "w" (a2) missing
    world.Barrier()
    _, exc = _outcome(lambda: ckpt.restore(path))
    assert type(exc) is CheckpointCorruptError, exc
    assert f"read on the chief, rank {last}" in str(exc)
    assert len(set(world.allgather(str(exc)))) == 1


class Crash(Exception):
    pass


def test_an_error_on_the_chief_alone_reaches_every_rank(comm, shared_dir, monkeypatch):
    """Any exception type, in every collective function: before, only OSError (and a few
    others when saving) was caught, and the other ranks waited in a broadcast forever."""
    manager = CheckpointManager(Checkpoint(comm=comm, **_state(comm.rank)), shared_dir)
    if comm.rank == 0:
        monkeypatch.setattr(_files, "scan", lambda *a: (_ for _ in ()).throw(KeyError("k")))
        monkeypatch.setattr(np, "savez", lambda *a, **k: (_ for _ in ()).throw(Crash("c")))
    for call in (lambda: latest_checkpoint(shared_dir, comm=comm),
                 lambda: manager.checkpoints, manager.restore_or_initialize):
        _, exc = _outcome(call)
        assert type(exc) is KeyError and "'k' (on the chief, rank 0)" in str(exc), exc
        assert len(set(comm.allgather(str(exc)))) == 1
    _, exc = _outcome(manager.save)
    assert type(exc) is OSError and "failed on the chief (rank 0): Crash: c" in str(exc), exc
    assert len(set(comm.allgather(str(exc)))) == 1 and manager.checkpoint.save_counter == 0
    monkeypatch.undo()
    assert comm.allreduce(1) == comm.size


def test_a_new_run_continues_the_numbering_everywhere(comm, shared_dir):
    """A run that saves without restoring, into the directory of an older one: ckpt-6,
    kept, and the newest on every rank (before: ckpt-1, deleted at once by pruning)."""
    old = Checkpoint(comm=comm, step=Scalar(-1))
    for n in (3, 4, 5):
        old.write(os.path.join(shared_dir, f"ckpt-{n}"))
    step = Scalar(comm.rank + 100)
    manager = CheckpointManager(Checkpoint(comm=comm, step=step), shared_dir, max_to_keep=2)
    path = manager.save()
    assert path == os.path.join(shared_dir, "ckpt-6") and manager.checkpoint.save_counter == 6
    assert [os.path.basename(p) for p in manager.checkpoints] == ["ckpt-5", "ckpt-6"]
    assert latest_checkpoint(shared_dir, comm=comm) == path
    step.assign(0)
    manager.restore_or_initialize()
    assert int(step) == 100
