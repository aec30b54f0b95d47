"""``MPIStore``: torch's key-value store for rendezvous, served over MPI (no socket).

torch's process groups meet through a ``torch.distributed.Store`` (gloo exchanges its
addresses in one, torch keeps counters and flags in it). torch's ``TCPStore`` needs
``MASTER_ADDR`` and ``MASTER_PORT`` and a listening socket on rank 0; in an MPI job the
ranks already share a communicator, so :class:`MPIStore` keeps the store there::

    store = MPIStore(comm)                 # collective over comm
    dist.init_process_group("gloo", store=store, rank=comm.rank, world_size=comm.size)
    ...
    store.close()                          # collective; stops the server

Design:

* **One dict, on rank 0.** The constructor duplicates ``comm`` (``Dup``: the store's
  messages never meet the program's). Rank 0 of the duplicate holds the keys and values
  in a dict under a condition variable; rank 0's own calls use it directly.
* **A server thread on rank 0** (a daemon) answers the other ranks. A request is one
  message on tag 1: a fixed header (request id, reply tag, operation, timeout, field
  count), then length-prefixed fields (keys, values, 8-byte integers), with no pickle.
  The reply goes to the requesting rank on the reply tag the request named, so several
  threads of one rank can wait at once, each on its own tag. A request that cannot be
  parsed, has the wrong fields or breaks a limit gets an error reply (or, when not even
  its header can be read, a line on stderr); nothing a request contains stops the server.
* **Blocking calls park, they do not spin.** ``get``, ``wait`` and ``multi_get`` of keys
  that do not exist yet are kept in a list of waiters, answered when a change to the
  dict makes their keys exist and failed when their deadline passes. Between messages
  the server, and a rank waiting for its reply, poll with ``Improbe`` and sleep
  between polls (backing off to 20 ms after a second of quiet): a blocking MPI probe
  would keep one core and MPI's progress engine busy for the whole life of the process
  group, which keeps the store; the price is a few milliseconds of latency on the first
  request after a quiet spell. The server sleeps on an event that rank 0's own changes
  and :meth:`MPIStore.close` set, so rank 0's changes reach remote waiters at once.
* **Bounded.** Keys up to :data:`MAX_KEY_BYTES`, values up to :data:`MAX_VALUE_BYTES`
  (after ``append`` too); larger ones are refused with a ``ValueError`` before anything
  is sent, and again by the server.
* **Timeouts as torch's stores.** ``get``, ``wait`` and ``multi_get`` wait at most the
  store's timeout (the constructor's, ``set_timeout``; ``wait`` may pass its own), then
  raise :class:`MPIStoreError` (a ``torch.distributed.DistStoreError``) naming the
  missing keys. A timeout of zero waits forever, as torch's ``kNoTimeout``.
* **Shutdown.** :meth:`MPIStore.close` is collective: each rank stops taking calls and
  tells rank 0's server, which serves every request that came before, fails the waiters
  still parked (their keys can no longer come) and ends; then the duplicate is freed. A
  program that never calls ``close`` still exits: the server is a daemon thread, and an
  ``atexit`` hook (which waits at most a second) stops it before MPI is finalised.

torch calls the store from C++ through its Python-subclass trampoline. That trampoline
looks up ``set``, ``get``, ``add``, ``compare_set``, ``check``, ``wait`` (with and without
a timeout), ``multi_get``, ``multi_set``, ``append``, ``clone`` and ``has_extended_api``
by those names, but ``getNumKeys`` and ``deleteKey`` by their C++ names: a
``PrefixStore`` over a Python store calls those, so :class:`MPIStore` answers both
spellings. ``queue_*`` and ``list_keys`` have no trampoline and stay torch's
"not implemented".
"""

from __future__ import annotations

import atexit
import datetime
import struct
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from ..runtime._mpi import Comm, mpi

__all__ = ["MPIStore", "MPIStoreError", "MAX_KEY_BYTES", "MAX_VALUE_BYTES"]

MAX_KEY_BYTES = 4 * 1024
"""The longest key (in bytes, UTF-8 for a ``str``) the store takes."""

MAX_VALUE_BYTES = 64 * 1024 * 1024
"""The longest value (in bytes) the store takes or builds with ``append``."""

_StoreErrorBase: Any = getattr(dist, "DistStoreError", None) or RuntimeError


