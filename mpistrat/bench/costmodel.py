"""A two-level alpha-beta cost model per algorithm: fit it on sweeps, predict other jobs.

An all-reduce of ``n`` bytes on ``H`` hosts is a sequence of steps. A step whose
messages all stay inside hosts costs ``alpha_in`` per message and ``beta_in`` per byte
(shared memory); a step where some message crosses a host's link costs ``alpha_net``
per message and ``beta_net`` per byte **on the busiest link direction** (the messages
inside hosts that run at the same time hide behind it). Summed over the steps of an
algorithm's critical path::

    t = alpha_in * L_in + beta_in * B_in * n + alpha_net * L_net
        + beta_burst * min(x, b) + beta_net * max(0, x - b),    x = B_net * n

``L_in``/``L_net`` count messages (of the busiest rank, per step) and ``B_in``/``B_net``
bytes per byte of the buffer (inside hosts: the busiest rank's larger direction; across
hosts: the busiest link direction, so ``B_net`` counts every rank of a host whose
message crosses the link in the same step). ``b`` is the links' burst: the bytes a link
direction passes per call before its rate applies (a shaped link's token bucket that the
barrier between timed calls refills, buffers in NICs and switches); without one (``b =
0``) the last two terms are ``beta_net * B_net * n``. A transport may also send small
messages inline (below a size of its own, as libfabric's inject size; MPICH's
``ofi``/``tcp`` between ``bin/cluster-local`` hosts is cheaper up to 128 B): the
``L_inline`` of ``L_net`` messages of at most that many bytes count as ``1 - saving``
of one, both numbers one pair for the links like ``b``. :func:`terms` derives the counts
by laying each algorithm's messages out over the ranks' hosts, so any layout works
(uneven hosts, one host, virtual nodes). For ``H > 1`` hosts of ``k`` ranks, ``p = H k``,
in host-major order (the flat algorithms sort ranks by host):

* ``xring#s``: every one of its ``2(p-1)`` steps crosses links, one rank per link
  direction: ``L_net = 2(p-1)s``, ``B_net = 2(p-1)/p``.
* ``rechd``: the first ``lg k`` halving steps and the last ``lg k`` doubling steps stay
  inside hosts (``L_in = 2 lg k``, ``B_in = 2(k-1)/k``); the other ``2 lg H`` cross with
  all ``k`` ranks of a host on its link at once (``B_net = 2(H-1)/H``). At or below
  2 KiB: ``lg p`` steps of the whole buffer (``B_net = k lg H``).
* ``native``, as MPICH 5's default selection runs ``MPI_Allreduce``: on one host as
  ``rechd``; on several, its node-aware composition: a reduce onto each host's first
  rank and a broadcast back, together counted as ``rechd`` on ``k`` ranks, and between
  them the ``H`` leaders' reduce-scatter + allgather, one rank per link
  (``L_net = 2 lg H``, ``B_net = 2(H-1)/H``; recursive doubling at or below 8 bytes).
* ``pscpu#s``: gather and scatter overlap as one step; ``B_net`` is the most any host
  link carries one way, ``(g(p-k) + (s-g)k)/s`` for ``g`` pieces gathered on the host,
  but at least the two phases' busiest directions one after the other for the first of
  a piece's ``m`` messages (a message goes back once it has arrived whole):
  ``(G + S)/m + (m-1)/m max(G, S)`` (``pscpu#1`` on 2 x 2 at one message: 2 + 2);
  where they take turns, the gather in and the scatter out each pass their own
  direction's burst.
* ``a/b#s``: ``a``'s reduce onto the leader and a broadcast inside hosts, ``b#s`` over
  the ``H`` leaders across links (one rank per link). On several nodes with several
  ranks on some node and at least two :data:`~mpistrat.algorithms.hierarchical.
  PIPELINE_BYTES` pieces, the three stages run at once over ``m = ceil(n /
  PIPELINE_BYTES)`` pieces: the stages on one piece plus ``(m - 1)`` x the slowest.

On one host every step stays inside it and the counts are the classic single-level ones.

**Fitting.** Each algorithm's five numbers (all >= 0) are fitted on every point of the
sweeps given (each with its own layout) by least absolute relative error: every size
counts alike, and a few sizes disturbed by a busy machine do not drag the line (sweeps
of one layout merge first, each point the median of their medians). One layout cannot
tell the levels apart (``L_in`` and ``L_net`` are then constants): a parameter that no
sweep separates serves both levels (marked ``=``), and ``a/b#s``, measurable only
across nodes, takes its intra terms from ``a/b`` (marked ``*``). The documented recipe
is one sweep on one host (``k`` ranks: the intra terms) plus one across two hosts
(``2 x k``). The burst is one number for all algorithms, the one of :data:`BURSTS` (0
first) with the least total error (:func:`fit_sweeps`); then the inline size and saving
of :data:`INLINES`, the same way. Nothing here needs MPI.
"""

from __future__ import annotations

import itertools
import math
import statistics
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from .. import algorithms
from ..algorithms._chunks import gather_groups
from ..errors import UnknownAlgorithmError
from ..spec import format_bytes
from .files import read_json
from .report import format_us
from .results import Point

__all__ = ["Layout", "Terms", "Sweep", "Check", "Fit", "CostModel", "Prediction", "BURSTS",
           "INLINES",
           "terms",
           "fit_points", "fit", "fit_sweeps", "predict", "layout_from_meta",
           "model_for_run", "pipeline_pieces", "merge_repeats"]

_SHUFFLES = {"pscpu", "psgpu"}
_RINGS = {"xring", "nccl"}
_HALVING = {"rechd"}
_MPICH_LEADERS_SHORT = 8  # MPICH 5's recursive doubling among node leaders: at most 8 B
_MPICH_BCAST_SHORT = 12288  # MPICH's binomial broadcast below this many bytes
_GROUP_SAMPLES = 8  # shuffle gather groups averaged (rotation moves them each call)
_ITEMSIZE = 4  # the model's element size where an algorithm switches on element counts


def _lg(p: int) -> int:
    return max(p - 1, 0).bit_length()  # ceil(log2 p)


# ------------------------------------------------------------------ layouts


