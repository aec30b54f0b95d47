"""Report files (``--report-dir``): what a rank that ends abnormally leaves where a cut-off
host's report survives, and what ``mpistrat run -n`` reads back and prints.

A report file is ``DIR/rank-R.txt``: one header line, then the report as the rank printed
it. The header names the rank, its host and the time, and carries a tag (an HMAC under the
job's secret, :mod:`.auth`) over all of it. ``mpistrat run -n`` prints a report only when
the tag is its own job's: a file left by an earlier job in a reused directory, or put
there by anyone else, is named and ignored. Files are replaced atomically through a
temporary of a random name (:mod:`mpistrat._atomic`), never written through a link; they
are read without following a link, and at most :data:`MAX_BYTES` of them.
"""

from __future__ import annotations

import os
import re
import stat
import time

from .._atomic import write_atomically
from . import auth

__all__ = ["write_report", "read_report", "report_path", "MAX_BYTES"]

MAX_BYTES = 64 * 1024  # of a report file that is read back (a report is a traceback)
_HEADER = re.compile(r"# mpistrat run report: rank (\d{1,9}) \(([!-~]{1,255})\), "
                     r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC); tag ([0-9a-f]{64})")


def report_path(directory: str, rank: int) -> str:
    """Where rank ``rank``'s report goes in ``directory``."""
    return os.path.join(directory, f"rank-{rank}.txt")


def write_report(path: str, text: str, secret: bytes | None, rank: int, host: str) -> None:
    """Write ``text`` (rank ``rank``'s report) to ``path`` atomically, with its header.
    A report file is a convenience (standard error has the report): failures to write it
    are ignored."""
    body = text.rstrip("\n") + "\n"
    host = auth.printable(host.split()[0] if host.split() else "?", 255).replace(" ", "?")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    mac = auth.tag(secret, "report", rank, host, when, body).hex() if secret else "0" * 64
    header = f"# mpistrat run report: rank {rank} ({host}), {when}; tag {mac}\n"
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        write_atomically(path, header + body)
    except OSError:
        pass


def read_report(path: str, secret: bytes, rank: int) -> tuple[str | None, str | None]:
    """Rank ``rank``'s report in ``path``, if this job (``secret``) wrote it:
    ``(text, None)``, or ``(None, why not)``; ``(None, None)`` when there is no file."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) |
                     getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"it cannot be opened ({exc.strerror or exc}; a link is not followed)"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None, "it is not a regular file"
        data = os.read(fd, MAX_BYTES + 1)
    except OSError as exc:
        return None, f"it cannot be read ({exc.strerror or exc})"
    finally:
        os.close(fd)
    if len(data) > MAX_BYTES:
        return None, f"it is larger than a report ({MAX_BYTES // 1024} KiB)"
    text = data.decode("utf-8", errors="replace")
    header, _, body = text.partition("\n")
    match = _HEADER.fullmatch(header)
    if match is None or int(match.group(1)) != rank or not auth.verify(
            secret, bytes.fromhex(match.group(4)), "report", rank, match.group(2),
            match.group(3), body):
        return None, "it was not written by this job (an earlier job's report, or not a report)"
    lines = [_printable_line(line) for line in body.rstrip("\n").split("\n")]
    return "\n".join(lines), None


def _printable_line(line: str) -> str:
    """A report line with control characters (escape sequences) shown as ``?``."""
    return "".join(c if c.isprintable() or c == "\t" else "?" for c in line)