class MPIStoreError(_StoreErrorBase):
    """An :class:`MPIStore` call that failed: a timeout (naming the keys), a closed store,
    or a request the server could not serve. A ``torch.distributed.DistStoreError``
    where torch has one (else a ``RuntimeError``), as torch's own stores raise: torch's
    code calls the store and catches torch's classes. (So it lives here, not in
    :mod:`mpistrat.errors`, which imports no torch, and is not a
    :class:`~mpistrat.MpistratError`.)"""


# -- the wire format (both directions: a header, then length-prefixed fields)

_REQUEST_TAG = 1
_FIRST_REPLY_TAG = 2
_REPLY_TAGS = 32765  # tags 2 .. 32766: within every MPI's TAG_UB (at least 32767)

_HEADER = struct.Struct("<QIBqI")  # request id, reply tag, operation, timeout ms, fields
_REPLY = struct.Struct("<QBI")  # request id, status, fields
_LENGTH = struct.Struct("<Q")
_INT = struct.Struct("<q")

_OK, _BAD_ARGUMENT, _FAILED = 0, 1, 2  # reply statuses: ValueError, MPIStoreError

(_SET, _GET, _ADD, _COMPARE_SET, _WAIT, _CHECK, _DELETE, _NUM_KEYS, _MULTI_GET, _MULTI_SET,
 _APPEND, _BYE) = range(1, 13)
_NAMES = {_SET: "set", _GET: "get", _ADD: "add", _COMPARE_SET: "compare_set", _WAIT: "wait",
          _CHECK: "check", _DELETE: "delete_key", _NUM_KEYS: "num_keys",
          _MULTI_GET: "multi_get", _MULTI_SET: "multi_set", _APPEND: "append", _BYE: "close"}
_BLOCKING = frozenset({_GET, _WAIT, _MULTI_GET})
# fields each operation takes: an exact count, or (at least, multiple of)
_ARITY: dict[int, int | tuple[int, int]] = {
    _SET: 2, _GET: 1, _ADD: 2, _COMPARE_SET: 3, _WAIT: (0, 1), _CHECK: (0, 1), _DELETE: 1,
    _NUM_KEYS: 0, _MULTI_GET: (0, 1), _MULTI_SET: (0, 2), _APPEND: 2, _BYE: 0}

_GRACE_S = 60.0  # how long past its deadline a rank waits for the server's answer
_CLOSE_WAIT_S = 10.0  # how long close waits for this rank's calls in other threads


class _Malformed(Exception):
    """A request that cannot be served as sent."""


def _frame(head: bytes, fields: Sequence[bytes]) -> bytes:
    parts = [head]
    for field in fields:
        parts += (_LENGTH.pack(len(field)), field)
    return b"".join(parts)


def _split(buffer: memoryview, offset: int, count: int) -> list[bytes]:
    """The ``count`` length-prefixed fields of ``buffer`` from ``offset``, exactly."""
    fields = []
    for i in range(count):
        if len(buffer) - offset < _LENGTH.size:
            raise _Malformed(f"the message ends before field {i} of {count}")
        (length,) = _LENGTH.unpack_from(buffer, offset)
        offset += _LENGTH.size
        if length > len(buffer) - offset:
            raise _Malformed(f"field {i} claims {length} bytes, but only "
                             f"{len(buffer) - offset} follow")
        fields.append(bytes(buffer[offset:offset + length]))
        offset += length
    if offset != len(buffer):
        raise _Malformed(f"{len(buffer) - offset} bytes follow the last of {count} fields")
    return fields


def _int(field: bytes, what: str) -> int:
    if len(field) != _INT.size:
        raise _Malformed(f"{what} is {len(field)} bytes, expected an {_INT.size}-byte integer")
    return int(_INT.unpack(field)[0])


def _show(key: bytes) -> str:
    text = key.decode("utf-8", "backslashreplace")
    return repr(text if len(text) <= 200 else text[:200] + "...")


def _show_keys(keys: Sequence[bytes]) -> str:
    shown = ", ".join(_show(k) for k in keys[:10])
    return shown + (f" and {len(keys) - 10} more" if len(keys) > 10 else "")


def _check_key(key: bytes) -> None:
    if len(key) > MAX_KEY_BYTES:
        raise ValueError(f"MPIStore key {_show(key)} is {len(key)} bytes, over the limit of "
                         f"{MAX_KEY_BYTES} bytes (MAX_KEY_BYTES); use a shorter key")


def _check_value(value: bytes, what: str = "value") -> None:
    if len(value) > MAX_VALUE_BYTES:
        raise ValueError(f"MPIStore {what} of {len(value)} bytes is over the limit of "
                         f"{MAX_VALUE_BYTES} bytes (MAX_VALUE_BYTES, 64 MiB); store large "
                         f"data elsewhere (a file, or an MPI broadcast) and its name here")


