"""A checkpoint on disk: ``PATH.npz`` (the arrays) and ``PATH.json`` (the manifest), written
so that a crash at any moment leaves either the complete old state or the complete new one.

Write order: remove an old manifest at ``PATH`` (so no manifest ever describes data that
is being replaced), write the arrays to a temporary file in the same directory, flush and
``fsync`` it, rename it to ``PATH.npz``; then the manifest (holding the data's size and
SHA-256) the same way; then ``fsync`` the directory, so the renames themselves survive a
power loss. The manifest is the commit record: a checkpoint exists when its manifest does
and the data matches the manifest's size and checksum. Temporary files start with a dot
and end with ``.tmp``; a crash can leave one behind, and nothing ever reads it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import secrets
import time
from collections.abc import Callable
from typing import IO, Any

import numpy as np

from ..errors import CheckpointCorruptError, CheckpointNotFoundError, MpistratError

__all__ = ["CheckpointNotFoundError", "CheckpointCorruptError", "write", "read", "scan",
           "remove", "remove_temporaries", "FORMAT", "VERSION"]

FORMAT = "mpistrat.checkpoint"
VERSION = 1


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # some platforms cannot open directories; the renames are still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _replace_atomically(path: str, fill: Callable[[IO[bytes]], object]) -> None:
    directory = os.path.dirname(path) or "."
    temporary = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}."
                                        f"{secrets.token_hex(4)}.tmp")
    # 0o666 and the umask, like any file the user writes (mkstemp would force 0o600)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as file:
            fill(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise


def _sha256(path: str) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def write(path: str, arrays: dict[str, np.ndarray], manifest: dict[str, Any]) -> None:
    """Write a checkpoint at ``path`` (see the module docstring for the order).

    Args:
        path: the checkpoint's path without suffix (``dir/ckpt-3``).
        arrays: the arrays, by their key in the ``.npz``.
        manifest: JSON-able facts; ``format``, ``version``, ``data``, ``bytes`` and
            ``sha256`` are added.
    """
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    data, record = path + ".npz", path + ".json"
    if os.path.exists(record):
        os.unlink(record)
        _fsync_dir(directory)
    _replace_atomically(data, lambda file: np.savez(
        file, **arrays))  # type: ignore[arg-type]  # numpy stub: **kwds may be allow_pickle
    sha256, size = _sha256(data)
    text = json.dumps({"format": FORMAT, "version": VERSION, **manifest,
                       "data": os.path.basename(data), "bytes": size, "sha256": sha256},
                      indent=1, sort_keys=True)
    _replace_atomically(record, lambda file: file.write(text.encode()))
    _fsync_dir(directory)


def read_manifest(path: str) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path``.

    Raises:
        CheckpointNotFoundError: no manifest.
        CheckpointCorruptError: a manifest that is not one of ours.
    """
    record = path + ".json"
    try:
        with open(record, "rb") as file:
            manifest = json.loads(file.read())
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"no checkpoint at {path!r} ({record} does not exist); give a path returned by "
            f"save() or latest_checkpoint(), without the .json/.npz suffix") from None
    except (OSError, ValueError) as exc:
        raise CheckpointCorruptError(f"the manifest {record} cannot be read ({exc}); restore "
                                     f"an older checkpoint") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{record} is not an mpistrat checkpoint manifest "
                                     f"(no \"format\": \"{FORMAT}\")")
    if manifest.get("version") != VERSION:
        raise CheckpointCorruptError(f"{record} has format version {manifest.get('version')!r}; "
                                     f"this mpistrat reads version {VERSION}")
    return manifest


def read(path: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The manifest and the arrays of the checkpoint at ``path``, verified.

    Raises:
        CheckpointNotFoundError: no manifest, or no data file.
        CheckpointCorruptError: the data does not match the manifest's size or checksum,
            or cannot be read.
    """
    manifest = read_manifest(path)
    data = os.path.join(os.path.dirname(path), manifest.get("data", ""))
    try:
        with open(data, "rb") as file:
            content = file.read()
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"the checkpoint {path!r} has a manifest but no data "
                                      f"file {data}; restore an older checkpoint") from None
    if len(content) != manifest.get("bytes") or \
            hashlib.sha256(content).hexdigest() != manifest.get("sha256"):
        raise CheckpointCorruptError(
            f"the data file {data} ({len(content)} bytes) does not match its manifest "
            f"({manifest.get('bytes')} bytes, sha256 {str(manifest.get('sha256'))[:12]}...): "
            f"it was truncated or changed after the checkpoint was written; restore an older "
            f"checkpoint")
    try:
        with np.load(io.BytesIO(content), allow_pickle=False) as npz:
            arrays = {key: npz[key] for key in npz.files}
    except (OSError, ValueError) as exc:
        raise CheckpointCorruptError(f"the data file {data} cannot be read ({exc})") from None
    return manifest, arrays


def scan(directory: str, name: str | None) -> list[tuple[int, str]]:
    """The complete checkpoints in ``directory`` as ``(number, path)``, oldest first.

    A checkpoint counts when its manifest reads and its data file has the recorded
    size (the checksum is verified when it is read). ``name`` selects ``name-N``
    checkpoints; None takes every name.
    """
    pattern = re.compile(rf"^({re.escape(name) if name else '.+'})-(\d+)\.json$")
    try:
        entries = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        match = pattern.match(entry)
        if match is None:
            continue
        path = os.path.join(directory, entry[:-len(".json")])
        try:
            manifest = read_manifest(path)
            size = os.path.getsize(os.path.join(directory, manifest.get("data", "")))
        except (MpistratError, OSError):
            continue
        if size == manifest.get("bytes"):
            found.append((int(match.group(2)), path))
    return sorted(found)


def remove(path: str) -> None:
    """Delete a checkpoint: the manifest first, so it is never seen half-deleted."""
    for suffix in (".json", ".npz"):
        try:
            os.unlink(path + suffix)
        except FileNotFoundError:
            pass


def remove_temporaries(directory: str, name: str, older_than: float = 60.0) -> None:
    """Delete temporary files a crashed save of ``name-N`` left, older than ``older_than``
    seconds (a save in progress elsewhere keeps its own)."""
    pattern = re.compile(rf"^\.{re.escape(name)}-\d+\.(json|npz)\..+\.tmp$")
    now = time.time()
    try:
        entries = os.listdir(directory)
    except FileNotFoundError:
        return
    for entry in entries:
        if pattern.match(entry):
            path = os.path.join(directory, entry)
            try:
                if now - os.path.getmtime(path) > older_than:
                    os.unlink(path)
            except OSError:
                pass
