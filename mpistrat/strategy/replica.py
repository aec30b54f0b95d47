"""Replica contexts and running a function once per local replica (``strategy.run``).

With one local replica, ``fn`` runs in the calling thread. With ``G > 1`` replicas per
rank, each replica runs in its own thread, as in TensorFlow's MirroredStrategy, but only
one thread runs at a time: replica 0 runs until it finishes or reaches a
``merge_call``, then replica 1, and so on. When every replica is waiting in a
``merge_call``, the calling (main) thread regroups their arguments and runs the merge
function once, in cross-replica context, then the replicas resume with their part of its
result. So every MPI call — collectives inside ``merge_fn``, ``all_reduce`` — comes from the
main thread, in the same order on every rank, whatever MPI thread level the library
grants; and replicas that call ``merge_call`` a different number of times get an error
instead of a hang.

Under :mod:`mpistrat.trace` each replica's call is a span ``replica <fn>`` on the thread
that ran it (its merge calls' waits included).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from .._nest import flatten, pack_sequence_as
from ..backends import get_backend
from ..backends.interop import is_writeable, to_native
from ..ops import ReduceOp
from ..runtime import recorder
from ..runtime.agreement import agree
from ..values import DistributedValues, Mirrored, PerReplica, components_of, regroup, select_replica
from . import context
from .variables import DistributedVariable, Variable

__all__ = ["ReplicaContext", "ValueContext", "regroup", "select_replica", "run_replicas"]


class ReplicaContext:
    """What ``fn`` sees inside ``strategy.run`` (``tf.distribute.ReplicaContext``).

    Attributes:
        strategy: the strategy running this replica.
        replica_id_in_sync_group: this replica's global id, ``rank * G + local index``.
        num_replicas_in_sync: replicas over all ranks (``W * G``).
    """

    def __init__(self, strategy: Any, replica_id_in_sync_group: int, local_index: int = 0,
                 merge: Callable[..., Any] | None = None) -> None:
        self._strategy = strategy
        self._replica_id = replica_id_in_sync_group
        self._local_index = local_index
        self._merge = merge

    @property
    def strategy(self) -> Any:
        return self._strategy

    @property
    def replica_id_in_sync_group(self) -> int:
        return self._replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        return self._strategy.num_replicas_in_sync

    @property
    def devices(self) -> tuple[str, ...]:
        """This replica's device (a one-element tuple)."""
        devices = self._strategy.extended.worker_devices
        return (devices[self._local_index],)

    def merge_call(self, merge_fn: Callable[..., Any], args: Sequence[Any] = (),
                   kwargs: dict[str, Any] | None = None) -> Any:
        """Pause every replica, run ``merge_fn(strategy, *args, **kwargs)`` once in
        cross-replica context with each argument regrouped across the local replicas
        (the same object from every replica stays unwrapped, otherwise a
        :class:`PerReplica`), and give each replica its component of the result.

        Raises:
            RuntimeError: replicas made different numbers of ``merge_call`` calls, or
                ``merge_fn`` raised on another replica's behalf (the error propagates).
        """
        kwargs = dict(kwargs or {})
        if self._merge is not None:
            return self._merge(merge_fn, tuple(args), kwargs)
        with context._entered(self._strategy, None):
            return merge_fn(self._strategy, *args, **kwargs)

    def all_reduce(self, reduce_op: Any, value: Any, options: Any = None, *,
                   inplace: bool = False, out: Any = None) -> Any:
        """All-reduce ``value`` (any nest of arrays of any library) across every replica of
        every rank.

        Every replica must call it in the same order with the same structure, shapes and
        dtypes (checked across ranks before any data moves). Returns the same nest, each
        leaf the reduced array as the leaf's array type (identical on every replica).

        Args:
            inplace: write each result into this replica's input leaf (writeable arrays)
                and return ``value`` itself.
            out: a nest like ``value`` of arrays to write the results into, returned.
        """
        op = ReduceOp.parse(reduce_op)
        leaves = flatten(value)
        if not leaves:
            return value
        devices = self._strategy.extended.worker_devices
        targets, problem = _targets(leaves, op, inplace, out)

        def merge_fn(strategy: Any, problems: Any, *per_replica: Any) -> Any:
            if inplace or out is not None:  # agreed, so a bad target is an error everywhere
                error = next((ValueError(p) for p in components_of(problems) if p), None)
                agree(strategy.comm, None if error else f"all_reduce into {len(per_replica)}",
                      error, "ReplicaContext.all_reduce")
            values = [_contributions(v, devices) for v in per_replica]
            reduced = strategy.extended.batch_reduce_to(op, [(v, v) for v in values],
                                                        options=options)
            return tuple(PerReplica(m.values, m.devices) if isinstance(m, DistributedValues)
                         and len(m.values) > 1 else components_of(m)[0] for m in reduced)

        reduced = self.merge_call(merge_fn, args=(problem, *leaves))
        if targets is None:
            return pack_sequence_as(value, list(reduced))
        for target, result in zip(targets, reduced):
            native = to_native(target, "write the result into")
            get_backend(native).copy(native, to_native(result))
        return value if inplace else out

    def all_gather(self, value: Any, axis: int = 0, options: Any = None) -> Any:
        """Concatenate every replica's ``value`` (a nest of arrays) along ``axis``, in
        global replica order; every replica gets the whole result."""

        devices = self._strategy.extended.worker_devices

        def merge_fn(strategy: Any, *per_replica: Any) -> Any:
            # one copy per local replica, as TF gives each device its own tensor: strategy.run
            # then returns a PerReplica of them, not one shared array
            return tuple(_per_device(strategy._gather(_contributions(v, devices), axis),
                                     strategy.extended.placement) for v in per_replica)

        leaves = flatten(value)
        gathered = self.merge_call(merge_fn, args=tuple(leaves))
        return pack_sequence_as(value, list(gathered))

    def __repr__(self) -> str:
        return (f"ReplicaContext(replica {self._replica_id} of {self.num_replicas_in_sync}, "
                f"{type(self._strategy).__name__})")


