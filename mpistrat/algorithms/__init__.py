"""All-reduce algorithms: the registry of names (pure) and the code behind each name.

Every algorithm is a function over a communicator and a contiguous 1-D buffer that it
reduces in place: ``f(comm, buf, *, op, shards, backend, rotation)``; see each module's
docstring for its steps, the bytes it moves and its preconditions. ``xring``, ``rechd``,
``pscpu``, ``native`` and ``shm`` also reduce out of place from a :class:`Source`
(tensors where they lie) into ``buf``; :func:`run` copies the source first for the
others, and hands a Source whose tensors are views of one buffer, in order, over as that
one buffer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ..errors import BackendUnavailable
from ..ops import ReduceOp
from . import gpu, halving_doubling, native, ring, shm, shuffle
from .hierarchical import Implementation, hierarchical
from .registry import AlgorithmInfo, Pool, Shards, get, names, register
from .source import Source, agreed_join

__all__ = [
    "AlgorithmInfo", "Shards", "Pool", "get", "names", "register",
    "Implementation", "implementation", "run", "compose", "check_fits", "Source",
]

_FLAT: dict[str, Implementation] = {
    "xring": Implementation(ring.all_reduce, out_of_place=True),
    "rechd": Implementation(halving_doubling.all_reduce, out_of_place=True),
    "pscpu": Implementation(shuffle.all_reduce, shuffle.reduce_to_root, out_of_place=True,
                            root_out_of_place=True),
    "native": Implementation(native.all_reduce, out_of_place=True),
    "shm": Implementation(shm.all_reduce, shm.reduce_to_root, out_of_place=True,
                          broadcast=shm.broadcast, root_out_of_place=True),
}


def implementation(name: str) -> Implementation:
    """The flat implementation of a registered, non-hierarchical algorithm.

    Raises:
        UnknownAlgorithmError: the name is not registered.
        BackendUnavailable: the algorithm needs GPUs (CuPy and NCCL), which host
            buffers cannot use.
    """
    info = get(name)
    if name in _FLAT:
        return _FLAT[name]
    if info.needs_gpu:
        return gpu.implementation(name)  # (raises BackendUnavailable saying what is missing)
    raise BackendUnavailable(f"algorithm {name!r} has no implementation")


def _host_buffers_for_gpu_algorithm(name: str) -> BackendUnavailable:
    return BackendUnavailable(
        f"algorithm {name!r} runs on GPU buffers through CuPy/NCCL; these are host "
        f"(NumPy) buffers — use a CPU algorithm such as 'xring', 'rechd', 'pscpu', 'shm' or "
        f"'pscpu/pscpu'")


@functools.lru_cache(maxsize=None)
def compose(intra: str, inter: str) -> Callable[..., None]:
    """The hierarchical all-reduce ``intra/inter`` for any two flat algorithms."""
    inner, outer = implementation(intra), implementation(inter)
    return functools.partial(hierarchical, intra=inner, inter=outer,
                             node_shards=get(intra).shards is Shards.GATHER_RANKS)


@functools.lru_cache(maxsize=256)
def check_fits(name: str, shards: int, workers: int, nodes: int,
               devices_per_worker: int = 1, gpus: bool = False) -> None:
    """Raise :class:`~mpistrat.errors.TopologyError` if ``name#shards`` cannot run on this
    layout (cached). Every rank knows these values, so every rank raises together."""
    from ..layout import Layout, require_fits  # (layout -> spec -> this package)

    require_fits([(name, shards)], Layout(workers, devices_per_worker, gpus, nodes))


def run(name: str, comm: Any, buf: Any, *, op: ReduceOp, shards: int = 1, backend: Any,
        rotation: int = 0, ranks_per_node: int | None = None,
        source: Source | None = None) -> None:
    """Reduce ``buf`` in place over ``comm`` with the algorithm called ``name`` — or, with
    a ``source``, reduce the source into ``buf`` (every rank's source must have the same
    segment sizes; ``buf`` is the source's size and dtype).

    The algorithm's topology preconditions (e.g. shards no more than the gather ranks
    of its stage) are checked first, on every rank alike, so a bad call raises
    everywhere instead of leaving some ranks waiting.
    """
    info = get(name)
    if info.needs_gpu and getattr(backend, "name", None) == "numpy":
        raise _host_buffers_for_gpu_algorithm(name)
    if info.hierarchical:
        from ..topology import get_topology

        topology = get_topology(comm, ranks_per_node)
        check_fits(name, shards, topology.size, topology.num_nodes)
        compose(info.intra, info.inter)(comm, buf, op=op, shards=shards, backend=backend,
                                        rotation=rotation, ranks_per_node=ranks_per_node,
                                        source=source)
    else:
        nodes = 1
        if comm.Get_size() > 1:
            from ..topology import get_topology

            topology = get_topology(comm, ranks_per_node)
            if info.single_node:
                nodes = topology.num_nodes
            elif name != "native":  # (the MPI library's own choice stays the baseline)
                comm = topology.host_major
        check_fits(name, shards, comm.Get_size(), nodes)
        flat = implementation(name)
        if source is None:
            flat.all_reduce(comm, buf, op=op, shards=shards, backend=backend, rotation=rotation)
        elif flat.out_of_place:
            if not info.single_node:  # peers cut their messages from the source's segments
                source = agreed_join(comm, source, backend)
            flat.all_reduce(comm, buf, op=op, shards=shards, backend=backend, rotation=rotation,
                            source=source)
        else:
            source.copy_into(buf, backend=backend)
            flat.all_reduce(comm, buf, op=op, shards=shards, backend=backend, rotation=rotation)
