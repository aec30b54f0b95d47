"""TF's preemption API in one process (COMM_SELF): ``PreemptionCheckpointHandler`` in TF's
form (restores at creation, ``run`` counts steps and the count is the checkpoint's number),
``TerminationConfig`` (watcher, exit, save functions and grace period, each checked) and
``PreemptionWatcher``; mpistrat's older form keeps working (tests/unit/test_checkpoint.py)."""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest

from mpistrat.checkpoint import (
    Checkpoint,
    CheckpointManager,
    PreemptionCheckpointHandler,
    PreemptionWatcher,
    Scalar,
    TerminationConfig,
)
from mpistrat.cluster import SimpleClusterResolver

MPI = pytest.importorskip("mpi4py.MPI")
SELF = MPI.COMM_SELF


def _state():
    weights, step = np.zeros(3), Scalar(0)
    return weights, step, Checkpoint(comm=SELF, weights=weights, step=step)


def test_tf_form_runs_steps_saves_at_the_notice_numbered_by_the_run_calls_and_resumes(tmp_path):
    weights, step, checkpoint = _state()
    exits = []
    config = TerminationConfig(exit_fn=lambda: exits.append("exit"))

    def train_step(delta):
        weights[:] += delta
        step.assign_add(1)
        return float(weights.sum())

    with PreemptionCheckpointHandler(None, checkpoint, str(tmp_path), config) as handler:
        assert handler.restored_path is None and handler.total_run_calls == 0
        results = [handler.run(train_step, 1.0) for _ in range(3)]
        assert results == [3.0, 6.0, 9.0] and handler.total_run_calls == 3
        os.kill(os.getpid(), signal.SIGUSR1)
        handler.run(train_step, 1.0)  # the check comes first: saves, "exits", then the step
        assert exits == ["exit"] and handler.preempted
        assert handler.saved_path == str(tmp_path / "ckpt-3")
    weights2, step2, checkpoint2 = _state()
    with PreemptionCheckpointHandler(SimpleClusterResolver({}), checkpoint2,
                                     str(tmp_path)) as resumed:
        assert resumed.restored_path == str(tmp_path / "ckpt-3")
        assert resumed.total_run_calls == 3 and step2.value == 3
        assert weights2.tolist() == [3.0, 3.0, 3.0]


def test_tf_form_with_a_manager_default_exit_and_save_checkpoint_if_preempted(tmp_path):
    _, _, checkpoint = _state()
    manager = CheckpointManager(checkpoint, tmp_path)
    with PreemptionCheckpointHandler(None, manager, signals=["USR2"]) as handler:
        assert handler.save_checkpoint_if_preempted() is False
        handler.run(lambda: None)
        os.kill(os.getpid(), signal.SIGUSR2)
        with pytest.raises(SystemExit) as info:
            handler.save_checkpoint_if_preempted()
        assert info.value.code == 42
    assert manager.latest_checkpoint == str(tmp_path / "ckpt-1")


def test_termination_watcher_fn_and_save_fn(tmp_path):
    _, _, checkpoint = _state()
    polls, saved = [], []

    def watcher():
        polls.append(1)
        return len(polls) >= 2

    config = TerminationConfig(termination_watcher_fn=watcher,
                               save_fn=lambda *a, **k: saved.append((a, k)))
    with PreemptionCheckpointHandler(None, checkpoint, str(tmp_path), config,
                                     exit_status=None) as handler:
        assert handler.save_checkpoint_if_preempted() is False
        assert handler.save_checkpoint_if_preempted("tag", number=7) is True
        assert saved == [(("tag",), {"number": 7})] and handler.saved_path is None
        assert handler.save_checkpoint_if_preempted() is True  # saved once
        assert len(saved) == 1 and len(polls) == 2


def test_a_grace_period_trains_on_until_the_safe_moment(tmp_path, monkeypatch):
    import mpistrat.checkpoint.preemption as preemption

    now = [1000.0]
    monkeypatch.setattr(preemption.time, "monotonic", lambda: now[0])
    _, _, checkpoint = _state()
    config = TerminationConfig(grace_period=100, exit_fn=lambda: None)
    with PreemptionCheckpointHandler(None, checkpoint, str(tmp_path), config) as handler:
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(3):
            now[0] += 20  # 20, 40, 60 s after the notice: more than 10 s + 2 saves left
            assert handler.save_checkpoint_if_preempted() is False
        now[0] += 35  # 95 s: past the safe moment
        assert handler.save_checkpoint_if_preempted() is True and handler.preempted


@pytest.mark.parametrize("kwargs,error,match", [
    ({"termination_watcher_fn": 3}, TypeError, "termination_watcher_fn must be a function"),
    ({"exit_fn": "exit"}, TypeError, "exit_fn must be a function"),
    ({"save_fn": 1}, TypeError, "save_fn must be a function"),
    ({"grace_period": "60"}, TypeError, "grace_period must be a number"),
    ({"grace_period": True}, TypeError, "grace_period must be a number"),
    ({"grace_period": -1}, ValueError, "grace_period must be >= 0"),
    ({"grace_period": float("nan")}, ValueError, "grace_period must be >= 0"),
])
def test_termination_config_is_checked(kwargs, error, match):
    with pytest.raises(error, match=match):
        TerminationConfig(**kwargs)


def test_bad_calls_name_the_two_forms(tmp_path):
    _, _, checkpoint = _state()
    manager = CheckpointManager(checkpoint, tmp_path)
    with pytest.raises(ValueError, match="needs checkpoint_dir"):
        PreemptionCheckpointHandler(None, checkpoint)
    with pytest.raises(TypeError, match="Checkpoint or CheckpointManager, got dict"):
        PreemptionCheckpointHandler(None, {"weights": 1})
    with pytest.raises(TypeError, match="ClusterResolver or None"):
        PreemptionCheckpointHandler("worker", manager)
    with pytest.raises(TypeError, match="signals= and exit_status= as keywords"):
        PreemptionCheckpointHandler(manager, ["USR1"])
    with pytest.raises(TypeError, match="TerminationConfig or None"):
        PreemptionCheckpointHandler(None, manager, termination_config={"exit_fn": None})


def test_watcher_reports_the_signal_and_chains_to_an_earlier_handler(tmp_path):
    _, _, checkpoint = _state()
    with PreemptionCheckpointHandler(CheckpointManager(checkpoint, tmp_path),
                                     exit_status=None) as handler, PreemptionWatcher() as watcher:
        assert watcher.preemption_message is None
        assert watcher.block_until_worker_exit() is False  # no notice: nothing to wait for
        os.kill(os.getpid(), signal.SIGTERM)
        assert watcher.preemption_message.startswith("SIGTERM received at")
        assert handler.received == signal.SIGTERM  # the handler installed first saw it too
        assert watcher.block_until_worker_exit(timeout=0.05) is False


def test_signal_handlers_need_the_main_thread():
    errors = []

    def make():
        try:
            PreemptionWatcher()
        except RuntimeError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=make)
    thread.start()
    thread.join()
    assert errors and "only in the main thread" in errors[0]
