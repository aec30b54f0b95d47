"""The job's secret, and what it authenticates: every message to the job monitors
(:mod:`.monitor`, :mod:`.sidecar`), every liveness probe of the watchdog
(:mod:`.watchdog`) and every report file (``--report-dir``).

The secret is 32 random bytes from :mod:`secrets`, made once per job: by ``mpistrat run
-n`` (and given to the ranks in the environment, ``MPISTRAT_JOB_SECRET``, never on a
command line: ``/proc/PID/environ`` is readable by the job's user only, a command line by
everyone), or inside the job by one rank and broadcast over MPI. A rank takes it out of its
environment (:func:`take_secret`), so the script's own child processes do not inherit it.

Messages carry ``HMAC-SHA256(secret, parts)``, never the secret; the parts are framed with
their lengths, so no two different messages have the same tag. Each side also binds its
messages to a nonce of the other side's (a challenge, a probe's number), so a message
recorded from one connection or one probe is worth nothing in another.

Only the standard library: the job monitor's own process imports this module without the
rest of mpistrat.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from collections.abc import Mapping

__all__ = ["SECRET_ENV", "new_secret", "encode", "decode", "take_secret", "tag", "verify",
           "printable"]

SECRET_ENV = "MPISTRAT_JOB_SECRET"
_BYTES = 32
_TAKEN: list[bytes] = []  # the secret this process took out of its environment


def new_secret() -> bytes:
    """32 bytes from the operating system's random source."""
    return secrets.token_bytes(_BYTES)


def encode(secret: bytes) -> str:
    """The secret as the environment holds it (hex)."""
    return secret.hex()


def decode(text: str | None) -> bytes | None:
    """The secret from its hex form; None for anything else than 64 hex digits."""
    if text is None or not re.fullmatch(r"[0-9a-f]{%d}" % (2 * _BYTES), text):
        return None
    return bytes.fromhex(text)


def take_secret(env: Mapping[str, str] | None = None) -> bytes | None:
    """This job's secret, from ``MPISTRAT_JOB_SECRET`` in ``env``; None when the job has
    none (not started by ``mpistrat run -n``). Without ``env``, from ``os.environ``, where
    the variable is then removed: later calls in this process get the secret it held."""
    if env is not None:
        return decode(env.get(SECRET_ENV))
    found = decode(os.environ.pop(SECRET_ENV, None))
    if found is not None:
        _TAKEN[:] = [found]
    return _TAKEN[0] if _TAKEN else None


def _framed(parts: tuple[bytes | str | int, ...]) -> bytes:
    out = bytearray()
    for part in parts:
        data = part if isinstance(part, bytes) else str(part).encode()
        out += len(data).to_bytes(4, "big") + data
    return bytes(out)


def tag(secret: bytes, *parts: bytes | str | int, size: int = 32) -> bytes:
    """The first ``size`` bytes of ``HMAC-SHA256(secret, parts)``."""
    return hmac.new(secret, _framed(parts), hashlib.sha256).digest()[:size]


def verify(secret: bytes, given: bytes, *parts: bytes | str | int) -> bool:
    """Whether ``given`` is the tag of ``parts`` (compared in constant time)."""
    return len(given) >= 16 and hmac.compare_digest(given, tag(secret, *parts,
                                                                size=len(given)))


def printable(text: str, limit: int = 200) -> str:
    """``text`` safe to print on a terminal: printable ASCII only (every other character,
    escape sequences and line breaks included, becomes ``?``), at most ``limit``
    characters."""
    cut = text[:limit]
    clean = "".join(c if " " <= c <= "~" else "?" for c in cut)
    return clean + ("..." if len(text) > limit else "")
