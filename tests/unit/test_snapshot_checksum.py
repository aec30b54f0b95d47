"""The checksum of a snapshot's values (mpistrat.checkpoint.snapshot._checksum): CRC-32
below 16 KiB, a 64-bit sum/xor mix above; every flipped bit, a zeroed page and a cut
tail change it. What the checksums cover (_blocks): a small state's values together,
a large state's each alone. A copy into the slot computes the checksum on the way
(_copy_summed): the same number as the checksum of the bytes it wrote."""

from __future__ import annotations

import numpy as np
import pytest

from mpistrat.checkpoint.snapshot import (
    _CHUNK,
    _CRC_BYTES,
    _TOGETHER_BYTES,
    _blocks,
    _checksum,
    _copy_summed,
)


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


def _layout(*sizes):
    entries, offset = [{"name": "rng", "kind": "generator"}], 4096
    for k, nbytes in enumerate(sizes):
        entries.append({"name": f"v{k}", "kind": "array", "offset": offset, "nbytes": nbytes})
        offset = -(-(offset + nbytes) // 64) * 64
    return {"entries": entries}


def test_a_small_states_values_are_checked_together_a_large_ones_each_alone():
    # together: one block from the first value to the last one's end, alignment included
    assert _blocks(_layout(48, 8, 4000)) == [
        ("entries 'v0', 'v1', 'v2', checked together, do not match their checksum",
         4096, 4096 + 128 + 4000)]
    # one value, or values that take 1 MiB or more together: one block each
    assert _blocks(_layout(48)) == [("entry 'v0' does not match its checksum", 4096, 4144)]
    large = _blocks(_layout(48, _TOGETHER_BYTES))
    assert [(what.split()[1], stop - start) for what, start, stop in large] == \
        [("'v0'", 48), ("'v1'", _TOGETHER_BYTES)]
    assert _blocks({"entries": [{"name": "rng", "kind": "generator"}]}) == []


@pytest.mark.parametrize("dtype", ["float32", "float64", "int16", "uint8", "complex64"])
@pytest.mark.parametrize("count", [_CRC_BYTES, _CRC_BYTES + 3, _CHUNK + 5, 3 * _CHUNK - 1])
def test_a_copy_sums_what_it_wrote_as_the_checksum_of_the_slot_would(dtype, count):
    rng = np.random.default_rng(count)
    raw = rng.integers(0, 256, count * np.dtype(dtype).itemsize, dtype=np.uint8)
    value = raw.view(dtype)[:count].reshape(-1, 1)
    slot = np.zeros(value.nbytes + 64, np.uint8)  # (a place inside a larger mapping)
    target = slot[64:].view(dtype).reshape(value.shape)
    found = _copy_summed(target, value)
    assert np.array_equal(target.view(np.uint8), value.view(np.uint8))
    assert found == _checksum(memoryview(slot[64:])), (dtype, count)
    target.reshape(-1).view(np.uint8)[-1] ^= 1  # (the tail counts)
    assert found != _checksum(memoryview(slot[64:]))


def test_a_copy_it_cannot_sum_on_the_way_is_still_made_and_checked_later():
    small = np.arange(10, dtype=np.float64)
    place = np.zeros_like(small)
    assert _copy_summed(place, small) is None and np.array_equal(place, small)
    strided = np.arange(2 * _CRC_BYTES, dtype=np.float64)[::2]  # (not contiguous)
    place = np.zeros_like(strided)
    assert _copy_summed(place, strided) is None and np.array_equal(place, strided)
    with pytest.raises(TypeError):  # (np.copyto's error, as before: no casting)
        _copy_summed(np.zeros(_CRC_BYTES, np.float32), np.zeros(_CRC_BYTES, np.float64))
