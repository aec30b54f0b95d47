"""What a worker rank runs: the scheduled closures, with the worker's own state.

The coordinator sends each closure as one ``cloudpickle`` payload ``(fn, args, kwargs)``
through ``mpi4py.futures`` (:func:`execute` is the task the executor runs). Objects that
stand for something living on the workers pickle as small handles and resolve here:

* a ``ParameterServerStrategy`` becomes this worker's strategy object;
* a ps variable becomes a variable bound to this rank's view of the store;
* ``PerWorkerValues`` become this worker's component, and a per-worker dataset iterator
  this worker's iterator, built on first use from the dataset function and kept for the
  next closures that use the same ``iter()``.

A closure's outcome travels back as one payload too: ``("ok", result)``, ``("error",
exception, traceback text)``, or ``("retry", message)`` when it raised
:class:`~mpistrat.errors.WorkerUnavailableError` (the coordinator runs it again; the
worker's per-worker datasets are dropped, so they are rebuilt, as TF does after a worker
failure).

Under :mod:`mpistrat.trace` a worker's steps are its closures: each step is the wait for
the next closure (``closure wait``, counted as waiting for input) and the closure's run
(a span ``closure <fn>`` with the coordinator's number of the closure and the worker).
"""

from __future__ import annotations

import inspect
import traceback
from collections.abc import Callable
from typing import Any

import cloudpickle

from ..data.input_context import InputContext
from ..errors import WorkerUnavailableError
from ..runtime import recorder

__all__ = ["WorkerState", "execute", "current", "experimental_get_current_worker_index"]


class WorkerState:
    """A worker rank's state while it serves closures."""

    def __init__(self, strategy: Any, index: int, num_workers: int, rank: int = -1) -> None:
        self.strategy = strategy
        self.index = index
        self.num_workers = num_workers
        self.rank = rank  # (in the job's communicator)
        self.iterators: dict[tuple[int, int], Any] = {}
        self.builders: dict[int, Any] = {}  # dataset id -> its dataset function
        self.idle_since = 0  # (traced: when the last closure ended, else 0)


class MissingBuilder(Exception):
    """A closure named a per-worker dataset whose function this worker has not received
    yet (the coordinator sends it again, with the function)."""


_STATE: list[WorkerState | None] = [None]


def current() -> WorkerState | None:
    """This rank's worker state, while it serves closures (None elsewhere)."""
    return _STATE[0]


def serving(state: WorkerState | None) -> None:
    """Set (or clear, with None) this rank's worker state. Setting it ends the trace's
    step of the setup: from then on, each closure is a step."""
    _STATE[0] = state
    if state is not None:
        _next_step(state)


def _next_step(state: WorkerState) -> None:
    """A step boundary of the trace: a worker's step starts with its wait for a closure."""
    recorder.boundary(recorder.FROM_INPUT)
    state.idle_since = recorder.begin()


def experimental_get_current_worker_index() -> int:
    """The index of the worker running the current scheduled function (or building its
    per-worker dataset), in ``[0, num_workers)``.

    Raises:
        RuntimeError: called outside a function a ``ClusterCoordinator`` scheduled.
    """
    state = _STATE[0]
    if state is None:
        raise RuntimeError("experimental_get_current_worker_index() is only available "
                           "inside a function scheduled by a ClusterCoordinator (or its "
                           "per-worker dataset_fn), where a worker runs it")
    return state.index


def _require_worker(what: str) -> WorkerState:
    state = _STATE[0]
    if state is None:
        raise RuntimeError(f"{what} is resolved on the worker that runs a scheduled "
                           f"function; it cannot be unpickled elsewhere")
    return state


def execute(payload: bytes, closure: int = -1) -> bytes:
    """Run one closure (the coordinator's number ``closure``) on this worker; its outcome
    as a payload (never raises)."""
    state = _require_worker("a scheduled function")
    if recorder.on and state.idle_since:
        recorder.end(state.idle_since, "closure wait", recorder.INPUT, {"id": closure})
    t = recorder.begin()
    fn: Any = None
    outcome = "error"
    try:
        try:
            fn, args, kwargs = cloudpickle.loads(payload)
        except MissingBuilder as exc:
            outcome = "resend"
            return cloudpickle.dumps(("resend", str(exc), state.index))
        except BaseException as exc:  # noqa: BLE001 -- every failure goes back to the coordinator
            return _failure(exc, state)
        try:
            result = cloudpickle.dumps(("ok", fn(*args, **kwargs), state.index))
            outcome = "ok"
            return result
        except WorkerUnavailableError as exc:
            state.iterators.clear()  # rebuilt from their dataset functions on next use
            outcome = "retry"
            return cloudpickle.dumps(("retry", f"worker {state.index}: {exc}", state.index))
        except BaseException as exc:  # noqa: BLE001 -- every failure goes back to the coordinator
            return _failure(exc, state)
    finally:
        if t:
            name = "?" if fn is None else getattr(fn, "__name__", type(fn).__name__)
            recorder.end(t, f"closure {name}", recorder.PS,
                         {"id": closure, "worker": state.index, "rank": state.rank,
                          "outcome": outcome})
        _next_step(state)


def _failure(exc: BaseException, state: WorkerState) -> bytes:
    text = traceback.format_exc()
    try:
        blob = cloudpickle.dumps(exc)
        cloudpickle.loads(blob)
    except Exception:  # noqa: BLE001 -- an exception that does not travel
        blob = cloudpickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))
    return cloudpickle.dumps(("error", blob, f"worker {state.index}:\n{text}", state.index))



# -- handles resolved on the worker ------------------------------------------------------


def local_strategy() -> Any:
    """This worker's ParameterServerStrategy (what a pickled strategy becomes)."""
    return _require_worker("a ParameterServerStrategy").strategy


def component(values: tuple[Any, ...]) -> Any:
    """This worker's element of a ``PerWorkerValues``."""
    state = _require_worker("a PerWorkerValues")
    if len(values) != state.num_workers:
        raise ValueError(f"PerWorkerValues has {len(values)} values for {state.num_workers} "
                         f"workers; give one value per worker")
    return values[state.index]


def dataset_iterator(key: tuple[int, int], builder: bytes | None, shard: bool) -> Any:
    """This worker's iterator of a per-worker dataset: built from the dataset function on
    first use of ``key`` (dataset id, ``iter()`` generation), then kept. The function
    comes with the closures until the coordinator knows every worker has it (``builder``
    None afterwards: this worker's copy)."""
    state = _require_worker("a per-worker dataset iterator")
    found = state.iterators.get(key)
    if found is None:
        if builder is not None:
            state.builders[key[0]] = cloudpickle.loads(builder)
        fn = state.builders.get(key[0], MissingBuilder)
        if fn is MissingBuilder:
            raise MissingBuilder(f"dataset {key[0]}")
        found = state.iterators[key] = iter(build_dataset(fn, state, shard))
    return found


def build_dataset(fn: Callable[..., Any] | Any, state: WorkerState, shard: bool) -> Any:
    """The dataset a per-worker dataset function gives on this worker: ``fn()``, or
    ``fn(input_context)`` when it takes an argument. TF's input context says one pipeline
    (every worker reads the whole dataset); ``shard`` makes it one per worker."""
    if not callable(fn):
        return fn  # a dataset object, sent as it is
    context = InputContext(state.num_workers if shard else 1, state.index if shard else 0,
                           len(state.strategy.extended.worker_devices))
    try:
        takes = len(inspect.signature(fn).parameters) > 0
    except (TypeError, ValueError):
        takes = False
    return fn(context) if takes else fn()
