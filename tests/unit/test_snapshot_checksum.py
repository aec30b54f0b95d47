"""The checksum of a snapshot's values (mpistrat.checkpoint.snapshot._checksum): CRC-32
below 1 MiB, a 64-bit sum/xor mix above; every flipped bit, a zeroed page and a cut
tail change it."""

from __future__ import annotations

import numpy as np
import pytest

from mpistrat.checkpoint.snapshot import _CRC_BYTES, _checksum


@pytest.mark.parametrize("size", [0, 1, 7, 4096, _CRC_BYTES - 1, _CRC_BYTES, _CRC_BYTES + 13,
                                  3 * _CRC_BYTES + 5])
def test_a_flipped_bit_anywhere_changes_it(size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    before = _checksum(memoryview(data))
    assert before == _checksum(memoryview(data.copy()))  # (a function of the bytes only)
    for at in sorted({0, size // 3, size // 2, size - 1} & set(range(size))):
        for bit in (0, 7):
            data[at] ^= 1 << bit
            assert _checksum(memoryview(data)) != before, (size, at, bit)
            data[at] ^= 1 << bit
    assert _checksum(memoryview(data)) == before


def test_a_zeroed_page_or_a_shorter_value_changes_it():
    data = np.random.default_rng(0).integers(1, 256, 2 * _CRC_BYTES, dtype=np.uint8)
    before = _checksum(memoryview(data))
    damaged = data.copy()
    damaged[8192:12288] = 0
    assert _checksum(memoryview(damaged)) != before
    assert _checksum(memoryview(data[:-8])) != before
    assert _checksum(memoryview(np.zeros(2 * _CRC_BYTES, np.uint8))) != \
        _checksum(memoryview(np.zeros(2 * _CRC_BYTES + 8, np.uint8)))
