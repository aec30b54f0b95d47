"""``CrossDeviceOps``: TensorFlow's gradient-reduction objects over MPI.

Every op reduces over all replicas of all ranks of its communicator (TF's in-graph view,
emulated: each rank holds its own ``G`` components and the ranks communicate). The
public methods (``reduce``, ``batch_reduce``, ``broadcast``) validate their arguments,
agree across ranks that every rank made the same, valid call (so a mistake on one rank
is an error on every rank, never a hang), take TF's shortcuts, then call the
``*_implementation`` methods that subclasses override:

* :class:`ReductionToOneDevice` — sum everything on one device (the first destination,
  rank 0's when it names no task), then broadcast;
* :class:`AllReduceCrossDeviceOps` and its :class:`NcclAllReduce` and
  :class:`HierarchicalCopyAllReduce` — all-reduce when the destinations are the value's
  devices, else reduce-to-one-device;
* :class:`MultiWorkerAllReduce` — an ``all_reduce_spec`` that routes each tensor by its
  byte size to an algorithm, with ``num_packs`` / small-gradient packing per spec entry.

Results always come back in input order (TF returned them grouped by spec entry).

Under :mod:`mpistrat.trace` each public call is one span ``<class>.reduce``,
``.batch_reduce`` or ``.broadcast`` (a ``cpu_op`` with the collective's args, see
:mod:`mpistrat.allreduce`) holding its ``agreement`` and phases.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from . import engine, fused
from ._nest import flatten
from .backends import copy_all, get_backend, host_backend
from .backends.capabilities import probe_gpus
from .backends.cupy_backend import CupyBackend
from .backends.interop import is_native, is_writeable, restore, to_host, to_native
from .communication import CommunicationImplementation, CommunicationOptions
from .errors import BackendUnavailable, TopologyError
from .ops import ReduceOp
from .packing import PackPlan
from .runtime import recorder
from .runtime._mpi import Comm, world
from .runtime.agreement import (
    DOORS,
    FUSED_BYTES,
    FUSED_RANKS,
    agree,
    close_door,
    dtype_of,
    note_algorithm,
    open_door,
    phase,
)
from .spec import AllReduceSpec, AllReduceSpecTuple, parse_spec
from .values import Device, DistributedValues, Mirrored, PerReplica, interned, parse_device, single

__all__ = [
    "CrossDeviceOps",
    "ReductionToOneDevice",
    "AllReduceCrossDeviceOps",
    "NcclAllReduce",
    "HierarchicalCopyAllReduce",
    "MultiWorkerAllReduce",
]


# ----------------------------------------------------------------------- arguments


def _reduce_op(value: Any) -> ReduceOp:
    op = ReduceOp.parse(value)
    if op not in (ReduceOp.SUM, ReduceOp.MEAN):
        raise ValueError(f"`reduce_op` must be ReduceOp.SUM or ReduceOp.MEAN, got {op}")
    return op


def _per_replica(value: Any) -> DistributedValues:
    """TF's conversion of a reduce input: a DistributedValues, or one array (on /cpu:0).
    A list or tuple of numbers becomes one array, as in TF 2.21; one holding arrays is
    refused, since it most likely meant one value per device."""
    if isinstance(value, DistributedValues):
        return value
    if isinstance(value, (list, tuple)):
        if any(not np.isscalar(leaf) for leaf in flatten(value)):
            raise ValueError(
                f"cannot reduce a {type(value).__name__} holding arrays as one tensor: "
                f"wrap one value per device in PerReplica([...]), or pass one array "
                f"(np.stack(...)) to reduce it as one tensor"
            )
        value = np.asarray(value)
    # (anything but an array is refused by _native, which every caller applies next)
    return PerReplica([np.asarray(value) if np.isscalar(value) else value])


def _native(value: DistributedValues) -> tuple[DistributedValues, Any]:
    """``value`` with its components as NumPy/CuPy arrays sharing their memory (PyTorch,
    JAX, DLPack, ... at the edge), and the component whose type the results take (None
    when every component is NumPy or CuPy already: nothing to convert back)."""
    components = value.values
    if all(is_native(c) for c in components):
        return value, None
    converted = [c if is_native(c) else np.asarray(c) if np.isscalar(c)
                 else to_native(c, "reduce") for c in components]
    like = next(c for c in components if not is_native(c))
    return type(value)._trusted(converted, value.device_set), like


def _restored(result: Any, like: Any) -> Any:
    """A reduction's result (an array or a DistributedValues) as ``like``'s array type."""
    if like is None:
        return result
    if isinstance(result, DistributedValues):
        return type(result)._trusted([restore(c, like) for c in result.values],
                                     result.device_set)
    return restore(result, like)


_NAMED: dict[str, tuple[Device, ...]] = {}  # a device name as destinations -> its set


def _destinations(destinations: Any) -> tuple[Device, ...]:
    """The destination devices: a DistributedValues', one device name, a list of names, or
    an array's (TF takes a tensor's device): a plain array is one value on ``/cpu:0``, as
    :func:`_per_replica` places it."""
    if isinstance(destinations, DistributedValues):
        return destinations.device_set
    if hasattr(destinations, "shape") and hasattr(destinations, "dtype"):
        return PerReplica([destinations]).device_set
    if isinstance(destinations, str):
        named = _NAMED.get(destinations)
        if named is None:
            if not destinations.strip():
                raise ValueError("destinations can not be empty")
            named = interned((parse_device(destinations),))
            if len(_NAMED) < 1024:
                _NAMED[destinations] = named
        return named
    if isinstance(destinations, Device):
        return interned((destinations,))
    if isinstance(destinations, (list, tuple)):
        if not destinations:
            raise ValueError("destinations can not be empty")
        if all(isinstance(d, (str, Device)) for d in destinations):
            return tuple(parse_device(d) for d in destinations)
    raise ValueError(
        f"destinations must be one of a `DistributedValues` object, an array, a device "
        f"string, or a list of device strings, got {destinations!r} "
        f"({type(destinations).__name__})"
    )


def _dest_set(value: DistributedValues, dest: Any) -> tuple[Device, ...]:
    """A pair's destination devices (a value is valid destinations for itself)."""
    return value.device_set if dest is value else _destinations(dest)


