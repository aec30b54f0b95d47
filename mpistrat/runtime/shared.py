"""Arrays that every rank of a node can read: MPI-3 shared windows.

``shared_empty(shape, dtype, comm)`` returns a NumPy array that lives in a shared window
(``MPI_Win_allocate_shared``) over the node group of ``comm``. The ``shm`` all-reduce
reads such an array where it lies (no copy into shared memory first): that is its
zero-copy mode. Any NumPy code can use the array as an ordinary one.

Design:

* A :class:`Block` is one shared window over one node communicator: every rank owns one
  segment (page-aligned, ``alloc_shared_noncontig``, first touched by its owner so its
  pages sit on the owner's NUMA node) and maps every peer's segment (``Shared_query``).
* Every block gets a *uid* that the ranks of its node group agree on when they allocate
  it (one small ``allreduce``), so a rank can tell its peers "my data is in block *u* at
  offset *o*" through shared memory and each peer finds its own mapping of that segment.
* Allocation and freeing are collective over the node group, so a block is never freed
  when an array is garbage collected (ranks collect at different times). Blocks live
  until :func:`free_shared`, until the communicator they were made for is freed, or
  until the process exits; the exit hook frees the blocks still alive in the order they
  were made (the order every rank made them in), before MPI is finalised.
"""

from __future__ import annotations

import atexit
import math
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import TopologyError
from ..packing import checked_shapes, views_in_order
from ._commcache import comm_cache
from ._mpi import Comm, mpi, world
from .topology import get_topology

__all__ = ["Block", "shared_empty", "shared_zeros", "shared_arrays", "free_shared",
           "node_empty", "allocate", "locate", "is_shared", "recycled", "POOL_SLOTS"]

_PAGE = 4096
_BLOCKS: dict[int, Block] = {}  # uid -> live block, in creation order
_UID_FLOOR = 0  # the highest uid agreed so far on this rank


@dataclass(eq=False)
class Block:
    """One shared window over a node communicator and every rank's mapping of it.

    Attributes:
        uid: the id the ranks of ``comm`` agreed on for this block.
        comm: the node communicator (a duplicate owned by the block).
        win: the MPI window (a passive-target ``Lock_all`` epoch is open for its life).
        rank, size: this rank in ``comm`` and its size.
        nbytes: the size of every rank's segment (of rank 0's alone, ``node``).
        segments: ``segments[q]`` is rank ``q``'s segment as a ``uint8`` array.
        base: the address of this rank's own segment.
        owner: what the block was made for (``"user"`` or an internal name; ``"node"``:
            one segment, rank 0's, that every rank uses).
    """

    uid: int
    comm: Comm
    win: Any
    rank: int
    size: int
    nbytes: int
    segments: list[np.ndarray]
    base: int
    owner: str

    def sync(self) -> None:
        """A memory barrier for this window (``MPI_Win_sync``): stores before it are
        visible to the peers before stores after it."""
        self.win.Sync()

    def serves(self, comm: Comm) -> bool:
        """True when ``comm`` has exactly this block's ranks in the same order (cached on
        ``comm``, whose cache dies with it: a freed communicator's handle may be reused)."""
        answers = comm_cache(comm).setdefault("shared_blocks_served", {})
        known = answers.get(self.uid)
        if known is None:
            MPI = mpi()
            if comm.Get_size() != self.size:
                known = False
            else:
                mine, theirs = self.comm.Get_group(), comm.Get_group()
                try:
                    known = MPI.Group.Compare(mine, theirs) == MPI.IDENT
                finally:
                    mine.Free()
                    theirs.Free()
            answers[self.uid] = known
        return known

    def free(self) -> None:
        """Free the window (collective over ``comm``); idempotent."""
        if _BLOCKS.pop(self.uid, None) is None:
            return
        MPI = mpi()
        self.segments = []
        if MPI.Is_finalized():
            return
        self.win.Unlock_all()
        self.win.Free()
        self.comm.Free()


