"""Packing: gather a batch of tensors into a few flat buffers before an all-reduce.

``batch_reduce`` all-reduces a batch of tensors; launching one collective per tensor
wastes latency on small ones, so the batch is first **packed** into fewer, larger 1-D
buffers, the packs are all-reduced, and the results are **unpacked** back into the
original tensors. Packing is a pure, single-process operation on one device's list of
arrays. A :class:`PackPlan` depends only on the batch's shapes and dtypes, so it is
built once per batch structure (planners are cached) and applied to every local
replica's list in the same way, on every rank.

Planners (TensorFlow's options, ``tf-semantics.md`` section 3):

* :func:`plan_concat_and_split` — ``num_packs = P > 0``: concatenate and cut into P.
* :func:`plan_small_tensor_aggregation` — ``agg_small_grads_max_bytes / max_group``.
* :func:`plan_by_size` — ``CommunicationOptions.bytes_per_pack`` (``pack_by_size``).
* :func:`no_packing` — every tensor reduced on its own (TF's ``num_packs=0``).
* :func:`plan_tf_packing` — TF's priority among the first three (section 3.1).

Decisions where mpistrat differs from TensorFlow:

* **A pack holds one dtype.** TF concatenated the whole batch and failed on mixed
  dtypes; here every planner groups per dtype, in order of first appearance.
* Small-tensor groups hold **at most** ``max_group`` tensors (TF allowed M + 2), and
  any floating dtype is eligible (TF only took float32).
* Layout: ``plan.pack(arrays)`` returns ``(packs, singles)`` — the packs in plan order,
  then the tensors reduced on their own in ascending index order (TF's packed-list
  layout). ``plan.unpack(reduced_packs, reduced_singles)`` returns the batch in its
  original order with its original shapes.

Only NumPy functions that dispatch on the array type (``np.empty_like``) and array
methods are used, so CuPy arrays work without this module importing CuPy.

The package: :mod:`.plan` (what a plan is and how it is applied: :class:`PackPlan`,
``segments``/``unpack``, buffers of views) and :mod:`.planners` (TensorFlow's ways of
choosing packs).
"""

from __future__ import annotations

from ..errors import PackingError, PackingTypeError
from .plan import (Pack, PackMember, PackPlan, TensorSpec, checked_shapes, flat_arrays,
                   tensor_specs, views_in_order)
from .planners import (no_packing, plan_by_size, plan_concat_and_split,
                       plan_small_tensor_aggregation, plan_tf_packing)

__all__ = [
    "PackingError",
    "PackingTypeError",
    "TensorSpec",
    "PackMember",
    "Pack",
    "PackPlan",
    "tensor_specs",
    "plan_concat_and_split",
    "plan_small_tensor_aggregation",
    "plan_by_size",
    "no_packing",
    "plan_tf_packing",
    "flat_arrays",
    "checked_shapes",
    "views_in_order",
]
