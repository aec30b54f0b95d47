"""Where a name becomes code (mpistrat.dispatch): the fit check of one entry says exactly
what the spec check says of the same entry, without parsing a spec."""

from __future__ import annotations

import pytest

from mpistrat import dispatch
from mpistrat.errors import BackendUnavailable, SpecError, TopologyError
from mpistrat.layout import Layout, require_fits
from mpistrat.spec import parse_spec


@pytest.mark.parametrize("alg, shards, workers, nodes, devices, gpus", [
    ("pscpu", 3, 2, 1, 1, False),          # more gather ranks than ranks
    ("pscpu/pscpu", 3, 4, 2, 1, False),    # more gather leaders than nodes
    ("shm", 1, 4, 2, 1, False),            # shared memory across nodes
    ("nccl", 1, 2, 1, 1, False),           # GPUs on CPU replicas
    ("psgpu", 5, 2, 1, 2, True),           # more GPUs than the job has
])
def test_an_entry_that_does_not_fit_raises_what_the_spec_check_raises(alg, shards, workers,
                                                                      nodes, devices, gpus):
    layout = Layout(workers, devices, gpus, nodes)
    with pytest.raises(TopologyError) as expected:
        require_fits([(alg, shards)], layout)
    dispatch.check_fits.cache_clear()
    with pytest.raises(TopologyError) as found:
        dispatch.check_fits(alg, shards, workers, nodes, devices, gpus)
    assert str(found.value) == str(expected.value)


@pytest.mark.parametrize("alg, shards", [("xring", 0), ("xring", True), ("xrng", 1)])
def test_a_malformed_entry_raises_what_the_parser_raises(alg, shards):
    with pytest.raises(SpecError) as expected:
        parse_spec([(alg, shards)])
    with pytest.raises(SpecError) as found:
        dispatch.check_fits(alg, shards, 2, 1)
    assert str(found.value) == str(expected.value)


def test_entries_that_fit_pass():
    for alg, shards, workers, nodes in [("xring", 2, 3, 1), ("pscpu", 3, 3, 1),
                                        ("shm/rechd", 1, 4, 2), ("pscpu/pscpu", 2, 4, 2)]:
        assert dispatch.check_fits(alg, shards, workers, nodes) is None


def test_a_hierarchical_name_is_composed_not_looked_up():
    with pytest.raises(BackendUnavailable, match="'shm/rechd' has no implementation"):
        dispatch.implementation("shm/rechd")
    assert dispatch.compose("shm", "rechd") is dispatch.compose("shm", "rechd")
