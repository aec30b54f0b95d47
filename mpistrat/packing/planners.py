"""TensorFlow's ways of choosing packs (``tf-semantics.md`` section 3), each returning a
:class:`~.plan.PackPlan`, cached by the batch's shapes and dtypes."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..errors import PackingError
from .plan import (Pack, PackMember, PackPlan, TensorSpec, _by_dtype, _check_int,
                   _is_floating, _whole_pack, tensor_specs)

__all__ = ["plan_concat_and_split", "plan_small_tensor_aggregation", "plan_by_size",
           "no_packing", "plan_tf_packing"]

_CACHE_SIZE = 256


def plan_concat_and_split(specs: Iterable[Any], num_packs: int) -> PackPlan:
    """TensorFlow's ``num_packs = P > 0``: concatenate the batch and cut it into P packs.

    Per dtype (dtypes in order of first appearance; TF had no dtype grouping and
    failed on mixed dtypes), the tensors of that dtype are flattened and concatenated
    in batch order into ``T`` elements, then cut into P packs: ``s = T // P``, packs
    0..P-2 hold ``s`` elements and the last holds ``T - s*(P-1)``; when ``T < P`` the
    first P-1 packs are empty (TF all-reduced them anyway, and so does this plan). A
    batch with D dtypes gives D·P packs; a tensor may be split across packs.

    Args:
        specs: the batch (see :func:`tensor_specs`).
        num_packs: P, at least 1.

    Returns:
        The plan; ``passthrough`` is empty.

    Raises:
        PackingError: ``num_packs`` is not greater than zero, or the batch is empty.
    """
    num_packs = _check_int("num_packs", num_packs)
    if num_packs <= 0:
        raise PackingError(
            f"num_packs must be greater than zero, got {num_packs}; use num_packs >= 1, "
            f"or no_packing() to reduce every tensor on its own")
    return _concat_and_split(tensor_specs(specs), num_packs)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _concat_and_split(specs: tuple[TensorSpec, ...], parts: int) -> PackPlan:
    packs = []
    for dtype, indices in _by_dtype(specs).items():
        total = sum(specs[i].size for i in indices)
        step = total // parts
        members: list[list[PackMember]] = [[] for _ in range(parts)]
        position = 0
        for i in indices:
            shape, size = specs[i].shape, specs[i].size
            k = _part_of(position, step, parts)
            if size == 0:
                members[k].append(PackMember(i, shape, position - k * step, 0))
            end, pos = position + size, position
            while pos < end:
                k = _part_of(pos, step, parts)
                stop = min(end, total if k == parts - 1 else (k + 1) * step)
                members[k].append(PackMember(i, shape, pos - k * step, stop - pos, pos - position))
                pos = stop
            position = end
        for k in range(parts):
            size = total - step * (parts - 1) if k == parts - 1 else step
            packs.append(Pack(dtype, size, tuple(members[k])))
    return PackPlan(specs, tuple(packs), (), method="concat_and_split")


def _part_of(position: int, step: int, parts: int) -> int:
    return parts - 1 if step == 0 else min(position // step, parts - 1)


def plan_small_tensor_aggregation(specs: Iterable[Any], max_bytes: int,
                                  max_group: int) -> PackPlan:
    """TensorFlow's ``agg_small_grads_max_bytes / agg_small_grads_max_group``.

    A tensor is small when its dtype is floating (any float dtype, including
    ``ml_dtypes`` ones such as bfloat16; TF only took float32) and its size is at most
    ``max_bytes`` bytes. Maximal runs of consecutive small tensors of one dtype (a run
    breaks at a dtype change) are cut, from their start, into groups of at most
    ``max_group`` tensors; each group of two or more becomes one pack, members in batch
    order. A group of one is not packed, as in TF. Every other tensor is a single.

    TF's ``extract_ranges`` let a run grow while ``last - first <= M``, so its groups
    held up to M + 2 tensors; this planner keeps the documented limit of M (so
    ``max_group=1`` packs nothing).

    Args:
        specs: the batch (see :func:`tensor_specs`).
        max_bytes: largest size, in bytes, of a small tensor (> 0).
        max_group: most tensors in one pack (> 0).

    Returns:
        The plan: packs in batch order, then the singles in ascending index order.

    Raises:
        PackingError: an argument is not greater than zero, or the batch is empty.
    """
    max_bytes = _check_int("agg_small_grads_max_bytes", max_bytes)
    max_group = _check_int("agg_small_grads_max_group", max_group)
    if max_bytes <= 0 or max_group <= 0:
        raise PackingError(
            f"agg_small_grads_max_bytes and agg_small_grads_max_group should both be "
            f"greater than zero, got {max_bytes} and {max_group}; use positive values, or "
            f"no_packing() to reduce every tensor on its own")
    return _small_tensors(tensor_specs(specs), max_bytes, max_group)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _small_tensors(specs: tuple[TensorSpec, ...], max_bytes: int, max_group: int) -> PackPlan:
    runs: list[list[int]] = []
    for i, spec in enumerate(specs):
        if not (_is_floating(spec.dtype) and spec.nbytes <= max_bytes):
            continue
        run = runs[-1] if runs else None
        if run and run[-1] == i - 1 and specs[run[-1]].dtype == spec.dtype:
            run.append(i)
        else:
            runs.append([i])
    packs, packed = [], set()
    for run in runs:
        for first in range(0, len(run), max_group):
            group = run[first:first + max_group]
            if len(group) >= 2:
                packs.append(_whole_pack(specs, group))
                packed.update(group)
    singles = tuple(i for i in range(len(specs)) if i not in packed)
    return PackPlan(specs, tuple(packs), singles, method="small_tensors")


def plan_by_size(specs: Iterable[Any], bytes_per_pack: int) -> PackPlan:
    """TensorFlow's ``CommunicationOptions.bytes_per_pack`` (``pack_by_size``, r2.2+).

    TF reverses the batch (gradients arrive roughly last layer first) and walks it,
    starting a new pack only when the current pack's size already **exceeds**
    ``bytes_per_pack``, so every pack but the last is at least the target; 0 means one
    pack. TF's test example, sizes 128, 32, 800, 4 bytes with target 200 giving packs
    ``[[128, 32, 800], [4]]``, describes that reversed walk: the batch
    ``[4, 800, 32, 128]`` (indices 0..3) gives pack 0 = tensors 3, 2, 1 and pack 1 =
    tensor 0.

    Mixed dtypes: a pack holds one dtype. Each dtype's tensors (taken in reversed batch
    order, skipping the others) are packed exactly as TF packs a one-dtype batch, and
    the packs are ordered by their first member's position in the reversed batch; for a
    one-dtype batch this is TF's result. ``bytes_per_pack == 0`` gives one pack per
    dtype. Members are laid out in reversed batch order, as TF concatenates them.

    Args:
        specs: the batch (see :func:`tensor_specs`).
        bytes_per_pack: target pack size in bytes (>= 0; 0 for one pack per dtype).

    Returns:
        The plan; ``passthrough`` is empty.

    Raises:
        PackingError: ``bytes_per_pack`` is negative, or the batch is empty.
    """
    bytes_per_pack = _check_int("bytes_per_pack", bytes_per_pack)
    if bytes_per_pack < 0:
        raise PackingError(
            f"bytes_per_pack must be >= 0, got {bytes_per_pack}; use 0 for one pack per "
            f"dtype or a target size in bytes such as 25 * 2**20")
    return _by_size(tensor_specs(specs), bytes_per_pack)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _by_size(specs: tuple[TensorSpec, ...], target: int) -> PackPlan:
    groups: list[list[int]] = []
    open_group: dict[np.dtype, tuple[list[int], int]] = {}
    for i in reversed(range(len(specs))):
        dtype = specs[i].dtype
        group, nbytes = open_group.get(dtype, (None, 0))
        if group is None or (target > 0 and nbytes > target):
            group, nbytes = [], 0
            groups.append(group)
        group.append(i)
        open_group[dtype] = (group, nbytes + specs[i].nbytes)
    packs = tuple(_whole_pack(specs, group) for group in groups)
    return PackPlan(specs, packs, (), method="by_size")


def no_packing(specs: Iterable[Any]) -> PackPlan:
    """Every tensor reduced on its own (TF's ``num_packs=0`` without small-tensor options).

    Raises:
        PackingError: the batch is empty.
    """
    specs = tensor_specs(specs)
    return PackPlan(specs, (), tuple(range(len(specs))), method="none")


def plan_tf_packing(specs: Iterable[Any], *, num_packs: int = 0,
                    agg_small_grads_max_bytes: int = 0,
                    agg_small_grads_max_group: int = 0) -> PackPlan:
    """Choose a plan as TF's ``_pack_tensors`` does (``tf-semantics.md`` section 3.1).

    ``num_packs > 0`` → :func:`plan_concat_and_split`; else both ``agg_*`` > 0 →
    :func:`plan_small_tensor_aggregation`; else :func:`no_packing`. Unlike TF, a
    negative value, or only one of the two ``agg_*`` options set, is an error rather
    than a silent "no packing".

    Raises:
        PackingError: a negative option, one ``agg_*`` option without the other, or an
            empty batch.
    """
    values = {"num_packs": num_packs, "agg_small_grads_max_bytes": agg_small_grads_max_bytes,
              "agg_small_grads_max_group": agg_small_grads_max_group}
    for name, value in values.items():
        if _check_int(name, value) < 0:
            raise PackingError(f"{name} must be >= 0, got {value}; use 0 to turn it off")
    if num_packs > 0:
        return plan_concat_and_split(specs, num_packs)
    if (agg_small_grads_max_bytes > 0) != (agg_small_grads_max_group > 0):
        raise PackingError(
            f"agg_small_grads_max_bytes and agg_small_grads_max_group should both be greater "
            f"than zero, got {agg_small_grads_max_bytes} and {agg_small_grads_max_group}; set "
            f"both to enable small-tensor aggregation, or both to 0")
    if agg_small_grads_max_bytes > 0:
        return plan_small_tensor_aggregation(
            specs, agg_small_grads_max_bytes, agg_small_grads_max_group)
    return no_packing(specs)
