"""Where an algorithm's name becomes code, and the checks that come first.

``'xring'`` is a name in :mod:`mpistrat.algorithms.registry` (what it is: stages, shards,
GPU or not) and an entry of :data:`IMPLEMENTATIONS` here (the functions of
:mod:`mpistrat.algorithms.ring`); the two tables are checked against each other when this
module is imported. A hierarchical name ``a/b`` has no entry of its own: :func:`compose`
builds it from the entries of ``a`` and ``b``.

:func:`fit` checks that an entry ``alg#shards`` can run on a communicator's layout (on
every rank alike, so a bad call raises everywhere instead of leaving some ranks waiting);
:func:`run` runs it. Callers that reduce many buffers with one entry check once and run
with ``checked=True``. Under :mod:`mpistrat.trace` each run is a phase ``algorithm`` of
its collective (args: the algorithm's ``name`` and the ``bytes`` reduced).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from time import monotonic_ns
from typing import Any

from .algorithms import (
    AlgorithmInfo,
    Implementation,
    Shards,
    Source,
    agreed_join,
    get,
    gpu,
    halving_doubling,
    names,
    native,
    nccl,
    ring,
    shm,
    shuffle,
)
from .algorithms import register as add
from .algorithms.hierarchical import hierarchical
from .backends.protocol import ArrayBackend
from .errors import BackendUnavailable
from .layout import Layout, require_entry_fits
from .ops import ReduceOp
from .runtime import recorder
from .runtime._mpi import Comm
from .runtime.agreement import note_algorithm, phase
from .runtime.topology import get_topology
from .spec import check_entry

__all__ = ["IMPLEMENTATIONS", "register", "implementation", "compose", "check_fits", "fit",
           "run"]

IMPLEMENTATIONS: dict[str, Implementation] = {
    "xring": Implementation(ring.all_reduce, out_of_place=True),
    "rechd": Implementation(halving_doubling.all_reduce, out_of_place=True),
    "pscpu": Implementation(shuffle.all_reduce, shuffle.reduce_to_root, out_of_place=True,
                            root_out_of_place=True),
    "native": Implementation(native.all_reduce, out_of_place=True),
    "shm": Implementation(shm.all_reduce, shm.reduce_to_root, out_of_place=True,
                          broadcast=shm.broadcast, root_out_of_place=True),
    # NCCL inside a node group: reduce onto the leader, NCCL broadcast back (nccl/<b>)
    "nccl": Implementation(nccl.all_reduce, nccl.reduce_to_root, broadcast=nccl.broadcast),
    # the shuffle on CuPy buffers: pieces added on the gather ranks' GPUs
    "psgpu": Implementation(shuffle.all_reduce, shuffle.reduce_to_root),
}


def _check_tables() -> None:
    """Every flat name of the registry has code here, and nothing else has."""
    flat = {name for name in names() if not get(name).hierarchical}
    if flat != set(IMPLEMENTATIONS):
        raise RuntimeError(
            f"mpistrat.dispatch.IMPLEMENTATIONS and the algorithm registry disagree: "
            f"registered without code {sorted(flat - set(IMPLEMENTATIONS))}, code without a "
            f"registered name {sorted(set(IMPLEMENTATIONS) - flat)}")


_check_tables()


def register(info: AlgorithmInfo, code: Implementation) -> None:
    """Add a flat algorithm: its name and description to the registry, its code here
    (a ``mpistrat bench --plugin`` module calls this)."""
    if info.hierarchical:
        raise ValueError(f"{info.name!r} is hierarchical: register its stages, and the "
                         f"'a/b' name runs them (compose)")
    add(info)
    IMPLEMENTATIONS[info.name] = code


def implementation(name: str) -> Implementation:
    """The implementation of a registered, non-hierarchical algorithm.

    Raises:
        UnknownAlgorithmError: the name is not registered.
        BackendUnavailable: the algorithm needs GPUs (CuPy and NCCL) that this process
            cannot use, or the name is registered without code (a hierarchical name).
    """
    info = get(name)
    if info.needs_gpu:
        gpu.require(name)  # (raises BackendUnavailable saying what is missing)
    try:
        return IMPLEMENTATIONS[name]
    except KeyError:
        raise BackendUnavailable(f"algorithm {name!r} has no implementation") from None


@functools.lru_cache(maxsize=None)
def compose(intra: str, inter: str) -> Callable[..., None]:
    """The hierarchical all-reduce ``intra/inter`` for any two flat algorithms."""
    inner, outer = implementation(intra), implementation(inter)
    return functools.partial(hierarchical, intra=inner, inter=outer,
                             node_shards=get(intra).shards is Shards.GATHER_RANKS)


@functools.lru_cache(maxsize=256, typed=True)  # (typed: shards=True is not shards=1)
def check_fits(name: str, shards: int, workers: int, nodes: int,
               devices_per_worker: int = 1, gpus: bool = False) -> None:
    """Raise :class:`~mpistrat.errors.SpecError` for a malformed entry ``name#shards``, or
    :class:`~mpistrat.errors.TopologyError` if it cannot run on this layout (cached).
    Every rank knows these values, so every rank raises together."""
    alg, shards, _ = check_entry(name, shards)
    require_entry_fits(alg, shards, Layout(workers, devices_per_worker, gpus, nodes))


def fit(name: str, comm: Comm, shards: int = 1, *, ranks_per_node: int | None = None,
        devices_per_worker: int = 1, gpus: bool = False) -> None:
    """:func:`check_fits` for ``comm``: its size, and its nodes where they matter (a
    hierarchical or shared-memory algorithm)."""
    info = get(name)
    nodes = 1
    if (info.hierarchical or info.single_node) and comm.Get_size() > 1:
        nodes = get_topology(comm, ranks_per_node).num_nodes
    check_fits(name, shards, comm.Get_size(), nodes, devices_per_worker, gpus)


def _host_buffers_for_gpu_algorithm(name: str) -> BackendUnavailable:
    return BackendUnavailable(
        f"algorithm {name!r} runs on GPU buffers through CuPy/NCCL; these are host "
        f"(NumPy) buffers — use a CPU algorithm such as 'xring', 'rechd', 'pscpu', 'shm' or "
        f"'pscpu/pscpu'")


def run(name: str, comm: Comm, buf: Any, *, op: ReduceOp, shards: int = 1, backend: ArrayBackend,
        rotation: int = 0, ranks_per_node: int | None = None,
        source: Source | None = None, checked: bool = False) -> None:
    """Reduce ``buf`` in place over ``comm`` with the algorithm called ``name`` — or, with
    a ``source``, reduce the source into ``buf`` (every rank's source must have the same
    segment sizes; ``buf`` is the source's size and dtype).

    The entry is checked first (:func:`fit`) unless the caller already did
    (``checked=True``). Flat algorithms other than ``native`` run over the ranks in
    host-major order (:attr:`~mpistrat.runtime.topology.Topology.host_major`), so a ring crosses
    each link once per direction whatever the launcher's placement.
    """
    info = get(name)
    if info.needs_gpu and getattr(backend, "name", None) == "numpy":
        raise _host_buffers_for_gpu_algorithm(name)
    if not checked:
        fit(name, comm, shards, ranks_per_node=ranks_per_node)
    t = monotonic_ns() if recorder.on else 0
    if info.hierarchical:
        compose(info.intra, info.inter)(comm, buf, op=op, shards=shards, backend=backend,
                                        rotation=rotation, ranks_per_node=ranks_per_node,
                                        source=source)
    else:
        if comm.Get_size() > 1 and not info.single_node and name != "native":
            comm = get_topology(comm, ranks_per_node).host_major  # (native: MPI's own)
        flat = implementation(name)
        if source is None:
            flat.all_reduce(comm, buf, op=op, shards=shards, backend=backend,
                            rotation=rotation)
        elif flat.out_of_place:
            if not info.single_node:  # peers cut their messages from the source's segments
                source = agreed_join(comm, source, backend)
            flat.all_reduce(comm, buf, op=op, shards=shards, backend=backend,
                            rotation=rotation, source=source)
        else:
            source.copy_into(buf, backend=backend)
            flat.all_reduce(comm, buf, op=op, shards=shards, backend=backend,
                            rotation=rotation)
    if t:
        note_algorithm(name)
        phase(t, "algorithm", {"name": name, "bytes": buf.nbytes})
