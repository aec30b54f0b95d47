"""GPU tests: marked ``gpu`` and skipped cleanly without CuPy or a CUDA device. They run on
one process (pytest) and under mpiexec (``bin/gputest`` runs both)."""

from __future__ import annotations

from pathlib import Path

import pytest


def _usable() -> str:
    from mpistrat.backends.capabilities import probe_gpus

    probe = probe_gpus()
    return "" if probe.usable else probe.reason


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    mine = [item for item in items if here in Path(str(item.fspath)).parents]
    reason = _usable() if mine else ""
    for item in mine:  # (this hook sees the whole session's items)
        item.add_marker(pytest.mark.gpu)
        if reason:
            item.add_marker(pytest.mark.skip(reason=f"needs CuPy and a CUDA device: {reason}"))
