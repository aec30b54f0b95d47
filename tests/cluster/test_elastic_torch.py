"""A PyTorch loop with mpistrat.torch's ZeroRedundancyOptimizer across the two real hosts
of conftest.py, under ``mpistrat run -n 4 --min-ranks 2`` (examples/torch_elastic.py,
Adam): each host's two ranks hold the optimizer state between them,
and each copies its own share of it into its host's snapshots. The last rank (on node2)
kills itself in a step of the first launch, and hydra's proxy on node2 ends the other
one there: node2 is lost (or, should that rank outlive its peer long enough to be told
apart, only rank 3 is), and the relaunch on the ranks left restores the snapshot taken
before that step from a host's ``/dev/shm`` (one step redone), splits the state over
its ranks again, and ends with the weights one process reaches on the same global
batches, every sample applied once per epoch."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _cluster import Job

pytestmark = pytest.mark.cluster
pytest.importorskip("torch", reason="the loop is a torch one")

VENV_BIN = Path(sys.executable).parent
SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "torch_elastic.py"
# (a narrow layer: on a wide one, Adam makes 4 ranks' sums, rounded apart from one
# process's, differ from its weights by more than the tolerance, with no fault too)
EPOCHS, KILL_STEP, HIDDEN = 3, 13, 16


@pytest.mark.timeout(240)
def test_a_lost_rank_of_a_zero_loop_across_hosts_costs_one_step(cluster, tmp_path):
    reference = subprocess.run(
        [sys.executable, str(SCRIPT), "--reference", "--optimizer", "zero", "--epochs",
         str(EPOCHS), "--hidden", str(HIDDEN), "--out", str(tmp_path / "reference.npz")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert reference.returncode == 0, reference.stdout + reference.stderr
    argv = [VENV_BIN / "mpistrat", "run", "-n", "4", "--min-ranks", "2", "--timeout", "20",
            "--snapshot-every", "1", SCRIPT, "--optimizer", "zero", "--epochs", str(EPOCHS),
            "--kill-step", str(KILL_STEP), "--hidden", str(HIDDEN), "--checkpoint-dir",
            tmp_path / "ckpt", "--out", tmp_path / "final.npz"]
    with Job(cluster, argv, tmp_path, cwd=tmp_path) as job:
        job.process.wait(180)
        out = job.output
    assert job.process.returncode == 0, out
    launches = re.findall(r"^@@ launch (\d) on (\d) ranks: restored (\S+) at step (\d+)$",
                          out, re.MULTILINE)
    lost = re.search(r"lost (host node2 \(ranks 2, 3\)|rank 3 \(\S*node2\S*\)); restart 1 of "
                     r"\d+ on (\d) ranks", out)
    assert lost and lost.group(2) == ("2" if lost.group(1).startswith("host") else "3"), out
    left = lost.group(2)
    # resumed from the snapshot taken before the killed step: one step redone
    assert launches == [("0", "4", "None", "0"), ("1", left, "snapshot", str(KILL_STEP))], out
    assert f"@@ done on {left} ranks after step 30" in out, out
    final, expected = np.load(tmp_path / "final.npz"), np.load(tmp_path / "reference.npz")
    np.testing.assert_array_equal(final["seen"], np.full(96, float(EPOCHS)))
    for name in expected.files:
        np.testing.assert_allclose(final[name], expected[name], rtol=1e-5, atol=1e-6,
                                   err_msg=name)
