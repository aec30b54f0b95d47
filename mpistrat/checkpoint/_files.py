"""A checkpoint on disk: ``PATH.json`` (the manifest) and ``PATH.<sha256[:16]>.npz`` (the
arrays), written so that a crash at any moment, or a second job writing the same directory,
leaves only complete checkpoints whose manifest describes their own data.

Write order: the arrays go to a temporary file beside the target (created with ``O_EXCL |
O_NOFOLLOW`` under a random name, :mod:`mpistrat._atomic`), through a writer that hashes
every byte as it is written; the file is flushed, ``fsync``\\ ed and renamed to its
content-addressed name ``NAME.<first 16 hex digits of its SHA-256>.npz``, and the directory
``fsync``\\ ed. Then the manifest, holding that name, the data's size and SHA-256 (of the
bytes written, never of a re-read file another writer may have replaced), is written the
same way and renamed over ``PATH.json``: that rename is the only commit. An existing
manifest at ``PATH`` stays in place until its replacement is; the data it named is deleted
only after the new manifest is committed. A checkpoint exists when its manifest does and
its data matches the manifest's size and checksum. Temporary files start with a dot and end
with ``.tmp``; a crash can leave one behind, and nothing ever reads it.

Reading treats the manifest as untrusted input: every field's type and range is checked,
``"data"`` must be the sibling file name the manifest's own name and checksum give (no path
separator, no ``..``), the data file must be a regular file (a symbolic link is refused),
and every failure is a :class:`CheckpointNotFoundError` or :class:`CheckpointCorruptError`
naming the bad value.

Save order: each manifest records ``sequence``, one more than the highest in the directory
when it was written; :func:`scan` lists checkpoints oldest first by it, so the newest save
is the newest checkpoint whatever its number. Version 1 manifests (``PATH.npz``, no
``sequence``; mpistrat before this format) are read too and count as older than any
version 2 one.

Concurrent writers: a save holds :func:`lock` (``flock`` on ``DIR/.mpistrat-ckpt.lock``)
while it picks its number and sequence, writes, commits and prunes, so saves into one
directory take turns. Where the file system does not support ``flock`` the saves go on
unlocked (with a warning): every checkpoint is still complete and self-consistent, but two
saves may then pick the same number, the later replacing the earlier.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import re
import socket
import stat
import time
import warnings
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from .._atomic import exclusive_temporary, fsync_directory, write_atomically
from ..errors import CheckpointCorruptError, CheckpointNotFoundError

__all__ = ["CheckpointNotFoundError", "CheckpointCorruptError", "write", "read",
           "read_manifest", "scan", "highest_number", "prune", "remove", "remove_temporaries",
           "lock", "FORMAT", "VERSION", "LOCK_NAME"]

FORMAT = "mpistrat.checkpoint"
VERSION = 2
READABLE_VERSIONS = (1, 2)
LOCK_NAME = ".mpistrat-ckpt.lock"
LOCK_TIMEOUT = 600.0  # seconds a save waits for another writer's save to finish
ORPHAN_AGE = 600.0  # seconds before a data file no manifest names counts as a crash's leftover

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # a FIFO planted at a name must not block the open
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_CHUNK = 1 << 20
_HEX64 = re.compile(r"[0-9a-f]{64}")
_FIX = "restore an older checkpoint (manager.checkpoints lists them) or start fresh"


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_int(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def data_name(name: str, sha256: str) -> str:
    """The data file of checkpoint ``name`` (``ckpt-3``) whose data has this SHA-256."""
    return f"{name}.{sha256[:16]}.npz"


class _HashingWriter(io.RawIOBase):
    """Writes through to ``file``, hashing and counting every byte on the way.

    It cannot seek, so ``zipfile`` (under ``np.savez``) streams: every byte is written
    once, in order, and the digest is that of the file's content."""

    def __init__(self, file: io.BufferedWriter) -> None:
        super().__init__()
        self._file = file
        self.digest = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._file.write(view)
        self.digest.update(view)
        self.size += len(view)
        return len(view)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self._file.flush()


