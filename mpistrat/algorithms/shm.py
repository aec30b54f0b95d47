"""``shm``: all-reduce inside a node through MPI-3 shared windows — one pass, no messages.

The ranks of a node group map one another's memory (:mod:`mpistrat.runtime.shared`). Each rank
owns a contiguous slice of the buffer, reduces that slice reading every rank's input
where it lies, and then every rank copies the other slices' results. No byte goes
through the MPI library's queues.

Steps of one call (``n`` ranks, every rank publishing in its own control segment):

1. **Arrival.** A rank writes what it was asked (a hash of size, dtype, op and kind of
   call) and where its input and output live, then its arrival epoch. It waits until
   every peer has arrived at the same epoch and checks that all asked the same (a
   mismatch raises :class:`~mpistrat.CollectiveMismatchError` on every rank).
2. **Small buffers** (up to :func:`small_limit` of the node group: 256 KiB on 2 ranks,
   less on more, as every rank reads all ``n`` slots) end here in one step: each rank
   copied its input into its slot of the control segment before arriving, and now every
   rank reduces the whole buffer from all slots, in rank order (the same operations on
   every rank, so the results are bitwise identical). The slots are double-buffered by the
   parity of the epoch, so no second synchronisation is needed: a rank can only
   overwrite a slot two calls later, after every peer has arrived at the call between,
   that is, finished reading.
3. **Large buffers** are cut into ``n`` slices (aligned to 64 bytes; rank ``r`` owns slice
   ``r``) and every slice into chunks of :data:`CHUNK_BYTES`. For chunk ``k``, a rank
   (a) copies its input's chunk ``k`` of every other slice into its shared scratch
   segment and bumps its *copied* counter — skipped in zero-copy mode, when the input
   already lives in a shared window from :func:`mpistrat.shared_empty`; (b) waits for
   the peers' *copied* counters and reduces chunk ``k`` of its own slice from all
   inputs in rank order, into its output if that is shared (zero-copy) or else into its
   scratch and then its output, and bumps its *reduced* counter; (c) when every rank's
   output is shared (zero-copy, or a ``batch_reduce`` result from the shared pool), it
   writes the chunk it just reduced into every peer's output too, while the chunk is
   in its cache (**push**); otherwise it copies chunk ``k - 1`` of every other slice from
   its owner's result (**pull**). A rank returns once every peer's *reduced* counter is
   final (push) or a final *done* counter says no peer still reads its buffers (pull),
   so its caller cannot overwrite a zero-copy buffer a peer still uses.

   Push moves a fifth less memory (2 ranks: a rank reads its slice of both buffers and
   writes the sum into both, instead of also reading the peer's result back) and has no
   per-chunk wait. It also escapes the slow one of this VM's two states: there pull ran
   at 3.4-3.9 GB/s while push, interleaved with it, ran at 10-17 GB/s
   (docs/notes/shm-history.md; pull reading lines a peer has just written is the likely
   cause, not verified).

Design choices:

* **Windows**: one control window per communicator (flags plus the two small slots),
  allocated on first use; one scratch window per communicator sized in powers of two
  (at least 1 MiB), replaced collectively by a larger one when a call needs more — the
  old one is freed, so growth does not leak. Both are freed with the communicator, or
  at exit (:mod:`mpistrat.runtime.shared`).
* **Synchronisation** is by counters in shared memory: each rank writes only its own
  64-byte lines (no false sharing) and polls its peers'. A counter carries the epoch in
  its high 32 bits, so it only ever grows and a later value implies every earlier step.
  ``MPI_Win_sync`` (a memory barrier) separates data stores from the counter store, and
  the counter load from the data loads. There are no MPI messages on the hot path.
* **Waiting** polls and calls ``sched_yield`` between polls, so with more ranks than
  cores the rank being waited for gets the core; after 1 ms it sleeps 50 µs between
  polls instead of burning a core during a long imbalance. The stall check and timeout
  of ``mpistrat run`` apply (:mod:`mpistrat.runtime.stall`): a report names the ranks being
  waited for, and past the timeout every waiting rank raises.
* **Failure**: a rank that raises inside the algorithm marks its abort word before
  re-raising; every peer polls the abort words while it waits and raises
  :class:`~mpistrat.CollectiveAbortedError` instead of waiting forever. After a failure
  the communicator's windows are inconsistent: later ``shm`` calls on it raise on every
  rank (use a fresh communicator, e.g. ``comm.Dup()``).
* **Slices** are contiguous and 64-byte aligned, so each rank streams through its own
  cache lines; segments are page-aligned and first touched by their owner (NUMA).
* **Zero-copy**: when a rank's input (or output) lies in a shared window of the same
  node group, it publishes the window's uid and offset instead of copying, and peers
  read (and the owner writes) it in place. Ranks may mix the two modes.
* **Packs** (``batch_reduce``, out of place from a :class:`~.source.Source`): the
  tensors are copied straight into the shared window, chunk by chunk — the copy into
  the pack *is* the copy-in, so a pack costs what one buffer costs — and the rank's own
  slice is reduced from the tensors where they lie. When the tensors are views of one
  array in order (:func:`mpistrat.shared_arrays` gives such views in shared memory),
  that array is the input, read in place if it is shared. When they lie in one shared
  block with gaps (a spec that routes the small tensors elsewhere), a rank publishes
  the block, its first tensor's offset and a hash of the others' offsets from it; if
  every rank's hash is equal, peers map each other's tensors with their own offsets
  and nobody copies in. The shared pack arena is the scratch window, so it is only
  grown at a call every rank has reached.
* **Results** are bitwise identical on every rank: each element of a large buffer is
  reduced once, by its slice's owner, and copied; small buffers are reduced by every
  rank with the same operations in the same order. Any dtype, op, length (0, 1, fewer
  elements than ranks) works; ``shards`` and ``rotation`` are ignored.

Preconditions: every rank of ``comm`` is on the same node (else
:class:`~mpistrat.TopologyError` on every rank, suggesting ``shm/<b>``); host (NumPy)
buffers.
"""

