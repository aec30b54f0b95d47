"""``mpistrat run -n 4 --min-ranks 2`` of a PyTorch loop (examples/torch_elastic.py:
mpistrat.torch's DistributedDataParallel, DistributedBatchSampler, a CheckpointManager
over the module and the optimizer): the last rank kills itself (SIGKILL) in a step of the
first launch; the job ends well on 3 ranks, resumed from the snapshot taken before that
step (not the checkpoint on disk), so one step is redone; the final weights are one
process's on the same global batches, and every sample was applied exactly once per
epoch. With torch.optim.SGD (momentum) and a DataLoader of 2 worker processes, which load
4 batches ahead of the loop, and a hidden layer 100000 wide (a 4.6 MiB model and its
momentum, whose snapshots the 4 ranks copy side by side); and with ZeroRedundancyOptimizer
(Adam), whose state, sharded over 4 ranks, is re-split over 3, and no worker processes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

pytestmark = pytest.mark.launch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "torch_elastic.py"
EPOCHS, KILL_STEP = 3, 13


@pytest.mark.parametrize("optimizer, workers, hidden", [("sgd", 2, 100_000), ("zero", 0, 16)])
def test_a_lost_rank_costs_one_step_of_a_torch_loop(mpistrat_cmd, tmp_path, optimizer,
                                                    workers, hidden):
    reference = subprocess.run(
        [sys.executable, str(SCRIPT), "--reference", "--optimizer", optimizer, "--epochs",
         str(EPOCHS), "--hidden", str(hidden), "--out", str(tmp_path / "reference.npz")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert reference.returncode == 0, reference.stdout + reference.stderr
    result = subprocess.run(
        [*mpistrat_cmd, "run", "-n", "4", "--min-ranks", "2", "--timeout", "20",
         "--snapshot-every", "1", str(SCRIPT), "--optimizer", optimizer, "--epochs",
         str(EPOCHS), "--kill-step", str(KILL_STEP), "--workers", str(workers),
         "--hidden", str(hidden),
         "--checkpoint-dir",
         str(tmp_path / "ckpt"), "--out", str(tmp_path / "final.npz")],
        cwd=tmp_path, capture_output=True, text=True, timeout=180, check=False)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    launches = re.findall(r"^@@ launch (\d) on (\d) ranks: restored (\S+) at step (\d+)$",
                          result.stdout, re.MULTILINE)
    # the relaunch resumed from the snapshot taken before the killed step: one step redone
    assert launches == [("0", "4", "None", "0"), ("1", "3", "snapshot", str(KILL_STEP))], out
    assert re.search(r"lost rank 3 \(\S+\); restart 1 of 3 on 3 ranks", result.stderr), out
    assert "@@ done on 3 ranks after step 30" in result.stdout, out
    final, expected = np.load(tmp_path / "final.npz"), np.load(tmp_path / "reference.npz")
    np.testing.assert_array_equal(final["seen"], np.full(96, float(EPOCHS)))
    assert sorted(final.files) == sorted(expected.files)
    for name in expected.files:
        np.testing.assert_allclose(final[name], expected[name], rtol=1e-5, atol=1e-6,
                                   err_msg=name)