def _text(components: int, shape: tuple, dtype: str) -> str:
    """How the agreement writes a value: ``2x(3, 4):<f4`` (``dtype`` as ``dtype.str``)."""
    return f"{components}x{shape}:{dtype}"


def _describe(value: DistributedValues) -> str:
    values = value.values
    if len(values) == 1 and type(values[0]) is np.ndarray:
        return _text(1, values[0].shape, values[0].dtype.str)
    arrays = _as_arrays(value)
    shapes = {(tuple(a.shape), a.dtype.str) for a in arrays}
    if len(shapes) != 1:
        raise ValueError(
            f"the components of {type(value).__name__} on {list(value.devices)} differ in "
            f"shape or dtype ({sorted(shapes)}); every device must hold the same shape and "
            f"dtype"
        )
    shape, dtype = shapes.pop()
    # (device arrays: ranks that disagree on where a value lives must not run one
    # algorithm on host buffers and another on device buffers)
    on = "" if all(isinstance(a, np.ndarray) for a in arrays) else "@gpu"
    return _text(len(arrays), shape, dtype) + on


def _batch_signature(values: list[DistributedValues]) -> str:
    """The agreement's description of a batch: :func:`_describe` of every value, joined.

    A training loop reduces the same structure every step, so the text is cached per key
    of shapes and dtypes (one-component NumPy or CuPy values, the common case, skip
    building 161 strings a call; other values are described, and checked, one by one).
    """
    key: list[Any] = []
    for value in values:
        components = value.values
        first = components[0]
        if len(components) == 1 and type(first) is np.ndarray:
            key.append((first.shape, first.dtype, ""))
        elif len(components) == 1 and CupyBackend.owns(first):  # (one GPU replica)
            key.append((first.shape, first.dtype, "@gpu"))
        else:
            key.append(_describe(value))
    return _signature_text(tuple(key))


@functools.lru_cache(maxsize=64)
def _signature_text(key: tuple) -> str:
    return ";".join(entry if type(entry) is str else _text(1, entry[0], entry[1].str)
                    + entry[2] for entry in key)


_DEFAULT_OPTIONS = CommunicationOptions()
_OPTIONS_TEXT = [(_DEFAULT_OPTIONS, repr(_DEFAULT_OPTIONS))]  # the last options seen


def _options_text(options: CommunicationOptions) -> str:
    """``repr(options)``, kept for the options object last seen (a strategy passes the
    same one on every call). By identity: equal options may print differently
    (``timeout_seconds=60`` and ``60.0``), and ranks agree on the text."""
    last = _OPTIONS_TEXT[0]  # (one read: another thread may replace it)
    if last[0] is options:
        return last[1]
    text = repr(options)
    _OPTIONS_TEXT[0] = (options, text)
    return text


def _same_devices(values: Sequence[Device], dest: Sequence[Device], comm: Comm) -> bool:
    """Are the destinations the value's devices (TF's condition for an all-reduce)?

    Each rank's value lives on every rank's local devices, so a destination that names a
    task is one rank's device, never the value's devices when there are several ranks;
    the answer is the same on every rank.
    """
    if values is dest or values == dest:  # the common case: destinations = the value
        # (device sets are interned, so equal sets are usually the same tuple)
        return comm.Get_size() == 1 or all(d.task is None for d in dest)
    rank, size = comm.Get_rank(), comm.Get_size()
    if size > 1 and any(d.task is not None for d in dest):
        return False
    return {d.on(rank) for d in values} == {d.on(rank) for d in dest}


def _first_array(value: DistributedValues) -> Any:
    first = value.values[0]
    return first if type(first) is np.ndarray else _as_arrays(value)[0]


def _as_arrays(value: DistributedValues) -> Sequence[Any]:
    values = value.values
    if len(values) == 1 and type(values[0]) is np.ndarray:
        return values
    return [v if type(v) is np.ndarray or hasattr(v, "shape") and hasattr(v, "dtype")
            and not isinstance(v, np.generic) else np.asarray(v) for v in value.values]


def _targets(op: ReduceOp, given: DistributedValues, value: DistributedValues,
             dest: tuple[Device, ...], match: bool, inplace: bool, out: Any,
             where: str) -> tuple[list[Any], list[Any]] | None:
    """The arrays a result is written into (as NumPy/CuPy, and as the caller gave them),
    or None for new arrays. Raises ValueError/TypeError naming the problem, which the
    caller's agreement turns into the same error on every rank."""
    if not inplace and out is None:
        return None
    if inplace and out is not None:
        raise ValueError(f"{where}: inplace=True writes into the value and out= into other "
                         f"arrays; give one of them, not both")
    if inplace:
        if not match:
            raise ValueError(
                f"{where}: inplace=True writes the result into the value's components, so "
                f"the destinations must be the value's devices {list(value.devices)}, got "
                f"{[str(d) for d in dest]}; use out= to write the result elsewhere"
            )
        handed = list(given.values)
        if any(type(c) is not np.ndarray and np.isscalar(c) for c in handed):
            raise ValueError(f"{where}: inplace=True needs arrays to write into, got a "
                             f"Python number; pass arrays, or use out=")
        natives = list(value.values)
    else:
        handed = list(out.values) if isinstance(out, DistributedValues) else \
            list(out) if isinstance(out, (list, tuple)) else [out]
        if len(handed) != len(dest):
            raise ValueError(
                f"{where}: out has {len(handed)} array(s) for {len(dest)} destination "
                f"device(s) {[str(d) for d in dest]}; give one array per destination device"
            )
        natives = [to_native(t, "write the result into") for t in handed]
    source = _first_array(value)
    dtype = op.result_dtype(source.dtype)
    for target, native in zip(handed, natives):
        if tuple(native.shape) != tuple(source.shape) or native.dtype != dtype:
            raise ValueError(
                f"{where}: the result has shape {tuple(source.shape)} and dtype {dtype}, the "
                f"array to write it into {tuple(native.shape)} and {native.dtype}"
                + ("; MEAN of integers is float64: use out=, or SUM" if inplace else "")
            )
        if not is_writeable(native):
            raise ValueError(f"{where}: the array to write the result into is read-only "
                             f"({type(target).__name__}); give writeable arrays")
    return natives, handed


