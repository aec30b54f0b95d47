"""``mpistrat info`` inside Slurm: what Slurm gave each rank.

The first tests run ``mpistrat info`` as the tasks of real ``srun`` steps on the test
cluster; the others check :func:`mpistrat.info.slurm_task`, :func:`~mpistrat.info.slurm_job`
and the table on environments recorded there, and need no Slurm.
"""

from __future__ import annotations

import json
import sys

import pytest

from mpistrat.cli.info import render_info
from mpistrat.info import slurm_job, slurm_task

INFO = [sys.executable, "-m", "mpistrat", "info", "--json", "--no-gpu"]

# One task of `srun --mpi=pmi2 -n 2 --gpus-per-task=1` (Slurm 22.05.8, bin/slurm-local)
SRUN_TASK_1 = {
    "SLURM_JOB_ID": "7", "SLURM_JOB_NAME": "train", "SLURM_JOB_PARTITION": "debug",
    "SLURM_CLUSTER_NAME": "local6817", "SLURM_JOB_NODELIST": "localhost", "SLURM_STEP_ID": "0",
    "SLURM_STEP_NUM_TASKS": "2", "SLURM_MPI_TYPE": "pmi2", "SLURMD_NODENAME": "localhost",
    "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_STEP_GPUS": "1",
    "SLURM_JOB_GPUS": "0,1", "SLURM_GPUS_ON_NODE": "2", "CUDA_VISIBLE_DEVICES": "1",
}


@pytest.mark.slurm
def test_srun_pmi2_tasks_show_their_slurm_fields(slurm):
    options = ["--gpus-per-task=1"] if slurm.gpus else []
    result = slurm.run(["srun", "--mpi=pmi2", "-n", "2", *options, *INFO])
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["world_size"] == 2 and not data["warnings"] and not data["notes"], data
    job = data["slurm"]
    assert job["job_id"].isdigit() and job["step_id"] == "0", job
    assert (job["step_tasks"], job["mpi_type"], job["job_nodelist"]) == (2, "pmi2", "localhost")
    for rank, record in enumerate(data["ranks"]):
        task = record["slurm"]
        assert (task["procid"], task["localid"], task["nodeid"], task["node"]) == (
            rank, rank, 0, "localhost"), task
        assert task["job_id"] == job["job_id"] and task["cpus"], task
        if slurm.gpus:  # each task bound to its own placeholder GPU
            assert (task["gpus"], record["cuda_visible_devices"]) == (str(rank), str(rank))


@pytest.mark.slurm
def test_plain_srun_gives_singletons_and_info_says_how_to_fix_it(slurm, tmp_path):
    """Without --mpi=pmi2 the pip MPICH starts every task as its own world of 1."""
    result = slurm.run(["srun", "-n", "2", f"--output={tmp_path}/info-%t.json", *INFO])
    assert result.returncode == 0, result.stderr
    for task in (0, 1):
        data = json.loads((tmp_path / f"info-{task}.json").read_text())
        assert data["world_size"] == 1 and data["slurm"]["step_tasks"] == 2, data
        (warning,) = data["warnings"]
        assert "every process is rank 0 of 1" in warning and "srun --mpi=pmi2" in warning


@pytest.mark.slurm
def test_mpiexec_inside_an_allocation_notes_the_proxy_step(slurm):
    result = slurm.run(["salloc", "-n", "2", "mpiexec", "-n", "2", *INFO])
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["world_size"] == 2 and not data["warnings"], data
    (note,) = data["notes"]
    assert "has 1 task(s) for 2 MPI rank(s)" in note and "mpiexec" in note
    assert [r["slurm"]["procid"] for r in data["ranks"]] == [0, 0]


def test_slurm_task_reads_the_task_variables():
    task = slurm_task(SRUN_TASK_1, cpus=[0, 1])
    assert task == {
        "job_id": "7", "job_name": "train", "partition": "debug", "cluster": "local6817",
        "job_nodelist": "localhost", "restart_count": 0, "step_id": "0", "step_tasks": 2,
        "mpi_type": "pmi2", "node": "localhost", "procid": 1, "localid": 1, "nodeid": 0,
        "cpus": [0, 1], "cpus_per_task": None, "gpus": "1", "gpus_on_node": 2,
    }


