"""Elastic training over plain MPI: ``mpistrat run -n N --min-ranks M`` keeps training
when a host is lost (see ``docs/elastic.md``).

MPI cannot shrink a running job, so recovery goes launch by launch: the launch that lost
a host ends (within ``--timeout``), ``mpistrat run`` relaunches the script on the hosts
that remain, and the script's usual ``CheckpointManager.restore_or_initialize()``
restores the newest snapshot a surviving host holds in RAM — taken at every step
boundary, so at most one step is redone — with the input pipeline's position, so the
same global batches follow in the same order, now split over fewer ranks.

* :func:`info` — whether this is an elastic job, which launch, on how many ranks, and
  what was lost so far;
* :func:`step` — a step boundary, for training loops that do not iterate a distributed
  dataset (whose iterator marks them itself);
* :mod:`~mpistrat.elastic.env` — the variables the launcher hands each launch;
* :mod:`~mpistrat.elastic.hooks` — where step boundaries meet the snapshots.
"""

from __future__ import annotations

from . import hooks
from .env import ElasticEnv, elastic_env

__all__ = ["ElasticEnv", "info", "step"]


def info() -> ElasticEnv | None:
    """This launch of an elastic job (``restart``: how many relaunches came before it;
    ``sizes``: the number of ranks of every launch, this one last; ``lost``: the hosts
    lost so far), or None outside one."""
    return elastic_env()


def step() -> None:
    """Mark a step boundary: every rank holds the state after a whole number of steps
    (call it at the top of the training loop, on every rank). In an elastic job the
    checkpoint manager's snapshot is taken here; otherwise it costs one branch."""
    hooks.step_boundary(None)
