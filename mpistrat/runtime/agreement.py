"""Agree across ranks that a collective call is valid and identical everywhere.

Before any data moves, every rank contributes (did my arguments fail?, a hash of what I
was asked to do) to one 24-byte ``Allreduce``. If some rank failed or the hashes differ,
the ranks exchange descriptions (error path only) and every rank raises: the rank whose
arguments were bad raises its own error, the others a :class:`CollectiveMismatchError`
naming each rank's call. So a mistake on one rank is an error everywhere, never a hang.

Up to :data:`FUSED_RANKS` ranks every agreement on a communicator — :func:`agree`'s,
timed or not, and ``all_reduce``'s — goes through the communicator's :class:`Exchange`
instead: one allgather of fixed-size blocks, a header with the call's code
and a payload area that carries a small ``all_reduce``'s data, so that agreement and data
travel in one collective. Because every entry point starts with the same collective, a
rank in one entry point and a rank in another meet and raise, instead of posting two
collectives that never match. Above :data:`FUSED_RANKS` it is the 24-byte ``Iallreduce``
above, for every entry point alike. Every agreement's collective is of one kind, since
blocking and non-blocking collectives never match: a blocking ``Allgather``, or under a
stall watch (set up collectively) or on a communicator whose ranks chose it
(:func:`poll_agreements`, e.g. a torch group with a timeout) an ``Iallgather`` that is
polled; a timed agreement on any other communicator without a watch runs the blocking
``Allgather`` in a thread that it stops waiting for at its deadline.

A rank that never arrives is caught by the stall check of :mod:`mpistrat.runtime.stall` (when
one is on, e.g. under ``mpistrat run``) or by a call's own ``timeout``.

Under :mod:`mpistrat.trace` every agreement is a span ``agreement`` (category
``mpistrat_phase``: the time this rank waited for the others) with the ``seq`` of its
collective on the communicator, so that the ranks' spans of one collective can be matched;
a small call whose data travels in the exchange says ``carries_data``. The front doors of
the collectives (``all_reduce``, the ``CrossDeviceOps``, the torch adapter) record their
spans through :func:`open_door` and :func:`close_door` (the section at the end).
"""

from __future__ import annotations

import hashlib
import threading
import time
from time import monotonic_ns
from typing import Any, NoReturn

import numpy as np

from ..errors import CollectiveMismatchError, CollectiveTimeoutError
from . import recorder, stall
from ._commcache import comm_cache
from ._mpi import Comm, mpi
from .recorder import bus_factor

__all__ = ["agree", "agree_exchange", "exchange", "Exchange", "signature_code", "FAILED",
           "FUSED_RANKS", "FUSED_BYTES", "HEADER_BYTES", "DOORS", "open_door", "close_door",
           "note_algorithm", "traced_agreement", "next_seq", "phase", "dtype_name", "dtype_of",
           "poll_agreements"]


def agree(comm: Comm, signature: str | None, error: BaseException | None, what: str,
          hint: str = "the same call", timeout: float | None = None) -> None:
    """Raise on every rank unless every rank prepared the same ``signature`` without error.

    Args:
        comm: the communicator of the collective about to run.
        signature: a description of this rank's call (None when ``error`` is set).
        error: the exception this rank's argument checks raised, if any.
        what: the collective's name for messages (``"all_reduce"``).
        hint: what every rank must pass identically, for the mismatch message.
        timeout: seconds to wait for the other ranks; past it, raise
            :class:`CollectiveTimeoutError` naming the ranks that have not arrived. Part
            of the agreed call: ranks that pass different timeouts get a mismatch error.
            None: the process-wide stall check and timeout of :func:`mpistrat.runtime.stall.watch`
            apply, if any.
    """
    found = exchange(comm)
    if found is not None:
        # every agreement on a communicator starts with its exchange, all_reduce's as
        # well as the others': a rank in one entry point and a rank in another then meet
        # in the same collective and see different codes, instead of two collectives
        # that never match
        _agree_through(found, comm, signature, error, what, hint, timeout)
        return
    code = 0
    if signature is not None:
        text = f"{signature} timeout={timeout}"
        digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
        code = int.from_bytes(digest, "little") >> 2  # fits in int64, and so does -code
    flags = np.array([1 if error is not None else 0, code, -code], dtype=np.int64)
    notes = None
    t = monotonic_ns() if recorder.on else 0
    if timeout is None:
        # Non-blocking even without a timeout: blocking and non-blocking collectives do
        # not match each other in MPI, and ranks may disagree on the timeout.
        stall.allreduce_max(comm, flags, what)
    else:
        notes = _allreduce_within(comm, flags, timeout, what)
    if t:
        traced_agreement(t, comm)
    failed, high, negated_low = (int(x) for x in flags)
    if not failed and high == -negated_low:
        if notes is not None:  # every rank agreed on this timeout, so every rank sent one
            notes.finish(range(comm.Get_size()))
        return
    _disagree(comm, signature, error, what, hint, timeout, notes)


