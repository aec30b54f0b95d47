"""Unit tests for mpistrat.packing: pack plans, TensorFlow's worked examples, round trips."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpistrat.bench.shapes import resnet50_gradient_shapes
from mpistrat.errors import MpistratError
from mpistrat.packing import (
    Pack,
    PackingError,
    PackingTypeError,
    PackMember,
    PackPlan,
    TensorSpec,
    no_packing,
    plan_by_size,
    plan_concat_and_split,
    plan_small_tensor_aggregation,
    plan_tf_packing,
    tensor_specs,
)

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)

PLANNERS = {
    "concat_and_split": lambda specs, a: plan_concat_and_split(specs, a % 5 + 1),
    "small_tensors": lambda specs, a: plan_small_tensor_aggregation(specs, 4 * (a % 40) + 1,
                                                                    a % 4 + 1),
    "by_size": lambda specs, a: plan_by_size(specs, 8 * (a % 30)),
    "none": lambda specs, a: no_packing(specs),
}


def f32(*shapes):
    return [(shape, np.float32) for shape in shapes]


def members(plan):
    """Each pack's member indices, in layout order."""
    return [list(p.indices) for p in plan.packs]


def make_batch(specs, seed=0):
    """Distinct values per tensor, so a misplaced element is caught."""
    rng = np.random.default_rng(seed)
    out = []
    for spec in tensor_specs(specs):
        values = rng.integers(1, 100, size=spec.shape) if spec.dtype.kind in "iub" else (
            rng.standard_normal(spec.shape))
        out.append(np.asarray(values).astype(spec.dtype))
    return out


def round_trip(plan, arrays, copy=False):
    packs, singles = plan.pack(arrays)
    reduced = [p.copy() for p in packs]  # stands in for the all-reduce
    return packs, singles, plan.unpack(reduced, [s.copy() for s in singles], copy=copy)


def assert_same_batch(got, expected):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype
        np.testing.assert_array_equal(_bytes(g), _bytes(e))  # exact, NaN and -0.0 included


def _bytes(array):
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def assert_no_aliasing(arrays):
    for a, b in itertools.combinations(arrays, 2):
        assert not np.shares_memory(a, b)


# ------------------------------------------------------------------ specs


def test_tensor_specs_accepts_arrays_pairs_and_specs():
    specs = tensor_specs([np.zeros((2, 3), np.float16), ((4,), "int32"), TensorSpec((), F32)])
    assert specs == (TensorSpec((2, 3), np.dtype("f2")), TensorSpec((4,), np.dtype("i4")),
                     TensorSpec((), F32))
    assert [s.size for s in specs] == [6, 4, 1]
    assert [s.nbytes for s in specs] == [12, 16, 4]
    assert TensorSpec((0, 5), F32).size == 0


@pytest.mark.parametrize("planner", [
    lambda s: plan_concat_and_split(s, 2), lambda s: plan_small_tensor_aggregation(s, 8, 2),
    lambda s: plan_by_size(s, 8), no_packing, lambda s: plan_tf_packing(s)])
def test_empty_batch_is_an_error_naming_it(planner):
    with pytest.raises(PackingError, match=r"the batch is empty \(0 tensors\).*pass at least"):
        planner([])


@pytest.mark.parametrize("item, error, pattern", [
    (5, PackingTypeError, r"tensor 0 is 5; expected an array or a \(shape, dtype\) pair"),
    (((2, -1), "f4"), PackingError, r"tensor 0 has shape \(2, -1\) with a negative"),
    (((2.5,), "f4"), PackingTypeError, r"tensor 0 has shape \(2\.5,\); expected a sequence"),
    (((2,), None), PackingTypeError, r"tensor 0 has dtype None"),
    (((2,), "nope"), PackingTypeError, r"tensor 0 has dtype 'nope', which NumPy"),
])
def test_bad_specs(item, error, pattern):
    with pytest.raises(error, match=pattern):
        no_packing([item])


def test_a_batch_must_be_a_sequence():
    with pytest.raises(PackingTypeError, match="a batch must be a sequence"):
        no_packing("float32")


