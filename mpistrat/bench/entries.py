"""What a sweep measures: algorithms (with shard counts), whole specs and peers.

Choosing the entries is pure: it needs the job's :class:`~mpistrat.layout.Layout`
(ranks, replicas, nodes), which every rank knows alike, so every rank picks the same
entries or raises the same error.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

from .. import algorithms
from ..algorithms.registry import Shards
from ..layout import Layout, check_spec
from ..spec import MAX_SHARDS, AllReduceSpec, parse_spec
from .peers import BACKENDS

__all__ = ["Entry", "select_entries", "BASELINE", "TORCH", "TORCH_ENTRIES"]

BASELINE = "native"
TORCH = "torch-gloo"
TORCH_ENTRIES = tuple(f"torch-{backend}" for backend in BACKENDS)
"""``--compare torch``'s entries: torch.distributed over gloo and over the "mpistrat"
backend (the second is left out, with a note, where that backend cannot be made)."""

_DEFAULT_SHARDS = {Shards.PIPELINES: (1, 2), Shards.GATHER_RANKS: (1, 2, None),
                   Shards.IGNORED: (1,)}


@dataclass(frozen=True)
class Entry:
    """One thing a sweep times at every size.

    Attributes:
        label: the name in tables and files (``xring#2``, ``spec:rechd:1M:xring``,
            ``torch-gloo``, ``torch-mpistrat``).
        kind: ``"algorithm"`` (one registered algorithm), ``"spec"`` (a whole spec,
            each size routed to its entry) or ``"torch"`` (torch.distributed over the
            backend its label names).
        alg, shards: the algorithm of an ``"algorithm"`` entry.
        spec: the spec of a ``"spec"`` entry.
    """

    label: str
    kind: str
    alg: str | None = None
    shards: int = 1
    spec: AllReduceSpec | None = None

    def route(self, nbytes: int) -> tuple[str, int]:
        """The (algorithm, shards) that reduces a buffer of ``nbytes`` bytes."""
        if self.kind == "algorithm":
            return self.alg, self.shards  # type: ignore[return-value]
        if self.kind == "spec":
            entry = self.spec.route(nbytes)  # type: ignore[union-attr]
            return entry.alg, entry.shards
        raise ValueError(f"entry {self.label!r} is not an mpistrat algorithm or spec")

    @property
    def recommendable(self) -> bool:
        """True for single algorithms: the candidates of ``--recommend``."""
        return self.kind == "algorithm"


def _label(alg: str, shards: int) -> str:
    return alg if shards == 1 else f"{alg}#{shards}"


def _algorithm(alg: str, shards: int) -> Entry:
    return Entry(_label(alg, shards), "algorithm", alg, shards)


def _one_entry(token: str) -> tuple[str, int, bool]:
    """``alg`` or ``alg#shards`` → (alg, shards, shards given)."""
    spec = parse_spec(token)
    if len(spec) != 1:
        raise ValueError(f"--algorithms entry {token!r} is a spec with {len(spec)} entries; "
                         f"give one algorithm[#shards] per comma, or measure it with --spec")
    alg, shards, _limit = spec[0]
    return alg, shards, "#" in token


def _shard_values(alg: str, wanted: Sequence[int | None], layout: Layout,
                  notes: list[str]) -> list[int]:
    info = algorithms.get(alg)
    if info.shards is Shards.IGNORED:
        return [1]
    if info.hierarchical and layout.nodes == 1:
        return [1]  # shards apply to the cross-node stage, which one node skips
    pool = layout.pool_size(info.pool) if info.pool is not None else None
    values: list[int] = []
    for value in wanted:
        if value is None:
            if pool is None:
                continue  # "all" means nothing for ring pipelines
            value = min(pool, MAX_SHARDS)
            if pool > MAX_SHARDS:
                assert info.pool is not None  # (pool is its size)
                notes.append(f"{_label(alg, value)}: 'all' of its pool ({pool} "
                             f"{info.pool.value}) stops at {MAX_SHARDS} shards, the most a "
                             f"spec entry takes")
        if pool is not None and value > pool:
            assert info.pool is not None  # (pool is its size)
            notes.append(f"{_label(alg, value)} skipped: its pool ({info.pool.value}) has "
                         f"{pool} member(s) on {layout.describe()}")
            continue
        if value not in values:
            values.append(value)
    return values


