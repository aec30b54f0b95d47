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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..ops import ReduceOp
from .source import Source, agreed_join

__all__ = ["Implementation", "hierarchical"]


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
