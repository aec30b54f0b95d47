"""``TaggedWriter`` (``mpistrat run --tag-output``) on long lines written in small pieces."""

from __future__ import annotations

import io
import random

from mpistrat.runner import output
from mpistrat.runner.output import TaggedWriter


class Reference:
    """The tagging rule, written plainly (the whole partial line split again on every
    write: the output to match, at a cost quadratic in a line's length)."""

    def __init__(self, prefix: str) -> None:
        self.out, self.prefix, self.pending, self.started = io.StringIO(), prefix, "", False

    def write(self, text: str) -> None:
        done = (self.pending + text).splitlines(keepends=True)
        self.pending = done.pop() if done and not done[-1].endswith(("\n", "\r")) else ""
        if done:
            first = done[0] if self.started else self.prefix + done[0]
            self.out.write(first + "".join(self.prefix + line for line in done[1:]))
            self.started = False

    def flush(self) -> None:
        if self.pending:
            self.out.write(self.pending if self.started else self.prefix + self.pending)
            self.pending, self.started = "", True


def test_a_long_line_in_small_pieces_is_split_once(monkeypatch):
    """A line of 20000 one-character writes and its newline: the line splitter sees each
    character once (it saw the partial line again on every write: 200 million characters),
    and the line comes out whole, tagged once. Flushes, carriage returns and the other
    line breaks of str.splitlines come out as the plain rule writes them."""
    seen = []
    split = output._split
    monkeypatch.setattr(output, "_split", lambda text: seen.append(len(text)) or split(text))
    out = io.StringIO()
    writer = TaggedWriter(out, "[3] ")
    for _ in range(20000):
        writer.write("x")
    assert out.getvalue() == "" and sum(seen) == 0
    writer.write("\n")
    assert out.getvalue() == "[3] " + "x" * 20000 + "\n"
    assert sum(seen) == 20001

    rng = random.Random(7)
    alphabet = ["a", "b", "\n", "\r", "\r\n", "\f", "\v", "\x1c", "\x85", "\u2028", ""]
    for _ in range(300):
        written = io.StringIO()
        mine, plain = TaggedWriter(written, "[1] "), Reference("[1] ")
        for _ in range(rng.randrange(1, 30)):
            if rng.random() < 0.1:
                mine.flush()
                plain.flush()
            else:
                piece = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 5)))
                mine.write(piece)
                plain.write(piece)
        assert written.getvalue() == plain.out.getvalue()
        mine.flush()
        plain.flush()
        assert written.getvalue() == plain.out.getvalue()
