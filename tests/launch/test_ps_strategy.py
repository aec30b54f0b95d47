"""Parameter-server training across real ranks: ParameterServerStrategy,
ClusterCoordinator, Server and ``mpistrat run --num-ps``.

Workers and ps ranks leave the strategy's constructor only when the job ends, so each
case is a script launched under ``mpiexec`` (tests/launch/ps_scripts), bounded by a
timeout, whose coordinator checks the results.
"""

from __future__ import annotations

import json
import sys

import pytest

SCRIPTS = "tests/launch/ps_scripts"


def _last_json(stdout: str) -> dict:
    return json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])


def _raising_on_every_rank(code: str) -> list[str]:
    """``python -c`` running ``code``, whose error each rank prints (``Name: message``)
    and then waits for the others to print theirs before exiting with status 1: a rank
    that exits first would have hydra kill the others mid-print."""
    body = "".join(f"    {line}\n" for line in code.splitlines())
    return [sys.executable, "-c",
            "import sys\nfrom mpi4py import MPI\nimport mpistrat as ms\ntry:\n" + body +
            "except Exception as exc:\n"
            "    print(f'{type(exc).__name__}: {exc}', file=sys.stderr, flush=True)\n"
            "    MPI.COMM_WORLD.Barrier()\n    sys.exit(1)\n"]


