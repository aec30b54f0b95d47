"""Snapshots of an elastic job: a :class:`~mpistrat.checkpoint.Checkpoint`'s state kept
in each host's RAM (``/dev/shm``) at every step boundary, so that a relaunch on the hosts
that remain resumes where the lost launch was, not at the last checkpoint on disk.

In synchronous data-parallel training every rank holds the whole state, so one rank per
host (the host's lowest) writes it, into that host's own directory: every host holds a
complete copy, and whichever host is lost, each survivor's copy is its partner copy. The
other ranks write nothing, except where the state is large (:data:`._shares.SHARE_BYTES`):
then the host's ranks each copy a share of it side by side, and the writer commits the
slot once every share's checksums are on the host's board (:mod:`._shares`).

Layout, in ``$MPISTRAT_ELASTIC_DIR`` (default ``/dev/shm``, else the temporary
directory)::

    mpistrat-elastic-<uid>-<job id>/        (0700, this user's)
        <host>/layout.json                  (names, dtypes, shapes, places; HMAC)
        <host>/slot-0.data  slot-1.data     (a commit record, then the values)
        <host>/shares.board                 (the shares' checksums, where shared)

Two slots alternate: snapshot ``n`` goes to slot ``n % 2``, a file mapped into the
writer's memory once, so that taking a snapshot makes no system call. Its commit record
(the sequence number, the input position, the generators' states, the values' checksums,
and an HMAC of all of it and the layout under the job's secret) is zeroed first, then the
values are copied, then the record is written, its HMAC last. A rank killed at any
moment leaves the other slot's snapshot committed, and never a record that describes
values being overwritten (its HMAC no longer matches).

Everything read is untrusted input: the layout is at most :data:`MAX_LAYOUT` bytes, read
without following links from a regular file of this user's, authenticated, and must
describe the checkpoint's own objects (names, kinds, dtypes, shapes) in places that do
not overlap; a slot's record must be committed, authentic, its fields in range, and
every value must match its checksum. A snapshot that fails any check is skipped with its
reason, and the restore takes the newest one that passes on any host (or, when none
does, the newest checkpoint on disk).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import mmap
import os
import re
import shutil
import socket
import stat
import struct
import tempfile
import threading
import time
import warnings
import weakref
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._atomic import write_atomically
from ..backends.interop import to_host
from ..elastic import hooks
from ..elastic.env import ElasticEnv
from ..runtime import recorder
from ..runtime._mpi import Comm
from . import _random, _shares
from .checkpoint import (
    Checkpoint,
    _assign,
    _describe,
    _is_tensor,
    _kind,
    _on_chief,
    _parse_dtype,
    _storable,
    _torch,
    _value,
)

__all__ = ["SnapshotStore", "SnapshotInfo", "DIR_ENV", "MAX_LAYOUT", "KEEP_ENV",
           "BACKGROUND_BYTES", "snapshot_root", "job_directory", "remove_job"]

DIR_ENV = "MPISTRAT_ELASTIC_DIR"
KEEP_ENV = "MPISTRAT_ELASTIC_KEEP"  # hours an abandoned job's snapshots stay (default 24)
FORMAT = "mpistrat.snapshot"
VERSION = 2
MAX_LAYOUT = 1 << 22
_CRC_BYTES = 16 << 10  # from this size on the word sums are faster than CRC-32 (_checksum)
# values that take less than this together (with their alignment) get one checksum: a
# small model's snapshot checksums one block instead of calling CRC-32 per value
_TOGETHER_BYTES = 1 << 20
BACKGROUND_BYTES = 1 << 20  # variables of at least this much are copied in the background
_MAGIC = b"MPSNAP01"
_HEADER = struct.Struct("<8sQQ32s")  # magic, sequence (0: none), record length, HMAC
_NO_MAC = bytes(32)
_ALIGN = 64
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_HOST = re.compile(r"[^A-Za-z0-9._-]")
# stores whose snapshot is being written in the background (restore waits for them)
_IN_FLIGHT: weakref.WeakSet[SnapshotStore] = weakref.WeakSet()
# leaves the layout places no value of: a generator's state is in the commit record, a
# stateful object's arrays and tree past the layout's values (see SnapshotStore.take)
_NO_VALUE = ("generator", "stateful")
# the most pieces of the stateful leaves' arrays one share of a snapshot may have (a
# board record's room); beyond, the writer copies them whole, alone
_STATE_PIECES = 1024


@dataclass(frozen=True)
class SnapshotInfo:
    """A snapshot restored (:meth:`SnapshotStore.restore`).

    Attributes:
        path: its slot's data file, on the host it was read from.
        sequence: its number (one per snapshot taken in the job, across launches).
        world_size: the number of ranks that took it.
        position: the input pipeline's position then (see :mod:`mpistrat.elastic.hooks`).
        skipped: the snapshots found but not used, each with its reason.
        finished: the iterators that had run to their end before it (``(kind, batches)``,
            oldest first; :func:`mpistrat.elastic.hooks.finished`).
    """

    path: str
    sequence: int
    world_size: int
    position: tuple[str, int] | None
    skipped: tuple[str, ...] = ()
    finished: tuple[tuple[str, int], ...] = ()


@dataclass
class _Slot:
    path: str  # the data file
    fd: int = -1
    map: mmap.mmap | None = None
    data: memoryview | None = None  # the whole mapping
    views: list[np.ndarray] = field(default_factory=list)  # each value's place in it
    raw: list[memoryview] = field(default_factory=list)  # the values' blocks (_blocks)
    # the snapshot's checksum blocks: ``raw``, then the stateful leaves' arrays (or their
    # pieces, where shared); and the checksums the copies computed as they went (None:
    # computed at the commit), one per block
    blocks: list[memoryview] = field(default_factory=list)
    sums: list[int | None] = field(default_factory=list)


@dataclass(eq=False)
class SnapshotStore:
    """The snapshots of ``checkpoint`` in an elastic job's ``launch`` (collective to
    create: the ranks learn who writes on each host, and a directory that cannot be
    used is the same error on every rank).

    Args:
        checkpoint: the state.
        launch: the job's launch (its id names the directory).
        secret: the job's secret (the HMAC key).
        comm: the job's communicator (default: the checkpoint's).
        root: the directory the job's snapshot directory goes in (default
            ``$MPISTRAT_ELASTIC_DIR``, else ``/dev/shm``, else the temporary directory).
        background: copy mpistrat's variables of at least :data:`BACKGROUND_BYTES` in
            all, checksum and commit in a thread while training goes on (see
            :meth:`take`); False: before :meth:`take` returns.

    Raises:
        PermissionError: the directory is not this user's private one (on every rank).
    """

    checkpoint: Checkpoint
    launch: ElasticEnv
    secret: bytes = field(repr=False)
    comm: Comm | None = None
    root: str | None = None
    background: bool = True
    sequence: int = 0  # the newest snapshot taken or restored
    taken: int = 0  # snapshots this process wrote
    seconds: float = 0.0  # time take() took here (the training's share of their cost)

    def __post_init__(self) -> None:
        if self.comm is None:
            self.comm = self.checkpoint.comm
        host = socket.gethostname()
        # each leaf's kind, once: an object keeps its kind (a torch one exists only once
        # torch is imported), and take() runs at every step boundary
        self._kinds = [(name, obj, _kind(obj)) for name, obj in self.checkpoint._leaves]
        rank = self.comm.Get_rank()
        hosts = self.comm.allgather(host)
        local = [r for r, h in enumerate(hosts) if h == host]
        # a sharded optimizer's state (a ZeroRedundancyOptimizer's, which each host's
        # ranks hold between them): each rank copies its own share, where the ranks that
        # hold it are the host's and can all share its snapshots; else it is gathered on
        # every host's writer
        torch_leaves = _torch() if any(k == "stateful" for _, _, k in self._kinds) else None
        sharded = [(name, obj) for name, obj, kind in self._kinds if kind == "stateful"
                   and torch_leaves is not None and torch_leaves.needs_gather(obj)]
        fits = len(local) <= _shares.MAX_SHARERS
        owned_params = 0
        for _, obj in sharded:
            if torch_leaves is not None and torch_leaves.sharded(obj):
                fits = obj.shard_comm.allgather(rank) == local and fits
                owned_params += obj.shard_params()
            else:
                fits = False
        facts = self.comm.allgather((fits, owned_params, self._generators_room(),
                                     self._values_bytes(), self._states_bytes()))
        owned = bool(sharded) and all(fact[0] for fact in facts)
        self._sharded = {name for name, _ in sharded} if owned else set()
        self._shard_texts: dict[str, tuple[list[bytes], list[Any]]] = {}  # (the last seen)
        self._owners: dict[str, list[int | None]] = {}  # each array's share, if its own
        self._gathered = bool(sharded) and not owned
        self._size = self.comm.Get_size()
        self.writer = hosts.index(host) == rank  # this host's lowest rank
        self._writers = sorted({hosts.index(h) for h in hosts})  # every host's
        self._host_writer = hosts.index(host)
        # (every rank's layout the same: the generators' room is the largest any needs)
        self._room = max(fact[2] for fact in facts)
        # a large state is copied by the host's ranks side by side (_shares), where every
        # rank holds the same values; the stateful leaves' states too (but a sharded
        # optimizer's: each rank copies its own share, or the writers the gathered state)
        same = len({fact[3:] for fact in facts}) == 1
        states_bytes = 0 if self._gathered else facts[0][4]
        large = same and facts[0][3] + states_bytes >= _shares.SHARE_BYTES
        self._share_states = large and not self._gathered and facts[0][4] > 0
        self._parts = min(len(local), _shares.MAX_SHARERS) if large or owned else 1
        self._part = local.index(rank) if local.index(rank) < self._parts else -1
        self._sharing = (large or owned) and any(hosts.count(h) > 1 for h in hosts)
        self._board: _shares.Board | None = None
        self._pieces: list[list[tuple[int, _shares.Piece]]] | None = None  # each share's
        self._written = [0, 0]  # the snapshot a sharer wrote last into each slot
        root = snapshot_root(self.root)
        self.job_directory = job_directory(self.launch.job, root)
        self.directory = os.path.join(self.job_directory, _HOST.sub("_", host)[:64] or "host")
        self._slots = [_Slot(os.path.join(self.directory, f"slot-{i}.data")) for i in (0, 1)]
        self._layout: dict[str, Any] | None = None  # written by this process
        self._thread: threading.Thread | None = None
        self._warned = False
        self._next_slot = 0
        self._background = 0.0  # seconds the last snapshot's background work took
        self.last_cost = 0.0  # seconds the last take() took here
        self.skipped: tuple[str, ...] = ()  # what the last restore() found and skipped
        problem = None
        if self._parts > 1:
            values = sum(1 for _, _, kind in self._kinds if kind not in _NO_VALUE)
            room = values + (_STATE_PIECES + 1 if self._share_states else 0)
            if self._sharded:  # (each owned parameter's arrays: Adam's are 3, AMSGrad's 4)
                room += 1 + 4 * max(fact[1] for fact in facts)
            self._board = _shares.Board(os.path.join(self.directory, "shares.board"),
                                        self._parts, room)
        if self.writer:
            try:
                _private_directory(self.job_directory)
                _private_directory(self.directory)
                if self._board is not None:
                    self._board.create()
                    self._board.open()
            except OSError as exc:
                problem = f"{type(exc).__name__}: {exc}"
        problems = [p for p in self.comm.allgather(problem) if p is not None]
        if self._sharing:  # (the sharers map the board the writers made)
            if not problems and self._board is not None and self._part > 0:
                try:
                    self._board.open()
                except (OSError, ValueError) as exc:
                    problem = f"{type(exc).__name__}: {exc}"
            problems += [p for p in self.comm.allgather(problem) if p is not None]
        if problems:
            raise PermissionError(f"elastic snapshots cannot be kept in {root}: "
                                  f"{problems[0]}")
        if self.writer:
            _sweep(root, self.job_directory)

    @property
    def collective(self) -> bool:
        """Whether every rank must take every snapshot or none: a host's ranks copy
        shares of a large state (:mod:`._shares`) or each its own share of a sharded
        optimizer's (a ZeroRedundancyOptimizer's), or such a state is gathered on every
        host's writer at each snapshot."""
        return self._sharing or self._gathered

    @property
    def _states_everywhere(self) -> bool:
        """Whether every sharer expands the stateful leaves too (to copy a share of
        them, or its own share of a sharded optimizer's state)."""
        return self._parts > 1 and (self._share_states or bool(self._sharded))

    def _generators_room(self) -> int:
        """What this rank's generators' states take in a commit record, with room to
        spare: twice their length, in whole 4 KiB (a state's length varies a little with
        its numbers: the layout, which it sizes, stays the same from one launch to the
        next)."""
        return sum(-(-2 * len(json.dumps(_random.get_state(obj))) // 4096) * 4096
                   for _, obj, kind in self._kinds if kind == "generator")

    def _states_bytes(self) -> int:
        """The bytes of the stateful leaves' tensors now (an optimizer's grow at its
        first step), but a sharded optimizer's."""
        return sum(_torch().nbytes(obj) for _, obj, kind in self._kinds
                   if kind == "stateful" and not _torch().needs_gather(obj))

    def _values_bytes(self) -> int:
        """The bytes of the layout's values (without copying them)."""
        total = 0
        for _, obj, kind in self._kinds:
            if kind not in _NO_VALUE:
                dtype, shape = _describe(obj)
                total += _nbytes(_parse_dtype(dtype), shape)
        return total

    @property
    def layout_path(self) -> str:
        """This host's layout file (the names, dtypes, shapes and places of the values)."""
        return os.path.join(self.directory, "layout.json")

    # -- taking

    def take(self, position: tuple[str, int] | None, number: int | None = None) -> None:
        """Write snapshot ``number`` (default ``sequence + 1``; the step boundary's
        number in the job, the same on every rank, so that hosts' snapshots compare) of
        the current state into the slot the newest one is not in (on this host's writer;
        the other ranks only count it, or each copy their share of a large state: then,
        as where :attr:`collective` says so for another reason, every rank takes every
        snapshot).

        Its commit record is invalidated first, then the values are copied, checksummed,
        and the record rewritten, its HMAC last (module docstring). In the background
        (large states), mpistrat's host variables are copied by a thread; the first
        write to any of them (the next update) waits until the copy is done
        (:func:`mpistrat.elastic.hooks.before_write`), so the snapshot holds this
        boundary's state. Other leaves (NumPy arrays, which the script may change in
        place, scalars, generators, GPU values) are copied before this returns.

        Traced (:mod:`mpistrat.trace`) as a span ``snapshot``, its background work as
        ``snapshot copy`` on its thread, and a write's wait for it as ``snapshot fence
        wait``."""
        t = recorder.begin()
        if not t:
            self._take(position, number)
            return
        done = (0, False)
        try:
            done = self._take(position, number)
        finally:
            recorder.end(t, "snapshot", recorder.CHECKPOINT,
                         {"sequence": self.sequence, "writer": self.writer,
                          "bytes": done[0], "background": done[1]})

    def _take(self, position: tuple[str, int] | None, number: int | None) -> tuple[int, bool]:
        """:meth:`take`; (the bytes of the slot written here, whether its copy goes on in
        the background)."""
        self.sequence = self.sequence + 1 if number is None else number
        started = time.perf_counter()
        states = self._expand_states()  # (collective for a sharded optimizer)
        if self._part < 0 or (self._parts == 1 and not self.writer):
            return 0, False
        self.wait()  # (the previous snapshot is committed: snapshots commit in order)
        values: list[tuple[np.ndarray, bool]] = []
        generators: dict[str, Any] = {}
        for name, obj, kind in self._kinds:
            if kind == "generator":
                if self.writer:
                    generators[name] = _random.get_state(obj)
            elif kind != "stateful":
                values.append(_host_value(obj))
        # (a slot's first snapshot creates and faults in its memory: not what the next
        # ones cost, which --snapshot-every auto weighs)
        fresh = self._layout is None or self._slots[self._next_slot].map is None
        layout = self._layout_for(values)
        places, index, size = _place_states(states, layout["size"], self._owners)
        # (then the states' checksums, past their index: a model's hundreds of arrays do
        # not fit the record's room, which the layout fixes before any state exists)
        room = _sums_room(places, self._parts) if states else 0
        slot_index = self._next_slot
        slot = self._slots[slot_index]
        self._next_slot = 1 - self._next_slot
        if self._part > 0:
            self._await_writer(slot_index)
        try:
            data = self._mapped(slot, layout, size + room)
        except OSError as exc:
            if self.writer:
                raise
            self._give_up(slot_index, self.sequence, exc)  # (the writer's is the error)
            return 0, False
        _HEADER.pack_into(data, 0, _MAGIC, 0, 0, _NO_MAC)  # (invalid until committed)
        fenced = sum(v.nbytes for v, f in values if f)
        later = self.background and fenced >= BACKGROUND_BYTES
        copies, owners = self._value_copies(slot, layout, values)
        state_copies, state_owners, state_parts = self._state_copies(slot, data, states,
                                                                     places)
        copies += state_copies
        owners = [mine + theirs for mine, theirs in zip(owners, state_owners)]
        # (the sharers' states must be the writer's: their structure's digest goes along)
        digest = int.from_bytes(hashlib.sha256(index).digest()[:24], "little") \
            if states and self._states_everywhere else None
        if not self.writer:  # (a share of the host's: its checksums go on the board)
            self._start(slot, copies, later, self._post,
                        (slot_index, self.sequence, owners[self._part], digest), started,
                        fresh)
            return sum(target.nbytes for _, target, _, _ in copies), later
        extra = {"sequence": self.sequence, "world_size": self._size,
                 "launch": self.launch.restart, "save_counter": self.checkpoint.save_counter,
                 "position": list(position) if position is not None else None,
                 "finished": [list(item) for item in hooks.finished()],
                 "generators": generators, "created": time.time(), "parts": self._parts,
                 "state_parts": state_parts}
        if states:
            # the stateful leaves' arrays, then the index that describes them, past the
            # layout's values: their structure may change from one snapshot to the next,
            # the layout (and the other slot's snapshot) stays
            at = size - len(index)
            data[at:size] = index
            extra["states"] = {"size": size, "index": [at, len(index)],
                               "sha256": hashlib.sha256(index).hexdigest(),
                               "sums": [size, room]}  # (its place, then what it holds)
        if self.taken % 64 == 0:
            os.utime(self.job_directory)  # (a live job's snapshots are never swept)
        self._start(slot, copies, later, self._commit,
                    (slot_index, layout, extra, owners, digest), started, fresh)
        return size, later

    def _value_copies(self, slot: _Slot, layout: dict[str, Any],
                      values: list[tuple[np.ndarray, bool]]
                      ) -> tuple[list[tuple[int, np.ndarray, np.ndarray, bool]],
                                 list[list[int]]]:
        """What this rank copies of the layout's values into ``slot``: ``(block, place,
        value, fenced)`` each, ``block`` the index of its own checksum among the slot's
        (-1 when it shares one with other values: small ones, checked together); and
        each share's blocks. One per value on a host whose writer copies alone; this
        rank's share of the values' bytes where the host's ranks share the copy
        (:mod:`._shares`)."""
        if self._parts == 1:
            alone = len(slot.raw) == len(slot.views)
            return ([(i if alone else -1, target, _whole(value), fence)
                     for i, (target, (value, fence)) in enumerate(zip(slot.views, values))],
                    [list(range(len(slot.raw)))])
        if self._pieces is None:
            self._pieces = _pieces(layout, self._parts)
        copies = []
        for block, piece in self._pieces[self._part]:
            value, fence = values[piece.value]
            place = slot.views[piece.value].reshape(-1).view(np.uint8)
            copies.append((block, place[piece.start:piece.stop],
                           _piece_of(value, piece.start, piece.stop), fence))
        return copies, [[block for block, _ in share] for share in self._pieces]

    def _state_copies(self, slot: _Slot, data: memoryview,
                      states: list[tuple[str, Any, list[Any]]],
                      places: dict[str, dict[str, Any]]
                      ) -> tuple[list[tuple[int, np.ndarray, np.ndarray, bool]],
                                 list[list[int]], int]:
        """The stateful leaves' part of a snapshot: this rank's copies (as
        :meth:`_value_copies`'), each share's blocks, and how many ranks share the arrays
        every rank holds: the host's sharers where every rank expanded its own replica (a
        piece each, cut as the values are), else 1 (the writer copies each such array
        whole). A sharded optimizer's arrays are copied whole by the rank that holds
        them (:func:`_cut_shares`). Sets the slot's ``blocks``: the values', then these."""
        entries = [entry for place in places.values() for entry in place["arrays"]]
        arrays = [array for _, _, found in states for array in found]
        cut = self._share_states and self._parts > 1
        shares = _cut_shares(entries, self._parts, cut)
        if cut and max(sum(1 for p in share if "owner" not in entries[p.value])
                       for share in shares) > _STATE_PIECES:
            cut, shares = False, _cut_shares(entries, self._parts, False)
        slot.blocks = list(slot.raw)
        copies: list[tuple[int, np.ndarray, np.ndarray, bool]] = []
        owners = []
        for j, share in enumerate(shares):
            owners.append(list(range(len(slot.blocks), len(slot.blocks) + len(share))))
            for piece in share:
                entry = entries[piece.value]
                whole = piece.start == 0 and piece.stop == entry["nbytes"]
                if whole:
                    place = _view(data, entry)
                else:
                    start = entry["offset"] + piece.start
                    place = np.frombuffer(data[start:start + piece.stop - piece.start],
                                          np.uint8)
                if j == self._part:  # (a device tensor's piece comes to the host alone)
                    array = arrays[piece.value]
                    source = _whole(array) if whole else \
                        _piece_of(array, piece.start, piece.stop)
                    copies.append((len(slot.blocks), place, source, False))
                slot.blocks.append(_bytes(place))
        return copies, owners, self._parts if cut else 1

    def _start(self, slot: _Slot, copies: list[tuple[int, np.ndarray, np.ndarray, bool]],
               later: bool, finish: Any, args: tuple[Any, ...], started: float,
               fresh: bool) -> None:
        """Copy ``copies`` (each computing its checksum as it goes), except the fenced
        ones when ``later``, then ``finish(slot, *args, deferred, copied)``: now, or in a
        thread that copies the ``deferred`` ones first (the fence held until it has)."""
        slot.sums = [None] * len(slot.blocks)
        for block, target, value, fence in copies:
            if not (later and fence):
                if block >= 0:
                    slot.sums[block] = _copy_summed(target, value)
                else:
                    np.copyto(target, value, casting="no")
        if not later:
            finish(slot, *args, [])
        else:
            deferred = [(block, t, v) for block, t, v, fence in copies if fence]
            copied = threading.Event()
            hooks.set_fence(copied.wait)
            self._thread = threading.Thread(
                target=finish, args=(slot, *args, deferred, copied),
                name="mpistrat-snapshot", daemon=True)
            _IN_FLIGHT.add(self)
            self._thread.start()
        self.taken += 1
        cost = time.perf_counter() - started
        # what --snapshot-every auto weighs: this one's time here and the last background
        # work's (it overlaps a step only where a core is free, so it counts in full)
        self.last_cost = 0.0 if fresh else cost + (self._background if later else 0.0)
        self.seconds += cost

    def _copy_deferred(self, slot: _Slot, sequence: int,
                       deferred: list[tuple[int, np.ndarray, np.ndarray]],
                       copied: threading.Event | None) -> None:
        """Copy the ``deferred`` values (``(block, place, value)``: ``block`` the index of
        the value's own checksum, -1 when it shares one) and release the fence (traced as
        ``snapshot copy`` in the background)."""
        t = recorder.begin() if copied is not None else 0  # (the background's)
        try:
            for block, target, value in deferred:
                if block >= 0:
                    slot.sums[block] = _copy_summed(target, value)
                else:
                    np.copyto(target, value, casting="no")
        finally:
            if copied is not None:
                hooks.set_fence(None)
                copied.set()
            if t:
                recorder.end(t, "snapshot copy", recorder.CHECKPOINT,
                             {"sequence": sequence,
                              "bytes": sum(v.nbytes for _, _, v in deferred)})

    def _await_writer(self, slot_index: int) -> None:
        """A sharer is about to write its share of the next snapshot into a slot: until
        the writer is done with the snapshot this sharer wrote there last (committed, or
        given up), so that a sharer that runs ahead (no collective between two
        snapshots) never overwrites a share the writer has yet to commit."""
        assert self._board is not None
        last = self._written[slot_index]
        if last:
            try:
                self._board.collect(slot_index, 0, last, time.monotonic() + _shares.WAIT_S)
            except (TimeoutError, ValueError):
                pass  # (the writer gave up on it, or ended: nothing left to protect)
        self._written[slot_index] = self.sequence

    def _post(self, slot: _Slot, slot_index: int, sequence: int, blocks: list[int],
              digest: int | None, deferred: list[tuple[int, np.ndarray, np.ndarray]],
              copied: threading.Event | None = None) -> None:
        """A sharer's end of a snapshot: copy the ``deferred`` values, release the fence,
        post this share's checksums (of ``blocks``, then the ``digest`` of its states'
        structure where they are shared) on the host's board for the writer's commit."""
        started = time.perf_counter()
        assert self._board is not None
        try:
            self._copy_deferred(slot, sequence, deferred, copied)
            sums = []
            for block in blocks:
                found = slot.sums[block]
                sums.append(_checksum(slot.blocks[block]) if found is None else found)
            self._board.post(slot_index, self._part, sequence,
                             sums if digest is None else [digest] + sums)
        except Exception as exc:  # noqa: BLE001 - training goes on without this snapshot
            self._give_up(slot_index, sequence, exc)
        finally:
            if copied is not None:
                self._background = time.perf_counter() - started

    def _give_up(self, slot_index: int, sequence: int, exc: Exception) -> None:
        """A sharer could not copy its share: it warns, and tells the writer, which
        leaves that snapshot uncommitted without waiting for it."""
        self._warn(sequence, exc)
        assert self._board is not None
        self._board.fail(slot_index, self._part, sequence)

    def _warn(self, sequence: int, exc: Exception) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"snapshot {sequence} could not be written to "
                          f"{self.directory}: {type(exc).__name__}: {exc}; training "
                          f"goes on, a restart falls back to an older snapshot or the "
                          f"checkpoint on disk (free memory in /dev/shm, or give "
                          f"{DIR_ENV} another directory)", RuntimeWarning, stacklevel=1)

    def _commit(self, slot: _Slot, slot_index: int, layout: dict[str, Any],
                extra: dict[str, Any], owners: list[list[int]], digest: int | None,
                deferred: list[tuple[int, np.ndarray, np.ndarray]],
                copied: threading.Event | None = None) -> None:
        """Copy the ``deferred`` values, release the fence, gather the other shares'
        checksums (where the host's ranks share the copy), checksum, commit."""
        data = slot.data
        assert data is not None
        started = time.perf_counter()
        t = 0
        try:
            self._copy_deferred(slot, extra["sequence"], deferred, copied)
            t = recorder.begin() if copied is not None else 0
            if self._parts > 1:
                assert self._board is not None
                deadline = time.monotonic() + _shares.WAIT_S
                for part in range(1, self._parts):
                    blocks = owners[part]
                    found = self._board.collect(slot_index, part, extra["sequence"],
                                                deadline)
                    if digest is not None and (not found or found.pop(0) != digest):
                        raise ValueError(f"share {part}'s stateful objects are not "
                                         f"structured as the writer's")
                    if len(found) != len(blocks):
                        raise ValueError(f"share {part} of snapshot {extra['sequence']} "
                                         f"posted {len(found)} checksums, expected "
                                         f"{len(blocks)} (one per piece)")
                    for block, checksum in zip(blocks, found):
                        slot.sums[block] = checksum
            sums = [_checksum(block) if found is None else found
                    for block, found in zip(slot.blocks, slot.sums)]
            extra["checksums"] = sums[:len(slot.raw)]
            if "states" in extra:
                at, room = extra["states"]["sums"]
                text = json.dumps(sums[len(slot.raw):], separators=(",", ":")).encode()
                if len(text) > room:
                    raise ValueError(f"the states' checksums take {len(text)} bytes, more "
                                     f"than the {room} kept for them")
                data[at:at + len(text)] = text
                extra["states"]["sums"] = [at, len(text),
                                           hashlib.sha256(text).hexdigest()]
            body = json.dumps(extra, separators=(",", ":")).encode()
            if len(body) > layout["header"] - _HEADER.size:
                raise ValueError(f"the snapshot's record is {len(body)} bytes, more than the "
                                 f"{layout['header'] - _HEADER.size} its layout holds")
            data[_HEADER.size:_HEADER.size + len(body)] = body
            _HEADER.pack_into(data, 0, _MAGIC, extra["sequence"], len(body), _NO_MAC)
            mac = self._mac(layout["digest"], extra["sequence"], body)
            data[_HEADER.size - 32:_HEADER.size] = mac  # (last: this commits)
        except Exception as exc:  # noqa: BLE001 - training goes on without this snapshot
            self._warn(extra["sequence"], exc)
        finally:
            if self._board is not None:  # (the sharers may write this slot again)
                self._board.post(slot_index, 0, extra["sequence"], [])
            if copied is not None:  # (in the background: take() weighs it next time)
                self._background = time.perf_counter() - started
            if t:
                recorder.end(t, "snapshot commit", recorder.CHECKPOINT,
                             {"sequence": extra["sequence"]})

    def wait(self) -> None:
        """Until the snapshot being written here (if any) is committed."""
        thread = self._thread
        if thread is not None:
            thread.join()
            self._thread = None
        _IN_FLIGHT.discard(self)

    def _expand_states(self) -> list[tuple[str, Any, list[Any]]]:
        """The stateful leaves' states on this host's writer (and its sharers, where
        they share them): ``(name, tree, arrays)`` each
        (:func:`mpistrat.checkpoint._torch.expand`; a device tensor in place of its
        array, which :meth:`_state_copies` brings to the host piece by piece, each rank
        its own pieces); nothing on the other ranks. A sharded optimizer's state
        is expanded by each rank of the host, its own share (:meth:`_expand_shards`),
        or where its ranks are not the host's, gathered on every host's writer in turn:
        collective either way (every rank is at the same step boundary)."""
        leaves = [(name, obj) for name, obj, kind in self._kinds if kind == "stateful"]
        if not leaves:
            return []
        torch_leaves = _torch()
        rank = self.comm.Get_rank() if self.comm is not None else 0
        states: list[tuple[str, Any, list[Any]]] = []
        for name, obj in leaves:
            if name in self._sharded:
                states.append((name, *self._expand_shards(name, obj)))
            elif torch_leaves.needs_gather(obj):
                for writer in self._writers:
                    torch_leaves.gather(obj, writer)
                    if writer == rank:
                        states.append((name, *torch_leaves.expand(obj, name)))
            elif self.writer or (self._states_everywhere and self._part > 0):
                states.append((name, *torch_leaves.expand(obj, name, lazy=True)))
        return [(name, tree, [_storable(name, a) if isinstance(a, np.ndarray) else a
                              for a in arrays])
                for name, tree, arrays in states]

    def _expand_shards(self, name: str, obj: Any) -> tuple[Any, list[Any]]:
        """A sharded optimizer's whole state, as every rank of the host sees it: the tree
        of its whole state_dict, its arrays (this rank's share's; for the other shares,
        read-only stand-ins of their dtype and shape), each array's share in
        ``self._owners[name]`` (None: held by every rank). Collective over the host's
        ranks (they tell each other their shares' structure, when it changed)."""
        torch_leaves = _torch()
        mine, rest = obj.shard_state()
        tree, arrays = torch_leaves.expand_value(mine, name, lazy=True)
        rest_tree, rest_arrays = torch_leaves.expand_value(rest, name, lazy=True)
        text = json.dumps([tree, [_array_meta(a)[:2] for a in arrays]],
                          separators=(",", ":")).encode()
        comm = obj.shard_comm
        digests = comm.allgather(hashlib.sha256(text).digest())
        seen = self._shard_texts.get(name)
        if seen is None or seen[0] != digests:
            seen = self._shard_texts[name] = (digests, [json.loads(t)
                                                        for t in comm.allgather(text)])
        shares = seen[1]
        everything: list[Any] = []
        owners: list[int | None] = []
        for part, (part_tree, described) in enumerate(shares):
            if part == self._part:
                everything += arrays
            else:
                everything += [np.broadcast_to(np.zeros((), _parse_dtype(dtype)), shape)
                               for dtype, shape in described]
            owners += [part] * len(described)
        everything += rest_arrays
        owners += [None] * len(rest_arrays)
        self._owners[name] = owners
        return torch_leaves.join_shards([(t, len(d)) for t, d in shares],
                                        (rest_tree, len(rest_arrays))), everything

    def _layout_for(self, values: list[tuple[np.ndarray, bool]]) -> dict[str, Any]:
        """This process's layout (the same on every rank; written to :attr:`layout_path`
        by the writer the first time)."""
        if self._layout is not None:
            return self._layout
        entries: list[dict[str, Any]] = []
        offset, arrays = 0, iter(values)
        for name, _, kind in self._kinds:
            if kind in ("generator", "stateful"):
                entries.append({"name": name, "kind": kind})
                continue
            dtype, shape, nbytes = _array_meta(next(arrays)[0])
            offset = -(-offset // _ALIGN) * _ALIGN
            entries.append({"name": name, "kind": kind, "dtype": dtype, "shape": shape,
                            "offset": offset, "nbytes": nbytes})
            offset += nbytes
        # (the record: its fields, the generators' states, a checksum per value and per
        # cut between shares, 58 digits at most; not the number of shares of this launch:
        # a relaunch with another number of ranks on the host keeps the layout, and with
        # it the snapshots taken before)
        header = -(-(2048 + 60 * (len(entries) + _shares.MAX_SHARERS) + self._room)
                   // 4096) * 4096
        for entry in entries:
            if "offset" in entry:
                entry["offset"] += header
        layout = {"format": FORMAT, "version": VERSION, "job": self.launch.job,
                  "header": header, "size": header + offset, "entries": entries}
        text = json.dumps(layout, sort_keys=True)
        layout["mac"] = hmac.new(self.secret, b"mpistrat-snapshot-layout\0" + text.encode(),
                                 hashlib.sha256).hexdigest()
        if self.writer:
            write_atomically(self.layout_path, json.dumps(layout, sort_keys=True), mode=0o600)
        layout["digest"] = hashlib.sha256(text.encode()).digest()
        self._layout = layout
        return layout

    def _mapped(self, slot: _Slot, layout: dict[str, Any], size: int) -> memoryview:
        """The slot's data file, at least ``size`` bytes, mapped (created or resized the
        first time, and again when a stateful leaf's state outgrows it)."""
        if slot.map is not None and len(slot.map) < size:
            self._unmap(slot)
        if slot.map is None:
            if size > layout["size"]:  # (room to grow: an optimizer's state appears)
                size = layout["size"] + -(-(size - layout["size"]) * 5 // 4 // 4096) * 4096
            fd = os.open(slot.path, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o600)
            try:
                info = os.fstat(fd)
                if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
                    raise PermissionError(f"{slot.path} is not a regular file of this "
                                          f"user's")
                if self.writer:
                    os.ftruncate(fd, size)
                elif info.st_size < size:  # (a sharer never shrinks what the writer sized)
                    _grow(fd, size)
                slot.map = mmap.mmap(fd, size)
            except BaseException:
                os.close(fd)
                raise
            slot.fd = fd
            slot.data = memoryview(slot.map)
            slot.views = [_view(slot.data, e) for e in layout["entries"]
                          if e["kind"] not in _NO_VALUE]
            slot.raw = [slot.data[a:b] for _, a, b in _blocks(layout, self._parts)]
        assert slot.data is not None
        return slot.data

    def _unmap(self, slot: _Slot) -> None:
        slot.views, slot.raw, slot.blocks = [], [], []
        if slot.data is not None:
            slot.data.release()
            slot.data = None
        if slot.map is not None:
            try:
                slot.map.close()
            except BufferError:
                pass  # (a view is still alive: the mapping goes with it)
            slot.map = None
        if slot.fd >= 0:
            os.close(slot.fd)
            slot.fd = -1

    def _mac(self, digest: bytes, sequence: int, body: bytes) -> bytes:
        return hmac.new(self.secret, b"mpistrat-snapshot\0" + digest
                        + sequence.to_bytes(8, "little") + body, hashlib.sha256).digest()

    # -- restoring

    def restore(self) -> SnapshotInfo | None:
        """Restore the newest valid snapshot any host holds into the checkpoint's
        objects, on every rank (collective); None (nothing changed) when no host holds
        one. The writers look; the newest found is read on its host and broadcast.
        Traced as a span ``snapshot restore``."""
        t = recorder.begin()
        info = None
        try:
            info = self._restore()
            return info
        finally:
            if t:
                recorder.end(t, "snapshot restore", recorder.CHECKPOINT,
                             {"sequence": info.sequence if info is not None else None,
                              "skipped": len(self.skipped)})

    def _restore(self) -> SnapshotInfo | None:
        comm = self.comm
        assert comm is not None
        for store in list(_IN_FLIGHT):  # (this process's own snapshots, committed first)
            store.wait()
        found: tuple[int, str, dict[str, Any]] | None = None
        notes: list[str] = []
        if self.writer:
            found, notes = self._newest()
        # (the newest here, and the slot the writer writes next: its sharers' too)
        heard = comm.allgather((found[0] if found is not None else -1, self._next_slot))
        sequences = [sequence for sequence, _ in heard]
        self._next_slot = heard[self._host_writer][1]
        skipped = tuple(note for part in comm.allgather(notes) for note in part)
        best = max(sequences)
        self.skipped = skipped
        if best < 0:
            return None
        source = sequences.index(best)
        values: list[np.ndarray] = []

        def work() -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
            assert found is not None
            path, record = found[1], found[2]
            layout = record.pop("layout")
            data = memoryview(_read_only_map(path, layout["size"]))
            values.extend(np.array(_view(data, e)) for e in layout["entries"]
                          if e["kind"] not in _NO_VALUE)
            values.extend(np.array(_view(data, e)) for _, _, part in record["states"]
                          for e in part)
            return path, record, layout["entries"]

        def failure(exc: Exception) -> tuple[type[Exception], str]:
            return OSError, (f"reading the snapshot on rank {source} failed: "
                             f"{type(exc).__name__}: {exc}")

        path, record, entries = _on_chief(comm, source, work, failure)
        chief_values: Iterator[np.ndarray] = iter(values)

        def receive(entry: dict[str, Any]) -> np.ndarray:
            if comm.Get_rank() == source:
                buffer = next(chief_values)
            else:
                buffer = np.empty(entry["shape"], _parse_dtype(entry["dtype"]))
            if buffer.nbytes and comm.Get_size() > 1:
                comm.Bcast(buffer.reshape(-1).view(np.uint8), root=source)
            return buffer

        received: list[np.ndarray | None] = [
            None if e["kind"] in _NO_VALUE else receive(e) for e in entries]
        states = {name: (tree, [receive(e) for e in part])
                  for name, tree, part in record["states"]}
        for (name, obj, _), entry, value in zip(self._kinds, entries, received):
            if entry["kind"] == "generator":
                _random.set_state(obj, record["generators"][name])
            elif entry["kind"] == "stateful":
                _torch().load(obj, *states[name])
            else:
                assert value is not None
                _assign(obj, value)
        self.checkpoint.save_counter = record["save_counter"]
        self.sequence = best
        position = record["position"]
        return SnapshotInfo(path, best, record["world_size"],
                            (position[0], position[1]) if position is not None else None,
                            skipped, tuple((k, n) for k, n in record["finished"]))

    def _newest(self) -> tuple[tuple[int, str, dict[str, Any]] | None, list[str]]:
        """This host's newest valid snapshot ``(sequence, data path, record)`` (the
        record holds its ``layout``), and why each other one found was skipped."""
        if not os.path.lexists(self.layout_path):
            return None, []
        try:
            layout = self.check_layout(self.layout_path)
        except (OSError, ValueError, RecursionError) as exc:
            return None, [f"{self.layout_path}: {exc}"]
        best: tuple[int, str, dict[str, Any]] | None = None
        notes = []
        for slot in self._slots:
            if not os.path.lexists(slot.path):
                continue
            try:
                record = self.check(slot.path, layout)
            except (OSError, ValueError, RecursionError) as exc:
                notes.append(f"{slot.path}: {exc}")
                continue
            if best is None or record["sequence"] > best[0]:
                best = (record["sequence"], slot.path, record)
                self._next_slot = 1 - self._slots.index(slot)  # (the newest stays)
        return best, notes

    def check_layout(self, path: str) -> dict[str, Any]:
        """The layout at ``path`` once it passed every check: this job's, authentic,
        and the checkpoint's own objects (names, kinds, dtypes, shapes) in places that
        do not overlap.

        Raises:
            ValueError: naming the first check that failed.
            OSError: the file cannot be read.
        """
        text = _read_private(path, MAX_LAYOUT)
        try:
            layout = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"not JSON mpistrat could write ({type(exc).__name__})") from None
        if not isinstance(layout, dict):
            raise ValueError("not a JSON object")
        given = layout.pop("mac", None)
        body = json.dumps(layout, sort_keys=True)
        mac = hmac.new(self.secret, b"mpistrat-snapshot-layout\0" + body.encode(),
                       hashlib.sha256).hexdigest()
        if not isinstance(given, str) or not hmac.compare_digest(given, mac):
            raise ValueError("not written by this job (its authentication does not match)")
        if layout.get("format") != FORMAT or layout.get("version") != VERSION or \
                layout.get("job") != self.launch.job:
            raise ValueError(f"not a version {VERSION} snapshot layout of job "
                             f"{self.launch.job}")
        header: Any = layout.get("header")
        size: Any = layout.get("size")
        if not _is_count(header) or header < _HEADER.size or not _is_count(size) or \
                size < header:
            raise ValueError(f"header {header!r} / size {size!r} are not a layout's")
        entries = layout.get("entries")
        leaves = self._kinds
        if not isinstance(entries, list) or len(entries) != len(leaves):
            raise ValueError(f"it holds {len(entries) if isinstance(entries, list) else '?'} "
                             f"entries, the checkpoint {len(leaves)} objects")
        end = header
        for entry, (name, obj, kind) in zip(entries, leaves):
            if not isinstance(entry, dict) or entry.get("name") != name or \
                    entry.get("kind") != kind:
                raise ValueError(f"an entry is {_short(entry)}, expected {kind} {name!r}")
            if kind in _NO_VALUE:
                continue
            dtype, shape = _describe(obj)
            if entry.get("dtype") != dtype or entry.get("shape") != list(shape):
                raise ValueError(f"entry {name!r} is {entry.get('dtype')!r} "
                                 f"{entry.get('shape')!r}, the object {dtype} {list(shape)}")
            nbytes = _nbytes(_parse_dtype(dtype), shape)
            offset: Any = entry.get("offset")
            if entry.get("nbytes") != nbytes or not _is_count(offset) or offset < end or \
                    offset + nbytes > size:
                raise ValueError(f"entry {name!r} has a bad place ({offset!r}, "
                                 f"{entry.get('nbytes')!r} bytes)")
            end = offset + nbytes
        layout["digest"] = hashlib.sha256(body.encode()).digest()
        return layout

    def check(self, path: str, layout: dict[str, Any]) -> dict[str, Any]:
        """The commit record of the slot at ``path`` (with its ``layout``) once every
        check passed: committed and authentic, its fields in range, every value
        matching its checksum.

        Raises:
            ValueError: naming the first check that failed.
            OSError: the file cannot be read.
        """
        data = memoryview(_read_only_map(path, layout["size"]))
        magic, sequence, length, mac = _HEADER.unpack_from(data, 0)
        if magic != _MAGIC or sequence == 0:
            raise ValueError("no committed snapshot (being written when its rank ended, "
                             "or never written)")
        if length > layout["header"] - _HEADER.size:
            raise ValueError(f"its record is {length} bytes, more than its layout's "
                             f"{layout['header'] - _HEADER.size}")
        body = bytes(data[_HEADER.size:_HEADER.size + length])
        if not hmac.compare_digest(mac, self._mac(layout["digest"], sequence, body)):
            raise ValueError("not committed by this job (its authentication does not "
                             "match: torn, or written by someone else)")
        try:
            record = json.loads(body)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"its record is not JSON mpistrat could write "
                             f"({type(exc).__name__})") from None
        if not isinstance(record, dict) or record.get("sequence") != sequence:
            raise ValueError("its record is not the one committed")
        for name in ("world_size", "save_counter", "launch"):
            if not _is_count(record.get(name)):
                raise ValueError(f"{name} is {record.get(name)!r}, expected an integer >= 0")
        if "position" not in record:
            raise ValueError("its record has no position")
        position = record["position"]
        if position is not None and not (isinstance(position, list) and len(position) == 2
                                         and isinstance(position[0], str)
                                         and _is_count(position[1])):
            raise ValueError(f"position is {_short(position)}, expected [kind, batches] or "
                             f"null")
        ended = record.get("finished")
        if not isinstance(ended, list) or len(ended) > hooks.MAX_FINISHED or not all(
                isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)
                and _is_count(item[1]) for item in ended):
            raise ValueError(f"finished is {_short(ended)}, expected at most "
                             f"{hooks.MAX_FINISHED} [kind, batches]")
        generators = record.get("generators")
        for name, obj, kind in self._kinds:
            if kind == "generator":
                state = generators.get(name) if isinstance(generators, dict) else None

                def bad(value: Any, expected: str, name: str = name) -> ValueError:
                    return ValueError(f"generator {name!r} has {_short(value)}, expected "
                                      f"{expected}")

                why = _random.mismatch(obj, _random.check_state(state, bad))
                if why is not None:
                    raise ValueError(f"generator {name!r} {why}")
        states: list[tuple[str, Any, list[Any]]] = []
        state_sums: list[Any] = []
        if any(kind == "stateful" for _, _, kind in self._kinds):
            states, state_sums = _check_states(record, layout, data, self.checkpoint._leaves)
        extra = [dict(entry, name=f"{name}[{j}]") for name, _, entries in states
                 for j, entry in enumerate(entries)]
        parts: Any = record.get("parts")
        if not _is_count(parts) or not 1 <= parts <= _shares.MAX_SHARERS:
            raise ValueError(f"parts is {_short(parts)}, expected 1 to "
                             f"{_shares.MAX_SHARERS} ranks that shared its copy")
        state_parts: Any = record.get("state_parts")
        if not _is_count(state_parts) or state_parts not in (1, parts):
            raise ValueError(f"state_parts is {_short(state_parts)}, expected 1 or its "
                             f"parts ({parts})")
        blocks = _blocks(layout, parts)
        sums = record.get("checksums")
        if not isinstance(sums, list) or len(sums) != len(blocks) or \
                not all(_is_count(c) for c in sums):
            raise ValueError(f"its checksums are not the {len(blocks)} of its values")
        for entry in extra:
            owner = entry.get("owner", 0)
            if not _is_count(owner) or owner >= parts:
                raise ValueError(f"{entry['name']} is held by share {_short(owner)}, not "
                                 f"one of its {parts}")
        state_blocks = _entry_blocks(extra, parts, state_parts > 1)
        if len(state_sums) != len(state_blocks) or not all(_is_count(c) for c in state_sums):
            raise ValueError(f"its states' checksums are not the {len(state_blocks)} of "
                             f"their arrays")
        for (what, start, stop), checksum in zip(blocks + state_blocks, sums + state_sums):
            if _checksum(data[start:stop]) != checksum:
                raise ValueError(f"{what} (changed after the commit)")
        record["layout"] = layout
        record["states"] = states
        return record

    # -- the end

    def close(self, remove: bool = False) -> None:
        """Unmap the slots; with ``remove``, delete this host's snapshots (the job is
        over)."""
        self.wait()
        for slot in self._slots:
            self._unmap(slot)
        if self._board is not None:
            self._board.close()
        if remove and self.writer:
            shutil.rmtree(self.directory, ignore_errors=True)
            try:
                os.rmdir(self.job_directory)  # (the last host's writer on a shared /dev/shm)
            except OSError:
                pass


