"""Gradient batches and training across real hosts (bin/cluster-local): ResNet-50's batch
through ``batch_reduce``, the digits example trained on 2 hosts against 1, and the spec the
strategy's AUTO communication picks from the hosts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mpistrat.strategy import mirrored

pytestmark = pytest.mark.cluster

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MPIEXEC = Path(sys.executable).parent / "mpiexec"
MPISTRAT = Path(sys.executable).parent / "mpistrat"


def test_batch_reduce_of_resnet50_is_exact_and_identical_on_every_rank(cluster):
    """161 tensors, 97.5 MiB per replica, 2 hosts x 2 ranks: MultiWorkerAllReduce's
    default spec (pscpu/pscpu#2, each tensor on its own) with 2 replicas per rank, and
    shared memory in each host with rechd across the hosts (the strategy's AUTO spec
    across nodes) over one pack, MEAN."""
    configurations = ["default=default,0,2,sum", "shm/rechd=rechd:16K:shm/rechd,1,1,mean"]
    before = cluster.bytes()
    result = cluster.mpiexec("node1:2,node2:2",
                             [sys.executable, HERE / "_check_batch.py", *configurations],
                             timeout=100)
    moved = cluster.moved(before)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and len(lines) == 1, (
        f"the batch job failed ({result.returncode}):\n{result.stdout[-3000:]}"
        f"\n{result.stderr[-3000:]}")
    report = json.loads(lines[0][len("RESULT "):])
    assert report["hosts"] == ["node1", "node1", "node2", "node2"], report["hosts"]
    assert (report["tensors"], report["elements"]) == (161, 25_557_032), report
    assert report["configurations"] == ["default", "shm/rechd"], report
    assert not report["problems"], "\n".join(report["problems"][:20])
    # each configuration sends about one batch (97.5 MiB) out of each host
    assert all(sent > 150 << 20 for sent in moved.values()), (
        f"bytes sent over each host's link: {moved}; expected > 150 MiB each")


# The environment of a run on one machine without the cluster: nothing of hydra's ssh
# shim, the ofi/tcp transport, a launcher or a Slurm job.
_CLUSTER_ONLY = ("HYDRA_", "MPIR_CVAR_", "FI_", "SLURM_", "SBATCH_", "PMI_", "PMIX_",
                 "OMPI_", "MPISTRAT_")


def _checkpoint(directory: Path, epoch: int) -> dict[str, np.ndarray]:
    """The arrays of checkpoint ``ckpt-EPOCH`` by variable name (its manifest names the
    npz keys)."""
    manifest = json.loads((directory / f"ckpt-{epoch}.json").read_text())
    with np.load(directory / manifest["data"]) as data:
        return {e["name"]: data[e["key"]] for e in manifest["entries"]}


def _epoch_lines(output: str) -> list[str]:
    """Rank 0's per-epoch and final lines without the timing."""
    return [re.sub(r"  \(\d+\.\d+ s, ", "  (", line) for line in output.splitlines()
            if line.startswith(("epoch ", "final test accuracy"))]


@pytest.mark.timeout(240)  # two launches of up to 100 s each (a loaded 2-core machine)
def test_digits_trained_on_two_hosts_is_the_same_model_as_on_one(cluster, tmp_path):
    """``mpistrat run -n 4 examples/digits_mlp.py`` with its default strategy, on 2 hosts
    x 2 ranks and on this machine alone (4 ranks, no cluster environment), 2 epochs,
    checkpointing every epoch: the last checkpoints hold the same weights, momentum
    velocities and epoch, bit for bit, and rank 0 printed the same losses and accuracies.

    Bitwise equality is what to expect, not luck, once both runs use one spec: the
    default (AUTO) spec across nodes is ``rechd:16K:shm/rechd`` (on one node it is
    ``shm:16M:rechd``, so the one-host run is given the two-host run's spec), and every
    gradient of this model is at most 16 KiB, so both runs sum the packed gradients with
    ``rechd`` over 4 ranks, whose order of operations depends on the ranks only."""
    epochs = 2
    runs = {}
    for name in ("two hosts", "one host"):
        directory = tmp_path / name.replace(" ", "-")
        argv = [MPISTRAT, "run", "-n", "4", ROOT / "examples" / "digits_mlp.py",
                "--epochs", str(epochs), "--no-progress", "--checkpoint-dir", directory]
        if name == "two hosts":
            before = cluster.bytes()
            result = cluster.run(argv, timeout=100)
            moved = cluster.moved(before)
        else:
            argv[2:2] = ["--spec", mirrored.AUTO_SPEC_NODES]  # (AUTO's choice across nodes)
            env = {k: v for k, v in os.environ.items() if not k.startswith(_CLUSTER_ONLY)}
            env["PATH"] = f"{MPISTRAT.parent}:{env.get('PATH', '')}"
            result = subprocess.run([str(a) for a in argv], env=env, cwd=ROOT, timeout=100,
                                    capture_output=True, text=True, check=False)
        assert result.returncode == 0, (
            f"training on {name} failed ({result.returncode}):\n{result.stdout[-3000:]}"
            f"\n{result.stderr[-3000:]}")
        runs[name] = (_epoch_lines(result.stdout), _checkpoint(directory, epochs))
    (lines_two, model_two), (lines_one, model_one) = runs["two hosts"], runs["one host"]
    assert len(lines_two) == epochs + 1 and "4 replicas" in lines_two[0], lines_two
    assert lines_two == lines_one, (
        f"rank 0 printed different losses/accuracies:\ntwo hosts: {lines_two}\n"
        f"one host:  {lines_one}")
    assert sorted(model_two) == sorted(model_one) == sorted(
        ["w1", "b1", "w2", "b2", "v_w1", "v_b1", "v_w2", "v_b2", "epoch"]), sorted(model_two)
    assert int(model_two["epoch"]) == epochs, model_two["epoch"]
    differ = {name: f"{np.count_nonzero(a != model_one[name])} of {a.size} elements differ, "
                    f"by up to {np.max(np.abs(a.astype(np.float64) - model_one[name])):.3g}"
              for name, a in model_two.items()
              if a.dtype != model_one[name].dtype or not np.array_equal(a, model_one[name])}
    assert not differ, f"the model trained on two hosts is not the one trained on one: {differ}"
    # the gradients (19 KB a step, 46 steps) crossed the links: about 1 MB out of each
    # host (the launcher alone sends some 10 KB)
    assert all(sent > 512 << 10 for sent in moved.values()), (
        f"bytes sent over each host's link while training: {moved}; expected > 512 KiB each")


_AUTO_PROBE = """
import json, socket
import numpy as np
from mpi4py import MPI
import mpistrat as ms
from mpistrat.spec import parse_spec
from mpistrat.strategy import mirrored
strategy = ms.MultiWorkerMirroredStrategy()
spec = strategy.extended.cross_device_ops.spec
rank, size = MPI.COMM_WORLD.rank, strategy.num_replicas_in_sync
value = np.arange(1 << 18, dtype=np.float32) + rank  # 1 MiB: past the spec's 16K limit
total = strategy.reduce(ms.ReduceOp.SUM, strategy.run(lambda: value), axis=None)
expected = size * np.arange(1 << 18, dtype=np.float32) + size * (size - 1) // 2
names = [name for name in ("RING_SPEC", "AUTO_SPEC_ONE_NODE", "AUTO_SPEC_NODES")
         if parse_spec(getattr(mirrored, name)) == spec]
reports = MPI.COMM_WORLD.gather({"rank": rank, "host": socket.gethostname(), "spec": names,
                                 "exact": bool(np.array_equal(np.asarray(total), expected))})
if rank == 0:
    print("AUTO " + json.dumps(reports), flush=True)
"""


@pytest.mark.parametrize("hosts, chosen", [
    ("node1:2,node2:2", "AUTO_SPEC_NODES"),   # several ranks a host: shm inside, rechd across
    ("node1:3,node2:1", "AUTO_SPEC_NODES"),
    ("node1:1,node2:1", "RING_SPEC"),         # one rank a host: nothing to share memory with
])
def test_strategy_auto_picks_the_hierarchical_spec_across_hosts(cluster, hosts, chosen):
    """MultiWorkerMirroredStrategy's default (AUTO) communication reads the hosts from MPI:
    every rank picks the same spec and reduces exactly through it."""
    before = cluster.bytes()
    result = cluster.mpiexec(hosts, [sys.executable, "-c", _AUTO_PROBE], timeout=100)
    moved = cluster.moved(before)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("AUTO ")]
    reports = json.loads(line[len("AUTO "):])
    n = sum(int(part.split(":")[1]) for part in hosts.split(","))
    assert [r["rank"] for r in reports] == list(range(n)), result.stdout
    assert [r["host"] for r in reports] == [
        part.split(":")[0] for part in hosts.split(",") for _ in range(int(part.split(":")[1]))]
    assert all(r["spec"] == [chosen] and r["exact"] for r in reports), reports
    assert all(sent > 256 << 10 for sent in moved.values()), moved