def test_errors_are_mpistrat_value_errors():
    assert issubclass(PackingError, MpistratError) and issubclass(PackingError, ValueError)
    assert issubclass(PackingTypeError, TypeError)


# ------------------------------------------------------------------ small-tensor aggregation


@pytest.mark.parametrize("shapes, wire, packed", [
    # tf-semantics.md 3.3, B=40 bytes, M=10, float32
    ([(8,), (3, 3), (12,), (5, 5, 5)], [(17,), (12,), (5, 5, 5)], [[0, 1]]),
    ([(5, 5, 5), (2, 3), (5,)], [(11,), (5, 5, 5)], [[1, 2]]),
    ([(5, 5, 5), (2, 3), (1, 5), (7,), (100,)], [(18,), (5, 5, 5), (100,)], [[1, 2, 3]]),
])
def test_small_tensor_aggregation_tf_examples(shapes, wire, packed):
    plan = plan_small_tensor_aggregation(f32(*shapes), 40, 10)
    assert list(plan.wire_shapes) == wire
    assert members(plan) == packed
    arrays = make_batch(f32(*shapes))
    packs, singles, out = round_trip(plan, arrays)
    np.testing.assert_array_equal(packs[0], np.concatenate([arrays[i].ravel() for i in packed[0]]))
    assert all(s is arrays[i] for s, i in zip(singles, plan.passthrough))
    assert_same_batch(out, arrays)


def test_small_tensor_groups_hold_at_most_max_group():
    # TF's extract_ranges would pack all 5 with M=3 (up to M + 2); we keep M.
    plan = plan_small_tensor_aggregation(f32(*[(2,)] * 5), 8, 3)
    assert members(plan) == [[0, 1, 2], [3, 4]]
    plan = plan_small_tensor_aggregation(f32(*[(2,)] * 7), 8, 3)
    assert members(plan) == [[0, 1, 2], [3, 4, 5]] and plan.passthrough == (6,)
    plan = plan_small_tensor_aggregation(f32(*[(2,)] * 4), 8, 1)
    assert plan.packs == () and plan.passthrough == (0, 1, 2, 3)


def test_small_tensor_runs_break_at_large_tensors_and_dtype_changes():
    specs = [((2,), "f4"), ((2,), "f4"), ((2,), "f2"), ((2,), "f2"), ((2,), "f2"),
             ((100,), "f4"), ((1,), "f4"), ((1,), "f4"), ((3,), "f8")]
    plan = plan_small_tensor_aggregation(specs, 16, 10)
    assert members(plan) == [[0, 1], [2, 3, 4], [6, 7]]
    assert [p.dtype.name for p in plan.packs] == ["float32", "float16", "float32"]
    assert plan.passthrough == (5, 8)


def test_small_means_any_float_and_at_most_max_bytes():
    specs = [((10,), BF16), ((10,), BF16), ((5,), "f8"), ((5,), "f8"), ((6,), "f8"),
             ((6,), "f8"), ((2,), "i4"), ((2,), "i4"), ((2,), "c8"), ((2,), "c8"),
             ((2,), "bool"), ((2,), "bool"), ((0,), "f4"), ((0,), "f4")]
    plan = plan_small_tensor_aggregation(specs, 40, 10)
    # bf16 20 B and f8 40 B are small; f8 48 B is not; ints, complex and bool never are
    assert members(plan) == [[0, 1], [2, 3], [12, 13]]
    assert plan.packs[0].dtype == BF16 and plan.packs[2].size == 0
    assert_same_batch(round_trip(plan, make_batch(specs))[2], make_batch(specs))


@pytest.mark.parametrize("max_bytes, max_group", [(0, 10), (40, 0), (-1, 3), (0, 0)])
def test_small_tensor_options_must_be_positive(max_bytes, max_group):
    with pytest.raises(PackingError, match=re.escape(
            "agg_small_grads_max_bytes and agg_small_grads_max_group should both be greater "
            f"than zero, got {max_bytes} and {max_group}")):
        plan_small_tensor_aggregation(f32((2,)), max_bytes, max_group)