def test_outside_slurm_there_is_no_slurm_record():
    assert slurm_task({"PMI_RANK": "0", "CUDA_VISIBLE_DEVICES": "0"}) is None
    assert slurm_job([None, None], 2) == (None, [])


def test_batch_step_uses_the_job_gpus_and_restart_count():
    env = {"SLURM_JOB_ID": "9", "SLURM_JOB_GPUS": "0,1", "SLURM_RESTART_COUNT": "2",
           "SLURM_CPUS_PER_TASK": "4", "SLURM_PROCID": "x"}
    task = slurm_task(env)
    assert (task["gpus"], task["restart_count"], task["cpus_per_task"]) == ("0,1", 2, 4)
    assert task["procid"] is None and task["step_id"] is None


def test_slurm_job_notes_ranks_that_are_not_the_step_tasks():
    proxy = slurm_task({**SRUN_TASK_1, "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_ID": "3"})
    summary, notes = slurm_job([proxy, proxy], world_size=2)
    assert summary["job_id"] == "7" and summary["step_tasks"] == 1
    assert notes == ["Slurm step 7.3 has 1 task(s) for 2 MPI rank(s): the ranks were not "
                     "started by srun as its tasks (mpiexec inside the allocation starts them "
                     "from one proxy task per node), so SLURM_PROCID and SLURM_LOCALID describe "
                     "the launcher's tasks, not the ranks"]
    _, notes = slurm_job([proxy, None], world_size=2)
    assert notes[0] == "only 1 of 2 rank(s) run inside a Slurm job"
    other = {**proxy, "job_id": "8"}
    _, notes = slurm_job([proxy, other], world_size=2)
    assert "the ranks run in different Slurm jobs: 7, 8" in notes


def _data(tasks):
    summary, notes = slurm_job(tasks, len(tasks))
    ranks = [{"rank": i, "host": "vm", "node": 0, "local_rank": i, "local_size": len(tasks),
              "leader": i == 0, "pid": 100 + i, "cuda_visible_devices": str(i), "gpus": [],
              "cupy": None, "nccl": None, "gpu_note": "", "cuda_aware_mpi": False,
              "slurm": task} for i, task in enumerate(tasks)]
    return {"mpistrat": "0", "python": "3", "mpi4py": "4", "mpi": {
        "vendor": "MPICH 5", "standard": "5.0", "thread_level": "multiple",
        "library_version": "MPICH", "library_path": None},
        "launcher": {"name": "MPICH Hydra / PMI", "size": 2}, "world_size": len(tasks),
        "nodes": 1, "ranks_per_node": [len(tasks)], "virtual_ranks_per_node": None,
        "slurm": summary, "ranks": ranks, "notes": notes, "warnings": []}


def test_table_shows_the_job_and_each_ranks_slurm_columns():
    tasks = [slurm_task({**SRUN_TASK_1, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i),
                         "SLURM_STEP_GPUS": str(i)}, cpus=[0, 1, 2, 5]) for i in (0, 1)]
    text = render_info(_data(tasks))
    lines = text.splitlines()
    assert ("slurm        job 7 'train', partition debug, cluster local6817, nodes localhost; "
            "step 7.0, 2 task(s), srun --mpi=pmi2") in lines
    header = next(line for line in lines if line.startswith("rank"))
    assert header.split()[-7:] == ["Slurm", "node", "SLURM_PROCID", "SLURM_LOCALID", "CPUs",
                                   "Slurm", "GPUs"]
    rows = [line.split() for line in lines if line[:1].isdigit()]
    assert [row[-5:] for row in rows] == [["localhost", "0", "0", "0-2,5", "0"],
                                          ["localhost", "1", "1", "0-2,5", "1"]]


def test_table_outside_slurm_has_no_slurm_columns():
    text = render_info(_data([None]))
    assert "slurm " not in text and "SLURM_PROCID" not in text
