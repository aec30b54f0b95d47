"""Parameter-server training features, checked on the coordinator; prints one JSON line.

    mpiexec -n N python train.py NUM_PS      (N >= NUM_PS + 2)
"""

import json
import sys
import time

import numpy as np

import mpistrat as ms

num_ps = int(sys.argv[1])
strategy = ms.ParameterServerStrategy(
    num_ps=num_ps, variable_partitioner=ms.MinSizePartitioner(64, max_shards=num_ps))
coordinator = ms.ClusterCoordinator(strategy)
workers = strategy.num_workers
with strategy.scope():
    counter = ms.Variable(np.zeros((), np.int64), name="counter")
    table = ms.Variable(np.zeros((7, 4), np.float32), name="table")  # 112 bytes: sharded
    with strategy.extended.colocate_vars_with(table):
        slot = ms.Variable(np.zeros((7, 4), np.float32), name="slot")
    ids = ms.Variable(np.zeros(workers, np.int64), name="seen")  # closures per worker
    total = ms.Variable(np.zeros((), np.float64), name="total")


def dataset_fn(context):
    data = ms.Dataset.from_tensor_slices(np.arange(40.0))
    return data.shard(context.num_input_pipelines, context.input_pipeline_id).repeat()


whole = iter(coordinator.create_per_worker_dataset(dataset_fn))
sharded = iter(coordinator.create_per_worker_dataset(dataset_fn, shard_by_worker=True))


def step(whole_it, sharded_it, tag):
    started = time.monotonic()  # (one clock for every process of the host)
    index = ms.experimental_get_current_worker_index()
    counter.assign_add(1)
    table.assign_add(np.ones((7, 4), np.float32))
    slot.assign_sub(np.ones((7, 4), np.float32), use_locking=True)
    seen = np.zeros(workers, np.int64)
    seen[index] = 1
    ids.assign_add(seen)
    mine = float(next(sharded_it))
    total.assign_add(mine)
    replicas = strategy.run(lambda: ms.get_replica_context().replica_id_in_sync_group)
    time.sleep(0.005)  # long enough for a second closure to overlap, if one could
    return float(next(whole_it)), index, tag, replicas, mine, (started, time.monotonic())


steps = 10 * workers
tags = ms.PerWorkerValues(tuple(f"w{i}" for i in range(workers)))
results = [coordinator.schedule(step, args=(whole, sharded, tags)) for _ in range(steps)]
coordinator.join()
assert coordinator.done()
values = coordinator.fetch(results)
by_worker = {}
sharded_ok = True
spans = {}
for first, index, tag, replicas, mine, span in values:
    spans.setdefault(index, []).append(span)
    assert tag == f"w{index}", (tag, index)
    assert replicas == 0, replicas
    by_worker.setdefault(index, []).append(first)
    sharded_ok = sharded_ok and int(mine) % workers == index
# every worker reads the whole dataset from its start (TF's one input pipeline)
per_worker_order_ok = all(v == [float(i % 40) for i in range(len(v))]
                          for v in by_worker.values())
shards = [v.shape for v in table.variables] if isinstance(table, ms.ShardedVariable) else []
print(json.dumps({
    "counter": int(counter.numpy()), "table": float(table.numpy().sum()),
    "slot": float(slot.numpy().sum()), "seen": ids.numpy().tolist(),
    "total": float(total.numpy()), "whole_in_order": per_worker_order_ok,
    "total_matches": float(total.numpy()) == sum(v[4] for v in values),
    # at most one closure in flight per worker: a worker's closures never overlap
    "one_at_a_time": all(b[0] >= a[1] for s in spans.values()
                         for a, b in zip(sorted(s), sorted(s)[1:])),
    "sharded_by_worker": sharded_ok,
    "shards": shards, "slot_device": slot.device,
    "shard_devices": [v.device for v in table.variables] if shards else [table.device],
    "workers": workers, "steps": steps, "repr": repr(strategy),
}), flush=True)