def _fits_nodes(info: algorithms.AlgorithmInfo, layout: Layout) -> bool:
    """Whether a default sweep measures ``info`` on this layout: not a single-node algorithm
    across nodes, and not its hierarchical forms on one node (only their intra stage
    would run: the flat algorithm plus a broadcast)."""
    if info.single_node:
        return layout.nodes == 1
    if info.hierarchical and algorithms.get(cast(str, info.intra)).single_node:
        return layout.nodes > 1
    return True


def select_entries(layout: Layout, names: Sequence[str] | None = None,
                   shards: Sequence[int | None] | None = None, specs: Iterable[str] = (),
                   compare: Iterable[str] = ()) -> tuple[list[Entry], list[str]]:
    """The entries of a sweep, ``native`` first, and notes for the user.

    Args:
        layout: the job's ranks, replicas per rank, GPUs or not, and nodes.
        names: algorithm names with optional ``#shards``; None for every algorithm that
            can run on this layout (GPU algorithms need GPU replicas).
        shards: shard counts for every algorithm that takes shards and was named without
            ``#`` (None in it: the whole gather pool). Default: 1 and 2 ring pipelines;
            1, 2 and every rank of the pool for shuffles. Counts a pool cannot hold are
            skipped with a note.
        specs: whole specs, measured as one entry each.
        compare: peers (``"torch"``: one entry per backend, :data:`TORCH_ENTRIES`).

    Raises:
        ValueError: an unknown name (with "did you mean"), a GPU algorithm without GPUs,
            an explicit shard count that does not fit the layout.
    """
    notes: list[str] = []
    entries: list[Entry] = []

    def add(entry: Entry) -> None:
        if entry not in entries:
            entries.append(entry)

    if names is None:
        candidates = [(name, 1, False) for name in algorithms.names()
                      if not specs and (layout.gpus or not algorithms.get(name).needs_gpu)
                      and _fits_nodes(algorithms.get(name), layout)]
        skipped = [name for name in algorithms.names() if algorithms.get(name).needs_gpu]
        if candidates and skipped and not layout.gpus:
            notes.append(f"GPU algorithms not measured (CPU replicas): {', '.join(skipped)}")
        one_node = [name for name in algorithms.names() if algorithms.get(name).single_node]
        if candidates and one_node and layout.nodes > 1:
            notes.append(f"single-node algorithms not measured ({layout.nodes} nodes; their "
                         f"hierarchical forms are): {', '.join(one_node)}")
    else:
        candidates = [_one_entry(token) for token in names]
        if not candidates:
            raise ValueError("--algorithms is empty; give names such as xring,rechd,native")
    for alg, count, explicit in candidates:
        info = algorithms.get(alg)
        if explicit or (names is not None and shards is None):
            values = [count]
        else:
            values = _shard_values(alg, shards if shards is not None
                                   else _DEFAULT_SHARDS[info.shards], layout, notes)
        for value in values:
            if info.shards is Shards.IGNORED and value != 1:
                notes.append(f"{alg} ignores shards: measured {alg} instead of {alg}#{value}")
                value = 1
            for finding in check_spec([(alg, value)], layout):
                if finding.level == "error":
                    raise ValueError(finding.message)
                if finding.entry is not None:
                    notes.append(finding.message.replace("entry 0 ", "", 1))
            add(_algorithm(alg, value))
    baseline = _algorithm(BASELINE, 1)
    entries = [baseline] + [e for e in entries if e != baseline]
    for text in specs:
        spec = parse_spec(text)
        for finding in check_spec(spec, layout):
            if finding.level == "error":
                raise ValueError(f"--spec {text!r}: {finding.message}")
        add(Entry(f"spec:{spec}", "spec", spec=spec))
    for peer in compare:
        if peer != "torch":
            raise ValueError(f"--compare knows 'torch', got {peer!r}")
        for label in TORCH_ENTRIES:
            add(Entry(label, "torch"))
    return entries, list(dict.fromkeys(notes))
