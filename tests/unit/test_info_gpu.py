"""``mpistrat info``'s rank -> GPU mapping, from faked probes (no GPU, no CuPy needed)."""

from __future__ import annotations

from mpistrat.backends.capabilities import GpuProbe
from mpistrat.cli.info import render_info
from mpistrat.info import _shared_gpu_notes, gpu_mapping

NO_CUPY = GpuProbe(reason="CuPy is not installed (pip install 'mpistrat[gpu]')")
TWO = GpuProbe(cupy="13.3", devices=((0, "H100"), (1, "H100")), nccl="2.21.5",
               identities=("GPU-aaaa", "GPU-bbbb"))
ONE = GpuProbe(cupy="13.3", devices=((0, "H100"),), nccl="2.21.5", identities=(None,))


def test_mapping_without_cupy_says_why():
    assert gpu_mapping(NO_CUPY, 0, 1, 1, None) == (
        None, "no GPUs: CuPy is not installed (pip install 'mpistrat[gpu]')")
    assert gpu_mapping(None, 0, 1, 1, None) == (None, "GPU probe skipped (--no-gpu)")


def test_mapping_by_local_rank():
    assert gpu_mapping(TWO, 1, 2, 1, None) == ([[1, "GPU-bbbb"]], "")
    assert gpu_mapping(TWO, 0, 1, 2, "3,4") == ([[0, "GPU-aaaa"], [1, "GPU-bbbb"]], "")
    assert gpu_mapping(ONE, 1, 2, 1, "5") == ([[0, "CUDA_VISIBLE_DEVICES[0]=5"]], "")


def test_mapping_too_few_devices():
    assigned, why = gpu_mapping(TWO, 0, 3, 1, None)
    assert assigned is None and "sees 2 CUDA device(s)" in why


def _data(records, g=1):
    ranks = [{"rank": i, "host": "vm", "node": 0, "local_rank": i, "local_size": len(records),
              "leader": i == 0, "pid": 100 + i, "cuda_visible_devices": None, "gpus": [],
              "cupy": None, "nccl": None, "gpu_note": "", "cuda_aware_mpi": None,
              "slurm": None, "assigned_gpus": a, "assignment_note": why}
             for i, (a, why) in enumerate(records)]
    return {"mpistrat": "0", "python": "3", "mpi4py": "4", "mpi": {
        "vendor": "MPICH 5", "standard": "5.0", "thread_level": "multiple",
        "library_version": "MPICH", "library_path": None},
        "launcher": {"name": None, "size": None}, "world_size": len(records),
        "nodes": 1, "ranks_per_node": [len(records)], "virtual_ranks_per_node": None,
        "gpus_per_rank": g, "slurm": None, "ranks": ranks,
        "notes": _shared_gpu_notes(ranks), "warnings": []}


def test_render_mapping():
    text = render_info(_data([gpu_mapping(TWO, r, 2, 1, None) for r in range(2)]))
    assert "GPU mapping  1 GPU(s) per rank (CUDA ordinal, physical GPU):" in text
    assert "  rank 0: 0 (GPU-aaaa)" in text and "  rank 1: 1 (GPU-bbbb)" in text
    rows = [line.split() for line in text.splitlines() if line[:1].isdigit()]
    assert [row[-4] for row in rows] == ["0", "1"]  # "uses" (before CuPy, NCCL, CUDA-aware)


def test_render_no_gpus():
    text = render_info(_data([gpu_mapping(NO_CUPY, 0, 1, 1, None)]))
    assert "GPU mapping  none: no GPUs: CuPy is not installed" in text


def test_shared_gpu_is_noted():
    data = _data([gpu_mapping(ONE, r, 2, 1, None) for r in range(2)])
    (note,) = data["notes"]
    assert note.startswith("rank(s) [0, 1] on vm share GPU ordinal 0") and "NCCL" in note
    assert f"note: {note}" in render_info(data)
