"""CrossDeviceOps in one process (COMM_WORLD of size 1): the batch path's cached layout."""

from __future__ import annotations

import numpy as np
import pytest

from mpistrat import CommunicationOptions, MultiWorkerAllReduce, PerReplica, ReduceOp
from mpistrat.packing import PackingError


def test_implementation_hook_checks_every_device_against_the_cached_plan():
    # the plan is looked up by the first device's shapes; a second device whose component
    # differs is an error, not views cut to the wrong sizes
    ops = MultiWorkerAllReduce(all_reduce_spec="xring", num_packs=1)
    ragged = PerReplica([np.ones(3, np.float32), np.ones(4, np.float32)])
    with pytest.raises(PackingError, match=r"shape \(4,\).*expects \(3,\)"):
        ops.batch_reduce_implementation(ReduceOp.SUM, [(ragged, ragged)],
                                        CommunicationOptions())


def test_same_shapes_other_dtype_get_their_own_plan():
    # routing and plans are cached by shapes and dtypes: a batch with the same shapes in
    # another dtype must not reuse the first one's layout
    ops = MultiWorkerAllReduce(all_reduce_spec="xring", num_packs=1)
    for dtype in (np.float32, np.float64, np.int32, np.float32):
        values = [PerReplica([np.full((2, 3), 1, dtype), np.full((2, 3), 2, dtype)]),
                  PerReplica([np.arange(5, dtype=dtype), np.arange(5, dtype=dtype)])]
        out = ops.batch_reduce("sum", [(v, v) for v in values])
        for result, want in zip(out, (np.full((2, 3), 3, dtype), 2 * np.arange(5, dtype=dtype))):
            for component in result.values:
                assert component.dtype == dtype and component.shape == want.shape
                np.testing.assert_array_equal(component, want)
