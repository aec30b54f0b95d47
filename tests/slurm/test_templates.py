"""The sbatch templates in slurm/, submitted to the real single-node Slurm of conftest.py.

Each job runs a tiny script written here under ``mpistrat run`` on 2 ranks (the node has
2 CPUs), and the test reads the job's output file and ``scontrol show job``'s JobState
and ExitCode (no slurmdbd, so no ``sacct``).
"""

from __future__ import annotations

import re
import textwrap

import pytest

pytestmark = pytest.mark.slurm

TWO_RANKS = ("--ntasks=2", "--cpus-per-task=1")

REPORT = textwrap.dedent('''
    """Every rank prints what it is; FAIL_RANK=r makes rank r raise."""
    import os
    import sys

    import mpistrat as ms
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    strategy = ms.get_strategy()
    total = comm.allreduce(comm.rank + 1)
    sys.stdout.write(f"report rank {comm.rank} of {comm.size} sum {total} replicas "
                     f"{strategy.num_replicas_in_sync} args {sys.argv[1:]} "
                     f"cvd {os.environ.get('CUDA_VISIBLE_DEVICES', '-')}\\n")  # one write:
    sys.stdout.flush()                                   # mpiexec interleaves ranks' writes
    if os.environ.get("FAIL_RANK") == str(comm.rank):
        raise RuntimeError(f"deliberate failure on rank {comm.rank}")
''')

# Saves its step when SIGUSR1 arrives (all ranks agree to stop at the same step), exits 42
# ("saved, run me again", as mpistrat's preemption checkpoint handler does), and on a
# restart resumes from the saved step and finishes a few steps later.
RESUMABLE = textwrap.dedent('''
    import os
    import signal
    import sys
    import time

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    path = sys.argv[1]
    caught = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: caught.append(signum))
    step = int(open(path).read()) if os.path.exists(path) else 0
    if comm.rank == 0:
        print(f"resumed from step {step}" if step else "started", flush=True)
    end = step + 3 if step else 10**6
    while step < end:
        time.sleep(0.05)
        step += 1
        if comm.rank == 0 and step == 2:
            print("running", flush=True)
        if comm.allreduce(bool(caught), op=MPI.LOR):
            if comm.rank == 0:
                with open(path + ".tmp", "w") as f:
                    f.write(str(step))
                os.replace(path + ".tmp", path)
                print(f"checkpointed at step {step}", flush=True)
            sys.exit(42)
    if comm.rank == 0:
        print(f"finished at step {step}", flush=True)
''')


@pytest.fixture
def scripts(tmp_path):
    (tmp_path / "report.py").write_text(REPORT)
    (tmp_path / "resumable.py").write_text(RESUMABLE)
    return tmp_path


def _report_lines(output):
    return sorted(re.findall(r"report rank .*? cvd [-\d,]+", output))