def _agree_uid(comm: Comm) -> int:
    global _UID_FLOOR
    _UID_FLOOR = comm.allreduce(_UID_FLOOR + 1, op=mpi().MAX)
    return _UID_FLOOR


def allocate(node_comm: Comm, nbytes: int, owner: str = "user") -> Block:
    """Allocate a shared window of ``nbytes`` per rank over ``node_comm`` (collective);
    with ``owner="node"``, ``nbytes`` on rank 0 alone, the one segment of the block.

    Every rank of ``node_comm`` must share memory with the others (one node) and pass
    the same ``nbytes``.

    Raises:
        TopologyError: on every rank, when the ranks of ``node_comm`` are not all on one
            node (their memory cannot be shared).
    """
    MPI = mpi()
    physical = node_comm.Split_type(MPI.COMM_TYPE_SHARED, key=node_comm.Get_rank())
    try:
        together = physical.Get_size() == node_comm.Get_size()
    finally:
        physical.Free()
    together = node_comm.allreduce(together, op=MPI.LAND)
    if not together:
        raise TopologyError(
            f"the {node_comm.Get_size()} ranks of this communicator are not all on one node, "
            f"so they cannot share memory; use the node group of the communicator "
            f"(mpistrat.runtime.topology.get_topology(comm).node_comm), or a hierarchical "
            f"algorithm such as 'shm/xring' across nodes"
        )
    comm = node_comm.Dup()
    size = max(_PAGE, -(-int(nbytes) // _PAGE) * _PAGE)
    rank = comm.Get_rank()
    common = owner == "node"
    info = MPI.Info.Create()
    info.Set("alloc_shared_noncontig", "true")
    try:
        win = MPI.Win.Allocate_shared(size if rank == 0 or not common else 0, 1,
                                      info=info, comm=comm)
    finally:
        info.Free()
    win.Lock_all(MPI.MODE_NOCHECK)
    segments = []
    for q in range(1 if common else comm.Get_size()):
        memory, _unit = win.Shared_query(q)
        segments.append(np.frombuffer(memory, dtype=np.uint8, count=size))
    if rank < len(segments):  # first touch by the owner: its NUMA node, faulted in now
        segments[rank].fill(0)
    win.Sync()
    uid = _agree_uid(comm)
    # (a node block is nobody's own segment but rank 0's: see locate)
    base = segments[min(rank, len(segments) - 1)].__array_interface__["data"][0]
    block = Block(uid, comm, win, rank, comm.Get_size(), size, segments, base, owner)
    _BLOCKS[uid] = block
    return block


def block(uid: int) -> Block | None:
    """The live block with this uid on this rank, or None."""
    return _BLOCKS.get(uid)


def locate(array: np.ndarray) -> tuple[Block, int] | None:
    """The block holding all of ``array`` in this rank's own segment, and the byte offset
    of its first element, or None when it is not (all) in shared memory."""
    if not _BLOCKS or not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
        return None
    start = array.__array_interface__["data"][0]
    end = start + array.nbytes
    for candidate in _BLOCKS.values():
        if candidate.owner == "node" and candidate.rank:
            continue  # rank 0's segment, not this rank's own
        if candidate.base <= start and end <= candidate.base + candidate.nbytes:
            return candidate, start - candidate.base
    return None


def is_shared(array: Any) -> bool:
    """True when ``array`` lives in a shared window made by :func:`shared_empty` (or by
    mpistrat internally), so the ``shm`` all-reduce can read it in place."""
    return locate(array) is not None


class _UserBlocks:
    """The user blocks made over one node communicator; freed with it."""

    def __init__(self) -> None:
        self.blocks: list[Block] = []

    def release(self) -> None:
        for item in self.blocks:
            item.free()
        self.blocks.clear()


def shared_empty(shape: Any, dtype: Any = float, comm: Comm | None = None,
                 ranks_per_node: int | None = None) -> np.ndarray:
    """A new uninitialised array in memory shared by the ranks of this rank's node group.

    Collective over the node group of ``comm``: every rank of ``comm`` calls it with the
    same shape and dtype, in the same order as its other collectives. The array is an
    ordinary C-contiguous ``numpy.ndarray``; passing it to an all-reduce whose spec uses
    ``shm`` (or ``shm/<b>``) lets the algorithm read and write it in place.

    Args:
        shape: an int or a tuple of ints, as for ``numpy.empty``.
        dtype: any NumPy dtype (default float64, as ``numpy.empty``).
        comm: the communicator whose node groups share the memory (default ``COMM_WORLD``).
        ranks_per_node: the virtual node size (default ``MPISTRAT_RANKS_PER_NODE``, else
            physical nodes), as for hierarchical algorithms.

    Returns:
        The array. Its memory is freed by :func:`free_shared`, when ``comm``'s node
        communicator is freed, or at exit.
    """
    return _user_array(shape, dtype, comm, ranks_per_node, "user")


def _user_array(shape: Any, dtype: Any, comm: Comm | None, ranks_per_node: int | None,
                owner: str) -> np.ndarray:
    """:func:`shared_empty` (``owner="user"``: this rank's segment) or :func:`node_empty`
    (``"node"``: the node group's one segment)."""
    dtype = np.dtype(dtype)
    shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"negative dimensions are not allowed in shape {shape}")
    nbytes = math.prod(shape) * dtype.itemsize
    node_comm = get_topology(world() if comm is None else comm, ranks_per_node).node_comm
    made = allocate(node_comm, nbytes, owner=owner)
    comm_cache(node_comm).setdefault("shared_user_blocks", _UserBlocks()).blocks.append(made)
    segment = made.segments[0 if owner == "node" else made.rank]
    return segment[:nbytes].view(dtype).reshape(shape)


def node_empty(shape: Any, dtype: Any = float, comm: Comm | None = None,
               ranks_per_node: int | None = None) -> np.ndarray:
    """A new uninitialised array of which the ranks of a node group share one copy:
    every rank's array is the same memory (on the group's first rank), so a store by
    one rank is what the others load.

    Collective over the node group of ``comm``, as :func:`shared_empty`. Stores by
    several ranks to the same elements race; order them with the node group's barrier
    (or another collective) before other ranks read. Freed as :func:`shared_empty`'s
    arrays (:func:`free_shared`, with the communicator, or at exit).
    """
    return _user_array(shape, dtype, comm, ranks_per_node, "node")


def shared_zeros(shape: Any, dtype: Any = float, comm: Comm | None = None,
                 ranks_per_node: int | None = None) -> np.ndarray:
    """Like :func:`shared_empty`, filled with zeros."""
    array = shared_empty(shape, dtype, comm, ranks_per_node)
    array.fill(0)
    return array


def shared_arrays(shapes: Any, dtype: Any = np.float32, comm: Comm | None = None,
                  ranks_per_node: int | None = None) -> list[np.ndarray]:
    """Zeroed arrays of the given shapes, one after another in one shared array: gradient
    buffers for zero-copy batched all-reduces.

    Compute each gradient into its array (``np.matmul(a, b, out=grads[0])``,
    ``grads[1][...] = ...``) and pass them, in this order, to ``batch_reduce`` or
    ``ReplicaContext.all_reduce``: the tensors of a pack are then views of one shared
    buffer, which ``shm`` (and ``shm/<b>``) reads in place instead of copying it in, and
    which every algorithm sends as one buffer instead of tensor by tensor.

    Collective over the node group of ``comm``, as :func:`shared_empty`.

    Args:
        shapes: one shape (an int or a tuple of ints) per array.
        dtype: the arrays' dtype (default float32).
        comm, ranks_per_node: as for :func:`shared_empty`.

    Returns:
        The arrays, in order. ``free_shared(arrays[0])`` frees them all.
    """
    shapes = checked_shapes(shapes)
    total = sum(math.prod(shape) for shape in shapes)
    flat = shared_zeros(max(1, total), dtype, comm, ranks_per_node)
    return views_in_order(flat, shapes)


def free_shared(array: np.ndarray) -> None:
    """Free the shared memory behind an array from :func:`shared_empty` (or the first of
    :func:`shared_arrays`, or :func:`node_empty`), collective over its node group, like
    the allocation. The array, and every view of it, must not be used afterwards.

    Raises:
        ValueError: ``array`` is not the whole of a block from :func:`shared_empty`.
    """
    if isinstance(array, np.ndarray):
        start = array.__array_interface__["data"][0]
        for candidate in list(_BLOCKS.values()):
            if candidate.owner == "node" and candidate.segments \
                    and candidate.segments[0].__array_interface__["data"][0] == start:
                candidate.free()
                return
    found = locate(array)
    if found is None or found[0].owner != "user" or found[1] != 0:
        raise ValueError("free_shared takes an array returned by mpistrat.shared_empty, or "
                         "the first of mpistrat.shared_arrays (not another view into one, "
                         "nor an ordinary array)")
    found[0].free()


POOL_SLOTS = 4  # shared result buffers per node group (more results alive: private memory)


class _Pool:
    """Shared result buffers of one node group, reused once nothing references them.

    Each slot is a block and an *anchor*: an array over the block's own segment that
    every buffer handed out is a view of, so the anchor's reference count says whether
    a result still uses the slot. Slots are made, reused and replaced only when every
    rank of the node group agrees (one small all-reduce), so the ranks' pools stay
    identical. A slot is never freed while this rank may hold a view of it: only when
    every rank found it free, or at exit (a freed communicator leaves its pool alive).
    """

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self.anchors: list[np.ndarray] = []


def recycled(comm: Comm, count: int, dtype: Any,
             ranks_per_node: int | None = None) -> np.ndarray | None:
    """A 1-D array of ``count`` elements in shared memory, reusing a slot whose earlier
    results are gone on every rank of the node group — or None (on every rank of the
    group alike) when all :data:`POOL_SLOTS` slots are in use.

    Collective over the node group of ``comm``: every rank calls it with the same count
    and dtype. Results that are views of the array keep its slot busy, as with
    ``NumpyBackend.recycled``.
    """
    MPI = mpi()
    dtype = np.dtype(dtype)
    if count <= 0:
        return None
    nbytes = count * dtype.itemsize
    node_comm = get_topology(comm, ranks_per_node).node_comm
    pool = comm_cache(node_comm).setdefault("shared_pool", _Pool())
    free = 0
    for i in range(len(pool.anchors)):
        if sys.getrefcount(pool.anchors[i]) == 2:  # the pool's list and getrefcount's argument
            free |= 1 << i
    mask = np.array([free], dtype=np.int64)
    if node_comm.Get_size() > 1:
        node_comm.Allreduce(MPI.IN_PLACE, mask, op=MPI.BAND)
    free = int(mask[0])
    fits = [i for i, b in enumerate(pool.blocks) if free >> i & 1 and b.nbytes >= nbytes]
    if fits:
        slot = min(fits, key=lambda i: pool.blocks[i].nbytes)
    else:
        spare = [i for i in range(len(pool.blocks)) if free >> i & 1]
        if spare:
            slot = spare[0]
            pool.blocks[slot].free()  # free on every rank of the group: nobody holds it
        elif len(pool.blocks) < POOL_SLOTS:
            slot = len(pool.blocks)
            pool.blocks.append(None)  # type: ignore[arg-type]
            pool.anchors.append(None)  # type: ignore[arg-type]
        else:
            return None
        made = allocate(node_comm, 1 << max(nbytes - 1, 1).bit_length(), owner="result pool")
        pool.blocks[slot] = made
        own = made.segments[made.rank]
        pool.anchors[slot] = np.frombuffer(own.data, dtype=np.uint8)
    return pool.anchors[slot][:nbytes].view(dtype)


@atexit.register
def _free_at_exit() -> None:
    if not _BLOCKS:  # (also true when MPI was never started: nothing imports it here)
        return
    MPI = mpi()
    if MPI.Is_finalized():
        return
    for item in list(_BLOCKS.values()):
        item.free()