from __future__ import annotations

import hashlib
import os
import time
import zlib
from typing import Any

import numpy as np

from ..backends.numpy_backend import UFUNCS
from ..backends.protocol import ArrayBackend
from ..errors import (
    BackendUnavailable,
    CollectiveAbortedError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    MpistratError,
)
from ..ops import ReduceOp
from ..runtime import shared, stall
from ..runtime._commcache import comm_cache
from ..runtime._mpi import Comm
from .source import Source

__all__ = ["all_reduce", "reduce_to_root", "broadcast", "SMALL_BYTES", "SMALL_TOTAL_BYTES",
           "small_limit", "CHUNK_BYTES"]

# The one-step path (every rank reduces the whole buffer from every rank's slot) against
# the pipelined one, 2 ranks on 2 cores, zero-copy buffers: 38 vs 104 us at 48 KiB, 82 vs
# 128 us at 150 KiB, even at 256 KiB, slower from 512 KiB (docs/notes/shm-history.md)
SMALL_BYTES = 256 * 1024  # a slot's size: the most a one-step call (or broadcast) carries
SMALL_TOTAL_BYTES = 512 * 1024  # the most a one-step reduce reads from all slots together
CHUNK_BYTES = 1 << 20  # bytes of a slice per pipeline step: the best of 64 KiB - 4 MiB measured
_MIN_SCRATCH = 1 << 20


# Control segment layout, in int64 words; every line is 64 bytes, written by its owner only.
_W = 8  # words per line
_ARRIVE = (0, 1)  # one arrival line per epoch parity: [epoch, signature, in uid, in
#                   offset, out uid, out offset, in layout]
_COPIED, _REDUCED, _DONE, _ABORT = 2 * _W, 3 * _W, 4 * _W, 5 * _W
_SLOTS = 4096  # byte offset of the two small slots
_SPIN_BEFORE_SLEEP = 1e-3
_SLEEP = 50e-6