def _agree_through(found: Exchange, comm: Comm, signature: str | None,
                   error: BaseException | None, what: str, hint: str,
                   timeout: float | None) -> None:
    """:func:`agree` through the communicator's :class:`Exchange` (its payload unread)."""
    code = FAILED if signature is None else signature_code(f"{signature} timeout={timeout}")
    notes = None
    if timeout is None:
        codes = found.run(comm, code, what)
    else:
        # the same kind of collective as an untimed agreement's (blocking and non-blocking
        # collectives never match): non-blocking under a stall watch, else blocking, in a
        # thread this one stops waiting for at the deadline
        t = monotonic_ns() if recorder.on else 0
        found.code[0] = code
        notes = _Notes(comm)
        if stall.current() is not None or found.polled:
            _within(comm, comm.Iallgather(*found.message), timeout, what, notes)
        else:
            _within(comm, _Blocking(comm.Allgather, found.message), timeout, what, notes)
        codes = found.codes.tobytes()
        if t:
            traced_agreement(t, comm)
    if codes == found.expected(code) and error is None:
        if notes is not None:  # every rank agreed on this timeout, so every rank sent one
            notes.finish(range(comm.Get_size()))
        return
    _disagree(comm, signature, error, what, hint, timeout, notes)


class _Blocking:
    """A blocking collective run by an agreement thread, seen as a request (``Test``): a
    timed agreement can stop waiting for it. Past the deadline the thread stays in the
    collective until the missing ranks come (the communicator is unusable after a
    timeout) and the next timed agreement gets another thread; they are daemon threads,
    so none keeps the process alive. Idle threads wait for the next call (starting a
    thread for each call cost about 0.1 ms of every timed agreement)."""

    _idle: list[_AgreementThread] = []
    _lock = threading.Lock()

    def __init__(self, call: Any, args: Any) -> None:
        with _Blocking._lock:
            worker = _Blocking._idle.pop() if _Blocking._idle else None
        if worker is None:
            worker = _AgreementThread()
        self._worker = worker
        worker.run(call, args)

    def Test(self) -> bool:  # noqa: N802 (mpi4py's name)
        """True once the collective has returned (its error, if any, raised here)."""
        worker = self._worker
        if not worker.done.acquire(timeout=1e-4):
            return False
        error, worker.error = worker.error, None
        with _Blocking._lock:
            _Blocking._idle.append(worker)
        if error is not None:
            raise error
        return True

    def abandon(self) -> None:
        """The agreement timed out: the thread goes back to the idle ones once its
        collective returns (when the missing ranks come), whatever it returned."""
        worker = self._worker
        with _Blocking._lock:
            if worker.done.acquire(blocking=False):  # (returned meanwhile)
                worker.error = None
                _Blocking._idle.append(worker)
            else:
                worker.abandoned = True