def _key(key: Any) -> bytes:
    if isinstance(key, str):
        encoded = key.encode("utf-8")
    elif isinstance(key, (bytes, bytearray, memoryview)):
        encoded = bytes(key)
    else:
        raise TypeError(f"MPIStore keys are str (or bytes), got {type(key).__name__} "
                        f"{key!r}")
    _check_key(encoded)
    return encoded


def _value(value: Any, what: str = "value") -> bytes:
    if isinstance(value, str):
        encoded = value.encode("utf-8")
    elif isinstance(value, (bytes, bytearray, memoryview)):
        encoded = bytes(value)
    else:
        raise TypeError(f"MPIStore {what}s are bytes (or str), got {type(value).__name__}; "
                        f"encode it first (e.g. str(x).encode())")
    _check_value(encoded, what)
    return encoded


def _keys(keys: Any) -> list[bytes]:
    if isinstance(keys, (str, bytes)):
        raise TypeError(f"MPIStore takes a list of keys here, got the single key {keys!r}; "
                        f"pass [{keys!r}]")
    return [_key(k) for k in keys]


def _seconds(timeout: Any) -> float:
    """A timeout as seconds (0: none), checked."""
    if not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"MPIStore timeouts are datetime.timedelta, got "
                        f"{type(timeout).__name__} {timeout!r}")
    seconds = timeout.total_seconds()
    if seconds < 0:
        raise ValueError(f"MPIStore timeout {timeout} is negative; pass a positive timedelta "
                         f"(or timedelta(0) to wait without limit)")
    return seconds


def _timeout_error(op: int, missing: Sequence[bytes], seconds: float, rank: int,
                   size: int) -> str:
    return (f"MPIStore {_NAMES[op]} on rank {rank} of {size} timed out after {seconds:g} s "
            f"waiting for key(s) {_show_keys(missing)}, which no rank has set. Check that "
            f"the rank that sets them runs and uses the same key (and PrefixStore prefix), or "
            f"raise the timeout (MPIStore(comm, timeout=...), set_timeout, or wait's timeout)")


def _closed_error(op: int, exiting: bool = False) -> str:
    if exiting:
        return (f"MPIStore {_NAMES[op]}: rank 0's process is exiting, and its store server "
                f"with it; call close() on every rank before any of them exits")
    return (f"MPIStore {_NAMES[op]}: the store is closed (close() is collective and ends it "
            f"on every rank); create a new MPIStore")


def _pause(pause: float, idle_s: float) -> float:
    """The next sleep between polls: from 50 us doubling, up to 1 ms in the first second
    of quiet and 20 ms after that."""
    return min(max(pause * 2, 50e-6), 1e-3 if idle_s < 1.0 else 20e-3)


# -- rank 0's dict


class _Table:
    """The keys and values (on rank 0), and every operation on them. Callers hold
    :attr:`cond` around :meth:`ready` and :meth:`apply`."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.cond = threading.Condition()
        self.version = 0  # bumped by every change that may make a key exist
        self.closed = False
        self.wake: threading.Event | None = None  # the server's, set on every change

    def _changed(self) -> None:
        self.version += 1
        self.cond.notify_all()
        if self.wake is not None:
            self.wake.set()

    def ready(self, op: int, fields: list[bytes]) -> list[bytes] | None:
        """A blocking operation's answer when its keys all exist, else None."""
        data = self.data
        if not all(k in data for k in fields):
            return None
        if op == _WAIT:
            return []
        return [data[k] for k in fields]  # get's one key, or multi_get's

    def missing(self, fields: list[bytes]) -> list[bytes]:
        return [k for k in fields if k not in self.data]

    def apply(self, op: int, fields: list[bytes]) -> list[bytes]:
        """Run a non-blocking operation; ``ValueError`` for bad arguments."""
        data = self.data
        if op == _SET:
            data[fields[0]] = fields[1]
            self._changed()
            return []
        if op == _ADD:
            key, amount = fields[0], _int(fields[1], "add's amount")
            old = data.get(key, b"0")
            try:
                current = int(old.decode("ascii"))
            except (UnicodeDecodeError, ValueError):
                raise ValueError(f"MPIStore add({_show(key)}): the key holds "
                                 f"{old[:40]!r}, not an integer counter; add only to keys "
                                 f"that add created (or that hold a decimal integer)") from None
            total = current + amount
            if not -(2**63) <= total < 2**63:
                raise ValueError(f"MPIStore add({_show(key)}, {amount}): {current} + {amount} "
                                 f"leaves the 64-bit range of torch's counters")
            data[key] = str(total).encode("ascii")
            self._changed()
            return [_INT.pack(total)]
        if op == _COMPARE_SET:
            key, expected, desired = fields
            current_value = data.get(key)
            if current_value is None:
                if expected:  # torch's stores: a missing key matches only b""
                    return [expected]
            elif current_value != expected:
                return [current_value]
            data[key] = desired
            self._changed()
            return [desired]
        if op == _CHECK:
            return [b"\x01" if all(k in data for k in fields) else b"\x00"]
        if op == _DELETE:
            return [b"\x01" if data.pop(fields[0], None) is not None else b"\x00"]
        if op == _NUM_KEYS:
            return [_INT.pack(len(data))]
        if op == _MULTI_SET:
            for key, value in zip(fields[::2], fields[1::2]):
                data[key] = value
            self._changed()
            return []
        if op == _APPEND:
            key, value = fields
            old = data.get(key, b"")
            if len(old) + len(value) > MAX_VALUE_BYTES:
                raise ValueError(f"MPIStore append({_show(key)}): the value would grow to "
                                 f"{len(old) + len(value)} bytes, over the limit of "
                                 f"{MAX_VALUE_BYTES} bytes (MAX_VALUE_BYTES, 64 MiB)")
            data[key] = old + value
            self._changed()
            return []
        raise _Malformed(f"operation {op} is not a non-blocking MPIStore operation")