_KIND_ALL, _KIND_ROOT, _KIND_BCAST = 1, 2, 3


class _Node:
    """The shared-memory state of one communicator: control window, scratch window,
    epoch counter and the views of every rank's segments."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.ctrl = shared.allocate(comm, _SLOTS + 2 * SMALL_BYTES, owner="shm control")
        self.flags = [segment[:_SLOTS].view(np.int64) for segment in self.ctrl.segments]
        self.slots = [[segment[_SLOTS + p * SMALL_BYTES:_SLOTS + (p + 1) * SMALL_BYTES]
                       for p in (0, 1)] for segment in self.ctrl.segments]
        self.mine = self.flags[self.rank]
        self.peers = [q for q in range(self.size) if q != self.rank]
        self.small_plans: dict[tuple, _SmallPlan] = {}
        self.scratch: shared.Block | None = None
        self.epoch = 0
        self.broken: str | None = None
        self.failed: list[int] = []
        self._chunk_tmp = np.empty(0, dtype=np.uint8)
        self.sync = self.ctrl.win.Sync

    # -- windows

    def ensure_scratch(self, nbytes: int) -> None:
        """Grow the scratch window to hold ``nbytes`` per rank (collective; every rank
        calls it with the same value)."""
        if self.scratch is not None and self.scratch.nbytes >= nbytes:
            return
        size = max(_MIN_SCRATCH, 1 << max(nbytes - 1, 1).bit_length())
        if self.scratch is not None:
            self.scratch.free()
            self.scratch = None
        self.scratch = shared.allocate(self.comm, size, owner="shm scratch")

    def release(self) -> None:
        """Free the windows (with the communicator)."""
        if self.scratch is not None:
            self.scratch.free()
            self.scratch = None
        self.ctrl.free()

    # -- waiting

    def check_abort(self) -> None:
        failed = [q for q in range(self.size) if self.flags[q][_ABORT]]
        if failed:
            self.failed = failed
            self.broken = (
                f"rank(s) {failed} of this node group failed inside a shared-memory "
                f"all-reduce; this rank stops too (the failing rank's own error says why)")
            raise self.aborted()

    def aborted(self) -> CollectiveAbortedError:
        """The error every call raises once a rank of this node group has failed."""
        return CollectiveAbortedError(
            f"{self.broken}; the shared windows of this communicator are unusable — "
            f"continue on a fresh communicator (e.g. comm.Dup())", self.failed)

    def wait(self, q: int, word: int, target: int, what: str) -> None:
        """Return once rank ``q``'s counter ``word`` reaches ``target``."""
        flags = self.flags[q]
        if flags[word] >= target:
            return
        yield_, perf = os.sched_yield, time.perf_counter
        start = perf()
        polls = 0
        watch = stall.current()
        reported = False
        nap = False
        while flags[word] < target:
            polls += 1
            if not polls & 63:
                self.check_abort()
                waited = perf() - start
                nap = waited > _SPIN_BEFORE_SLEEP
                if watch is not None:
                    reported = self._watched(watch, q, word, target, what, waited, reported)
            if nap:
                time.sleep(_SLEEP)
            else:
                yield_()

    def _watched(self, watch: Any, q: int, word: int, target: int, what: str,
                 waited: float, reported: bool) -> bool:
        late = [p for p in range(self.size) if self.flags[p][word] < target and p != self.rank]
        if watch.timeout and waited > watch.timeout:
            self.mine[_ABORT] = 2
            self.broken = f"timed out in a shared-memory all-reduce ({what})"
            raise CollectiveTimeoutError(
                f"shared-memory all-reduce: rank {self.rank} of the node group waited "
                f"{waited:.0f} s for rank(s) {late} ({what}); giving up (timeout "
                f"{watch.timeout:g} s)", late)
        if watch.stall_check and waited > watch.stall_check and not reported:
            watch.report(
                f"[mpistrat] stall: rank {self.rank} of a node group has waited "
                f"{waited:.0f} s in a shared-memory all-reduce for rank(s) {late} ({what})")
            return True
        return reported

    def fail(self) -> None:
        """Mark this rank's abort word: peers waiting on it raise instead of hanging."""
        self.mine[_ABORT] = 1
        if self.broken is None:
            self.broken = "an earlier shared-memory all-reduce on this communicator failed"

    def chunk_tmp(self, nbytes: int) -> np.ndarray:
        if self._chunk_tmp.nbytes < nbytes:
            self._chunk_tmp = np.empty(nbytes, dtype=np.uint8)
        return self._chunk_tmp[:nbytes]


