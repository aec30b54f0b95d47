"""``mpistrat bench`` under ``mpiexec -n 2`` and ``-n 3``: tiny sizes, few iterations.

The ``--check`` test registers a deliberately wrong algorithm from a plugin module that
this file writes into a temporary folder (``--plugin``); nothing test-only ships in the
package's registry. ``--compare torch`` runs against a stand-in ``torch`` package (also
written here, reducing through mpi4py), which checks the glue (process group from the MPI
world, op mapping, MEAN) but not gloo itself, and that the ``torch-mpistrat`` column is
left out with a note where ``mpistrat.torch`` cannot be imported; with PyTorch installed
both columns run for real (gloo and the "mpistrat" backend).
"""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from mpistrat import parse_spec
from mpistrat.bench.recommend import read_spec_file
from mpistrat.cli import cli

pytestmark = pytest.mark.launch

TINY = ["-n", "2", "-w", "1", "-q"]

CORRUPT_PLUGIN = textwrap.dedent('''
    """Test only: 'corrupt' = native, then one element off by one on rank 0."""
    from mpistrat import algorithms, dispatch
    from mpistrat.algorithms import Implementation, native


    def _corrupt(comm, buf, *, op, shards=1, backend, rotation=0):
        native.all_reduce(comm, buf, op=op, backend=backend)
        if comm.Get_rank() == 0 and buf.size:
            buf[buf.size // 2] += 1


    dispatch.register(algorithms.AlgorithmInfo(
        "corrupt", "test only: native, then one element wrong on rank 0",
        algorithms.Shards.IGNORED, from_tf=False), Implementation(_corrupt))
''')


@pytest.fixture
def bench(mpirun, mpistrat_cmd):
    def run(n, *args, env=None):
        return mpirun(n, [*mpistrat_cmd, "bench", *args], env=env)

    return run


def _json(path):
    return json.loads(path.read_text())


@pytest.mark.parametrize("n, extra, participants", [
    (2, [], 2),
    (3, ["--local-replicas", "2", "-o", "mean"], 6),
])
def test_sweep_writes_every_field(bench, tmp_path, n, extra, participants):
    out_json, out_csv = tmp_path / "s.json", tmp_path / "s.csv"
    result = bench(n, "--algorithms", "xring,rechd,pscpu", "--shards", "1,all",
                   "-b", "4", "-e", "1K", "-f", "16", *TINY, *extra,
                   "--json", str(out_json), "--csv", str(out_csv))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert sum(line.startswith("# mpistrat bench") for line in lines) == 1  # rank 0 only
    assert sum(line.startswith("#       size") for line in lines) == 1
    doc = _json(out_json)
    meta = doc["meta"]
    for key in ("mpi_library", "mpi_vendor", "ranks", "nodes", "ranks_per_node", "hosts",
                "hostnames_by_rank", "date", "mpistrat", "mpi4py", "numpy", "python",
                "options", "argv", "method"):
        assert key in meta, key
    assert meta["ranks"] == n and len(meta["hostnames_by_rank"]) == n
    assert sum(meta["ranks_per_node"]) == n and meta["options"]["dtype"] == "float32"
    assert doc["complete"] is True and doc["recommendation"] and doc["cost_model"]
    labels = ["native", "xring", "rechd", "pscpu", f"pscpu#{n}"]  # "all": shuffles only
    assert meta["options"]["entries"] == labels
    results = doc["results"]
    assert [(r["nbytes"], r["label"]) for r in results] == [
        (size, label) for size in (4, 64, 1024) for label in labels]
    for r in results:
        assert r["participants"] == participants and r["wrong"] == 0
        assert len(r["samples"]) == r["iters"] == 2 and r["warmup"] == 1
        assert len(r["per_rank_median"]) == n
        assert r["min_s"] <= r["median_s"] <= r["max_s"]
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 2 * (participants - 1)
                                                / participants)
    with open(out_csv) as fh:
        rows = list(csv.DictReader(line for line in fh if not line.startswith("#")))
    assert len(rows) == 2 * len(results)