@pytest.mark.parametrize(("ranks", "num_ps"), [(3, 1), (4, 2), (5, 1)])
def test_training_features_across_ranks(mpirun, ranks, num_ps):
    """Variables on the ps (round-robin, sharded by the partitioner, colocated slots),
    concurrent updates from every worker with no lost update, per-worker datasets (whole,
    and sharded by worker), PerWorkerValues, strategy.run inside a closure, and at most
    one closure in flight per worker."""
    result = mpirun(ranks, [sys.executable, f"{SCRIPTS}/train.py", str(num_ps)], timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    out = _last_json(result.stdout)
    workers, steps = ranks - 1 - num_ps, out["steps"]
    assert out["workers"] == workers
    assert out["counter"] == steps  # one atomic add per closure: none lost
    assert out["table"] == 28 * steps and out["slot"] == -28 * steps
    assert sum(out["seen"]) == steps and len(out["seen"]) == workers
    assert out["whole_in_order"] and out["total_matches"] and out["sharded_by_worker"]
    assert out["one_at_a_time"]
    if num_ps == 2:  # 112 bytes, MinSizePartitioner(64, max_shards=2): TF's div rule
        assert out["shards"] == [[4, 4], [3, 4]]
        # counter took ps 0, so the table's shards are on ps 1 and ps 0; its slot with it
        assert out["shard_devices"] == ["/job:ps/replica:0/task:1/device:CPU:0",
                                        "/job:ps/replica:0/task:0/device:CPU:0"]
        assert out["slot_device"] == out["shard_devices"][0]
    else:
        assert out["shards"] == []


@pytest.mark.parametrize("ranks", [3, 4])
def test_error_contract_retries_and_misuse(mpirun, ranks):
    """The first error raised once by join/schedule/done, unstarted closures cancelled,
    WorkerUnavailableError retried, TF's misuse errors, a dataset function sent only until
    every worker has it (and again to a worker that lost it); the script asserts them."""
    result = mpirun(ranks, [sys.executable, f"{SCRIPTS}/errors.py"], timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout, result.stdout + result.stderr


def test_tf_pattern_with_servers(mpirun):
    """Workers and ps join a Server, the chief builds the strategy from its resolver."""
    result = mpirun(4, [sys.executable, f"{SCRIPTS}/server.py"], timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "chief [8.0, 8.0]" in result.stdout
    for task in ("ps:0", "worker:0", "worker:1"):
        assert f"served {task}" in result.stdout, result.stdout


@pytest.mark.parametrize(("ranks", "env", "message"), [
    (3, {}, "There must be at least one ps."),
    (2, {"MPISTRAT_NUM_PS": "1"}, "There must be at least one worker."),
])
def test_missing_roles_fail_on_every_rank(mpirun, ranks, env, message):
    result = mpirun(ranks, _raising_on_every_rank("ms.ParameterServerStrategy()"),
                    env=env, timeout=60)
    assert result.returncode != 0
    assert result.stderr.count(f"ValueError: {message}") == ranks, result.stderr


def test_mpistrat_run_num_ps(mpirun, mpistrat_cmd, tmp_path):
    """``mpistrat run --num-ps`` sets the roles and installs no default strategy; the job
    ends when the coordinator's script does, and a failing closure fails the job."""
    script = tmp_path / "ps.py"
    script.write_text(
        "import sys\nimport numpy as np\nimport mpistrat as ms\n"
        "strategy = ms.ParameterServerStrategy()\n"
        "coordinator = ms.ClusterCoordinator(strategy)\n"
        "with strategy.scope():\n    w = ms.Variable(np.zeros(3))\n"
        "def step(fail):\n"
        "    if fail:\n        raise ValueError('bad batch')\n"
        "    w.assign_add(np.ones(3))\n"
        "for _ in range(6):\n    coordinator.schedule(step, args=(sys.argv[1] == 'fail',))\n"
        "coordinator.join()\n"
        "print('w', w.numpy().tolist(), strategy.num_ps, strategy.num_workers)\n")
    good = mpirun(4, [*mpistrat_cmd, "run", "--num-ps", "1", str(script), "ok"], timeout=120)
    assert good.returncode == 0, good.stdout + good.stderr
    assert "w [6.0, 6.0, 6.0] 1 2" in good.stdout
    bad = mpirun(4, [*mpistrat_cmd, "run", "--num-ps", "2", str(script), "fail"], timeout=120)
    assert bad.returncode != 0
    assert "ValueError: bad batch" in bad.stdout + bad.stderr


def test_workers_with_local_replicas(mpirun):
    """MPISTRAT_LOCAL_REPLICAS=2: strategy.run inside a scheduled function runs both
    replicas, strategy.reduce reduces across them, and ps variables updated in replica
    context are merged by their aggregation and applied once per step (NONE refused)."""
    result = mpirun(4, [sys.executable, f"{SCRIPTS}/replicas.py"],
                    env={"MPISTRAT_LOCAL_REPLICAS": "2"}, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    out = _last_json(result.stdout)
    assert out["replicas"] == 2
    assert out["results"] == [[[0, 1], 1.0]] * 6
    assert out["total"] == [18.0] * 3  # 6 steps x (1 + 2)
    assert out["mean"] == [9.0] * 3  # 6 steps x 1.5
    assert out["first"] == [60.0] * 3  # 6 steps x replica 0's 10
    assert out["plain"] == [0.0] * 3
    assert "You must specify an aggregation method" in out["error"]
    # 2 examples per replica from each worker's own pipeline over 0..15, in order
    starts = {tuple(pair) for pair in out["sums"]}
    assert starts <= {(1.0, 5.0), (9.0, 13.0), (17.0, 21.0), (25.0, 29.0)}, out["sums"]


def test_workers_with_different_replica_counts_fail_on_every_rank(mpirun):
    code = "ms.ParameterServerStrategy(num_ps=1, local_replicas=1 + (MPI.COMM_WORLD.rank == 3))"
    result = mpirun(4, _raising_on_every_rank(code), timeout=60)
    assert result.returncode != 0
    assert result.stderr.count("ValueError: Mismatched number of replicas per worker") == 4


STUCK = (
    "import sys, time\nimport mpistrat as ms\n"
    "strategy = ms.ParameterServerStrategy()\n"
    "coordinator = ms.ClusterCoordinator(strategy)\n"
    "def work(seconds):\n    time.sleep(seconds)\n"
    "for _ in range(int(sys.argv[2])):\n"
    "    coordinator.schedule(work, args=(float(sys.argv[1]),))\n"
    "if sys.argv[3] == 'fail':\n    time.sleep(1)  # (the function is running by now)\n"
    "    raise RuntimeError('the program fails')\n"
    "coordinator.join()\nprint('joined', flush=True)\n")


def test_serving_is_not_a_stall_and_a_stuck_function_times_out(mpirun, mpistrat_cmd,
                                                                 tmp_path):
    """Under mpistrat run's stall check, workers and ps serving for longer than it are
    not reported; a function stuck past --timeout fails the job within the bound, with
    the coordinator's error."""
    script = tmp_path / "stuck.py"
    script.write_text(STUCK)
    options = ["run", "--num-ps", "1", "--stall-check", "1", "--timeout", "4"]
    healthy = mpirun(4, [*mpistrat_cmd, *options, str(script), "0.4", "8", "ok"],
                     timeout=120)
    assert healthy.returncode == 0, healthy.stdout + healthy.stderr
    assert "joined" in healthy.stdout
    assert "stall" not in healthy.stdout + healthy.stderr
    stuck = mpirun(4, [*mpistrat_cmd, *options, str(script), "600", "3", "ok"], timeout=60)
    out = stuck.stdout + stuck.stderr
    assert stuck.returncode != 0, out
    assert "no scheduled function has finished for" in out, out
    assert "CollectiveTimeoutError: no scheduled function finished in 4 s" in out, out


def test_coordinator_failure_with_functions_running_aborts_the_job(mpirun, tmp_path):
    """Without mpistrat run: the coordinator's program raises while a function runs on a
    worker; the job is aborted at once instead of waiting for the function."""
    script = tmp_path / "fail.py"
    script.write_text(STUCK)
    result = mpirun(3, [sys.executable, str(script), "600", "1", "fail"],
                    env={"MPISTRAT_NUM_PS": "1"}, timeout=30)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "RuntimeError: the program fails" in out
    assert "aborting the job" in out, out


def test_a_bad_argument_on_one_rank_fails_every_rank(mpirun):
    code = ("bad = 3 if MPI.COMM_WORLD.rank == 1 else None\n"
            "ms.ParameterServerStrategy(num_ps=1, variable_partitioner=bad)")
    result = mpirun(3, _raising_on_every_rank(code), timeout=60)
    assert result.returncode != 0
    assert "TypeError: variable_partitioner must be callable" in result.stderr
    assert result.stderr.count("CollectiveMismatchError: ParameterServerStrategy failed on "
                               "rank(s) [1]") == 2, result.stderr