@dataclass(frozen=True)
class Layout:
    """Where a job's ranks run.

    Attributes:
        host_of_rank: the host index of every rank (MPI rank order); hosts are the
            units that share one link.
        node_of_rank: the node group of every rank for hierarchical algorithms (virtual
            nodes cut hosts further); None: one node group per host.
    """

    host_of_rank: tuple[int, ...]
    node_of_rank: tuple[int, ...] | None = None

    @classmethod
    def per_host(cls, ranks: int, ranks_per_host: int) -> Layout:
        """``ranks`` ranks, ``ranks_per_host`` per host in rank order (the last host
        takes the remainder)."""
        if ranks < 1 or ranks_per_host < 1:
            raise ValueError(f"a layout needs ranks and ranks per host >= 1, got {ranks} "
                             f"and {ranks_per_host}")
        return cls(tuple(r // ranks_per_host for r in range(ranks)))

    @classmethod
    def even(cls, ranks: int, hosts: int) -> Layout:
        """``ranks`` ranks spread over ``hosts`` hosts as evenly as blocks allow."""
        hosts = max(1, min(hosts, ranks))
        return cls.per_host(ranks, -(-ranks // hosts))

    @classmethod
    def from_counts(cls, counts: Sequence[int]) -> Layout:
        """Hosts holding ``counts[i]`` consecutive ranks each (``[3, 1]``: uneven)."""
        if not counts or min(counts) < 1:
            raise ValueError(f"every host needs at least one rank, got {list(counts)}")
        return cls(tuple(h for h, c in enumerate(counts) for _ in range(c)))

    @property
    def ranks(self) -> int:
        return len(self.host_of_rank)

    @property
    def hosts(self) -> int:
        return len(set(self.host_of_rank))

    @property
    def ranks_per_host(self) -> list[int]:
        counts: dict[int, int] = {}
        for h in self.host_of_rank:
            counts[h] = counts.get(h, 0) + 1
        return list(counts.values())

    @property
    def node_groups(self) -> list[list[int]]:
        """The ranks of each node group, groups ordered by their lowest rank."""
        nodes = self.node_of_rank or self.host_of_rank
        groups: dict[int, list[int]] = {}
        for rank, node in enumerate(nodes):
            groups.setdefault(node, []).append(rank)
        return list(groups.values())

    def describe(self) -> str:
        counts = self.ranks_per_host
        word = "host" if len(counts) == 1 else "hosts"
        text = (f"{len(counts)} {word} x {counts[0]}" if len(set(counts)) == 1
                else f"{len(counts)} hosts of {'+'.join(map(str, counts))}")
        if self.node_of_rank is not None and len(self.node_groups) != len(counts):
            text += f" ({len(self.node_groups)} virtual nodes)"
        return text

    def as_dict(self) -> dict[str, Any]:
        return {"host_of_rank": list(self.host_of_rank),
                "node_of_rank": None if self.node_of_rank is None else list(self.node_of_rank)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Layout:
        nodes = data.get("node_of_rank")
        return cls(tuple(data["host_of_rank"]), None if nodes is None else tuple(nodes))


def layout_from_meta(meta: Mapping[str, Any]) -> Layout:
    """The layout a sweep ran on, from its metadata: hosts by rank (their link), node
    groups (virtual ones cut each host's ranks into groups of ``k``); results without
    host names spread ``ranks`` evenly over ``nodes``."""
    ranks = int(meta.get("ranks", 1))
    names = meta.get("hostnames_by_rank") or []
    if len(names) != ranks:
        return Layout.even(ranks, int(meta.get("nodes", 1)))
    index: dict[str, int] = {}
    hosts = tuple(index.setdefault(h, len(index)) for h in names)
    virtual = meta.get("virtual_ranks_per_node")
    if not virtual:
        return Layout(hosts)
    seen: dict[int, int] = {}
    nodes: list[int] = []
    groups: dict[tuple[int, int], int] = {}
    for h in hosts:  # local rank on the host // k, numbered by first appearance
        local = seen[h] = seen.get(h, -1) + 1
        nodes.append(groups.setdefault((h, local // int(virtual)), len(groups)))
    return Layout(hosts, tuple(nodes))


# ------------------------------------------------------------------ terms


@dataclass(frozen=True)
class Terms:
    """The critical path of one call, per level: messages (``l_*``) and bytes per byte of
    the buffer (``b_*``); ``share``: the most ranks of one host whose messages cross its
    link in one step."""

    l_in: float = 0.0
    b_in: float = 0.0
    l_net: float = 0.0
    b_net: float = 0.0
    share: int = 0
    l_inline: float = 0.0  # of l_net: messages small enough to go inline
    directions: int = 1  # link directions one after the other, each with its own burst

    def __add__(self, other: Terms) -> Terms:
        return Terms(self.l_in + other.l_in, self.b_in + other.b_in,
                     self.l_net + other.l_net, self.b_net + other.b_net,
                     max(self.share, other.share), self.l_inline + other.l_inline,
                     max(self.directions, other.directions))

    def scaled(self, steps: float, volume: float) -> Terms:
        """Messages times ``steps``, bytes times ``volume``."""
        return Terms(self.l_in * steps, self.b_in * volume, self.l_net * steps,
                     self.b_net * volume, self.share, self.l_inline * steps,
                     self.directions)

    def features(self, nbytes: float, saving: float = 0.0) -> tuple[float, float, float, float]:
        """What multiplies (alpha_in, beta_in, alpha_net, beta_net); an inline message
        counts as ``1 - saving`` of one across links."""
        return (self.l_in, self.b_in * nbytes, self.l_net - saving * self.l_inline,
                self.b_net * nbytes)

    def time(self, params: Sequence[float], nbytes: float) -> float:
        return sum(x * f for x, f in zip(params, self.features(nbytes)))


def _step(transfers: Iterable[tuple[int, int, float, int]], hosts: Sequence[int],
          small: float = 0.0) -> Terms:
    """One step in which every ``(src, dst, fraction, messages)`` transfer runs at once
    (ranks index ``hosts``). It crosses links when any transfer does; then it costs the
    busiest link direction's bytes and the busiest rank's messages over links (inline
    ones if every message across is at most ``small`` of the buffer), else the busiest
    rank's bytes and messages inside its host."""
    sent: dict[int, float] = {}
    received: dict[int, float] = {}
    out_msgs: dict[int, int] = {}
    in_msgs: dict[int, int] = {}
    link_out: dict[int, float] = {}
    link_in: dict[int, float] = {}
    users: dict[tuple[int, int], set[int]] = {}
    net_out: dict[int, int] = {}
    net_in: dict[int, int] = {}
    large = small <= 0  # some message across links too large to go inline
    for src, dst, frac, msgs in transfers:
        if src == dst or frac < 0:
            continue
        sent[src] = sent.get(src, 0.0) + frac
        received[dst] = received.get(dst, 0.0) + frac
        out_msgs[src] = out_msgs.get(src, 0) + msgs
        in_msgs[dst] = in_msgs.get(dst, 0) + msgs
        a, b = hosts[src], hosts[dst]
        if a != b:
            link_out[a] = link_out.get(a, 0.0) + frac
            link_in[b] = link_in.get(b, 0.0) + frac
            users.setdefault((a, 0), set()).add(src)
            users.setdefault((b, 1), set()).add(dst)
            net_out[src] = net_out.get(src, 0) + msgs
            net_in[dst] = net_in.get(dst, 0) + msgs
            large = large or frac > small * msgs
    if link_out:
        l_net = max(max(net_out.values()), max(net_in.values()))
        return Terms(l_net=l_net,
                     b_net=max(max(link_out.values()), max(link_in.values())),
                     share=max(len(u) for u in users.values()),
                     l_inline=0.0 if large else l_net)
    if not sent:
        return Terms()
    return Terms(l_in=max(max(out_msgs.values()), max(in_msgs.values())),
                 b_in=max(max(sent.values()), max(received.values())))


def _host_major(hosts: Sequence[int]) -> list[int]:
    """The hosts of the ranks in host-major order (ranks sorted by host, stable)."""
    first: dict[int, int] = {}
    for rank, h in enumerate(hosts):
        first.setdefault(h, rank)
    return sorted(hosts, key=lambda h: first[h])


def _ring(hosts: Sequence[int], pipelines: int, small: float = 0.0) -> Terms:
    p = len(hosts)
    if p <= 1:
        return Terms()
    step = _step(((r, (r + 1) % p, 1 / p, pipelines) for r in range(p)), hosts, small)
    return step.scaled(2 * (p - 1), 2 * (p - 1))


def _halving_doubling(hosts: Sequence[int], nbytes: int, small: float = 0.0,
                      short: int | None = None) -> Terms:
    """rechd (and MPICH's reduce-scatter + allgather): fold the extra ranks in, halve and
    double among the largest power of two, fold out; recursive doubling of the whole
    buffer at or below ``short`` bytes (default rechd's ``SHORT_BYTES``) or when it has
    fewer elements than that power of two."""
    n = len(hosts)
    if n <= 1:
        return Terms()
    p = 1 << (n.bit_length() - 1)
    rem = n - p

    def real(new: int) -> int:
        return 2 * new + 1 if new < rem else new + rem

    total = Terms()
    if rem:
        total += _step(((2 * i, 2 * i + 1, 1.0, 1) for i in range(rem)), hosts, small)
    if short is None:
        short = getattr(sys.modules.get("mpistrat.algorithms.halving_doubling"),
                        "SHORT_BYTES", 2048)
    masks = [1 << i for i in range(p.bit_length() - 1)]
    if nbytes <= short or nbytes // _ITEMSIZE < p:
        for mask in masks:
            total += _step(((real(r), real(r ^ mask), 1.0, 1) for r in range(p)), hosts,
                           small)
    else:
        for i, mask in enumerate(masks):  # halving, then the doubling's mirror step
            total += _step(((real(r), real(r ^ mask), 0.5 ** (i + 1), 1)
                            for r in range(p)), hosts, small).scaled(2, 2)
    if rem:
        total += _step(((2 * i + 1, 2 * i, 1.0, 1) for i in range(rem)), hosts, small)
    return total


def _native(hosts: Sequence[int], nbytes: int, small: float = 0.0) -> Terms:
    """``MPI_Allreduce`` as MPICH 5's default selection runs it (commutative op): on one
    host its shared-memory all-reduce, counted as ``rechd``'s steps; on several, its
    node-aware composition: that all-reduce's reduce onto each host's first rank and its
    broadcast back (the same counts, on the largest host's ranks), and between them the
    leaders' all-reduce across links, one rank per host (reduce-scatter + allgather;
    recursive doubling at or below 8 bytes or with fewer elements than leaders)."""
    if len(set(hosts)) <= 1:
        return _halving_doubling(list(hosts), nbytes, small)
    counts: dict[int, int] = {}
    for h in hosts:
        counts[h] = counts.get(h, 0) + 1
    inside = _halving_doubling([0] * max(counts.values()), nbytes)
    return inside + _halving_doubling(list(counts), nbytes, small,
                                      short=_MPICH_LEADERS_SHORT)


def _serial(both: Terms, gather: float, scatter: float, messages: int) -> Terms:
    """``both`` (gather and scatter as one step) with its link bytes at least those of
    a gather rank that sends each message back only once it has all of it: the two
    phases' busiest link directions (``gather``, ``scatter``) one after the other for the
    first message of a piece's ``messages``, then overlapping. The gather comes in on
    the gather rank's link and the scatter goes out on it: where the two take turns,
    each direction passes its own burst."""
    if not both.l_net or messages < 1:
        return both
    serial = (gather + scatter) / messages + (messages - 1) / messages * max(gather, scatter)
    if serial <= both.b_net:
        return both
    return replace(both, b_net=serial, directions=2)


def _shuffle_group(hosts: Sequence[int], owners: Sequence[int],
                   destinations: Sequence[int] | None = None, messages: int = 0,
                   small: float = 0.0) -> Terms:
    """One shuffle: pieces to their gather ranks, reduced pieces back to
    ``destinations`` (every rank by default), gather and scatter as one step: the
    gather rank sends each message back as it is added. With ``messages`` (per piece),
    a message goes back only once it has arrived whole, so across links the scatter of
    a piece of one message waits for its gather (:func:`_serial`)."""
    p, s = len(hosts), len(owners)
    targets = range(p) if destinations is None else destinations
    frac = 1 / s
    gather: list[tuple[int, int, float, int]] = []
    scatter: list[tuple[int, int, float, int]] = []
    for owner in owners:
        gather += [(r, owner, frac, 1) for r in range(p) if r != owner]
        scatter += [(owner, d, frac, 1) for d in targets if d != owner]
    both = _step(gather + scatter, hosts, small)
    if not messages:
        return both
    return _serial(both, _step(gather, hosts).b_net, _step(scatter, hosts).b_net, messages)


def _shuffle_counted(hosts: Sequence[int], owners: Sequence[int], messages: int = 0,
                     small: float = 0.0) -> Terms:
    """:func:`_shuffle_group` for every rank as destination, counted per host instead
    of per message (large jobs: p x s messages)."""
    p, s = len(hosts), len(owners)
    per_host: dict[int, int] = {}
    for h in hosts:
        per_host[h] = per_host.get(h, 0) + 1
    pieces: dict[int, int] = {}
    for owner in owners:
        pieces[owner] = pieces.get(owner, 0) + 1
    if len(per_host) == 1:  # rank r: g(p-1)/s in and out for its pieces, (s-g)/s others
        held = [*pieces.values()] + [0] * (p > len(pieces))  # (0: a rank gathering none)
        g = max(pieces.values())
        return Terms(l_in=g * (p - 1) + (s - g),
                     b_in=max((g * (p - 1) + s - g) / s for g in held))
    on_host: dict[int, int] = {}
    for owner, g in pieces.items():
        on_host[hosts[owner]] = on_host.get(hosts[owner], 0) + g
    # host h's link, one way: its pieces' remote contributions (or results) and the
    # remote pieces' results for (or contributions from) its k ranks
    load = max((on_host.get(h, 0) * (p - k) + (s - on_host.get(h, 0)) * k) / s
               for h, k in per_host.items())
    count = max(pieces.get(r, 0) * (p - per_host[hosts[r]])
                + (s - on_host.get(hosts[r], 0)) for r in range(p))
    both = Terms(l_net=count, b_net=load, share=max(per_host.values()),
                 l_inline=count if 0 < 1 / s <= small else 0.0)
    if not messages:
        return both
    # each phase alone: into a host its pieces' remote contributions, out of it its
    # ranks' contributions to remote pieces (the scatter mirrors it)
    phase = max(max(on_host.get(h, 0) * (p - k), (s - on_host.get(h, 0)) * k) / s
                for h, k in per_host.items())
    return _serial(both, phase, phase, messages)


def _shuffle(hosts: Sequence[int], shards: int, nbytes: int | None = None,
             small: float = 0.0) -> Terms:
    """``pscpu#shards``; with ``nbytes``, a call on its own (each piece's first message
    gathered whole before it goes back, :func:`_serial`), without, a pipeline stage
    whose phases overlap those of the pieces before and after it."""
    p = len(hosts)
    if p <= 1:
        return Terms()
    groups = gather_groups(p, max(1, min(shards, p)))
    if len(groups) > _GROUP_SAMPLES:  # rotation walks the groups: a spread of them
        groups = [groups[i * len(groups) // _GROUP_SAMPLES] for i in range(_GROUP_SAMPLES)]
    piece_bytes = getattr(sys.modules.get("mpistrat.algorithms.shuffle"), "PIECE_BYTES",
                          4 << 20)
    messages = 0 if nbytes is None else \
        max(1, -(-nbytes // (len(groups[0]) * piece_bytes)))
    count = _shuffle_counted if p * len(groups[0]) > 4096 else _shuffle_group
    parts = [count(hosts, g, messages=messages, small=small) for g in groups]
    mean = sum(parts[1:], parts[0]).scaled(1 / len(parts), 1 / len(parts))
    return replace(mean, share=max(t.share for t in parts))


def _flat(alg: str, hosts: Sequence[int], shards: int, nbytes: int,
          alone: bool = True, inline: int = 0) -> Terms:
    """Terms of a flat algorithm on ranks with these hosts (in the communicator's
    order; all but ``native`` run host-major, ``native`` is MPICH's composition);
    ``alone``: a call of its own, not a stage of a pipeline; messages across links of
    at most ``inline`` bytes go inline."""
    if alg == "shm":
        k = len(hosts)
        if len(set(hosts)) > 1:
            raise KeyError("shm across hosts")
        return Terms(l_in=2.0, b_in=2 * (k - 1) / k) if k > 1 else Terms()
    small = inline / nbytes if inline > 0 and nbytes > 0 else 0.0  # of the buffer
    if alg == "native":
        return _native(hosts, nbytes, small)
    order = _host_major(hosts)
    if alg in _RINGS:
        return _ring(order, shards if alg == "xring" else 1, small)
    if alg in _HALVING:
        return _halving_doubling(order, nbytes, small)
    if alg in _SHUFFLES:
        return _shuffle(order, shards, nbytes if alone else None, small)
    raise KeyError(alg)


def _reduce_to_leader(alg: str, k: int, nbytes: int) -> Terms:
    """Stage 1 of ``a/b`` on a node of ``k`` ranks (inside one host)."""
    if k <= 1:
        return Terms()
    if alg == "shm":
        return Terms(l_in=2.0, b_in=2 * (k - 1) / k)
    if alg in _SHUFFLES:  # every rank gathers a piece, then sends it to the root only
        return _shuffle_group([0] * k, list(range(k)), [0])
    return _flat(alg, [0] * k, 1, nbytes)  # the all-reduce stands in


def _broadcast(alg: str, k: int, nbytes: int) -> Terms:
    """Stage 3 of ``a/b``: shared memory (``shm``), else MPICH's broadcast (binomial
    below 12 KiB, scatter + ring allgather above)."""
    if k <= 1:
        return Terms()
    if alg == "shm":
        return Terms(l_in=2.0, b_in=1.0)
    if nbytes < _MPICH_BCAST_SHORT:
        return Terms(l_in=_lg(k), b_in=_lg(k))
    return Terms(l_in=_lg(k) + k - 1, b_in=2 * (k - 1) / k)


def _stages(info: Any, shards: int, layout: Layout, nbytes: int,
            alone: bool = True, inline: int = 0) -> list[Terms]:
    """The stages of ``a/b`` at ``nbytes`` bytes (one stage on a single node);
    ``alone``: not pipelined."""
    groups = layout.node_groups
    k = max(len(g) for g in groups)
    hosts = layout.host_of_rank
    if len(groups) == 1:
        if k == 1:
            return [Terms()]
        node_hosts = [hosts[r] for r in groups[0]]
        return [_flat(info.intra, node_hosts,
                      k if info.intra in _SHUFFLES else 1, nbytes)]
    leaders = [hosts[g[0]] for g in groups]
    return [_reduce_to_leader(info.intra, k, nbytes),
            _flat(info.inter, leaders, shards, nbytes, alone, inline),
            _broadcast(info.intra, k, nbytes)]


def pipeline_pieces(alg: str, layout: Layout, nbytes: int) -> int:
    """How many pieces ``a/b`` pipelines ``nbytes`` in on ``layout`` (1: it does not)."""
    # (the package's name `hierarchical` is the function; the constant is the module's)
    piece = getattr(sys.modules.get("mpistrat.algorithms.hierarchical"), "PIPELINE_BYTES",
                    None)
    info = algorithms.get(alg)
    if not (info.hierarchical and piece) or info.needs_gpu:
        return 1
    nodes = len(layout.node_groups)
    if nodes <= 1 or layout.ranks <= nodes or nbytes < 2 * piece:
        return 1
    return -(-nbytes // piece)


def terms(alg: str, shards: int, layout: Layout | int, nbytes: int = 1 << 20, *,
          params: Sequence[float] | None = None, nodes: int | None = None,
          inline: int = 0) -> Terms:
    """The critical path of ``alg#shards`` for ``nbytes`` bytes on ``layout`` (or a
    rank count, spread evenly over ``nodes`` hosts).

    For pipelined ``a/b`` the slowest stage on one piece (in the stream, where a
    shuffle's gather and scatter overlap those of the pieces around it) counts ``m - 1``
    more times after the first piece's stages;
    ``params`` (alpha_in, beta_in, alpha_net, beta_net) decide which stage is slowest
    (without them: the stage with the most bytes across links, else the most bytes).

    Raises:
        KeyError: the algorithm has no model (e.g. one registered by a plugin).
    """
    if isinstance(layout, int):
        layout = Layout.even(layout, nodes or 1)
    try:
        info = algorithms.get(alg)
    except UnknownAlgorithmError:
        raise KeyError(alg) from None
    if layout.ranks <= 1:
        return Terms()
    if not info.hierarchical:
        return _flat(alg, layout.host_of_rank, shards, nbytes, inline=inline)
    pieces = pipeline_pieces(alg, layout, nbytes)
    stages = _stages(info, shards, layout, -(-nbytes // pieces), inline=inline)
    if pieces == 1:
        return sum(stages[1:], stages[0])
    # the first piece runs its stages as a call of its own; in the stream of pieces
    # after it each stage overlaps its neighbours' (a shuffle's gather and scatter)
    piece = [s.scaled(1, 1 / pieces) for s in stages]
    steady = piece if info.inter not in _SHUFFLES else \
        [s.scaled(1, 1 / pieces) for s in
         _stages(info, shards, layout, -(-nbytes // pieces), alone=False, inline=inline)]
    if params is None:
        slowest = max(steady, key=lambda s: (s.b_net, s.l_net, s.b_in, s.l_in))
    else:
        slowest = max(steady, key=lambda s: s.time(params, nbytes))
    return sum(piece[1:], piece[0]) + slowest.scaled(pieces - 1, pieces - 1)


# ------------------------------------------------------------------ fitting


def fit_points(sizes: Sequence[int], times: Sequence[float], *,
               robust: bool = False) -> tuple[float, float]:
    """``(a, b)`` >= 0 minimising the sum of ``((a + b n) / t - 1)^2`` over the points
    (with ``robust``: of ``|(a + b n) / t - 1|``, as the cost model fits)."""
    if len(sizes) != len(times) or not sizes:
        raise ValueError("fit_points needs as many sizes as times, at least one")
    a, b = _nnls([(1.0, float(n)) for n in sizes], times, robust=robust)
    return a, b


def _nnls(rows: Sequence[Sequence[float]], times: Sequence[float],
          known: Sequence[float] | None = None, *, robust: bool = True) -> list[float]:
    """``x >= 0`` minimising the relative errors ``(row . x + known) / t - 1`` (``known``:
    seconds already accounted for, default none): their sum of absolute values when
    ``robust`` (iteratively reweighted, so a few sizes disturbed by a busy machine do not
    drag the line), else their sum of squares."""
    a = np.array([[f / t for f in row] for row, t in zip(rows, times)], dtype=float)
    y = np.array([1 - c / t for c, t in zip(known or [0.0] * len(times), times)])
    scale = np.where(np.abs(a).max(axis=0) > 0, np.abs(a).max(axis=0), 1.0)
    a = a / scale
    x = _nonnegative_lstsq(a, y)
    for _ in range(30 if robust else 0):
        # weights 1/sqrt(|error|) turn squares into absolute values (errors under 1 %
        # count as 1 %, which keeps the weights finite and the iteration stable)
        w = 1 / np.sqrt(np.maximum(np.abs(a @ x - y), 0.01))
        new = _nonnegative_lstsq(a * w[:, None], y * w)
        if np.allclose(new, x, rtol=1e-9, atol=1e-15):
            break
        x = new
    return list(x / scale)


def _nonnegative_lstsq(a: Any, y: Any) -> Any:
    """The ``x >= 0`` minimising ``|a x - y|^2``: the best of the unconstrained solutions
    on every support that come out non-negative (exact for this model's few columns)."""
    cols = a.shape[1]
    x, *_ = np.linalg.lstsq(a, y, rcond=None)
    if np.all(x * np.abs(a).max(axis=0) > 1e-9):
        return x  # the unconstrained optimum is positive (not zero by rounding): the answer
    best, best_loss = np.zeros(cols), float(np.sum(y ** 2))  # all zero
    for size in range(1, cols + 1):
        for support in itertools.combinations(range(cols), size):
            sub = a[:, support]
            if not np.any(sub):
                continue
            x, *_ = np.linalg.lstsq(sub, y, rcond=None)
            if np.any(x < 0):
                continue
            loss = float(np.sum((sub @ x - y) ** 2))
            if loss < best_loss - 1e-12 * max(1.0, best_loss):
                best = np.zeros(cols)
                best[list(support)] = x
                best_loss = loss
    return best


def _separates(pairs: Sequence[tuple[float, float]]) -> bool:
    """Whether points with these (intra, net) coefficients tell the two apart: both
    appear, and not always in the same proportion."""
    if not any(a for a, _ in pairs) or not any(b for _, b in pairs):
        return False
    norms = [math.hypot(a, b) for a, b in pairs]
    unit = [(a / n, b / n) for (a, b), n in zip(pairs, norms) if n > 0]
    return any(abs(u[0] * v[1] - u[1] * v[0]) > 1e-6 for u, v in zip(unit, unit[1:]))


@dataclass(frozen=True)
class Sweep:
    """Measured points and the layout they were measured on (``name``: where they come
    from, e.g. a file name)."""

    points: tuple[Point, ...]
    layout: Layout
    name: str = ""


@dataclass(frozen=True)
class Check:
    """One measured point against the fitted model."""

    layout: str
    nbytes: int
    measured: float
    model: float

    @property
    def error(self) -> float:
        return (self.model - self.measured) / self.measured


@dataclass(frozen=True)
class Fit:
    """The fitted two-level model of one algorithm and its error on the measured points.

    ``shared`` names the parameters no sweep could separate by level ("alpha", "beta"):
    their intra and net values are one fitted number; ``intra_from`` names the entry
    (same algorithm, other shards) whose intra values this one uses instead."""

    label: str
    alg: str
    shards: int
    alpha_in: float  # seconds per message inside a host
    beta_in: float  # seconds per byte inside a host
    alpha_net: float  # seconds per message of a step that crosses links
    beta_net: float  # seconds per byte on the busiest link direction
    shared: tuple[str, ...] = ()
    checks: tuple[Check, ...] = ()
    intra_from: str | None = None  # the entry whose alpha_in/beta_in this one took
    beta_burst: float = 0.0  # seconds per byte of a call's first `burst` bytes on a link
    burst: float = 0.0  # bytes a link direction passes per call before beta_net applies
    inline: int = 0  # bytes: a message across links of at most this many goes inline
    inline_saving: float = 0.0  # the part of alpha_net an inline message does not cost

    @property
    def params(self) -> tuple[float, float, float, float]:
        return (self.alpha_in, self.beta_in, self.alpha_net, self.beta_net)

    def terms(self, nbytes: int, layout: Layout) -> Terms:
        return terms(self.alg, self.shards, layout, nbytes, params=self.params,
                     inline=self.inline)

    def parts(self, nbytes: int, layout: Layout) -> tuple[float, float, float, float]:
        """Seconds per term: intra messages, intra bytes, net messages, net bytes (the
        bytes within the link's burst at ``beta_burst``, the rest at ``beta_net``)."""
        return self.parts_of(self.terms(nbytes, layout), nbytes)

    def parts_of(self, t: Terms, nbytes: int) -> tuple[float, float, float, float]:
        """:meth:`parts` of the terms ``t`` of an ``nbytes`` call."""
        l_in, b_in, l_net, b_net = t.features(nbytes, self.inline_saving)
        within, beyond = _split_burst(b_net, self.burst * t.directions)
        return (self.alpha_in * l_in, self.beta_in * b_in, self.alpha_net * l_net,
                self.beta_burst * within + self.beta_net * beyond)

    def time(self, nbytes: int, layout: Layout | int, nodes: int | None = None) -> float:
        if isinstance(layout, int):
            layout = Layout.even(layout, nodes or 1)
        return sum(self.parts(nbytes, layout))

    def errors(self, layout: str | None = None) -> list[float]:
        return [abs(c.error) for c in self.checks if layout in (None, c.layout)]

    @property
    def median_error(self) -> float:
        return statistics.median(self.errors()) if self.checks else math.nan

    @property
    def max_error(self) -> float:
        return max(self.errors()) if self.checks else math.nan

    def formula(self, layout: Layout, nbytes: int) -> str:
        """The model at ``nbytes`` on ``layout`` with its numbers written in."""
        t = self.terms(nbytes, layout)
        parts = []
        if t.l_in or t.b_in:
            parts.append(f"{t.l_in:g} x {_us(self.alpha_in)} + {t.b_in:.4g} n x "
                         f"{_ns(self.beta_in)} inside hosts")
        if t.l_net or t.b_net:
            net = f"{t.b_net:.4g} n x {_ns(self.beta_net)}"
            if self.burst > 0:  # (each direction taking turns passes its own)
                burst = format_bytes(int(self.burst * t.directions))
                net = (f"min(x, {burst}) x {_ns(self.beta_burst)} + max(0, x - {burst}) x "
                       f"{_ns(self.beta_net)} with x = {t.b_net:.4g} n")
            msgs = f"{t.l_net:g} x {_us(self.alpha_net)}"
            if t.l_inline and self.inline_saving:
                msgs = (f"({t.l_net:g} - {self.inline_saving:g} x {t.l_inline:g} inline) x "
                        f"{_us(self.alpha_net)}")
            parts.append(f"{msgs} + {net} across links "
                         f"({t.share} rank(s) of a host on its link at once)")
        return "t = " + (" + ".join(parts) if parts else "0 (nothing to exchange)")

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.label, "alg": self.alg, "shards": self.shards,
                "alpha_in_s": self.alpha_in, "beta_in_s_per_byte": self.beta_in,
                "alpha_net_s": self.alpha_net, "beta_net_s_per_byte": self.beta_net,
                "beta_burst_s_per_byte": self.beta_burst, "link_burst_bytes": self.burst,
                "inline_bytes": self.inline, "inline_saving": self.inline_saving,
                "shared": list(self.shared), "intra_from": self.intra_from,
                "median_rel_error": self.median_error,
                "max_rel_error": self.max_error, "points": len(self.checks),
                "checks": [{"layout": c.layout, "nbytes": c.nbytes, "measured_s": c.measured,
                            "model_s": c.model} for c in self.checks]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Fit:
        return cls(data["label"], data["alg"], int(data["shards"]), data["alpha_in_s"],
                   data["beta_in_s_per_byte"], data["alpha_net_s"],
                   data["beta_net_s_per_byte"], tuple(data.get("shared", ())),
                   intra_from=data.get("intra_from"),
                   beta_burst=float(data.get("beta_burst_s_per_byte", 0.0)),
                   burst=float(data.get("link_burst_bytes", 0.0)),
                   inline=int(data.get("inline_bytes", 0)),
                   inline_saving=float(data.get("inline_saving", 0.0)))


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.3g} us"


def _ns(seconds: float) -> str:
    return f"{seconds * 1e9:.3g} ns/B"


def _split_burst(net_bytes: float, burst: float) -> tuple[float, float]:
    """A call's bytes on the busiest link direction within the link's burst, and beyond."""
    return min(net_bytes, burst), max(0.0, net_bytes - burst)


def _fit_group(label: str, alg: str, shards: int,
               group: Sequence[tuple[Point, Layout, str]],
               intra: Fit | None = None, burst: float = 0.0,
               inline: tuple[int, float] = (0, 0.0)) -> Fit:
    """Fit one algorithm's points (each with its layout), non-negative, on absolute
    relative errors (:func:`_nnls`), sharing a parameter between levels where the points cannot
    separate it, or taking alpha_in and beta_in from ``intra`` (the same stages inside
    hosts, fitted on more layouts); with a ``burst``, the bytes of a call within it get
    their own ``beta_burst``; with ``inline`` (bytes, saving), a message across links of
    at most that many bytes counts as ``1 - saving`` of one. Pipelined points are
    refitted until their slowest stage is stable."""
    sizes = [p.nbytes for p, _, _ in group]
    times = [p.median for p, _, _ in group]
    params: Sequence[float] | None = None
    shared: tuple[str, ...] = ()
    beta_burst = 0.0
    feats: list[tuple[float, float, float, float]] = []
    for _ in range(6):
        moved = [terms(alg, shards, lay, n, params=params, inline=inline[0])
                 for n, (_, lay, _) in zip(sizes, group)]
        previous, feats = feats, [t.features(n, inline[1]) for t, n in zip(moved, sizes)]
        if feats == previous:  # the same slowest stages: the same fit
            break
        # (within the burst, beyond it): the last feature split in two
        split = [_split_burst(f[3], burst * t.directions) for f, t in zip(feats, moved)]
        if intra is not None:
            known = [intra.alpha_in * f[0] + intra.beta_in * f[1] for f in feats]
            rows = [[f[2], beyond, within] for f, (within, beyond) in zip(feats, split)]
            x = _nnls([r[:3 if burst else 2] for r in rows], times, known)
            new = [intra.alpha_in, intra.beta_in, x[0], x[1]]
            new_burst = x[2] if burst else 0.0
        else:
            # one layout never separates the levels (what differs between its sizes,
            # short messages or pipelining, is too small or too noisy to carry a level)
            several = len({lay for _, lay, _ in group}) > 1
            shared = tuple(name for name, i in (("alpha", 0), ("beta", 1))
                           if not (several and _separates([(f[i], f[i + 2]) for f in feats])))
            # (which params a column sets, how to read it from features + split); the
            # bytes within the burst are a fifth parameter (index 4), never shared
            columns: list[tuple[tuple[int, ...], Callable[..., float]]] = []
            net = (lambda f, s: f[2], lambda f, s: s[1])  # alpha_net, beta_net beyond
            for name, i in (("alpha", 0), ("beta", 1)):
                if name in shared:
                    columns.append(((i, i + 2), lambda f, s, i=i: f[i] + net[i](f, s)))
                else:
                    columns += [((i,), lambda f, s, i=i: f[i]),
                                ((i + 2,), lambda f, s, i=i: net[i](f, s))]
            if burst:
                columns.append(((4,), lambda f, s: s[0]))
            x = _nnls([[read(f, sp) for _, read in columns] for f, sp in zip(feats, split)],
                      times)
            values = [0.0] * 5
            for (targets, _), value in zip(columns, x):
                for j in targets:
                    values[j] = value
            new, new_burst = values[:4], values[4]
        if params is not None and math.isclose(beta_burst, new_burst, rel_tol=1e-9,
                                               abs_tol=1e-18) and all(
                math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-18) for a, b in zip(params, new)):
            break
        params, beta_burst = new, new_burst
    assert params is not None
    fitted = Fit(label, alg, shards, *params,  # type: ignore[misc, arg-type]  # 4 floats
                 shared=shared, intra_from=intra.label if intra is not None else None,
                 beta_burst=beta_burst, burst=burst, inline=inline[0],
                 inline_saving=inline[1])
    checks = tuple(Check(name, n, t, fitted.time(n, lay))
                   for n, t, (_, lay, name) in zip(sizes, times, group))
    return replace(fitted, checks=checks)


# the link bursts tried: none, then 16 KiB .. 4 MiB (x2)
BURSTS = (0, *(1 << k for k in range(14, 23)))
# the inline sends tried (largest message in bytes, the part of alpha_net it saves)
# after the burst: none, then 64 B .. 1 KiB (x2) saving a quarter, half or three quarters
INLINES = ((0, 0.0), *((1 << k, saving) for k in range(6, 11) for saving in (0.25, 0.5, 0.75)))


def fit_sweeps(sweeps: Sequence[Sweep], bursts: Sequence[int] | None = None,
               inlines: Sequence[tuple[int, float]] | None = None) -> CostModel:
    """Fit every single-algorithm entry over all ``sweeps`` together (only correct
    points count; an algorithm is fitted on the sweeps that measured it).

    Across hosts a link may pass a call's first bytes faster than its rate (a shaped
    link's token bucket, a NIC's or switch's buffers, TCP windows that the barrier
    between calls lets drain): each burst of ``bursts`` (default :data:`BURSTS` where
    some sweep spans several hosts, else none) is tried for every algorithm at once,
    and the one with the least total relative error is kept, so a link without one
    fits as the plain model (burst 0).

    Likewise a transport may send a message of up to some bytes inline (with the
    request, no completion to wait for, as libfabric's inject size allows), which costs
    less than another message: with the burst chosen, each ``(bytes, saving)`` of ``inlines``
    (default :data:`INLINES` across hosts) is tried, and kept where it lowers the total
    error."""
    by_label: dict[str, list[tuple[Point, Layout, str]]] = {}
    for sweep in sweeps:
        name = sweep.layout.describe()
        for p in sweep.points:
            if p.kind == "algorithm" and p.correct and p.median > 0:
                by_label.setdefault(p.label, []).append((p, sweep.layout, name))
    groups, skipped = {}, []
    for label, group in by_label.items():
        alg, shards = group[0][0].alg or label, group[0][0].shards
        try:
            moved = [terms(alg, shards, lay, p.nbytes) for p, lay, _ in group]
        except KeyError:
            skipped.append(f"{label} (no model for {alg!r} on this layout)")
            continue
        keep = [g for g, t in zip(group, moved) if t.features(1.0) != (0, 0, 0, 0)]
        if not keep:
            skipped.append(f"{label} (nothing crosses ranks at "
                           f"{group[0][1].ranks} rank(s))")
            continue
        groups[label] = (alg, shards, keep)
    across = any(s.layout.hosts > 1 for s in sweeps)
    if bursts is None:
        bursts = BURSTS if across else (0,)
    if inlines is None:
        inlines = INLINES if across else ((0, 0.0),)
    best: tuple[float, list[Fit]] | None = None
    chosen = 0.0
    # every burst without inline sends, then every inline size with the burst chosen
    tries: list[tuple[float | None, tuple[int, float]]] = [(float(b), (0, 0.0))
                                                           for b in bursts]
    tries += [(None, inline) for inline in inlines if inline[0] > 0]
    for burst, inline in tries:
        fits = _fit_all(groups, chosen if burst is None else burst, inline)
        errors = [abs(c.error) for f in fits for c in f.checks]
        # a larger burst, or an inline size, must do better by more than rounding (an
        # exact fit stays at the plain model)
        if best is None or sum(errors) < best[0] - 1e-6 * len(errors):
            best = (sum(errors), fits)
            chosen = chosen if burst is None else burst
    return CostModel(tuple(best[1]) if best else (), tuple(skipped), _named_layouts(sweeps))


def _fit_all(groups: Mapping[str, tuple[str, int, list[tuple[Point, Layout, str]]]],
             burst: float, inline: tuple[int, float] = (0, 0.0)) -> list[Fit]:
    """:func:`fit_sweeps` with one link burst and one inline size."""
    fits = [_fit_group(label, alg, shards, keep, burst=burst, inline=inline)
            for label, (alg, shards, keep) in groups.items()]
    # an entry measured only across hosts (a/b#2: shards need several nodes) takes the
    # terms inside hosts from the same algorithm with another shard count, fitted on
    # more layouts: the stages inside hosts do not depend on the shards
    separated: dict[str, Fit] = {}
    for f in fits:
        best = separated.get(f.alg)
        if not f.shared and (best is None or len(f.checks) > len(best.checks)):
            separated[f.alg] = f
    for i, f in enumerate(fits):
        sibling = separated.get(f.alg)
        if f.shared and sibling is not None and sibling is not f:
            fits[i] = _fit_group(f.label, f.alg, f.shards, groups[f.label][2], intra=sibling,
                                 burst=burst, inline=inline)
    return fits


def _named_layouts(sweeps: Sequence[Sweep]) -> tuple[tuple[Layout, str], ...]:
    return tuple(dict.fromkeys((s.layout, s.name) for s in sweeps))


def merge_repeats(sweeps: Sequence[Sweep]) -> list[Sweep]:
    """Sweeps of the same layout as one: each (entry, size) timed as the median of the
    sweeps' medians (repeats taken at different times even out a busy machine)."""
    groups: dict[Layout, list[Sweep]] = {}
    for sweep in sweeps:
        groups.setdefault(sweep.layout, []).append(sweep)
    out = []
    for layout, group in groups.items():
        if len(group) == 1:
            out.append(group[0])
            continue
        medians: dict[tuple[str, int], list[Point]] = {}
        for sweep in group:
            for p in sweep.points:
                if p.kind == "algorithm" and p.correct and p.median > 0:
                    medians.setdefault((p.label, p.nbytes), []).append(p)
        points = tuple(replace(ps[0], samples=tuple(p.median for p in ps),
                               per_rank_median=())
                       for ps in medians.values())
        names = [s.name for s in group if s.name]
        out.append(Sweep(points, layout, ", ".join(names) if len(names) == len(group)
                         else f"{len(group)} sweeps"))
    return out


def fit(points: Sequence[Point], ranks: int, nodes: int, *,
        layout: Layout | None = None, more: Sequence[Sweep] = ()) -> CostModel:
    """Fit a sweep measured on ``ranks`` ranks over ``nodes`` hosts (or on ``layout``),
    together with ``more`` sweeps (other layouts: what separates the two levels)."""
    layout = layout or Layout.even(ranks, nodes)
    return fit_sweeps([Sweep(tuple(points), layout), *more])


# ------------------------------------------------------------------ the model


@dataclass(frozen=True)
class CostModel:
    """Fits of every modelled algorithm, what could not be modelled, and the layouts of
    the sweeps it was fitted on (or checked against) with where those came from; a
    fit's checks name their layout (:meth:`Layout.describe`)."""

    fits: tuple[Fit, ...]
    skipped: tuple[str, ...] = ()
    layouts: tuple[tuple[Layout, str], ...] = ()
    source: str = ""  # where a loaded model came from (--model-from)

    @property
    def ranks(self) -> int:
        return max((lay.ranks for lay, _ in self.layouts), default=1)

    @property
    def nodes(self) -> int:
        return max((lay.hosts for lay, _ in self.layouts), default=1)

    @property
    def burst(self) -> float:
        """The link burst of the fit in bytes (0: none; one value serves every fit)."""
        return max((f.burst for f in self.fits), default=0.0)

    @property
    def inline(self) -> tuple[int, float]:
        """The largest message across links that goes inline, in bytes, and the part of
        alpha_net it saves ((0, 0.0): none; one value serves every fit)."""
        return max(((f.inline, f.inline_saving) for f in self.fits), default=(0, 0.0))

    def lines(self) -> list[str]:
        where = "; ".join(lay.describe() + (f" ({name})" if name else "")
                          for lay, name in self.layouts) or "?"
        how = (f"saved in {self.source}, checked against the medians of: {where}"
               if self.source else f"fitted on the medians of: {where}")
        burst = self.burst
        if burst:
            net = (f"b_burst*min(x, {format_bytes(int(burst))}) + b_net*max(0, x - "
                   f"{format_bytes(int(burst))}) with x = B_net*n (the link's burst: "
                   f"the least error of those tried; twice that where a shuffle's gather "
                   f"and scatter take turns on the link, each direction passing its own)")
        else:
            net = "b_net*B_net*n"
        size, saving = self.inline
        msgs = "a_net*L_net"
        if size:
            msgs = (f"a_net*(L_net - {saving:g}*L_inline) (L_inline: the messages of at most "
                    f"{format_bytes(size)}, which go inline: the least error of those tried)")
        out = [f"# Cost model t = a_in*L_in + b_in*B_in*n + {msgs} + {net} "
               f"(inside hosts / across links), {how}"]
        names = list(dict.fromkeys(lay.describe() for lay, _ in self.layouts))
        rows = [("algorithm", "a_in(us)", "b_in(ns/B)", "a_net(us)",
                 *(("b_burst(ns/B)",) if burst else ()), "b_net(ns/B)",
                 "1/b_net(MB/s)", *(f"err {n}" for n in names), "points")]
        for f in self.fits:
            errs = []
            for n in names:
                e = f.errors(n)
                errs.append(f"{statistics.median(e):.0%}/{max(e):.0%}" if e else "-")
            mark = {n: "=" if n in f.shared else "*" if f.intra_from else ""
                    for n in ("alpha", "beta")}
            rows.append((f.label, f"{f.alpha_in * 1e6:.2f}" + mark["alpha"],
                         f"{f.beta_in * 1e9:.4g}" + mark["beta"],
                         f"{f.alpha_net * 1e6:.2f}",
                         *((f"{f.beta_burst * 1e9:.4g}",) if burst else ()),
                         f"{f.beta_net * 1e9:.4g}",
                         f"{1 / f.beta_net / 1e6:.4g}" if f.beta_net > 0 else "inf",
                         *errs, str(len(f.checks))))
        out += _table(rows, left=1)
        out.append("#   err: median/max of |model - measured| / measured on that sweep's "
                   "points; '=': no sweep separates the levels, one value serves both")
        borrowed = [f"{f.label} from {f.intra_from}" for f in self.fits if f.intra_from]
        if borrowed:
            out.append("#   '*': inside-host terms of the same algorithm with other shards "
                       f"({', '.join(borrowed)})")
        out += [f"# not modelled: {s}" for s in self.skipped]
        return out

    def error_lines(self, layout_name: str | None = None) -> list[str]:
        """Signed error (model / measured - 1) per size and algorithm on one sweep's
        points (default: the sweep with the most hosts)."""
        if layout_name is None:
            if not self.layouts:
                return []
            layout = max((lay for lay, _ in self.layouts), key=lambda x: (x.hosts, x.ranks))
            layout_name = layout.describe()
        table: dict[int, dict[str, float]] = {}
        for f in self.fits:
            for c in f.checks:
                if c.layout == layout_name:
                    table.setdefault(c.nbytes, {})[f.label] = c.error
        if not table:
            return []
        labels = [f.label for f in self.fits if any(c.layout == layout_name for c in f.checks)]
        rows = [("size", *labels)]
        for nbytes in sorted(table):
            rows.append((format_bytes(nbytes),
                         *(f"{table[nbytes][lb]:+.0%}" if lb in table[nbytes] else "-"
                           for lb in labels)))
        return [f"# Model error per size on {layout_name} (model / measured - 1)",
                *_table(rows)]

    def checked_against(self, sweeps: Sequence[Sweep]) -> CostModel:
        """This model's fits with their errors on the points of ``sweeps`` instead
        (validation sweeps: nothing is refitted)."""
        by_label = {f.label: f for f in self.fits}
        checks: dict[str, list[Check]] = {}
        missing: list[str] = []
        for sweep in sweeps:
            name = sweep.layout.describe()
            for p in sweep.points:
                if p.kind != "algorithm" or not p.correct or p.median <= 0:
                    continue
                f = by_label.get(p.label)
                if f is None:
                    if p.label not in missing:
                        missing.append(p.label)
                    continue
                try:
                    model = f.time(p.nbytes, sweep.layout)
                except KeyError:
                    continue
                checks.setdefault(p.label, []).append(Check(name, p.nbytes, p.median, model))
        fits = tuple(replace(by_label[label], checks=tuple(c)) for label, c in checks.items())
        skipped = tuple(f"{lb} (not in the model from {self.source or 'the given file'})"
                        for lb in missing)
        return CostModel(fits, skipped, _named_layouts(sweeps), self.source)

    def as_dict(self) -> dict[str, Any]:
        return {"model": "two-level alpha-beta",
                "layouts": [{"name": name, **lay.as_dict(), "describe": lay.describe()}
                            for lay, name in self.layouts],
                "fits": [f.as_dict() for f in self.fits], "skipped": list(self.skipped)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "") -> CostModel:
        """A model saved by :meth:`as_dict` (``cost_model`` of a ``--json`` file)."""
        if data.get("model") != "two-level alpha-beta":
            raise ValueError(f"{source or 'the file'} has no two-level cost model (written "
                             f"by an older mpistrat: refit it with --from-json FILE --model)")
        layouts = tuple((Layout.from_dict(x), x["name"]) for x in data.get("layouts", []))
        return cls(tuple(Fit.from_dict(f) for f in data["fits"]),
                   tuple(data.get("skipped", [])), layouts, source)


def _table(rows: Sequence[Sequence[str]], left: int = 0) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["#   " + "  ".join(c.ljust(w) if i < left else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in rows]


# ------------------------------------------------------------------ prediction


@dataclass(frozen=True)
class Prediction:
    """Predicted times (seconds) per size and algorithm for another job, with each
    algorithm's four terms."""

    ranks: int
    ranks_per_node: int
    nodes: int
    sizes: tuple[int, ...]
    times: dict[str, tuple[float, ...]]
    parts: dict[str, tuple[tuple[float, ...], ...]] = field(default_factory=dict)  # 4 per size
    formulas: dict[str, str] = field(default_factory=dict)
    terms: dict[str, tuple[Terms, ...]] = field(default_factory=dict)
    burst: float = 0.0  # the fitted link burst in bytes (net bytes within it cost less)
    inline: tuple[int, float] = (0, 0.0)  # messages inline across links: bytes, saving

    def best(self) -> list[str]:
        return [min(self.times, key=lambda label: self.times[label][i])
                for i in range(len(self.sizes))]

    def header(self) -> str:
        layout = Layout.per_host(self.ranks, self.ranks_per_node)
        return (f"# Predicted time (us) at {self.ranks} ranks, {self.ranks_per_node} per host "
                f"({layout.describe()}), every link like the measured ones"
                + (f" (burst {format_bytes(int(self.burst))} per call)" if self.burst else "")
                + (f" (messages of at most {format_bytes(self.inline[0])} inline)"
                   if self.inline[0] else ""))

    def lines(self, detail: bool = True) -> list[str]:
        labels = list(self.times)
        out = [self.header()]
        rows = [["size", *labels, "best"]]
        for i, (size, best) in enumerate(zip(self.sizes, self.best())):
            rows.append([format_bytes(size), *(format_us(self.times[lb][i]) for lb in labels),
                         best])
        out += _table(rows)
        if detail:
            for label in labels:
                out += self.algorithm_lines(label)
        return out

    def algorithm_lines(self, label: str) -> list[str]:
        """One algorithm's model written out: its formula at the largest size, then per
        size the four terms (L and B, and the microseconds each costs)."""
        if label not in self.parts:
            return []
        out = [f"# {label}: {self.formulas.get(label, '')}  (at {format_bytes(self.sizes[-1])})"]
        rows: list[tuple[str, ...]] = [("size", "L_in", "B_in", "L_net", "B_net", "a_in*L_in",
                                        "b_in*B_in*n",
                                        "a_net*L_net" if not self.inline[1]
                                        else "a_net*(L_net-s*L_inline)",
                                        "b_net*B_net*n" if not self.burst else "net bytes",
                                        "total(us)", "net share")]
        for i, size in enumerate(self.sizes):
            t = self.terms[label][i]
            parts = self.parts[label][i]
            total = sum(parts)
            rows.append((format_bytes(size), f"{t.l_in:g}", f"{t.b_in:.3g}", f"{t.l_net:g}",
                         f"{t.b_net:.3g}", *(format_us(x) for x in parts), format_us(total),
                         f"{(parts[2] + parts[3]) / total:.0%}" if total > 0 else "-"))
        return out + _table(rows)

    def as_dict(self) -> dict[str, Any]:
        return {"ranks": self.ranks, "ranks_per_node": self.ranks_per_node,
                "nodes": self.nodes, "sizes": list(self.sizes),
                "times_s": {k: list(v) for k, v in self.times.items()}, "best": self.best(),
                "formulas": dict(self.formulas), "link_burst_bytes": self.burst,
                "inline_bytes": self.inline[0], "inline_saving": self.inline[1],
                "parts_s": {k: [list(x) for x in v] for k, v in self.parts.items()},
                "terms": {k: [[t.l_in, t.b_in, t.l_net, t.b_net, t.share] for t in v]
                          for k, v in self.terms.items()}}


def predict(model: CostModel, ranks: int, ranks_per_node: int,
            sizes: Sequence[int]) -> Prediction:
    """Predict every fitted algorithm at ``ranks`` ranks, ``ranks_per_node`` per host
    (hosts of consecutive ranks, the last one taking the remainder).

    Raises:
        ValueError: ranks or ranks_per_node below 1, no sizes, or nothing fitted.
    """
    if ranks < 1 or ranks_per_node < 1:
        raise ValueError(f"--predict-ranks and ranks per node must be >= 1, got {ranks} "
                         f"and {ranks_per_node}")
    if not sizes:
        raise ValueError("predict needs at least one size")
    if not model.fits:
        raise ValueError("the cost model has no fitted algorithm to predict with (a sweep "
                         "on one rank moves nothing; measure on 2 or more ranks)")
    per_node = min(ranks_per_node, ranks)
    layout = Layout.per_host(ranks, per_node)
    sizes = tuple(sizes)
    times, formulas, all_terms = {}, {}, {}
    parts: dict[str, tuple[tuple[float, ...], ...]] = {}
    for f in model.fits:
        try:
            layers = [f.terms(n, layout) for n in sizes]
        except KeyError:  # (shm across hosts: a single-node algorithm)
            continue
        parts[f.label] = tuple(f.parts_of(t, n) for t, n in zip(layers, sizes))
        times[f.label] = tuple(sum(p) for p in parts[f.label])
        formulas[f.label] = f.formula(layout, sizes[-1])
        all_terms[f.label] = tuple(layers)
    if not times:
        raise ValueError(f"no fitted algorithm runs on {layout.describe()} (shm needs one host)")
    return Prediction(ranks, per_node, layout.hosts, sizes, times, parts, formulas,
                      all_terms, model.burst, model.inline)


# ------------------------------------------------------------------ a run's model


def _sweep_from_file(path: str) -> tuple[Sweep, dict[str, Any]]:
    meta, points, document = read_json(path)
    layout = layout_from_meta(meta)
    return Sweep(tuple(points), layout, Path(path).name), document


def model_for_run(meta: Mapping[str, Any], points: Sequence[Point], *,
                  model_with: Sequence[str] = (), model_from: str | None = None) -> CostModel:
    """The cost model of a run: fitted on its points and the sweeps in the
    ``model_with`` files (sweeps of one layout merged: median of their medians), or
    (``model_from``) the model saved in that file with its errors on those points.

    Raises:
        ValueError: a file is not an ``mpistrat bench`` result or has no usable model.
    """
    layout = layout_from_meta(meta)
    this = Sweep(tuple(points), layout, "this sweep" if model_with or model_from else "")
    sweeps = merge_repeats([this, *(_sweep_from_file(path)[0] for path in model_with)])
    if model_from:
        _, document = _sweep_from_file(model_from)
        saved = document.get("cost_model")
        if not saved:
            raise ValueError(f"{model_from} holds no cost model; give a --json file of a "
                             f"run with --model (or --from-json it with --model --json)")
        return CostModel.from_dict(saved, Path(model_from).name).checked_against(sweeps)
    return fit_sweeps(sweeps)