def _write(result: Any, targets: tuple[list[Any], list[Any]], dest: tuple[Device, ...],
           copies: list[tuple[Any, Any]] | None = None) -> Any:
    """Copy a reduction's result (an array or a DistributedValues) into ``targets`` and
    return the caller's arrays as the reduce would have returned new ones. ``copies``:
    collect the ``(target, result)`` pairs there instead, for :func:`copy_all`."""
    natives, handed = targets
    parts = result.values if isinstance(result, DistributedValues) else [result]
    for index, native in enumerate(natives):
        part = parts[min(index, len(parts) - 1)]  # (one result array: into every target)
        if native is not part:
            if copies is None:
                get_backend(native).copy(native, to_native(part))
            else:
                copies.append((native, to_native(part)))
    if len(dest) == 1:
        return handed[0]
    return Mirrored(handed, [str(d) for d in dest])


def _traced_pairs(pairs: Any) -> list[Any]:
    """The values of ``batch_reduce``'s pairs, for the trace (nothing for a malformed
    argument, which the call itself reports)."""
    if isinstance(pairs, (list, tuple)):
        return [pair[0] for pair in pairs if isinstance(pair, tuple) and len(pair) == 2]
    return []


def _traced_arrays(values: list[Any]) -> tuple[list[Any], int]:
    """One device's arrays of ``values`` (each a DistributedValues, an array or a
    number) as the trace counts them, and the number of devices (replicas)."""
    arrays, replicas = [], 1
    for value in values:
        try:
            if isinstance(value, DistributedValues):
                replicas = max(replicas, len(value.values))
                value = value.values[0]
            arrays.append(value if type(value) is np.ndarray
                          else np.asarray(value) if np.isscalar(value)
                          else value if is_native(value) else to_native(value, "trace"))
        except (TypeError, ValueError, IndexError):
            continue
    return arrays, replicas


# ----------------------------------------------------------------------- base class


