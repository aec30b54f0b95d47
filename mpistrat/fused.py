"""Small reductions that travel inside their agreement.

Up to :data:`~mpistrat.runtime.agreement.FUSED_RANKS` ranks, a checked collective starts
with the communicator's :class:`~mpistrat.runtime.agreement.Exchange`: one allgather of
fixed-size blocks, each a header with the hash of the rank's call and a payload area. A
reduction of host arrays of at most :data:`~mpistrat.runtime.agreement.FUSED_BYTES` in
all puts their data in the payload: after the allgather every rank has agreed on the
call and holds every rank's arrays, and reduces them itself in rank order
(``((x0 + x1) + x2) + ...``), so one collective does the whole call and the results are
the same bits on every rank. The spec's algorithm does not run (its entries are still
checked against the job's layout, so a spec that cannot run fails here too).

:func:`plan` builds such a call for one array, :func:`plan_batch` for several (laid out
by :func:`layout`), once per shapes, dtypes and signature; ``mpistrat.all_reduce`` and
``MultiWorkerAllReduce.reduce`` / ``batch_reduce`` keep the plans.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from time import monotonic_ns
from typing import Any, NoReturn

import numpy as np

from . import algorithms, dispatch
from .backends.numpy_backend import UFUNCS
from .config import RANKS_PER_NODE
from .ops import ReduceOp
from .runtime import recorder
from .runtime._mpi import Comm
from .runtime.agreement import exchange, note_algorithm, phase, signature_code, traced_agreement
from .spec import AllReduceSpecTuple

__all__ = ["plan", "plan_batch", "layout", "grouping_env", "ALIGN"]


ALIGN = 16
"""The parts of a batch start at multiples of this many bytes into the payload."""


def layout(parts: Sequence[tuple[tuple, Any]]) -> tuple[list[int], int]:
    """The payload offsets of ``parts`` (``(shape, dtype)`` each) laid out in order, each
    aligned to :data:`ALIGN`, and the bytes they take in all."""
    offsets, end = [], 0
    for shape, dtype in parts:
        start = -(-end // ALIGN) * ALIGN
        offsets.append(start)
        end = start + int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    return offsets, end


def plan(comm: Comm, shape: tuple, dtype: Any, op: ReduceOp, inplace: bool,
         entry: AllReduceSpecTuple, ranks_per_node: int | None, signature: str,
         what: str, hint: str, check: bool = True) -> Callable[..., Any]:
    """The plan of a small call of one array: ``plan(array, into=None)`` reduces
    ``array`` (of ``shape`` and ``dtype``, any layout) across the ranks of ``comm``,
    into ``into``, into ``array`` itself (``inplace``) or into a new array, and returns
    the result — or None, without communicating, when the plan no longer applies (the
    node grouping it agreed on has changed). MEAN divides by the number of ranks
    (integers give float64).

    Checked, ``signature`` (this call's description, which every rank must share) is
    agreed on in the exchange, and a mismatch raises on every rank (``what``, ``hint``:
    for the message). The data rides in the exchange's blocks when they have room for it;
    when not (the first small call of this size on the communicator), the agreement goes
    first and the data follows in a second allgather, after which the blocks have room.
    Unchecked, one allgather of the data alone."""
    carrier = _Carrier(comm, [(shape, dtype)], [entry], ranks_per_node, signature, what,
                       hint, check)
    reduce = _reducer(shape, np.dtype(dtype), op, carrier.size, inplace)
    send = carrier.sends[0]
    ex, code, expected, size = carrier.ex, carrier.code, carrier.expected, carrier.size
    gather, code_word, words = ex.gather, ex.code, ex.words
    grouping, agreed_env = carrier.grouping, carrier.agreed_env

    def run(array: Any, into: Any = None) -> Any:
        if grouping and grouping_env() != agreed_env:
            return None
        send[...] = array
        if not check:
            carrier.unchecked()
        elif carrier.block == ex.block:  # steady: the exchange is the whole call
            code_word[0] = code
            if recorder.on:
                carrier.traced_gather()
            else:
                gather(comm, what)
            if (words[0] != code or words[carrier.block >> 3] != code) if size == 2 \
                    else ex.codes.tobytes() != expected:
                carrier.disagree()
        else:
            carrier.unsteady()
        return reduce(carrier.rows[0], array, into)

    return run


def plan_batch(comm: Comm, parts: Sequence[tuple[tuple, Any]], op: ReduceOp,
               entries: Sequence[AllReduceSpecTuple], signature: str, what: str,
               hint: str) -> Callable[..., Any]:
    """:func:`plan` for several arrays at once, checked, into new arrays (``parts``:
    their ``(shape, dtype)``, laid out by :func:`layout` in at most ``FUSED_BYTES``;
    ``entries``: the spec entries they are checked against): ``run(arrays)`` returns the
    list of results, or None as :func:`plan`'s does. One collective carries the
    agreement and every array."""
    carrier = _Carrier(comm, parts, entries, None, signature, what, hint, True)
    reducers = [_reducer(shape, np.dtype(dtype), op, carrier.size, False)
                for shape, dtype in parts]
    sends = carrier.sends
    ex, code, expected = carrier.ex, carrier.code, carrier.expected

    def run(arrays: Sequence[Any]) -> list[Any] | None:
        if carrier.grouping and grouping_env() != carrier.agreed_env:
            return None
        for send, array in zip(sends, arrays):
            send[...] = array
        if carrier.block == ex.block:  # steady: the exchange is the whole call
            if ex.run(comm, code, what, True) != expected:
                carrier.disagree()
        else:
            carrier.unsteady()
        return [reduce(rows, array, None)
                for reduce, rows, array in zip(reducers, carrier.rows, arrays)]

    return run


class _Carrier:
    """A plan's side of the exchange: the payload views, the agreed code, the spec
    entries to fit, and the rows to reduce once the call is steady."""

    __slots__ = ("comm", "ex", "size", "parts", "offsets", "nbytes", "sends", "packed",
                 "entries", "ranks_per_node", "grouping", "agreed_env", "signature", "what",
                 "hint", "code", "expected", "block", "rows")

    def __init__(self, comm: Comm, parts: Sequence[tuple[tuple, Any]],
                 entries: Sequence[AllReduceSpecTuple], ranks_per_node: int | None,
                 signature: str, what: str, hint: str, check: bool) -> None:
        ex = exchange(comm)
        assert ex is not None  # (small calls run on up to FUSED_RANKS ranks)
        self.comm, self.ex, self.size = comm, ex, comm.Get_size()
        self.parts = [(shape, np.dtype(dtype)) for shape, dtype in parts]
        self.offsets, self.nbytes = layout(self.parts)
        self.sends = [ex.payload(shape, dtype, offset)
                      for (shape, dtype), offset in zip(self.parts, self.offsets)]
        self.packed = ex.packed(self.nbytes)
        self.entries, self.ranks_per_node = list(dict.fromkeys(entries)), ranks_per_node
        # the node grouping is part of what hierarchical calls agree on, and shared-memory
        # entries fit only one node: a change of MPISTRAT_RANKS_PER_NODE retires the plan
        infos = [algorithms.get(entry.alg) for entry in self.entries]
        self.grouping = any(info.hierarchical or info.single_node for info in infos)
        self.agreed_env = grouping_env() if self.grouping else None
        self.signature = signature if check else ""
        self.what, self.hint = what, hint
        self.code = signature_code(signature) if check else 0
        self.expected = ex.expected(self.code)
        # the block size the rows were read for (0: packed, -1: not yet steady); steady:
        # the entries have been fitted, the data fits the blocks, the rows are views of
        # the blocks as they are. Per part: (rank 0's row, rank 1's or None, the others').
        self.block = -1
        self.rows: list[tuple] = []

    def _read(self, block: int) -> None:
        size, ex = self.size, self.ex
        rows = [ex.rows(shape, dtype, block <= 0, offset, self.nbytes)
                for (shape, dtype), offset in zip(self.parts, self.offsets)]
        self.rows = [(r[0], r[1] if size > 1 else None, tuple(r[2:])) for r in rows]
        self.block = block

    def _fit(self) -> None:  # after the agreement: every rank checks the same entries
        for entry in self.entries:
            dispatch.fit(entry.alg, self.comm, entry.shards, ranks_per_node=self.ranks_per_node)

    def unsteady(self) -> None:
        """A checked call that is not steady yet: exchange (then the data alone if the
        blocks have no room), grow the blocks, fit the entries, read the rows."""
        ex = self.ex
        fits = self.nbytes <= ex.capacity
        if ex.run(self.comm, self.code, self.what, fits) != self.expected:
            self.disagree()
        if not fits:
            self._gather_data()
            ex.grow(self.nbytes)  # (every rank agreed on this call: they all grow alike)
        self._fit()
        self._read(ex.block if fits else -1)

    def unchecked(self) -> None:
        """An unchecked call: one allgather of the data alone."""
        t = monotonic_ns() if recorder.on else 0
        self.comm.Allgather(*self.packed)
        if t:
            self._traced_data(t)
        if self.block:
            self._fit()
            self._read(0)

    def _gather_data(self) -> None:
        """Every rank's data, packed, in one allgather (no agreement in it)."""
        t = monotonic_ns() if recorder.on else 0
        self.comm.Allgather(*self.packed)
        if t:
            self._traced_data(t)

    def _traced_data(self, start: int) -> None:
        note_algorithm("allgather")
        phase(start, "algorithm", {"name": "allgather", "bytes": self.nbytes})

    def traced_gather(self) -> None:
        """A steady call's exchange (the agreement and the data), recorded."""
        t = recorder.begin()
        self.ex.gather(self.comm, self.what)
        traced_agreement(t, self.comm, True)

    def disagree(self) -> NoReturn:
        self.ex.disagree(self.comm, self.signature, None, self.what, self.hint)


def _reducer(shape: tuple, dtype: np.dtype, op: ReduceOp, size: int,
             inplace: bool) -> Callable[..., Any]:
    """``reduce(rows, array, into)``: the ranks' rows (rank 0's, rank 1's or None, the
    others') combined in rank order into ``into``, into ``array`` (``inplace``) or into a
    new array; MEAN divided by ``size`` (integers: a float64 result)."""
    combine = UFUNCS[op.primitive]
    divisor = size if op is ReduceOp.MEAN else 0
    integer_mean = bool(divisor) and dtype.kind in "iu"
    scale = None if not divisor or integer_mean else dtype.type(divisor)
    # a new result straight from the ufunc (for shape (), a ufunc would give a scalar)
    plain = not divisor and size > 1 and shape != ()

    def reduce(rows: tuple, array: Any, into: Any) -> Any:
        r0, r1, others = rows
        if inplace:
            into = array
        elif into is None and plain:
            into = combine(r0, r1)
            for row in others:
                combine(into, row, out=into)
            return into
        if into is None:
            into = np.empty(shape, np.float64 if integer_mean else dtype)
        if integer_mean:
            total = r0.copy()
            if r1 is not None:
                combine(total, r1, out=total)
            for row in others:
                combine(total, row, out=total)
            np.true_divide(total, divisor, out=into)
            return into
        if r1 is None:  # one rank
            into[...] = r0
        else:
            combine(r0, r1, out=into)
        for row in others:
            combine(into, row, out=into)
        if scale is not None:
            np.true_divide(into, scale, out=into)
        return into

    return reduce


_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_KEY: Any = RANKS_PER_NODE
if _ENV_DATA is not None:
    try:
        _ENV_KEY = os.environ.encodekey(RANKS_PER_NODE)  # type: ignore[attr-defined]
    except AttributeError:
        _ENV_DATA = None


def grouping_env() -> Any:
    """``MPISTRAT_RANKS_PER_NODE`` as the environment holds it (compared, not parsed): read
    from ``os.environ``'s own store where CPython has one (``os.environ.get`` and the
    parse cost 1.5 µs per call, as much as the rest of a small call)."""
    if _ENV_DATA is not None:
        return _ENV_DATA.get(_ENV_KEY)
    return os.environ.get(RANKS_PER_NODE)