def _write_data(path: str, arrays: dict[str, np.ndarray]) -> tuple[str, str, int]:
    """Write the arrays beside ``path``; return (data file name, sha256, size)."""
    directory = os.path.dirname(path) or "."
    with exclusive_temporary(path + ".npz") as (file, temporary):
        writer = _HashingWriter(file)  # type: ignore[arg-type]
        np.savez(writer, **arrays)  # type: ignore[arg-type]  # numpy stub: **kwds
        file.flush()
        os.fsync(file.fileno())
        sha256 = writer.digest.hexdigest()
        name = data_name(os.path.basename(path), sha256)
        # the same name holds the same bytes: replacing an earlier copy changes nothing
        os.replace(temporary, os.path.join(directory, name))
    return name, sha256, writer.size


def write(path: str, arrays: dict[str, np.ndarray], manifest: dict[str, Any]) -> None:
    """Write a checkpoint at ``path`` (see the module docstring for the order). Hold
    :func:`lock` on the directory around it when other writers may be at work.

    Args:
        path: the checkpoint's path without suffix (``dir/ckpt-3``).
        arrays: the arrays, by their key in the ``.npz``.
        manifest: JSON-able facts; ``format``, ``version``, ``data``, ``bytes``,
            ``sha256`` and ``sequence`` are added.
    """
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    try:
        previous: str | None = read_manifest(path)["data"]
    except Exception:  # noqa: BLE001 - none, or unreadable: nothing of ours to delete
        previous = None
    sequence = max((r.sequence for r in _records(directory, None)), default=0) + 1
    name, sha256, size = _write_data(path, arrays)
    fsync_directory(directory)  # the data's name is durable before a manifest names it
    text = json.dumps({**manifest, "format": FORMAT, "version": VERSION, "data": name,
                       "bytes": size, "sha256": sha256, "sequence": sequence},
                      indent=1, sort_keys=True)
    write_atomically(path + ".json", text, sync_directory=True)
    if previous is not None and previous != name:
        try:
            os.unlink(os.path.join(directory, previous))
        except OSError:
            pass  # left for prune()'s sweep of unreferenced data


def _open_regular(path: str, what: str) -> int:
    """A read-only descriptor of the regular file ``path``, never through a link.

    Raises:
        FileNotFoundError: nothing there.
        CheckpointCorruptError: a symbolic link, or not a regular file.
        OSError: it cannot be opened (permissions).
    """
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CheckpointCorruptError(
                f"the {what} {path} is a symbolic link; mpistrat writes regular files and "
                f"never follows a link planted at one of its names: remove it, then "
                f"{_FIX}") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointCorruptError(f"the {what} {path} is not a regular file; remove it, "
                                     f"then {_FIX}")
    return fd


