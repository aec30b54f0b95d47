"""Small reductions that travel inside their agreement.

Up to :data:`~mpistrat.runtime.agreement.FUSED_RANKS` ranks, a checked collective starts
with the communicator's :class:`~mpistrat.runtime.agreement.Exchange`: one allgather of
fixed-size blocks, each a header with the hash of the rank's call and a payload area. A
reduction of one host array of at most :data:`~mpistrat.runtime.agreement.FUSED_BYTES`
puts its data in the payload: after the allgather every rank has agreed on the call and
holds every rank's array, and reduces them itself in rank order
(``((x0 + x1) + x2) + ...``), so one collective does the whole call and the result is
the same bits on every rank. The spec's algorithm does not run (its entry is still
checked against the job's layout, so a spec that cannot run fails here too).

:func:`plan` builds such a call once per shape, dtype and signature;
``mpistrat.all_reduce`` and ``MultiWorkerAllReduce.reduce`` keep the plans.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from . import algorithms, dispatch
from .backends.numpy_backend import UFUNCS
from .config import RANKS_PER_NODE
from .ops import ReduceOp
from .runtime._mpi import Comm
from .runtime.agreement import exchange, signature_code
from .spec import AllReduceSpecTuple

__all__ = ["plan", "grouping_env"]


def plan(comm: Comm, shape: tuple, dtype: Any, op: ReduceOp, inplace: bool,
         entry: AllReduceSpecTuple, ranks_per_node: int | None, signature: str,
         what: str, hint: str, check: bool = True) -> Callable[..., Any]:
    """The plan of a small call: ``plan(array, into=None)`` reduces ``array`` (of
    ``shape`` and ``dtype``, any layout) across the ranks of ``comm``, into ``into``,
    into ``array`` itself (``inplace``) or into a new array, and returns the result — or
    None, without communicating, when the plan no longer applies (the node grouping it
    agreed on has changed). MEAN divides by the number of ranks (integers give float64).

    Checked, ``signature`` (this call's description, which every rank must share) is
    agreed on in the exchange, and a mismatch raises on every rank (``what``, ``hint``:
    for the message). The data rides in the exchange's blocks when they have room for it;
    when not (the first small call of this size on the communicator), the agreement goes
    first and the data follows in a second allgather, after which the blocks have room.
    Unchecked, one allgather of the data alone."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    size = comm.Get_size()
    ex = exchange(comm)
    assert ex is not None  # (small calls run on up to FUSED_RANKS ranks)
    send = ex.payload(shape, dtype)
    packed = ex.packed(nbytes)
    combine = UFUNCS[op.primitive]
    divisor = size if op is ReduceOp.MEAN else 0
    integer_mean = bool(divisor) and dtype.kind in "iu"
    scale = None if not divisor or integer_mean else dtype.type(divisor)
    # a new result straight from the ufunc (for shape (), a ufunc would give a scalar)
    plain = not divisor and size > 1 and shape != ()
    info = algorithms.get(entry.alg)
    # the node grouping is part of what hierarchical calls agree on, and shared-memory
    # entries fit only one node: a change of MPISTRAT_RANKS_PER_NODE retires the plan
    grouping = info.hierarchical or info.single_node
    agreed_env = grouping_env() if grouping else None
    if not check:
        signature = ""
    code = signature_code(signature) if check else 0
    expected = ex.expected(code)
    gather, code_word, words = ex.gather, ex.code, ex.words
    # [the block size the rows were read for (0: packed, -1: not yet steady), rank 0's
    # data, rank 1's (None with one rank), the others']. Steady: the entry has been
    # fitted, the data fits the blocks, the rows are views of the blocks as they are.
    state: list[Any] = [-1, None, None, ()]

    def read(source: list[Any], block: int) -> None:
        state[:] = [block, source[0], source[1] if size > 1 else None, tuple(source[2:])]

    def unsteady() -> None:
        """A checked call that is not steady yet: exchange (then the data alone if the
        blocks have no room), grow the blocks, fit the entry, read the rows."""
        fits = nbytes <= ex.capacity
        agreed = ex.run(comm, code, what) == expected
        if not agreed:
            ex.disagree(comm, signature, None, what, hint)
        if not fits:
            comm.Allgather(*packed)
            ex.grow(nbytes)  # (every rank agreed on this call: they all grow alike)
        fit()
        if fits:
            read(ex.rows(shape, dtype), ex.block)
        else:
            read(ex.rows(shape, dtype, packed=True), -1)

    def fit() -> None:  # after the agreement: every rank checks the same entry
        dispatch.fit(entry.alg, comm, entry.shards, ranks_per_node=ranks_per_node)

    def run(array: Any, into: Any = None) -> Any:
        if grouping and grouping_env() != agreed_env:
            return None
        send[...] = array
        if not check:
            comm.Allgather(*packed)
            if state[0]:
                fit()
                read(ex.rows(shape, dtype, packed=True), 0)
        elif state[0] == ex.block:  # steady: the exchange is the whole call
            code_word[0] = code
            gather(comm, what)
            if (words[0] != code or words[state[0] >> 3] != code) if size == 2 \
                    else ex.codes.tobytes() != expected:
                ex.disagree(comm, signature, None, what, hint)
        else:
            unsteady()
        _, r0, r1, others = state
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

    return run


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