def _node(comm: Comm) -> _Node:
    cache = comm_cache(comm)
    node = cache.get("shm")
    if node is None:
        node = cache["shm"] = _Node(comm)
    return node


def _signature(kind: int, buf: np.ndarray, op: ReduceOp, root: int) -> int:
    text = f"{kind} {buf.size} {buf.dtype.str} {op.primitive.name} {root}"
    return zlib.crc32(text.encode()) + 1


def _location(node: _Node, array: np.ndarray | None) -> tuple[int, int]:
    """(uid, byte offset) of ``array`` in a shared block of this node group, or (0, 0)."""
    if array is None:
        return 0, 0
    found = shared.locate(array)
    if found is None or not found[0].serves(node.comm):
        return 0, 0
    return found[0].uid, found[1]


def _peer_view(node: _Node, q: int, uid: int, offset: int, count: int,
               dtype: np.dtype) -> np.ndarray:
    """Rank ``q``'s array published as (``uid``, ``offset``); uid 0 is its scratch."""
    if uid == 0:
        assert node.scratch is not None  # uid 0 is published once the scratch exists
        segment = node.scratch.segments[q]
    else:
        block = shared.block(uid)
        if block is None:  # a peer published a block this rank does not have
            raise MpistratError(
                f"rank {q} of the node group published shared block {uid}, unknown on "
                f"rank {node.rank}; were shared_empty calls made in different orders?")
        segment = block.segments[q]
    return segment[offset:offset + count * dtype.itemsize].view(dtype)


def _reduce_into(ufunc: Any, inputs: list[np.ndarray], dst: np.ndarray) -> None:
    """``dst = inputs[0] op inputs[1] op ...`` in rank order (the hook tests break)."""
    ufunc(inputs[0], inputs[1], out=dst)
    for more in inputs[2:]:
        ufunc(dst, more, out=dst)


class _SmallPlan:
    """What a small call of one signature needs, built once: its signature word, the
    views of every rank's two slots, and its ufunc."""

    __slots__ = ("signature", "views", "ufunc")

    def __init__(self, node: _Node, kind: int, out: np.ndarray, op: ReduceOp,
                 root: int) -> None:
        self.signature = _signature(kind, out, op, root)
        self.views = [[node.slots[q][p][:out.nbytes].view(out.dtype) for q in range(node.size)]
                      for p in (0, 1)]
        self.ufunc = UFUNCS[op.primitive]


