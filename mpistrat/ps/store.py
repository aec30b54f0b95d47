"""The parameter servers' variable store: one MPI window arena per ps, reached by RMA.

A :class:`VariableStore` is created collectively over a communicator. The ranks listed as
parameter servers (ps) each expose an arena of ``arena_bytes`` bytes through one
``MPI.Win.Allocate`` window; every other rank exposes 0 bytes. Variables are placed in
the arenas by pure bookkeeping (no communication), so every rank that makes the same
sequence of placement calls gets the same handles, and a handle (a small frozen
dataclass: ps rank, byte offset, shape, dtype) pickles to any rank of the communicator
and works there.

Operations, from any rank, concurrently with any other rank's:

* ``read``: ``Get_accumulate(op=NO_OP)`` under ``Lock(SHARED)``.
* ``assign``: ``Accumulate(op=REPLACE)`` under ``Lock(SHARED)``.
* ``assign_add`` / ``assign_sub``: ``Accumulate(op=SUM)`` (of the value, or of its
  negation) under ``Lock(SHARED)``. MPI makes accumulates with the same predefined op on
  the same element atomic, so concurrent adds never lose an update.
* ``update(handle, fn)``: read, ``fn``, write back under ``Lock(EXCLUSIVE)`` of the owning
  ps: an atomic read-modify-write for optimizers with state (TF's ``use_locking=True``).

float16 has no predefined MPI type here (mpi4py's float16 type is a derived 2-byte type
and MPICH's SUM over it gives garbage), so float16 moves as 16-bit integers (NO_OP and
REPLACE only copy bits) and its ``assign_add``/``assign_sub`` run as a locked
read-modify-write: still no lost update, but serialised on the owning ps.

Progress: passive-target RMA needs the target to enter MPI unless the transport does
RMA itself. A ps rank must therefore wait *inside MPI* (a blocking ``Recv`` of a shutdown
message, or a ``Barrier``) while other ranks use its arena, not compute in Python. This
holds even on one node with the MPICH 5.0.2 wheel used here: its ``Win.Allocate``
windows report ``alloc_shm`` and the unified memory model, yet a ``Lock`` (shared or
exclusive) on a ps that sleeps in Python waits until that ps next enters MPI.
"""

from __future__ import annotations

import math
import operator
import os
import secrets
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from ..errors import ArenaFullError
from ..partitioners import shard_offsets, validate_partitions
from ..runtime._mpi import Comm, mpi, world

__all__ = [
    "ARENA_ENV",
    "DEFAULT_ARENA_BYTES",
    "SUPPORTED_DTYPES",
    "ArenaFullError",
    "ShardedHandle",
    "VariableHandle",
    "VariableStore",
    "arena_bytes_from_env",
]

ARENA_ENV = "MPISTRAT_PS_ARENA_BYTES"
DEFAULT_ARENA_BYTES = 256 << 20
ALIGN = 64  # every variable starts on a cache line (and so on its element size)

# numpy dtype name -> (MPI type name for arithmetic, MPI type name for moving bits);
# arithmetic None: no predefined MPI type, adds run as a locked read-modify-write
_MPI_TYPES: dict[str, tuple[str | None, str]] = {
    "float16": (None, "UINT16_T"),
    "float32": ("FLOAT", "FLOAT"),
    "float64": ("DOUBLE", "DOUBLE"),
    "int32": ("INT32_T", "INT32_T"),
    "int64": ("INT64_T", "INT64_T"),
}
SUPPORTED_DTYPES = tuple(_MPI_TYPES)
_Store = TypeVar("_Store", bound="VariableStore")


@dataclass(frozen=True)
class VariableHandle:
    """Where one variable lives: ``nbytes`` bytes at byte ``offset`` of ps ``ps``'s arena.

    Attributes:
        store: the id of the store that placed it (the same on every rank).
        ps: the owning ps, as a rank of the store's communicator.
        offset: the byte offset in that ps's arena.
        shape: the variable's shape.
        dtype: its dtype's name (one of :data:`SUPPORTED_DTYPES`).
        name: a name for messages (may be empty).
    """

    store: str
    ps: int
    offset: int
    shape: tuple[int, ...]
    dtype: str
    name: str = ""

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class ShardedHandle:
    """A variable split along axis 0 into shards on consecutive ps (TF's div rule).

    Attributes:
        shape: the whole variable's shape.
        dtype: its dtype's name.
        shards: one :class:`VariableHandle` per shard, in row order.
        row_offsets: shard ``i`` holds rows ``row_offsets[i]:row_offsets[i + 1]``.
        name: a name for messages; shard ``i`` is named ``"{name}/part_{i}"``.
    """

    shape: tuple[int, ...]
    dtype: str
    shards: tuple[VariableHandle, ...]
    row_offsets: tuple[int, ...]
    name: str = ""

    @property
    def store(self) -> str:
        return self.shards[0].store

    @property
    def nbytes(self) -> int:
        return sum(shard.nbytes for shard in self.shards)