def _targets(leaves: list[Any], op: ReduceOp, inplace: bool, out: Any,
             ) -> tuple[list[Any] | None, str | None]:
    """The arrays ``all_reduce`` writes into (None: new arrays), and what is wrong with
    them on this replica (None: nothing), checked before any data moves."""
    if not inplace and out is None:
        return None, None
    if inplace and out is not None:
        return None, "inplace=True writes into the inputs: drop out, or inplace"
    try:
        targets = leaves if inplace else flatten(out)
        if len(targets) != len(leaves):
            return None, (f"out has {len(targets)} arrays, value {len(leaves)}: give out "
                          f"the structure of value")
        for index, (target, leaf) in enumerate(zip(targets, leaves)):
            native, source = to_native(target, "write the result into"), to_native(leaf)
            dtype = op.result_dtype(source.dtype)
            if tuple(native.shape) != tuple(source.shape) or native.dtype != dtype:
                return None, (f"leaf {index}: the result has shape {tuple(source.shape)} and "
                              f"dtype {dtype}, the array to write it into "
                              f"{tuple(native.shape)} and {native.dtype}"
                              + ("; MEAN of integers is float64: use out, or op='sum'"
                                 if inplace else ""))
            if not is_writeable(native):
                immutable = type(target).__module__.startswith("jax")
                return None, (f"leaf {index} is read-only ({type(target).__name__}); write "
                              f"into writeable arrays"
                              + (" (JAX arrays are immutable)" if immutable else ""))
    except TypeError as exc:
        return None, str(exc)
    return targets, None


