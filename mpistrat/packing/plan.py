"""What a packing plan is and how it is applied: :class:`PackPlan` (packs of tensors of
one dtype, ``segments`` to read a batch through it, ``unpack`` to cut the results back),
the batch's :class:`TensorSpec` list, and flat buffers whose views are the tensors
(:func:`flat_arrays`). Pure and single-process; CuPy arrays work without importing CuPy.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from ..errors import PackingError, PackingTypeError

__all__ = ["TensorSpec", "PackMember", "Pack", "PackPlan", "tensor_specs", "flat_arrays",
           "checked_shapes", "views_in_order"]


class TensorSpec(NamedTuple):
    """The shape and dtype of one tensor of a batch (all a plan depends on)."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        return self.size * self.dtype.itemsize


@dataclass(frozen=True)
class PackMember:
    """One tensor's piece inside a pack.

    Attributes:
        index: the tensor's position in the batch.
        shape: the tensor's shape (to restore it when unpacking).
        offset: where the piece starts in the pack, in elements.
        size: the piece's length in elements.
        start: where the piece starts in the flattened tensor; 0 unless a tensor is
            split across packs (only :func:`plan_concat_and_split` does that).
    """

    index: int
    shape: tuple[int, ...]
    offset: int
    size: int
    start: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))


@dataclass(frozen=True)
class Pack:
    """One flat buffer to all-reduce: a dtype, a length and its members in layout order."""

    dtype: np.dtype
    size: int
    members: tuple[PackMember, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        object.__setattr__(self, "members", tuple(self.members))

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        return self.size * self.dtype.itemsize

    @property
    def indices(self) -> tuple[int, ...]:
        """Batch positions of the members, in layout order."""
        return tuple(m.index for m in self.members)


@dataclass(frozen=True)
class PackPlan:
    """How a batch (by shapes and dtypes) maps to packs and tensors reduced on their own.

    Plans are immutable and hashable; two plans with the same layout compare equal
    whichever planner built them (``method`` is informative only). Constructing one
    directly validates it: every tensor must be covered exactly once, by pieces of its
    own dtype, or be listed in ``passthrough``.

    Attributes:
        specs: the batch's shapes and dtypes, in batch order.
        packs: the flat buffers, in the order they are returned and reduced.
        passthrough: indices of tensors reduced on their own, in ``singles`` order.
        method: the planner that built the plan ("concat_and_split", "small_tensors",
            "by_size", "none" or "custom").
    """

    specs: tuple[TensorSpec, ...]
    packs: tuple[Pack, ...]
    passthrough: tuple[int, ...]
    method: str = field(default="custom", compare=False)
    _pieces: dict = field(init=False, repr=False, compare=False)
    _reads: tuple = field(init=False, repr=False, compare=False)
    _whole: tuple = field(init=False, repr=False, compare=False)
    _split: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "specs", tensor_specs(self.specs))
        object.__setattr__(self, "packs", tuple(self.packs))
        object.__setattr__(self, "passthrough", tuple(self.passthrough))
        object.__setattr__(self, "_pieces", _check_plan(self.specs, self.packs, self.passthrough))
        # the layout precomputed once per plan (a training loop applies it every step):
        # per pack, what each member reads ((index, None, None) for a whole tensor), and
        # the tensors that lie whole in one pack as (index, pack, offset, end, shape)
        whole = {index for index, pieces in self._pieces.items()
                 if len(pieces) == 1 and pieces[0][1].size == self.specs[index].size}
        object.__setattr__(self, "_reads", tuple(
            tuple((m.index, None, None) if m.index in whole else
                  (m.index, m.start, m.start + m.size) for m in pack.members)
            for pack in self.packs))
        object.__setattr__(self, "_whole", tuple(
            (index, k, m.offset, m.offset + m.size, m.shape)
            for index, ((k, m),) in ((i, self._pieces[i]) for i in sorted(whole))))
        object.__setattr__(self, "_split", tuple(i for i in self._pieces if i not in whole))

    @property
    def num_tensors(self) -> int:
        """Number of tensors in the batch."""
        return len(self.specs)

    @property
    def pack_sizes(self) -> tuple[int, ...]:
        """Element count of each pack."""
        return tuple(p.size for p in self.packs)

    @property
    def wire_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Shapes of what is all-reduced: the packs (1-D), then the singles (TF's layout)."""
        return tuple((p.size,) for p in self.packs) + tuple(
            self.specs[i].shape for i in self.passthrough)

    def pack(self, arrays: Sequence[Any],
             allocate: Callable[[int, Any], Any] | None = None) -> tuple[list[Any], list[Any]]:
        """Copy a batch into new flat packs.

        Args:
            arrays: the batch (NumPy or CuPy arrays), with the plan's shapes and dtypes.
            allocate: ``f(size, dtype) -> 1-D array`` giving each pack's buffer (e.g. a
                backend's recycling pool); default: a new array.

        Returns:
            ``(packs, singles)``: ``packs`` are new 1-D C-contiguous arrays, one per
            ``self.packs`` (they never alias the inputs, so reducing them in place is
            safe); ``singles`` are the passthrough arrays themselves (not copied), in
            ``self.passthrough`` order.

        Raises:
            PackingError: the batch's length, a shape or a dtype differs from the plan.
        """
        arrays = list(arrays)
        packs = []
        for pack, views in zip(self.packs, self.segments(arrays)):
            if allocate is not None:
                buffer = allocate(pack.size, pack.dtype)
            else:
                template = arrays[pack.members[0].index] if pack.members else arrays[0]
                buffer = np.empty_like(template, dtype=pack.dtype, shape=(pack.size,))
            for m, view in zip(pack.members, views):
                buffer[m.offset:m.offset + m.size] = view
            packs.append(buffer)
        return packs, [arrays[i] for i in self.passthrough]

    def segments(self, arrays: Sequence[Any], *, validate: bool = True) -> list[list[Any]]:
        """Each pack's contents as 1-D views of the batch's arrays, in pack order (no copy).

        The concatenation of ``segments(arrays)[k]`` is what :meth:`pack` copies into pack
        ``k``; out-of-place algorithms read these views directly. An array that is not
        C-contiguous is flattened into a copy first.

        Args:
            arrays: the batch, with the plan's shapes and dtypes.
            validate: check that it has them; ``False`` skips the check when the caller
                looked the plan up by this very batch's shapes and dtypes (a training
                loop's hot path; a batch that does not match then gives wrong views).

        Raises:
            PackingError: the batch's length, a shape or a dtype differs from the plan.
        """
        if validate:
            arrays = list(arrays)
            self._check_batch(arrays)
        flats: dict[int, Any] = {}  # tensors split across packs: flattened once
        out = []
        for reads in self._reads:
            views = []
            for index, start, stop in reads:
                if start is None:  # a whole tensor: its flat view (a copy if not C-order)
                    views.append(arrays[index].reshape(-1))
                    continue
                flat = flats.get(index)
                if flat is None:
                    flat = flats[index] = arrays[index].reshape(-1)
                views.append(flat[start:stop])
            out.append(views)
        return out

    def unpack(self, reduced_packs: Sequence[Any], reduced_singles: Sequence[Any] = (),
               *, copy: bool = False) -> list[Any]:
        """Rebuild the batch, in its original order and shapes, from the reduced buffers.

        A tensor that lies whole in one pack comes back as a reshaped view of that
        pack (a copy with ``copy=True``); a tensor split across packs is a new array;
        a single is the reduced single reshaped (a view where NumPy can). Results never
        share memory with each other. The dtype is the reduced buffers' dtype, which is
        the original one unless the reduction changed it (integer MEAN gives float64).

        Args:
            reduced_packs: one array per pack, each with that pack's element count.
            reduced_singles: one array per passthrough tensor, in ``passthrough`` order.
            copy: return new arrays instead of views into ``reduced_packs``.

        Returns:
            A list of ``num_tensors`` arrays in batch order.

        Raises:
            PackingError: the number of packs or singles, or a size, differs from the plan.
        """
        reduced_packs = list(reduced_packs)
        reduced_singles = list(reduced_singles)
        _check_count("reduced packs", reduced_packs, len(self.packs), "pack()")
        _check_count("reduced singles", reduced_singles, len(self.passthrough), "pack()")
        flats = []
        for k, (array, pack) in enumerate(zip(reduced_packs, self.packs)):
            if array.size != pack.size:
                raise PackingError(
                    f"reduced pack {k} has {array.size} elements, the plan's pack {k} has "
                    f"{pack.size}; pass the all-reduced packs in the order pack() returned them")
            flats.append(array.reshape(-1))
        results: list[Any] = [None] * len(self.specs)
        for j, (array, index) in enumerate(zip(reduced_singles, self.passthrough)):
            spec = self.specs[index]
            if array.size != spec.size:
                raise PackingError(
                    f"reduced single {j} (tensor {index}) has {array.size} elements, expected "
                    f"{spec.size} for shape {spec.shape}; pass the singles in passthrough order")
            out = array.reshape(spec.shape)
            results[index] = out.copy() if copy else out
        for index, k, offset, end, shape in self._whole:
            out = flats[k][offset:end].reshape(shape)
            results[index] = out.copy() if copy else out
        for index in self._split:
            pieces, spec = self._pieces[index], self.specs[index]
            out = np.empty_like(flats[pieces[0][0]], shape=(spec.size,))
            for k, m in pieces:
                out[m.start:m.start + m.size] = flats[k][m.offset:m.offset + m.size]
            results[index] = out.reshape(spec.shape)
        return results

    def _check_batch(self, arrays: list[Any]) -> None:
        _check_count("arrays", arrays, len(self.specs), "tensor_specs()")
        for index, (array, spec) in enumerate(zip(arrays, self.specs)):
            shape = getattr(array, "shape", None)
            dtype = getattr(array, "dtype", None)
            if shape is None or dtype is None:
                raise PackingTypeError(
                    f"tensor {index} is a {type(array).__name__}, not an array; pass NumPy "
                    f"or CuPy arrays")
            if tuple(shape) != spec.shape or np.dtype(dtype) != spec.dtype:
                raise PackingError(
                    f"tensor {index} has shape {tuple(shape)} and dtype {np.dtype(dtype)}, "
                    f"the plan expects {spec.shape} and {spec.dtype}; build a plan for this "
                    f"batch (plans are cached per batch structure)")


def tensor_specs(items: Iterable[Any]) -> tuple[TensorSpec, ...]:
    """Normalise a batch description to a tuple of :class:`TensorSpec`.

    Args:
        items: arrays (anything with ``.shape`` and ``.dtype``) or ``(shape, dtype)``
            pairs, in batch order.

    Returns:
        One ``TensorSpec`` per item, with a tuple-of-int shape and a ``numpy.dtype``.

    Raises:
        PackingError: the batch is empty, or a dimension is negative.
        PackingTypeError: an item is neither an array nor a ``(shape, dtype)`` pair.
    """
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        raise PackingTypeError(
            f"a batch must be a sequence of arrays or (shape, dtype) pairs, got {items!r}")
    specs = tuple(_tensor_spec(i, item) for i, item in enumerate(items))
    if not specs:
        raise PackingError(
            "the batch is empty (0 tensors): there is nothing to pack; pass at least one "
            "tensor, or skip the reduction")
    return specs


def flat_arrays(shapes: Iterable[Any], dtype: Any = np.float32) -> list[np.ndarray]:
    """Zeroed arrays of the given shapes, one after another in one NumPy array: gradient
    buffers that pack for free.

    A pack of such arrays (passed to ``batch_reduce`` or ``ReplicaContext.all_reduce`` in
    this order) is the one array they are views of, so it travels as one buffer instead
    of tensor by tensor, and one large allocation gets the kernel's huge pages, which
    separately allocated small arrays do not (reading 35 MiB of ResNet-50's gradients
    from small arrays cost 2–4 ms more per all-reduce here:
    docs/notes/batch-reduce-history.md). Compute each gradient into its array
    (``np.matmul(a, b, out=grads[0])``). For ``shm``, use :func:`mpistrat.shared_arrays`,
    the same in shared memory.
    """
    shapes = checked_shapes(shapes)
    return views_in_order(np.zeros(sum(math.prod(s) for s in shapes), dtype=dtype), shapes)


def checked_shapes(shapes: Iterable[Any]) -> list[tuple[int, ...]]:
    """``shapes`` as tuples of ints (an int is a 1-D shape).

    Raises:
        ValueError: a negative dimension.
    """
    out = [(int(s),) if np.ndim(s) == 0 else tuple(int(d) for d in s) for s in shapes]
    bad = [shape for shape in out if any(d < 0 for d in shape)]
    if bad:
        raise ValueError(f"negative dimensions are not allowed in shape {bad[0]}")
    return out


def views_in_order(flat: Any, shapes: Sequence[tuple[int, ...]]) -> list[Any]:
    """Views of ``flat`` with these shapes, one after another from its start."""
    out, at = [], 0
    for shape in shapes:
        size = math.prod(shape)
        out.append(flat[at:at + size].reshape(shape))
        at += size
    return out


def _tensor_spec(index: int, item: Any) -> TensorSpec:
    if hasattr(item, "shape") and hasattr(item, "dtype"):
        shape, dtype = item.shape, item.dtype
    elif isinstance(item, (tuple, list)) and len(item) == 2:
        shape, dtype = item
    else:
        raise PackingTypeError(
            f"tensor {index} is {item!r}; expected an array or a (shape, dtype) pair")
    try:
        dims = tuple(operator.index(d) for d in shape)
    except TypeError:
        raise PackingTypeError(
            f"tensor {index} has shape {shape!r}; expected a sequence of ints such as "
            f"(3, 3) or () for a scalar") from None
    if any(d < 0 for d in dims):
        raise PackingError(f"tensor {index} has shape {dims} with a negative dimension")
    if dtype is None:
        raise PackingTypeError(f"tensor {index} has dtype None; give a dtype such as 'float32'")
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise PackingTypeError(
            f"tensor {index} has dtype {dtype!r}, which NumPy does not understand; give a "
            f"dtype such as 'float32' or numpy.float16") from None
    return TensorSpec(dims, dtype)


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise PackingTypeError(f"{name} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise PackingTypeError(
            f"{name} must be an int, got {value!r} ({type(value).__name__})") from None


def _check_count(what: str, items: list, expected: int, source: str) -> None:
    if len(items) != expected:
        raise PackingError(
            f"got {len(items)} {what}, the plan expects {expected}; pass exactly what "
            f"{source} describes for this plan")


def _is_floating(dtype: np.dtype) -> bool:
    """Real floating dtypes, including ml_dtypes' (bfloat16 and float8 are kind 'V')."""
    return dtype.kind == "f" or (dtype.kind == "V" and dtype.name.startswith(("bfloat", "float")))


def _by_dtype(specs: tuple[TensorSpec, ...]) -> dict[np.dtype, list[int]]:
    groups: dict[np.dtype, list[int]] = {}
    for i, spec in enumerate(specs):
        groups.setdefault(spec.dtype, []).append(i)
    return groups


def _whole_pack(specs: tuple[TensorSpec, ...], indices: list[int]) -> Pack:
    members, offset = [], 0
    for i in indices:
        members.append(PackMember(i, specs[i].shape, offset, specs[i].size))
        offset += specs[i].size
    return Pack(specs[indices[0]].dtype, offset, tuple(members))


def _check_plan(specs: tuple[TensorSpec, ...], packs: tuple[Pack, ...],
                passthrough: tuple[int, ...]) -> dict[int, list[tuple[int, PackMember]]]:
    """Validate a plan; return each packed tensor's pieces ``(pack, member)`` by start."""
    n = len(specs)
    pieces: dict[int, list[tuple[int, PackMember]]] = {}
    for k, pack in enumerate(packs):
        if not isinstance(pack, Pack):
            raise PackingTypeError(f"pack {k} is {pack!r}; expected a Pack")
        used = 0
        for m in pack.members:
            if not 0 <= m.index < n:
                raise PackingError(f"pack {k} names tensor {m.index}; the batch has {n}")
            spec = specs[m.index]
            if spec.dtype != pack.dtype or m.shape != spec.shape:
                raise PackingError(
                    f"pack {k} ({pack.dtype}) holds tensor {m.index} as {m.shape}, but the "
                    f"tensor is {spec.shape} {spec.dtype}; a pack holds one dtype")
            if m.offset != used or m.size < 0 or not 0 <= m.start <= spec.size - m.size:
                raise PackingError(
                    f"pack {k}: member {m} overlaps, leaves a gap or runs past its tensor; "
                    f"members must tile the pack in layout order")
            used += m.size
            pieces.setdefault(m.index, []).append((k, m))
        if used != pack.size:
            raise PackingError(f"pack {k} has size {pack.size} but its members hold {used}")
    for i in passthrough:
        if not 0 <= i < n or i in pieces:
            raise PackingError(
                f"passthrough index {i} is out of range or also packed; the batch has {n} "
                f"tensors and each goes to exactly one place")
    if len(set(passthrough)) != len(passthrough):
        raise PackingError(f"passthrough {passthrough} lists a tensor twice")
    single = set(passthrough)
    for i in range(n):
        if i in pieces:
            own = sorted(pieces[i], key=lambda p: p[1].start)
            pieces[i] = own
            starts = [m.start for _, m in own]
            ends = [m.start + m.size for _, m in own]
            size = specs[i].size
            tiles = starts[0] == 0 and ends[-1] == size and starts[1:] == ends[:-1]
            if not tiles or (size > 0 and 0 in (m.size for _, m in own)) or (
                    size == 0 and len(own) != 1):
                raise PackingError(f"tensor {i} is not covered exactly once by its pieces")
        elif i not in single:
            raise PackingError(f"tensor {i} is in no pack and not in passthrough")
    return pieces