def read_manifest(path: str) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path``, every top-level field checked (the
    entries' structure is the caller's: :mod:`mpistrat.checkpoint.checkpoint`).

    Raises:
        CheckpointNotFoundError: no manifest.
        CheckpointCorruptError: a manifest that is not one of ours, or has a field of the
            wrong type or range, or names a data file other than its own sibling.
    """
    record = path + ".json"
    try:
        fd = _open_regular(record, "manifest")
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"no checkpoint at {path!r} ({record} does not exist); give a path returned by "
            f"save() or latest_checkpoint(), without the .json/.npz suffix") from None
    except OSError as exc:
        raise CheckpointCorruptError(f"the manifest {record} cannot be read ({exc}); "
                                     f"{_FIX}") from None
    try:
        with os.fdopen(fd, "rb") as file:
            manifest = json.loads(file.read())
    except (OSError, ValueError, RecursionError) as exc:  # (UnicodeDecodeError: ValueError)
        raise CheckpointCorruptError(f"the manifest {record} cannot be read "
                                     f"({type(exc).__name__}: {exc}); {_FIX}") from None
    _check_manifest(manifest, path)
    return manifest


def _check_manifest(manifest: Any, path: str) -> None:
    record = path + ".json"

    def bad(field: str, expected: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(
            f"the manifest {record} has \"{field}\": {_show(manifest.get(field, '(none)'))}, "
            f"expected {expected}; it was damaged or not written by mpistrat: {_FIX}")

    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{record} is not an mpistrat checkpoint manifest "
                                     f"(no \"format\": \"{FORMAT}\"); {_FIX}")
    version = manifest.get("version")
    if not _is_int(version, 1):
        raise bad("version", f"an integer in {list(READABLE_VERSIONS)}")
    if version not in READABLE_VERSIONS:
        raise CheckpointCorruptError(
            f"{record} has format version {version!r}; this mpistrat reads versions "
            f"{list(READABLE_VERSIONS)}: read it with the (newer) mpistrat that wrote it")
    if not isinstance(manifest.get("sha256"), str) or not _HEX64.fullmatch(manifest["sha256"]):
        raise bad("sha256", "64 lowercase hexadecimal digits")
    if not _is_int(manifest.get("bytes"), 0):
        raise bad("bytes", "the data file's size, an integer >= 0")
    name = os.path.basename(path)
    expected = data_name(name, manifest["sha256"]) if version >= 2 else f"{name}.npz"
    if manifest.get("data") != expected:
        raise bad("data", f"{expected!r}: the data file beside the manifest, named for the "
                          f"checkpoint and its checksum (never a path elsewhere)")
    if version >= 2 and not _is_int(manifest.get("sequence"), 1):
        raise bad("sequence", "the save's place in the directory's save order, an integer >= 1")
    if not _is_int(manifest.get("save_counter"), 0):
        raise bad("save_counter", "an integer >= 0")
    if not _is_int(manifest.get("world_size"), 1):
        raise bad("world_size", "an integer >= 1")
    if not isinstance(manifest.get("created"), str):
        raise bad("created", "a UTC time as text")
    if not isinstance(manifest.get("entries"), list):
        raise bad("entries", "a list of entries")


def read(path: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The manifest and the arrays of the checkpoint at ``path``, verified: the data file
    has the manifest's size and SHA-256, and every member is a NumPy array.

    Raises:
        CheckpointNotFoundError: no manifest, or no data file.
        CheckpointCorruptError: anything else wrong (see :func:`read_manifest`; the data
            does not match the manifest's size or checksum, or cannot be read).
    """
    manifest = read_manifest(path)
    data = os.path.join(os.path.dirname(path), manifest["data"])
    try:
        fd = _open_regular(data, "data file")
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"the checkpoint {path!r} has a manifest but no data "
                                      f"file {data}; {_FIX}") from None
    except OSError as exc:
        raise CheckpointCorruptError(f"the data file {data} cannot be read ({exc}); "
                                     f"{_FIX}") from None
    with os.fdopen(fd, "rb") as file:
        try:
            size = os.fstat(file.fileno()).st_size
            digest = hashlib.sha256()
            if size == manifest["bytes"]:
                while chunk := file.read(_CHUNK):
                    digest.update(chunk)
        except OSError as exc:
            raise CheckpointCorruptError(f"the data file {data} cannot be read ({exc}); "
                                         f"{_FIX}") from None
        if size != manifest["bytes"] or digest.hexdigest() != manifest["sha256"]:
            raise CheckpointCorruptError(
                f"the data file {data} ({size} bytes) does not match its manifest "
                f"({manifest['bytes']} bytes, sha256 {manifest['sha256'][:12]}...): it was "
                f"truncated or changed after the checkpoint was written; {_FIX}")
        try:
            file.seek(0)
            with np.load(file, allow_pickle=False) as npz:
                arrays = {key: npz[key] for key in npz.files}
        except Exception as exc:  # noqa: BLE001 - zipfile, zlib, numpy: any of their errors
            raise CheckpointCorruptError(f"the data file {data} cannot be read "
                                         f"({type(exc).__name__}: {exc}); {_FIX}") from None
    odd = [key for key, value in arrays.items() if not isinstance(value, np.ndarray)]
    if odd:
        raise CheckpointCorruptError(f"the data file {data} holds members that are not NumPy "
                                     f"arrays: {odd[:5]}; {_FIX}")
    return manifest, arrays