def _digested_json(raw: memoryview, digest: Any, what: str, mismatch: str) -> Any:
    """The JSON in ``raw`` once its SHA-256 is ``digest`` (hex, from an authenticated
    record).

    Raises:
        ValueError: "``what`` ``mismatch``", or "``what``: not JSON ...".
    """
    body = bytes(raw)
    if not isinstance(digest, str) or not hmac.compare_digest(
            hashlib.sha256(body).hexdigest(), digest):
        raise ValueError(f"{what} {mismatch}")
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{what}: not JSON mpistrat could write "
                         f"({type(exc).__name__})") from None


def _sums_room(places: dict[str, dict[str, Any]], parts: int) -> int:
    """Room for the JSON list of the states' checksums: 60 bytes each (58 digits at most)
    for every array and every cut between ``parts`` shares."""
    return 60 * (sum(len(place["arrays"]) for place in places.values()) + parts) + 2


def _place_states(states: list[tuple[str, Any, list[Any]]], start: int,
                  owners: dict[str, list[int | None]]
                  ) -> tuple[dict[str, dict[str, Any]], bytes, int]:
    """Where the stateful leaves' arrays go in a slot, from ``start`` (the layout's
    end) on, and the index that says so (JSON, after them); the slot's size. An array
    of a sharded optimizer's share has the share's number as its ``owner``
    (``owners``: each such leaf's, None for an array every rank holds)."""
    places: dict[str, dict[str, Any]] = {}
    offset = start
    for name, tree, arrays in states:
        entries = []
        for value, owner in zip(arrays, owners.get(name) or [None] * len(arrays)):
            offset = -(-offset // _ALIGN) * _ALIGN
            dtype, shape, nbytes = _array_meta(value)
            entries.append({"dtype": dtype, "shape": shape, "offset": offset,
                            "nbytes": nbytes})
            if owner is not None:
                entries[-1]["owner"] = owner
            offset += nbytes
        places[name] = {"tree": tree, "arrays": entries}
    if not states:
        return places, b"", start
    index = json.dumps(places, separators=(",", ":")).encode()
    return places, index, offset + len(index)


def _array_meta(value: Any) -> tuple[str, list[int], int]:
    """An array's dtype (by name), shape and bytes: a NumPy array's, or a device array's
    (a torch tensor's, a CuPy array's) as its host array will be, without its values."""
    if isinstance(value, np.ndarray):
        return value.dtype.name, list(value.shape), int(value.nbytes)
    dtype, shape = _describe(value)
    return dtype, list(shape), _nbytes(_parse_dtype(dtype), shape)


def _check_states(record: dict[str, Any], layout: dict[str, Any], data: memoryview,
                  leaves: list[tuple[str, Any]]
                  ) -> tuple[list[tuple[str, Any, list[Any]]], list[Any]]:
    """The stateful leaves' part of a slot (record field ``states``), checked as
    untrusted input: its index where the record says, matching its SHA-256, JSON of
    the expected form, every array in the slot past the layout's values without
    overlap, and each state one its object takes; then the arrays' checksums, right
    after the index, matching their SHA-256, a JSON list. Returns ``(name, tree, array
    entries)`` per stateful leaf, in the checkpoint's order, and the checksums (their
    number and values are the caller's to check).

    Raises:
        ValueError: naming the first check that failed.
    """
    states = record.get("states")
    if not isinstance(states, dict):
        raise ValueError("its record has no stateful objects' states")
    size: Any = states.get("size")
    place: Any = states.get("index")
    digest: Any = states.get("sha256")
    if not _is_count(size) or size < layout["size"] or size > len(data):
        raise ValueError(f"its states end at {_short(size)}, beyond its data "
                         f"({len(data)} bytes) or inside its layout's values")
    if not (isinstance(place, list) and len(place) == 2 and all(_is_count(n) for n in place)
            and place[0] >= layout["size"] and place[0] + place[1] == size
            and place[1] <= MAX_LAYOUT):
        raise ValueError(f"its states' index is at {_short(place)}, not within its data")
    index = _digested_json(data[place[0]:size], digest, "its states' index",
                           "does not match its checksum")
    names = [name for name, obj in leaves if _kind(obj) == "stateful"]
    if not isinstance(index, dict) or sorted(index) != sorted(names):
        found = sorted(index) if isinstance(index, dict) else index
        raise ValueError(f"its states are of {_short(found)}, the checkpoint's stateful "
                         f"objects are {names}")
    torch_leaves = _torch()
    end = layout["size"]
    found = []
    objects = dict(leaves)
    for name in names:
        state = index[name]
        entries = state.get("arrays") if isinstance(state, dict) else None
        if not isinstance(entries, list):
            raise ValueError(f"the state of {name!r} has no list of arrays")
        arrays = []
        for entry in entries:
            if not isinstance(entry, dict):
                raise ValueError(f"the state of {name!r} has an array {_short(entry)}")
            try:
                dtype = _parse_dtype(entry.get("dtype"))
            except ValueError:
                raise ValueError(f"the state of {name!r} has an array of dtype "
                                 f"{_short(entry.get('dtype'))}") from None
            shape: Any = entry.get("shape")
            offset: Any = entry.get("offset")
            if not isinstance(shape, list) or not all(_is_count(n) for n in shape):
                raise ValueError(f"the state of {name!r} has an array of shape "
                                 f"{_short(shape)}")
            nbytes = _nbytes(dtype, shape)
            if entry.get("nbytes") != nbytes or not _is_count(offset) or offset < end or \
                    offset + nbytes > place[0] or offset % dtype.alignment:
                raise ValueError(f"the state of {name!r} has an array in a bad place "
                                 f"({_short(offset)}, {_short(entry.get('nbytes'))} bytes)")
            end = offset + nbytes
            arrays.append(entry)
        views = [_view(data, e) for e in arrays]
        try:
            torch_leaves.check_fits(objects[name], name, torch_leaves.decode(
                state.get("tree"), len(views), lambda j: views[j]))
        except (ValueError, RecursionError):
            raise
        except Exception as exc:  # noqa: BLE001 - a skipped snapshot, never a traceback
            raise ValueError(f"the state of {name!r} cannot be checked "
                             f"({type(exc).__name__}: {exc})") from None
        found.append((name, state["tree"], arrays))
    sums: Any = states.get("sums")
    if not (isinstance(sums, list) and len(sums) == 3 and _is_count(sums[0])
            and _is_count(sums[1]) and sums[0] == size and size + sums[1] <= len(data)
            and sums[1] <= MAX_LAYOUT and isinstance(sums[2], str)):
        raise ValueError(f"its states' checksums are at {_short(sums)}, not right after "
                         f"their index within its data")
    listed = _digested_json(data[size:size + sums[1]], sums[2], "its states' checksums",
                            "do not match their digest")
    if not isinstance(listed, list):
        raise ValueError(f"its states' checksums are {_short(listed)}, not a list")
    return found, listed


def _host_value(obj: Any) -> tuple[Any, bool]:
    """``obj``'s value in host memory, without a copy where it lives there already, or
    where it lives on a device (a torch tensor's or mpistrat's GPU variable's), that
    value there (:func:`_piece_of` brings over what a rank copies of it); and whether
    every change to it waits for :func:`mpistrat.elastic.hooks.before_write` (mpistrat's
    variables on the host: the value may be copied later)."""
    value: Any = obj
    fenced = False
    if _is_tensor(obj):
        if _torch().on_device(obj):
            return obj.detach(), False
    elif not isinstance(obj, np.ndarray):
        read = getattr(obj, "_read_array", None)  # mpistrat's variables: no copy
        value = read() if callable(read) else None
        fenced = isinstance(value, np.ndarray)
        if not fenced and value is not None and _on_gpu(value):
            return value, False
    if not isinstance(value, np.ndarray):
        value = _value(obj)  # (a tensor: a view, copied before take() returns)
    if value.dtype.byteorder not in "=|":
        value, fenced = value.astype(value.dtype.newbyteorder("=")), False
    return value, fenced


def _on_gpu(value: Any) -> bool:
    """Whether ``value`` is a CuPy array (mpistrat's GPU variables hold their values so)."""
    return type(value).__module__.split(".")[0] == "cupy"


def _piece_of(value: Any, start: int, stop: int) -> np.ndarray:
    """Bytes ``start:stop`` of a value's or state's array in order (multiples of its
    element size), as a flat uint8 array in host memory: a view of a host array; of a
    device one (a torch tensor, a CuPy array), those bytes alone copied over."""
    if isinstance(value, np.ndarray):
        return _flat_bytes(value)[start:stop]
    if _is_tensor(value):
        return _torch().host_piece(value, start, stop)  # type: ignore[no-any-return]
    size = value.dtype.itemsize
    return to_host(value.reshape(-1)[start // size:stop // size]).reshape(-1).view(np.uint8)


def _whole(value: Any) -> np.ndarray:
    """A value's or state's array whole in host memory (a view where it is there)."""
    if isinstance(value, np.ndarray):
        return value
    if _is_tensor(value):
        return _torch().host_value(value)  # type: ignore[no-any-return]
    return to_host(value)


def snapshot_root(root: str | None = None) -> str:
    """Where a host keeps elastic jobs' snapshots: ``root``, else
    ``$MPISTRAT_ELASTIC_DIR``, else ``/dev/shm``, else the temporary directory."""
    return root or os.environ.get(DIR_ENV) or (
        "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())


def job_directory(job: str, root: str | None = None) -> str:
    """The directory of job ``job``'s snapshots on this host (under :func:`snapshot_root`)."""
    return os.path.join(snapshot_root(root), f"mpistrat-elastic-{os.getuid()}-{job}")


def remove_job(job: str, root: str | None = None) -> None:
    """Delete job ``job``'s snapshots on this host, if it is this user's directory (the
    job is over: ``mpistrat run --min-ranks`` calls it when it ends)."""
    path = job_directory(job, root)
    try:
        info = os.lstat(path)
    except OSError:
        return
    if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
        shutil.rmtree(path, ignore_errors=True)


def _nbytes(dtype: np.dtype, shape: Any) -> int:
    """The bytes of an array of ``dtype`` and ``shape``."""
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


def _grow(fd: int, size: int) -> None:
    """Make the file ``fd`` at least ``size`` bytes long, never shorter (another process
    may make it longer meanwhile)."""
    allocate = getattr(os, "posix_fallocate", None)
    if allocate is not None:
        allocate(fd, 0, size)
    else:  # (no fallocate: the writer sized it first, or the job is on one rank a host)
        os.ftruncate(fd, max(size, os.fstat(fd).st_size))


def _pieces(layout: dict[str, Any], parts: int) -> list[list[tuple[int, _shares.Piece]]]:
    """The layout's values cut into ``parts`` shares (:func:`_cut_shares`): each
    share's pieces, each with the index of its checksum among the slot's blocks."""
    values = [e for e in layout["entries"] if e["kind"] not in _NO_VALUE]
    out, block = [], 0
    for share in _cut_shares(values, parts, True):
        out.append([(block + k, piece) for k, piece in enumerate(share)])
        block += len(share)
    return out


def _cut_shares(entries: list[dict[str, Any]], parts: int, cut: bool
                ) -> list[list[_shares.Piece]]:
    """Which of ``parts`` shares copies what of ``entries`` (each with its bytes, and an
    ``owner`` where one share holds it: a sharded optimizer's array, copied whole by
    its share): the others cut among the shares (:func:`._shares.shares`) where ``cut``,
    else whole in share 0 (the writer's). Each share's pieces: those cut, then its own."""
    common = [i for i, e in enumerate(entries) if "owner" not in e]
    out: list[list[_shares.Piece]] = [[] for _ in range(parts)]
    if cut:
        for j, share in enumerate(_shares.shares([entries[i]["nbytes"] for i in common],
                                                 parts)):
            out[j] = [_shares.Piece(common[p.value], p.start, p.stop) for p in share]
    else:
        out[0] = [_shares.Piece(i, 0, entries[i]["nbytes"]) for i in common]
    for i, entry in enumerate(entries):
        if "owner" in entry:
            out[entry["owner"]].append(_shares.Piece(i, 0, entry["nbytes"]))
    return out


def _entry_blocks(entries: list[dict[str, Any]], parts: int, cut: bool
                  ) -> list[tuple[str, int, int]]:
    """What the checksums of ``entries`` (each with its name, offset and bytes in the
    slot) cover, as ``(what a mismatch says, start, stop)``: each piece of each of
    ``parts`` shares (:func:`_cut_shares`; each entry whole in one share where nothing
    is ``cut``)."""
    found = []
    for j, share in enumerate(_cut_shares(entries, parts, cut)):
        for p in share:
            entry = entries[p.value]
            where = f" (bytes {p.start} to {p.stop}, share {j})" if cut and \
                "owner" not in entry else f" (share {j}'s own)" if "owner" in entry else ""
            found.append((f"entry {entry['name']!r} does not match its checksum{where}",
                          entry["offset"] + p.start, entry["offset"] + p.stop))
    return found


def _blocks(layout: dict[str, Any], parts: int = 1) -> list[tuple[str, int, int]]:
    """What the commit record's checksums cover, in order, as ``(what a mismatch says,
    start, stop)`` byte ranges of a slot: the layout's values as one block when together
    they take less than :data:`_TOGETHER_BYTES` (the alignment between them included: it
    is never written), else each value alone, or where ``parts`` ranks of the host
    shared the copy, each piece of each share (:mod:`._shares`). The stateful leaves'
    arrays follow."""
    values = [e for e in layout["entries"] if e["kind"] not in _NO_VALUE]
    if not values:
        return []
    start, stop = values[0]["offset"], values[-1]["offset"] + values[-1]["nbytes"]
    if parts == 1 and stop - start < _TOGETHER_BYTES and len(values) > 1:
        names = ", ".join(repr(e["name"]) for e in values)
        return [(f"entries {names}, checked together, do not match their checksum",
                 start, stop)]
    return _entry_blocks(values, parts, parts > 1)


def _checksum(raw: memoryview) -> int:
    """A checksum of ``raw`` that finds a value damaged after its commit: CRC-32 below
    :data:`_CRC_BYTES` (16 KiB); from there on the wrapping sum and the xor of its 8-byte
    words side by side with its tail and length (a 192-bit number: any one flipped bit
    changes the sum), faster from 16 KiB on (4.0 against 9.7 µs at 40 KiB) and about 6 ms
    per 100 MiB where CRC-32 takes 25: fast enough to run at every step. Not a defence
    against a forger: the record's HMAC is, and the directory is the user's own."""
    if len(raw) < _CRC_BYTES:
        return zlib.crc32(raw)
    words = np.frombuffer(raw, np.uint64, len(raw) // 8)
    return _summed(int(words.sum(dtype=np.uint64)), int(np.bitwise_xor.reduce(words)),
                   raw[8 * len(words):], len(raw))


def _summed(total: int, mixed: int, tail: bytes | memoryview, length: int) -> int:
    """:func:`_checksum` from the words' wrapping sum and xor, the tail and the length."""
    return (total & _WORD) << 128 | mixed << 64 | \
        int.from_bytes(tail, "little") << 8 ^ (length & 0xFF)


_WORD = (1 << 64) - 1
# a chunk copied, then summed while it is still in the cache (a core's L2 here: 64 KiB
# chunks took 18.1, 256 KiB 14.4, 1-4 MiB 13.4, 16 MiB 16.0 and one pass 19.9 ms for 93 MiB)
_CHUNK = 1 << 20


def _copy_summed(target: np.ndarray, value: np.ndarray) -> int | None:
    """``np.copyto(target, value)``, and :func:`_checksum` of ``target``'s bytes when it
    can be had on the way (None otherwise): chunk by chunk, each chunk summed right after
    its copy, from the cache (13.4 against 18.3 ms for 93 MiB copied into ``/dev/shm``,
    then summed)."""
    if value.nbytes < _CRC_BYTES or value.dtype != target.dtype or \
            value.shape != target.shape or \
            not (value.flags.c_contiguous and target.flags.c_contiguous):
        np.copyto(target, value, casting="no")  # (and its errors)
        return None
    source = value.reshape(-1).view(np.uint8)
    place = target.reshape(-1).view(np.uint8)
    length = len(place)
    whole = length - length % 8
    total = mixed = 0
    for start in range(0, whole, _CHUNK):
        stop = min(start + _CHUNK, whole)
        words = place[start:stop].view(np.uint64)
        np.copyto(words, source[start:stop].view(np.uint64))
        total += int(words.sum(dtype=np.uint64))
        mixed ^= int(np.bitwise_xor.reduce(words))
    place[whole:] = source[whole:]
    return _summed(total, mixed, place[whole:].tobytes(), length)


def _flat_bytes(array: np.ndarray) -> np.ndarray:
    """``array``'s bytes in order, as a flat uint8 array (a view where it is contiguous)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def _view(data: memoryview, entry: dict[str, Any]) -> np.ndarray:
    dtype = _parse_dtype(entry["dtype"])
    count = entry["nbytes"] // dtype.itemsize
    return np.frombuffer(data, dtype, count, entry["offset"]).reshape(entry["shape"])


def _bytes(array: np.ndarray) -> memoryview:
    return memoryview(array.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _private_directory(path: str) -> None:
    """Create ``path`` (0700) or check that it is this user's directory and no link."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or \
            info.st_mode & 0o077:
        raise PermissionError(f"{path} is not a private directory of this user's (a link, "
                              f"someone else's, or open to others); remove it, or give "
                              f"{DIR_ENV} another directory")


def _read_private(path: str, limit: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise ValueError("not a regular file of this user's")
        if info.st_size > limit:
            raise ValueError(f"{info.st_size} bytes, more than a manifest's {limit}")
        return os.read(fd, limit + 1)[:limit + 1]
    finally:
        os.close(fd)


def _read_only_map(path: str, size: int | None = None) -> mmap.mmap:
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise ValueError("its data is not a regular file of this user's")
        if size is not None and info.st_size < size:
            raise ValueError(f"its data holds {info.st_size} bytes, the manifest says {size}")
        return mmap.mmap(fd, max(info.st_size, 1), prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _sweep(root: str, keep: str) -> None:
    """Delete this user's snapshot directories of other jobs untouched for
    ``$MPISTRAT_ELASTIC_KEEP`` hours (default 24): a job killed whole leaves its own."""
    try:
        hours = float(os.environ.get(KEEP_ENV, "24"))
    except ValueError:
        hours = 24.0
    cutoff = time.time() - hours * 3600
    prefix = f"mpistrat-elastic-{os.getuid()}-"
    try:
        names = [n for n in os.listdir(root) if n.startswith(prefix)]
    except OSError:
        return
    for name in names:
        path = os.path.join(root, name)
        if path == keep:
            continue
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and \
                info.st_mtime < cutoff:
            shutil.rmtree(path, ignore_errors=True)