Handle = VariableHandle | ShardedHandle


def arena_bytes_from_env(environ: Any = None) -> int:
    """The arena size from ``MPISTRAT_PS_ARENA_BYTES`` (bytes, an int >= 1), else 256 MiB.

    A value that is not such an int warns (naming the variable) and falls back to the
    default.
    """
    environ = os.environ if environ is None else environ
    text = environ.get(ARENA_ENV)
    if text is None or not text.strip():
        return DEFAULT_ARENA_BYTES
    try:
        value = int(text.strip())
    except ValueError:
        value = 0
    if value < 1:
        warnings.warn(f"{ARENA_ENV}={text!r} is not a byte count >= 1 (an int such as "
                      f"{DEFAULT_ARENA_BYTES}); using the default {DEFAULT_ARENA_BYTES} bytes",
                      RuntimeWarning, stacklevel=3)
        return DEFAULT_ARENA_BYTES
    return value


def _dtype_name(dtype: Any) -> str:
    try:
        resolved = np.dtype(dtype)
    except (TypeError, ValueError) as error:
        raise TypeError(f"dtype {dtype!r} is not a NumPy dtype; the ps store holds "
                        f"{', '.join(SUPPORTED_DTYPES)}") from error
    if resolved.name not in _MPI_TYPES or not resolved.isnative:
        raise TypeError(f"the ps store cannot hold dtype {resolved} (no MPI type for its "
                        f"one-sided accumulates); use one of {', '.join(SUPPORTED_DTYPES)}, "
                        f"e.g. cast to float32")
    return resolved.name


