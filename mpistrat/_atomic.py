"""Files written so that a reader sees the old content or the new one, never a torn file,
and so that no one else's file is written through.

:func:`write_atomically` writes into a temporary file beside the target, created with
``O_CREAT | O_EXCL | O_NOFOLLOW`` under a random name (a link planted at a guessed name
cannot redirect the write: the name cannot be guessed, and an existing entry makes the
create fail instead of being followed), flushes and ``fsync``-s it, then renames it over
the target. ``rename`` replaces a symbolic link at the target itself; it never writes to
what the link points at. Only the standard library: the job monitor's own process imports
nothing else.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable, Iterator
from typing import IO

__all__ = ["write_atomically", "exclusive_temporary", "temporary_name", "fsync_directory"]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def temporary_name(path: str) -> str:
    """``DIR/.NAME.<16 random hex digits>.tmp`` beside ``path``: hidden, unguessable, and
    recognisable as a leftover (``.tmp``)."""
    directory, name = os.path.split(path)
    return os.path.join(directory or ".", f".{name}.{secrets.token_hex(8)}.tmp")


def fsync_directory(directory: str) -> None:
    """Make the renames in ``directory`` durable (where the platform allows it)."""
    try:
        fd = os.open(directory or ".", os.O_RDONLY)
    except OSError:
        return  # some platforms cannot open directories; the renames are still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def exclusive_temporary(path: str, mode: int = 0o666) -> Iterator[tuple[IO[bytes], str]]:
    """A new temporary file beside ``path`` (:func:`temporary_name`), created exclusively
    and never through a link: ``(binary file, its path)``. Inside the block, write it,
    flush and ``fsync`` it, and rename it where it belongs; it is closed when the block
    ends, and deleted if the block raises."""
    temporary = temporary_name(path)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb") as file:
            yield file, temporary
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise


def write_atomically(path: str | os.PathLike[str], content: bytes | str |
                     Callable[[IO[bytes]], object], *, mode: int = 0o666,
                     sync_directory: bool = False) -> None:
    """Replace ``path`` with ``content`` (bytes, text written as UTF-8, or a function that
    writes into the binary file it is given), atomically.

    The file gets ``mode`` less the umask, like any file the user writes. With
    ``sync_directory``, the directory is ``fsync``-ed after the rename too, so the new name
    survives a power loss.

    Raises:
        OSError: the directory cannot be written (nothing is left behind then).
    """
    target = os.fspath(path)
    with exclusive_temporary(target, mode) as (file, temporary):
        if callable(content):
            content(file)
        else:
            file.write(content.encode() if isinstance(content, str) else content)
        file.flush()
        os.fsync(file.fileno())
        os.replace(temporary, target)
    if sync_directory:
        fsync_directory(os.path.dirname(target))
