"""Settings read from ``MPISTRAT_*`` environment variables, in one place.

Precedence everywhere is: explicit argument, then environment variable, then default.
A malformed environment value is not an error (a job should not die on a typo in an
optional knob): it is reported as a ``RuntimeWarning`` naming the variable and the
value, and the default is used.

Variables:
    MPISTRAT_RANKS_PER_NODE: group every k consecutive ranks of a physical node into a
        virtual node, so hierarchical algorithms run their cross-node stage on one
        machine (tests, experiments). Unset: node groups are the physical nodes.
    MPISTRAT_STALL_CHECK: seconds after which ``mpistrat run`` reports the ranks that
        have not arrived in a collective (default 60; 0 turns the check off).
    MPISTRAT_COLLECTIVE_TIMEOUT: seconds after which ``mpistrat run`` gives up waiting
        in a collective and aborts the job (default: never).
    MPISTRAT_CUDA_AWARE_MPI: ``1`` passes GPU buffers to MPI directly, ``0`` stages them
        through pinned host memory, ``auto`` (default) asks the MPI library
        (``MPIX_Query_cuda_support``). Also ``true/false``, ``yes/no``, ``on/off``.
    MPISTRAT_MALLOC_HUGEPAGES: ``0`` keeps ``mpistrat run`` and ``mpistrat bench`` from
        restarting with glibc's ``glibc.malloc.hugetlb=1`` (transparent huge pages for
        the whole heap, see :mod:`mpistrat.launch.hugepages`); ``1``/``auto`` (default):
        restart when it helps.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Settings"]

RANKS_PER_NODE = "MPISTRAT_RANKS_PER_NODE"
STALL_CHECK = "MPISTRAT_STALL_CHECK"
COLLECTIVE_TIMEOUT = "MPISTRAT_COLLECTIVE_TIMEOUT"
CUDA_AWARE_MPI = "MPISTRAT_CUDA_AWARE_MPI"
MALLOC_HUGEPAGES = "MPISTRAT_MALLOC_HUGEPAGES"
# MASTER_ADDR:MASTER_PORT when mpistrat run chose them for a torch script (not the user):
# set by mpistrat.runner.torchenv, read by mpistrat.torch.rendezvous
RUN_MASTER = "MPISTRAT_RUN_MASTER"


@dataclass(frozen=True)
class Settings:
    """Options that can come from the environment.

    Attributes:
        ranks_per_node: virtual node size (None: physical nodes).
        stall_check: seconds before a stall report (None: unset; 0: off).
        collective_timeout: seconds before a collective gives up (None: unset; 0: never).
        cuda_aware_mpi: force passing GPU buffers to MPI (True) or staging them (False);
            None: detect.
        malloc_hugepages: False when the heap must keep glibc's default pages; None or
            True: huge pages when the machine supports them.
    """

    ranks_per_node: int | None = None
    stall_check: float | None = None
    collective_timeout: float | None = None
    cuda_aware_mpi: bool | None = None
    malloc_hugepages: bool | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Read the ``MPISTRAT_*`` variables of ``environ`` (default ``os.environ``)."""
        env = os.environ if environ is None else environ
        return cls(ranks_per_node=_positive_int(env, RANKS_PER_NODE),
                   stall_check=_seconds(env, STALL_CHECK),
                   collective_timeout=_seconds(env, COLLECTIVE_TIMEOUT),
                   cuda_aware_mpi=_on_off_auto(
                       env, CUDA_AWARE_MPI, "=0 to stage GPU buffers through host memory"),
                   malloc_hugepages=_on_off_auto(
                       env, MALLOC_HUGEPAGES, "=0 to keep the heap on 4 KiB pages"))


def _positive_int(env: Mapping[str, str], name: str) -> int | None:
    text = env.get(name, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        warnings.warn(
            f"{name}={text!r} is not a positive integer; ignoring it (expected e.g. "
            f"{name}=2)",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return value


def _seconds(env: Mapping[str, str], name: str) -> float | None:
    text = env.get(name, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        warnings.warn(
            f"{name}={text!r} is not a number of seconds >= 0; ignoring it (expected e.g. "
            f"{name}=60, or 0 to turn it off)",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return value


_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _on_off_auto(env: Mapping[str, str], name: str, example: str) -> bool | None:
    text = env.get(name, "").strip()
    if not text or text.lower() == "auto":
        return None
    if text.lower() in _ON:
        return True
    if text.lower() in _OFF:
        return False
    warnings.warn(
        f"{name}={text!r} is not 1, 0 or auto; ignoring it (using auto instead; expected "
        f"e.g. {name}{example})",
        RuntimeWarning,
        stacklevel=3,
    )
    return None