class _AgreementThread:
    """One thread that runs the blocking collectives handed to it, one at a time; two
    locks held as signals (a lock's release wakes its waiter faster than an Event's
    condition does): ``_go`` released to start a call, ``done`` released when it has
    returned."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.abandoned = False  # (its caller timed out: nobody waits for this call)
        self._job: tuple[Any, Any] | None = None
        self._go = threading.Lock()
        self._go.acquire()
        self.done = threading.Lock()
        self.done.acquire()
        threading.Thread(target=self._serve, daemon=True, name="mpistrat-agreement").start()

    def run(self, call: Any, args: Any) -> None:
        self._job = (call, args)
        self._go.release()

    def _serve(self) -> None:
        while True:
            self._go.acquire()
            job, self._job = self._job, None
            assert job is not None
            try:
                job[0](*job[1])
            except BaseException as exc:  # handed to the waiting thread by Test
                self.error = exc
            with _Blocking._lock:  # (abandon() decides under it too)
                if self.abandoned:
                    self.abandoned, self.error = False, None
                    _Blocking._idle.append(self)
                else:
                    self.done.release()


def _disagree(comm: Comm, signature: str | None, error: BaseException | None, what: str,
              hint: str, timeout: float | None = None, notes: _Notes | None = None,
              ) -> NoReturn:
    """The ranks did not agree: exchange descriptions (one ``allgather``) and raise on
    every rank: this rank's own error if its arguments failed, else a
    :class:`CollectiveMismatchError` naming every rank's call."""
    mine = f"{type(error).__name__}: {error}" if error is not None else signature
    everyone = comm.allgather((error is not None, mine, timeout is not None))
    timed = [rank for rank, (_, _, has_timeout) in enumerate(everyone) if has_timeout]
    if notes is not None:
        notes.finish(timed)
    else:  # take the arrival notes the timed ranks sent us, so none is left behind
        for source in timed:
            comm.Recv(np.zeros(1, dtype=np.int64), source, tag=_ARRIVAL_TAG)
    detail = "; ".join(f"rank {rank}: {text}" for rank, (_, text, _) in enumerate(everyone))
    if error is not None:
        raise error
    bad = [rank for rank, (erred, _, _) in enumerate(everyone) if erred]
    if bad:
        raise CollectiveMismatchError(
            f"{what} failed on rank(s) {bad} before communicating ({detail}); fix the "
            f"arguments there: every rank must pass a valid, identical call"
        )
    raise CollectiveMismatchError(
        f"{what} called with different arguments on different ranks ({detail}); every "
        f"rank must pass {hint}"
    )


_ARRIVAL_TAG = 0x5A7  # point-to-point tag of the arrival notes of timed agreements


class _Notes:
    """The arrival notes of one timed agreement: one sent to, one expected from, each rank."""

    def __init__(self, comm: Comm) -> None:
        rank = comm.Get_rank()
        self.others = [r for r in range(comm.Get_size()) if r != rank]
        self._note = np.ones(1, dtype=np.int64)
        self._inbox = [np.zeros(1, dtype=np.int64) for _ in self.others]
        self.receives = [comm.Irecv(buf, source, tag=_ARRIVAL_TAG)
                         for buf, source in zip(self._inbox, self.others)]
        self.sends = [comm.Isend(self._note, dest, tag=_ARRIVAL_TAG) for dest in self.others]

    def missing(self) -> list[int]:
        """The ranks whose note has not come."""
        return [source for source, r in zip(self.others, self.receives) if not r.Test()]

    def finish(self, senders: Any) -> None:
        """Complete the exchange: wait for the notes of ``senders``, cancel the others."""
        MPI = mpi()
        senders = set(senders)
        for source, receive in zip(self.others, self.receives):
            if source not in senders and not receive.Test():
                receive.Cancel()
            receive.Wait()
        MPI.Request.Waitall(self.sends)  # every rank takes the notes sent to it


def _allreduce_within(comm: Comm, flags: np.ndarray, timeout: float, what: str) -> _Notes:
    """The agreement Allreduce, given up after ``timeout`` seconds.

    Each arriving rank also sends a one-word arrival note to every other rank, so that on
    a timeout a rank can name the ranks it never heard from. After a timeout the
    communicator still has a collective in flight and must not be used again: end the
    job (``mpistrat run`` aborts it) or create a new communicator.
    """
    MPI = mpi()
    notes = _Notes(comm)
    return _within(comm, comm.Iallreduce(MPI.IN_PLACE, flags, op=MPI.MAX), timeout, what,
                   notes)