def _info_table(output):
    """The rows of ``mpistrat info``'s table, as dicts keyed by the column headers."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("rank  host"))
    spans = [m.span() for m in re.finditer(r"-+", lines[start + 1])]
    rows = []
    for line in lines[start + 2:]:
        if not line[:1].isdigit():
            break
        rows.append({lines[start][a:b].strip(): line[a:b].strip() for a, b in spans})
    return rows


@pytest.mark.parametrize("launch", ["srun", "mpiexec"])
def test_cpu_template_runs_the_script_on_every_rank(slurm, scripts, launch):
    out = scripts / "job.out"
    job_id = slurm.sbatch("cpu.sbatch", scripts / "report.py", "--epochs", "2", output=out,
                          options=TWO_RANKS,
                          env={"LAUNCH": launch, "SHOW_INFO": "1" if launch == "srun" else "0"})
    job = slurm.wait(job_id, out)
    assert (job.state, job.exit_code) == ("COMPLETED", "0:0"), job
    assert _report_lines(job.output) == [
        f"report rank {r} of 2 sum 3 replicas 2 args ['--epochs', '2'] cvd -" for r in (0, 1)
    ], job
    expected = "srun --mpi=pmi2" if launch == "srun" else "mpiexec -n 2"
    assert f"launch: {expected}" in job.output, job
    if launch == "srun":  # mpistrat info ran first and showed what Slurm gave each rank
        assert f"slurm        job {job_id} 'mpistrat-cpu'" in job.output, job
        rows = _info_table(job.output)
        assert [(r["rank"], r["SLURM_PROCID"], r["Slurm node"]) for r in rows] == [
            ("0", "0", "localhost"), ("1", "1", "localhost")], job


def test_script_and_arguments_from_variables(slurm, scripts):
    out = scripts / "job.out"
    job_id = slurm.sbatch("cpu.sbatch", output=out, options=TWO_RANKS,
                          env={"SCRIPT": str(scripts / "report.py"), "SCRIPT_ARGS": "-x 1",
                               "SHOW_INFO": "0", "RUN_OPTIONS": "--tag-output"})
    job = slurm.wait(job_id, out)
    assert (job.state, job.exit_code) == ("COMPLETED", "0:0"), job
    for rank in (0, 1):  # --tag-output prefixes the rank
        assert (f"[{rank}] report rank {rank} of 2 sum 3 replicas 2 args ['-x', '1']"
                in job.output), job


@pytest.mark.parametrize("launch", ["srun", "mpiexec"])
def test_a_failing_script_is_a_failed_job(slurm, scripts, launch):
    out = scripts / "job.out"
    job_id = slurm.sbatch("cpu.sbatch", scripts / "report.py", output=out, options=TWO_RANKS,
                          env={"LAUNCH": launch, "SHOW_INFO": "0", "FAIL_RANK": "1"})
    job = slurm.wait(job_id, out)
    assert job.state == "FAILED", job
    assert job.exit_code != "0:0" and job.exit_code.endswith(":0"), job
    assert "RuntimeError: deliberate failure on rank 1" in job.output, job
    assert job.fields.get("Restarts") == "0", job


def test_a_template_without_its_environment_says_how_to_fix_it(slurm, scripts):
    out = scripts / "job.out"
    job_id = slurm.sbatch("cpu.sbatch", scripts / "report.py", output=out, options=TWO_RANKS,
                          env={"VENV": str(scripts / "no-venv")})
    job = slurm.wait(job_id, out)
    assert (job.state, job.exit_code) == ("FAILED", "2:0"), job
    assert f"no virtual environment at '{scripts / 'no-venv'}'" in job.output, job
    assert "set VENV=" in job.output, job


def test_ranks_that_save_on_sigusr1_and_exit_42_requeue_the_job(slurm, scripts):
    """``--signal=USR1@N`` (without ``B:``) reaches the ranks, not the batch shell: they
    save and exit 42, which the template takes as "run me again". The job is requeued
    (same job id, log appended) and the restart resumes from the saved step. (The trap
    for ``B:USR1`` is tested with the digits example below.)"""
    out = scripts / "job.out"
    checkpoint = scripts / "step.txt"
    job_id = slurm.sbatch("cpu.sbatch", scripts / "resumable.py", checkpoint, output=out,
                          options=TWO_RANKS, env={"SHOW_INFO": "0"})
    slurm.wait_for_output(out, "running")
    sent = slurm.run(["scancel", "--signal=USR1", job_id])  # the job's steps only
    assert sent.returncode == 0, sent.stderr
    job = slurm.wait(job_id, out, timeout=90)
    assert (job.state, job.exit_code, job.fields.get("Restarts")) == ("COMPLETED", "0:0", "1"), job
    saved = int(checkpoint.read_text())
    lines = [line for line in job.output.splitlines() if not line.startswith("mpistrat-job: job")]
    expected = ["started", "running", f"checkpointed at step {saved}",
                "mpistrat-job: ranks stopped (exit status 42); requeueing job",
                f"resumed from step {saved}", f"finished at step {saved + 3}"]
    found = [next((line for line in lines if line.startswith(e)), None) for e in expected]
    assert None not in found and found == sorted(found, key=lines.index), job
    assert "mpistrat-job: SIGUSR1 at" not in job.output, job


def test_gpu_template_gives_each_rank_its_gpu(slurm, scripts):
    """Placeholder GPUs: Slurm's --gpus-per-task and --gpu-bind set CUDA_VISIBLE_DEVICES per
    rank, and mpistrat info shows the GPU ids Slurm allocated to each rank."""
    if not slurm.gpus:
        pytest.skip(f"no placeholder GPUs in the test cluster: {slurm.gpu_note}")
    out = scripts / "job.out"
    # CuPy is not needed: the CPU strategy runs the script, Slurm's GPU binding is checked
    job_id = slurm.sbatch("gpu.sbatch", scripts / "report.py", output=out,
                          options=("--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"),
                          env={"RUNNER": "mpistrat run"})
    job = slurm.wait(job_id, out)
    assert (job.state, job.exit_code) == ("COMPLETED", "0:0"), job
    assert _report_lines(job.output) == [
        f"report rank {r} of 2 sum 3 replicas 2 args [] cvd {r}" for r in (0, 1)], job
    assert "--gpu-bind=per_task:1" in job.output, job
    rows = _info_table(job.output)
    assert [(r["CUDA_VISIBLE_DEVICES"], r["Slurm GPUs"], r["SLURM_LOCALID"]) for r in rows] == [
        ("0", "0", "0"), ("1", "1", "1")], job


def test_gpu_template_through_mpiexec_gives_the_node_gpus_to_every_rank(slurm, scripts):
    if not slurm.gpus:
        pytest.skip(f"no placeholder GPUs in the test cluster: {slurm.gpu_note}")
    out = scripts / "job.out"
    job_id = slurm.sbatch("gpu.sbatch", scripts / "report.py", output=out,
                          options=("--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"),
                          env={"RUNNER": "mpistrat run", "LAUNCH": "mpiexec", "SHOW_INFO": "0"})
    job = slurm.wait(job_id, out)
    assert (job.state, job.exit_code) == ("COMPLETED", "0:0"), job
    assert _report_lines(job.output) == [
        f"report rank {r} of 2 sum 3 replicas 2 args [] cvd 0,1" for r in (0, 1)], job


def test_bench_template_writes_its_results(slurm, scripts):
    out = scripts / "job.out"
    results = scripts / "bench"
    job_id = slurm.sbatch(
        "bench.sbatch", output=out,
        options=("--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"),
        env={"SHOW_INFO": "0", "BENCH_DIR": str(results),
             "BENCH_ARGS": "-b 4 -e 64 -f 16 -n 3 -w 1 -q --algorithms xring"})
    job = slurm.wait(job_id, out)
    assert (job.state, job.exit_code) == ("COMPLETED", "0:0"), job
    assert "2 rank(s)" in job.output and "xring" in job.output, job
    assert {p.name for p in results.iterdir()} == {"sweep.json", "sweep.md", "allreduce.spec"}


def test_default_job_trains_the_example_and_resumes_it_after_sigusr1(slurm, tmp_path):
    """The template's default script, examples/digits_mlp.py, interrupted by SIGUSR1 part
    way: it saves, the job requeues, and the restart finishes the remaining epochs only."""
    pytest.importorskip("sklearn", reason="the digits example needs scikit-learn")
    out = tmp_path / "job.out"
    job_id = slurm.sbatch(
        "cpu.sbatch", output=out, options=TWO_RANKS,
        env={"SHOW_INFO": "0",
             "SCRIPT_ARGS": f"--epochs 30 --no-progress --checkpoint-dir {tmp_path / 'ckpt'}"})
    slurm.wait_for_output(out, "epoch   3/30")
    sent = slurm.run(["scancel", "--signal=USR1", "--batch", job_id])
    assert sent.returncode == 0, sent.stderr
    job = slurm.wait(job_id, out, timeout=90)
    assert (job.state, job.exit_code, job.fields.get("Restarts")) == ("COMPLETED", "0:0", "1"), job
    assert "mpistrat-job: SIGUSR1 at" in job.output and "requeueing job" in job.output, job
    epochs = re.findall(r"^epoch +(\d+)/30", job.output, flags=re.M)
    assert epochs.count("1") == 1 and epochs.count("30") == 1, job  # resumed, not restarted
    (accuracy,) = re.findall(r"^final test accuracy (\S+)", job.output, flags=re.M)
    assert float(accuracy) > 0.9, job


def test_cpu_template_runs_parameter_server_training(slurm, tmp_path):
    """RUN_OPTIONS=--num-ps 1 with the parameter-server example on 4 tasks (overcommitted
    on the 2-CPU node): rank 0 coordinates, the job completes with the trained model."""
    pytest.importorskip("sklearn", reason="the digits example needs scikit-learn")
    out = tmp_path / "job.out"
    job_id = slurm.sbatch(
        "cpu.sbatch", "examples/digits_ps.py", "--epochs", "3", output=out,
        options=("--ntasks=4", "--cpus-per-task=1", "--overcommit"),
        env={"SHOW_INFO": "0", "RUN_OPTIONS": "--num-ps 1"})
    job = slurm.wait(job_id, out, timeout=180)
    assert (job.state, job.exit_code) == ("COMPLETED", "0:0"), job
    assert "2 workers, 1 ps" in job.output, job
    (accuracy,) = re.findall(r"^final test accuracy (\S+)", job.output, flags=re.M)
    assert float(accuracy) > 0.8, job