def _check_fields(op: int, fields: list[bytes]) -> None:
    """A request's fields fit its operation and the limits (the server's own check)."""
    arity = _ARITY.get(op)
    if arity is None:
        raise _Malformed(f"unknown operation {op} (expected 1 to {len(_ARITY)})")
    if isinstance(arity, int):
        if len(fields) != arity:
            raise _Malformed(f"{_NAMES[op]} takes {arity} field(s), got {len(fields)}")
    elif len(fields) < arity[0] or len(fields) % arity[1]:
        raise _Malformed(f"{_NAMES[op]} takes a multiple of {arity[1]} fields, "
                         f"got {len(fields)}")
    if op == _MULTI_SET:
        keys, values = fields[::2], fields[1::2]
    elif op in (_SET, _APPEND, _COMPARE_SET):
        keys, values = fields[:1], fields[1:]
    elif op in (_GET, _DELETE, _ADD):  # (add's amount is checked as it is read)
        keys, values = fields[:1], []
    else:
        keys, values = fields, []
    for key in keys:
        _check_key(key)
    for value in values:
        _check_value(value)


# -- the server (rank 0)


class _Waiter:
    __slots__ = ("source", "tag", "request", "op", "keys", "deadline", "seconds")

    def __init__(self, source: int, tag: int, request: int, op: int, keys: list[bytes],
                 seconds: float) -> None:
        self.source, self.tag, self.request, self.op, self.keys = source, tag, request, op, keys
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds if seconds > 0 else float("inf")


_SERVERS: weakref.WeakSet[_Server] = weakref.WeakSet()
_AT_EXIT: list[bool] = []


def _stop_servers_at_exit() -> None:
    """atexit: stop every server still running (before MPI is finalised); bounded."""
    for server in list(_SERVERS):
        server.halt(join_s=1.0)