_ABANDONED: list[Any] = []  # the requests of timed-out agreements (a few per job at most)


def _within(comm: Comm, request: Any, timeout: float, what: str,
            notes: _Notes | None = None) -> _Notes:
    """Wait for ``request``, an agreement's first collective, at most ``timeout`` seconds,
    with arrival notes (made here unless given, before ``request`` on every rank) to
    name the ranks that never came."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if notes is None:
        notes = _Notes(comm)
    start = time.monotonic()
    deadline = start + timeout
    spin = min(deadline, start + stall.SPIN)
    pause = 1e-5
    while not request.Test():
        now = time.monotonic()
        if now < spin:  # (short waits: poll, yielding the core; then sleep longer)
            stall.yield_core()
            continue
        if now >= deadline:
            if isinstance(request, _Blocking):
                request.abandon()
            else:  # (kept: a non-blocking collective's request must never be freed)
                _ABANDONED.append(request)
            missing = notes.missing()
            raise CollectiveTimeoutError(
                f"{what} timed out after {timeout:g} s on rank {rank} of {size}: rank(s) "
                f"{missing} did not arrive; they are stuck elsewhere or have taken another "
                f"code path (every rank must call {what} the same number of times); this "
                f"communicator cannot be used after the timeout",
                missing,
            )
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)
    return notes


# -- the exchange: an agreement that carries a small payload ---------------------------------

FUSED_RANKS = 16
"""Up to this many ranks, a communicator's :class:`Exchange` is an allgather of fixed-size
blocks (header and payload); above it the exchange carries no payload and is
:func:`agree`'s 24-byte ``Iallreduce`` (a gather grows with the ranks)."""

FUSED_BYTES = 4096
"""The most payload a block carries: ``all_reduce`` of one array of up to this many bytes
travels inside its agreement (:meth:`Exchange.grow`)."""

HEADER_BYTES = 64
"""A block's header: the signature code (int64) in its first word, zeros after (the
payload starts 64-byte aligned)."""

FAILED = -1
"""The code of a rank whose arguments failed (a signature's code is never negative)."""


