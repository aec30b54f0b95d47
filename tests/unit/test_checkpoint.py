"""Checkpoints in one process (COMM_SELF): round trips of every kind of object, numbering,
the manager, what a crash at each moment of a save leaves behind, forged and damaged
checkpoints (every one a clear error, never garbage restored), and two processes saving
into one directory."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from mpistrat.checkpoint import (
    PREEMPTION_EXIT_STATUS,
    Checkpoint,
    CheckpointCorruptError,
    CheckpointManager,
    CheckpointNotFoundError,
    PreemptionCheckpointHandler,
    Scalar,
    latest_checkpoint,
)
from mpistrat.checkpoint import _files

MPI = pytest.importorskip("mpi4py.MPI")
SELF = MPI.COMM_SELF


def _names(directory):
    """The directory's entries, the lock file left out and data files' hashes as ``*``."""
    return sorted(re.sub(r"\.[0-9a-f]{16}\.npz$", ".*.npz", name)
                  for name in os.listdir(directory) if name != _files.LOCK_NAME)


def _manifest(path):
    with open(f"{path}.json") as file:
        return json.load(file)


def _data(path):
    """The data file the manifest of ``path`` names."""
    return os.path.join(os.path.dirname(path), _manifest(path)["data"])


def _npz(arrays):
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def _forge(path, arrays=None, content=None, **fields):
    """Rewrite the checkpoint at ``path`` as someone with write access to the directory
    (or a buggy writer) could: new data (``arrays``, or raw ``content``) with a matching
    size and checksum, and manifest fields replaced, so that only checks of what the
    manifest and data say, not of the checksum, can catch it. Works on the format of
    any mpistrat version (the data file's name follows its content when it holds a
    hash)."""
    manifest = _manifest(path)
    if arrays is not None or content is not None:
        content = _npz(arrays) if content is None else content
        sha256 = hashlib.sha256(content).hexdigest()
        old = manifest["data"]
        new = re.sub(r"\.[0-9a-f]{16}\.npz$", f".{sha256[:16]}.npz", old)
        os.unlink(os.path.join(os.path.dirname(path), old))
        with open(os.path.join(os.path.dirname(path), new), "wb") as file:
            file.write(content)
        manifest.update(data=new, bytes=len(content), sha256=sha256)
    manifest.update(fields)
    with open(f"{path}.json", "w") as file:
        json.dump(manifest, file)


class FakeVariable:
    """An object with numpy() and assign(), like mpistrat's variables."""

    def __init__(self, value):
        self.value = np.array(value)

    def numpy(self):
        return self.value.copy()

    def assign(self, value):
        self.value = np.array(value, dtype=self.value.dtype)


def _state(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "params": [rng.standard_normal((3, 4)).astype(np.float32), np.arange(5)],
        "opt": {"momentum": rng.standard_normal(4), "lr": Scalar(0.1)},
        "step": Scalar(7),
        "var": FakeVariable(rng.standard_normal(2)),
        "rng": np.random.default_rng(seed + 100),
    }


def _zeroed(state):
    state["params"][0][...] = 0
    state["params"][1][...] = 0
    state["opt"]["momentum"][...] = 0
    state["opt"]["lr"].assign(0)
    state["step"].assign(0)
    state["var"].assign([0, 0])
    state["rng"] = np.random.default_rng(12345)
    return state


def test_round_trip_restores_every_kind_in_place(tmp_path):
    state = _state()
    ckpt = Checkpoint(comm=SELF, **state)
    path = ckpt.save(str(tmp_path / "ckpt"))
    assert path == str(tmp_path / "ckpt-1") and ckpt.save_counter == 1
    assert _names(tmp_path) == ["ckpt-1.*.npz", "ckpt-1.json"]
    expected_next = state["rng"].random()
    saved = {k: [p.copy() for p in v] if k == "params" else v for k, v in _state().items()}

    other = _zeroed(_state())
    params = other["params"]
    restored = Checkpoint(comm=SELF, **other)
    assert restored.restore(path) == path
    assert other["params"] is params  # arrays were updated in place
    np.testing.assert_array_equal(params[0], saved["params"][0])
    np.testing.assert_array_equal(params[1], saved["params"][1])
    np.testing.assert_array_equal(other["opt"]["momentum"], saved["opt"]["momentum"])
    assert other["opt"]["lr"].value == pytest.approx(0.1) and int(other["step"]) == 7
    np.testing.assert_array_equal(other["var"].value, saved["var"].value)
    assert other["rng"].random() == expected_next  # the generator continues from the save
    assert restored.save_counter == 1


def test_generator_state_resumes_the_same_stream(tmp_path):
    rng = np.random.default_rng(3)
    rng.random(10)
    ckpt = Checkpoint(comm=SELF, rng=rng)
    path = ckpt.write(str(tmp_path / "g"))
    expected = rng.random(5)
    fresh = np.random.default_rng(0)
    Checkpoint(comm=SELF, rng=fresh).restore(path)
    np.testing.assert_array_equal(fresh.random(5), expected)


