"""A job killed in the middle of writing a checkpoint resumes, when restarted, from the
last complete one: the torn temporary file is ignored, and the result is the one an
uninterrupted run gives."""

from __future__ import annotations

import os
import re
import textwrap

import pytest

pytestmark = pytest.mark.launch

TRAIN = textwrap.dedent("""\
    import os, signal, sys
    import numpy as np
    import mpistrat
    from mpistrat.checkpoint import Checkpoint, CheckpointManager, Scalar
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    directory, steps, crash_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    w, step = np.zeros(4), Scalar(0)
    manager = CheckpointManager(Checkpoint(w=w, step=step), directory, max_to_keep=3)
    resumed = manager.restore_or_initialize()
    if comm.rank == 0:
        print(f"start at step {int(step)} from {resumed}", flush=True)

    real_savez = np.savez
    def savez(file, **arrays):  # the chief dies half-way through writing step crash_at
        if int(step) == crash_at:
            file.write(b"PK\\x03\\x04 half a checkpoint")
            file.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        real_savez(file, **arrays)
    np.savez = savez

    while int(step) < steps:
        step.assign_add(1)
        w += mpistrat.all_reduce(np.full(4, float(int(step))), comm=comm)
        manager.save()
    if comm.rank == 0:
        print(f"final step {int(step)} w {w.tolist()}")
    """)


def _complete(directory):
    """The checkpoints' files (data files' hashes as ``*``): not the lock file, not the
    torn save's temporary file (deleted by a later save once a minute old)."""
    return sorted(re.sub(r"\.[0-9a-f]{16}\.npz$", ".*.npz", f) for f in os.listdir(directory)
                  if not f.endswith((".tmp", ".lock")))


def test_killed_mid_save_resumes_from_the_last_complete_checkpoint(mpirun, mpistrat_cmd,
                                                                   tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    ckpts = tmp_path / "ckpts"
    first = mpirun(2, [*mpistrat_cmd, "run", str(script), str(ckpts), "6", "4"], timeout=60)
    assert first.returncode != 0, first.stdout + first.stderr
    assert "start at step 0 from None" in first.stdout and "final" not in first.stdout
    files = sorted(os.listdir(ckpts))
    torn = [f for f in files if f.endswith(".tmp")]
    assert len(torn) == 1 and torn[0].startswith(".ckpt-4.npz."), files
    assert _complete(ckpts) == [f"ckpt-{i}.{ext}" for i in (1, 2, 3) for ext in ("*.npz", "json")]

    second = mpirun(2, [*mpistrat_cmd, "run", str(script), str(ckpts), "6", "0"], timeout=60)
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"start at step 3 from {ckpts / 'ckpt-3'}" in second.stdout
    total = 2 * sum(range(1, 7))  # two ranks add the step number, steps 1..6
    assert f"final step 6 w {[float(total)] * 4}" in second.stdout
    assert _complete(ckpts) == [f"ckpt-{i}.{ext}" for i in (4, 5, 6) for ext in ("*.npz", "json")]
