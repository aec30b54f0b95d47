"""TF's error contract of ClusterCoordinator, checked on the coordinator; prints OK."""

import time

import numpy as np

import mpistrat as ms

strategy = ms.ParameterServerStrategy(num_ps=1)
coordinator = ms.ClusterCoordinator(strategy)
with strategy.scope():
    runs = ms.Variable(np.zeros((), np.int64))


def slow(i):
    if i == 2:
        raise KeyError(f"closure {i} failed")
    time.sleep(0.2)
    return i


values = [coordinator.schedule(slow, args=(i,)) for i in range(12)]
try:
    coordinator.join()
    raise SystemExit("join did not raise the closure's error")
except KeyError as exc:
    assert "closure 2 failed" in str(exc), exc
    assert any("worker" in note for note in getattr(exc, "__notes__", [])), exc
statuses = []
for value in values:
    try:
        statuses.append(value.fetch())
    except ms.CancelledError as exc:
        assert "cancelled" in str(exc)
        statuses.append("cancelled")
    except KeyError:
        statuses.append("error")
assert statuses.count("error") == 1, statuses
assert "cancelled" in statuses, statuses  # the closures not started yet were thrown away
assert statuses[:2] == [0, 1], statuses
# raised once: the coordinator works again
assert coordinator.done()
assert coordinator.schedule(slow, args=(5,)).fetch() == 5

# an error also surfaces from schedule() and done()
coordinator.schedule(slow, args=(2,))
time.sleep(1.0)
try:
    coordinator.schedule(slow, args=(1,))
    raise SystemExit("schedule did not raise the pending error")
except KeyError:
    pass
coordinator.schedule(slow, args=(2,))
time.sleep(1.0)
try:
    coordinator.done()
    raise SystemExit("done did not raise the pending error")
except KeyError:
    pass
coordinator.join()  # nothing pending: no error left

# transient worker errors: the closure runs again until it succeeds
def flaky(i):
    runs.assign_add(1)
    if int(runs.numpy()) % 3:
        raise ms.WorkerUnavailableError("preempted")
    return i


flaky_values = [coordinator.schedule(flaky, args=(i,)) for i in range(6)]
coordinator.join()
assert [v.fetch() for v in flaky_values] == list(range(6))
assert coordinator.retries == int(runs.numpy()) - 6 > 0, (coordinator.retries, runs.numpy())

# misuse
try:
    coordinator.schedule(slow, args=(values[0],))
    raise SystemExit("a RemoteValue argument was accepted")
except ValueError as exc:
    assert "RemoteValue used as an input" in str(exc)
try:
    ms.ClusterCoordinator(ms.MirroredStrategy())
    raise SystemExit("a MirroredStrategy was accepted")
except ValueError as exc:
    assert "Only ParameterServerStrategy" in str(exc)
try:
    ms.experimental_get_current_worker_index()
    raise SystemExit("worker index outside a closure")
except RuntimeError:
    pass


def make_variable():
    with strategy.scope():
        return ms.Variable(1.0)


try:
    coordinator.schedule(make_variable).fetch()
    raise SystemExit("a variable was created on a worker")
except RuntimeError as exc:
    assert "created on the coordinator" in str(exc), exc
try:  # fetch() raised it; the coordinator still raises it once, as TF does
    coordinator.join()
    raise SystemExit("join did not raise the pending error")
except RuntimeError as exc:
    assert "created on the coordinator" in str(exc), exc
# a dataset function travels with the closures only until every worker has it
import itertools  # noqa: E402

import mpistrat.ps.coordinator as pc  # noqa: E402
import mpistrat.ps.worker as pw  # noqa: E402

big = np.ones(250_000)  # 2 MB, captured by the dataset function
dataset = iter(coordinator.create_per_worker_dataset(lambda: itertools.repeat(big.sum())))
real_dumps, sizes = pc.cloudpickle.dumps, []


def spy(obj, *args, **kwargs):
    out = real_dumps(obj, *args, **kwargs)
    sizes.append(len(out))
    return out


def take(iterator):
    return next(iterator)


pc.cloudpickle.dumps = spy
for _ in range(50):  # until every worker has run a closure with the function
    warm = [coordinator.schedule(take, args=(dataset,)) for _ in range(strategy.num_workers)]
    assert [v.fetch() for v in warm] == [250_000.0] * strategy.num_workers
    if len(dataset._dataset._holders) == strategy.num_workers:
        break
first = list(sizes)
sizes.clear()
later = [coordinator.schedule(take, args=(dataset,)) for _ in range(10)]
coordinator.join()
assert [v.fetch() for v in later] == [250_000.0] * 10
assert max(first) > 1_000_000 and max(sizes) < 100_000, (first, sizes)


def forget():  # as if the worker had restarted: its dataset functions are gone
    pw.current().builders.clear()
    pw.current().iterators.clear()


coordinator.schedule(forget)
coordinator.join()
sizes.clear()
again = [coordinator.schedule(take, args=(dataset,)) for _ in range(4)]
assert [v.fetch() for v in again] == [250_000.0] * 4  # sent again, with the function
if strategy.num_workers == 1:  # (else the forgetful worker may have run none of them)
    assert max(sizes) > 1_000_000, sizes
pc.cloudpickle.dumps = real_dumps
print("OK", statuses.count("cancelled"), coordinator.retries, flush=True)