def test_check_catches_a_wrong_algorithm(bench, tmp_path):
    (tmp_path / "bench_corrupt_plugin.py").write_text(CORRUPT_PLUGIN)
    out_json = tmp_path / "c.json"
    result = bench(2, "--plugin", "bench_corrupt_plugin", "--algorithms", "corrupt,rechd",
                   "-c", "-b", "64", "-e", "1K", "-f", "16", "-n", "3", "-w", "1", "-q",
                   "--recommend", "--json", str(out_json),
                   env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 1, result.stdout + result.stderr  # wrong results fail
    assert "WRONG RESULTS" in result.stdout
    records = {(r["nbytes"], r["label"]): r for r in _json(out_json)["results"]}
    for size in (64, 1024):
        corrupt = records[(size, "corrupt")]
        assert corrupt["wrong"] == 1  # one element, on one rank, in every iteration
        assert corrupt["checked"] == 1 + 1 + 3 and corrupt["wrong_iterations"] == 5
        assert records[(size, "rechd")]["wrong"] == records[(size, "native")]["wrong"] == 0
    spec = result.stdout.split("spec: ")[1].split()[0]
    assert "corrupt" not in spec


def test_recommended_spec_parses_routes_and_runs(bench, tmp_path):
    saved, out_json = tmp_path / "allreduce.spec", tmp_path / "r.json"
    result = bench(2, "--algorithms", "rechd,xring", "-b", "4", "-e", "4K", "-f", "32",
                   *TINY, "--save", str(saved), "--json", str(out_json))
    assert result.returncode == 0, result.stderr
    spec = read_spec_file(saved)
    printed = [ln for ln in result.stdout.splitlines() if ln.startswith("spec: ")]
    assert printed == [f"spec: {spec}"]
    assert parse_spec(str(spec)) == spec
    for row in _json(out_json)["recommendation"]["ranges"]:
        for size in row["sizes"]:
            entry = spec.route(size)
            assert (entry.alg, entry.shards) == (row["alg"], row["shards"])
    validate = CliRunner().invoke(cli, ["validate", str(spec), "--workers", "2"])
    assert validate.exit_code == 0, validate.output

    measured = tmp_path / "m.json"
    result = bench(2, "--spec", f"@{saved}", "--algorithms", "native", "-b", "4", "-e", "4K",
                   "-f", "32", *TINY, "--json", str(measured))
    assert result.returncode == 0, result.stderr
    rows = [r for r in _json(measured)["results"] if r["kind"] == "spec"]
    assert [r["label"] for r in rows] == [f"spec:{spec}"] * 3
    for r in rows:
        assert (r["alg"], r["shards"]) == tuple(spec.route(r["nbytes"]))[:2]


def test_batch_mode(bench, tmp_path):
    shapes, out_json = tmp_path / "shapes.json", tmp_path / "b.json"
    shapes.write_text("[[16, 3, 3, 3], [16], [16], [64, 16], [64], [10]]")
    result = bench(2, "--batch", str(shapes), "--num-packs", "1,2", "--agg-small-grads",
                   "256:4", "-c", *TINY, "--json", str(out_json))
    assert result.returncode == 0, result.stdout + result.stderr
    doc = _json(out_json)
    labels = [r["label"] for r in doc["results"]]
    assert labels == ["per-tensor native", "per-tensor native, out of place", "flat native",
                      "flat rechd",
                      "flat rechd (batch_reduce)", "batch_reduce num_packs=1",
                      "batch_reduce num_packs=2", "batch_reduce agg 256B/4",
                      "batch_reduce no packing", "batch_reduce num_packs=1, one buffer"]
    assert all(r["wrong"] == 0 and r["checked"] == 1 + 1 + 2 for r in doc["results"])
    assert doc["inputs_modified"] == 0 and doc["meta"]["options"]["tensors"] == 6
    assert "time/per-tensor" in result.stdout and "time/per-tensor oop" in result.stdout
    assert "time/flat spec" in result.stdout and "time/flat oop" in result.stdout

    # shm with the gradients of the last row in shared memory (mpistrat.shared_arrays)
    result = bench(2, "--batch", str(shapes), "--spec", "shm", "--num-packs", "1",
                   "--agg-small-grads", "0", "--shared", "-c", *TINY, "--json", str(out_json))
    assert result.returncode == 0, result.stdout + result.stderr
    doc = _json(out_json)
    assert doc["results"][-1]["label"] == "batch_reduce num_packs=1, shared buffer"
    assert all(r["wrong"] == 0 for r in doc["results"]) and doc["inputs_modified"] == 0


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib is not installed")
def test_self_launch_and_plot(tmp_path, mpistrat_cmd):
    png = tmp_path / "sweep.png"
    result = subprocess.run(
        [*mpistrat_cmd, "bench", "--np", "2", "--algorithms", "rechd", "-b", "4", "-e", "64",
         *TINY, "--plot", str(png)],
        capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 rank(s)" in result.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, message", [
    (["--algorithms", "pscpu#5"], "shards=5 but its gather pool"),
    pytest.param(["--gpus-per-rank", "1"], "needs 1 CUDA device(s) per rank",
                 marks=pytest.mark.skipif(importlib.util.find_spec("cupy") is not None,
                                          reason="CuPy is installed")),
])
def test_errors_found_after_mpi_starts_are_printed_once(bench, args, message):
    result = bench(2, *args, "-b", "4", "-e", "4", *TINY)
    assert result.returncode == 2
    output = result.stdout + result.stderr
    assert output.count(message) == 1, output


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None,
                    reason="PyTorch is installed: the missing-torch error cannot happen")