class _Server:
    """Rank 0's thread answering the other ranks' requests."""

    def __init__(self, comm: Any, table: _Table) -> None:
        self.comm = comm
        self.size = comm.Get_size()
        self.table = table
        self.wake = threading.Event()
        table.wake = self.wake
        self.waiters: list[_Waiter] = []
        self.outbox: list[tuple[Any, bytes]] = []
        self.byes: set[int] = set()
        self.halted = False
        self.tag_ub = min(int(comm.Get_attr(mpi().TAG_UB) or 32767), 2**31 - 1)
        self.thread = threading.Thread(target=self._run, name="mpistrat-store-server",
                                       daemon=True)
        _SERVERS.add(self)
        if not _AT_EXIT:
            atexit.register(_stop_servers_at_exit)
            _AT_EXIT.append(True)
        self.thread.start()

    def bye(self, rank: int) -> None:
        with self.table.cond:
            self.byes.add(rank)
        self.wake.set()

    def halt(self, join_s: float | None) -> None:
        self.halted = True
        self.wake.set()
        if self.thread is not threading.current_thread():
            self.thread.join(join_s)

    # -- the loop

    def _run(self) -> None:
        MPI = mpi()
        status = MPI.Status()
        pause, quiet_since, seen, due = 0.0, time.monotonic(), -1, float("inf")
        failures = 0  # in a row, of MPI itself
        while not self.halted:
            try:
                message = self.comm.Improbe(MPI.ANY_SOURCE, _REQUEST_TAG, status)
                if message is not None:
                    buffer = bytearray(status.Get_count(MPI.BYTE))
                    source = status.Get_source()
                    message.Recv([buffer, MPI.BYTE])
                failures = 0
            except Exception as exc:
                failures += 1
                self._note(f"receiving a request failed: {type(exc).__name__}: {exc}")
                if failures >= 10:
                    self._note("stopping after 10 failures of MPI in a row")
                    break
                message = None
            try:
                if message is not None:
                    self._serve(source, memoryview(buffer))
                with self.table.cond:
                    if self.table.version != seen or time.monotonic() >= due:
                        seen = self.table.version
                        self._answer_waiters()
                    due = min((w.deadline for w in self.waiters), default=float("inf"))
                    if len(self.byes) == self.size:
                        break
                self._flush(block=False)
            except Exception as exc:  # never let one request end the server
                self._note(f"error while serving: {type(exc).__name__}: {exc}")
                message = None
            if message is not None:
                pause, quiet_since = 0.0, time.monotonic()
                continue
            now = time.monotonic()
            pause = _pause(pause, now - quiet_since)
            self.wake.wait(max(0.0, min(pause, due - now)))
            self.wake.clear()
        self._finish()

    def _finish(self) -> None:
        """Every rank said bye (or the process exits): fail the parked waiters, send the
        last replies, mark the table closed."""
        with self.table.cond:
            waiters, self.waiters = self.waiters, []
            for waiter in waiters:
                self._reply(waiter.source, waiter.tag, waiter.request, _FAILED,
                            [_closed_error(waiter.op, exiting=self.halted).encode()])
            self.table.closed = True
            self.table.cond.notify_all()
        try:
            self._flush(block=not self.halted)
        except Exception as exc:
            self._note(f"sending the last answers failed: {type(exc).__name__}: {exc}")

    def _note(self, text: str) -> None:
        try:
            sys.stderr.write(f"mpistrat: MPIStore server (rank 0): {text}\n")
            sys.stderr.flush()
        except Exception:  # stderr closed at exit
            pass

    def _serve(self, source: int, buffer: memoryview) -> None:
        if len(buffer) < _HEADER.size:
            self._note(f"dropped a request of {len(buffer)} bytes from rank {source}: shorter "
                       f"than the {_HEADER.size}-byte header, so it names no reply tag")
            return
        request, tag, op, timeout_ms, count = _HEADER.unpack_from(buffer, 0)
        if not _FIRST_REPLY_TAG <= tag <= self.tag_ub:
            self._note(f"dropped request {request} from rank {source}: reply tag {tag} is "
                       f"outside {_FIRST_REPLY_TAG}..{self.tag_ub}")
            return
        try:
            fields = _split(buffer, _HEADER.size, count)
            _check_fields(op, fields)
            if timeout_ms < 0:
                raise _Malformed(f"negative timeout {timeout_ms} ms")
        except _Malformed as exc:
            self._reply(source, tag, request, _FAILED, [self._malformed(source, exc)])
            return
        except ValueError as exc:
            self._reply(source, tag, request, _BAD_ARGUMENT, [str(exc).encode()])
            return
        with self.table.cond:
            if op == _BYE:
                self.byes.add(source)
                self._reply(source, tag, request, _OK, [])
                return
            if self.table.closed:
                self._reply(source, tag, request, _FAILED, [_closed_error(op).encode()])
                return
            try:
                if op in _BLOCKING:
                    answer = self.table.ready(op, fields)
                    if answer is None:
                        self.waiters.append(_Waiter(source, tag, request, op, fields,
                                                    timeout_ms / 1000.0))
                        return
                else:
                    answer = self.table.apply(op, fields)
            except ValueError as exc:
                self._reply(source, tag, request, _BAD_ARGUMENT, [str(exc).encode()])
                return
            except _Malformed as exc:
                self._reply(source, tag, request, _FAILED, [self._malformed(source, exc)])
                return
            self._reply(source, tag, request, _OK, answer)

    @staticmethod
    def _malformed(source: int, exc: Exception) -> bytes:
        return (f"MPIStore server on rank 0 refused a malformed request from rank {source}: "
                f"{exc}; requests come from MPIStore's own methods, not raw messages on its "
                f"communicator").encode()

    def _answer_waiters(self) -> None:
        """Answer the parked waiters whose keys exist; fail those past their deadline.
        The caller holds the table's lock."""
        now, keep = time.monotonic(), []
        for waiter in self.waiters:
            answer = self.table.ready(waiter.op, waiter.keys)
            if answer is not None:
                self._reply(waiter.source, waiter.tag, waiter.request, _OK, answer)
            elif now >= waiter.deadline:
                text = _timeout_error(waiter.op, self.table.missing(waiter.keys),
                                      waiter.seconds, waiter.source, self.size)
                self._reply(waiter.source, waiter.tag, waiter.request, _FAILED, [text.encode()])
            else:
                keep.append(waiter)
        self.waiters = keep

    def _reply(self, dest: int, tag: int, request: int, status: int,
               fields: Sequence[bytes]) -> None:
        data = _frame(_REPLY.pack(request, status, len(fields)), fields)
        try:
            self.outbox.append((self.comm.Isend([data, mpi().BYTE], dest=dest, tag=tag), data))
        except Exception as exc:
            self._note(f"could not answer request {request} of rank {dest}: "
                       f"{type(exc).__name__}: {exc}")

    def _flush(self, block: bool) -> None:
        """Forget the sends that completed; with ``block``, wait (up to a few seconds)
        for the rest first."""
        deadline, pause = time.monotonic() + _CLOSE_WAIT_S, 0.0
        while self.outbox:
            self.outbox = [(req, data) for req, data in self.outbox if not req.Test()]
            if not block or not self.outbox or time.monotonic() > deadline:
                return
            pause = _pause(pause, 0.0)
            time.sleep(pause)