def signature_code(text: str) -> int:
    """A call's signature as a non-negative int64 (a 62-bit hash of the text)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(),
                          "little") >> 2


def _aligned(nbytes: int) -> np.ndarray:
    """``nbytes`` zeroed bytes starting on a 64-byte boundary."""
    raw = np.zeros(nbytes + 64, dtype=np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start:start + nbytes]


class Exchange:
    """The first collective of a checked ``all_reduce`` on one communicator of ``size``
    ranks (at most :data:`FUSED_RANKS`): every rank contributes one block of
    ``HEADER_BYTES + capacity`` bytes to an allgather — the same count and datatype on
    every rank whatever it was asked to do, so the call is well defined even when the
    ranks disagree. A block's header holds the code of the rank's signature
    (:data:`FAILED` when its arguments failed); its payload area holds the rank's data
    when the call is small and fits, else nothing. After the allgather every rank has
    every rank's header (the call agreed if they are all its own code) and, for small
    calls that fit, every rank's data, reduced locally in rank order (bitwise the same
    on every rank).

    ``capacity`` starts at 0 and grows (:meth:`grow`, to at most :data:`FUSED_BYTES`)
    after an *agreed* small call that did not fit — that call's data then follows in a
    second allgather — so a loop of small calls sends blocks just large enough, and a
    job of large calls headers only. It changes only on calls every rank agreed on,
    identically everywhere, so every rank's next block has the same size.

    The buffers live as long as the communicator (:func:`exchange`): calls on one
    communicator are sequential (an MPI rule for collectives), so one set serves them all.
    """

    __slots__ = ("size", "capacity", "block", "send", "recv", "code", "codes", "words",
                 "message", "polled")

    def __init__(self, size: int) -> None:
        self.size = size
        self.polled = False  # (set by poll_agreements: non-blocking on every rank)
        self.send = _aligned(HEADER_BYTES + FUSED_BYTES)
        self.recv = _aligned(size * (HEADER_BYTES + FUSED_BYTES))
        # this rank's header word, and the gather buffer as int64 words (rank r's code is
        # word r * block // 8): memoryviews, whose items cost less to reach than NumPy's
        self.code = self.send[:8].data.cast("q")
        self.words = self.recv.data.cast("q")
        self._resize(0)

    def _resize(self, capacity: int) -> None:
        MPI = mpi()
        self.capacity = capacity
        self.block = block = HEADER_BYTES + capacity
        self.codes = self.recv.view(np.int64)[:self.size * block // 8:block // 8]
        # the allgather's arguments, made once (mpi4py then skips NumPy's buffer export)
        self.message = ([MPI.buffer(self.send[:block]), MPI.BYTE],
                        [MPI.buffer(self.recv[:self.size * block]), MPI.BYTE])

    def grow(self, nbytes: int) -> None:
        """Make room for ``nbytes`` of payload (at most :data:`FUSED_BYTES`) from the next
        exchange on. Call it on every rank alike: after an agreed call."""
        if self.capacity < nbytes <= FUSED_BYTES:
            self._resize(min(FUSED_BYTES, -(-nbytes // 64) * 64))

    def payload(self, shape: tuple, dtype: Any, offset: int = 0) -> np.ndarray:
        """A view of ``shape`` and ``dtype`` at ``offset`` bytes into this rank's payload
        area (what it sends, in a block or packed; at most :data:`FUSED_BYTES` in all)."""
        dtype = np.dtype(dtype)
        start = HEADER_BYTES + offset
        return self.send[start:start + _nbytes(shape, dtype)].view(dtype).reshape(shape)

    def rows(self, shape: tuple, dtype: Any, packed: bool = False, offset: int = 0,
             stride: int | None = None) -> list[np.ndarray]:
        """Views of ``shape`` and ``dtype``, ``offset`` bytes into every rank's data in
        the gather buffer, in rank order: in the blocks as they are now (``capacity`` must
        hold them), or ``packed`` back to back as :meth:`packed` gathers them (``stride``:
        the bytes per rank it gathered, default this view's own)."""
        dtype = np.dtype(dtype)
        nbytes = _nbytes(shape, dtype)
        if packed:
            step, start = (nbytes if stride is None else stride), offset
        else:
            step, start = self.block, HEADER_BYTES + offset
            if offset + nbytes > self.capacity:
                raise ValueError(f"{offset + nbytes} bytes do not fit blocks of "
                                 f"{self.capacity}")
        return [self.recv[r * step + start:r * step + start + nbytes].view(dtype)
                .reshape(shape) for r in range(self.size)]

    def packed(self, nbytes: int) -> tuple[list, list]:
        """The arguments of an allgather of ``nbytes`` per rank without headers: from this
        rank's payload area into the start of the gather buffer, rank ``r``'s bytes at
        ``r * nbytes``. For calls whose structure every rank knows to match (they agreed,
        or skip the check)."""
        MPI = mpi()
        return ([MPI.buffer(self.send[HEADER_BYTES:HEADER_BYTES + nbytes]), MPI.BYTE],
                [MPI.buffer(self.recv[:self.size * nbytes]), MPI.BYTE])

    def expected(self, code: int) -> bytes:
        """What :meth:`run` returns when every rank sent ``code``."""
        return code.to_bytes(8, "little", signed=True) * self.size

    def run(self, comm: Comm, code: int, what: str, data: bool = False) -> bytes:
        """Send ``code`` with whatever the payload area holds (``capacity`` bytes of it),
        gather every rank's block; return every rank's code as bytes (compare with
        :meth:`expected`). ``data``: the payload carries the call's data (for the trace).

        Watched (:func:`mpistrat.runtime.stall.watch`): a non-blocking allgather polled
        like :func:`agree`'s; else a blocking one (the watch is process-wide and set up
        collectively, so every rank makes the same choice)."""
        t = monotonic_ns() if recorder.on else 0
        self.code[0] = code
        self.gather(comm, what)
        if t:
            traced_agreement(t, comm, data)
        return self.codes.tobytes()

    def gather(self, comm: Comm, what: str) -> None:
        """The exchange's collective, as every untimed agreement on ``comm`` makes it (one
        kind everywhere: blocking and non-blocking collectives never match): a blocking
        allgather, or under a stall watch (set up collectively) or on a communicator of
        :func:`poll_agreements` a non-blocking one, polled."""
        watch = stall.current()
        if watch is not None:
            watch.wait(comm, comm.Iallgather(*self.message), what)
        elif self.polled:
            comm.Iallgather(*self.message).Wait()
        else:
            comm.Allgather(*self.message)

    def disagree(self, comm: Comm, signature: str | None, error: BaseException | None,
                 what: str, hint: str) -> NoReturn:
        """Raise on every rank after an exchange that did not agree (as :func:`agree`
        does: this rank's own error, or a :class:`CollectiveMismatchError`)."""
        _disagree(comm, signature, error, what, hint)


def _nbytes(shape: tuple, dtype: np.dtype) -> int:
    count = 1
    for n in shape:
        count *= n
    return count * dtype.itemsize


def exchange(comm: Comm) -> Exchange | None:
    """``comm``'s :class:`Exchange` (made on first use), or None for a communicator of
    more than :data:`FUSED_RANKS` ranks (use :func:`agree`)."""
    cache = comm_cache(comm)
    found = cache.get("exchange", False)
    if found is False:
        size = comm.Get_size()
        found = cache["exchange"] = Exchange(size) if size <= FUSED_RANKS else None
    return found


def poll_agreements(comm: Comm) -> None:
    """Make every agreement on ``comm`` a non-blocking collective that the caller polls,
    timed or not, with or without a stall watch: a timed agreement then needs no thread
    to stop waiting for a blocking one (about 12 µs instead of 46 on 2 ranks). Every rank
    of ``comm`` must call it before the first agreement on ``comm`` (e.g. where every rank
    makes the communicator and agrees to time its calls): the ranks of one communicator
    must make the same kind of collective."""
    found = exchange(comm)
    if found is not None:  # (above FUSED_RANKS every agreement is non-blocking already)
        found.polled = True


def agree_exchange(comm: Comm, signature: str | None, error: BaseException | None,
                   what: str, hint: str = "the same call") -> Exchange | None:
    """:func:`agree` for a call that starts with an :class:`Exchange` but has no data to
    carry in it: the exchange, its payload area (if the blocks have one) unread — or,
    above :data:`FUSED_RANKS` ranks, :func:`agree`. Returns the exchange (None above
    :data:`FUSED_RANKS`)."""
    found = exchange(comm)
    if found is None:
        agree(comm, signature, error, what, hint)
        return None
    code = FAILED if signature is None else signature_code(signature)
    if found.run(comm, code, what) != found.expected(code) or error is not None:
        found.disagree(comm, signature, error, what, hint)
    return found


# -- tracing: the spans of the collectives ----------------------------------------------------
#
# Only touched while tracing is on (each instrumented place costs one branch when it is
# off). A collective's front door opens with open_door and closes with close_door; the
# outermost door of a thread is the collective (a cpu_op span: what classify counts as
# communication), the doors it goes through (the torch backend's all_reduce calls
# mpistrat.all_reduce) and everything below are phases of it.


class _Doors(threading.local):
    """This thread's traced collectives."""

    depth = 0          # front doors open (1: the collective; more: doors inside it)
    seq = 0            # the collective's number on its communicator (the outermost door's)
    direct = False     # a door's traced path calls the door itself: straight in, no span
    quiet = 0          # > 0: no phases (a batch's group records its reductions as one)
    algorithm = ""     # what reduced the data inside the collective ("xring+shm")
    waited = 0         # ns the collective spent in agreements that carried no data


DOORS = _Doors()
_SEQ_KEY = "trace seq"


_DTYPE_NAMES: dict[Any, str] = {}


def dtype_name(dtype: Any) -> str:
    """``str(dtype)``, remembered (NumPy's costs microseconds a call)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = str(dtype).removeprefix("torch.")
        if len(_DTYPE_NAMES) < 256:
            _DTYPE_NAMES[dtype] = name
    return name


def dtype_of(arrays: list[Any]) -> str:
    """The one dtype of ``arrays`` as the trace writes it, or ``"mixed"``."""
    names = {dtype_name(a.dtype) for a in arrays}
    return names.pop() if len(names) == 1 else "mixed"


def next_seq(comm: Comm) -> int:
    """The next collective's number on ``comm`` (counted while tracing only: the same on
    every rank, since every rank traces the same calls)."""
    cache = comm_cache(comm)
    seq = cache.get(_SEQ_KEY, 0) + 1
    cache[_SEQ_KEY] = seq
    return seq


def open_door(comm: Comm) -> int:
    """A traced collective starts on ``comm``: its start time (for :func:`close_door`)."""
    doors = DOORS
    if not doors.depth:
        doors.seq = next_seq(comm)
        doors.algorithm = ""
        doors.waited = 0
    doors.depth += 1
    return monotonic_ns()


def note_algorithm(name: str) -> None:
    """Say which algorithm reduced (part of) the open collective's data."""
    doors = DOORS
    if not doors.algorithm:
        doors.algorithm = name
    elif name not in doors.algorithm.split("+"):
        doors.algorithm += "+" + name