class CrossDeviceOps(abc.ABC):
    """Base class: reduce and broadcast across devices (``tf.distribute.CrossDeviceOps``).

    Args:
        comm: the communicator whose ranks take part (default ``COMM_WORLD``).
    """

    def __init__(self, comm: Comm | None = None) -> None:
        self._comm = comm
        self._fused: dict[str, Callable[..., Any]] = {}  # small-call plans by signature

    @property
    def comm(self) -> Any:
        """The communicator (``COMM_WORLD`` unless one was given)."""
        return world() if self._comm is None else self._comm

    # -- public API

    def reduce(self, reduce_op: Any, per_replica_value: Any, destinations: Any,
               options: CommunicationOptions | None = None, *, inplace: bool = False,
               out: Any = None) -> Any:
        """Reduce ``per_replica_value`` over every replica of every rank to ``destinations``.

        Args:
            inplace: write the result into the value's components (writeable arrays of any
                library; the destinations must be the value's devices) and return them.
            out: the array to write the result into, or one per destination device (a
                list or a DistributedValues); returned in place of new arrays.

        Returns:
            A :class:`Mirrored` on the destination devices, the same on every rank; with a
            single destination device, the array itself (as TF returns the tensor).
        """
        if recorder.on:  # (off: this one branch; on: the call again, inside its span)
            if not DOORS.direct:
                return self._traced("reduce", [per_replica_value], lambda: self.reduce(
                    reduce_op, per_replica_value, destinations, options, inplace=inplace,
                    out=out))
            DOORS.direct = False
        comm = self.comm
        signature = error = small = None
        timeout = self._timeout(options)
        where = f"{type(self).__name__}.reduce"
        try:
            options = self._options(options)
            op = _reduce_op(reduce_op)
            given = _per_replica(per_replica_value)
            value, like = _native(given)
            dest = _destinations(destinations)
            match = _same_devices(value.device_set, dest, comm)
            targets = _targets(op, given, value, dest, match, inplace, out, where)
            signature = (f"{where} op={op.name} value={_describe(value)} "
                         f"match={match} options={_options_text(options)}")
            if match and targets is None and timeout is None:
                # (its agreement's signature says so: a rank that differs disagrees)
                small = self._fused_plan(comm, op, [value], signature, where)
        except (ValueError, TypeError) as exc:
            error = exc
        if small is not None:  # the agreement carries the data: one collective in all
            assert signature is not None and options is not None
            return _restored(self._run_fused(small, comm, op, [value], signature, where,
                                             options)[0], like)
        agree(comm, signature, error, where, timeout=timeout)
        assert options is not None  # agree raised unless _options returned it
        self._check_implementation(options)
        if comm.Get_size() == 1 and len(value) == 1 and match:
            # TF's shortcut: no arithmetic
            return given.values[0] if targets is None else \
                _write(value.values[0], targets, dest)
        result = single(self.reduce_implementation(op, value, dest, options))
        if targets is None:
            return _restored(result, like)
        t = recorder.begin()
        written = _write(result, targets, dest)
        if t:
            phase(t, "copy-back", {"devices": len(dest)})
        return written

    def batch_reduce(self, reduce_op: Any, value_destination_pairs: Any,
                     options: CommunicationOptions | None = None, *, inplace: bool = False,
                     out: Any = None) -> list[Any]:
        """Reduce several values at once; one batched all-reduce when every pair's
        destinations are its value's devices (and all values share devices).

        Args:
            inplace: write each pair's result into its value's components (writeable
                arrays; each pair's destinations must be its value's devices) and return
                them: a grouped in-place reduce, packed and routed as without it.
            out: one entry per pair, as :meth:`reduce`'s ``out``; returned in place of
                new arrays.

        Returns:
            One :class:`Mirrored` per pair, in the order of the pairs (the array itself
            where a pair has a single destination device).
        """
        if recorder.on:  # (off: this one branch; on: the call again, inside its span)
            if not DOORS.direct:
                return self._traced("batch_reduce", _traced_pairs(value_destination_pairs),
                                    lambda: self.batch_reduce(
                                        reduce_op, value_destination_pairs, options,
                                        inplace=inplace, out=out))
            DOORS.direct = False
        comm = self.comm
        signature = error = small = None
        timeout = self._timeout(options)
        where = f"{type(self).__name__}.batch_reduce"
        try:
            options = self._options(options)
            op = _reduce_op(reduce_op)
            pairs, likes, givens, dests = self._pairs(value_destination_pairs)
            match = self._all_match(pairs, comm, dests)
            targets = self._batch_targets(comm, op, pairs, givens, dests, inplace, out, where)
            signature = (f"{where} op={op.name} match={match} "
                         f"options={_options_text(options)} "
                         + _batch_signature([v for v, _ in pairs]))
            if pairs and match and targets is None and timeout is None:
                small = self._fused_plan(comm, op, [v for v, _ in pairs], signature, where)
        except (ValueError, TypeError) as exc:
            error = exc
        if small is not None:  # small values: reduced inside the agreement
            assert signature is not None and options is not None
            return [_restored(r, like) for r, like in zip(
                self._run_fused(small, comm, op, [v for v, _ in pairs], signature, where,
                                options), likes)]
        agree(comm, signature, error, where, timeout=timeout)
        assert options is not None  # agree raised unless _options returned it
        self._check_implementation(options)
        if comm.Get_size() == 1 and match and len(pairs[0][0]) == 1:
            if targets is None:
                return [g.values[0] for g in givens]  # TF's shortcut: no arithmetic
            reduced: list[Any] = [v.values[0] for v, _ in pairs]
        else:
            reduced = [single(r) for r in
                       self.batch_reduce_implementation(op, pairs, options, match=match)]
        if targets is None:
            return [_restored(r, like) for r, like in zip(reduced, likes)]
        start = recorder.begin()
        copies: list[tuple[Any, Any]] = []
        written = [_write(r, t, d, copies) for r, t, d in zip(reduced, targets, dests)]
        copy_all(copies)
        if start:
            phase(start, "copy-back", {"tensors": len(written)})
        return written

    def broadcast(self, tensor: Any, destinations: Any) -> Any:
        """Copy rank 0's ``tensor`` to every destination device on every rank.

        Returns:
            A :class:`Mirrored` on the destination devices; with a single destination
            device, the array itself (as in TF).
        """
        if recorder.on:  # (off: this one branch; on: the call again, inside its span)
            if not DOORS.direct:
                return self._traced("broadcast", [tensor],
                                    lambda: self.broadcast(tensor, destinations))
            DOORS.direct = False
        comm = self.comm
        signature = error = None
        try:
            dest = _destinations(destinations)
            array = np.asarray(tensor) if np.isscalar(tensor) else to_native(tensor, "broadcast")
            backend = get_backend(array)
            signature = f"broadcast {tuple(array.shape)}:{array.dtype} to {len(dest)}"
        except (ValueError, TypeError) as exc:
            error = exc
        agree(comm, signature, error, f"{type(self).__name__}.broadcast")
        t = recorder.begin()
        buf = backend.flat_copy(array)
        if comm.Get_size() > 1:
            backend.synchronize()
            comm.Bcast(backend.comm_view(buf), root=0)
        if t:
            note_algorithm("MPI_Bcast")
            phase(t, "algorithm", {"name": "MPI_Bcast", "bytes": buf.nbytes})
        result = buf.reshape(array.shape)
        like = None if is_native(tensor) else tensor
        if len(dest) == 1:
            return _restored(result, like)  # one destination: the tensor itself, as in TF
        return _restored(Mirrored([result] + [result.copy() for _ in dest[1:]],
                                  [str(d) for d in dest]), like)

    # -- tracing

    def _traced(self, method: str, values: list[Any], call: Callable[[], Any]) -> Any:
        """``call()`` (the public ``method`` again, going straight in) recorded as one span
        ``<class>.<method>`` with its collective's args: Kineto's ``allreduce`` (or
        ``reduce`` where the values went to one device first), ``allreduce_coalesced``
        for a batch, ``broadcast``; ``values``: the values as given (their first
        component counts: one device's message)."""
        comm = self.comm
        start = open_door(comm)
        DOORS.direct = True
        try:
            return call()
        finally:
            DOORS.direct = False
            arrays, replicas = _traced_arrays(values)
            nelems = nbytes = 0
            for a in arrays:
                nelems += int(a.size)
                nbytes += int(a.nbytes)
            collective = "broadcast" if method == "broadcast" else \
                "reduce" if DOORS.algorithm == "reduce_to_one_device" else \
                "allreduce_coalesced" if method == "batch_reduce" else "allreduce"
            close_door(start, f"{type(self).__name__}.{method}", collective,
                       comm.Get_size(), dtype_of(arrays), nelems, nelems, nbytes,
                       extra={"replicas": replicas, "tensors": len(arrays)})

    # -- hooks for subclasses

    def _fused_entry(self, nbytes: int) -> AllReduceSpecTuple | None:
        """The spec entry a small all-reduce of ``nbytes`` would take (checked against
        the job's layout), for ops that reduce small host values inside their agreement
        (:mod:`mpistrat.fused`); None (the default): this op runs its own algorithm."""
        return None

    def _check_layout(self, comm: Comm, replicas: int) -> None:
        """Raise (after the agreement, on every rank) when this op cannot serve a value
        of ``replicas`` components per rank on ``comm``."""

    def _fused_plan(self, comm: Comm, op: ReduceOp, values: Sequence[DistributedValues],
                    signature: str, where: str) -> Callable[..., Any] | None:
        """The plan of an all-reduce of ``values`` inside its agreement (see
        :mod:`mpistrat.fused`), or None where it does not apply: several components,
        device or non-numeric arrays, more than ``FUSED_BYTES`` in all, one rank or more
        than ``FUSED_RANKS``, or an op that runs its own algorithm. Kept per signature."""
        size = comm.Get_size()
        if not 1 < size <= FUSED_RANKS:
            return None
        arrays = []
        for value in values:
            components = value.values
            array = components[0]
            if len(components) != 1 or type(array) is not np.ndarray \
                    or array.dtype.kind not in "fiuc":
                return None
            arrays.append(array)
        plans = self._fused
        found = plans.get(signature)
        if found is not None:
            return found
        parts = [(a.shape, a.dtype) for a in arrays]
        if fused.layout(parts)[1] > FUSED_BYTES:
            return None
        found_entries = [self._fused_entry(a.nbytes) for a in arrays]
        entries = [e for e in found_entries if e is not None]
        if len(entries) != len(arrays):
            return None
        if len(plans) >= 256:
            plans.clear()
        found = plans[signature] = fused.plan_batch(
            comm, parts, op, entries, f"{signature} via=exchange", where, "the same call")
        return found

    def _run_fused(self, small: Callable[..., Any], comm: Comm, op: ReduceOp,
                   values: Sequence[DistributedValues], signature: str, where: str,
                   options: CommunicationOptions) -> list[Any]:
        """Run a plan of :meth:`_fused_plan` on ``values``' arrays (agreement and data in
        one collective); the reduced arrays."""
        arrays = [value.values[0] for value in values]
        results = small(arrays)
        if results is None:  # the node grouping changed since the plan was made
            self._fused.clear()
            again = self._fused_plan(comm, op, values, signature, where)
            assert again is not None
            results = again(arrays)
            assert results is not None
        self._check_implementation(options)
        self._check_layout(comm, 1)
        return results

    @abc.abstractmethod
    def reduce_implementation(self, op: ReduceOp, value: DistributedValues,
                              dest: tuple[Device, ...], options: CommunicationOptions) -> Mirrored:
        """Reduce one validated, agreed value to ``dest`` (every concrete op defines it)."""

    def batch_reduce_implementation(self, op: ReduceOp, pairs: list[tuple[DistributedValues, Any]],
                                    options: CommunicationOptions,
                                    match: bool | None = None) -> list[Mirrored]:
        """Reduce validated, agreed pairs; ``match`` is whether every pair's destinations
        are its value's devices (computed by ``batch_reduce`` already)."""
        return [self.reduce_implementation(op, value, _destinations(dest), options)
                for value, dest in pairs]

    # -- helpers

    @staticmethod
    def _check_implementation(options: CommunicationOptions) -> None:
        """NCCL asked for on host values is an error (on every rank: the options were
        agreed); RING and AUTO let the op use its own host algorithms."""
        if options.implementation is CommunicationImplementation.NCCL:
            raise BackendUnavailable(
                "CommunicationOptions(implementation=NCCL) needs GPU values (CuPy arrays "
                "on CUDA devices) and NCCL; these values are host (NumPy) arrays: use "
                "RING or AUTO"
            )

    @staticmethod
    def _timeout(options: Any) -> float | None:
        """The agreement's timeout, known even when other arguments are bad (so a rank
        with a bad argument still takes part in the timed agreement)."""
        return options.timeout_seconds if isinstance(options, CommunicationOptions) else None

    @staticmethod
    def _options(options: Any) -> CommunicationOptions:
        if options is None:
            return _DEFAULT_OPTIONS
        if not isinstance(options, CommunicationOptions):
            raise TypeError(f"options must be a CommunicationOptions, got {options!r}")
        return options

    @staticmethod
    def _batch_targets(comm: Comm, op: ReduceOp, pairs: list[tuple[DistributedValues, Any]],
                       givens: list[DistributedValues], dests: list[tuple[Device, ...]],
                       inplace: bool, out: Any, where: str) -> list[Any] | None:
        """Per pair, the arrays its result is written into (see :func:`_targets`)."""
        if not inplace and out is None:
            return None
        if out is not None and (not isinstance(out, (list, tuple)) or len(out) != len(pairs)):
            raise ValueError(
                f"{where}: out must be a list with one entry per pair ({len(pairs)}), got "
                f"{type(out).__name__}" + (f" of {len(out)}" if isinstance(out, (list, tuple))
                                           else "")
            )
        targets = []
        for index, ((value, _), given, dest_devices) in enumerate(zip(pairs, givens, dests)):
            targets.append(_targets(
                op, given, value, dest_devices,
                _same_devices(value.device_set, dest_devices, comm),
                inplace, None if out is None else out[index], f"{where} pair {index}"))
        return targets

    @staticmethod
    def _pairs(value_destination_pairs: Any,
               ) -> tuple[list[tuple[DistributedValues, Any]], list[Any],
                          list[DistributedValues], list[tuple[Device, ...]]]:
        """The pairs with their values as NumPy/CuPy arrays (:func:`_native`), per pair
        the component whose type its result takes (None: nothing to convert), the values
        as given (as DistributedValues), and each pair's destination devices."""
        if isinstance(value_destination_pairs, Iterator):
            value_destination_pairs = list(value_destination_pairs)  # a generator, as TF 2.21
        if not isinstance(value_destination_pairs, (list, tuple)):
            raise ValueError(
                f"`value_destination_pairs` should be a list or tuple, got "
                f"{type(value_destination_pairs).__name__}"
            )
        if not value_destination_pairs:
            raise ValueError("`value_destination_pairs` is empty: give at least one "
                             "(value, destinations) pair")
        pairs, likes, givens, dests = [], [], [], []
        for index, pair in enumerate(value_destination_pairs):
            if not isinstance(pair, tuple):
                raise ValueError(f"Each element of `value_destination_pairs` should be a "
                                 f"tuple; element {index} is a {type(pair).__name__}")
            if len(pair) != 2:
                raise ValueError(f"Each element of `value_destination_pairs` should be a "
                                 f"tuple of size 2; element {index} has {len(pair)}")
            value, dest = pair
            if not isinstance(value, DistributedValues):
                value = _per_replica(value)
            dests.append(_dest_set(value, dest))
            native, like = _native(value)
            pairs.append((native, native if dest is value else dest))
            likes.append(like)
            givens.append(value)
        return pairs, likes, givens, dests

    @staticmethod
    def _all_match(pairs: list[tuple[DistributedValues, Any]], comm: Comm,
                   dests: list[tuple[Device, ...]] | None = None) -> bool:
        """Are all pairs' destinations their values' devices, one device set for all?
        (``dests``: the pairs' destination devices, when the caller has them.)"""
        if dests is None:
            dests = [_dest_set(value, dest) for value, dest in pairs]
        first = pairs[0][0].device_set
        # the common case, checked in one pass: every value and destination on one
        # (interned) device set
        if all(value.device_set is first and dest is first
               for (value, _), dest in zip(pairs, dests)):
            return _same_devices(first, first, comm)
        return all(
            _same_devices(value.device_set, dest, comm)
            and _same_devices(value.device_set, first, comm)
            for (value, _), dest in zip(pairs, dests)
        )