# ------------------------------------------------------------------ concat and split


def test_concat_and_split_sizes_follow_tf():
    plan = plan_concat_and_split(f32((3, 3), (5,), (2, 2, 2)), 4)  # T = 22, s = 5
    assert plan.pack_sizes == (5, 5, 5, 7) and plan.passthrough == ()
    assert plan_concat_and_split(f32((22,)), 1).pack_sizes == (22,)
    assert plan_concat_and_split(f32((2,), (1,)), 5).pack_sizes == (0, 0, 0, 0, 3)  # T < P
    assert plan_concat_and_split(f32((0,), ()), 2).pack_sizes == (0, 1)


def test_concat_and_split_packs_are_slices_of_the_concatenation():
    specs = f32((3, 3), (5,), (), (0,), (2, 2, 2))
    arrays = make_batch(specs)
    plan = plan_concat_and_split(specs, 3)
    packs, singles, out = round_trip(plan, arrays)
    whole = np.concatenate([a.ravel() for a in arrays])
    np.testing.assert_array_equal(np.concatenate(packs), whole)
    assert singles == [] and [len(p) for p in packs] == [7, 7, 9]
    assert_same_batch(out, arrays)
    # T = 23, s = 7: tensor 0 (elements 0..8) straddles packs 0 and 1; the empty tensor 3
    # sits where it would start, in pack 2
    assert [[(m.index, m.offset, m.size, m.start) for m in p.members] for p in plan.packs] == [
        [(0, 0, 7, 0)], [(0, 0, 2, 7), (1, 2, 5, 0)], [(2, 0, 1, 0), (3, 1, 0, 0), (4, 1, 8, 0)]]


def test_concat_and_split_groups_per_dtype_in_order_of_first_appearance():
    specs = [((4,), "i4"), ((3,), "f4"), ((2,), "i4"), ((5,), "f4"), ((1,), BF16)]
    plan = plan_concat_and_split(specs, 2)
    assert [(p.dtype.name, p.size) for p in plan.packs] == [
        ("int32", 3), ("int32", 3), ("float32", 4), ("float32", 4), ("bfloat16", 0),
        ("bfloat16", 1)]
    assert members(plan)[:4] == [[0], [0, 2], [1, 3], [3]]
    arrays = make_batch(specs)
    assert_same_batch(round_trip(plan, arrays)[2], arrays)


@pytest.mark.parametrize("num_packs", [0, -3])
def test_concat_and_split_needs_positive_num_packs(num_packs):
    with pytest.raises(PackingError, match=rf"^num_packs must be greater than zero, got "
                                           rf"{num_packs}; use num_packs >= 1"):
        plan_concat_and_split(f32((2,)), num_packs)


@pytest.mark.parametrize("value", [True, 2.0, "2", None])
def test_options_must_be_ints(value):
    with pytest.raises(PackingTypeError, match=r"num_packs must be an int, got"):
        plan_concat_and_split(f32((2,)), value)
    with pytest.raises(PackingTypeError, match=r"bytes_per_pack must be an int, got"):
        plan_by_size(f32((2,)), value)


# ------------------------------------------------------------------ by size


def test_by_size_tf_example_is_the_reversed_batch():
    # TF's test: sizes 128, 32, 800, 4 bytes, target 200 -> [[128, 32, 800], [4]]. TF packs
    # the reversed batch, so the example is the batch [4, 800, 32, 128] seen from its end.
    batch = f32((1,), (200,), (8,), (32,))  # 4, 800, 32, 128 bytes
    plan = plan_by_size(batch, 200)
    assert [[plan.specs[i].nbytes for i in pack] for pack in members(plan)] == [
        [128, 32, 800], [4]]
    assert members(plan) == [[3, 2, 1], [0]]
    # The same sizes in batch order 128, 32, 800, 4: reversed 4, 800 | 32, 128.
    plan = plan_by_size(f32((32,), (8,), (200,), (1,)), 200)
    assert members(plan) == [[3, 2], [1, 0]]


