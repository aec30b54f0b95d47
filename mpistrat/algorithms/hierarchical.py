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
communicator — while the leaders all-reduce piece ``k`` across nodes, the node reduces
piece ``k + 1`` onto its leader and broadcasts piece ``k - 1``. The cross-node stage is
the one on the network, so the node stages hide behind it: the call takes about the
cross-node time plus one piece's node stages, instead of the three stages' sum. Every
piece goes through the same steps as the whole buffer would, so the results stay bitwise
identical on every rank. Whether to pipeline depends only on values every rank shares
(the buffer's size, the node layout), so all ranks cut the same pieces.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from queue import SimpleQueue
from typing import Any

from .._commcache import comm_cache
from ..ops import ReduceOp
from ._chunks import even_bounds
from .source import Source, agreed_join

__all__ = ["Implementation", "hierarchical", "PIPELINE_BYTES"]

PIPELINE_BYTES = 4 << 20  # the piece size of the pipelined multi-node form


@dataclass(frozen=True)
class Implementation:
    """The code behind an algorithm name.

    Attributes:
        all_reduce: ``f(comm, buf, *, op, shards, backend, rotation)``, in place.
        reduce_to_root: ``f(comm, buf, *, op, backend, root)`` leaving the reduction on
            ``root`` only, when the algorithm has a cheaper form for that (used as the
            intra-node stage of hierarchical algorithms).
        broadcast: ``f(comm, buf, *, backend, root)`` copying ``root``'s buffer to every
            rank, when the algorithm has a faster way than ``MPI_Bcast`` (shared memory,
            NCCL); used for the last stage of hierarchical algorithms.
        out_of_place: ``all_reduce`` also takes ``source=`` (a :class:`.source.Source`)
            and reduces it into ``buf`` without first copying it there.
        root_out_of_place: ``reduce_to_root`` takes ``source=`` likewise.
    """

    all_reduce: Callable[..., None]
    reduce_to_root: Callable[..., None] | None = None
    out_of_place: bool = False
    broadcast: Callable[..., None] | None = None
    root_out_of_place: bool = False


def hierarchical(comm: Any, buf: Any, *, op: ReduceOp, shards: int, backend: Any,
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
    from ..topology import get_topology  # (topology -> layout -> spec -> this package)

    topology = get_topology(comm, ranks_per_node)
    single = topology.num_nodes == 1 and topology.local_size > 1 and buf.size > 0
    if source is not None and intra.out_of_place and single:
        intra.all_reduce(topology.node_comm, buf, op=op, backend=backend, rotation=rotation,
                         shards=topology.local_size if node_shards else 1,
                         source=agreed_join(topology.node_comm, source, backend))
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
    if single:
        intra.all_reduce(node_comm, buf, op=op, backend=backend, rotation=rotation,
                         shards=topology.local_size if node_shards else 1)
        return
    if topology.local_size > 1:
        if source is not None:  # (peers cut their messages from the source's segments)
            source = agreed_join(node_comm, source, backend)
            intra.reduce_to_root(node_comm, buf, op=op, backend=backend, root=0, source=source)
        elif intra.reduce_to_root is not None:
            intra.reduce_to_root(node_comm, buf, op=op, backend=backend, root=0)
        else:
            intra.all_reduce(node_comm, buf, op=op, shards=1, backend=backend,
                             rotation=rotation)
    if topology.is_leader and topology.num_nodes > 1:
        inter.all_reduce(topology.leader_comm, buf, op=op, shards=shards, backend=backend,
                         rotation=rotation)
    if topology.local_size > 1:
        if intra.broadcast is not None:
            intra.broadcast(node_comm, buf, backend=backend, root=0)
        else:
            backend.synchronize()
            backend.transport(node_comm).bcast(backend.comm_view(buf), 0)


def _pipelines(topology: Any, buf: Any, backend: Any) -> bool:
    """Whether this call runs pipelined: host buffers of two pieces or more, across nodes,
    with some node holding several ranks (decided alike on every rank)."""
    return (getattr(backend, "name", None) == "numpy" and topology.num_nodes > 1
            and topology.size > topology.num_nodes and buf.nbytes >= 2 * PIPELINE_BYTES)


class _StageBackend:
    """The backend as one pipeline stage sees it: scratch of its own, since the stages
    (which may run the same algorithm, as in ``pscpu/pscpu``) work at the same time."""

    def __init__(self, backend: Any, stage: str) -> None:
        self._backend, self._stage = backend, stage

    def scratch(self, tag: str, count: int, dtype: Any) -> Any:
        return self._backend.scratch(f"{self._stage}:{tag}", count, dtype)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


class _BroadcastComm:
    """A duplicate of the node communicator for the broadcast stage, freed with it: two
    stages that run at once may not share a communicator."""

    def __init__(self, node_comm: Any) -> None:
        self.comm = node_comm.Dup()

    def release(self) -> None:
        self.comm.Free()


def _pipelined(topology: Any, buf: Any, *, op: ReduceOp, shards: int, backend: Any,
               rotation: int, intra: Implementation, inter: Implementation) -> None:
    """Reduce onto the leader, all-reduce across leaders and broadcast, piece by piece,
    with the stages this rank takes part in running at once (see the module docstring)."""
    pieces = -(-buf.nbytes // PIPELINE_BYTES)
    bounds = even_bounds(buf.size, pieces)
    chunks = [buf[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    node_comm = topology.node_comm
    stages: list[Callable[[Any], None]] = []
    if topology.local_size > 1:
        near = _StageBackend(backend, "node")
        if intra.reduce_to_root is not None:
            stages.append(lambda c: intra.reduce_to_root(node_comm, c, op=op, backend=near,
                                                         root=0))
        else:
            stages.append(lambda c: intra.all_reduce(node_comm, c, op=op, shards=1,
                                                     backend=near, rotation=rotation))
    if topology.is_leader:
        far = _StageBackend(backend, "nodes")
        stages.append(lambda c: inter.all_reduce(topology.leader_comm, c, op=op, shards=shards,
                                                 backend=far, rotation=rotation))
    if topology.local_size > 1:
        cache = comm_cache(node_comm)
        fan = cache.get("pipeline-broadcast")
        if fan is None:  # (collective over the node: every rank of it gets here together)
            fan = cache["pipeline-broadcast"] = _BroadcastComm(node_comm)
        out = _StageBackend(backend, "fan-out")
        if intra.broadcast is not None:
            stages.append(lambda c: intra.broadcast(fan.comm, c, backend=out, root=0))
        else:
            stages.append(lambda c: out.transport(fan.comm).bcast(backend.comm_view(c), 0))
    run_stages(stages, chunks)


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
