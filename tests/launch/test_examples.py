"""The examples, run the way the README runs them (``mpistrat run -n N``): the digits MLP
reaches the same accuracy at 1 and 2 ranks with the same global batch, resumes exactly
from its checkpoints, and the custom loop converges on a non-power-of-two rank count."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.launch
pytest.importorskip("sklearn", reason="the digits example reads scikit-learn's bundled data")

EPOCHS = 6


def _run(n: int, *args: str, timeout: float = 120) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "mpistrat", "run", "-n", str(n), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def _accuracy(stdout: str) -> float:
    match = re.search(r"final test accuracy (\d\.\d+)", stdout)
    assert match, stdout
    return float(match.group(1))


@pytest.fixture(scope="module")
def two_ranks() -> float:
    return _accuracy(_run(2, "examples/digits_mlp.py", "--epochs", str(EPOCHS),
                          "--no-progress"))


def test_digits_same_accuracy_at_one_and_two_ranks(two_ranks):
    one = _accuracy(_run(1, "examples/digits_mlp.py", "--epochs", str(EPOCHS),
                         "--no-progress"))
    assert two_ranks >= 0.9
    assert one == two_ranks


def test_digits_resumes_exactly_from_its_checkpoint(two_ranks, tmp_path):
    first = _run(2, "examples/digits_mlp.py", "--epochs", "3", "--checkpoint-dir",
                 str(tmp_path), "--no-progress")
    assert "resumed" not in first
    second = _run(2, "examples/digits_mlp.py", "--epochs", str(EPOCHS), "--checkpoint-dir",
                  str(tmp_path), "--no-progress")
    assert "(epoch 3)" in second
    assert "epoch   1/" not in second  # epochs 1-3 were not run again
    assert _accuracy(second) == two_ranks  # bitwise the same model as the straight run


def test_custom_loop_on_three_ranks_with_two_replicas():
    out = _run(3, "--local-replicas", "2", "examples/custom_loop.py", "--steps", "60")
    match = re.search(r"final mse (\S+); largest weight error (\S+) \(6 replicas\)", out)
    assert match, out
    assert float(match.group(1)) < 1e-3 and float(match.group(2)) < 1e-2


def test_tf_custom_loop_trains_to_the_one_process_accuracy(tmp_path):
    """TF's custom-training tutorial loop, ``import mpistrat as tfd``: 3 ranks of 2 replicas
    (the last global batch leaves replicas empty, so workers end each epoch's
    ``get_next_as_optional`` loop together only if they agree) train the model one process
    trains; the checkpoint of each epoch restores into a new model exactly."""
    args = ("examples/tf_custom_loop.py", "--epochs", "4")
    runs = {n: _run(n, *extra, *args, "--checkpoint-dir", str(tmp_path / str(n)))
            for n, extra in ((1, ()), (3, ("--local-replicas", "2")))}
    for n, out in runs.items():
        assert out.count("Epoch ") == 4, out
        assert "Number of devices: %d" % (2 * n if n == 3 else n) in out, out
        assert re.search(r"restored test accuracy (\S+)", out).group(1) == \
            re.search(r"final test accuracy (\S+)", out).group(1), out
        assert len(list((tmp_path / str(n)).glob("ckpt-*.json"))) == 4
    one = _accuracy(runs[1])
    assert one >= 0.9
    assert abs(_accuracy(runs[3]) - one) <= 1 / 360


def test_digits_torch_on_two_ranks_trains_the_one_process_model():
    pytest.importorskip("torch", reason="the example trains a PyTorch CNN")
    args = ("examples/digits_torch.py", "--epochs", "3")
    runs = [_run(1, *args), _run(2, *args), _run(2, *args, "--zero")]
    found = [re.search(r"final test accuracy (\S+)  parameter sum (\S+)", out) for out in runs]
    assert all(found), runs
    (acc_one, sum_one), (acc_two, sum_two), _ = [(float(m.group(1)), float(m.group(2)))
                                                 for m in found if m]
    # the sharded optimizer: the same bits as torch.optim.SGD
    assert found[2] and found[1] and found[2].group(0) == found[1].group(0), runs[1:]
    assert acc_two >= 0.8
    assert abs(acc_one - acc_two) <= 1 / 360  # at most one of the 360 test images differs
    # the same global batches and MEAN-reduced gradients: equal up to float rounding
    assert sum_two == pytest.approx(sum_one, rel=1e-5, abs=1e-4)
    assert "2 ranks" in runs[1] and "1 ranks" in runs[0]


def test_digits_parameter_servers_preempted_resume_with_more_ps(tmp_path):
    """Asynchronous training with 1 ps, SIGTERM to the job after its first epoch: the
    coordinator saves at the end of its epoch and exits 42 while the workers and ps ignore
    the signal and end with it; a rerun with 2 ps (the first layer then sharded over
    both) resumes from the checkpoint and trains on."""
    import signal
    import time

    job = subprocess.Popen(
        [sys.executable, "-m", "mpistrat", "run", "-n", "4", "--num-ps", "1",
         "examples/digits_ps.py", "--epochs", "500", "--checkpoint-dir", str(tmp_path)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert job.stdout is not None
        lines = []
        deadline = time.monotonic() + 120
        for line in job.stdout:  # until the first epoch is done
            lines.append(line)
            if line.startswith("epoch ") or time.monotonic() > deadline:
                break
        job.send_signal(signal.SIGTERM)
        rest, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    out = "".join(lines) + rest
    assert job.returncode == 42, out
    assert "2 workers, 1 ps" in out and "SIGTERM received; saved" in out, out
    saved = int(re.findall(r"^epoch +(\d+)/500", out, flags=re.M)[-1])
    again = _run(5, "--num-ps", "2", "examples/digits_ps.py", "--epochs", str(saved + 3),
                 "--checkpoint-dir", str(tmp_path), timeout=240)
    assert f"(epoch {saved})" in again and "epoch   1/" not in again, again
    assert "2 workers, 2 ps" in again
    assert _accuracy(again) >= 0.85


def test_digits_from_a_data_file_is_scikit_learns_data():
    """``--data`` (for machines without scikit-learn, e.g. a GPU image) reads its file
    format into the same split as scikit-learn's own copy."""
    import importlib.util

    import numpy as np
    import sklearn.datasets

    spec = importlib.util.spec_from_file_location("digits_mlp",
                                                  ROOT / "examples" / "digits_mlp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path = Path(sklearn.datasets.__file__).parent / "data" / "digits.csv.gz"
    for ours, theirs in zip(module.load_data(3, str(path)), module.load_data(3)):
        assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs)