def test_manifest_names_entries_and_checksum(tmp_path):
    path = Checkpoint(comm=SELF, **_state()).save(str(tmp_path / "ckpt"))
    manifest = _manifest(path)
    assert manifest["format"] == "mpistrat.checkpoint" and manifest["version"] == 2
    content = open(_data(path), "rb").read()
    assert manifest["sha256"] == hashlib.sha256(content).hexdigest()
    assert manifest["data"] == f"ckpt-1.{manifest['sha256'][:16]}.npz"  # content-addressed
    assert manifest["bytes"] == len(content) and manifest["sequence"] == 1
    names = [e["name"] for e in manifest["entries"]]
    assert names == ["opt/lr", "opt/momentum", "params/0", "params/1", "rng", "step", "var"]
    params0 = next(e for e in manifest["entries"] if e["name"] == "params/0")
    assert params0["dtype"] == "float32" and params0["shape"] == [3, 4]
    with np.load(_data(path)) as npz:  # plain NumPy reads the data
        np.testing.assert_array_equal(npz[params0["key"]].shape, (3, 4))


def test_files_get_the_usual_permissions(tmp_path):
    umask = os.umask(0o022)
    os.umask(umask)
    path = Checkpoint(comm=SELF, s=Scalar(0)).save(str(tmp_path / "ckpt"))
    for name in (_data(path), path + ".json", tmp_path / _files.LOCK_NAME):
        assert os.stat(name).st_mode & 0o777 == 0o666 & ~umask


def test_restore_none_restores_nothing(tmp_path):
    step = Scalar(5)
    assert Checkpoint(comm=SELF, step=step).restore(None) is None
    assert int(step) == 5


def test_missing_checkpoint(tmp_path):
    ckpt = Checkpoint(comm=SELF, step=Scalar(0))
    with pytest.raises(CheckpointNotFoundError, match=r"no checkpoint at .*ckpt-9") as info:
        ckpt.restore(str(tmp_path / "ckpt-9"))
    assert isinstance(info.value, FileNotFoundError)