class _Record(NamedTuple):
    sequence: int  # 0 for version 1 manifests: older than any version 2 one
    number: int
    path: str
    data: str


def _numbered(directory: str, name: str | None) -> list[tuple[int, str]]:
    """``(N, entry)`` for every ``name-N.json`` in ``directory`` (any name when None)."""
    pattern = re.compile(rf"^({re.escape(name) if name else '.+'})-(\d+)\.json$")
    try:
        entries = os.listdir(directory)
    except FileNotFoundError:
        return []
    return [(int(m.group(2)), entry) for entry in entries
            if (m := pattern.match(entry)) is not None]


def _records(directory: str, name: str | None) -> list[_Record]:
    """The complete checkpoints, oldest save first."""
    found = []
    for number, entry in _numbered(directory, name):
        path = os.path.join(directory, entry[:-len(".json")])
        try:
            manifest = read_manifest(path)
            info = os.lstat(os.path.join(directory, manifest["data"]))
        except Exception:  # noqa: BLE001 - one bad manifest must not hide the others
            continue
        if stat.S_ISREG(info.st_mode) and info.st_size == manifest["bytes"]:
            sequence = manifest["sequence"] if manifest["version"] >= 2 else 0
            found.append(_Record(sequence, number, path, manifest["data"]))
    return sorted(found)


def scan(directory: str, name: str | None) -> list[tuple[int, str]]:
    """The complete checkpoints in ``directory`` as ``(number, path)``, oldest save first
    (the last is the newest save, whatever its number).

    A checkpoint counts when its manifest reads and checks and its data file is a regular
    file of the recorded size (the checksum is verified when it is read). ``name`` selects
    ``name-N`` checkpoints; None takes every name.
    """
    return [(r.number, r.path) for r in _records(directory, name)]


def highest_number(directory: str, name: str) -> int:
    """The highest N of any ``name-N.json`` in ``directory``, complete or not (0: none), so
    a numbered save never lands on an existing name."""
    return max((number for number, _ in _numbered(directory, name)), default=0)


def remove(path: str) -> None:
    """Delete a checkpoint: the manifest first, so it is never seen half-deleted, then the
    data file it names."""
    try:
        data: str | None = read_manifest(path)["data"]
    except (CheckpointNotFoundError, CheckpointCorruptError):
        data = None
    try:
        os.unlink(path + ".json")
    except FileNotFoundError:
        pass
    if data is not None:
        try:
            os.unlink(os.path.join(os.path.dirname(path), data))
        except FileNotFoundError:
            pass


def prune(directory: str, name: str, keep: int | None, protect: str) -> None:
    """After a save of ``protect``: delete all but the newest ``keep`` saves of ``name-N``
    (``protect`` never), leftovers of crashed saves, and data files no manifest names."""
    remove_temporaries(directory, name)
    if keep is not None:
        records = _records(directory, name)
        for record in records[:max(len(records) - keep, 0)]:
            if record.path != protect:
                remove(record.path)
    remove_orphans(directory, name)


def remove_orphans(directory: str, name: str, older_than: float | None = None) -> None:
    """Delete data files ``name-N.<hash>.npz`` that no manifest names, once older than
    ``older_than`` seconds (default :data:`ORPHAN_AGE`): a save in progress elsewhere
    renames its data moments before committing its manifest. A data file whose manifest
    exists but cannot be read is left alone."""
    older_than = ORPHAN_AGE if older_than is None else older_than
    pattern = re.compile(rf"^({re.escape(name)}-\d+)\.[0-9a-f]{{16}}\.npz$")
    now = time.time()
    try:
        entries = os.listdir(directory)
    except FileNotFoundError:
        return
    for entry in entries:
        match = pattern.match(entry)
        if match is None:
            continue
        owner = os.path.join(directory, match.group(1))
        try:
            if read_manifest(owner)["data"] == entry:
                continue
        except CheckpointNotFoundError:
            pass
        except CheckpointCorruptError:
            continue  # not ours to judge: someone may want to look at it
        _remove_if_older(os.path.join(directory, entry), now - older_than)