def test_torch_ddp_script_on_two_ranks_reaches_the_one_process_accuracy():
    """examples/torch_ddp.py: torch's own DDP, DistributedSampler and DataLoader over the
    "mpistrat" backend. The ranks' samplers split each epoch differently from one
    process's, so the models differ by more than rounding; the accuracy must not."""
    pytest.importorskip("torch", reason="the example trains a PyTorch CNN")
    args = ("examples/torch_ddp.py", "--epochs", str(EPOCHS))
    one, two = _accuracy(_run(1, *args)), _run(2, *args)
    assert "2 ranks, mpistrat" in two, two
    assert one >= 0.9
    assert _accuracy(two) >= one - 0.02, (one, two)


def _rank_pids(script: str) -> list[int]:
    """The ranks of a running ``mpistrat run -n`` job of ``script`` (not its launcher:
    only the launcher's command line holds ``--min-ranks``)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as file:
                argv = file.read().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(script.encode()) for a in argv) and b"mpistrat" in argv \
                and b"--min-ranks" not in argv and b"-n" not in argv:
            found.append(int(pid))
    return sorted(found)


def _newest_weights(directory: Path) -> dict[str, np.ndarray]:
    from mpistrat.checkpoint import _files

    path = _files.scan(str(directory), "ckpt")[-1][1]
    manifest, arrays = _files.read(path)
    return {e["name"]: arrays[e["key"]] for e in manifest["entries"] if e.get("key")}


@pytest.mark.timeout(180)
def test_digits_keeps_training_when_a_rank_is_lost(tmp_path):
    """examples/digits_mlp.py, unchanged, under mpistrat run -n 4 --min-ranks 2: a rank
    killed mid-run (SIGKILL, from outside) costs the job one step, not the run. The job
    goes on on 3 ranks from the snapshot in /dev/shm (not the checkpoint of the last
    epoch) and ends with the model an uninterrupted run on 4 ranks trains."""
    epochs = "12"
    _run(4, "examples/digits_mlp.py", "--epochs", epochs, "--checkpoint-dir",
         str(tmp_path / "straight"), "--no-progress")
    out = tmp_path / "job.out"
    with open(out, "w") as log:
        job = subprocess.Popen(
            [sys.executable, "-m", "mpistrat", "run", "-n", "4", "--min-ranks", "2",
             "--timeout", "20", "examples/digits_mlp.py", "--epochs", epochs,
             "--checkpoint-dir", str(tmp_path / "elastic"), "--no-progress"],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while "epoch   4/" not in out.read_text() and job.poll() is None:
            assert time.monotonic() < deadline, out.read_text()
            time.sleep(0.02)
        ranks = _rank_pids("examples/digits_mlp.py")
        assert len(ranks) == 4, (ranks, out.read_text())
        os.kill(ranks[-1], signal.SIGKILL)
        assert job.wait(120) == 0, out.read_text()
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(30)
    text = out.read_text()
    assert re.search(r"mpistrat run: lost rank \d \(\S+\); restart 1 of 3 on 3 ranks", text), text
    resumed = re.search(r"resumed from (\S+) \(epoch (\d+)\)", text)
    assert resumed and "/dev/shm/mpistrat-elastic-" in resumed.group(1), text
    assert "3 replicas)" in text, text  # (the epochs after the loss)
    straight, elastic = (_newest_weights(tmp_path / d) for d in ("straight", "elastic"))
    assert straight.keys() == elastic.keys()
    for name in straight:
        np.testing.assert_allclose(elastic[name], straight[name], rtol=1e-4, atol=1e-6,
                                   err_msg=name)
