"""Hierarchical ``a/b`` all-reduce: ``a`` inside each node group, ``b`` across node leaders,
then a broadcast inside each node.

Steps: (1) the ranks of each node group reduce onto their leader (local rank 0) with
``a``'s reduce-to-root when it has one (``pscpu``: each local rank gathers one piece and
sends it to the leader), else with ``a``'s all-reduce; (2) the leaders all-reduce with
``b`` over the cross-node communicator, ``shards`` applying to this stage; (3) each
leader broadcasts the result to its node group. Any pair of algorithms composes. With one
rank per node this is TensorFlow's "within a worker, then across workers". All ranks end
bitwise identical: the leaders hold identical results after ``b`` and everyone else
receives a copy.

On a single node there is no stage (2) (TensorFlow skips it for one worker too), and
(1) + (3) are one all-reduce by ``a`` over the node: ``pscpu/pscpu`` on one node runs
``pscpu`` with every rank gathering one piece. That moves less than a reduce onto the
leader followed by a broadcast (2 ranks: each sends half and gets half back, instead of
also sending its reduced half to the leader and receiving the whole result).

Across several nodes with several ranks on some node, host buffers of at least two
:data:`PIPELINE_BYTES` pieces are **pipelined**: the buffer is cut into pieces of about
that size and the three stages run at once, each in its own thread on its own
communicator — while piece ``k`` is all-reduced across nodes, the node reduces piece
``k + 1`` and broadcasts piece ``k - 1``. The cross-node stage is the one on the network,
so the node stages hide behind it: the call takes about the cross-node time plus one
piece's node stages, instead of the three stages' sum. And the pieces take turns among a
node's ranks: piece ``i`` is reduced onto local rank ``i mod m`` (``m`` the fewest ranks
any node has), which all-reduces it with the same local rank of the other nodes and
broadcasts it, so all ``m`` ranks of a node drive the network at once (the bytes on a
node's link stay those of one leader; the network stack's work per byte is spread over
``m`` cores, which is what limits a fast link). Every piece goes through the same steps as
the whole buffer would, so the results stay bitwise identical on every rank. Whether to
pipeline depends only on values every rank shares (the buffer's size, the node layout),
so all ranks cut the same pieces.

Under :mod:`mpistrat.trace` the stages are phases of the collective: ``node stage``
(``step`` reduce, broadcast, or all_reduce on one node) and ``cross-node stage``; a
pipelined call records each stage once, in its thread, over all its pieces.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from queue import SimpleQueue
from time import monotonic_ns
from typing import Any

from ..backends.protocol import ArrayBackend
from ..ops import ReduceOp
from ..runtime import recorder
from ..runtime._commcache import comm_cache
from ..runtime._mpi import Comm, mpi
from ..runtime.agreement import DOORS, phase
from ..runtime.topology import get_topology
from ._chunks import even_bounds
from .implementation import Implementation
from .source import Source, agreed_join

__all__ = ["hierarchical", "PIPELINE_BYTES"]

PIPELINE_BYTES = 4 << 20  # the piece size of the pipelined multi-node form


def hierarchical(comm: Comm, buf: Any, *, op: ReduceOp, shards: int, backend: ArrayBackend,
                 rotation: int, intra: Implementation, inter: Implementation,
                 ranks_per_node: int | None = None, source: Source | None = None,
                 node_shards: bool = False) -> None:
    """Run ``intra`` in each node group, ``inter`` across leaders, then broadcast (in place,
    or from ``source`` into ``buf``: the node stage reads the source when ``intra``
    can, else it is copied into ``buf`` first).

    On a single node there is no cross-node stage, so ``intra``'s all-reduce runs over the
    node instead of its reduce-to-root and the broadcast (with every rank gathering a
    piece when ``node_shards``: the shuffles), which moves less.
    """
    topology = get_topology(comm, ranks_per_node)
    single = topology.num_nodes == 1 and topology.local_size > 1 and buf.size > 0
    if source is not None and intra.out_of_place and single:
        t = monotonic_ns() if recorder.on else 0
        intra.all_reduce(topology.node_comm, buf, op=op, backend=backend, rotation=rotation,
                         shards=topology.local_size if node_shards else 1,
                         source=agreed_join(topology.node_comm, source, backend))
        if t:
            phase(t, "node stage", {"step": "all_reduce", "ranks": topology.local_size})
        return
    if _pipelines(topology, buf, backend):
        if source is not None:
            source.copy_into(buf, backend=backend)
        _pipelined(topology, buf, op=op, shards=shards, backend=backend, rotation=rotation,
                   intra=intra, inter=inter)
        return
    if source is not None and not (intra.root_out_of_place and topology.local_size > 1
                                   and not single):
        source.copy_into(buf, backend=backend)
        source = None
    if buf.size == 0 or topology.size == 1:
        return
    node_comm = topology.node_comm
    t = monotonic_ns() if recorder.on else 0
    if single:
        intra.all_reduce(node_comm, buf, op=op, backend=backend, rotation=rotation,
                         shards=topology.local_size if node_shards else 1)
        if t:
            phase(t, "node stage", {"step": "all_reduce", "ranks": topology.local_size})
        return
    if topology.local_size > 1:
        if source is not None:  # (peers cut their messages from the source's segments)
            source = agreed_join(node_comm, source, backend)
            assert intra.reduce_to_root is not None  # (root_out_of_place: it has one)
            intra.reduce_to_root(node_comm, buf, op=op, backend=backend, root=0, source=source)
        elif intra.reduce_to_root is not None:
            intra.reduce_to_root(node_comm, buf, op=op, backend=backend, root=0)
        else:
            intra.all_reduce(node_comm, buf, op=op, shards=1, backend=backend,
                             rotation=rotation)
        if t:
            phase(t, "node stage", {"step": "reduce", "ranks": topology.local_size})
            t = monotonic_ns() if recorder.on else 0
    if topology.is_leader and topology.num_nodes > 1:
        inter.all_reduce(topology.leader_comm, buf, op=op, shards=shards, backend=backend,
                         rotation=rotation)
        if t:
            phase(t, "cross-node stage", {"nodes": topology.num_nodes})
            t = monotonic_ns() if recorder.on else 0
    if topology.local_size > 1:
        if intra.broadcast is not None:
            intra.broadcast(node_comm, buf, backend=backend, root=0)
        else:
            backend.synchronize()
            backend.transport(node_comm).bcast(backend.comm_view(buf), 0)
        if t:
            phase(t, "node stage", {"step": "broadcast", "ranks": topology.local_size})


def _pipelines(topology: Any, buf: Any, backend: ArrayBackend) -> bool:
    """Whether this call runs pipelined: host buffers of two pieces or more, across nodes,
    with some node holding several ranks (decided alike on every rank)."""
    return (getattr(backend, "name", None) == "numpy" and topology.num_nodes > 1
            and topology.size > topology.num_nodes and buf.nbytes >= 2 * PIPELINE_BYTES)


class _StageBackend:
    """The backend as one pipeline stage sees it: scratch of its own, since the stages
    (which may run the same algorithm, as in ``pscpu/pscpu``) work at the same time."""

    def __init__(self, backend: ArrayBackend, stage: str) -> None:
        self._backend, self._stage = backend, stage

    def scratch(self, tag: str, count: int, dtype: Any) -> Any:
        return self._backend.scratch(f"{self._stage}:{tag}", count, dtype)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


def _pipelined(topology: Any, buf: Any, *, op: ReduceOp, shards: int, backend: ArrayBackend,
               rotation: int, intra: Implementation, inter: Implementation) -> None:
    """Reduce each piece onto its owner, all-reduce it across the owners of the nodes and
    broadcast it from the owner, with the stages this rank takes part in running at once
    (see the module docstring). Piece ``i``'s owner is local rank ``i mod m`` of every
    node, ``m`` the fewest ranks any node has, so the nodes' ranks take turns on the
    network instead of the leader carrying every piece."""
    pieces = -(-buf.nbytes // PIPELINE_BYTES)
    bounds = even_bounds(buf.size, pieces)
    items = [(i, buf[a:b]) for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]
    owners = min(len(ranks) for ranks in topology.node_ranks)
    node_comm, local = topology.node_comm, topology.local_rank
    stages: list[Callable[[tuple[int, Any]], None]] = []
    labels: list[tuple[str, dict[str, Any]]] = []  # (the trace's names of the stages)
    if topology.local_size > 1:
        near = _StageBackend(backend, "node")
        if intra.reduce_to_root is not None:
            stages.append(lambda item: intra.reduce_to_root(  # type: ignore[misc]  # not None
                node_comm, item[1], op=op, backend=near, root=item[0] % owners))
        else:
            stages.append(lambda item: intra.all_reduce(node_comm, item[1], op=op, shards=1,
                                                        backend=near, rotation=rotation))
        labels.append(("node stage", {"step": "reduce", "ranks": topology.local_size}))
    # (keyed by the node layout too: virtual nodes give one communicator several layouts)
    peers = _shared(topology.comm, ("pipeline-peers", topology.ranks_per_node, owners),
                    lambda: _PeerComm(topology, owners))
    if local < owners:
        far = _StageBackend(backend, "nodes")

        def across(item: tuple[int, Any]) -> None:
            if item[0] % owners == local:
                inter.all_reduce(peers.comm, item[1], op=op, shards=shards, backend=far,
                                 rotation=rotation)

        stages.append(across)
        labels.append(("cross-node stage", {"nodes": topology.num_nodes}))
    if topology.local_size > 1:
        fan = _shared(node_comm, "pipeline-broadcast", lambda: _DupComm(node_comm))
        out = _StageBackend(backend, "fan-out")
        if intra.broadcast is not None:
            stages.append(lambda item: intra.broadcast(  # type: ignore[misc]  # not None
                fan.comm, item[1], backend=out, root=item[0] % owners))
        else:
            stages.append(lambda item: out.transport(fan.comm).bcast(
                backend.comm_view(item[1]), item[0] % owners))
        labels.append(("node stage", {"step": "broadcast", "ranks": topology.local_size}))
    if recorder.on and not DOORS.quiet:
        stages = [_TracedStage(stage, name, args, len(items))
                  for stage, (name, args) in zip(stages, labels)]
    run_stages(stages, items)


class _TracedStage:
    """A pipeline stage recorded as one phase, in the thread that runs it: from its first
    piece's start to its last piece's end (one event per stage, not per piece), with the
    pieces and the time spent working on them (the rest: waiting for the stage before)."""

    def __init__(self, stage: Callable[[Any], None], name: str, args: dict[str, Any],
                 pieces: int) -> None:
        self.stage, self.name, self.args, self.pieces = stage, name, args, pieces
        self.first = self.busy = self.done = 0

    def __call__(self, item: Any) -> None:
        start = monotonic_ns()
        self.first = self.first or start
        self.stage(item)
        self.busy += monotonic_ns() - start
        self.done += 1
        if self.done == self.pieces:
            phase(self.first, self.name, {**self.args, "pieces": self.pieces,
                                          "busy_ms": round(self.busy / 1e6, 3)})


def _shared(comm: Comm, key: Any, make: Callable[[], Any]) -> Any:
    """A sub-communicator cached on ``comm`` (made collectively on first use: every rank
    of ``comm`` takes the same path, since the decision to pipeline is the same)."""
    cache = comm_cache(comm)
    value = cache.get(key)
    if value is None:
        value = cache[key] = make()
    return value


class _DupComm:
    """A duplicate of the node communicator for the broadcast stage, freed with it: two
    stages that run at once may not share a communicator."""

    def __init__(self, node_comm: Comm) -> None:
        self.comm = node_comm.Dup()

    def release(self) -> None:
        self.comm.Free()


class _PeerComm:
    """Local rank ``j`` of every node, ``j < owners``, ordered by node: the ranks that
    all-reduce the pieces ``j`` owns across nodes (local rank 0: the leaders)."""

    def __init__(self, topology: Any, owners: int) -> None:
        MPI = mpi()
        color = topology.local_rank if topology.local_rank < owners else MPI.UNDEFINED
        comm = topology.comm.Split(color, key=topology.node)
        self.comm = None if comm == MPI.COMM_NULL else comm

    def release(self) -> None:
        if self.comm is not None:
            self.comm.Free()


def run_stages(stages: Sequence[Callable[[Any], None]], items: Sequence[Any]) -> None:
    """Run every item through every stage in order, the stages at once: stage ``s`` takes
    item ``k`` after stage ``s - 1`` has finished it. The first stage runs in the calling
    thread, each later one in a thread of its own. The first exception of any stage is
    raised here once every stage has stopped (a failed stage passes nothing further)."""
    if len(stages) <= 1 or len(items) <= 1:
        for item in items:
            for stage in stages:
                stage(item)
        return
    queues: list[SimpleQueue] = [SimpleQueue() for _ in stages[1:]]
    errors: list[BaseException] = []
    _END = object()

    def work(index: int) -> None:
        inbox = queues[index - 1]
        outbox = queues[index] if index < len(queues) else None
        try:
            while True:
                item = inbox.get()
                if item is _END:
                    break
                stages[index](item)
                if outbox is not None:
                    outbox.put(item)
        except BaseException as exc:  # (re-raised by the calling thread)
            errors.append(exc)
        finally:
            if outbox is not None:
                outbox.put(_END)

    threads = [threading.Thread(target=work, args=(i,), daemon=True,
                                name=f"mpistrat-pipeline-{i}") for i in range(1, len(stages))]
    for thread in threads:
        thread.start()
    try:
        for item in items:
            stages[0](item)
            queues[0].put(item)
    except BaseException as exc:
        errors.insert(0, exc)
    finally:
        queues[0].put(_END)
        for thread in threads:
            thread.join()
    if errors:
        raise errors[0]
