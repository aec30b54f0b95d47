"""TF's ``PreemptionCheckpointHandler.run`` across ranks: a signal that reaches one rank
only, or a ``termination_watcher_fn`` that fires on one rank only, stops every rank at
the same step with one checkpoint numbered by the steps taken, which a new handler
restores on every rank together with ``total_run_calls``."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from mpistrat.checkpoint import Checkpoint, PreemptionCheckpointHandler, Scalar, TerminationConfig

MPI = pytest.importorskip("mpi4py.MPI")


def _train(world, directory, config, notify_at):
    """Steps until the handler stops the job; the last rank gets the notice before the
    step ``notify_at``. Returns (steps run, the exit calls, the handler)."""
    weights, step = np.zeros(2), Scalar(0)
    checkpoint = Checkpoint(comm=world, weights=weights, step=step)
    exits = []
    config.exit_fn = lambda: exits.append(int(step.value))
    handler = PreemptionCheckpointHandler(None, checkpoint, directory, config)
    try:
        def train_step():
            weights[:] += world.allreduce(1.0)  # a collective step, as training is
            step.assign_add(1)

        while not exits and handler.total_run_calls < 50:
            if world.rank == world.size - 1 and handler.total_run_calls == notify_at:
                notify()
            handler.run(train_step)
    finally:
        handler.close()
    return exits, handler


def notify():
    os.kill(os.getpid(), signal.SIGUSR1)


def test_a_signal_on_one_rank_stops_every_rank_at_the_same_step(world, root):
    exits, handler = _train(world, root, TerminationConfig(), notify_at=4)
    everyone = world.allgather((exits, handler.saved_path, handler.total_run_calls))
    assert len({repr(e) for e in everyone}) == 1, everyone
    saved_at = exits[0]
    assert 4 <= saved_at <= 5  # (the notice may reach the flag one step late)
    assert handler.saved_path == os.path.join(root, f"ckpt-{saved_at}")
    weights, step = np.zeros(2), Scalar(0)
    resumed = PreemptionCheckpointHandler(None, Checkpoint(comm=world, weights=weights, step=step),
                                          root)
    resumed.close()
    assert resumed.total_run_calls == saved_at == step.value
    assert weights.tolist() == [saved_at * world.size] * 2


def test_a_termination_watcher_on_one_rank_stops_every_rank(world, root):
    calls = []

    def watcher():
        calls.append(1)
        return world.rank == 0 and len(calls) > 3

    exits, handler = _train(world, root, TerminationConfig(termination_watcher_fn=watcher),
                            notify_at=-1)
    assert world.allgather(exits) == [[3]] * world.size
    assert handler.saved_path == os.path.join(root, "ckpt-3")