def close_door(start: int, name: str, collective: str, size: int, dtype: str,
               nelems_in: int, nelems_out: int, nbytes: int, algorithm: str = "",
               extra: dict[str, Any] | None = None) -> None:
    """Record the collective that :func:`open_door` started at ``start``: a ``cpu_op``
    span ``name`` (a phase when another door is open around it) with Kineto's collective
    args, mpistrat's ``algorithm``, ``bytes``, ``seq`` and the bandwidths (over the span
    less its agreements' waiting, as nccl-tests time the data's movement alone)."""
    doors = DOORS
    doors.depth -= 1
    rec = recorder.current()
    if rec is None:
        return
    duration = max(monotonic_ns() - start, 1)
    # (over the time the data moved: waiting for the last rank in the agreement would
    # make a straggler look like a slow link; nccl-tests' times have no such wait)
    algbw = nbytes / max(duration - doors.waited, 1)  # bytes per ns: GB/s
    args = {"Collective name": collective, "dtype": dtype, "In msg nelems": nelems_in,
            "Out msg nelems": nelems_out, "Group size": size,
            "algorithm": algorithm or doors.algorithm or "local", "bytes": nbytes,
            "seq": doors.seq, "algbw (GB/s)": algbw,
            "busbw (GB/s)": algbw * bus_factor(collective, size)}
    if extra:
        args.update(extra)
    rec.add(start, duration, name, recorder.PHASE if doors.depth else recorder.COLLECTIVE,
            args)


def traced_agreement(start: int, comm: Comm, carries_data: bool = False) -> None:
    """Record an agreement that started at ``start``: the phase ``agreement`` with the
    ``seq`` of its collective (an agreement outside any traced collective is one of its
    own on ``comm``); ``carries_data``: the exchange carried the call's data as well."""
    stop = monotonic_ns()  # (one reading: the span is the waiting that algbw leaves out)
    doors = DOORS
    seq = doors.seq if doors.depth else next_seq(comm)
    if carries_data:  # (the exchange is the algorithm: every rank reduces the blocks)
        note_algorithm("exchange")
    elif doors.depth:
        doors.waited += stop - start
    recorder.end(start, "agreement", recorder.PHASE,
                 {"seq": seq, "carries_data": True} if carries_data else {"seq": seq}, stop)


def phase(start: int, name: str, args: dict[str, Any] | None = None) -> None:
    """Record a phase of the open collective that started at ``start`` (not while a
    batch records its reductions as one)."""
    if not DOORS.quiet:
        recorder.end(start, name, recorder.PHASE, args)
