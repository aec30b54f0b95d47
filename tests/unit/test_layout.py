"""Unit tests for mpistrat.layout: the job's shape and the spec checks that depend on it."""

from __future__ import annotations

import dataclasses
import re

import pytest

from mpistrat.algorithms.registry import Pool
from mpistrat.errors import SpecError, TopologyError, UnknownAlgorithmError
from mpistrat.layout import Finding, Layout, check_spec, require_fits
from mpistrat.spec import AllReduceSpec, parse_spec

CPU4 = Layout(4)  # 4 ranks x 1 CPU replica, one node
CPU4_2N = Layout(4, nodes=2)
GPU2x2 = Layout(2, devices_per_worker=2, gpus=True)  # 4 GPUs, one node
GPU4x2_2N = Layout(4, devices_per_worker=2, gpus=True, nodes=2)


def errors(findings):
    return [f for f in findings if f.level == "error"]


def assert_too_many_shards(message, alg, shards, available, pool):
    """The message names the entry and its shards, the bound and its pool, and the fix."""
    pattern = (rf"^entry 0 '{re.escape(alg)}' has shards={shards}\b.*\b{pool}\b"
               rf".*\bonly {available}\b.*use shards <= {available}$")
    assert re.search(pattern, message), message


# ------------------------------------------------------------------ Layout


def test_layout_defaults_and_derived_values():
    layout = Layout(3)
    assert layout == Layout(workers=3, devices_per_worker=1, gpus=False, nodes=1)
    assert layout.replicas == 3
    assert GPU4x2_2N.replicas == 8


def test_pool_sizes():
    assert GPU4x2_2N.pool_size(Pool.RANKS) == 4
    assert GPU4x2_2N.pool_size(Pool.GPUS) == 8
    assert GPU4x2_2N.pool_size(Pool.NODES) == 2
    # CPU replicas have no GPUs to gather on
    assert Layout(4, devices_per_worker=2).pool_size(Pool.GPUS) == 0


def test_describe():
    assert CPU4_2N.describe() == "4 worker(s) x 1 CPU replica on 2 node(s)"
    assert GPU4x2_2N.describe() == "4 worker(s) x 2 GPUs on 2 node(s)"


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(workers=0), r"workers must be an integer >= 1, got 0"),
    (dict(workers=-2), r"workers must be an integer >= 1, got -2"),
    (dict(workers=True), r"workers must be an integer >= 1, got True"),
    (dict(workers=2.0), r"workers must be an integer >= 1, got 2\.0"),
    (dict(workers="4"), r"workers must be an integer >= 1, got '4'"),
    (dict(workers=2, devices_per_worker=0), r"devices_per_worker must be an integer >= 1, got 0"),
    (dict(workers=2, nodes=0), r"nodes must be an integer >= 1, got 0"),
    (dict(workers=2, nodes=None), r"nodes must be an integer >= 1, got None"),
    (dict(workers=2, nodes=3), r"nodes \(3\) cannot exceed workers \(2\)"),
])
def test_layout_validation(kwargs, pattern):
    with pytest.raises(TopologyError, match=pattern) as info:
        Layout(**kwargs)
    assert isinstance(info.value, ValueError)


def test_layout_is_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        CPU4.workers = 8


@pytest.mark.parametrize("workers, per_node, nodes", [
    (8, 4, 2), (5, 2, 3), (4, 1, 4), (2, 8, 1), (1, 1, 1), (7, 7, 1), (9, 4, 3),
])
def test_from_ranks_per_node(workers, per_node, nodes):
    layout = Layout.from_ranks_per_node(workers, per_node)
    assert layout == Layout(workers, 1, False, nodes)


def test_from_ranks_per_node_keeps_devices():
    layout = Layout.from_ranks_per_node(4, 2, devices_per_worker=2, gpus=True)
    assert layout == Layout(4, 2, True, 2)


@pytest.mark.parametrize("workers, per_node, pattern", [
    (4, 0, r"ranks_per_node must be an integer >= 1, got 0"),
    (4, -1, r"ranks_per_node must be an integer >= 1, got -1"),
    (4, True, r"ranks_per_node must be an integer >= 1, got True"),
    (4, 2.0, r"ranks_per_node must be an integer >= 1, got 2\.0"),
    (0, 2, r"workers must be an integer >= 1, got 0"),
])
def test_from_ranks_per_node_validation(workers, per_node, pattern):
    with pytest.raises(TopologyError, match=pattern):
        Layout.from_ranks_per_node(workers, per_node)