def _remove_if_older(path: str, cutoff: float) -> None:
    """Delete ``path`` if it was last changed before ``cutoff`` (``time.time()``)."""
    try:
        if os.lstat(path).st_mtime < cutoff:
            os.unlink(path)
    except OSError:
        pass


def remove_temporaries(directory: str, name: str, older_than: float = 60.0) -> None:
    """Delete temporary files a crashed save of ``name-N`` left, older than ``older_than``
    seconds (a save in progress elsewhere keeps its own)."""
    pattern = re.compile(rf"^\.{re.escape(name)}-\d+\.(json|npz)\..+\.tmp$")
    cutoff = time.time() - older_than
    try:
        entries = os.listdir(directory)
    except FileNotFoundError:
        return
    for entry in entries:
        if pattern.match(entry):
            _remove_if_older(os.path.join(directory, entry), cutoff)


_UNLOCKED_WARNED: set[str] = set()


@contextlib.contextmanager
def lock(directory: str, timeout: float | None = None) -> Iterator[None]:
    """Hold the writers' lock of ``directory`` (``flock`` on ``DIR/.mpistrat-ckpt.lock``):
    saves into one directory, from any process on any host where the file system
    supports ``flock`` across hosts, take turns.

    Waits up to ``timeout`` seconds (default :data:`LOCK_TIMEOUT`) for another save to
    finish. Where ``flock`` is not supported it warns once and goes on unlocked.

    Raises:
        TimeoutError: another process held the lock all that time (named in the message).
        OSError: the lock file cannot be opened, or is not a regular file.
    """
    try:
        import fcntl
    except ImportError:  # no flock on this platform
        yield
        return
    timeout = LOCK_TIMEOUT if timeout is None else timeout
    path = os.path.join(directory, LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | _NOFOLLOW | _NONBLOCK | _CLOEXEC, 0o666)
    except OSError as exc:
        hint = " (a symbolic link: remove it)" if exc.errno == errno.ELOOP else ""
        raise OSError(exc.errno, f"cannot open the checkpoint lock file {path}{hint}: "
                                 f"{exc.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"the checkpoint lock file {path} is not a regular "
                                        f"file; remove it")
        locked = _acquire(fcntl, fd, path, directory, timeout)
        if locked:
            holder = (f"pid {os.getpid()} on {socket.gethostname()} since "
                      f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n").encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, holder, 0)
        try:
            yield
        finally:
            if locked:
                os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # releases the lock


def _acquire(fcntl: Any, fd: int, path: str, directory: str, timeout: float) -> bool:
    """Take the lock (True), or find flock unsupported (False, warned once)."""
    deadline = time.monotonic() + timeout
    pause = 0.01
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            if directory not in _UNLOCKED_WARNED:
                _UNLOCKED_WARNED.add(directory)
                warnings.warn(
                    f"the file system of {directory} does not support flock ({exc.strerror}):"
                    f" checkpoint saves there are not serialized against other jobs; each "
                    f"checkpoint stays complete, but two jobs saving there at once may pick "
                    f"the same number. Give each job its own directory", RuntimeWarning,
                    stacklevel=4)
            return False
        if time.monotonic() >= deadline:
            try:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
            except OSError:
                holder = ""
            raise TimeoutError(
                f"another process has held the checkpoint lock {path} for over {timeout:g} "
                f"s ({holder or 'holder unknown'}): another job is saving into {directory} "
                f"and its save is slow or stuck; give each job its own directory, or end "
                f"the other job")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)  # (short: the holder may save again soon after)