def test_by_size_starts_a_pack_only_when_the_current_one_exceeds_the_target():
    plan = plan_by_size(f32((1,), (25,), (25,)), 100)  # reversed: 100 B (== target), 100, 4
    assert members(plan) == [[2, 1], [0]]
    assert all(p.nbytes >= 100 for p in plan.packs[:-1])


def test_by_size_zero_means_one_pack_per_dtype():
    assert members(plan_by_size(f32((3,), (100,), ()), 0)) == [[2, 1, 0]]
    specs = [((3,), "f4"), ((2,), "f2"), ((4,), "f4"), ((1,), "f2")]
    plan = plan_by_size(specs, 0)
    assert members(plan) == [[3, 1], [2, 0]]
    assert [p.dtype.name for p in plan.packs] == ["float16", "float32"]


def test_by_size_mixed_dtypes_pack_each_dtype_as_tf_would():
    specs = [((10,), "f4"), ((10,), "f2"), ((10,), "f4"), ((10,), "f2"), ((10,), "f4")]
    plan = plan_by_size(specs, 30)  # f4 tensors are 40 B, f2 20 B
    # reversed: 4 (f4), 3 (f2), 2 (f4), 1 (f2), 0 (f4); f4: [4] 40 > 30 -> [2] -> [0];
    # f2: [3] 20 <= 30, [3, 1]; packs ordered by where they start in the reversed batch
    assert members(plan) == [[4], [3, 1], [2], [0]]
    arrays = make_batch(specs)
    assert_same_batch(round_trip(plan, arrays)[2], arrays)


def _tf_group_by_size(sizes, target):
    """TF's group_by_size on a one-dtype list, as tf-semantics.md 3.4 describes it."""
    if target == 0:
        return [list(range(len(sizes)))]
    packs, last = [], 0
    for i, size in enumerate(sizes):
        if not packs or last > target:
            packs.append([])
            last = 0
        packs[-1].append(i)
        last += size
    return packs


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 64), min_size=1, max_size=20), st.integers(0, 300))
def test_by_size_matches_tf_on_one_dtype(lengths, target):
    specs = f32(*[(n,) for n in lengths])
    rev = list(reversed(range(len(specs))))
    expected = [[rev[j] for j in pack] for pack in
                _tf_group_by_size([4 * lengths[i] for i in rev], target)]
    assert members(plan_by_size(specs, target)) == expected


def test_by_size_rejects_negative_target():
    with pytest.raises(PackingError, match=r"bytes_per_pack must be >= 0, got -1"):
        plan_by_size(f32((2,)), -1)


# ------------------------------------------------------------------ no packing, TF priority


def test_no_packing():
    plan = no_packing(f32((2,), (), (0, 3)))
    assert plan.packs == () and plan.passthrough == (0, 1, 2) and plan.method == "none"
    arrays = make_batch(plan.specs)
    packs, singles, out = round_trip(plan, arrays)
    assert packs == [] and all(s is a for s, a in zip(singles, arrays))
    assert_same_batch(out, arrays)


def test_tf_priority():
    specs = f32((2,), (3,), (400,))
    assert plan_tf_packing(specs, num_packs=2, agg_small_grads_max_bytes=40,
                           agg_small_grads_max_group=4).method == "concat_and_split"
    small = plan_tf_packing(specs, agg_small_grads_max_bytes=40, agg_small_grads_max_group=4)
    assert small.method == "small_tensors" and members(small) == [[0, 1]]
    assert plan_tf_packing(specs) == no_packing(specs)
    with pytest.raises(PackingError, match=r"should both be greater than zero, got 40 and 0"):
        plan_tf_packing(specs, agg_small_grads_max_bytes=40)
    with pytest.raises(PackingError, match=r"num_packs must be >= 0, got -1"):
        plan_tf_packing(specs, num_packs=-1)


# ------------------------------------------------------------------ plans: caching, checks


