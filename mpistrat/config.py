"""Settings read from ``MPISTRAT_*`` environment variables, in one place.

Precedence everywhere is: explicit argument, then environment variable, then default.
A malformed environment value is not an error (a job should not die on a typo in an
optional knob): it is reported as a ``RuntimeWarning`` naming the variable and the
value, and the default is used.

Variables:
    MPISTRAT_RANKS_PER_NODE: group every k consecutive ranks of a physical node into a
        virtual node, so hierarchical algorithms run their cross-node stage on one
        machine (tests, experiments). Unset: node groups are the physical nodes.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Settings"]

RANKS_PER_NODE = "MPISTRAT_RANKS_PER_NODE"


@dataclass(frozen=True)
class Settings:
    """Options that can come from the environment.

    Attributes:
        ranks_per_node: virtual node size (None: physical nodes).
    """

    ranks_per_node: int | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Read the ``MPISTRAT_*`` variables of ``environ`` (default ``os.environ``)."""
        env = os.environ if environ is None else environ
        return cls(ranks_per_node=_positive_int(env, RANKS_PER_NODE))


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
