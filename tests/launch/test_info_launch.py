"""``mpistrat info`` under mpiexec: rank 0 prints one table for every rank."""

from __future__ import annotations

import json

import pytest


@pytest.mark.parametrize("n", [1, 2, 4])
def test_one_table_for_all_ranks(mpirun, mpistrat_cmd, n):
    result = mpirun(n, [*mpistrat_cmd, "info"])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert sum(line.startswith("world") for line in lines) == 1  # printed once, by rank 0
    rows = [line.split() for line in lines if line.split()[:1] and line.split()[0].isdigit()]
    assert [int(row[0]) for row in rows] == list(range(n))


def test_json_with_virtual_nodes(mpirun, mpistrat_cmd):
    result = mpirun(4, [*mpistrat_cmd, "info", "--json"],
                    env={"MPISTRAT_RANKS_PER_NODE": "2"})
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["world_size"] == 4
    assert data["nodes"] == 2 and data["ranks_per_node"] == [2, 2]
    assert [r["node"] for r in data["ranks"]] == [0, 0, 1, 1]
    assert [r["leader"] for r in data["ranks"]] == [True, False, True, False]
    assert data["launcher"]["size"] == 4 and not data["warnings"]


def test_launch_module_passes_exit_status(mpistrat_cmd, tmp_path):
    import subprocess
    import sys

    script = tmp_path / "exit3.py"
    script.write_text("from mpi4py import MPI\nraise SystemExit(3 if MPI.COMM_WORLD.rank == 1 else 0)\n")
    result = subprocess.run(
        [sys.executable, "-m", "mpistrat.launch", "-n", "2", "--", sys.executable, str(script)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode != 0