def test_plans_are_cached_hashable_and_compare_by_layout():
    arrays = make_batch(f32((3,), (4, 4)))
    a = plan_concat_and_split(arrays, 2)
    assert plan_concat_and_split(f32((3,), (4, 4)), 2) is a
    assert {a: 1}[plan_concat_and_split([((3,), "float32"), ((4, 4), "<f4")], 2)] == 1
    # one pack of everything, whichever planner made it
    assert plan_by_size(arrays, 0) != plan_concat_and_split(arrays, 1)  # member order differs
    assert plan_small_tensor_aggregation(arrays, 64, 2) == plan_concat_and_split(arrays, 1)


def test_a_handmade_plan_is_validated():
    specs = f32((2,), (3,))
    good = PackPlan(specs, (Pack("float32", 5, (PackMember(1, (3,), 0, 3),
                                                PackMember(0, (2,), 3, 2))),), ())
    arrays = make_batch(specs)
    assert_same_batch(round_trip(good, arrays)[2], arrays)
    bad = [
        ((Pack("float32", 5, (PackMember(1, (3,), 0, 3), PackMember(0, (2,), 2, 2))),), (),
         "overlaps, leaves a gap"),
        ((Pack("float32", 3, (PackMember(1, (3,), 0, 3),)),), (), "tensor 0 is in no pack"),
        ((Pack("float32", 3, (PackMember(1, (3,), 0, 3),)),), (0, 1), "also packed"),
        ((Pack("float64", 2, (PackMember(0, (2,), 0, 2),)),), (1,), "a pack holds one dtype"),
        ((Pack("float32", 2, (PackMember(0, (2,), 0, 2),)),), (1, 1), "lists a tensor twice"),
        ((Pack("float32", 4, (PackMember(0, (2,), 0, 2),)),), (1,), "members hold 2"),
        ((Pack("float32", 2, (PackMember(1, (3,), 0, 2),)),), (0,), "not covered exactly"),
        ((Pack("float32", 2, (PackMember(7, (3,), 0, 2),)),), (0,), "names tensor 7"),
    ]
    for packs, passthrough, message in bad:
        with pytest.raises(PackingError, match=message):
            PackPlan(specs, packs, passthrough)


def test_pack_and_unpack_check_their_inputs():
    plan = plan_small_tensor_aggregation(f32((2,), (3,), (50,)), 40, 4)
    arrays = make_batch(plan.specs)
    with pytest.raises(PackingError, match=r"got 2 arrays, the plan expects 3"):
        plan.pack(arrays[:2])
    with pytest.raises(PackingError, match=r"tensor 1 has shape \(4,\) and dtype float32, the "
                                           r"plan expects \(3,\) and float32; build a plan"):
        plan.pack([arrays[0], np.zeros(4, np.float32), arrays[2]])
    with pytest.raises(PackingError, match=r"tensor 2 has shape \(50,\) and dtype float64"):
        plan.pack(arrays[:2] + [arrays[2].astype(np.float64)])
    with pytest.raises(PackingTypeError, match=r"tensor 0 is a list, not an array"):
        plan.pack([[1.0, 2.0]] + arrays[1:])
    packs, singles = plan.pack(arrays)
    with pytest.raises(PackingError, match=r"got 0 reduced packs, the plan expects 1"):
        plan.unpack([], singles)
    with pytest.raises(PackingError, match=r"got 0 reduced singles, the plan expects 1"):
        plan.unpack(packs, [])
    with pytest.raises(PackingError, match=r"reduced pack 0 has 4 elements, the plan's pack 0 "
                                           r"has 5"):
        plan.unpack([packs[0][:4]], singles)
    with pytest.raises(PackingError, match=r"reduced single 0 \(tensor 2\) has 3 elements, "
                                           r"expected 50"):
        plan.unpack(packs, [np.zeros(3, np.float32)])


# ------------------------------------------------------------------ unpack: views, copies, dtypes


