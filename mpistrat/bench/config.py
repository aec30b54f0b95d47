"""The options of a benchmark run, parsed and checked before MPI starts.

Every rank parses the same command line, so every check here reaches the same verdict
on every rank: a mistake is one clean error, never a rank waiting for another.
Nothing here imports ``mpi4py.MPI``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import numpy as np

from ..ops import ReduceOp
from ..spec import MAX_SHARDS, format_bytes, parse_bytes

__all__ = [
    "BenchConfig", "BatchConfig", "sizes", "resolve_dtype", "parse_byte_count",
    "parse_int_list", "parse_shards_list", "parse_agg", "KiB", "MiB", "MAX_SIZES",
]

KiB, MiB = 1 << 10, 1 << 20

#: ``--shards`` token meaning "every gather rank of the algorithm's pool".
ALL_SHARDS = "all"

MAX_SIZES = 4096
"""The most sizes one sweep measures: each takes about ``--time-per-point`` seconds per
algorithm (1 s by default), so 4096 sizes are hours already; ``-b 1K -e 1M -i 1K`` (1024
sizes) fits."""


def parse_byte_count(text: str, what: str) -> int:
    """A byte count >= 1 with K/M/G/T suffixes (powers of two), as nccl-tests takes them.

    Raises:
        ValueError: the text is not such a count; the message names ``what``.
    """
    try:
        value = parse_bytes(text)
    except ValueError:
        value = None
    if value is None or value < 1:
        raise ValueError(f"{what} must be a byte count >= 1 with an optional K/M/G suffix "
                         f"(powers of two, e.g. 8, 32K, 256M), got {text!r}")
    return value


def parse_int_list(text: str, what: str, minimum: int = 1,
                   maximum: int | None = None) -> tuple[int, ...]:
    """A comma list of distinct integers from ``minimum`` to ``maximum`` (``"1,2,4"``), in
    the given order."""
    values: list[int] = []
    for token in (t.strip() for t in text.split(",")):
        if not token:
            continue
        if len(token) > 18 and token.lstrip("+-").isdigit():  # (int() refuses > 4300 digits)
            raise ValueError(f"{what} value {token[:18]}... ({len(token)} digits) is too "
                             f"large; give integers from {minimum} to "
                             f"{maximum if maximum is not None else 'a few thousand'}")
        try:
            value = int(token)
        except ValueError:
            raise ValueError(f"{what} takes a comma list of integers >= {minimum}, got "
                             f"{token!r} in {text!r}") from None
        if value < minimum:
            raise ValueError(f"{what} values must be >= {minimum}, got {value} in {text!r}")
        if maximum is not None and value > maximum:
            raise ValueError(f"{what} values must be at most {maximum}, got {value} in "
                             f"{text!r}")
        if value not in values:
            values.append(value)
    return tuple(values)


def parse_shards_list(text: str) -> tuple[int | None, ...]:
    """``--shards``: integers from 1 to ``MAX_SHARDS`` (1024) and ``all`` (None: every
    gather rank of the pool, at most ``MAX_SHARDS``)."""
    values: list[int | None] = []
    for token in (t.strip() for t in text.split(",")):
        if not token:
            continue
        value = None if token.lower() == ALL_SHARDS else \
            parse_int_list(token, "--shards", maximum=MAX_SHARDS)[0]
        if value not in values:
            values.append(value)
    if not values:
        raise ValueError(f"--shards needs at least one value (e.g. 1,2,{ALL_SHARDS}), got "
                         f"{text!r}")
    return tuple(values)


def parse_agg(text: str) -> tuple[int, int]:
    """``--agg-small-grads BYTES:GROUP`` (``64K:16``); ``0`` turns the row off → (0, 0)."""
    if text.strip() == "0":
        return 0, 0
    head, sep, tail = text.partition(":")
    try:
        group = int(tail) if sep else 0
    except ValueError:
        group = 0
    if not sep or group < 1:
        raise ValueError(f"--agg-small-grads takes BYTES:GROUP (e.g. 64K:16: tensors of at "
                         f"most 64 KiB packed in groups of at most 16) or 0, got {text!r}")
    return parse_byte_count(head, "--agg-small-grads BYTES"), group


def resolve_dtype(name: str) -> np.dtype:
    """The NumPy dtype called ``name``: a numeric type, or ``bfloat16`` (needs ml_dtypes).

    Raises:
        ValueError: unknown or non-numeric type, or bfloat16 without ml_dtypes.
    """
    if name.strip().lower() == "bfloat16":
        try:
            import ml_dtypes  # optional: only bfloat16 needs it
        except ImportError:
            raise ValueError("dtype bfloat16 needs the ml_dtypes package: pip install "
                             "ml_dtypes") from None
        return np.dtype(ml_dtypes.bfloat16)
    aliases = {"float": "float32", "half": "float16", "double": "float64"}
    try:
        dtype = np.dtype(aliases.get(name.strip().lower(), name.strip()))
    except TypeError:
        raise ValueError(f"unknown dtype {name!r}; expected a numeric NumPy type such as "
                         f"float32, float64, float16, int32, int64, uint8 or bfloat16") from None
    if dtype.kind not in "fiuc":
        raise ValueError(f"dtype {name!r} is not numeric; expected float, int, uint or "
                         f"complex (e.g. float32)")
    return dtype


def sizes(minbytes: int, maxbytes: int, stepfactor: int | None = None,
          stepbytes: int | None = None) -> list[int]:
    """The sizes of a sweep, as nccl-tests walks them: from ``minbytes`` to ``maxbytes``
    (inclusive), multiplying by ``stepfactor``, or else adding ``stepbytes``.

    Raises:
        ValueError: ``maxbytes < minbytes``, both or neither step given, a factor < 2, a
            step < 1, or more than :data:`MAX_SIZES` sizes (counted before the list is
            built: ``-i 1 -e 1G`` would be a billion).
    """
    if maxbytes < minbytes:
        raise ValueError(f"--maxbytes ({format_bytes(maxbytes)}) is below --minbytes "
                         f"({format_bytes(minbytes)}); give -e >= -b")
    if (stepfactor is None) == (stepbytes is None):
        raise ValueError("give exactly one of --stepfactor (-f) and --stepbytes (-i)")
    if stepfactor is not None and stepfactor < 2:
        raise ValueError(f"--stepfactor must be at least 2, got {stepfactor}")
    if stepbytes is not None and stepbytes < 1:
        raise ValueError(f"--stepbytes must be at least 1, got {stepbytes}")
    if stepbytes is not None and (maxbytes - minbytes) // stepbytes + 1 > MAX_SIZES:
        count = (maxbytes - minbytes) // stepbytes + 1
        fewest = -(-(maxbytes - minbytes) // (MAX_SIZES - 1))
        raise ValueError(f"--stepbytes {stepbytes} from {format_bytes(minbytes)} to "
                         f"{format_bytes(maxbytes)} gives {count} sizes, more than the "
                         f"{MAX_SIZES} a sweep measures; give -i {fewest} or more, a "
                         f"narrower -b/-e range, or step by a factor (-f)")
    out, size = [], minbytes
    while size <= maxbytes:
        out.append(size)
        size = size * stepfactor if stepfactor is not None else size + cast(int, stepbytes)
    return out


def _check_compare(compare: tuple[str, ...], replicas: int) -> None:
    """``--compare``: known peers, one replica per rank."""
    unknown = [c for c in compare if c != "torch"]
    if unknown:
        raise ValueError(f"--compare knows 'torch' (torch.distributed over gloo and over "
                         f"the 'mpistrat' backend), got {', '.join(map(repr, unknown))}")
    if compare and replicas > 1:
        raise ValueError(f"--compare torch measures one buffer per rank, got {replicas} "
                         f"replicas per rank; leave out --local-replicas/--gpus-per-rank")


@dataclass(frozen=True)
class BenchConfig:
    """What to measure and how; built by the CLI (or a script) from its options.

    Attributes:
        algorithms: names with optional ``#shards`` (``("xring", "pscpu#2")``); None for
            every algorithm usable here.
        shards: shard counts applied to algorithms that take shards (None in the tuple:
            every gather rank of the pool); None for the default choice.
        specs: whole specs to measure, each as one entry routed by size.
        minbytes, maxbytes, stepfactor, stepbytes: the sizes (see :func:`sizes`).
        dtype: NumPy dtype name; op: ``sum``, ``mean``, ``min`` or ``max``.
        warmup, iters: fixed counts per size; None for adaptive counts that aim at
            ``time_per_point`` seconds of measured time per (size, algorithm), within
            ``[min_iters, max_iters]``.
        check_every: verify every iteration's result, not only one checked iteration.
        local_replicas, gpus_per_rank: replicas per rank (G); the bus factor counts
            ``ranks * G`` participants, as nccl-tests counts processes x GPUs.
        ranks_per_node: virtual node size for hierarchical algorithms.
        shared: allocate the buffers with :func:`mpistrat.shared_empty`, so ``shm``
            reads them in place (its zero-copy mode); host buffers only.
        compare: peers to measure beside mpistrat (``("torch",)``: torch.distributed over
            gloo and over the "mpistrat" backend).
        quiet: no progress output.
    """

    algorithms: tuple[str, ...] | None = None
    shards: tuple[int | None, ...] | None = None
    specs: tuple[str, ...] = ()
    minbytes: int = 4
    maxbytes: int = 64 * MiB
    stepfactor: int | None = 4
    stepbytes: int | None = None
    dtype: str = "float32"
    op: str = "sum"
    warmup: int | None = None
    iters: int | None = None
    time_per_point: float = 1.0
    min_iters: int = 5
    max_iters: int = 1000
    check_every: bool = False
    local_replicas: int = 1
    gpus_per_rank: int = 0
    ranks_per_node: int | None = None
    shared: bool = False
    compare: tuple[str, ...] = ()
    quiet: bool = False

    def __post_init__(self) -> None:
        self.sizes()  # raises on a bad range
        np_dtype = self.np_dtype
        op = self.reduce_op
        if np_dtype.kind == "c" and op.primitive in (ReduceOp.MIN, ReduceOp.MAX):
            raise ValueError(f"--op {op.name.lower()} is not defined for complex dtype "
                             f"{np_dtype}; use sum or mean")
        if op is ReduceOp.MEAN and np_dtype.kind in "iu":
            raise ValueError(f"--op mean of integer dtype {np_dtype} returns float64 in "
                             f"mpistrat (a new array, not in place); benchmark mean with a "
                             f"float dtype, or use sum")
        if not (self.time_per_point > 0 and math.isfinite(self.time_per_point)):
            raise ValueError(f"--time-per-point must be a number of seconds > 0, got "
                             f"{self.time_per_point}")
        if self.min_iters > self.max_iters:
            raise ValueError(f"--min-iters ({self.min_iters}) exceeds --max-iters "
                             f"({self.max_iters})")
        if self.local_replicas > 1 and self.gpus_per_rank:
            raise ValueError("--local-replicas and --gpus-per-rank exclude each other: a "
                             "rank has CPU replicas or GPUs")
        if self.shared and self.gpus_per_rank:
            raise ValueError("--shared allocates host buffers in shared memory; it does not "
                             "apply with --gpus-per-rank")
        _check_compare(self.compare, self.replicas_per_rank)

    @property
    def np_dtype(self) -> np.dtype:
        return resolve_dtype(self.dtype)

    @property
    def reduce_op(self) -> ReduceOp:
        return ReduceOp.parse(self.op)

    @property
    def replicas_per_rank(self) -> int:
        """G: the replicas each rank contributes (GPUs, or CPU replicas)."""
        return self.gpus_per_rank or self.local_replicas

    def sizes(self) -> list[int]:
        """The swept sizes that hold at least one element, rounded down to whole elements."""
        itemsize = resolve_dtype(self.dtype).itemsize
        out: list[int] = []
        for size in sizes(self.minbytes, self.maxbytes, self.stepfactor, self.stepbytes):
            whole = size // itemsize * itemsize
            # the sizes ascend, so a size rounded onto one already kept is the last kept
            if whole and (not out or whole != out[-1]):
                out.append(whole)
        if not out:
            raise ValueError(f"no size in [{format_bytes(self.minbytes)}, "
                             f"{format_bytes(self.maxbytes)}] holds one {self.dtype} element "
                             f"({itemsize} B); raise --maxbytes")
        return out


@dataclass(frozen=True)
class BatchConfig:
    """A ``--batch`` run: one gradient batch reduced several ways.

    Attributes:
        shapes: the tensors' shapes; name: where they came from (``resnet50``, a file).
        spec: the all-reduce spec of ``MultiWorkerAllReduce`` (any spec form).
        num_packs: one ``batch_reduce num_packs=P`` row per value.
        agg_bytes, agg_group: the small-tensor aggregation row (0, 0: no such row).
        shared: the "tensors in one buffer" row keeps them in shared memory
            (:func:`mpistrat.shared_arrays`), so ``shm`` reads them in place.
        compare: peers to time on the same batch (``("torch",)``: torch.distributed
            over gloo and over the "mpistrat" backend, per tensor, coalesced and flat;
            one replica per rank).
        dtype, local_replicas, warmup, iters, check_every, quiet: as in BenchConfig
            (fixed counts; the batch is one size).
    """

    shapes: tuple[tuple[int, ...], ...]
    name: str = "resnet50"
    spec: str = "rechd"
    num_packs: tuple[int, ...] = (1, 2, 4)
    agg_bytes: int = 64 * KiB
    agg_group: int = 16
    shared: bool = False
    dtype: str = "float32"
    local_replicas: int = 1
    warmup: int = 3
    iters: int = 20
    check_every: bool = False
    compare: tuple[str, ...] = ()
    quiet: bool = False

    def __post_init__(self) -> None:
        if not self.shapes:
            raise ValueError(f"the batch {self.name!r} has no tensors")
        resolve_dtype(self.dtype)
        _check_compare(self.compare, self.local_replicas)

    @property
    def np_dtype(self) -> np.dtype:
        return resolve_dtype(self.dtype)