# ------------------------------------------------------------------ check_spec: clean cases


@pytest.mark.parametrize("spec, layout", [
    ("xring#4", CPU4),
    ("rechd", CPU4),
    ("native", CPU4),
    ("pscpu#4", CPU4),
    ("pscpu/pscpu#2", CPU4_2N),
    ("nccl", GPU2x2),
    ("psgpu#4", GPU2x2),  # shards == W * G
    ("psgpu#8", GPU4x2_2N),
    ("nccl/pscpu#2", GPU4x2_2N),
    ("nccl/xring#3", GPU4x2_2N),
    ("nccl:1K:nccl/rechd", GPU4x2_2N),
    ("nccl:1K:pscpu/pscpu#2", Layout(4, 1, True, 2)),
])
def test_fitting_specs_have_no_findings(spec, layout):
    assert check_spec(spec, layout) == []
    assert require_fits(spec, layout) == parse_spec(spec)


# ------------------------------------------------------------------ check_spec: errors


@pytest.mark.parametrize("alg", ["nccl", "psgpu", "nccl/xring", "nccl/rechd", "nccl/pscpu"])
def test_gpu_algorithm_on_cpu_replicas_is_an_error(alg):
    findings = check_spec(alg, Layout(4, devices_per_worker=2, nodes=2))
    assert len(errors(findings)) == 1
    error = errors(findings)[0]
    assert error.entry == 0
    assert f"entry 0 '{alg}' needs GPUs" in error.message
    assert "CPU replicas only" in error.message
    assert "'xring'" in error.message and "--gpus-per-worker" in error.message


def test_gpu_error_names_the_right_entry():
    findings = check_spec("xring:1K:rechd:1M:nccl", CPU4)
    assert [(f.level, f.entry) for f in findings] == [("error", 2)]
    assert "entry 2 'nccl' needs GPUs" in findings[0].message


def test_pscpu_shards_above_workers_is_an_error():
    findings = check_spec("pscpu#5", CPU4)
    assert [(f.level, f.entry) for f in findings] == [("error", 0)]
    assert_too_many_shards(findings[0].message, "pscpu", 5, 4, "ranks")


@pytest.mark.parametrize("spec, layout, available", [
    ("pscpu/pscpu#3", CPU4_2N, 2),
    ("nccl/pscpu#3", GPU4x2_2N, 2),
    ("pscpu/pscpu#4", Layout(8, nodes=3), 3),
])
def test_hierarchical_shuffle_shards_above_nodes_is_an_error(spec, layout, available):
    findings = errors(check_spec(spec, layout))
    assert len(findings) == 1
    alg, shards = spec.split("#")
    assert findings[0].entry == 0
    assert_too_many_shards(findings[0].message, alg, shards, available, "node leaders")


def test_hierarchical_shuffle_bound_is_nodes_not_workers():
    # 8 workers but 2 nodes: pscpu/pscpu#4 needs 4 node leaders
    assert errors(check_spec("pscpu/pscpu#4", Layout(8, nodes=2)))
    assert not errors(check_spec("pscpu#4", Layout(8, nodes=2)))


def test_psgpu_shards_bounded_by_all_gpus():
    assert check_spec("psgpu#4", GPU2x2) == []
    findings = check_spec("psgpu#5", GPU2x2)
    assert [(f.level, f.entry) for f in findings] == [("error", 0)]
    assert_too_many_shards(findings[0].message, "psgpu", 5, 4, "GPUs")


def test_psgpu_on_cpu_reports_the_gpu_problem_only():
    # no GPUs means no GPU pool; the shard count is not reported on top of it
    findings = check_spec("psgpu#4", CPU4)
    assert len(findings) == 1
    assert "needs GPUs" in findings[0].message


def test_xring_shards_are_not_bounded_by_the_layout():
    assert check_spec("xring#16", Layout(2)) == []


# ------------------------------------------------------------------ check_spec: warnings