def test_unpack_returns_disjoint_views_or_copies():
    specs = f32((2, 2), (3,), (), (0,), (5,))
    plan = plan_concat_and_split(specs, 2)  # tensor 1 straddles the two packs
    arrays = make_batch(specs)
    packs, _ = plan.pack(arrays)
    assert not any(np.shares_memory(p, a) for p in packs for a in arrays)
    views = plan.unpack(packs)
    assert_same_batch(views, arrays)
    assert_no_aliasing(views)
    assert np.shares_memory(views[0], packs[0]) and not np.shares_memory(views[1], packs[0])
    copies = plan.unpack(packs, copy=True)
    assert_same_batch(copies, arrays)
    assert not any(np.shares_memory(c, p) for c in copies for p in packs)


def test_unpack_keeps_the_reduced_dtype():
    # integer MEAN returns float64: the results take the reduced buffers' dtype
    plan = plan_concat_and_split([((2, 2), "i4"), ((3,), "i4")], 2)
    packs, _ = plan.pack([np.arange(4, dtype=np.int32).reshape(2, 2), np.arange(3, dtype="i4")])
    out = plan.unpack([p / 2 for p in packs])
    assert [o.dtype for o in out] == [np.float64, np.float64]
    np.testing.assert_array_equal(out[0], np.arange(4).reshape(2, 2) / 2)
    np.testing.assert_array_equal(out[1], np.arange(3) / 2)


def test_non_contiguous_inputs_pack_correctly():
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    arrays = [base.T, base[:, ::2], np.float32(3.5)]
    for plan in (plan_concat_and_split(arrays, 4), plan_by_size(arrays, 0)):
        assert_same_batch(round_trip(plan, arrays)[2], [np.asarray(a) for a in arrays])
        packs, _ = plan.pack(arrays)
        for pack, views in zip(packs, plan.segments([np.asarray(a) for a in arrays])):
            assert np.array_equal(np.concatenate(views), pack)


def test_segments_are_views_and_check_the_batch():
    plan = plan_concat_and_split([((2, 3), "f4"), ((4,), "f4"), ((5,), "f4")], 2)
    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(4, np.float32),
              np.zeros(5, np.float32)]
    segments = plan.segments(arrays)
    # a whole tensor and the pieces of a split one are views of the inputs, not copies
    assert all(any(np.shares_memory(v, a) for a in arrays) for views in segments for v in views)
    assert sum(len(views) for views in segments) == 4  # tensor 1 is split over both packs
    with pytest.raises(PackingError, match=r"tensor 1 has shape \(3,\)"):
        plan.segments([arrays[0], np.ones(3, np.float32), arrays[2]])
    with pytest.raises(PackingError, match="float64"):
        plan.segments([arrays[0], arrays[1], np.zeros(5)])


# ------------------------------------------------------------------ property: round trips

DTYPES = [np.dtype(d) for d in ("f4", "f2", "f8", "i4", "i8", "u1", "bool", "c8")] + [BF16]
spec_strategy = st.tuples(st.lists(st.integers(0, 4), max_size=3).map(tuple),
                          st.sampled_from(DTYPES))


@pytest.mark.parametrize("name", sorted(PLANNERS))
@settings(max_examples=40, deadline=None)
@given(specs=st.lists(spec_strategy, min_size=1, max_size=10), arg=st.integers(0, 10_000))
def test_round_trip(name, specs, arg):
    plan = PLANNERS[name](specs, arg)
    arrays = make_batch(specs, seed=arg)
    packs, singles, out = round_trip(plan, arrays)
    assert_same_batch(out, arrays)
    assert_no_aliasing([o for o in out if o.size])
    # every pack is 1-D, one dtype, its declared size; singles are in passthrough order
    assert [p.shape for p in packs] == [(p.size,) for p in plan.packs]
    assert [p.dtype for p in packs] == [p.dtype for p in plan.packs]
    assert [s.shape for s in singles] == [plan.specs[i].shape for i in plan.passthrough]
    assert sum(plan.pack_sizes) + sum(plan.specs[i].size for i in plan.passthrough) == sum(
        s.size for s in plan.specs)
    # segments(): views whose concatenation is each pack (what out-of-place reads), the
    # same with the check skipped
    unchecked = plan.segments(arrays, validate=False)
    for pack, views, same in zip(packs, plan.segments(arrays), unchecked, strict=True):
        joined = np.concatenate(views) if views else pack[:0]
        assert joined.dtype == pack.dtype and np.array_equal(
            joined.view(np.uint8), pack.view(np.uint8))
        assert [v.shape for v in same] == [v.shape for v in views]
        assert all(np.array_equal(a.view(np.uint8), b.view(np.uint8))
                   for a, b in zip(same, views))
    if name == "small_tensors":
        for pack in plan.packs:
            assert 2 <= len(pack.members) and list(pack.indices) == list(
                range(pack.indices[0], pack.indices[-1] + 1))
    if name in ("by_size", "concat_and_split"):
        assert plan.passthrough == ()