def test_compare_torch_without_torch_says_how_to_install(bench):
    result = bench(2, "--compare", "torch", "-b", "4", "-e", "4", *TINY)
    assert result.returncode == 2
    output = result.stdout + result.stderr
    assert output.count("--compare torch needs PyTorch") == 1, output
    assert "pip install torch" in output


NO_TORCH_ON_RANK_1 = textwrap.dedent('''
    """Test only: PyTorch is not importable on rank 1 (find_spec sees None)."""
    import os
    import sys

    if os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK")) == "1":
        sys.modules["torch"] = None
''')


@pytest.mark.parametrize("mode", [["-b", "4", "-e", "4"], ["--batch", "resnet50"]],
                         ids=["sweep", "batch"])
def test_compare_torch_missing_on_one_rank_is_one_error(bench, tmp_path, mode):
    (tmp_path / "sitecustomize.py").write_text(NO_TORCH_ON_RANK_1)
    result = bench(2, "--compare", "torch", *mode, *TINY, env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 2, result.stdout + result.stderr
    output = result.stdout + result.stderr
    assert output.count("--compare torch needs PyTorch on every rank") == 1, output
    assert "rank(s) [1]" in output and "pip install torch" in output


TINY_BATCH = "[[16, 3, 3, 3], [16], [16], [64, 16], [64], [10]]"


def test_batch_compare_torch_times_both_backends_on_the_same_batch(bench, tmp_path):
    dist = pytest.importorskip("torch.distributed")
    shapes, out_json = tmp_path / "shapes.json", tmp_path / "bt.json"
    shapes.write_text(TINY_BATCH)
    result = bench(2, "--batch", str(shapes), "--num-packs", "1", "--compare", "torch", "-c",
                   *TINY, "--json", str(out_json))
    assert result.returncode == 0, result.stdout + result.stderr
    doc = _json(out_json)
    torch_rows = []
    for peer in ("torch-gloo", "torch-mpistrat"):  # three rows each, gloo's first
        torch_rows.append((f"{peer} per-tensor", "torch-each", 6))
        if hasattr(dist, "all_reduce_coalesced"):
            torch_rows.append((f"{peer} all_reduce_coalesced", "torch-coalesced", 1))
        torch_rows.append((f"{peer} flat (cat, split)", "torch-flat", 1))
    n = len(torch_rows)
    assert [(r["label"], r["kind"]) for r in doc["results"][-n:]] == [
        (label, f"batch-{kind}") for label, kind, _ in torch_rows]
    assert [(m["label"], m["calls"]) for m in doc["methods"][-n:]] == [
        (label, calls) for label, _, calls in torch_rows]
    for r in doc["results"]:  # checked once, after warm-up and every round (-c)
        assert r["wrong"] == 0 and r["checked"] == 1 + 1 + 2 and len(r["samples"]) == 2
    assert doc["inputs_modified"] == 0 and doc["meta"]["options"]["compare"] == ["torch"]
    for peer, backend in (("torch-gloo", "gloo backend"),
                          ("torch-mpistrat", "mpistrat backend")):
        assert sum(note.startswith(f"{peer}: torch.distributed ") and backend in note
                   and "torch thread(s) per rank" in note
                   for note in doc["meta"]["notes"]) == 1, doc["meta"]["notes"]
    table = [line for line in result.stdout.splitlines() if not line.startswith("#")]
    for label, _, _ in torch_rows:
        assert sum(line.startswith(f" {label} ") for line in table) == 1, result.stdout

    # a dtype gloo cannot reduce: one error, before anything is measured
    result = bench(2, "--batch", str(shapes), "--compare", "torch", "-d", "int16", *TINY)
    assert result.returncode == 2
    output = result.stdout + result.stderr
    assert output.count("cannot reduce dtype int16") == 1, output


FAKE_TORCH = {
    "torch/__init__.py": textwrap.dedent('''
        """Stand-in for PyTorch (test only): tensors are NumPy arrays."""
        __version__ = "0.0-stand-in"
        _threads = [4]


        def set_num_threads(n):
            _threads[0] = n


        def get_num_threads():
            return _threads[0]


        class _Tensor:
            def __init__(self, array):
                self.array = array

            def div_(self, value):
                self.array /= value


        def from_numpy(array):
            return _Tensor(array)
    '''),
    "torch/distributed.py": textwrap.dedent('''
        """Stand-in for torch.distributed over mpi4py (test only); records its init."""
        import enum
        import os

        from mpi4py import MPI


        class ReduceOp(enum.Enum):
            SUM = "sum"
            MIN = "min"
            MAX = "max"


        _OPS = {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX}
        calls = []


        class TCPStore:
            def __init__(self, host_name, port, world_size=None, is_master=False,
                         wait_for_workers=True):
                # rank 0's store binds a port of the system's choice (0); the others join it
                assert (port == 0) == is_master == (MPI.COMM_WORLD.rank == 0)
                assert not (is_master and wait_for_workers)  # (the others come later)
                self.host, self.port = host_name, port or 20000 + os.getpid() % 40000


        def init_process_group(backend, store, rank, world_size):
            assert backend == "gloo" and isinstance(store, TCPStore)
            assert (rank, world_size) == (MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size)
            address = f"{store.host}:{store.port}"
            calls.append(address)
            with open(os.environ["FAKE_TORCH_LOG"] + f".{rank}", "w") as fh:
                fh.write(address)


        def all_reduce(tensor, op):
            MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, tensor.array, op=_OPS[op.value])


        def destroy_process_group():
            calls.clear()
    '''),
}


def test_compare_torch_runs_the_peer_from_the_mpi_world(bench, tmp_path):
    for name, text in FAKE_TORCH.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    out_json, log = tmp_path / "p.json", tmp_path / "init"
    result = bench(2, "--compare", "torch", "--algorithms", "rechd", "-o", "mean", "-c",
                   "-b", "4", "-e", "64", *TINY, "--json", str(out_json), "--recommend",
                   env={"PYTHONPATH": str(tmp_path), "FAKE_TORCH_LOG": str(log)})
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [r for r in _json(out_json)["results"] if r["label"] == "torch-gloo"]
    assert len(rows) == 3 and all(r["wrong"] == 0 and r["kind"] == "torch" for r in rows)
    addresses = {(tmp_path / f"init.{r}").read_text() for r in range(2)}
    assert len(addresses) == 1  # every rank joined the address rank 0 broadcast
    assert "torch.distributed 0.0-stand-in" in result.stdout
    assert "torch thread(s) per rank" in result.stdout
    assert "torch" not in result.stdout.split("spec: ")[1]
    # the stand-in is no torch mpistrat.torch imports: gloo's column alone, and why
    doc = _json(out_json)
    assert doc["meta"]["options"]["entries"] == ["native", "rechd", "torch-gloo"]
    assert not any(r["label"] == "torch-mpistrat" for r in doc["results"])
    (why,) = [n for n in doc["meta"]["notes"] if n.startswith("torch-mpistrat")]
    assert why.startswith("torch-mpistrat: not measured: rank(s) [0, 1]: import "
                          "mpistrat.torch failed"), why
    assert result.stdout.count("# note: torch-mpistrat: not measured") == 1


def test_compare_torch_measures_gloo_and_the_mpistrat_backend(bench, tmp_path):
    pytest.importorskip("torch.distributed")
    out = {ext: tmp_path / f"t.{ext}" for ext in ("json", "csv", "md")}
    result = bench(2, "--compare", "torch", "--algorithms", "rechd", "-c", "-b", "4",
                   "-e", "64K", "-f", "128", *TINY, "--json", str(out["json"]),
                   "--csv", str(out["csv"]), "--markdown", str(out["md"]))
    assert result.returncode == 0, result.stdout + result.stderr
    peers = ["torch-gloo", "torch-mpistrat"]
    table = [line.split() for line in result.stdout.splitlines() if not line.startswith("#")]
    for size in ("4", "512", "65536"):  # a row of each column per size
        assert [row[4] for row in table if row[0] == size] == ["native", "rechd", *peers]
    doc = _json(out["json"])
    assert doc["meta"]["options"]["entries"] == ["native", "rechd", *peers]
    rows = [r for r in doc["results"] if r["kind"] == "torch"]
    assert [r["label"] for r in rows] == peers * 3
    assert all(r["wrong"] == 0 and r["checked"] == 1 + 1 + 2 for r in rows)
    for peer, backend in zip(peers, ("gloo backend", "mpistrat backend")):
        assert sum(note.startswith(f"{peer}: torch.distributed ") and backend in note
                   for note in doc["meta"]["notes"]) == 1, doc["meta"]["notes"]
    assert "torch-mpistrat: not measured" not in result.stdout
    assert "Avg bus bandwidth" in result.stdout and " torch-mpistrat " in result.stdout
    with out["csv"].open() as fh:
        records = list(csv.DictReader(line for line in fh if not line.startswith("#")))
    assert {r["algorithm"] for r in records if r["kind"] == "torch"} == set(peers)
    markdown = out["md"].read_text()
    assert all(markdown.count(f"| {peer} |") == 3 for peer in peers), markdown

    # --from-json: the saved run's table again, both columns, and the analyses
    again = CliRunner().invoke(cli, ["bench", "--from-json", str(out["json"])])
    assert again.exit_code == 0, again.output
    for peer in peers:
        assert sum(f" {peer} " in line for line in again.output.splitlines()
                   if not line.startswith("#")) == 3, again.output
    assert "# Best vs native:" in again.output


def test_transport_net_goes_through_the_network_module(bench, tmp_path, launcher):
    out_json = tmp_path / "t.json"
    result = bench(2, "--transport", "net", "--algorithms", "rechd,pscpu/pscpu", "-b", "4",
                   "-e", "64", *TINY, "--json", str(out_json))
    assert result.returncode == 0, result.stdout + result.stderr
    meta = _json(out_json)["meta"]
    assert meta["mpi_env"]["MPIR_CVAR_NOLOCAL"] == "1"
    assert "# env: MPIR_CVAR_NOLOCAL=1" in result.stdout
    if launcher.flavour == "mpich":
        assert meta["nodes"] == 2  # without shared memory every rank is its own node


def test_main_module_runs_bench_help():
    result = subprocess.run([sys.executable, "-m", "mpistrat", "bench", "--help"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0 and "--recommend" in result.stdout