# -- the store


class MPIStore(dist.Store):
    """A ``torch.distributed.Store`` shared by the ranks of an MPI communicator, served
    over MPI by a thread on its rank 0 (no socket, no ``MASTER_ADDR``).

    Args:
        comm: the ranks that share the store (an mpi4py intracommunicator; the store
            uses a ``Dup`` of it). Every rank of ``comm`` must construct the store.
        timeout: how long ``get``, ``wait`` and ``multi_get`` wait for missing keys
            (``timedelta(0)``: without limit); default torch's process-group timeout.

    Every method of torch's store API works from any rank, from any thread, directly and
    under ``torch.distributed.PrefixStore``. Keys are ``str`` (or bytes) of up to
    :data:`MAX_KEY_BYTES`, values bytes (or ``str``) of up to :data:`MAX_VALUE_BYTES`.
    :meth:`close` is collective.
    """

    def __init__(self, comm: Comm, timeout: datetime.timedelta = default_pg_timeout) -> None:
        super().__init__()
        _seconds(timeout)
        self.set_timeout(timeout)
        MPI = mpi()
        provided = MPI.Query_thread()
        if provided < MPI.THREAD_MULTIPLE:
            names = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE",
                     MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
                     MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED"}
            raise RuntimeError(
                f"MPIStore needs MPI initialised with MPI_THREAD_MULTIPLE (its server thread "
                f"on rank 0 uses MPI while the program does), but MPI provides "
                f"{names.get(provided, provided)}. Leave mpi4py.rc.thread_level at its "
                f"default 'multiple' (it must be set before the first 'from mpi4py import "
                f"MPI') and use an MPI library built with thread support")
        if not hasattr(comm, "Dup") or not hasattr(comm, "Get_rank"):
            raise TypeError(f"MPIStore takes an mpi4py communicator, got "
                            f"{type(comm).__name__} {comm!r}")
        self._comm = comm.Dup()
        self._rank, self._size = self._comm.Get_rank(), self._comm.Get_size()
        self._closed = False
        self._lock = threading.Condition()  # a remote rank's: tags, request ids, sends
        self._request = 0
        self._in_flight: set[int] = set()
        self._abandoned: set[int] = set()
        self._next_tag = 0
        self._table: _Table | None = None
        self._server: _Server | None = None
        if self._rank == 0:
            self._table = _Table()
            if self._size > 1:
                self._server = _Server(self._comm, self._table)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"timeout {self.timeout}"
        return f"MPIStore(rank {self._rank} of {self._size}, {state})"

    # -- torch's Store API

    def set(self, key: str | bytes, value: str | bytes) -> None:
        """Set ``key`` to ``value``."""
        self._call(_SET, [_key(key), _value(value)])

    def get(self, key: str | bytes) -> bytes:
        """The value of ``key``, waiting (up to the store's timeout) until some rank sets
        it; :class:`MPIStoreError` naming the key past the timeout."""
        return self._call(_GET, [_key(key)], self._timeout_s())[0]

    def add(self, key: str | bytes, value: int) -> int:
        """Add ``value`` to the integer counter ``key`` (0 when missing); the new count.
        The key holds the count as decimal text, as torch's stores do."""
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"MPIStore add({key!r}, {value!r}): the amount must be an int, "
                            f"got {type(value).__name__}")
        if not -(2**63) <= value < 2**63:
            raise ValueError(f"MPIStore add({key!r}, {value}): the amount is outside the "
                             f"64-bit range of torch's counters")
        return _int(self._call(_ADD, [_key(key), _INT.pack(value)])[0], "add's answer")

    def compare_set(self, key: str | bytes, expected_value: str | bytes,
                    desired_value: str | bytes) -> bytes:
        """Set ``key`` to ``desired_value`` if it holds ``expected_value`` (a missing key
        matches only ``b""``); the value it holds afterwards (``expected_value`` when the
        key is missing and that is not empty), as torch's stores."""
        return self._call(_COMPARE_SET, [_key(key), _value(expected_value, "expected value"),
                                         _value(desired_value, "desired value")])[0]

    def wait(self, keys: Sequence[str | bytes],
             timeout: datetime.timedelta | None = None) -> None:
        """Wait until every key of ``keys`` exists, up to ``timeout`` (default: the
        store's; ``timedelta(0)``: without limit); :class:`MPIStoreError` naming the
        missing keys past it."""
        seconds = self._timeout_s() if timeout is None else _seconds(timeout)
        self._call(_WAIT, _keys(keys), seconds)

    def check(self, keys: Sequence[str | bytes]) -> bool:
        """Whether every key of ``keys`` exists (at once, without waiting)."""
        return self._call(_CHECK, _keys(keys))[0] == b"\x01"

    def delete_key(self, key: str | bytes) -> bool:
        """Delete ``key``; whether it existed."""
        return self._call(_DELETE, [_key(key)])[0] == b"\x01"

    def num_keys(self) -> int:
        """How many keys the store holds (every prefix's)."""
        return _int(self._call(_NUM_KEYS, [])[0], "num_keys's answer")

    def multi_get(self, keys: Sequence[str | bytes]) -> list[bytes]:
        """The values of ``keys``, waiting (up to the store's timeout) until all exist."""
        return self._call(_MULTI_GET, _keys(keys), self._timeout_s())

    def multi_set(self, keys: Sequence[str | bytes], values: Sequence[str | bytes]) -> None:
        """Set each key of ``keys`` to the value at the same place of ``values``."""
        encoded_keys, encoded_values = _keys(keys), [_value(v) for v in values]
        if len(encoded_keys) != len(encoded_values):
            raise ValueError(f"MPIStore multi_set got {len(encoded_keys)} keys and "
                             f"{len(encoded_values)} values; pass one value per key")
        self._call(_MULTI_SET, [f for pair in zip(encoded_keys, encoded_values)
                                for f in pair])

    def append(self, key: str | bytes, value: str | bytes) -> None:
        """Append ``value`` to the value of ``key`` (creating it)."""
        self._call(_APPEND, [_key(key), _value(value)])

    def has_extended_api(self) -> bool:
        """True: ``append``, ``multi_get`` and ``multi_set`` are the store's own (one
        request each), so torch and gloo may use them."""
        return True

    def clone(self) -> MPIStore:
        """This store: every method may be called from any thread, so a clone (torch's
        handle for another thread) is the store itself."""
        return self

    # the C++ names under which torch's trampoline looks these two up
    getNumKeys = num_keys  # noqa: N815
    deleteKey = delete_key  # noqa: N815

    # -- closing

    def close(self) -> None:
        """End the store on every rank (collective; a second call does nothing): calls
        still waiting in other threads fail, the server on rank 0 stops, the duplicate
        communicator is freed."""
        if self._closed:
            return
        if self._rank == 0:
            self._closed = True
            assert self._table is not None
            if self._server is not None:
                self._server.bye(0)
                self._server.thread.join()  # ends once every rank has said bye
                self._server = None
            with self._table.cond:
                self._table.closed = True
                self._table.cond.notify_all()
        else:
            self._remote(_BYE, [], 0.0)  # sent after every request of this rank
        # past the barrier rank 0's server has ended and sent its last answers: this rank's
        # calls still running in other threads have them, or get them within a poll
        self._comm.Barrier()
        with self._lock:
            self._lock.wait_for(lambda: not self._in_flight, _CLOSE_WAIT_S)
        self._comm.Free()

    # -- calls

    def _timeout_s(self) -> float:
        return _seconds(self.timeout)

    def _call(self, op: int, fields: list[bytes], seconds: float = 0.0) -> list[bytes]:
        """Run ``op`` on rank 0's dict: directly on rank 0, else by a request."""
        if self._closed:
            raise MPIStoreError(_closed_error(op))
        if self._table is not None:
            return self._local(op, fields, seconds)
        return self._remote(op, fields, seconds)

    def _local(self, op: int, fields: list[bytes], seconds: float) -> list[bytes]:
        table = self._table
        assert table is not None
        deadline = time.monotonic() + seconds if seconds > 0 else None
        with table.cond:
            while True:
                if table.closed:
                    raise MPIStoreError(_closed_error(op))
                if op not in _BLOCKING:
                    return table.apply(op, fields)
                answer = table.ready(op, fields)
                if answer is not None:
                    return answer
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise MPIStoreError(_timeout_error(op, table.missing(fields), seconds,
                                                       self._rank, self._size))
                table.cond.wait(left)

    def _take_tag(self) -> int:
        """A reply tag that no call of this rank in progress (or given up) uses."""
        for _ in range(_REPLY_TAGS):
            tag = _FIRST_REPLY_TAG + self._next_tag
            self._next_tag = (self._next_tag + 1) % _REPLY_TAGS
            if tag not in self._in_flight and tag not in self._abandoned:
                return tag
        raise MPIStoreError(f"MPIStore on rank {self._rank}: all {_REPLY_TAGS} reply tags "
                            f"are in use by calls in progress; make fewer concurrent calls")

    def _remote(self, op: int, fields: list[bytes], seconds: float) -> list[bytes]:
        MPI = mpi()
        with self._lock:
            if self._closed:
                raise MPIStoreError(_closed_error(op))
            if op == _BYE:
                self._closed = True  # no request of this rank follows its bye
            tag = self._take_tag()
            self._request += 1
            request = self._request
            header = _HEADER.pack(request, tag, op, round(seconds * 1000), len(fields))
            self._in_flight.add(tag)
            try:
                self._comm.Send([_frame(header, fields), MPI.BYTE], dest=0, tag=_REQUEST_TAG)
            except BaseException:
                self._in_flight.discard(tag)
                raise
        abandoned = False
        try:
            status, answer = self._await(tag, request, op, seconds)
        except BaseException:
            abandoned = True  # its answer may still come: never reuse the tag
            raise
        finally:
            with self._lock:
                self._in_flight.discard(tag)
                if abandoned:
                    self._abandoned.add(tag)
                self._lock.notify_all()
        if status == _OK:
            return answer
        text = answer[0].decode("utf-8", "backslashreplace") if answer else "(no reason)"
        if status == _BAD_ARGUMENT:
            raise ValueError(text)
        raise MPIStoreError(text)

    def _await(self, tag: int, request: int, op: int,
               seconds: float) -> tuple[int, list[bytes]]:
        """The server's answer to ``request``, polled on ``tag``."""
        MPI = mpi()
        status = MPI.Status()
        limit = seconds if op in _BLOCKING else self._timeout_s()
        start = time.monotonic()
        deadline = start + limit + _GRACE_S if limit > 0 else None
        pause = 0.0
        while True:
            message = self._comm.Improbe(0, tag, status)
            if message is None:
                now = time.monotonic()
                if deadline is not None and now > deadline:
                    raise MPIStoreError(
                        f"MPIStore {_NAMES[op]} on rank {self._rank} of {self._size}: no "
                        f"answer from the store's server on rank 0 after {now - start:.0f} s "
                        f"(it answers within the timeout when it runs); rank 0 may be stuck "
                        f"holding Python's GIL, or have left the job")
                pause = _pause(pause, now - start)
                time.sleep(pause)
                continue
            buffer = bytearray(status.Get_count(MPI.BYTE))
            message.Recv([buffer, MPI.BYTE])
            view = memoryview(buffer)
            try:
                if len(view) < _REPLY.size:
                    raise _Malformed(f"a reply of {len(view)} bytes")
                answered, code, count = _REPLY.unpack_from(view, 0)
                fields = _split(view, _REPLY.size, count)
            except _Malformed as exc:
                raise MPIStoreError(f"MPIStore {_NAMES[op]}: a malformed reply from rank 0 "
                                    f"({exc})") from None
            if answered == request:
                return code, fields
            # an answer to an earlier call that gave up on this tag: not ours
