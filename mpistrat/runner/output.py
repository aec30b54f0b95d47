"""What each rank's output looks like under ``mpistrat run``: tagged with the rank
(``--tag-output``), or shown for rank 0 only (``--quiet-ranks``).

Both work on Python's ``sys.stdout`` and ``sys.stderr``: output a C extension or a child
process writes straight to file descriptor 1 or 2 is not tagged nor silenced (the
launcher's own options do that: Open MPI's ``--tag-output``, MPICH's ``-prepend-rank``).
Failure reports bypass both settings: they always reach the real ``stderr``, tagged.
"""

from __future__ import annotations

import io
import os
import re
import sys
import threading
from collections.abc import Sequence
from typing import Any, TextIO

__all__ = ["TaggedWriter", "RankOutput", "rank_tag"]


def rank_tag(ranks: Sequence[int]) -> str:
    """``[1] `` for one rank; ``[0-2,5] `` for several (runs of ranks as ranges)."""
    ranks = sorted(ranks)
    parts: list[str] = []
    start = prev = ranks[0]
    for rank in [*ranks[1:], None]:
        if rank is not None and rank == prev + 1:
            prev = rank
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if rank is not None:
            start = prev = rank
    return f"[{','.join(parts)}] "


# where str.splitlines() ends a line
_BREAK = re.compile("[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]")


def _split(text: str) -> list[str]:
    """``text``'s lines, each with its line break (what :class:`TaggedWriter` tags)."""
    return text.splitlines(keepends=True)


class TaggedWriter(io.TextIOBase):
    """A text stream that puts ``prefix`` before every line it passes to ``stream``.

    Whole lines are written at once (so lines of different ranks do not mix within a
    line); a partial line waits for its end, or for :meth:`flush`. A carriage return
    starts a new line too (progress bars redraw their line with one).

    A partial line is kept as the list of its pieces and joined once, when a line break
    comes: a long line written in many small pieces costs time linear in its length
    (re-splitting the whole partial line on every write was quadratic).
    """

    def __init__(self, stream: TextIO, prefix: str) -> None:
        super().__init__()
        self._stream = stream
        self._prefix = prefix
        self._pending: list[str] = []  # the partial line, in pieces: no line break but
        self._open = False  # at the end of the last piece, and then this is True
        self._started = False  # the pending text's line has its prefix written already
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        if not text:
            return 0
        with self._lock:
            if not self._open and _BREAK.search(text) is None:
                self._pending.append(text)  # the line goes on
                return len(text)
            done = _split("".join(self._pending) + text)
            last = done.pop() if done and not done[-1].endswith(("\n", "\r")) else ""
            # (a line that ends with another break, say a form feed, waits as splitlines
            # leaves it, and is written with the next piece)
            self._pending = [last] if last else []
            self._open = bool(last) and _BREAK.match(last[-1]) is not None
            if done:
                first = done[0] if self._started else self._prefix + done[0]
                self._stream.write(first + "".join(self._prefix + line for line in done[1:]))
                self._started = False
        return len(text)

    def flush(self) -> None:
        with self._lock:
            if self._pending:
                pending = "".join(self._pending)
                self._stream.write(pending if self._started else self._prefix + pending)
                self._pending, self._open = [], False
                self._started = True
            self._stream.flush()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._stream, "encoding", "utf-8")

    @property
    def errors(self) -> str | None:  # type: ignore[override]
        return getattr(self._stream, "errors", None)


class RankOutput:
    """Install this rank's ``sys.stdout``/``sys.stderr`` for the script, and keep the real
    ``stderr`` for failure and stall reports.

    Args:
        rank: this rank.
        size: the number of ranks (tags are left out when it is 1).
        tag: prefix each line with ``[rank] ``.
        quiet: silence this rank (``--quiet-ranks`` on a rank other than 0).
        stdout, stderr: the real streams (default: ``sys.stdout``/``sys.stderr`` at entry).
    """

    def __init__(self, rank: int, size: int, *, tag: bool = False, quiet: bool = False,
                 stdout: TextIO | None = None, stderr: TextIO | None = None) -> None:
        self.rank, self.size = rank, size
        self._tag, self._quiet = tag and size > 1, quiet
        self._given = (stdout, stderr)
        self._saved: tuple[Any, Any] | None = None
        self._null: TextIO | None = None
        self._line_buffered: bool | None = None

    @property
    def real_stdout(self) -> TextIO:
        return self._given[0] or (self._saved[0] if self._saved else sys.stdout)

    @property
    def real_stderr(self) -> TextIO:
        return self._given[1] or (self._saved[1] if self._saved else sys.stderr)

    def __enter__(self) -> RankOutput:
        self._saved = (sys.stdout, sys.stderr)
        self._line_buffered = _line_buffering(sys.stdout, True)
        if self._quiet:
            self._null = open(os.devnull, "w")  # noqa: SIM115
            sys.stdout = sys.stderr = self._null
        elif self._tag:
            prefix = rank_tag([self.rank])
            sys.stdout = TaggedWriter(self.real_stdout, prefix)
            sys.stderr = TaggedWriter(self.real_stderr, prefix)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.flush()
        assert self._saved is not None
        sys.stdout, sys.stderr = self._saved
        self._saved = None
        _line_buffering(sys.stdout, self._line_buffered)
        if self._null is not None:
            self._null.close()
            self._null = None

    def flush(self) -> None:
        """Flush the script's streams and the real ones (before a report or an abort)."""
        for stream in {id(s): s for s in (sys.stdout, sys.stderr, self.real_stdout,
                                          self.real_stderr)}.values():
            try:
                stream.flush()
            except (OSError, ValueError):
                pass

    def report(self, text: str, ranks: Sequence[int] | None = None) -> None:
        """Write ``text`` to the real ``stderr``, every line tagged with ``ranks`` (default
        this rank; no tag when the job has one rank)."""
        self.flush()
        prefix = rank_tag(ranks if ranks is not None else [self.rank]) if self.size > 1 else ""
        lines = text.rstrip("\n").split("\n")
        stream = self.real_stderr
        stream.write("".join(f"{prefix}{line}\n" for line in lines))
        stream.flush()


def _line_buffering(stream: Any, on: bool | None) -> bool | None:
    """Set a text stream's line buffering (under a launcher stdout is a pipe, so Python
    would buffer whole blocks: progress would show late and ranks' lines would mix);
    returns the previous setting, None when the stream cannot say."""
    previous = getattr(stream, "line_buffering", None)
    if on is not None and previous is not None and hasattr(stream, "reconfigure"):
        try:
            stream.reconfigure(line_buffering=on)
        except (ValueError, OSError):
            return None
    return previous