def _shape(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (shape,)
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise TypeError(f"shape must be a sequence of ints >= 0 such as (1024, 64), got "
                        f"{shape!r}")
    dims = []
    for dim in shape:
        if isinstance(dim, bool) or not hasattr(dim, "__index__") or operator.index(dim) < 0:
            raise ValueError(f"shape {tuple(shape)!r} has {dim!r}; every dimension must be "
                             f"an int >= 0")
        dims.append(operator.index(dim))
    return tuple(dims)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


# --- the store ----------------------------------------------------------------------------


class VariableStore:
    """Variables in MPI window arenas on the ps ranks, used by one-sided RMA from any rank.

    Creation and :meth:`free` are collective over ``comm``. Placement (:meth:`allocate`,
    :meth:`allocate_sharded`) is local bookkeeping: ranks that make the same calls in the
    same order get equal handles. The other operations are one-sided and may run on any
    rank at any time, concurrently with other ranks'; the owning ps must wait inside MPI
    meanwhile (see the module docstring). Every fresh variable reads as zeros.

    One store is used from one thread at a time (an internal lock serialises callers), and
    the ``fn`` of :meth:`update` must not call the store.

    Args:
        ps_ranks: the ranks of ``comm`` that hold arenas, in round-robin order; the same
            list on every rank.
        arena_bytes: bytes per ps arena; default ``MPISTRAT_PS_ARENA_BYTES`` or 256 MiB.
            Must be the same on every rank.
        comm: the communicator (default ``COMM_WORLD``); the store duplicates it.

    Raises:
        ValueError: bad ``ps_ranks`` or ``arena_bytes``, or ranks that disagree on them
            (raised on every rank).
    """

    def __init__(self, ps_ranks: Sequence[int], arena_bytes: int | None = None,
                 comm: Comm | None = None) -> None:
        MPI = mpi()
        base = world() if comm is None else comm
        problem = None
        try:
            ranks = tuple(operator.index(r) for r in ps_ranks)
        except TypeError:
            ranks = ()
            problem = f"ps_ranks must be a sequence of ints, got {ps_ranks!r}"
        arena = arena_bytes_from_env() if arena_bytes is None else arena_bytes
        if problem is None:
            if not ranks:
                problem = "ps_ranks is empty; name at least one rank that holds variables"
            elif len(set(ranks)) != len(ranks) or not all(0 <= r < base.size for r in ranks):
                problem = (f"ps_ranks {list(ranks)} must be distinct ranks of the "
                           f"communicator, in [0, {base.size})")
            elif isinstance(arena, bool) or not isinstance(arena, (int, np.integer)) \
                    or arena < 1:
                problem = (f"arena_bytes must be an int >= 1, got {arena!r}; pass e.g. "
                           f"{DEFAULT_ARENA_BYTES} or set {ARENA_ENV}")
        token = secrets.token_hex(8) if base.rank == 0 else ""
        seen = base.allgather((problem, ranks, None if problem else int(arena), token))
        problems = [f"rank {r}: {p}" for r, (p, _, _, _) in enumerate(seen) if p]
        if not problems and len({(s[1], s[2]) for s in seen}) > 1:
            problems.append("the ranks disagree on the store: (ps_ranks, arena_bytes) per "
                            "rank " + ", ".join(f"{r}: ({list(s[1])}, {s[2]})"
                                                for r, s in enumerate(seen))
                            + f"; pass the same values (and {ARENA_ENV}) everywhere")
        if problems:
            raise ValueError("cannot create the ps variable store: " + "; ".join(problems))
        self.ps_ranks: tuple[int, ...] = ranks
        self.arena_bytes: int = int(arena)
        self.id: str = seen[0][3]
        self._comm = base.Dup()
        self._mine = self._comm.rank in ranks
        self._win = MPI.Win.Allocate(self.arena_bytes if self._mine else 0, 1,
                                     comm=self._comm)
        if self._mine:  # fresh variables read as zeros (the memory is not promised to be)
            rank = self._comm.rank
            self._win.Lock(rank, MPI.LOCK_EXCLUSIVE)
            np.frombuffer(self._win.tomemory(), np.uint8)[:] = 0
            self._win.Unlock(rank)
        self._comm.Barrier()
        self._used = dict.fromkeys(ranks, 0)
        self._count = 0  # round-robin placements so far
        self._thread_lock = threading.Lock()
        self._holder: int | None = None  # the thread inside a locked section
        self._freed = False

    # --- placement (bookkeeping only) --------------------------------------------------

    @property
    def used(self) -> dict[int, int]:
        """Bytes placed so far on each ps (aligned)."""
        return dict(self._used)

    def allocate(self, shape: Any, dtype: Any, *, ps: int | None = None,
                 name: str = "") -> VariableHandle:
        """Place one variable: on ``ps`` if given (the round-robin count is not advanced,
        as for TF's ``colocate_vars_with``), else on ``ps_ranks[n % P]`` for the n-th
        round-robin placement.

        Raises:
            ArenaFullError: the variable does not fit in the free part of the arena.
            TypeError: an unsupported dtype.
        """
        self._check_open()
        dims, kind = _shape(shape), _dtype_name(dtype)
        if ps is not None and ps not in self._used:
            raise ValueError(f"ps {ps!r} is not a parameter server of this store; use one "
                             f"of {list(self.ps_ranks)}")
        target = self._next_ps(0) if ps is None else ps
        nbytes = math.prod(dims) * np.dtype(kind).itemsize
        self._check_room({target: nbytes}, name, dims, kind)
        handle = VariableHandle(self.id, target, self._used[target], dims, kind, name)
        self._used[target] += _aligned(nbytes)
        if ps is None:
            self._count += 1
        return handle

    def allocate_sharded(self, shape: Any, dtype: Any, partitions: Any, *,
                         name: str = "") -> Handle:
        """Place a variable split along axis 0 as a partitioner result ``[k, 1, ...]``
        asks (``k`` clipped to the rows, as TF does): shard ``i`` takes the next
        round-robin slot, so shards sit on consecutive ps, with TF's div rule of rows
        (13 rows over 5 shards: 3, 3, 3, 2, 2). One shard gives a plain handle.

        Raises:
            ValueError: ``partitions`` is not ``[k, 1, ..., 1]`` (TF's message).
            ArenaFullError: a shard does not fit; nothing is placed then.
        """
        self._check_open()
        dims, kind = _shape(shape), _dtype_name(dtype)
        k = validate_partitions(partitions, dims)
        if k == 1:
            return self.allocate(dims, kind, name=name)
        rows = shard_offsets(dims[0], k)
        row_bytes = math.prod(dims[1:]) * np.dtype(kind).itemsize
        targets = [self._next_ps(i) for i in range(k)]
        need: dict[int, int] = {}
        for i, ps in enumerate(targets):
            need[ps] = need.get(ps, 0) + _aligned((rows[i + 1] - rows[i]) * row_bytes)
        self._check_room(need, name, dims, kind, shards=k)
        shards = []
        for i, ps in enumerate(targets):
            part = (rows[i + 1] - rows[i],) + dims[1:]
            shards.append(VariableHandle(self.id, ps, self._used[ps], part, kind,
                                         f"{name}/part_{i}" if name else f"part_{i}"))
            self._used[ps] += _aligned(math.prod(part) * np.dtype(kind).itemsize)
        self._count += k
        return ShardedHandle(dims, kind, tuple(shards), tuple(rows), name)

    def _next_ps(self, ahead: int) -> int:
        return self.ps_ranks[(self._count + ahead) % len(self.ps_ranks)]

    def _check_room(self, need: dict[int, int], name: str, dims: tuple[int, ...],
                    kind: str, shards: int = 1) -> None:
        for ps, nbytes in need.items():
            if self._used[ps] + nbytes > self.arena_bytes:
                free = self.arena_bytes - self._used[ps]
                what = f"variable {name!r}" if name else "a variable"
                split = f" (its {shards} shards need {nbytes} bytes on ps {ps})" \
                    if shards > 1 else ""
                raise ArenaFullError(
                    f"cannot place {what} of shape {dims} and dtype {kind} "
                    f"({math.prod(dims) * np.dtype(kind).itemsize} bytes){split}: the arena "
                    f"of ps {ps} is {self.arena_bytes} bytes with {free} free; set "
                    f"{ARENA_ENV} to more bytes (e.g. {2 * self.arena_bytes}) on every rank, "
                    f"add parameter servers, or shard the variable")

    # --- one-sided operations -----------------------------------------------------------

    def read(self, handle: Handle) -> np.ndarray:
        """Return the variable's value (a new array); a sharded one gathered in row order,
        all shards read under their ps' shared locks held together."""
        parts = self._parts(handle)
        out = np.empty(handle.shape, handle.dtype)
        with self._locked(parts, exclusive=False) as MPI:
            for part, rows in parts:
                self._get(MPI, part, out[rows] if rows else out)
        return out

    def assign(self, handle: Handle, value: Any) -> None:
        """Replace the variable's value (``Accumulate(REPLACE)``); ``value`` broadcasts."""
        self._accumulate(handle, value, "REPLACE", negate=False)

    def assign_add(self, handle: Handle, value: Any) -> None:
        """Add ``value`` atomically element-wise (``Accumulate(SUM)``)."""
        self._accumulate(handle, value, "SUM", negate=False)

    def assign_sub(self, handle: Handle, value: Any) -> None:
        """Subtract ``value``: add its negation (``Accumulate(SUM)``)."""
        self._accumulate(handle, value, "SUM", negate=True)

    def update(self, handle: Handle, fn: Callable[[np.ndarray], Any]) -> np.ndarray:
        """Atomic read-modify-write: under ``Lock(EXCLUSIVE)`` of every owning ps (taken in
        ps order), read the value, call ``fn(value)`` and write its result back.

        ``fn`` gets the whole value (a sharded variable gathered) and returns the new value
        (anything that broadcasts to the shape). It must not use the store.

        Returns:
            The value written.
        """
        parts = self._parts(handle)
        with self._locked(parts, exclusive=True) as MPI:
            current = np.empty(handle.shape, handle.dtype)
            for part, rows in parts:
                self._get(MPI, part, current[rows] if rows else current)
            for part, _ in parts:
                self._win.Flush(part.ps)
            new = self._value(handle, fn(current))
            for part, rows in parts:
                self._put(MPI, part, new[rows] if rows else new, "REPLACE")
        return new

    # --- lifetime -------------------------------------------------------------------------

    def free(self) -> None:
        """Release the window and the communicator (collective); later calls raise."""
        if self._freed:
            return
        self._freed = True
        self._win.Free()
        self._comm.Free()

    def __enter__(self: _Store) -> _Store:  # noqa: PYI019 (typing.Self is 3.11+)
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    def __repr__(self) -> str:
        state = "freed" if self._freed else f"used {self._used}"
        return (f"VariableStore(ps_ranks={list(self.ps_ranks)}, arena_bytes="
                f"{self.arena_bytes}, {state})")

    # --- internals ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._freed:
            raise RuntimeError("the ps variable store was freed; create a new VariableStore")

    def _parts(self, handle: Any) -> list[tuple[VariableHandle, slice | None]]:
        self._check_open()
        if isinstance(handle, ShardedHandle):
            parts: list[tuple[VariableHandle, slice | None]] = [
                (shard, slice(handle.row_offsets[i], handle.row_offsets[i + 1]))
                for i, shard in enumerate(handle.shards)]
        elif isinstance(handle, VariableHandle):
            parts = [(handle, None)]
        else:
            raise TypeError(f"expected a VariableHandle or ShardedHandle from "
                            f"VariableStore.allocate, got {type(handle).__name__}")
        for part, _ in parts:
            if part.store != self.id:
                raise ValueError(f"handle {part.name or part} belongs to store {part.store}, "
                                 f"not to this store ({self.id}); use it with the store that "
                                 f"placed it")
        return parts

    def _value(self, handle: Handle, value: Any) -> np.ndarray:
        array = np.asarray(value)
        try:
            array = array.astype(handle.dtype, casting="same_kind", copy=False)
        except TypeError as error:
            raise TypeError(f"cannot store a {array.dtype} value in variable "
                            f"{handle.name or ''} of dtype {handle.dtype}; cast it first"
                            ) from error
        try:
            array = np.broadcast_to(array, handle.shape)
        except ValueError as error:
            raise ValueError(f"a value of shape {array.shape} does not fit variable "
                             f"{handle.name or ''} of shape {handle.shape}") from error
        return np.ascontiguousarray(array)

    def _accumulate(self, handle: Handle, value: Any, op: str, *, negate: bool) -> None:
        parts = self._parts(handle)
        array = self._value(handle, value)
        if negate:
            array = np.negative(array)
        if op == "SUM" and _MPI_TYPES[handle.dtype][0] is None:  # float16: locked RMW
            self.update(handle, lambda current: current + array)
            return
        with self._locked(parts, exclusive=False) as MPI:
            for part, rows in parts:
                self._put(MPI, part, array[rows] if rows else array, op)

    @contextmanager
    def _locked(self, parts: list[tuple[VariableHandle, slice | None]], *,
                exclusive: bool) -> Iterator[Any]:
        """Hold the lock of every owning ps (in rank order, so two ranks locking the same
        set cannot deadlock) for the body; RMA calls complete at the unlocks."""
        MPI = mpi()
        kind = MPI.LOCK_EXCLUSIVE if exclusive else MPI.LOCK_SHARED
        owners = sorted({part.ps for part, _ in parts})
        if self._holder == threading.get_ident():
            raise RuntimeError("the ps variable store was called from inside update()'s fn; "
                               "fn must only compute the new value from the one it is given")
        with self._thread_lock:
            self._holder = threading.get_ident()
            locked: list[int] = []
            try:
                for ps in owners:
                    self._win.Lock(ps, kind)
                    locked.append(ps)
                yield MPI
            finally:
                self._holder = None
                for ps in locked:
                    self._win.Unlock(ps)

    def _types(self, MPI: Any, part: VariableHandle, arithmetic: bool) -> Any:
        sum_type, move_type = _MPI_TYPES[part.dtype]
        return getattr(MPI, sum_type if arithmetic and sum_type else move_type)

    def _get(self, MPI: Any, part: VariableHandle, out: np.ndarray) -> None:
        if part.size == 0:
            return
        kind = self._types(MPI, part, arithmetic=False)
        # ``out`` is a whole C-contiguous array or a range of its rows: contiguous; it is
        # filled when the epoch ends (Flush or Unlock). NO_OP ignores the origin buffer.
        self._win.Get_accumulate([out, part.size, kind], [out, part.size, kind],
                                 part.ps, target=(part.offset, part.size, kind),
                                 op=MPI.NO_OP)

    def _put(self, MPI: Any, part: VariableHandle, value: np.ndarray, op: str) -> None:
        if part.size == 0:
            return
        kind = self._types(MPI, part, arithmetic=op == "SUM")
        buffer = np.ascontiguousarray(value)
        self._win.Accumulate([buffer, part.size, kind], part.ps,
                             target=(part.offset, part.size, kind), op=getattr(MPI, op))