# ------------------------------------------------------------------ ResNet-50


def test_resnet50_gradient_shapes():
    shapes = resnet50_gradient_shapes()
    assert len(shapes) == 161
    assert sum(int(np.prod(s)) for s in shapes) == 25_557_032
    assert shapes[:3] == ((7, 7, 3, 64), (64,), (64,))
    assert shapes[3:6] == ((1, 1, 64, 256), (256,), (256,))  # first projection shortcut
    assert shapes[-2:] == ((2048, 1000), (1000,))
    assert sum(len(s) == 4 for s in shapes) == 53 and sum(len(s) == 1 for s in shapes) == 107


def test_resnet50_plans():
    specs = f32(*resnet50_gradient_shapes())
    plan = plan_concat_and_split(specs, 4)
    assert plan.pack_sizes == (6_389_258,) * 3 + (6_389_258,)
    # batch-norm vectors up to 1024 channels are small (4 KiB); the four 2048-channel ones
    # and every kernel are not, and the fc bias follows the fc kernel alone
    small = plan_small_tensor_aggregation(specs, 4096, 16)
    assert all(len(p.members) == 2 for p in small.packs)  # each gamma with its beta
    assert len(small.packs) == 53 - 4 and len(small.passthrough) == 161 - 2 * 49
    by_size = plan_by_size(specs, 4 << 20)
    assert all(p.nbytes > 4 << 20 for p in by_size.packs[:-1])
    assert by_size.packs[0].members[0].index == 160  # fc bias first, as TF reverses
    arrays = [np.full(s, i, np.float32) for i, s in enumerate(resnet50_gradient_shapes())]
    for plan in (plan, by_size):
        _, _, out = round_trip(plan, arrays)
        assert all(o.shape == a.shape and o.flat[0] == i and o.flat[-1] == i
                   for i, (o, a) in enumerate(zip(out, arrays)))


# ---------------------------------------------------------------- flat_arrays


def test_flat_arrays_are_views_of_one_buffer_in_order():
    import mpistrat
    from mpistrat.algorithms import Source

    arrays = mpistrat.flat_arrays([(2, 3), 5, (), (0, 4), (1,)], np.float64)
    assert [a.shape for a in arrays] == [(2, 3), (5,), (), (0, 4), (1,)]
    assert all(a.dtype == np.float64 and a.flags.writeable and not a.any() for a in arrays)
    base = arrays[0].base
    assert all(a.base is base for a in arrays) and base.size == 13
    arrays[1][...] = 7
    assert base[6:11].tolist() == [7.0] * 5  # right after the 2x3 array
    joined = Source([a.reshape(-1) for a in arrays]).joined()
    assert joined is not None and joined.size == 13
    with pytest.raises(ValueError, match=r"negative dimensions .* \(2, -1\)"):
        mpistrat.flat_arrays([(3,), (2, -1)])


@pytest.mark.parametrize("array", [np.arange(7, dtype=np.float32), np.zeros(0),
                                   np.ones(3, np.int64)], ids=["float32", "empty", "int64"])
def test_source_of_one_array_is_the_general_constructor_s_source(array):
    """``Source.of`` fills its fields by hand (every out-of-place call makes one): they must
    stay what ``Source([array])`` computes."""
    from mpistrat.algorithms import Source

    quick, general = Source.of(array), Source([array])
    for name in Source.__slots__:
        assert repr(getattr(quick, name)) == repr(getattr(general, name)), name
