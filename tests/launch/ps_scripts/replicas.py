"""Workers with several local replicas: strategy.run over them inside a scheduled
function, and ps variables updated in replica context by TF's AggregatingVariable rules.

    MPISTRAT_LOCAL_REPLICAS=2 mpiexec -n N python replicas.py
"""

import json

import numpy as np

import mpistrat as ms

strategy = ms.ParameterServerStrategy(num_ps=1)
coordinator = ms.ClusterCoordinator(strategy)
with strategy.scope():
    total = ms.Variable(np.zeros(3), aggregation="sum")
    mean = ms.Variable(np.zeros(3), aggregation="mean")
    first = ms.Variable(np.zeros(3), aggregation="only_first_replica")
    plain = ms.Variable(np.zeros(3))


def step():
    def replica():
        rid = ms.get_replica_context().replica_id_in_sync_group
        total.assign_add(np.full(3, rid + 1.0))
        mean.assign_add(np.full(3, rid + 1.0))
        first.assign_add(np.full(3, 10.0 * (rid + 1)))
        return rid

    ids = strategy.run(replica)
    return list(strategy.experimental_local_results(ids)), \
        float(strategy.reduce("sum", ids, axis=None))


steps = 6
results = coordinator.fetch([coordinator.schedule(step) for _ in range(steps)])


# TF's recommended input: distribute_datasets_from_function inside the per-worker function,
# so each worker's batches come split over its replicas
def dataset_fn(context):
    batch = context.get_per_replica_batch_size(4)
    return ms.Dataset.from_tensor_slices(np.arange(16.0)).batch(batch).repeat()


batches = iter(coordinator.create_per_worker_dataset(
    lambda: strategy.distribute_datasets_from_function(dataset_fn)))


def consume(iterator):
    per_replica = strategy.run(lambda b: float(np.sum(b)), args=(next(iterator),))
    return list(strategy.experimental_local_results(per_replica))


sums = coordinator.fetch([coordinator.schedule(consume, args=(batches,)) for _ in range(4)])


def update_without_aggregation():
    strategy.run(lambda: plain.assign_add(np.ones(3)))


try:
    coordinator.schedule(update_without_aggregation).fetch()
    error = None
except ValueError as exc:
    error = str(exc)
try:
    coordinator.join()
except ValueError:
    pass
print(json.dumps({"replicas": strategy.num_replicas_in_sync, "results": results,
                  "total": total.numpy().tolist(), "mean": mean.numpy().tolist(),
                  "first": first.numpy().tolist(), "plain": plain.numpy().tolist(),
                  "error": error, "sums": sums}), flush=True)
