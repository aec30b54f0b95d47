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
print("OK", statuses.count("cancelled"), coordinator.retries, flush=True)
