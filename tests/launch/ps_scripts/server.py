"""TF's single-binary pattern: workers and ps run a Server, the chief the strategy."""

import numpy as np
from mpi4py import MPI

import mpistrat as ms

rank = MPI.COMM_WORLD.Get_rank()
cluster = {"chief": ["c:1"], "ps": ["p:1"], "worker": ["w0:1", "w1:1"]}
task = [("chief", 0), ("ps", 0), ("worker", 0), ("worker", 1)][rank]
resolver = ms.SimpleClusterResolver(cluster, task_type=task[0], task_id=task[1])
if task[0] in ("worker", "ps"):
    server = ms.Server(cluster, job_name=task[0], task_index=task[1])
    server.join()
    print(f"served {task[0]}:{task[1]}", flush=True)
else:
    strategy = ms.ParameterServerStrategy(resolver)
    coordinator = ms.ClusterCoordinator(strategy)
    with strategy.scope():
        v = ms.Variable(np.zeros(2))
    for _ in range(8):
        coordinator.schedule(lambda: v.assign_add(np.ones(2)) and None)
    coordinator.join()
    print("chief", v.numpy().tolist(), flush=True)
