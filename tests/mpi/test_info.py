"""``collect_info``: one consistent description of the job on every rank."""

from __future__ import annotations

import json

from mpistrat.cli.info import render_info
from mpistrat.info import collect_info


def test_collect_info(comm):
    data = collect_info(comm, gpus=True)
    assert json.loads(json.dumps(data)) == data  # JSON-ready
    assert data["world_size"] == comm.size
    assert [r["rank"] for r in data["ranks"]] == list(range(comm.size))
    assert sum(data["ranks_per_node"]) == comm.size
    assert data["mpi"]["vendor"] and data["mpi"]["standard"]
    mine = data["ranks"][comm.rank]
    assert mine["local_rank"] < mine["local_size"]
    # CPU-only machine: no CuPy means no GPU and a note saying why
    if mine["cupy"] is None:
        assert mine["gpus"] == [] and "CuPy" in mine["gpu_note"]
        assert mine["assigned_gpus"] is None and mine["assignment_note"].startswith("no GPUs")
    # every rank holds the same description
    assert comm.allgather(json.dumps(data["ranks"])) == [json.dumps(data["ranks"])] * comm.size


def test_render_has_one_row_per_rank(comm):
    text = render_info(collect_info(comm, gpus=False))
    rows = [line for line in text.splitlines() if line.split()[:1] and line.split()[0].isdigit()]
    assert len(rows) == comm.size


def test_render_shows_the_gpu_mapping(comm):
    data = collect_info(comm, gpus=True, gpus_per_rank=1)
    text = render_info(data)
    assert data["gpus_per_rank"] == 1 and "GPU mapping  " in text
    if all(r["cupy"] is None for r in data["ranks"]):
        assert "GPU mapping  none: no GPUs: CuPy is not installed" in text
