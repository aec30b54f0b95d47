"""Checkpoints in one process (COMM_SELF): round trips of every kind of object, numbering,
the manager, and what a crash at each moment of a save leaves behind."""

from __future__ import annotations

import json
import os
import signal

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
    assert sorted(os.listdir(tmp_path)) == ["ckpt-1.json", "ckpt-1.npz"]
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
    manifest = json.loads(open(path + ".json").read())
    assert manifest["format"] == "mpistrat.checkpoint" and manifest["version"] == 1
    assert manifest["data"] == "ckpt-1.npz" and len(manifest["sha256"]) == 64
    assert manifest["bytes"] == os.path.getsize(path + ".npz")
    names = [e["name"] for e in manifest["entries"]]
    assert names == ["opt/lr", "opt/momentum", "params/0", "params/1", "rng", "step", "var"]
    params0 = next(e for e in manifest["entries"] if e["name"] == "params/0")
    assert params0["dtype"] == "float32" and params0["shape"] == [3, 4]
    with np.load(path + ".npz") as npz:  # plain NumPy reads the data
        np.testing.assert_array_equal(npz[params0["key"]].shape, (3, 4))


def test_files_get_the_usual_permissions(tmp_path):
    umask = os.umask(0o022)
    os.umask(umask)
    path = Checkpoint(comm=SELF, s=Scalar(0)).save(str(tmp_path / "ckpt"))
    for suffix in (".npz", ".json"):
        assert os.stat(path + suffix).st_mode & 0o777 == 0o666 & ~umask


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
    data, record = path + ".npz", path + ".json"
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
    with pytest.raises(Crash):
        manager.save()
    assert sorted(os.listdir(tmp_path)) == ["ckpt-1.json", "ckpt-1.npz"]  # temp file removed
    monkeypatch.undo()
    assert latest_checkpoint(str(tmp_path), comm=SELF) == first
    assert manager.restore_or_initialize() == first and ckpt.save_counter == 1


def test_crash_before_the_manifest_hides_the_new_data(tmp_path, monkeypatch):
    w = np.ones(4)
    manager = CheckpointManager(Checkpoint(comm=SELF, w=w), tmp_path)
    first = manager.save()
    real = _files._replace_atomically

    def no_manifest(path, fill):
        if path.endswith(".json"):
            raise Crash("killed before the manifest")
        real(path, fill)

    monkeypatch.setattr(_files, "_replace_atomically", no_manifest)
    w[...] = 2
    with pytest.raises(Crash):
        manager.save()
    monkeypatch.undo()
    assert os.path.exists(tmp_path / "ckpt-2.npz") and not os.path.exists(tmp_path / "ckpt-2.json")
    assert manager.latest_checkpoint == first == latest_checkpoint(str(tmp_path), comm=SELF)
    assert manager.checkpoints == [first]
    with pytest.raises(CheckpointNotFoundError):
        manager.checkpoint.restore(str(tmp_path / "ckpt-2"))
    manager.restore_or_initialize()
    assert (w == 1).all()


def test_rewriting_a_path_removes_its_manifest_first(tmp_path, monkeypatch):
    """Overwriting ckpt-1 in place: a crash mid-way leaves no checkpoint there, never new
    data under the old manifest."""
    w = np.ones(4)
    ckpt = Checkpoint(comm=SELF, w=w)
    path = ckpt.write(str(tmp_path / "ckpt-1"))
    monkeypatch.setattr(np, "savez", lambda file, **a: (_ for _ in ()).throw(Crash("killed")))
    with pytest.raises(Crash):
        ckpt.write(path)
    monkeypatch.undo()
    assert not os.path.exists(path + ".json")
    assert latest_checkpoint(str(tmp_path), comm=SELF) is None


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
    assert manager.save(checkpoint_number=100).endswith("model-100")
    assert manager.checkpoints == [paths[3], str(tmp_path / "run" / "model-100")]
    assert latest_checkpoint(str(tmp_path / "run"), comm=SELF) is None  # default name "ckpt"
    assert latest_checkpoint(str(tmp_path / "run"), None, comm=SELF).endswith("model-100")
    step.assign(0)
    fresh = CheckpointManager(Checkpoint(comm=SELF, step=step), tmp_path / "run",
                              checkpoint_name="model")
    assert fresh.restore_or_initialize().endswith("model-100") and int(step) == 4


def test_latest_of_a_missing_directory(tmp_path):
    assert latest_checkpoint(str(tmp_path / "nope"), comm=SELF) is None


@pytest.mark.parametrize("kwargs, match", [
    ({"max_to_keep": 0}, "max_to_keep"), ({"checkpoint_name": "a/b"}, "checkpoint_name"),
])
def test_manager_arguments(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        CheckpointManager(Checkpoint(comm=SELF, s=Scalar(0)), tmp_path, **kwargs)
    with pytest.raises(TypeError, match="Checkpoint"):
        CheckpointManager(object(), tmp_path)


def test_unwritable_directory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError, match=r"saving the checkpoint .* failed on the chief \(rank 0\)"):
        Checkpoint(comm=SELF, s=Scalar(0)).save(str(blocker / "ckpt"))


def test_two_chiefs_or_none(tmp_path):
    with pytest.raises(ValueError, match=r"exactly one chief rank.*got 0"):
        Checkpoint(comm=SELF, is_chief=False, s=Scalar(0)).save(str(tmp_path / "c"))


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
