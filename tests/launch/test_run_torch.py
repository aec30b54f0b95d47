"""An unmodified torchrun-style script under ``mpistrat run`` (self-launched and under
``mpiexec``): torchrun's variables come from MPI, ``init_process_group("gloo")`` meets,
and ``--torch-backend mpistrat`` swaps gloo for the ``"mpistrat"`` backend."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mpistrat.runner.torchenv import TORCH_ENV, free_port

pytestmark = pytest.mark.launch

ROOT = Path(__file__).resolve().parents[2]

# what a script written for torchrun does, nothing of mpistrat in it
TORCHRUN_SCRIPT = textwrap.dedent("""\
    import json, os, sys
    torch_before = "torch" in sys.modules
    import torch
    import torch.distributed as dist

    names = {names!r}
    seen = {{name: os.environ.get(name) for name in names}}
    backend = sys.argv[1] if len(sys.argv) > 1 else None
    if backend is None:
        dist.init_process_group()
    else:
        dist.init_process_group(backend)
    rank, size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    total = torch.tensor([float(rank + 1), 1.0])
    dist.all_reduce(total)
    sys.stdout.write("@@" + json.dumps({{
        "env": seen, "rank": rank, "size": size, "backend": dist.get_backend(),
        "total": total.tolist(), "local_rank": local_rank, "torch_before": torch_before}})
        + "\\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    """).format(names=list(TORCH_ENV))


def _records(stdout: str) -> list[dict]:
    # (each record is one write, but with PYTHONUNBUFFERED two ranks' may share a line)
    decoder = json.JSONDecoder()
    found = [decoder.raw_decode(piece)[0] for piece in stdout.split("@@")[1:]]
    return sorted(found, key=lambda r: r["rank"])


def _check(records: list[dict], size: int, backend: str, port: str | None = None) -> None:
    assert [r["rank"] for r in records] == list(range(size))
    ports = {r["env"]["MASTER_PORT"] for r in records}
    assert len(ports) == 1 and (port is None or ports == {port})
    for r in records:
        rank = str(r["rank"])
        env = r["env"]
        assert env["RANK"] == env["ROLE_RANK"] == env["LOCAL_RANK"] == rank  # (one host)
        assert env["WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] \
            == str(size)
        assert env["GROUP_RANK"] == "0" and env["GROUP_WORLD_SIZE"] == "1"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert r["size"] == size and r["backend"] == backend
        assert r["total"] == [size * (size + 1) / 2, size]
        assert r["torch_before"] is False  # (mpistrat run did not import torch)


@pytest.fixture(scope="module")
def torch_script(tmp_path_factory):
    pytest.importorskip("torch")
    path = tmp_path_factory.mktemp("torchrun") / "train.py"
    path.write_text(TORCHRUN_SCRIPT)
    return path


def test_self_launched_torchrun_script_meets_over_gloo(torch_script):
    result = subprocess.run([sys.executable, "-m", "mpistrat", "run", "-n", "2",
                             str(torch_script), "gloo"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    _check(_records(result.stdout), 2, "gloo")


def test_torchrun_script_under_mpiexec_keeps_the_users_port(mpirun, mpistrat_cmd,
                                                           torch_script):
    port = str(free_port())
    result = mpirun(3, [*mpistrat_cmd, "run", str(torch_script), "gloo"],
                    env={"MASTER_PORT": port}, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    _check(_records(result.stdout), 3, "gloo", port)


def test_a_users_rank_that_is_not_mpis_stops_every_rank_before_the_script(
        mpirun, mpistrat_cmd, tmp_path):
    script = tmp_path / "never.py"
    script.write_text("print('@@ the script ran', flush=True)\n")
    result = mpirun(2, [*mpistrat_cmd, "run", str(script)], env={"RANK": "0"}, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "@@" not in result.stdout
    assert result.stderr.count("Error: mpistrat run: RANK='0' is set in the environment of "
                               "the rank MPI numbers 1 (of 2)") == 1, result.stderr


@pytest.mark.parametrize("init", ["gloo", None, "cpu:gloo,cuda:nccl"])
def test_torch_backend_mpistrat_replaces_gloo(torch_script, init):
    result = subprocess.run([sys.executable, "-m", "mpistrat", "run", "-n", "2",
                             "--torch-backend", "mpistrat", str(torch_script),
                             *([init] if init else [])],
                            cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    records = _records(result.stdout)
    for r in records:
        r["torch_before"] = False  # (--torch-backend mpistrat imports torch: asked for)
    _check(records, 2, "mpistrat")


def test_torch_backend_mpistrat_without_torch_stops_every_rank(mpirun, mpistrat_cmd,
                                                              tmp_path):
    hide = tmp_path / "hide"
    hide.mkdir()
    # (this job's interpreters cannot import torch, whatever is installed)
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None\n")
    script = tmp_path / "never.py"
    script.write_text("print('@@ the script ran', flush=True)\n")
    result = mpirun(2, [*mpistrat_cmd, "run", "--torch-backend", "mpistrat", str(script)],
                    env={"PYTHONPATH": f"{hide}:{ROOT}"}, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "@@" not in result.stdout
    assert result.stderr.count("--torch-backend mpistrat needs mpistrat.torch: PyTorch is "
                               "not installed: pip install 'mpistrat[torch]'") == 1, \
        result.stderr


FAILING = textwrap.dedent("""\
    import sys, time
    import torch, torch.distributed as dist
    import mpistrat.torch
    dist.init_process_group("mpistrat")
    if dist.get_rank() == 1:
        if sys.argv[1] == "raise":
            raise RuntimeError("rank one broke")
        time.sleep(60)
    dist.all_reduce(torch.ones(1000))
    print("@@ past the all_reduce", flush=True)
    """)


@pytest.mark.parametrize("how", ["raise", "stall"])
def test_a_rank_that_fails_or_never_comes_ends_the_job_with_one_account(torch_script,
                                                                       tmp_path, how):
    """mpistrat run's failure handling covers the backend's collectives: rank 1 raises
    (one traceback, the job ends with its status) or sleeps past --timeout while rank 0
    waits in dist.all_reduce (the timeout names rank 1)."""
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    result = subprocess.run([sys.executable, "-m", "mpistrat", "run", "-n", "2",
                             "--stall-check", "2", "--timeout", "5", str(script), how],
                            cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "@@" not in result.stdout, out
    if how == "raise":
        assert out.count("RuntimeError: rank one broke") == 1, out
    else:
        assert "CollectiveTimeoutError" in out and "rank(s) [1] did not arrive" in out, out