@pytest.mark.parametrize("spec, layout, alg", [
    ("rechd#2", CPU4, "rechd"),
    ("native#2", CPU4, "native"),
    ("nccl#2", GPU2x2, "nccl"),
    ("nccl/rechd#3", GPU4x2_2N, "nccl/rechd"),
])
def test_ignored_shards_is_a_warning(spec, layout, alg):
    findings = check_spec(spec, layout)
    assert [(f.level, f.entry) for f in findings] == [("warning", 0)]
    shards = spec.split("#")[1]
    assert f"entry 0 '{alg}' ignores shards (got {shards})" in findings[0].message
    assert f"without '#{shards}'" in findings[0].message
    assert require_fits(spec, layout) == parse_spec(spec)


def test_ignored_shards_of_one_is_not_reported():
    assert check_spec("rechd", CPU4) == []


@pytest.mark.parametrize("spec, layout, intra", [
    ("pscpu/pscpu", CPU4, "pscpu"),
    ("nccl/xring", GPU2x2, "nccl"),
    ("nccl/pscpu", GPU2x2, "nccl"),
])
def test_hierarchical_on_one_node_is_a_warning(spec, layout, intra):
    findings = check_spec(spec, layout)
    assert [(f.level, f.entry) for f in findings] == [("warning", 0)]
    message = findings[0].message
    assert f"entry 0 '{spec}' is hierarchical but the job has one node" in message
    assert f"intra-node stage '{intra}'" in message
    assert "MPISTRAT_RANKS_PER_NODE" in message


def test_hierarchical_on_several_nodes_is_quiet():
    assert check_spec("pscpu/pscpu", Layout.from_ranks_per_node(4, 2)) == []


def test_single_replica_is_a_warning():
    findings = check_spec("xring", Layout(1))
    assert findings == [Finding("warning", None, findings[0].message)]
    assert "single replica" in findings[0].message
    # one worker with two devices is two replicas: nothing to warn about
    assert check_spec("xring", Layout(1, devices_per_worker=2)) == []


def test_errors_come_first_then_warnings_in_entry_order():
    findings = check_spec("rechd#2:1K:nccl:1M:pscpu/pscpu#8", Layout(4, nodes=2))
    assert [(f.level, f.entry) for f in findings] == [
        ("error", 1), ("error", 2), ("warning", 0),
    ]


def test_finding_as_dict():
    finding = check_spec("nccl", CPU4)[0]
    assert finding.as_dict() == {"level": "error", "entry": 0, "message": finding.message}


def test_check_spec_accepts_parsed_and_raw_specs_alike():
    spec = "nccl#2:1K:pscpu/pscpu#2"
    assert check_spec(spec, CPU4_2N) == check_spec(parse_spec(spec), CPU4_2N)
    assert check_spec(spec, CPU4_2N) == check_spec([("nccl", 2, 1024), ("pscpu/pscpu", 2)],
                                                   CPU4_2N)


def test_check_spec_rejects_invalid_specs_with_spec_errors():
    with pytest.raises(UnknownAlgorithmError):
        check_spec("xrng", CPU4)
    with pytest.raises(SpecError):
        check_spec({}, CPU4)


# ------------------------------------------------------------------ require_fits


def test_require_fits_raises_the_first_error():
    with pytest.raises(TopologyError, match=r"entry 1 'nccl' needs GPUs") as info:
        require_fits("rechd#2:1K:nccl:1M:pscpu/pscpu#8", Layout(4, nodes=2))
    assert isinstance(info.value, ValueError)
    assert not isinstance(info.value, SpecError)


def test_require_fits_raises_on_too_many_shards():
    with pytest.raises(TopologyError, match=r"entry 0 'pscpu' has shards=5 .*ranks.*only 4"):
        require_fits("pscpu#5", CPU4)


def test_require_fits_returns_the_parsed_spec_despite_warnings():
    spec = require_fits("xring:1K:pscpu/pscpu", Layout(1))
    assert isinstance(spec, AllReduceSpec)
    assert spec == parse_spec("xring:1K:pscpu/pscpu")
    parsed = parse_spec("xring")
    assert require_fits(parsed, CPU4) is parsed


def test_require_fits_lets_spec_errors_through():
    with pytest.raises(SpecError, match="no entry has limit -1"):
        require_fits(("xring", 1, 1024), CPU4)
