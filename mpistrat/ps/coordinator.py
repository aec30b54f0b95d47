"""``ClusterCoordinator``: schedule functions on the workers of a ParameterServerStrategy.

TF's contract (``tf.distribute.coordinator``), over ``mpi4py.futures``:

* :meth:`ClusterCoordinator.schedule` returns a :class:`RemoteValue` at once; the function
  runs on whichever worker is idle (one function in flight per worker; the executor sends
  a task only to an idle worker), at least once;
* the first error a function raises is raised once, by the next ``schedule``, ``join`` or
  ``done``, after every function still running has finished; the functions not started
  yet are thrown away and their ``RemoteValue.fetch()`` raises
  :class:`~mpistrat.errors.CancelledError`;
* a function that raises :class:`~mpistrat.errors.WorkerUnavailableError` runs again, on
  any worker (TF's worker-failure contract; that worker's per-worker datasets are
  rebuilt);
* :class:`PerWorkerValues` in the arguments become the executing worker's value; a
  per-worker dataset's iterator becomes that worker's iterator.

Functions and their arguments travel with ``cloudpickle`` (a function defined in the
script needs no import on the workers); variables, the strategy and per-worker values
travel as handles (:mod:`mpistrat.ps.worker`).

A worker or ps process that dies ends the MPI job (``mpistrat run`` names it); there is
no function-level recovery from a lost process. Under ``mpistrat run --min-ranks`` the
job is launched again on the ranks left and resumes from the coordinator's newest
snapshot: ``schedule()``, ``join()`` and ``mpistrat.elastic.step()`` are its step
boundaries (:mod:`mpistrat.ps.elastic`). Otherwise: resume from the coordinator's
checkpoint.

Under :mod:`mpistrat.trace` the coordinator records each closure it schedules (an
instant ``closure scheduled`` with the closure's number and function), each one that
comes back (``closure done``: on which worker, how it ended), and its waits in
``RemoteValue.fetch`` (``fetch``) and :meth:`ClusterCoordinator.join` (``join``); the
worker records the closure's run (:mod:`mpistrat.ps.worker`). The coordinator's steps
are its ``schedule`` calls (unless the script marks its own with
:func:`mpistrat.trace.step`).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import cloudpickle

from .._nest import flatten, pack_sequence_as
from ..elastic import hooks
from ..errors import CancelledError, CollectiveTimeoutError
from ..runtime import recorder, stall
from . import worker
from .strategy import _COORDINATORS, ParameterServerStrategy
from .worker import experimental_get_current_worker_index

__all__ = ["ClusterCoordinator", "RemoteValue", "PerWorkerValues", "PerWorkerDataset",
           "PerWorkerDistributedIterator", "experimental_get_current_worker_index"]

_CANCELLED = "The corresponding function is cancelled. Please reschedule the function."
_dataset_ids = itertools.count()


class _Sending(threading.local):
    """What the closure being pickled carries: whether every per-worker dataset goes with
    its function (``full``), and the datasets that did (``carried``; None: not pickling
    a closure)."""

    full = False
    carried: list[PerWorkerDataset] | None = None


_SENDING = _Sending()


class RemoteValue:
    """The result of a scheduled function (TF's ``RemoteValue``): :meth:`fetch` waits for
    it and returns the value, or raises the function's error, or
    :class:`~mpistrat.errors.CancelledError` when the function was thrown away."""

    __slots__ = ("_ready", "_status", "_payload", "_closure")

    def __init__(self, closure: int = -1) -> None:
        self._ready = threading.Event()
        self._status = ""
        self._payload: Any = None
        self._closure = closure  # (the closure's number, for the trace)

    def _finish(self, status: str, payload: Any = None) -> None:
        self._status, self._payload = status, payload
        self._ready.set()

    def fetch(self) -> Any:
        """Wait for the function and return its value (NumPy arrays and Python values as
        the function returned them)."""
        t = recorder.begin()
        self._ready.wait()
        if t:
            recorder.end(t, "fetch", recorder.PS, {"id": self._closure})
        if self._status == "ok":
            return self._payload
        if self._status == "error":
            raise self._payload
        raise CancelledError(_CANCELLED)

    def get(self) -> Any:
        """:meth:`fetch` (TF's ``get`` returns tensors; here both give the same values)."""
        return self.fetch()

    def __repr__(self) -> str:
        state = {"": "not ready", "ok": "ready", "error": "failed",
                 "cancelled": "cancelled"}[self._status]
        return f"<RemoteValue {state}>"


class PerWorkerValues:
    """One value per worker; passed to a scheduled function, each worker gets its own
    (TF's ``PerWorkerValues``).

    Args:
        values: a tuple with one value per worker, in worker order.
    """

    def __init__(self, values: tuple[Any, ...]) -> None:
        self._values = tuple(values)

    @property
    def values(self) -> tuple[Any, ...]:
        return self._values

    def __reduce__(self) -> Any:
        return (worker.component, (self._values,))

    def __repr__(self) -> str:
        return f"PerWorkerValues({len(self._values)} values)"


class PerWorkerDistributedIterator(PerWorkerValues):
    """The iterators of a per-worker dataset, one on each worker (what ``iter()`` of a
    :class:`PerWorkerDataset` returns). Pass it to a scheduled function and call
    ``next()`` on it there; each worker builds its dataset on first use."""

    def __init__(self, key: tuple[int, int], dataset: PerWorkerDataset) -> None:
        super().__init__(())
        self._key, self._dataset = key, dataset

    def __next__(self) -> Any:
        raise TypeError("next() of a per-worker iterator runs inside a scheduled function "
                        "(coordinator.schedule(step, args=(iterator,))), on a worker")

    def __iter__(self) -> Iterator[Any]:
        return self

    def __reduce__(self) -> Any:
        # the dataset function goes along until every worker is known to have it
        dataset, carried = self._dataset, _SENDING.carried
        full = carried is None or _SENDING.full or len(dataset._holders) < dataset._workers
        if full and carried is not None and dataset not in carried:
            carried.append(dataset)
        return (worker.dataset_iterator,
                (self._key, dataset._builder if full else None, dataset._shard))

    def __repr__(self) -> str:
        return f"<PerWorkerDistributedIterator dataset {self._key[0]}, iter() {self._key[1]}>"


class PerWorkerDataset:
    """A dataset built on every worker from a function (``create_per_worker_dataset``);
    each ``iter()`` gives new iterators, started afresh on every worker."""

    def __init__(self, dataset_fn: Any, shard_by_worker: bool = False,
                 workers: int = 1) -> None:
        self._id = next(_dataset_ids)
        self._workers = workers
        self._holders: set[int] = set()  # workers known to hold the function
        self._generation = itertools.count()
        try:
            self._builder = cloudpickle.dumps(dataset_fn)
        except Exception as exc:  # noqa: BLE001 -- say what could not travel
            raise TypeError(f"the dataset function cannot be sent to the workers "
                            f"({type(exc).__name__}: {exc}); build the dataset inside a "
                            f"function that only references picklable objects") from exc
        self._shard = bool(shard_by_worker)

    def __iter__(self) -> PerWorkerDistributedIterator:
        return PerWorkerDistributedIterator((self._id, next(self._generation)), self)

    def __repr__(self) -> str:
        return f"<PerWorkerDataset {self._id}{' sharded by worker' if self._shard else ''}>"


class _Closure:
    __slots__ = ("call", "payload", "carried", "value", "future", "id")

    def __init__(self, call: tuple, number: int = -1) -> None:
        self.call = call  # (fn, args, kwargs)
        self.id = number  # (the coordinator's count of closures, for the trace)
        self.payload = b""
        self.carried: list[PerWorkerDataset] = []  # datasets sent with their function
        self.value = RemoteValue(number)
        self.future: Any = None

    def pickle(self, full: bool = False) -> None:
        """The payload; ``full``: every per-worker dataset with its function."""
        _SENDING.full, _SENDING.carried = full, []
        try:
            self.payload = cloudpickle.dumps(self.call)
            self.carried = _SENDING.carried
        finally:
            _SENDING.full, _SENDING.carried = False, None


class ClusterCoordinator:
    """Schedule functions on the workers of a :class:`ParameterServerStrategy` (TF's
    ``tf.distribute.coordinator.ClusterCoordinator``). One per strategy: constructing it
    again returns the same object. Use it on the coordinator rank (the only rank that
    runs the program past the strategy's constructor).

    Raises:
        ValueError: the strategy is not a ParameterServerStrategy (TF's message).
    """

    _strategy: ParameterServerStrategy

    def __new__(cls, strategy: Any) -> ClusterCoordinator:
        if not isinstance(strategy, ParameterServerStrategy):
            raise ValueError("Only ParameterServerStrategy is supported to work with "
                             "ClusterCoordinator currently.")
        found = _COORDINATORS.get(strategy._store.id)
        if found is None:
            if strategy._executor is None:
                raise RuntimeError("the ClusterCoordinator runs on the coordinator rank, and "
                                   "this strategy has been shut down")
            found = super().__new__(cls)
            found._setup(strategy)
            _COORDINATORS[strategy._store.id] = found
        return found

    def _setup(self, strategy: ParameterServerStrategy) -> None:
        self._strategy = strategy
        self._executor = strategy._executor
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending: set[_Closure] = set()
        self._error: BaseException | None = None
        self._retries = 0
        self._progress = time.monotonic()  # when a function last finished
        self._marked = False  # a step boundary marked since the last function was sent
        self._closures = itertools.count()  # (numbers the closures, for the trace)

    @property
    def strategy(self) -> ParameterServerStrategy:
        return self._strategy

    # -- scheduling
    def schedule(self, fn: Callable[..., Any], args: Any = None,
                 kwargs: Any = None) -> RemoteValue:
        """Schedule ``fn(*args, **kwargs)`` on a worker; returns at once.

        Raises:
            the first error of an earlier function (once; the functions not started yet
            are cancelled and nothing is running when it is raised).
            TypeError: ``fn`` is not callable, or it or its arguments cannot be sent.
        """
        self._raise_error()
        if not callable(fn):
            raise TypeError(f"schedule() takes a function, got {type(fn).__name__}")
        self._boundary()
        for value in flatten([args, kwargs]):
            if isinstance(value, RemoteValue):
                raise ValueError("RemoteValue used as an input to scheduled function is not "
                                 "yet supported.")
        closure = _Closure((fn, tuple(args or ()), dict(kwargs or {})), next(self._closures))
        try:
            closure.pickle()
        except Exception as exc:  # noqa: BLE001 -- say what could not travel
            raise TypeError(f"cannot send {getattr(fn, '__name__', fn)!r} and its arguments "
                            f"to a worker ({type(exc).__name__}: {exc}); scheduled "
                            f"functions may reference variables, the strategy, per-worker "
                            f"iterators and picklable values") from exc
        if recorder.on:
            recorder.instant("closure scheduled", recorder.PS,
                             {"id": closure.id,
                              "fn": getattr(fn, "__name__", type(fn).__name__)})
        self._submit(closure)
        self._marked = False
        return closure.value

    def _submit(self, closure: _Closure) -> None:
        with self._lock:
            self._pending.add(closure)
        closure.future = self._executor.submit(worker.execute, closure.payload, closure.id)
        closure.future.add_done_callback(lambda future: self._finished(closure, future))

    def _finished(self, closure: _Closure, future: Any) -> None:
        """A closure's future completed (in the executor's thread)."""
        if future.cancelled():
            outcome: tuple = ("cancelled",)
        elif future.exception() is not None:  # the executor could not run it at all
            outcome = ("error", cloudpickle.dumps(future.exception()), "", None)
        else:
            try:
                outcome = cloudpickle.loads(future.result())
            except Exception as exc:  # noqa: BLE001 -- a result this process cannot load
                outcome = ("error", cloudpickle.dumps(RuntimeError(
                    f"the result of a scheduled function cannot be loaded on the "
                    f"coordinator ({type(exc).__name__}: {exc}); return NumPy arrays and "
                    f"Python values")), "", None)
        if outcome[0] == "resend" and self._error is None:
            # the worker lacked a dataset function: send the closure again with them all
            closure.pickle(full=True)
            self._submit(closure)  # (it stays pending meanwhile: join() keeps waiting)
            return
        if outcome[0] == "resend":
            outcome = ("cancelled",)  # (an error is pending: nothing more is started)
        if recorder.on:
            recorder.instant("closure done", recorder.PS,
                             {"id": closure.id, "outcome": outcome[0],
                              "worker": outcome[-1] if len(outcome) > 1 else None})
        if outcome[0] != "cancelled" and outcome[-1] is not None:
            for dataset in closure.carried:  # that worker has their functions now
                dataset._holders.add(outcome[-1])
        cancel: list[Any] = []
        with self._lock:
            self._progress = time.monotonic()
            if outcome[0] == "retry":
                if self._error is None:
                    self._retries += 1  # (it stays pending: join() keeps waiting)
                    retry = True
                else:
                    outcome, retry = ("cancelled",), False
            else:
                retry = False
            if not retry:
                if outcome[0] == "error":
                    error = cloudpickle.loads(outcome[1])
                    if outcome[2]:
                        error.add_note(f"(raised on {outcome[2].rstrip()})")
                    closure.value._finish("error", error)
                    if self._error is None:
                        self._error = error
                        cancel = [c.future for c in self._pending
                                  if c is not closure and c.future is not None]
                elif outcome[0] == "ok":
                    closure.value._finish("ok", outcome[1])
                else:
                    closure.value._finish("cancelled")
                self._pending.discard(closure)
                self._idle.notify_all()
        if retry:
            self._submit(closure)
        for other in cancel:  # (outside the lock: a cancel calls _finished at once)
            other.cancel()

    def _raise_error(self) -> None:
        """Raise the first error, once, when nothing is running any more."""
        with self._lock:
            if self._error is None:
                return
            self._wait_idle()
            error, self._error = self._error, None
        raise error

    def _wait_idle(self) -> None:
        """Wait (holding the lock) until no function is pending. Under ``mpistrat run``'s
        stall check, report when none has finished for that long; past its ``--timeout``,
        raise :class:`~mpistrat.CollectiveTimeoutError` instead of waiting for a worker
        that is stuck."""
        watch = stall.current()
        stall_check = watch.stall_check if watch is not None else None
        timeout = watch.timeout if watch is not None else None
        reported = 0
        while self._pending:
            if stall_check is None and timeout is None:
                self._idle.wait()
                continue
            quiet = time.monotonic() - self._progress
            if timeout is not None and quiet >= timeout:
                raise CollectiveTimeoutError(
                    f"no scheduled function finished in {timeout:g} s (--timeout): "
                    f"{self._describe_pending()}; a worker is stuck in a function (an "
                    f"endless loop, a wait that never ends) or cannot be reached", [])
            if stall_check is not None and quiet >= (reported + 1) * stall_check:
                reported += 1
                assert watch is not None  # (stall_check comes from it)
                watch.report(
                    f"mpistrat: no scheduled function has finished for {quiet:.0f} s: "
                    f"{self._describe_pending()}. "
                    + ("The job gives up after " f"{timeout:g} s (--timeout)."
                       if timeout is not None else
                       "mpistrat run --timeout S ends the job instead of waiting."))
            deadlines = [t for t in ((reported + 1) * stall_check if stall_check else None,
                                     timeout) if t is not None]
            self._idle.wait(timeout=max(0.01, min(deadlines) - quiet))

    def _describe_pending(self) -> str:
        running = sum(1 for c in self._pending if c.future is not None and c.future.running())
        return (f"{running} running on the workers, {len(self._pending) - running} waiting "
                f"for a free worker")

    def join(self) -> None:
        """Wait until every scheduled function has finished.

        Raises:
            the first error of a function (once), as :meth:`schedule`.
            CollectiveTimeoutError: under ``mpistrat run --timeout``, no function
                finished for that long.
        """
        t = recorder.begin()
        try:
            self._drain()
        finally:
            if t:
                recorder.end(t, "join", recorder.PS)
        self._boundary()

    def _drain(self) -> None:
        """Wait until every scheduled function has finished; raise the first error."""
        with self._lock:
            self._wait_idle()
        self._raise_error()

    def _boundary(self) -> None:
        """A step boundary of an elastic job (:mod:`mpistrat.ps.elastic`): a snapshot,
        when one is due, waits for the functions scheduled so far (:meth:`_drain`). Not
        marked twice without a function sent in between (the same state)."""
        if not self._marked:
            self._marked = True
            recorder.boundary(recorder.FROM_STRATEGY)  # (the trace's: below a script's)
            hooks.step_boundary(None, traced=True)

    def done(self) -> bool:
        """Whether every scheduled function has finished (raises the first error, once)."""
        self._raise_error()
        with self._lock:
            return not self._pending

    def fetch(self, val: Any) -> Any:
        """``RemoteValue.fetch`` of every RemoteValue in a structure; other values as
        they are."""
        leaves = flatten(val)
        return pack_sequence_as(val, [v.fetch() if isinstance(v, RemoteValue) else v
                                      for v in leaves])

    # -- datasets
    def create_per_worker_dataset(self, dataset_fn: Any, *,
                                  shard_by_worker: bool = False) -> PerWorkerDataset:
        """A dataset built on every worker from ``dataset_fn`` (``dataset_fn()``, or
        ``dataset_fn(input_context)`` when it takes an argument), built on first use.

        As in TF, every worker builds the whole dataset (the input context says one
        pipeline): shuffle it with a different seed per worker, or shard it yourself with
        :func:`~mpistrat.experimental_get_current_worker_index`. ``shard_by_worker=True``
        (not in TF) gives each worker an input context with one pipeline per worker, so
        ``dataset.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)`` splits the data.
        """
        return PerWorkerDataset(dataset_fn, shard_by_worker, self._strategy.num_workers)

    @property
    def retries(self) -> int:
        """Functions run again after a :class:`~mpistrat.errors.WorkerUnavailableError`."""
        return self._retries

    def _abandon(self) -> int:
        """The job is ending: cancel what has not started; how many are still running."""
        with self._lock:
            futures = [c.future for c in self._pending if c.future is not None]
        for future in futures:
            future.cancel()
        return sum(1 for future in futures if not future.done())

    def __reduce__(self) -> Any:
        raise TypeError("a ClusterCoordinator stays on the coordinator: do not use it "
                        "inside a scheduled function")
