"""Snapshots of an elastic job: a :class:`~mpistrat.checkpoint.Checkpoint`'s state kept
in each host's RAM (``/dev/shm``) at every step boundary, so that a relaunch on the hosts
that remain resumes where the lost launch was, not at the last checkpoint on disk.

In synchronous data-parallel training every rank holds the whole state, so one rank per
host (the host's lowest) writes it, into that host's own directory: every host holds a
complete copy, and whichever host is lost, each survivor's copy is its partner copy. The
other ranks write nothing.

Layout, in ``$MPISTRAT_ELASTIC_DIR`` (default ``/dev/shm``, else the temporary
directory)::

    mpistrat-elastic-<uid>-<job id>/      (0700, this user's)
        <host>/slot-0.data  slot-1.data   (the values, back to back; written in place)
        <host>/slot-0.json  slot-1.json   (manifests: the commit records)

Two slots alternate: snapshot ``n`` goes to slot ``n % 2``. Its manifest is first deleted,
then the values are copied into the slot's data file (mapped once, so a snapshot is one
memory copy), then a new manifest is written under a temporary name and renamed into
place: the rename commits. A rank killed at any moment leaves the other slot's snapshot
complete and committed, and never a manifest that describes data being overwritten.

A manifest is untrusted input: it is at most :data:`MAX_MANIFEST` bytes, read without
following links from a regular file of this user's; every field is checked, the whole
manifest carries an HMAC under the job's secret (so no file another job, or anybody
without the secret, wrote is ever restored), its entries must be the checkpoint's own
(names, kinds, dtypes, shapes), and each value's CRC-32 must match. A snapshot that fails
any check is skipped with its reason, and the restore takes the newest one that passes on
any host (or, when none does, the newest checkpoint on disk).
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
from ..elastic import hooks
from ..elastic.env import ElasticEnv
from ..runtime._mpi import Comm
from .checkpoint import Checkpoint, _describe, _jsonable, _kind, _on_chief, _parse_dtype

__all__ = ["SnapshotStore", "SnapshotInfo", "DIR_ENV", "MAX_MANIFEST", "KEEP_ENV"]

DIR_ENV = "MPISTRAT_ELASTIC_DIR"
KEEP_ENV = "MPISTRAT_ELASTIC_KEEP"  # hours an abandoned job's snapshots stay (default 24)
FORMAT = "mpistrat.snapshot"
VERSION = 1
MAX_MANIFEST = 1 << 20
_ALIGN = 64
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_HOST = re.compile(r"[^A-Za-z0-9._-]")
# stores whose snapshot is being written in the background (restore waits for them)
_IN_FLIGHT: weakref.WeakSet[SnapshotStore] = weakref.WeakSet()


@dataclass(frozen=True)
class SnapshotInfo:
    """A snapshot restored (:meth:`SnapshotStore.restore`).

    Attributes:
        path: its manifest, on the host it was read from.
        sequence: its number (one per snapshot taken in the job, across launches).
        world_size: the number of ranks that took it.
        position: the input pipeline's position then (see :mod:`mpistrat.elastic.hooks`).
        skipped: the snapshots found but not used, each with its reason.
    """

    path: str
    sequence: int
    world_size: int
    position: tuple[str, int] | None
    skipped: tuple[str, ...] = ()


@dataclass
class _Slot:
    path: str
    size: int = 0
    fd: int = -1
    map: mmap.mmap | None = None


@dataclass(eq=False)
class SnapshotStore:
    """The snapshots of ``checkpoint`` in an elastic job's ``launch`` (collective to
    create: the ranks learn who writes on each host).

    Args:
        checkpoint: the state.
        launch: the job's launch (its id names the directory).
        secret: the job's secret (the manifests' HMAC key).
        comm: the job's communicator (default: the checkpoint's).
        root: the directory the job's snapshot directory goes in (default
            ``$MPISTRAT_ELASTIC_DIR``, else ``/dev/shm``, else the temporary directory).
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
        hosts = self.comm.allgather(host)
        self._size = self.comm.Get_size()
        self.writer = hosts.index(host) == self.comm.Get_rank()  # this host's lowest rank
        root = self.root or os.environ.get(DIR_ENV) or (
            "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        self.job_directory = os.path.join(root, f"mpistrat-elastic-{os.getuid()}-"
                                                f"{self.launch.job}")
        self.directory = os.path.join(self.job_directory, _HOST.sub("_", host)[:64] or "host")
        self._slots = [_Slot(os.path.join(self.directory, f"slot-{i}")) for i in (0, 1)]
        self._thread: threading.Thread | None = None
        self._warned = False
        if self.writer:
            _private_directory(self.job_directory)
            _private_directory(self.directory)
            _sweep(root, self.job_directory)

    # -- taking

    def take(self, position: tuple[str, int] | None) -> None:
        """Write snapshot ``sequence + 1`` of the current state (on this host's writer;
        the other ranks only count it).

        With ``background`` (the default), the writer copies mpistrat's variables into
        the slot, checksums and commits in a thread of its own while training goes on:
        the first write to any mpistrat variable (the next update) waits until the copy
        is done (:func:`mpistrat.elastic.hooks.before_write`), so the snapshot holds the
        state of this boundary. Other leaves (NumPy arrays, which the script may change
        in place, scalars, generators, GPU values) are copied here, before returning."""
        self.sequence += 1
        if not self.writer:
            return
        started = time.perf_counter()
        self.wait()  # (the previous snapshot is committed: snapshots commit in order)
        os.utime(self.job_directory)  # (a live job's snapshots are never swept, _sweep)
        slot = self._slots[self.sequence % 2]
        sources: list[tuple[dict[str, Any], np.ndarray, bool]] = []
        entries, offset = [], 0
        for name, obj in self.checkpoint._leaves:
            kind = _kind(obj)
            if kind == "generator":
                entries.append({"name": name, "kind": kind,
                                "state": _jsonable(obj.bit_generator.state)})
                continue
            value, fenced = _host_value(obj)
            offset = -(-offset // _ALIGN) * _ALIGN
            entry = {"name": name, "kind": kind, "dtype": value.dtype.name,
                     "shape": list(value.shape), "offset": offset, "nbytes": int(value.nbytes)}
            entries.append(entry)
            sources.append((entry, value, fenced and self.background))
            offset += value.nbytes
        _unlink(slot.path + ".json")  # (the data below is no longer what it describes)
        data = self._mapped(slot, offset)
        for entry, value, later in sources:
            if not later:
                np.copyto(_view(data, entry), value, casting="no")
        manifest = {"format": FORMAT, "version": VERSION, "job": self.launch.job,
                    "sequence": self.sequence, "slot": self.sequence % 2,
                    "world_size": self._size, "launch": self.launch.restart,
                    "save_counter": self.checkpoint.save_counter, "data_size": offset,
                    "position": list(position) if position is not None else None,
                    "entries": entries, "created": time.time()}
        deferred = [(entry, value) for entry, value, later in sources if later]
        if not self.background:
            self._finish(slot, data, manifest, sources, [])
        else:
            copied = threading.Event()
            if deferred:
                hooks.set_fence(copied.wait)
            else:
                copied.set()
            self._thread = threading.Thread(
                target=self._finish, args=(slot, data, manifest, sources, deferred, copied),
                name="mpistrat-snapshot", daemon=True)
            _IN_FLIGHT.add(self)
            self._thread.start()
        self.taken += 1
        self.seconds += time.perf_counter() - started

    def _finish(self, slot: _Slot, data: memoryview, manifest: dict[str, Any],
                sources: list[tuple[dict[str, Any], np.ndarray, bool]],
                deferred: list[tuple[dict[str, Any], np.ndarray]],
                copied: threading.Event | None = None) -> None:
        """Copy the ``deferred`` values, release the fence, checksum, commit."""
        try:
            try:
                for entry, value in deferred:
                    np.copyto(_view(data, entry), value, casting="no")
            finally:
                if copied is not None:
                    hooks.set_fence(None)
                    copied.set()
            for entry, _, _ in sources:
                entry["crc32"] = zlib.crc32(_bytes(_view(data, entry)))
            manifest["mac"] = self._mac(manifest)
            write_atomically(slot.path + ".json", json.dumps(manifest, sort_keys=True),
                             mode=0o600)
        except Exception as exc:  # noqa: BLE001 - training goes on without this snapshot
            if not self._warned:
                self._warned = True
                warnings.warn(f"snapshot {manifest['sequence']} could not be written to "
                              f"{self.directory}: {type(exc).__name__}: {exc}; training "
                              f"goes on, a restart falls back to an older snapshot or the "
                              f"checkpoint on disk (free memory in /dev/shm, or give "
                              f"{DIR_ENV} another directory)", RuntimeWarning, stacklevel=1)

    def wait(self) -> None:
        """Until the snapshot being written here (if any) is committed."""
        thread = self._thread
        if thread is not None:
            thread.join()
            self._thread = None
        _IN_FLIGHT.discard(self)

    def _mapped(self, slot: _Slot, size: int) -> memoryview:
        """The slot's data file, ``size`` bytes, mapped (created or resized when needed)."""
        if slot.map is None or slot.size != size:
            self._unmap(slot)
            fd = os.open(slot.path + ".data", os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o600)
            try:
                os.ftruncate(fd, max(size, 1))
                slot.map = mmap.mmap(fd, max(size, 1))
            except BaseException:
                os.close(fd)
                raise
            slot.fd, slot.size = fd, size
        return memoryview(slot.map)

    def _unmap(self, slot: _Slot) -> None:
        if slot.map is not None:
            slot.map.close()
            slot.map = None
        if slot.fd >= 0:
            os.close(slot.fd)
            slot.fd = -1

    def _mac(self, manifest: dict[str, Any]) -> str:
        body = json.dumps({k: v for k, v in manifest.items() if k != "mac"}, sort_keys=True)
        return hmac.new(self.secret, b"mpistrat-snapshot\0" + body.encode(),
                        hashlib.sha256).hexdigest()

    # -- restoring

    def restore(self) -> SnapshotInfo | None:
        """Restore the newest valid snapshot any host holds into the checkpoint's
        objects, on every rank (collective); None (nothing changed) when no host holds
        one. The writers look; the newest found is read on its host and broadcast."""
        comm = self.comm
        assert comm is not None
        for store in list(_IN_FLIGHT):  # (this process's own snapshots, committed first)
            store.wait()
        found: tuple[int, str, dict[str, Any]] | None = None
        notes: list[str] = []
        if self.writer:
            found, notes = self._newest()
        sequences = comm.allgather(found[0] if found is not None else -1)
        skipped = tuple(note for part in comm.allgather(notes) for note in part)
        best = max(sequences)
        if best < 0:
            return None
        source = sequences.index(best)
        values: list[np.ndarray] = []

        def work() -> tuple[str, dict[str, Any]]:
            assert found is not None
            path, manifest = found[1], found[2]
            data = memoryview(_read_only_map(path[:-len(".json")] + ".data"))
            values.extend(np.array(_view(data, e)) for e in manifest["entries"]
                          if e["kind"] != "generator")
            return path, manifest

        def failure(exc: Exception) -> tuple[type[Exception], str]:
            return OSError, (f"reading the snapshot on rank {source} failed: "
                             f"{type(exc).__name__}: {exc}")

        path, manifest = _on_chief(comm, source, work, failure)
        chief_values: Iterator[np.ndarray] = iter(values)
        received: list[np.ndarray | None] = []
        for entry in manifest["entries"]:
            if entry["kind"] == "generator":
                received.append(None)
                continue
            if comm.Get_rank() == source:
                buffer = next(chief_values)
            else:
                buffer = np.empty(entry["shape"], _parse_dtype(entry["dtype"]))
            if buffer.nbytes and comm.Get_size() > 1:
                comm.Bcast(buffer.reshape(-1).view(np.uint8), root=source)
            received.append(buffer)
        for (_, obj), entry, value in zip(self.checkpoint._leaves, manifest["entries"],
                                          received):
            if entry["kind"] == "generator":
                obj.bit_generator.state = entry["state"]
            elif isinstance(obj, np.ndarray):
                obj[...] = value
            else:
                obj.assign(value)
        self.checkpoint.save_counter = manifest["save_counter"]
        self.sequence = best
        position = manifest["position"]
        return SnapshotInfo(path, best, manifest["world_size"],
                            (position[0], position[1]) if position is not None else None,
                            skipped)

    def _newest(self) -> tuple[tuple[int, str, dict[str, Any]] | None, list[str]]:
        """This host's newest valid snapshot ``(sequence, manifest path, manifest)``,
        and why each other one found was skipped."""
        best: tuple[int, str, dict[str, Any]] | None = None
        notes = []
        for slot in self._slots:
            path = slot.path + ".json"
            if not os.path.lexists(path):
                continue
            try:
                manifest = self.check(path)
            except (OSError, ValueError) as exc:
                notes.append(f"{path}: {exc}")
                continue
            if best is None or manifest["sequence"] > best[0]:
                best = (manifest["sequence"], path, manifest)
        return best, notes

    def check(self, path: str) -> dict[str, Any]:
        """The manifest at ``path`` once every check of the module docstring passed.

        Raises:
            ValueError: naming the first check that failed.
            OSError: the files cannot be read.
        """
        text = _read_private(path, MAX_MANIFEST)
        try:
            manifest = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"not JSON ({exc})") from None
        if not isinstance(manifest, dict):
            raise ValueError("not a JSON object")
        given = manifest.get("mac")
        if not isinstance(given, str) or not hmac.compare_digest(given, self._mac(manifest)):
            raise ValueError("not written by this job (its authentication does not match)")
        if manifest.get("format") != FORMAT or manifest.get("version") != VERSION or \
                manifest.get("job") != self.launch.job:
            raise ValueError(f"not a version {VERSION} snapshot of job {self.launch.job}")
        for name in ("sequence", "world_size", "save_counter", "data_size", "slot"):
            if not _is_count(manifest.get(name)):
                raise ValueError(f"{name} is {manifest.get(name)!r}, expected an integer >= 0")
        if manifest["sequence"] % 2 != manifest["slot"] or \
                not path.endswith(f"slot-{manifest['slot']}.json"):
            raise ValueError(f"its slot {manifest['slot']} is not the file's")
        position = manifest.get("position")
        if position is not None and not (isinstance(position, list) and len(position) == 2
                                         and isinstance(position[0], str)
                                         and _is_count(position[1])):
            raise ValueError(f"position is {position!r}, expected [kind, batches] or null")
        entries = manifest.get("entries")
        leaves = self.checkpoint._leaves
        if not isinstance(entries, list) or len(entries) != len(leaves):
            raise ValueError(f"it holds {len(entries) if isinstance(entries, list) else '?'} "
                             f"entries, the checkpoint {len(leaves)} objects")
        data_path = path[:-len(".json")] + ".data"
        data: memoryview | None = None
        for entry, (name, obj) in zip(entries, leaves):
            kind = _kind(obj)
            if not isinstance(entry, dict) or entry.get("name") != name or \
                    entry.get("kind") != kind:
                raise ValueError(f"an entry is {_short(entry)}, expected {kind} {name!r}")
            if kind == "generator":
                state = entry.get("state")
                if not isinstance(state, dict) or state.get("bit_generator") != \
                        type(obj.bit_generator).__name__:
                    raise ValueError(f"entry {name!r} is not a "
                                     f"{type(obj.bit_generator).__name__} state")
                continue
            dtype, shape = _describe(obj)
            if entry.get("dtype") != dtype or entry.get("shape") != list(shape):
                raise ValueError(f"entry {name!r} is {entry.get('dtype')!r} "
                                 f"{entry.get('shape')!r}, the object {dtype} {list(shape)}")
            nbytes = int(np.prod(shape, dtype=np.int64)) * _parse_dtype(dtype).itemsize
            offset: Any = entry.get("offset")
            if entry.get("nbytes") != nbytes or not _is_count(offset) or \
                    offset + nbytes > manifest["data_size"] or \
                    not _is_count(entry.get("crc32")):
                raise ValueError(f"entry {name!r} has a bad place or checksum field")
            if data is None:
                data = memoryview(_read_only_map(data_path, manifest["data_size"]))
            if zlib.crc32(_bytes(_view(data, entry))) != entry["crc32"]:
                raise ValueError(f"entry {name!r} does not match its checksum (torn or "
                                 f"changed)")
        return manifest

    # -- the end

    def close(self, remove: bool = False) -> None:
        """Unmap the slots; with ``remove``, delete this host's snapshots (the job is
        over)."""
        self.wait()
        for slot in self._slots:
            self._unmap(slot)
        if remove and self.writer:
            shutil.rmtree(self.directory, ignore_errors=True)
            try:
                os.rmdir(self.job_directory)  # (the last host's writer on a shared /dev/shm)
            except OSError:
                pass


def _host_value(obj: Any) -> tuple[np.ndarray, bool]:
    """``obj``'s value in host memory, without a copy where it lives there already; and
    whether every change to it waits for :func:`mpistrat.elastic.hooks.before_write`
    (mpistrat's variables on the host: the value may be copied later)."""
    value: Any = obj
    fenced = False
    if not isinstance(obj, np.ndarray):
        read = getattr(obj, "_read_array", None)  # mpistrat's variables: no copy
        value = read() if callable(read) else None
        fenced = isinstance(value, np.ndarray)
        if not fenced:
            value = np.asarray(obj.numpy())
    if value.dtype.byteorder not in "=|":
        value, fenced = value.astype(value.dtype.newbyteorder("=")), False
    return value, fenced


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