@pytest.mark.parametrize("damage", ["truncate", "flip", "no data", "bad manifest", "foreign"])
def test_damaged_checkpoint_is_an_error(tmp_path, damage):
    w = np.arange(100.0)
    path = Checkpoint(comm=SELF, w=w).save(str(tmp_path / "ckpt"))
    data, record = _data(path), path + ".json"
    if damage == "truncate":
        with open(data, "r+b") as f:
            f.truncate(os.path.getsize(data) // 2)
    elif damage == "flip":
        content = bytearray(open(data, "rb").read())
        content[len(content) // 2] ^= 0xFF
        open(data, "wb").write(bytes(content))
    elif damage == "no data":
        os.unlink(data)
    elif damage == "bad manifest":
        open(record, "w").write("{ not json")
    else:
        open(record, "w").write(json.dumps({"format": "something else"}))
    error = CheckpointNotFoundError if damage == "no data" else CheckpointCorruptError
    before = w.copy()
    w[...] = -1
    with pytest.raises(error, match="restore an older checkpoint|not an mpistrat"):
        Checkpoint(comm=SELF, w=w).restore(path)
    assert (w == -1).all()  # nothing was half-restored
    assert not (before == -1).all()


def test_objects_must_match_the_checkpoint(tmp_path):
    path = Checkpoint(comm=SELF, w=np.zeros((2, 3)), step=Scalar(0)).save(str(tmp_path / "c"))
    with pytest.raises(ValueError, match=r"'w' holds float64 of shape \(2, 3\), the object is "
                                         r"float64 of shape \(3, 2\)"):
        Checkpoint(comm=SELF, w=np.zeros((3, 2)), step=Scalar(0)).restore(path)
    with pytest.raises(ValueError, match=r"'w' holds float64.*the object is float32"):
        Checkpoint(comm=SELF, w=np.zeros((2, 3), np.float32), step=Scalar(0)).restore(path)
    with pytest.raises(ValueError, match=r"missing \['b'\], unexpected \['step'\]"):
        Checkpoint(comm=SELF, w=np.zeros((2, 3)), b=Scalar(0)).restore(path)


@pytest.mark.parametrize("bad, match", [
    ({"n": 3}, r"cannot checkpoint 'n': a int.*Scalar"),
    ({"xs": [1.5]}, r"cannot checkpoint 'xs/0'"),
    ({"d": {1: np.zeros(1)}}, "names must be non-empty strings"),
    ({"d": {"a/b": np.zeros(1)}}, "without '/'"),
])
def test_unsupported_objects_are_refused_at_construction(bad, match):
    with pytest.raises(TypeError, match=match):
        Checkpoint(comm=SELF, **bad)


def test_no_objects():
    with pytest.raises(ValueError, match="keyword arguments"):
        Checkpoint(comm=SELF)


def test_object_arrays_are_refused_when_saving(tmp_path):
    with pytest.raises(OSError, match="dtype object"):
        Checkpoint(comm=SELF, o=np.array([object()])).write(str(tmp_path / "o"))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("value", [np.array(["ab", "c"]), np.array([b"x"]),
                                   np.zeros(2, dtype=[("x", "f4"), ("y", "i4")])])
def test_values_without_a_dtype_name_are_refused_when_saving(tmp_path, value):
    """Strings and structured arrays: the manifest's dtype name would not bring them back
    (before, they were saved and a restore then failed or reinterpreted bytes)."""
    with pytest.raises(OSError, match=r"cannot checkpoint 'v': its dtype .* has no name"):
        Checkpoint(comm=SELF, v=value).write(str(tmp_path / "v"))
    assert os.listdir(tmp_path) == []


def test_big_endian_arrays_round_trip(tmp_path):
    w = np.arange(4, dtype=">f4")
    path = Checkpoint(comm=SELF, w=w).write(str(tmp_path / "b"))
    with np.load(_data(path)) as npz:
        assert npz["a0"].dtype == np.dtype("float32")  # stored in the native order
    out = np.zeros(4, dtype=">f4")
    Checkpoint(comm=SELF, w=out).restore(path)
    np.testing.assert_array_equal(out, [0, 1, 2, 3])


def test_scalar():
    s = Scalar(3)
    assert s.assign_add(2) is s and int(s) == 5 and s.value == 5 and s.dtype == np.int64
    assert float(Scalar(0.5, dtype=np.float32)) == 0.5 and list(range(10))[Scalar(2)] == 2
    assert repr(Scalar(1)) == "Scalar(1, dtype=int64)" and Scalar(1).shape == ()
    with pytest.raises(ValueError, match="one number"):
        Scalar([1, 2])


def test_bfloat16_round_trip(tmp_path):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    w = np.arange(6, dtype=ml_dtypes.bfloat16)
    path = Checkpoint(comm=SELF, w=w).write(str(tmp_path / "b"))
    out = np.zeros(6, dtype=ml_dtypes.bfloat16)
    Checkpoint(comm=SELF, w=out).restore(path)
    np.testing.assert_array_equal(out.astype(np.float32), np.arange(6, dtype=np.float32))


# --- crashes during a save -----------------------------------------------------------------


class Crash(Exception):
    pass


def test_crash_while_writing_data_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    w = np.ones(4)
    ckpt = Checkpoint(comm=SELF, w=w)
    manager = CheckpointManager(ckpt, tmp_path)
    first = manager.save()

    def torn_savez(file, **arrays):
        file.write(b"PK\x03\x04 half a zip")
        raise Crash("killed while writing")

    monkeypatch.setattr(np, "savez", torn_savez)
    with pytest.raises(OSError, match=r"failed on the chief \(rank 0\): Crash: killed while"):
        manager.save()
    assert _names(tmp_path) == ["ckpt-1.*.npz", "ckpt-1.json"]  # temp file removed
    monkeypatch.undo()
    assert latest_checkpoint(str(tmp_path), comm=SELF) == first
    assert manager.restore_or_initialize() == first and ckpt.save_counter == 1


def test_crash_before_the_manifest_hides_the_new_data(tmp_path, monkeypatch):
    w = np.ones(4)
    manager = CheckpointManager(Checkpoint(comm=SELF, w=w), tmp_path)
    first = manager.save()
    real = _files.write_atomically

    def no_manifest(path, content, **kwargs):
        if str(path).endswith(".json"):
            raise Crash("killed before the manifest")
        real(path, content, **kwargs)

    monkeypatch.setattr(_files, "write_atomically", no_manifest)
    w[...] = 2
    with pytest.raises(OSError, match="Crash: killed before the manifest"):
        manager.save()
    monkeypatch.undo()
    assert _names(tmp_path) == ["ckpt-1.*.npz", "ckpt-1.json", "ckpt-2.*.npz"]
    assert manager.latest_checkpoint == first == latest_checkpoint(str(tmp_path), comm=SELF)
    assert manager.checkpoints == [first]
    with pytest.raises(CheckpointNotFoundError):
        manager.checkpoint.restore(str(tmp_path / "ckpt-2"))
    manager.restore_or_initialize()
    assert (w == 1).all()
    # the orphaned data is the crash's leftover: deleted once older than ORPHAN_AGE (a
    # save in progress elsewhere renames its data moments before its manifest)
    orphan = next(tmp_path.glob("ckpt-2.*.npz"))
    assert manager.save() == str(tmp_path / "ckpt-2")  # the failed save never existed
    assert orphan.exists()  # too young to delete
    os.utime(orphan, (1, 1))
    manager.save()
    assert not orphan.exists()
    assert _names(tmp_path) == [f"ckpt-{i}.{ext}" for i in (1, 2, 3) for ext in ("*.npz", "json")]


def test_rewriting_a_path_keeps_its_manifest_until_the_new_one_is_in_place(tmp_path,
                                                                            monkeypatch):
    """Overwriting ckpt-1 in place: a crash mid-way leaves the old checkpoint, complete
    (before, its manifest was deleted first, so the crash lost it)."""
    w = np.ones(4)
    ckpt = Checkpoint(comm=SELF, w=w)
    path = ckpt.write(str(tmp_path / "ckpt-1"))
    w[...] = 2
    monkeypatch.setattr(np, "savez", lambda file, **a: (_ for _ in ()).throw(Crash("killed")))
    with pytest.raises(OSError, match="Crash: killed"):
        ckpt.write(path)
    monkeypatch.undo()
    assert latest_checkpoint(str(tmp_path), comm=SELF) == path
    ckpt.restore(path)
    assert (w == 1).all()


def test_rewriting_a_path_deletes_the_data_it_replaced(tmp_path):
    w = np.ones(4)
    ckpt = Checkpoint(comm=SELF, w=w)
    path = ckpt.write(str(tmp_path / "latest"))
    first = _data(path)
    for value in (2, 2, 3):  # the same content twice: the same data file, kept
        w[...] = value
        ckpt.write(path)
    assert _names(tmp_path) == ["latest.*.npz", "latest.json"] and not os.path.exists(first)
    w[...] = 0
    ckpt.restore(path)
    assert (w == 3).all()


def test_the_checksum_is_of_the_bytes_written(tmp_path, monkeypatch):
    """Another writer replacing the data between its rename and the manifest (or a disk
    that changes it): the manifest holds the checksum of what this save wrote, so the
    restore refuses the other bytes. Before, the checksum was of the file re-read after
    the rename, and the other writer's data restored under this save's manifest."""
    w = np.ones(4)
    ckpt = Checkpoint(comm=SELF, w=w)
    real = os.replace

    def replace_then_clobber(src, dst, *args, **kwargs):
        real(src, dst, *args, **kwargs)
        if str(dst).endswith(".npz"):
            with open(dst, "wb") as file:
                file.write(_npz({"a0": np.full(4, 666.0)}))

    monkeypatch.setattr(os, "replace", replace_then_clobber)
    path = ckpt.write(str(tmp_path / "c"))
    monkeypatch.undo()
    w[...] = 0
    with pytest.raises(CheckpointCorruptError, match="does not match its manifest"):
        ckpt.restore(path)
    assert (w == 0).all()


def test_leftover_temporary_files_are_ignored_then_removed(tmp_path):
    w = np.ones(3)
    manager = CheckpointManager(Checkpoint(comm=SELF, w=w), tmp_path, max_to_keep=2)
    torn = tmp_path / ".ckpt-5.npz.abc123.tmp"
    torn.write_bytes(b"PK torn")
    fake = tmp_path / "ckpt-7.json.tmp"  # not ours: left alone
    fake.write_text("x")
    assert manager.latest_checkpoint is None
    os.utime(torn, (1, 1))  # old: from a crashed job
    manager.save()
    assert not torn.exists() and fake.exists()


# --- numbering and pruning -----------------------------------------------------------------


def test_manager_numbers_and_prunes(tmp_path):
    step = Scalar(0)
    manager = CheckpointManager(Checkpoint(comm=SELF, step=step), tmp_path / "run",
                                max_to_keep=2, checkpoint_name="model")
    assert manager.restore_or_initialize() is None and manager.checkpoints == []
    paths = []
    for _ in range(4):
        step.assign_add(1)
        paths.append(manager.save())
    assert paths == [str(tmp_path / "run" / f"model-{i}") for i in range(1, 5)]
    assert manager.checkpoints == paths[2:]
    assert _names(tmp_path / "run") == [f"model-{i}.{e}" for i in (3, 4) for e in ("*.npz", "json")]
    assert manager.save(checkpoint_number=100).endswith("model-100")
    assert manager.checkpoints == [paths[3], str(tmp_path / "run" / "model-100")]
    assert latest_checkpoint(str(tmp_path / "run"), comm=SELF) is None  # default name "ckpt"
    assert latest_checkpoint(str(tmp_path / "run"), None, comm=SELF).endswith("model-100")
    assert manager.save().endswith("model-101")  # above every number on disk
    step.assign(0)
    fresh = CheckpointManager(Checkpoint(comm=SELF, step=step), tmp_path / "run",
                              checkpoint_name="model")
    assert fresh.restore_or_initialize().endswith("model-101") and int(step) == 4
    assert fresh.checkpoint.save_counter == 101


def _old_run(directory, numbers=(3, 4, 5)):
    """Checkpoints ``ckpt-3..5`` that an earlier run left in ``directory``."""
    old = Scalar(-1)
    ckpt = Checkpoint(comm=SELF, step=old)
    for n in numbers:
        old.assign(n)
        ckpt.write(os.path.join(directory, f"ckpt-{n}"))


def test_a_new_run_continues_the_numbering_and_keeps_its_save(tmp_path):
    """A run that saves without restoring, into the directory of an older run: its save
    is ckpt-6, the newest, and pruning deletes the old run's oldest. Before, it wrote
    ckpt-1, which pruning deleted at once, and latest_checkpoint named the old ckpt-5."""
    _old_run(tmp_path)
    step = Scalar(100)
    manager = CheckpointManager(Checkpoint(comm=SELF, step=step), tmp_path, max_to_keep=2)
    path = manager.save()
    assert path == str(tmp_path / "ckpt-6") and manager.checkpoint.save_counter == 6
    assert manager.checkpoints == [str(tmp_path / "ckpt-5"), path]
    assert latest_checkpoint(str(tmp_path), comm=SELF) == path == manager.latest_checkpoint
    step.assign(0)
    assert manager.restore_or_initialize() == path and int(step) == 100


def test_an_explicit_lower_number_is_the_newest_save(tmp_path):
    """As TF's manager: the save just made is the newest, whatever its number; pruning
    goes by save order and never deletes it."""
    _old_run(tmp_path)
    step = Scalar(7)
    manager = CheckpointManager(Checkpoint(comm=SELF, step=step), tmp_path, max_to_keep=3)
    path = manager.save(checkpoint_number=1)
    assert path == str(tmp_path / "ckpt-1")
    assert manager.checkpoints == [str(tmp_path / f"ckpt-{n}") for n in (4, 5, 1)]
    assert latest_checkpoint(str(tmp_path), comm=SELF) == path
    step.assign(0)
    assert manager.restore_or_initialize() == path and int(step) == 7
    assert manager.save() == str(tmp_path / "ckpt-6")  # above every number on disk
    assert manager.checkpoints == [str(tmp_path / f"ckpt-{n}") for n in (5, 1, 6)]


def test_checkpoint_save_continues_from_the_newest_on_disk(tmp_path):
    _old_run(tmp_path, numbers=(7,))
    ckpt = Checkpoint(comm=SELF, step=Scalar(0))
    assert ckpt.save(tmp_path / "ckpt") == str(tmp_path / "ckpt-8") and ckpt.save_counter == 8
    (tmp_path / "ckpt-20.json").write_text("torn")  # a broken checkpoint is not replaced
    assert ckpt.save(tmp_path / "ckpt") == str(tmp_path / "ckpt-21")
    assert (tmp_path / "ckpt-20.json").read_text() == "torn"


def test_version_1_checkpoints_still_restore_and_count_as_older(tmp_path):
    """A checkpoint of mpistrat before this format (``PATH.npz``, no save sequence)."""
    content = _npz({"a0": np.arange(3.0)})
    (tmp_path / "ckpt-9.npz").write_bytes(content)
    (tmp_path / "ckpt-9.json").write_text(json.dumps({
        "format": "mpistrat.checkpoint", "version": 1, "data": "ckpt-9.npz",
        "bytes": len(content), "sha256": hashlib.sha256(content).hexdigest(),
        "save_counter": 9, "world_size": 2, "created": "2025-01-01T00:00:00Z",
        "entries": [{"name": "w", "kind": "array", "key": "a0", "dtype": "float64",
                     "shape": [3]}]}))
    w = np.zeros(3)
    manager = CheckpointManager(Checkpoint(comm=SELF, w=w), tmp_path, max_to_keep=1)
    assert manager.restore_or_initialize() == str(tmp_path / "ckpt-9")
    np.testing.assert_array_equal(w, [0, 1, 2])
    assert manager.save(checkpoint_number=2) == str(tmp_path / "ckpt-2")  # newer than v1's
    assert _names(tmp_path) == ["ckpt-2.*.npz", "ckpt-2.json"]


def test_hostile_names_and_manifests_do_not_break_the_listing(tmp_path):
    """One bad entry in the directory must not hide the good checkpoints or stop saves:
    before, a manifest nested too deep for json (RecursionError) made every listing
    raise."""
    manager = CheckpointManager(Checkpoint(comm=SELF, s=Scalar(1)), tmp_path)
    good = manager.save()
    manifest = _manifest(good)
    (tmp_path / "ckpt-3.json").write_text("[" * 100_000)
    (tmp_path / "ckpt-4.json").write_bytes(b"\xff\xfe not text")
    # a version 1 checkpoint (complete) with a forged "sequence": ordered as version 1
    (tmp_path / "ckpt-7.npz").write_bytes(open(_data(good), "rb").read())
    (tmp_path / "ckpt-7.json").write_text(json.dumps(
        {**manifest, "version": 1, "data": "ckpt-7.npz", "sequence": "x"}))
    assert manager.checkpoints == [str(tmp_path / "ckpt-7"), good]
    assert latest_checkpoint(str(tmp_path), comm=SELF) == good
    assert manager.save() == str(tmp_path / "ckpt-8")
    assert (tmp_path / "ckpt-3.json").exists()  # unreadable: never deleted


def test_latest_of_a_missing_directory(tmp_path):
    assert latest_checkpoint(str(tmp_path / "nope"), comm=SELF) is None


@pytest.mark.parametrize("kwargs, match", [
    ({"max_to_keep": 0}, "max_to_keep"), ({"checkpoint_name": "a/b"}, "checkpoint_name"),
    ({"checkpoint_name": ".."}, "checkpoint_name"),
])
def test_manager_arguments(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        CheckpointManager(Checkpoint(comm=SELF, s=Scalar(0)), tmp_path, **kwargs)
    with pytest.raises(TypeError, match="Checkpoint"):
        CheckpointManager(object(), tmp_path)


def test_unwritable_directory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError, match=r"saving the checkpoint .* failed on the chief \(rank 0\)"
                                      r".*check the directory's space and permissions"):
        Checkpoint(comm=SELF, s=Scalar(0)).save(str(blocker / "ckpt"))


def test_two_chiefs_or_none(tmp_path):
    with pytest.raises(ValueError, match=r"exactly one chief rank.*got 0"):
        Checkpoint(comm=SELF, is_chief=False, s=Scalar(0)).save(str(tmp_path / "c"))


# --- forged and damaged checkpoints ---------------------------------------------------------
# Each is what someone with write access to the directory, or a buggy writer, could leave:
# the data's size and checksum match the manifest, so only the checks of what the manifest
# and the data say catch it. Every one is a CheckpointCorruptError naming the bad value,
# and no object changes.


def _saved(tmp_path, **objects):
    objects = objects or {"w": np.arange(12, dtype=np.float32).reshape(3, 4),
                          "step": Scalar(5), "rng": np.random.default_rng(1)}
    directory = tmp_path / "ckpts"
    path = Checkpoint(comm=SELF, **objects).save(str(directory / "ckpt"))
    return path, objects


def _outside(tmp_path, arrays):
    """A valid npz outside the checkpoint directory; (its path, its size, its sha256)."""
    content = _npz(arrays)
    (tmp_path / "outside.npz").write_bytes(content)
    return str(tmp_path / "outside.npz"), len(content), hashlib.sha256(content).hexdigest()


def _restore_fails(path, match, error=CheckpointCorruptError):
    w, step = np.full((3, 4), -1, np.float32), Scalar(-1)
    rng = np.random.default_rng(99)
    before = rng.bit_generator.state
    with pytest.raises(error, match=match) as info:
        Checkpoint(comm=SELF, w=w, step=step, rng=rng).restore(path)
    assert type(info.value) is error
    assert (w == -1).all() and int(step) == -1 and rng.bit_generator.state == before
    return info.value


@pytest.mark.parametrize("data", [5, None, ["x.npz"], {"a": 1}, "", ".", "..", "ckpt-1",
                                  "sub/ckpt-1.npz", "ckpt-2.npz"])
def test_manifest_data_must_be_its_own_sibling_file(tmp_path, data):
    path, _ = _saved(tmp_path)
    _forge(path, data=data)
    _restore_fails(path, r'has "data": .*expected .*ckpt-1.*the data file beside the manifest')
    assert latest_checkpoint(str(tmp_path / "ckpts"), comm=SELF) is None


@pytest.mark.parametrize("where", ["absolute", "relative"])
def test_manifest_data_outside_the_directory_is_never_read(tmp_path, where):
    """A valid checkpoint's data elsewhere, with its right size and checksum: before, it
    was read and restored."""
    path, _ = _saved(tmp_path)
    outside, size, sha256 = _outside(tmp_path, {"a2": np.full((3, 4), 9, np.float32),
                                                "a1": np.array(9)})
    data = outside if where == "absolute" else "../outside.npz"
    _forge(path, data=data, bytes=size, sha256=sha256)
    _restore_fails(path, re.escape(repr(data)))


def test_a_symbolic_link_at_the_data_name_is_not_followed(tmp_path):
    path, _ = _saved(tmp_path)
    outside, size, sha256 = _outside(tmp_path, {"a2": np.full((3, 4), 9, np.float32),
                                                "a1": np.array(9)})
    _forge(path, content=open(outside, "rb").read())
    data = _data(path)
    os.unlink(data)
    os.symlink(outside, data)
    _restore_fails(path, "is a symbolic link")


@pytest.mark.timeout(20)
def test_a_fifo_at_the_data_name_does_not_block(tmp_path):
    path, _ = _saved(tmp_path)
    data = _data(path)
    os.unlink(data)
    os.mkfifo(data)
    _restore_fails(path, "not a regular file")


@pytest.mark.parametrize("field, value, match", [
    ("version", True, r'"version": True, expected an integer'),
    ("version", "1", r'"version": \'1\''),
    ("bytes", "12", r'"bytes": \'12\', expected'),
    ("sha256", 5, r'"sha256": 5, expected 64'),
    ("save_counter", "x", r'"save_counter": \'x\''),
    ("save_counter", -1, r'"save_counter": -1'),
    ("world_size", 0, r'"world_size": 0'),
    ("created", None, r'"created": None'),
    ("entries", {"w": 1}, r'"entries": \{\'w\': 1\}, expected a list'),
    ("entries", None, r'"entries": None'),
])
def test_forged_manifest_fields(tmp_path, field, value, match):
    path, _ = _saved(tmp_path)
    _forge(path, **{field: value})
    _restore_fails(path, match)


def _entry(path, name):
    entries = _manifest(path)["entries"]
    return entries, next(e for e in entries if e["name"] == name)


@pytest.mark.parametrize("change, match", [
    (lambda e: e.update(name=5), r'entry \d has "name" 5, expected a non-empty string'),
    (lambda e: e.update(name=""), r'"name" \'\''),
    (lambda e: e.update(name="step"), r'"name" \'step\', expected a name no other entry has'),
    (lambda e: e.update(kind="blob"), r'"kind" \'blob\', expected one of'),
    (lambda e: e.update(key=["a0"]), r'"key" \[\'a0\'\]'),
    (lambda e: e.update(dtype="object"), r'"dtype" \'object\''),
    (lambda e: e.update(dtype="f4"), r'"dtype" \'f4\', expected the canonical name'),
    (lambda e: e.update(dtype="str96"), r'"dtype" \'str96\''),
    (lambda e: e.update(dtype=None), r'"dtype" None'),
    (lambda e: e.update(dtype="finfo"), r'"dtype" \'finfo\''),
    (lambda e: e.update(shape=[3, -4]), r'"shape" \[3, -4\], expected a list of integers'),
    (lambda e: e.update(shape=[True, 12]), r'"shape" \[True, 12\]'),
    (lambda e: e.update(shape="3,4"), r'"shape" \'3,4\''),
    (lambda e: e.update(shape=[4, 3]), r"has shape \(3, 4\), the manifest says \(4, 3\)"),
    (lambda e: e.update(shape=[12]), r"has shape \(3, 4\), the manifest says \(12,\)"),
])
def test_forged_entries(tmp_path, change, match):
    path, _ = _saved(tmp_path)
    entries, w = _entry(path, "w")
    change(w)
    _forge(path, entries=entries)
    _restore_fails(path, match)


@pytest.mark.parametrize("state, match", [
    ("x", r'"state" \'x\', expected a generator\'s state'),
    ({"bit_generator": "os"}, r'"state" \'os\', expected the name of a NumPy bit generator'),
    ({"bit_generator": "BitGenerator"}, "expected the name of a NumPy bit generator"),
    ({"bit_generator": "PCG64", "state": 5}, r"expected a state PCG64 accepts"),
])
def test_forged_generator_states(tmp_path, state, match):
    path, _ = _saved(tmp_path)
    entries, rng = _entry(path, "rng")
    rng["state"] = state
    _forge(path, entries=entries)
    _restore_fails(path, match)


def test_a_member_of_another_dtype_is_not_reinterpreted(tmp_path):
    """int32 where the manifest says float32, the same size: before, its bytes were
    viewed as float32 and restored."""
    path, _ = _saved(tmp_path)
    _forge(path, arrays={"a2": np.arange(12, dtype=np.int32).reshape(3, 4),
                         "a1": np.array(5)})
    _restore_fails(path, r"member 'a2' \(entry 'w'\) .* holds int32, the manifest says "
                         r"float32: restoring it would reinterpret its bytes")


def test_a_member_of_another_shape_is_refused(tmp_path):
    path, _ = _saved(tmp_path)
    _forge(path, arrays={"a2": np.zeros((4, 3), np.float32), "a1": np.array(5)})
    _restore_fails(path, r"member 'a2' .* has shape \(4, 3\), the manifest says \(3, 4\)")


def test_a_missing_member_is_refused(tmp_path):
    """Before, the missing array was restored as np.empty's garbage."""
    path, _ = _saved(tmp_path)
    _forge(path, arrays={"a1": np.array(5)})
    _restore_fails(path, r"has no member 'a2' \(entry 'w'\); its members are \['a1'\]")


def test_a_member_that_is_not_an_array_is_refused(tmp_path):
    import zipfile

    path, _ = _saved(tmp_path)
    buffer = io.BytesIO()
    npy = io.BytesIO()
    np.lib.format.write_array(npy, np.array(5))
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("a2", b"raw bytes, no .npy header")
        archive.writestr("a1.npy", npy.getvalue())
    _forge(path, content=buffer.getvalue())
    _restore_fails(path, "cannot be read|not NumPy arrays")


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 truncated", b"not a zip at all"])
def test_an_unreadable_data_file_with_a_matching_checksum(tmp_path, content):
    """Before, zipfile's BadZipFile escaped as itself (and at several ranks the others
    waited for the chief forever)."""
    path, _ = _saved(tmp_path)
    _forge(path, content=content)
    _restore_fails(path, "cannot be read")


def test_a_bfloat16_member_stored_as_void_of_another_size_is_refused(tmp_path):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    w = np.arange(6, dtype=ml_dtypes.bfloat16)
    path = Checkpoint(comm=SELF, w=w).write(str(tmp_path / "b"))
    _forge(path, arrays={"a0": np.zeros(6, dtype="V4")})
    with pytest.raises(CheckpointCorruptError, match=r"holds \|V4, the manifest says bfloat16"):
        Checkpoint(comm=SELF, w=w).restore(path)


def test_objects_that_differ_from_a_valid_checkpoint_are_a_value_error(tmp_path):
    """The checkpoint is fine, the objects are not the ones saved: a plain ValueError (a
    forged checkpoint is a CheckpointCorruptError, also a ValueError)."""
    path, _ = _saved(tmp_path)
    with pytest.raises(ValueError, match=r"missing \['v'\], unexpected \['w'\]") as info:
        Checkpoint(comm=SELF, v=np.zeros((3, 4), np.float32), step=Scalar(0),
                   rng=np.random.default_rng()).restore(path)
    assert type(info.value) is ValueError
    with pytest.raises(ValueError, match="holds a PCG64 state, the object is a MT19937"):
        Checkpoint(comm=SELF, w=np.zeros((3, 4), np.float32), step=Scalar(0),
                   rng=np.random.Generator(np.random.MT19937())).restore(path)


def test_the_start_fresh_pattern(tmp_path):
    """The documented pattern: a checkpoint that cannot be restored is a ValueError (or a
    CheckpointNotFoundError), and the script starts from its initial values."""
    path, _ = _saved(tmp_path)
    _forge(path, data=None)
    w = np.zeros((3, 4), np.float32)
    manager = CheckpointManager(Checkpoint(comm=SELF, w=w, step=Scalar(0),
                                           rng=np.random.default_rng()),
                                tmp_path / "ckpts")
    try:
        manager.checkpoint.restore(path)
    except (ValueError, CheckpointNotFoundError):
        w[...] = 1  # start fresh
    assert (w == 1).all()
    assert manager.save() == str(tmp_path / "ckpts" / "ckpt-2")  # the broken one is kept


# --- two writers of one directory ------------------------------------------------------------

WRITER = textwrap.dedent("""\
    import os, sys, time
    import numpy as np
    from mpi4py import MPI
    from mpistrat.checkpoint import Checkpoint, CheckpointManager, Scalar

    directory, me, saves, start = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    w, step, writer = np.zeros(1000), Scalar(0), Scalar(me)
    rng = np.random.default_rng(me)  # its state (in the manifest) says who wrote it too
    manager = CheckpointManager(Checkpoint(comm=MPI.COMM_SELF, w=w, step=step, writer=writer,
                                           rng=rng), directory, max_to_keep=4)
    open(f"{start}.{me}", "w").close()  # ready: both start saving together
    while not os.path.exists(start):
        time.sleep(0.001)
    for i in range(1, saves + 1):
        step.assign(i)
        w[...] = me * 1000 + i
        print(manager.save(), flush=True)
        time.sleep(0.01)  # a training step
    """)


def test_two_processes_saving_into_one_directory(tmp_path):
    """Two jobs' saves take turns (the directory's lock): every save gets its own number,
    each checkpoint holds one save's state whole (never one job's manifest over the
    other's data), the newest saves are the ones kept, and no data file is left over.
    Before, both wrote ckpt-1, ckpt-2, ... over each other."""
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    directory, start = tmp_path / "ckpts", tmp_path / "start"
    saves = 25
    writers = [subprocess.Popen([sys.executable, str(script), str(directory), str(me),
                                 str(saves), str(start)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for me in (1, 2)]
    deadline = time.monotonic() + 60
    while not all(os.path.exists(f"{start}.{me}") for me in (1, 2)):
        assert time.monotonic() < deadline and all(w.poll() is None for w in writers)
        time.sleep(0.01)
    start.write_text("go")
    outputs = [writer.communicate(timeout=90) for writer in writers]
    for writer, (out, err) in zip(writers, outputs):
        assert writer.returncode == 0, err
    paths = [line for out, _ in outputs for line in out.split()]
    assert len(paths) == 2 * saves and len(set(paths)) == 2 * saves, sorted(paths)
    first, second = ([int(p.rsplit("-", 1)[1]) for p in out.split()] for out, _ in outputs)
    assert min(first) < max(second) and min(second) < max(first), (first, second)  # overlap
    kept = CheckpointManager(Checkpoint(comm=SELF, x=Scalar(0)), directory).checkpoints
    assert len(kept) == 4
    assert _names(directory) == sorted(
        f"{os.path.basename(p)}.{e}" for p in kept for e in ("*.npz", "json"))
    # the kept ones are the four newest saves: the highest numbers, in save order
    assert [int(p.rsplit("-", 1)[1]) for p in kept] == list(range(2 * saves - 3, 2 * saves + 1))
    for path in kept:
        w, step, writer = np.zeros(1000), Scalar(0), Scalar(0)
        rng = np.random.default_rng(12345)
        Checkpoint(comm=SELF, w=w, step=step, writer=writer, rng=rng).restore(path)
        me = int(writer)
        assert me in (1, 2) and (w == me * 1000 + int(step)).all(), path
        assert rng.bit_generator.state == np.random.default_rng(me).bit_generator.state


HOLDER = textwrap.dedent("""\
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o666)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, b"pid %d on the other host since then" % os.getpid())
    print("locked", flush=True)
    time.sleep(float(sys.argv[2]))
    """)


def _hold_lock(directory, seconds):
    os.makedirs(directory, exist_ok=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER,
                               os.path.join(directory, _files.LOCK_NAME), str(seconds)],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_a_save_waits_for_another_writers_save(tmp_path):
    holder = _hold_lock(tmp_path, 1.0)
    started = time.monotonic()
    path = Checkpoint(comm=SELF, s=Scalar(1)).save(str(tmp_path / "ckpt"))
    assert time.monotonic() - started > 0.5 and path.endswith("ckpt-1")
    holder.wait(timeout=10)


def test_a_save_gives_up_on_a_stuck_writer_and_names_it(tmp_path, monkeypatch):
    monkeypatch.setattr(_files, "LOCK_TIMEOUT", 0.3)
    holder = _hold_lock(tmp_path, 30)
    try:
        with pytest.raises(OSError, match=rf"TimeoutError: another process has held the "
                                          rf"checkpoint lock .* for over 0.3 s \(pid "
                                          rf"{holder.pid} on the other host since then\)"):
            Checkpoint(comm=SELF, s=Scalar(1)).save(str(tmp_path / "ckpt"))
    finally:
        holder.kill()
        holder.wait()
    assert _names(tmp_path) == []


def test_a_symbolic_link_at_the_lock_name_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("keep me")
    directory = tmp_path / "ckpts"
    directory.mkdir()
    os.symlink(target, directory / _files.LOCK_NAME)
    with pytest.raises(OSError, match="lock file .*a symbolic link: remove it"):
        Checkpoint(comm=SELF, s=Scalar(1)).save(str(directory / "ckpt"))
    assert target.read_text() == "keep me"


# --- preemption ---------------------------------------------------------------------------


def test_preemption_saves_and_exits_on_a_signal(tmp_path):
    step = Scalar(0)
    manager = CheckpointManager(Checkpoint(comm=SELF, step=step), tmp_path)
    before = signal.getsignal(signal.SIGUSR1)
    with PreemptionCheckpointHandler(manager) as handler:
        step.assign(3)
        assert handler.save_checkpoint_if_preempted() is False
        os.kill(os.getpid(), signal.SIGUSR1)
        with pytest.raises(SystemExit) as info:
            handler.save_checkpoint_if_preempted()
        assert info.value.code == PREEMPTION_EXIT_STATUS
        assert handler.preempted and handler.received == signal.SIGUSR1
        assert handler.saved_path == str(tmp_path / "ckpt-1")
    assert signal.getsignal(signal.SIGUSR1) is before
    assert manager.latest_checkpoint == handler.saved_path


def test_preemption_without_exit(tmp_path):
    manager = CheckpointManager(Checkpoint(comm=SELF, step=Scalar(0)), tmp_path)
    with PreemptionCheckpointHandler(manager, signals=["USR2"], exit_status=None) as handler:
        os.kill(os.getpid(), signal.SIGUSR2)
        assert handler.save_checkpoint_if_preempted() is True
        assert handler.save_checkpoint_if_preempted() is True  # saved once
    assert len(manager.checkpoints) == 1


def test_preemption_arguments(tmp_path):
    manager = CheckpointManager(Checkpoint(comm=SELF, step=Scalar(0)), tmp_path)
    with pytest.raises(ValueError, match="unknown signal 'SIGNOPE'"):
        PreemptionCheckpointHandler(manager, signals=["SIGNOPE"])
    with pytest.raises(TypeError, match="CheckpointManager"):
        PreemptionCheckpointHandler(object())


def test_zero_dimensional_values_keep_their_shape(tmp_path):
    """A 0-d variable (an epoch counter) restores as 0-d, not as shape (1,)."""
    import mpistrat as ms

    epoch, weights = ms.Variable(7), ms.Variable(np.float32(2.5))
    ckpt = Checkpoint(epoch=epoch, w=weights)
    path = ckpt.write(str(tmp_path / "zero-d"))
    epoch.assign(0)
    weights.assign(0.0)
    ckpt.restore(path)
    assert epoch.numpy().shape == () and int(epoch.numpy()) == 7
    assert weights.numpy().shape == () and float(weights.numpy()) == 2.5
