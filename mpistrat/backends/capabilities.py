"""Capability probes: CuPy, CUDA devices, NCCL and CUDA-aware MPI.

Each probe is lazy (CuPy is imported only when a probe runs), never raises, and
returns a value that says what is there and, when something is missing, why. The
probes are what ``mpistrat info`` reports and what GPU code paths check before they
raise :class:`~mpistrat.errors.BackendUnavailable`.
"""

from __future__ import annotations

import ctypes
import importlib.util
from dataclasses import dataclass, field
from typing import Any

from ..config import Settings
from ..runtime._commcache import comm_cache
from ..runtime._mpi import Comm, mpi
from ..runtime.devices import device_identity

__all__ = ["GpuProbe", "probe_gpus", "mpi_library_path", "cuda_aware_mpi",
           "cuda_aware_choice", "device_buffers_to_mpi"]


@dataclass(frozen=True)
class GpuProbe:
    """What this process can see of CUDA through CuPy.

    Attributes:
        cupy: CuPy's version, or None when CuPy is not importable.
        devices: ``(id, name)`` of every CUDA device visible to this process.
        nccl: NCCL's version through ``cupy.cuda.nccl``, or None.
        reason: why there are no devices / no NCCL, when that is the case.
        identities: UUID (else PCI bus id, else None) of each device, by ordinal.
    """

    cupy: str | None = None
    devices: tuple[tuple[int, str], ...] = field(default_factory=tuple)
    nccl: str | None = None
    reason: str = ""
    identities: tuple[str | None, ...] = field(default_factory=tuple)

    @property
    def usable(self) -> bool:
        """True when CuPy imports and at least one device is visible."""
        return self.cupy is not None and bool(self.devices)


def probe_gpus() -> GpuProbe:
    """Probe CuPy, the visible CUDA devices and NCCL (imports CuPy; never raises)."""
    if importlib.util.find_spec("cupy") is None:
        return GpuProbe(reason="CuPy is not installed (pip install 'mpistrat[gpu]')")
    try:
        import cupy  # (CuPy on demand: import mpistrat starts no CUDA)
    except Exception as exc:  # a broken install must not break `mpistrat info`
        return GpuProbe(reason=f"CuPy failed to import: {exc}")
    version = getattr(cupy, "__version__", "unknown")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
        devices = []
        for index in range(count):
            props = cupy.cuda.runtime.getDeviceProperties(index)
            name = props.get("name", b"")
            devices.append((index, name.decode() if isinstance(name, bytes) else str(name)))
    except Exception as exc:
        return GpuProbe(cupy=version, reason=f"no usable CUDA device: {exc}")
    nccl, reason = None, ""
    try:
        from cupy.cuda import nccl as nccl_module  # (CuPy on demand: no CUDA at import)

        if getattr(nccl_module, "available", True):
            nccl = _format_nccl_version(nccl_module.get_version())
        else:
            reason = "CuPy was built without NCCL"
    except Exception as exc:
        reason = f"NCCL not usable through CuPy: {exc}"
    if not devices and not reason:
        reason = "CuPy sees no CUDA device (check CUDA_VISIBLE_DEVICES)"
    identities = tuple(device_identity(cupy, index) for index, _ in devices)
    return GpuProbe(cupy=version, devices=tuple(devices), nccl=nccl, reason=reason,
                    identities=identities)


def _format_nccl_version(code: int) -> str:
    # NCCL encodes versions as MAJOR*10000 + MINOR*100 + PATCH since 2.9 (1000s before).
    if code >= 10000:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


def mpi_library_path() -> str | None:
    """Path of the MPI library loaded in this process (Linux), or None if unknown."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = sorted({line.split()[-1] for line in maps if "/libmpi" in line})
    except OSError:
        return None
    return paths[0] if paths else None


def cuda_aware_mpi(MPI: Any) -> bool | None:
    """Whether the loaded MPI library can take CUDA device buffers, when it can tell.

    Uses ``MPIX_Query_cuda_support`` (Open MPI, MPICH >= 4) from the loaded library.
    Must run after MPI is initialised.

    Returns:
        True or False when the library answers, None when it cannot be known.
    """
    if not MPI.Is_initialized():
        return None
    path = mpi_library_path()
    try:
        library = ctypes.CDLL(path) if path else ctypes.CDLL(None)
        query = library.MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return None
    query.restype = ctypes.c_int
    query.argtypes = []
    return bool(query())


def cuda_aware_choice(MPI: Any, forced: bool | None) -> tuple[bool, str]:
    """Whether this process would pass device buffers to MPI, and why.

    Args:
        MPI: the ``mpi4py.MPI`` module (initialised).
        forced: ``Settings.cuda_aware_mpi`` (``MPISTRAT_CUDA_AWARE_MPI``): True or False
            decide; None asks the library, and an unknown answer means staging (safe).
    """
    if forced is not None:
        return forced, f"MPISTRAT_CUDA_AWARE_MPI={'1' if forced else '0'}"
    answer = cuda_aware_mpi(MPI)
    if answer is None:
        return False, "the MPI library cannot tell (no MPIX_Query_cuda_support): staged"
    return answer, f"MPIX_Query_cuda_support() = {int(answer)}"


def device_buffers_to_mpi(comm: Comm, forced: bool | None = None) -> bool:
    """True: the algorithms pass device buffers to MPI directly (CUDA-aware MPI); False:
    they stage them through pinned host memory (:mod:`mpistrat.backends.transport`).

    Collective on the first call for ``comm`` (the answer is cached on it): every rank
    must move its bytes the same way, since staged transfers are cut into chunks, so
    the ranks agree — direct only if every rank can. ``forced`` defaults to
    ``MPISTRAT_CUDA_AWARE_MPI``.
    """
    cache = comm_cache(comm)
    key = ("device_buffers_to_mpi",)
    if key not in cache:
        MPI = mpi()
        if forced is None:
            forced = Settings.from_env().cuda_aware_mpi
        mine, _ = cuda_aware_choice(MPI, forced)
        cache[key] = bool(comm.allreduce(int(mine), op=MPI.MIN))
    return cache[key]