def small_limit(ranks: int) -> int:
    """The largest all-reduce (bytes) that takes the one-step path in a node group of
    ``ranks``: :data:`SMALL_BYTES`, or less where reading ``ranks`` slots of it would pass
    :data:`SMALL_TOTAL_BYTES` (128 KiB on 4 ranks, 32 KiB on 16)."""
    return min(SMALL_BYTES, SMALL_TOTAL_BYTES // max(ranks, 1) // 64 * 64)


def _small(node: _Node, kind: int, x: np.ndarray, out: np.ndarray, op: ReduceOp,
           root: int) -> None:
    """One step: publish the input in this epoch's slot, wait for every peer's, and
    reduce the whole buffer from the slots in rank order (or copy the root's slot)."""
    key = (kind, out.size, out.dtype, op, root)
    plan = node.small_plans.get(key)
    if plan is None:
        plan = node.small_plans[key] = _SmallPlan(node, kind, out, op, root)
    epoch, r = node.epoch, node.rank
    parity = epoch & 1
    views = plan.views[parity]
    if kind != _KIND_BCAST or r == root:
        views[r][...] = x
    line = _ARRIVE[parity] * _W
    mine, flags = node.mine, node.flags
    mine[line + 1] = plan.signature
    node.sync()
    mine[line] = epoch
    for q in node.peers:
        node.wait(q, line, epoch, "arrival")
    node.sync()
    for q in node.peers:
        if flags[q][line + 1] != plan.signature:
            _mismatch()
    if kind == _KIND_BCAST:
        if r != root:
            out[...] = views[root]
    elif node.size == 1:
        out[...] = views[0]
    else:
        _reduce_into(plan.ufunc, views, out)


def _mismatch() -> None:
    raise CollectiveMismatchError(
        "shared-memory all-reduce: the ranks of this node group asked for different "
        "calls (size, dtype, op or root differ); every rank must call the same "
        "collective with the same arguments")


def _arrive(node: _Node, kind: int, buf: np.ndarray, op: ReduceOp, root: int,
            locations: tuple[int, ...]) -> list[tuple[int, int, int, int, int, int, int]]:
    """Publish this rank's call, wait for every peer's, and check they match.

    Returns every rank's arrival line (rank order) as ints: epoch, signature, input uid
    and offset, output uid and offset, input layout (0: contiguous)."""
    epoch = node.epoch
    line = _ARRIVE[epoch & 1] * _W
    mine = node.mine
    mine[line + 1] = _signature(kind, buf, op, root)
    mine[line + 2:line + 2 + len(locations)] = locations
    node.sync()
    mine[line] = epoch
    for q in range(node.size):
        if q != node.rank:
            node.wait(q, line, epoch, "arrival")
    node.sync()
    lines = [tuple(node.flags[q][line:line + 7].tolist()) for q in range(node.size)]
    if len({entry[1] for entry in lines}) > 1:
        _mismatch()  # every rank raises here, alike; the windows stay consistent
    return lines


def _host_only(backend: ArrayBackend) -> None:
    if getattr(backend, "name", None) != "numpy":
        raise BackendUnavailable(
            "the 'shm' algorithm reduces host memory (NumPy arrays); for GPU buffers use "
            "'nccl' or a staged algorithm such as 'xring'")


def _begin(comm: Comm) -> _Node:
    node = _node(comm)
    if node.broken is None:
        try:
            node.check_abort()  # a peer failed after this rank finished its last call
        except CollectiveAbortedError:
            pass
    if node.broken is not None:
        raise node.aborted()
    node.epoch += 1
    return node


def _slices(count: int, size: int, itemsize: int) -> tuple[list[int], int, int]:
    align = max(1, 64 // itemsize)
    per = -(-count // size)
    per = -(-per // align) * align
    bounds = [min(q * per, count) for q in range(size + 1)]
    chunk = max(align, CHUNK_BYTES // itemsize)
    return bounds, chunk, -(-per // chunk) if per else 0


def _pieces(x: np.ndarray | None, src: Source | None, lo: int,
            hi: int) -> list[tuple[int, int, np.ndarray]]:
    """``(start, stop, array)`` pieces of this rank's input ``[lo, hi)``: one slice of
    ``x``, or the pieces of the tensors of ``src``."""
    if src is None:
        assert x is not None  # the input is x when there is no src
        return [(lo, hi, x[lo:hi])]
    return [(at, at + b - a, src.segments[index][a:b]) for index, a, b, at in src.pieces(lo, hi)]


class _Layout:
    """Where the tensors of a Source lie in one shared block: the block, the byte offset
    of the first tensor, every tensor's byte offset from the first, and a word that
    ranks compare to know their layouts are the same (never 0)."""

    __slots__ = ("uid", "offset", "relative", "word")

    def __init__(self, uid: int, offset: int, relative: list[int]) -> None:
        self.uid, self.offset, self.relative = uid, offset, relative
        digest = hashlib.blake2b(np.asarray(relative, dtype=np.int64).tobytes(), digest_size=8)
        self.word = (int.from_bytes(digest.digest(), "little") >> 2) + 1


def _layout(node: _Node, src: Source) -> _Layout | None:
    """The layout of ``src``'s tensors when all lie in one shared block of this node group
    (e.g. gradients from :func:`mpistrat.shared_arrays`, with gaps where tensors of
    other packs sit), else None."""
    found = shared.locate(src.segments[0])
    if found is None or not found[0].serves(node.comm):
        return None
    block, first = found
    relative = []
    for segment in src.segments:
        start = segment.__array_interface__["data"][0] - block.base \
            if isinstance(segment, np.ndarray) and segment.flags.c_contiguous else -1
        if start < 0 or start + segment.nbytes > block.nbytes:
            return None
        relative.append(start - first)
    return _Layout(block.uid, first, relative)


def _peer_segments(node: _Node, q: int, line: tuple[int, ...], layout: _Layout,
                   src: Source) -> list[np.ndarray]:
    """Rank ``q``'s tensors, laid out in its block as this rank's are in its own."""
    block = shared.block(line[2])
    if block is None:
        raise MpistratError(
            f"rank {q} of the node group published shared block {line[2]}, unknown on "
            f"rank {node.rank}; were shared_empty calls made in different orders?")
    segment, at = block.segments[q], line[3]
    return [segment[at + rel:at + rel + s.nbytes].view(s.dtype)
            for rel, s in zip(layout.relative, src.segments)]


def _reduce(node: _Node, x: np.ndarray | None, out: np.ndarray, op: ReduceOp,
            root: int | None, src: Source | None = None) -> None:
    """The all-reduce (``root`` None) or reduce-to-root of ``x`` — or of the tensors of
    ``src`` — into ``out``."""
    n, r = node.size, node.rank
    kind = _KIND_ALL if root is None else _KIND_ROOT
    nbytes = out.nbytes
    epoch = node.epoch
    if nbytes <= small_limit(n):
        if src is not None:
            x = node.chunk_tmp(nbytes).view(out.dtype)
            for a, b, piece in _pieces(None, src, 0, out.size):
                x[a:b] = piece
        assert x is not None  # the input is x when there is no src
        _small(node, kind, x, out, op, root or 0)
        return
    ufunc = UFUNCS[op.primitive]

    layout = _layout(node, src) if src is not None else None
    in_uid, in_off = (layout.uid, layout.offset) if layout is not None else _location(node, x)
    out_uid, out_off = _location(node, out)
    lines = _arrive(node, kind, out, op, root or 0,
                    (in_uid, in_off, out_uid, out_off, layout.word if layout else 0))
    # Whose input is read where it lies: a shared buffer, or tensors in a shared block when
    # every rank's lie alike (a peer maps them with this rank's layout); the others copy
    # in. Every rank decides from the same lines, so all decide alike.
    words = {entry[6] for entry in lines}
    segmented = len(words) == 1 and 0 not in words
    in_place = [entry[2] != 0 and (entry[6] == 0 or segmented) for entry in lines]
    if not all(in_place) or any(entry[4] == 0 for entry in lines):
        node.ensure_scratch(nbytes)
    count, dtype = out.size, out.dtype
    peers: list[Any]  # rank q's tensors, None at q == r
    inputs: list[Any]  # rank q's input, None at q == r
    if segmented:
        assert layout is not None and src is not None  # one nonzero layout word, as ours
        peers = [None if q == r else _peer_segments(node, q, lines[q], layout, src)
                 for q in range(n)]
    else:
        inputs = [None if q == r else  # (uid 0, offset 0: the peer's scratch, where it copied in)
                  _peer_view(node, q, *(lines[q][2:4] if in_place[q] else (0, 0)), count, dtype)
                  for q in range(n)]
    results = [_peer_view(node, q, lines[q][4], lines[q][5], count, dtype)
               for q in range(n)]
    copy_in = not in_place[r]
    staged = [q for q in range(n) if q != r and not in_place[q]]
    # my scratch, where peers read their slices of my input when it is not shared
    own_staging = _peer_view(node, r, 0, 0, count, dtype) if copy_in else None
    bounds, chunk, nchunks = _slices(count, n, out.itemsize)
    tag = epoch << 32
    mine, wait, sync = node.mine, node.wait, node.sync
    lo_r, hi_r = bounds[r], bounds[r + 1]
    alias = src is None and r >= 2 and np.may_share_memory(results[r], x)
    # every output shared: a rank writes its reduced chunk into every output while the
    # chunk is in its cache, instead of every rank reading it back from the owner's
    push = root is None and all(entry[4] != 0 for entry in lines)
    gathers = not push and (root is None or root == r)  # (pull: copies the others' slices)
    for k in range(nchunks + 1):
        if k < nchunks:
            if copy_in:
                assert own_staging is not None  # (made when copy_in)
                for q in range(n):
                    if q != r:
                        lo = bounds[q] + k * chunk
                        hi = min(lo + chunk, bounds[q + 1])
                        for a, b, piece in _pieces(x, src, lo, hi):
                            own_staging[a:b] = piece
                sync()
                mine[_COPIED] = tag + k + 1
            lo = lo_r + k * chunk
            hi = min(lo + chunk, hi_r)
            if lo < hi:
                for q in staged:
                    wait(q, _COPIED, tag + k + 1, "copy-in")
                sync()
                dst = results[r][lo:hi]
                if alias:  # writing my input before reading all of it: go through a temp
                    dst = node.chunk_tmp(dst.nbytes).view(dtype)
                if segmented:  # every rank's tensors, piece by piece
                    assert src is not None  # (segmented only with a src)
                    for index, a, b, at in src.pieces(lo, hi):
                        _reduce_into(ufunc, [src.segments[index][a:b] if q == r else
                                             peers[q][index][a:b] for q in range(n)],
                                     dst[at - lo:at - lo + b - a])
                else:
                    for a, b, piece in _pieces(x, src, lo, hi):
                        _reduce_into(ufunc, [piece if q == r else inputs[q][a:b]
                                             for q in range(n)], dst[a - lo:b - lo])
                if alias:
                    results[r][lo:hi] = dst
                if push:
                    for q in node.peers:
                        results[q][lo:hi] = dst
                if out_uid == 0 and gathers:
                    out[lo:hi] = results[r][lo:hi]
            sync()
            mine[_REDUCED] = tag + k + 1
        if k and gathers:
            for q in range(n):
                if q != r:
                    lo = bounds[q] + (k - 1) * chunk
                    hi = min(lo + chunk, bounds[q + 1])
                    if lo < hi:
                        wait(q, _REDUCED, tag + k, "reduction")
                        sync()
                        out[lo:hi] = results[q][lo:hi]
    if push:
        # a peer's last push into this rank's output is its last access of this call
        for q in node.peers:
            wait(q, _REDUCED, tag + nchunks, "reduction")
        sync()
        return
    _finish(node, tag)


def _finish(node: _Node, tag: int) -> None:
    node.sync()
    node.mine[_DONE] = tag
    for q in range(node.size):
        if q != node.rank:
            node.wait(q, _DONE, tag, "the end of the call")


def _guarded(node: _Node, body: Any, *args: Any) -> None:
    try:
        body(node, *args)
    except (CollectiveMismatchError, CollectiveAbortedError):
        raise  # every rank raises the first; the second is already a peer's failure
    except BaseException:
        node.fail()
        raise


def _call(comm: Comm, buf: Any, op: ReduceOp, backend: ArrayBackend, root: int | None,
          source: Source | None) -> None:
    """Reduce ``buf`` — or ``source`` into ``buf`` — onto every rank (``root`` None) or
    onto ``root``: what it reduces is ``buf`` itself, the one buffer ``source``'s tensors
    are views of (read in place when it is shared), or ``source`` as tensors to copy in
    from."""
    _host_only(backend)
    if comm.Get_size() == 1 or buf.size == 0:
        if source is not None:
            source.copy_into(buf, backend=backend)
        return
    node = _begin(comm)
    x, src = buf, None
    if source is not None:
        x = source.joined()
        src = source if x is None else None
    _guarded(node, _reduce, x, buf, op, root, src)


def all_reduce(comm: Comm, buf: Any, *, op: ReduceOp, shards: int = 1, backend: ArrayBackend,
               rotation: int = 0, source: Source | None = None) -> None:
    """All-reduce ``buf`` in place over the ranks of ``comm`` (one node) through shared
    memory — or reduce ``source`` into ``buf``: its tensors are copied straight into the
    shared window (the copy-in), or read in place when they are views of one shared
    array (``shards``, ``rotation`` ignored)."""
    _call(comm, buf, op, backend, None, source)


def reduce_to_root(comm: Comm, buf: Any, *, op: ReduceOp, backend: ArrayBackend, root: int = 0,
                   source: Source | None = None) -> None:
    """Reduce ``buf`` (or ``source``, as :func:`all_reduce`) onto ``root``'s ``buf``
    through shared memory (other ranks skip the copy-out; their buffers are left partly
    reduced)."""
    _call(comm, buf, op, backend, root, source)


def _broadcast(node: _Node, buf: np.ndarray, root: int) -> None:
    r, epoch = node.rank, node.epoch
    nbytes = buf.nbytes
    if nbytes <= SMALL_BYTES:
        _small(node, _KIND_BCAST, buf, buf, ReduceOp.SUM, root)
        return
    uid, offset = _location(node, buf) if r == root else (0, 0)
    lines = _arrive(node, _KIND_BCAST, buf, ReduceOp.SUM, root, (uid, offset, 0, 0))
    root_uid = lines[root][2]
    if root_uid == 0:
        node.ensure_scratch(nbytes)
    tag = epoch << 32
    step = max(1, CHUNK_BYTES * node.size // buf.itemsize)
    count = buf.size
    if r == root:
        if root_uid == 0:
            assert node.scratch is not None  # (ensure_scratch above)
            staging = node.scratch.segments[r][:nbytes].view(buf.dtype)
            for k, lo in enumerate(range(0, count, step)):
                staging[lo:lo + step] = buf[lo:lo + step]
                node.sync()
                node.mine[_COPIED] = tag + k + 1
    else:
        source = _peer_view(node, root, root_uid, lines[root][3], count, buf.dtype)
        for k, lo in enumerate(range(0, count, step)):
            if root_uid == 0:
                node.wait(root, _COPIED, tag + k + 1, "broadcast")
                node.sync()
            buf[lo:lo + step] = source[lo:lo + step]
    _finish(node, tag)


def broadcast(comm: Comm, buf: Any, *, backend: ArrayBackend, root: int = 0) -> None:
    """Copy ``root``'s ``buf`` to every rank of ``comm`` (one node) through shared memory."""
    _host_only(backend)
    if comm.Get_size() == 1 or buf.size == 0:
        return
    node = _begin(comm)
    _guarded(node, _broadcast, buf, root)
