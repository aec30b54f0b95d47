"""Which GPUs a rank uses: device assignment from ``CUDA_VISIBLE_DEVICES`` and the local rank.

A rank owning ``G`` GPUs takes them from the devices its process can see:

* **per-rank visibility** — the process sees exactly ``G`` devices (Slurm's
  ``--gpus-per-task=G``, or a per-rank ``CUDA_VISIBLE_DEVICES`` set by a wrapper): it
  takes CUDA ordinals ``0 .. G-1``;
* **shared visibility** — the process sees the node's devices (at least ``local_size *
  G`` of them): local rank ``L`` takes ordinals ``L*G .. L*G+G-1``.

Anything else (fewer than ``G`` devices, or more than ``G`` but fewer than the node's
ranks need) is an error naming the counts and the fix. The rule is the pure function
:func:`assign_devices`, so it is tested with plain values; :func:`node_assignment` feeds it
this process's real inputs (local rank from :func:`mpistrat.runtime.topology.get_topology`, device
count and UUIDs from CuPy) and :func:`require_distinct_devices` checks, collectively, that
no two ranks of a communicator use the same physical GPU — NCCL rejects a communicator
holding one GPU twice, with an error that does not say which ranks collided.

A physical GPU is identified by its UUID or PCI bus id when CuPy reports one, else by the
``CUDA_VISIBLE_DEVICES`` entry the ordinal resolves to (an index or a ``GPU-…`` UUID),
else by the ordinal itself; identities are compared together with the host name.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import BackendUnavailable, DuplicateDeviceError, TopologyError
from ._mpi import Comm, mpi
from .topology import get_topology

__all__ = [
    "DeviceAssignment", "DuplicateDeviceError", "parse_visible_devices", "assign_devices",
    "node_assignment", "require_distinct_devices", "duplicate_devices", "device_identity",
]


@dataclass(frozen=True)
class DeviceAssignment:
    """The GPUs of one rank.

    Attributes:
        local_rank, local_size: the rank's place in its node group.
        ordinals: the CUDA device ordinals (within this process's visible devices) the
            rank uses, one per local device, in local-device order.
        physical: an identity of the physical GPU behind each ordinal (UUID / PCI bus id,
            else the ``CUDA_VISIBLE_DEVICES`` entry, else ``"ordinal N"``).
        mode: ``"per-rank"`` (the process sees exactly its ``G`` devices) or
            ``"shared"`` (the process sees the node's devices; sliced by local rank).
    """

    local_rank: int
    local_size: int
    ordinals: tuple[int, ...]
    physical: tuple[str, ...]
    mode: str

    def describe(self) -> str:
        """``"0 (GPU-1a2b...)"``-style text, one item per device."""
        return ", ".join(f"{o} ({p})" if p != f"ordinal {o}" else str(o)
                         for o, p in zip(self.ordinals, self.physical))


def parse_visible_devices(value: str | None) -> tuple[str, ...] | None:
    """The entries of a ``CUDA_VISIBLE_DEVICES`` value, or None when it is unset.

    Follows CUDA's reading: entries are comma separated and stripped; the list stops at
    the first empty entry or at ``-1`` (CUDA ignores everything after an invalid entry);
    an empty value hides every device (an empty tuple).
    """
    if value is None:
        return None
    entries: list[str] = []
    for entry in value.split(","):
        entry = entry.strip()
        if not entry or entry == "-1" or entry.lower() == "nodevfiles":
            break
        entries.append(entry)
    return tuple(entries)


def assign_devices(local_rank: int, local_size: int, gpus_per_rank: int,
                   visible: str | None, device_count: int,
                   uuids: Sequence[str | None] | None = None) -> DeviceAssignment:
    """The GPUs of the rank with node-local rank ``local_rank`` (a pure function).

    Args:
        local_rank, local_size: the rank's place in, and the size of, its node group.
        gpus_per_rank: ``G``, the GPUs each rank owns (>= 1).
        visible: this process's ``CUDA_VISIBLE_DEVICES`` (None when unset).
        device_count: how many CUDA devices this process sees.
        uuids: a physical identity (UUID or PCI bus id) per visible ordinal, when known.

    Raises:
        TopologyError: ``gpus_per_rank`` or the local rank is invalid, or the process
            does not see enough devices for its share.
    """
    if isinstance(gpus_per_rank, bool) or not isinstance(gpus_per_rank, int) \
            or gpus_per_rank < 1:
        raise TopologyError(f"gpus_per_rank must be an integer >= 1, got {gpus_per_rank!r}")
    if not 0 <= local_rank < local_size:
        raise TopologyError(f"local rank {local_rank} is not in 0..{local_size - 1}")
    g = gpus_per_rank
    shown = "unset" if visible is None else repr(visible)
    if device_count == g:
        mode, first = "per-rank", 0
    elif device_count >= local_size * g:
        mode, first = "shared", local_rank * g
    else:
        need = (f"{g} GPU(s) per rank" if device_count < g else
                f"{local_size} rank(s) x {g} GPU(s) = {local_size * g} on this node")
        raise TopologyError(
            f"local rank {local_rank} of {local_size} cannot get {g} GPU(s): this process "
            f"sees {device_count} CUDA device(s) (CUDA_VISIBLE_DEVICES={shown}) and needs "
            f"{need}; give each rank exactly {g} device(s) (srun --gpus-per-task={g}, or a "
            f"per-rank CUDA_VISIBLE_DEVICES), let every rank see the node's "
            f"{local_size * g} devices, or use fewer ranks per node or fewer GPUs per rank"
        )
    ordinals = tuple(range(first, first + g))
    entries = parse_visible_devices(visible)
    physical = []
    for ordinal in ordinals:
        if uuids is not None and ordinal < len(uuids) and uuids[ordinal]:
            physical.append(str(uuids[ordinal]))
        elif entries is not None and ordinal < len(entries):
            physical.append(f"CUDA_VISIBLE_DEVICES[{ordinal}]={entries[ordinal]}")
        else:
            physical.append(f"ordinal {ordinal}")
    return DeviceAssignment(local_rank, local_size, ordinals, tuple(physical), mode)


def duplicate_devices(claims: Sequence[tuple[str, Sequence[str]]]) -> dict[tuple[str, str],
                                                                            list[int]]:
    """Physical GPUs claimed more than once: ``{(host, gpu): [ranks]}``.

    Args:
        claims: per rank, ``(host, physical identities of its GPUs)``.
    """
    owners: dict[tuple[str, str], list[int]] = {}
    for rank, (host, gpus) in enumerate(claims):
        for gpu in gpus:
            owners.setdefault((host, gpu), []).append(rank)
    return {key: ranks for key, ranks in owners.items() if len(ranks) > 1}


def require_distinct_devices(comm: Comm, physical: Sequence[str], *, host: str | None = None,
                             purpose: str = "NCCL") -> None:
    """Raise :class:`DuplicateDeviceError` on every rank of ``comm`` when two ranks (or one
    rank twice) claim the same physical GPU (collective).

    Args:
        comm: the communicator whose ranks will share one NCCL communicator.
        physical: this rank's GPU identities (:attr:`DeviceAssignment.physical`, or any
            strings naming physical GPUs).
        host: this rank's host name (default: ``MPI.Get_processor_name()``).
        purpose: what needs distinct GPUs, for the message.
    """
    if host is None:
        host = mpi().Get_processor_name()
    claims = comm.allgather((host, tuple(physical)))
    duplicates = duplicate_devices(claims)
    if not duplicates:
        return
    clashes = "; ".join(
        f"GPU {gpu} on {node} is claimed by rank(s) {sorted(set(ranks))}"
        + (" (one rank twice)" if len(set(ranks)) == 1 else "")
        for (node, gpu), ranks in sorted(duplicates.items()))
    raise DuplicateDeviceError(
        f"{purpose} needs every device of its communicator to be a different GPU, and "
        f"{clashes}; NCCL rejects a communicator holding the same GPU twice ('Duplicate GPU "
        f"detected'). Give each rank its own GPUs: run at most as many ranks per node as "
        f"it has GPUs / G, use srun --gpus-per-task=G or a per-rank CUDA_VISIBLE_DEVICES, "
        f"or pick an MPI algorithm (xring, rechd, psgpu), which may share a GPU"
    )


def _probe_devices() -> tuple[int, list[str | None]]:
    """This process's CUDA device count and the UUID (else PCI bus id) of each device."""
    try:
        import cupy  # (CuPy on demand: import mpistrat starts no CUDA)
    except Exception as exc:
        raise BackendUnavailable(
            f"GPU workers need CuPy, which failed to import ({exc}); install it with "
            f"pip install 'mpistrat[gpu]'"
        ) from exc
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        raise BackendUnavailable(f"no usable CUDA device: {exc}") from exc
    return count, [device_identity(cupy, i) for i in range(count)]


def device_identity(cupy: Any, ordinal: int) -> str | None:
    """UUID (``GPU-…``) or PCI bus id of CUDA device ``ordinal``, or None (never raises)."""
    try:
        uuid = cupy.cuda.runtime.getDeviceProperties(ordinal).get("uuid")
        if isinstance(uuid, (bytes, bytearray)) and len(uuid) == 16:
            h = uuid.hex()
            return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
    except Exception:
        pass
    try:
        return str(cupy.cuda.Device(ordinal).pci_bus_id)
    except Exception:
        return None


def node_assignment(comm: Comm, gpus_per_rank: int, *, ranks_per_node: int | None = None,
                    environ: Mapping[str, str] | None = None,
                    probe: Any = None) -> DeviceAssignment:
    """This rank's GPUs, agreed over ``comm`` (collective): if any rank cannot get its
    share, every rank raises the same :class:`~mpistrat.errors.TopologyError`.

    Args:
        comm: the job's communicator; node groups come from its topology.
        gpus_per_rank: ``G``.
        ranks_per_node: virtual node size (see :func:`mpistrat.runtime.topology.get_topology`).
        environ: this rank's environment (default ``os.environ``).
        probe: ``() -> (device_count, identities)``; default asks CuPy.
    """
    env = os.environ if environ is None else environ
    topology = get_topology(comm, ranks_per_node)
    error = None
    assignment = None
    try:
        count, uuids = (probe or _probe_devices)()
        assignment = assign_devices(topology.local_rank, topology.local_size, gpus_per_rank,
                                    env.get("CUDA_VISIBLE_DEVICES"), count, uuids)
    except (TopologyError, BackendUnavailable) as exc:
        error = f"{type(exc).__name__}: {exc}"
    errors = comm.allgather(error)
    bad = [(rank, text) for rank, text in enumerate(errors) if text is not None]
    if bad:
        detail = "; ".join(f"rank {rank}: {text}" for rank, text in bad)
        kind = BackendUnavailable if all("BackendUnavailable" in t for _, t in bad) \
            else TopologyError
        raise kind(f"GPU assignment failed on {len(bad)} rank(s) of {comm.Get_size()}: "
                   f"{detail}")
    assert assignment is not None  # no rank reported an error
    return assignment
