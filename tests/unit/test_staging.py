"""How staged messages are cut into chunks (both sides must cut alike)."""

from __future__ import annotations

import numpy as np

from mpistrat.backends.transport import HostMover, chunk_cuts


def test_chunk_cuts():
    assert chunk_cuts(0, 10) == [(0, 0)]  # an empty message still is one message
    assert chunk_cuts(10, 10) == [(0, 10)]
    assert chunk_cuts(25, 10) == [(0, 10), (10, 20), (20, 25)]
    assert chunk_cuts(25, 10, align=4) == [(0, 8), (8, 16), (16, 24), (24, 25)]
    assert chunk_cuts(5, 2, align=4) == [(0, 4), (4, 5)]  # never below one element


def test_host_mover_copies_at_once():
    mover = HostMover()
    host, _ = mover.host(4)
    event = mover.to_host(host, np.arange(4, dtype=np.uint8))
    assert mover.done(event) and list(host) == [0, 1, 2, 3]
    out = np.zeros(4, np.uint8)
    mover.to_device(out, host)
    assert list(out) == [0, 1, 2, 3]