# ------------------------------------------------------------- reduction to one device


def _add_n(arrays: list[Any]) -> Any:
    backend = get_backend(arrays[0])
    total = backend.flat_copy(arrays[0])
    for array in arrays[1:]:
        view = backend.flat_view(array)
        backend.combine(ReduceOp.SUM, total, view if view is not None else backend.flat_copy(array))
    return total.reshape(np.shape(arrays[0]))


_HOST = host_backend()


def _gather_rows(comm: Comm, parts: Sequence[Any], root: int) -> Any:
    """Every rank's components gathered on ``root`` as rows (global replica order,
    rank-major), a host array of shape ``(size * G, elements)``; None on the other ranks.
    (Device components are read to the host: this reduction runs on the host.)"""
    local = np.concatenate([np.reshape(to_host(p), -1) for p in parts])
    rows = None
    if comm.Get_rank() == root:
        rows = np.empty((comm.Get_size() * len(parts), local.size // len(parts)),
                        dtype=local.dtype)
    comm.Gather(_HOST.comm_view(local),
                _HOST.comm_view(rows.reshape(-1)) if rows is not None else None, root=root)
    return rows


class ReductionToOneDevice(CrossDeviceOps):
    """Sum every replica's value on one device, then broadcast the result.

    The reduce device is ``reduce_to_device`` or the first destination device; a device
    without a task is rank 0's. Its rank receives every component (in global replica
    order, rank-major), applies ``accumulation_fn`` (default: add them in order), divides
    by the number of components for MEAN, and broadcasts. The sums run in host memory;
    device components (GPU replicas) get their result back on their own devices.

    Args:
        reduce_to_device: the device to reduce on (default: the first destination).
        accumulation_fn: ``f(list_of_arrays) -> array`` (default: an ordered sum).
        comm: the communicator (default ``COMM_WORLD``).
    """

    def __init__(self, reduce_to_device: str | None = None,
                 accumulation_fn: Callable[[list[Any]], Any] | None = None,
                 comm: Comm | None = None) -> None:
        super().__init__(comm)
        self.reduce_to_device = None if reduce_to_device is None else \
            str(parse_device(reduce_to_device))
        self.accumulation_fn = accumulation_fn or _add_n

    def reduce_implementation(self, op, value, dest, options):
        t = recorder.begin()
        comm = self.comm
        device = parse_device(self.reduce_to_device) if self.reduce_to_device else dest[0]
        root = device.task if device.task is not None else 0
        if root >= comm.Get_size():
            raise TopologyError(
                f"reduce device {device} names task {root}, but the communicator has "
                f"{comm.Get_size()} ranks (tasks 0..{comm.Get_size() - 1})"
            )
        arrays = _as_arrays(value)
        shape, dtype = tuple(arrays[0].shape), arrays[0].dtype
        rows = _gather_rows(comm, arrays, root)
        is_root = rows is not None
        failure = None
        if is_root:
            try:
                total = to_host(self.accumulation_fn([row.reshape(shape) for row in rows]))
                if total.shape != shape:
                    raise ValueError(f"accumulation_fn returned shape {total.shape}, "
                                     f"expected {shape}")
                total = _HOST.flat_copy(total.astype(dtype, copy=False))
                if op is ReduceOp.MEAN:
                    total = _HOST.divide(total, len(rows))
            except Exception as exc:  # reported on every rank below
                failure = exc
        # every rank learns whether the reduce device succeeded (no rank left waiting)
        status = comm.bcast(None if failure is None else f"{type(failure).__name__}: "
                            f"{failure}", root=root)
        if failure is not None:
            raise failure
        if status is not None:
            raise ValueError(f"the reduction on rank {root} ({device}) failed: {status}")
        result = total if is_root else np.empty(arrays[0].size, dtype=op.result_dtype(dtype))
        comm.Bcast(_HOST.comm_view(result), root=root)
        result = result.reshape(shape)
        if t:
            note_algorithm("reduce_to_one_device")
            phase(t, "algorithm", {"name": "reduce_to_one_device", "root": root,
                                   "bytes": result.nbytes})
        if isinstance(arrays[0], np.ndarray):
            copies = [result] + [result.copy() for _ in dest[1:]]
        else:  # device components: each destination's copy on the matching local device
            backends = [get_backend(a) for a in arrays]
            copies = [backends[min(i, len(backends) - 1)].clone(result)
                      for i in range(len(dest))]
        return Mirrored(copies, [str(d) for d in dest])


# --------------------------------------------------------------- batched all-reduce


def _all_reduce_batch(comm: Comm, op: ReduceOp, values: list[DistributedValues],
                      groups: Sequence[tuple[Sequence[int], PackPlan, engine.Reducer]],
                      ) -> list[Mirrored]:
    """All-reduce a batch of distributed values through :func:`mpistrat.engine.
    reduce_batch`; results in input order, on the values' devices."""
    devices = values[0].device_set
    return [Mirrored._trusted(parts, devices) for parts in
            engine.reduce_batch(comm, op, [_as_arrays(v) for v in values], groups)]


def _check_num_packs(num_packs: Any, message: str) -> int:
    if isinstance(num_packs, bool) or not isinstance(num_packs, int):
        raise TypeError(f"num_packs must be an int, got {num_packs!r}")
    if num_packs < 0:
        raise ValueError(message.format(num_packs))
    return num_packs


class _AllReduceBase(CrossDeviceOps):
    """All-reduce when destinations are the values' devices, else reduce to one device."""

    def reduce_implementation(self, op, value, dest, options):
        if _same_devices(value.device_set, dest, self.comm):
            return self._batch(op, [value], options)[0]
        return ReductionToOneDevice(comm=self._comm).reduce_implementation(op, value, dest,
                                                                           options)

    def batch_reduce_implementation(self, op, pairs, options, match=None):
        if match if match is not None else self._all_match(pairs, self.comm):
            return self._batch(op, [value for value, _ in pairs], options)
        return super().batch_reduce_implementation(op, pairs, options)

    @abc.abstractmethod
    def _batch(self, op: ReduceOp, values: list[DistributedValues],
               options: CommunicationOptions) -> list[Mirrored]:
        """All-reduce values whose destinations are their own devices, in input order."""


# ------------------------------------------------------- AllReduceCrossDeviceOps family


def _require_gpus(what: str) -> None:
    probe = probe_gpus()
    if not probe.usable or probe.nccl is None:
        raise BackendUnavailable(
            f"{what} needs CuPy with NCCL and CUDA GPUs, and this host has none usable "
            f"({probe.reason or 'NCCL missing'}); on CPU replicas use "
            f"MultiWorkerAllReduce(all_reduce_spec='xring') or ReductionToOneDevice()"
        )


class AllReduceCrossDeviceOps(_AllReduceBase):
    """TF's single-spec all-reduce op: ``"nccl"`` or ``"hierarchical_copy"`` over every
    replica of every rank, the whole batch packed into ``num_packs`` packs.

    Args:
        all_reduce_alg: ``"nccl"`` (needs CuPy, NCCL and GPUs) or ``"hierarchical_copy"``.
        num_packs: > 0 concatenates the batch (per dtype) into this many packs; 0 or
            less: each tensor on its own (TF's meaning of a negative value here).
        comm: the communicator (default ``COMM_WORLD``).
    """

    def __init__(self, all_reduce_alg: str = "nccl", num_packs: int = 1, comm: Comm | None = None):
        super().__init__(comm)
        if all_reduce_alg not in ("nccl", "hierarchical_copy"):
            raise ValueError(f"all_reduce_alg must be 'nccl' or 'hierarchical_copy', got "
                             f"{all_reduce_alg!r}")
        if all_reduce_alg == "nccl":
            _require_gpus("AllReduceCrossDeviceOps('nccl')")
        self.all_reduce_alg = all_reduce_alg
        self.num_packs = num_packs

    def _batch(self, op, values, options):
        num_packs = self.num_packs if self.num_packs > 0 else 0
        plan = engine.cached_plan(engine.structure([_first_array(v) for v in values]),
                                  options.bytes_per_pack, num_packs, 0, 0)
        return _all_reduce_batch(self.comm, op, values,
                                 [(list(range(len(values))), plan, self._reducer(op, values))])

    def _reducer(self, op: ReduceOp, values: list[DistributedValues]) -> engine.Reducer:
        if self.all_reduce_alg == "nccl":
            return engine.algorithm_reducer(self.comm, op, "nccl", 1)
        return _hierarchical_copy_reducer(self.comm, op, len(values[0]))


class NcclAllReduce(AllReduceCrossDeviceOps):
    """NCCL all-reduce over every GPU of every rank (needs CuPy, NCCL and GPUs).

    Raises:
        ValueError: ``num_packs < 0`` (TF's wording).
        BackendUnavailable: no usable GPU/NCCL on this host.
    """

    def __init__(self, num_packs: int = 1, comm: Comm | None = None) -> None:
        _check_num_packs(num_packs, "NCCL all-reduce requires num_packs >= 0, but {} is "
                                    "specified")
        super().__init__("nccl", num_packs, comm)


class HierarchicalCopyAllReduce(AllReduceCrossDeviceOps):
    """TF's DGX-1 "hierarchical copy": the devices split into two halves, each half summed
    on its root, the two sums added, the total copied back; roots rotate over the
    packed tensors. Over MPI the sums run on the rank owning the first root, then the
    total is broadcast (TF's summation order and root rotation are kept).

    Requires an even number of devices in total (two equal halves); an odd count raises
    :class:`~mpistrat.errors.TopologyError`, where TF 2.21 falls back to another reduction.

    Raises:
        ValueError: ``num_packs < 0`` (TF's wording).
    """

    def __init__(self, num_packs: int = 1, comm: Comm | None = None) -> None:
        _check_num_packs(num_packs, "HierarchicalCopy requires num_packs >= 0, but {} is "
                                    "specified")
        super().__init__("hierarchical_copy", num_packs, comm)


def _hierarchical_copy_reducer(comm: Comm, op: ReduceOp, replicas: int) -> engine.Reducer:
    size = comm.Get_size()
    devices = size * replicas
    if devices % 2:
        raise TopologyError(
            f"hierarchical copy needs an even number of devices, got {devices} ({size} "
            f"rank(s) x {replicas} device(s)), for its two equal halves; use "
            f"MultiWorkerAllReduce or ReductionToOneDevice, or an even device count"
        )
    half = devices // 2

    def reduce(sources: list[Any], index: int) -> Any:
        # the sums run in host memory (rows come gathered there); device buffers get the
        # total back on their device
        t = recorder.begin()
        backend = get_backend(sources[0].segments[0])
        parts = [s.segments[0] if s.contiguous else engine.local_sum(op, [s], backend)
                 for s in sources]
        root0 = index % devices
        owner = root0 // replicas
        rows = _gather_rows(comm, parts, owner)
        if rows is not None:
            first, second = (range(0, half), range(half, devices)) if root0 < half else \
                (range(half, devices), range(0, half))
            total = rows[first[0]].copy()
            for d in first[1:]:
                _HOST.combine(op, total, rows[d])
            other = rows[second[0]].copy()
            for d in second[1:]:
                _HOST.combine(op, other, rows[d])
            _HOST.combine(op, total, other)
        else:
            total = np.empty(parts[0].size, dtype=parts[0].dtype)
        comm.Bcast(_HOST.comm_view(total), root=owner)
        if t:
            note_algorithm("hierarchical_copy")
            phase(t, "algorithm", {"name": "hierarchical_copy", "root": owner,
                                   "bytes": total.nbytes})
        return total if isinstance(parts[0], np.ndarray) else backend.asarray(total)

    reduce.alg = "hierarchical_copy"  # type: ignore[attr-defined]  # (the trace's name)
    return reduce


# ------------------------------------------------------------- MultiWorkerAllReduce


class MultiWorkerAllReduce(_AllReduceBase):
    """TF's ``MultiWorkerAllReduce``: each tensor goes, by its byte size, to the first
    entry of ``all_reduce_spec`` whose limit holds it; each entry packs its tensors and
    all-reduces them with its algorithm across every rank of ``comm``.

    Args:
        worker_devices: one name per worker (``"/job:worker/task:0"`` …); default: every
            rank of ``comm``. Its length must equal the communicator's size.
        num_gpus_per_worker: GPUs per worker; 0 means CPU replicas (as many as each
            value has components).
        all_reduce_spec: any spec form (limits in bytes).
        num_packs: > 0 concatenates each entry's tensors (per dtype) into this many packs.
        agg_small_grads_max_bytes, agg_small_grads_max_group: with ``num_packs == 0``,
            both > 0 pack runs of consecutive small floating tensors (≤ max_bytes each)
            into groups of at most max_group (the documented limit, not TF's max_group+2).
        comm: the communicator (default ``COMM_WORLD``).

    Raises:
        SpecError: an invalid spec (eagerly, at construction).
        ValueError: negative packing options.
    """

    def __init__(self, worker_devices: Sequence[str] | None = None, num_gpus_per_worker: int = 0,
                 all_reduce_spec: Any = ("pscpu/pscpu", 2, -1), num_packs: int = 0,
                 agg_small_grads_max_bytes: int = 0, agg_small_grads_max_group: int = 10,
                 comm: Comm | None = None) -> None:
        super().__init__(comm)
        self.spec: AllReduceSpec = parse_spec(all_reduce_spec)
        for name, value in (("num_gpus_per_worker", num_gpus_per_worker),
                            ("num_packs", num_packs),
                            ("agg_small_grads_max_bytes", agg_small_grads_max_bytes),
                            ("agg_small_grads_max_group", agg_small_grads_max_group)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        self.worker_devices = None if worker_devices is None else tuple(worker_devices)
        self.num_gpus_per_worker = num_gpus_per_worker
        self.num_packs = num_packs
        self.agg_small_grads_max_bytes = agg_small_grads_max_bytes
        self.agg_small_grads_max_group = agg_small_grads_max_group

    def _fused_entry(self, nbytes):
        return None if self.num_gpus_per_worker else self.spec.route(nbytes)

    def _check_layout(self, comm, replicas):
        size = comm.Get_size()
        if self.worker_devices is not None and len(self.worker_devices) != size:
            raise TopologyError(
                f"MultiWorkerAllReduce got {len(self.worker_devices)} worker_devices but the "
                f"communicator has {size} ranks; give one per rank or leave it out"
            )
        if self.num_gpus_per_worker and replicas != self.num_gpus_per_worker:
            raise TopologyError(
                f"num_gpus_per_worker={self.num_gpus_per_worker} but the values have "
                f"{replicas} component(s) per rank"
            )

    def _batch(self, op, values, options):
        comm = self.comm
        replicas = len(values[0])
        self._check_layout(comm, replicas)
        groups = engine.fitted_groups(
            comm, op, [_first_array(v) for v in values], self.spec, self.num_packs,
            self.agg_small_grads_max_bytes, self.agg_small_grads_max_group,
            options.bytes_per_pack, devices_per_worker=replicas,
            gpus=self.num_gpus_per_worker > 0
            or not isinstance(_first_array(values[0]), np.ndarray))
        return _all_reduce_batch(comm, op, values, groups)