class ValueContext:
    """What ``value_fn`` of ``experimental_distribute_values_from_function`` gets for
    each replica (``tf.distribute.experimental.ValueContext``)."""

    __slots__ = ("_replica_id", "_num_replicas")

    def __init__(self, replica_id_in_sync_group: int = 0, num_replicas_in_sync: int = 1) -> None:
        self._replica_id = replica_id_in_sync_group
        self._num_replicas = num_replicas_in_sync

    @property
    def replica_id_in_sync_group(self) -> int:
        """This replica's global id, in ``[0, num_replicas_in_sync)``."""
        return self._replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas across every rank."""
        return self._num_replicas

    def __repr__(self) -> str:
        return (f"ValueContext(replica_id_in_sync_group={self._replica_id}, "
                f"num_replicas_in_sync={self._num_replicas})")


def _per_device(array: Any, placement: Any) -> Any:
    """``array`` on the first local replica's device and a copy on each other one's (a
    Mirrored), or the array itself (on the replica's device) with one replica."""
    devices = placement.devices
    first = placement.put(array, 0) if placement.gpu else array
    if len(devices) == 1:
        return first
    return Mirrored([first] + [placement.clone(first, i) for i in range(1, len(devices))],
                    devices)


def _contributions(value: Any, devices: Sequence[str]) -> DistributedValues:
    """One component per local replica. A leaf that ``merge_call`` left unwrapped is the
    same object from every replica: each replica contributed it (as when they passed
    equal but distinct objects). With one replica, ``merge_fn`` gets the value itself.
    A variable contributes each replica's copy (a copy of it: results never alias it)."""
    if isinstance(value, DistributedVariable):
        return PerReplica([c.copy() for c in value.values], value.devices)
    if isinstance(value, Variable):
        value = value.numpy()
    if isinstance(value, DistributedValues):
        return value
    return PerReplica([value] * len(devices), devices)


class _Abort(BaseException):
    """Unwinds a replica thread when another replica failed (never seen by users)."""


class _Replica:
    def __init__(self) -> None:
        self.go = threading.Event()
        self.paused = threading.Event()
        # (merge_fn, args, kwargs) while the replica waits in merge_call, else None (Any: the
        # main thread reads it only for replicas that wait there)
        self.merge: Any = None
        self.merged: Any = None
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = False
        self.abort = False


def run_replicas(strategy: Any, fn: Callable[..., Any], args: tuple, kwargs: dict,
                 replica_ids: Sequence[int], devices: Sequence[str]) -> list[Any]:
    """Run ``fn`` once per local replica, in lock-step (see the module docstring);
    return each replica's result, in local order."""
    count = len(replica_ids)
    placement = strategy.extended.placement
    if count == 1:
        ctx = ReplicaContext(strategy, replica_ids[0], 0)
        with context._entered(strategy, ctx), placement.on(0):
            t = recorder.begin()
            try:
                return [fn(*select_replica(0, args), **select_replica(0, kwargs))]
            finally:
                if t:
                    _traced(t, fn, replica_ids[0])

    slots = [_Replica() for _ in range(count)]

    def body(index: int) -> None:
        slot = slots[index]

        def merge(merge_fn: Callable[..., Any], margs: tuple, mkwargs: dict) -> Any:
            slot.merge = (merge_fn, margs, mkwargs)
            slot.paused.set()
            slot.go.wait()
            slot.go.clear()
            if slot.abort:
                raise _Abort()
            return slot.merged

        ctx = ReplicaContext(strategy, replica_ids[index], index, merge)
        context._start_thread(strategy, ctx)
        slot.go.wait()
        slot.go.clear()
        t = recorder.begin()
        try:
            if not slot.abort:
                with placement.on(index):  # (a GPU replica's device, current in its thread)
                    slot.result = fn(*select_replica(index, args),
                                     **select_replica(index, kwargs))
        except _Abort:
            pass
        except BaseException as exc:  # noqa: BLE001 (re-raised in the caller)
            slot.error = exc
        if t:
            _traced(t, fn, replica_ids[index])
        slot.done = True
        slot.paused.set()

    threads = [threading.Thread(target=body, args=(i,), daemon=True,
                                name=f"mpistrat-replica-{replica_ids[i]}") for i in range(count)]
    for thread in threads:
        thread.start()

    def step(slot: _Replica) -> None:
        slot.paused.clear()
        slot.go.set()
        slot.paused.wait()

    try:
        for slot in slots:
            step(slot)
        while True:
            failed = next((s.error for s in slots if s.error is not None), None)
            if failed is not None:
                raise failed
            waiting = [s for s in slots if not s.done]
            if not waiting:
                return [s.result for s in slots]
            if len(waiting) != count:
                raise RuntimeError(
                    f"some replicas made a different number of replica_context().merge_call() "
                    f"calls: replicas {[i for i, s in enumerate(slots) if s.done]} finished "
                    f"while {[i for i, s in enumerate(slots) if not s.done]} wait in a "
                    f"merge_call (all_reduce and variable updates in replica context are "
                    f"merge_calls); make every replica take the same path"
                )
            merge_fn = slots[0].merge[0]
            margs = [regroup([s.merge[1][k] for s in slots], devices)
                     for k in range(_same_length([s.merge[1] for s in slots]))]
            keys = slots[0].merge[2].keys()
            if any(s.merge[2].keys() != keys for s in slots):
                raise RuntimeError("replicas passed different keyword arguments to merge_call")
            mkwargs = {k: regroup([s.merge[2][k] for s in slots], devices) for k in keys}
            with context._entered(strategy, None):
                merged = merge_fn(strategy, *margs, **mkwargs)
            for index, slot in enumerate(slots):
                slot.merged = select_replica(index, merged)
                slot.merge = None
                step(slot)
    except BaseException:
        for slot in slots:
            if not slot.done:
                slot.abort = True
                slot.go.set()
        for thread in threads:
            thread.join()
        raise
    finally:
        for thread in threads:
            thread.join()


def _traced(start: int, fn: Callable[..., Any], replica_id: int) -> None:
    """The trace's span of one replica's call of ``fn`` (on the replica's thread)."""
    recorder.end(start, f"replica {getattr(fn, '__name__', type(fn).__name__)}",
                 recorder.USER, {"replica": replica_id})


def _same_length(argument_lists: list[tuple]) -> int:
    lengths = {len(a) for a in argument_lists}
    if len(lengths) != 1:
        raise RuntimeError(f"replicas passed different numbers of arguments to merge_call: "
                           f"{sorted(lengths)}")
    return lengths.pop()
