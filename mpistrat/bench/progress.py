"""Progress on stderr while a sweep runs: a tqdm bar when tqdm is installed and stderr
is a terminal, otherwise one line per step. Results still go to stdout, printed through
the bar so it is not torn (tqdm is optional: ``pip install tqdm``)."""

from __future__ import annotations

import sys
from typing import Any, TextIO

__all__ = ["Progress"]


class Progress:
    """Counts finished steps (sizes); only rank 0 makes an enabled one.

    Args:
        total: the number of steps.
        enabled: False for no progress output at all (``--quiet``, ranks other than 0).
        unit: what a step is, for the bar.
    """

    def __init__(self, total: int, enabled: bool, unit: str = "size",
                 stream: TextIO | None = None) -> None:
        self.total, self.enabled, self.done = total, enabled, 0
        self.stream = stream if stream is not None else sys.stderr
        self._bar: Any = None
        if enabled and getattr(self.stream, "isatty", lambda: False)():
            try:
                from tqdm import tqdm  # optional: without it, plain lines
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, file=self.stream, unit=unit,
                                 dynamic_ncols=True, leave=False)

    def start(self, what: str) -> None:
        """Say which step is running now."""
        if self._bar is not None:
            self._bar.set_postfix_str(what)

    def step(self, what: str, detail: str = "") -> None:
        """One step is done."""
        self.done += 1
        if self._bar is not None:
            self._bar.update(1)
        elif self.enabled:
            print(f"[{self.done}/{self.total}] {what}{': ' + detail if detail else ''}",
                  file=self.stream, flush=True)

    def echo(self, text: str, file: TextIO | None = None) -> None:
        """Print ``text`` (results) without breaking the bar."""
        out = file if file is not None else sys.stdout
        if self._bar is not None:
            self._bar.write(text, file=out)
            out.flush()
        else:
            print(text, file=out, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
