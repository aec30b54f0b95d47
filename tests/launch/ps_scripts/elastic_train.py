"""An elastic parameter-server job for tests/launch/test_run_elastic_ps.py: S scheduled
functions, function i adding [1, i] to a ps variable, counted from the restored count,
so the end state says whether every function's update was applied exactly once.

    mpistrat run -n 5 --num-ps 1 --min-ranks 3 --timeout 20 elastic_train.py MODE [S]

MODE: who is killed (SIGKILL) at function S // 2 + 5 of the first launch only:
``worker`` (the worker running it kills itself), ``ps`` (that worker kills the ps),
``coordinator`` (rank 0 kills itself before scheduling it), ``none`` (the fault comes
from outside: tests/cluster/test_elastic_ps.py). The coordinator joins every 10 functions
(a step boundary where nothing runs; it prints ``@@ joined N``) and prints one JSON line
at the end. ``STEP_SLEEP`` (default 0.02): seconds each function sleeps.
``FAKE_HOSTS=a,a,b,...`` gives each rank a host name (the partner copy's test), and
``TEST_JOB_SECRET`` the job's secret when a plain ``mpiexec`` launches it.
"""

import json
import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

import mpistrat as ms

if "FAKE_HOSTS" in os.environ:  # (tests: the ranks on several "hosts" of one machine)
    import socket

    _host = os.environ["FAKE_HOSTS"].split(",")[MPI.COMM_WORLD.rank]
    socket.gethostname = lambda: _host
if "TEST_JOB_SECRET" in os.environ:  # (a plain mpiexec: no mpistrat run gives it)
    from mpistrat.elastic.env import set_job_secret

    set_job_secret(bytes.fromhex(os.environ["TEST_JOB_SECRET"]))

mode = sys.argv[1]
total_steps = int(sys.argv[2]) if len(sys.argv) > 2 else 60
restart = int(os.environ["MPISTRAT_ELASTIC_RESTART"])
kill_at = total_steps // 2 + 5 if restart == 0 else -1
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0.02"))  # seconds each function sleeps
pids = MPI.COMM_WORLD.allgather(os.getpid())  # (rank 1 is the ps)

strategy = ms.ParameterServerStrategy()  # workers and ps serve inside, then exit 0
coordinator = ms.ClusterCoordinator(strategy)
with strategy.scope():
    progress = ms.Variable(np.zeros(2, np.int64), name="progress")  # [functions, sum of i]
    weights = ms.Variable(np.zeros(3), name="weights")
manager = ms.CheckpointManager(ms.Checkpoint(progress=progress, weights=weights),
                               os.environ.get("CKPT_DIR", "ckpt"))
restored = manager.restore_or_initialize()
start = int(progress.numpy()[0])
print(f"@@ launch {restart}: {strategy.num_workers} workers, resuming at {start} from "
      f"{restored}", flush=True)


def step(i, victim, ps_pid):
    if i == victim and mode == "worker":
        os.kill(os.getpid(), signal.SIGKILL)
    if i == victim and mode == "ps":
        os.kill(ps_pid, signal.SIGKILL)
        time.sleep(30)  # (the launcher ends this launch)
    time.sleep(STEP_SLEEP)
    weights.assign_add(np.full(3, 0.5))
    progress.assign_add(np.array([1, i], np.int64))
    return i


for i in range(start, total_steps):
    if i == kill_at and mode == "coordinator":
        os.kill(os.getpid(), signal.SIGKILL)
    coordinator.schedule(step, args=(i, kill_at, pids[1]))
    if (i + 1) % 10 == 0:
        coordinator.join()
        print(f"@@ joined {i + 1}", flush=True)
coordinator.join()
snapshot = manager.restored_snapshot
print(json.dumps({
    "restart": restart, "start": start, "restored": restored,
    "sequence": snapshot.sequence if snapshot else None,
    "workers": strategy.num_workers, "progress": progress.numpy().tolist(),
    "weights": weights.numpy().tolist(), "steps": total_steps}), flush=True)
