"""Transparent huge pages for all of a rank's heap: glibc's ``glibc.malloc.hugetlb=1``.

NumPy asks the kernel for transparent huge pages (``madvise``) only for arrays of 4 MiB
or more, so most of a model's gradients (151 of ResNet-50's 161, 34.7 MiB of 97.5) sit
on 4 KiB pages. MPI moves those much more slowly: MPICH's single-copy intra-node path
(CMA) walks the sender's memory page by page, and copying them first costs as much. On
the project's VM, reducing ResNet-50's separately allocated gradients through
``batch_reduce`` took 1.34-1.50x the time of the same bytes in one (huge-paged) array,
and 1.14-1.24x with this tunable (docs/notes/batch-reduce-history.md, round 3).

glibc 2.35 and later read ``GLIBC_TUNABLES`` once, when the process starts, and with
``glibc.malloc.hugetlb=1`` malloc marks all its memory ``MADV_HUGEPAGE``. It matters when
the kernel's THP mode is ``madvise`` (``always`` gives huge pages anyway, ``never``
none). ``mpistrat run`` and ``mpistrat bench`` therefore start over (``exec`` of the same
command line, before MPI is initialised) with the tunable added, unless
``MPISTRAT_MALLOC_HUGEPAGES=0`` or the tunable is already set either way; when they start
the ranks themselves (``-n``, ``--np``), they hand the ranks the tunable instead, so that
no process starts twice. This is what
HPC sites do with huge-page modules for their MPI jobs; the cost is memory rounded up
to 2 MiB pages in the allocator's larger regions.

The restart also fixes malloc's mmap threshold at 32 MiB (and its trim threshold at 64
MiB), the values glibc's sliding thresholds reach anyway once a program has freed a
large array. Without it, the first arrays a process allocates from 128 KiB up (the
gradient buffers a training script keeps for its whole run) each get their own
``mmap``, where a huge page covers only the aligned 2 MiB inside it: on the project's
VM 32-56 % of the bytes of ResNet-50's separately allocated gradients stayed on 4 KiB
pages, and
``batch_reduce`` of them took 19.3-20.2 ms instead of 14.7-15.2 ms with the thresholds
fixed (2 ranks, three runs; docs/notes/batch-reduce-history.md). A threshold the user
set (in ``GLIBC_TUNABLES`` or glibc's ``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_``)
is kept.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping
from typing import Any

from ..config import Settings

__all__ = ["TUNABLE", "THRESHOLDS", "thp_mode", "glibc_version", "malloc_hugepages_env",
           "restart_with_hugepages", "describe_heap"]

TUNABLE = "glibc.malloc.hugetlb"
THRESHOLDS = {  # tunable: (value, glibc's older environment variable for it)
    "glibc.malloc.mmap_threshold": (32 << 20, "MALLOC_MMAP_THRESHOLD_"),
    "glibc.malloc.trim_threshold": (64 << 20, "MALLOC_TRIM_THRESHOLD_"),
}
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
_MIN_GLIBC = (2, 35)


def thp_mode(path: str = THP_ENABLED) -> str | None:
    """The kernel's transparent huge page mode (``always``, ``madvise``, ``never``), or
    None when it cannot be read (not Linux, no THP)."""
    try:
        with open(path, encoding="ascii") as handle:
            text = handle.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def glibc_version() -> tuple[int, int] | None:
    """The C library's version when it is glibc, else None."""
    name, version = platform.libc_ver()
    parts = version.split(".")
    if name != "glibc" or len(parts) < 2 or not all(p.isdigit() for p in parts[:2]):
        return None
    return int(parts[0]), int(parts[1])


_MACHINE: Any = object()  # (default of the probes below: ask this machine)


def malloc_hugepages_env(environ: Mapping[str, str] | None = None, *,
                         mode: str | None = _MACHINE,
                         glibc: tuple[int, int] | None = _MACHINE) -> dict[str, str] | None:
    """The ``GLIBC_TUNABLES`` to start with (the current ones, then ``hugetlb=1`` and the
    :data:`THRESHOLDS` the user has not set), or None when there is nothing to change:
    ``MPISTRAT_MALLOC_HUGEPAGES`` is off, the tunable is already set (either way), the C
    library is not glibc 2.35+, or the THP mode is not ``madvise`` (``mode`` and
    ``glibc`` default to this machine's)."""
    env = os.environ if environ is None else environ
    current = env.get("GLIBC_TUNABLES", "")
    named = {item.split("=")[0].strip() for item in current.split(":")}
    if TUNABLE in named:
        return None  # (also after the restart: it happens once)
    if Settings.from_env(env).malloc_hugepages is False:
        return None
    glibc = glibc_version() if glibc is _MACHINE else glibc
    mode = thp_mode() if mode is _MACHINE else mode
    if glibc is None or glibc < _MIN_GLIBC or mode != "madvise":
        return None
    added = [f"{TUNABLE}=1"] + [f"{name}={value}" for name, (value, legacy)
                                in THRESHOLDS.items() if name not in named and legacy not in env]
    return {"GLIBC_TUNABLES": ":".join(([current] if current else []) + added)}


def restart_with_hugepages() -> None:
    """Replace this process by the same command line with the tunable set, when
    :func:`malloc_hugepages_env` asks for it and MPI has not been imported yet (a
    started MPI library must not be restarted under its launcher); else return."""
    new = malloc_hugepages_env()
    if new is None or "mpi4py.MPI" in sys.modules or not getattr(sys, "orig_argv", None):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, **new})


def describe_heap(tunables: str | None, mode: str | None) -> str:
    """One line on the pages a run's small arrays got (from ``GLIBC_TUNABLES`` and the
    THP mode it ran with), for benchmark headers."""
    if tunables and f"{TUNABLE}=1" in tunables.replace(" ", ""):
        return f"heap on transparent huge pages (GLIBC_TUNABLES={tunables}, THP {mode})"
    if mode == "always":
        return "heap on transparent huge pages (THP always)"
    return (f"arrays under 4 MiB on 4 KiB pages (THP {mode or 'unknown'}"
            + (f", GLIBC_TUNABLES={tunables}" if tunables else "") + ")")
