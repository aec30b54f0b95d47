"""Plain-text tables for the CLI (left-aligned columns, a header and a rule)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["format_table"]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]], indent: str = "") -> str:
    """Render ``rows`` under ``headers`` with columns padded to their widest cell."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return (indent + "  ".join(c.ljust(w) for c, w in zip(row, widths))).rstrip()

    rule = indent + "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])
