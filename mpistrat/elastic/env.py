"""What ``mpistrat run --min-ranks`` tells the ranks of each launch (the environment),
and what the ranks read back: standard library only, so the launcher reads it without the
rest of mpistrat.

Every launch of one elastic ``mpistrat run`` carries:

* ``MPISTRAT_ELASTIC``: the job's id (32 hex digits), the same for every launch: it
  names the job's snapshots in each host's ``/dev/shm``;
* ``MPISTRAT_ELASTIC_RESTART``: 0 for the first launch, then 1, 2, ...;
* ``MPISTRAT_ELASTIC_SIZES``: the world size of every launch so far, this one last
  (``4,3``);
* ``MPISTRAT_ELASTIC_LOST``: what was lost so far, comma-separated: a host name, or
  ``host/rank`` for a single rank of a host that stayed;
* ``MPISTRAT_ELASTIC_SNAPSHOT_EVERY``: take a snapshot every k steps (``--snapshot-every``);
  0: ``auto``, at every step unless that would cost more than :data:`AUTO_SHARE` of the
  training time (then at the first step boundary after that share of time has passed).

The job's secret (``MPISTRAT_JOB_SECRET``) is the same for every launch too: snapshots
are authenticated with it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["JOB_ENV", "RESTART_ENV", "SIZES_ENV", "LOST_ENV", "EVERY_ENV", "ElasticEnv",
           "elastic_env", "rank_env", "set_job_secret", "job_secret", "AUTO_SHARE"]

JOB_ENV = "MPISTRAT_ELASTIC"
RESTART_ENV = "MPISTRAT_ELASTIC_RESTART"
SIZES_ENV = "MPISTRAT_ELASTIC_SIZES"
LOST_ENV = "MPISTRAT_ELASTIC_LOST"
EVERY_ENV = "MPISTRAT_ELASTIC_SNAPSHOT_EVERY"
_JOB = re.compile(r"[0-9a-f]{32}")
_LOST = re.compile(r"[!-+\--~]{1,255}")  # printable, no comma or space
AUTO_SHARE = 0.03  # --snapshot-every auto: the share of the training time snapshots may take
_SECRET: list[bytes] = []  # the job's secret, as mpistrat run's rank set-up holds it


@dataclass(frozen=True)
class ElasticEnv:
    """One launch of an elastic job, as its ranks see it.

    Attributes:
        job: the job's id (the same for every launch).
        restart: 0 for the first launch, then the number of relaunches so far.
        sizes: the world size of every launch so far, this one last.
        lost: hosts (``host``) and single ranks (``host/rank``) lost so far.
        snapshot_every: steps between two snapshots (0: ``auto``).
    """

    job: str
    restart: int = 0
    sizes: tuple[int, ...] = ()
    lost: tuple[str, ...] = ()
    snapshot_every: int = 0

    @property
    def resumed(self) -> bool:
        """Whether this launch follows a lost one (restart > 0)."""
        return self.restart > 0

    def as_env(self) -> dict[str, str]:
        """The variables that carry this launch to its ranks."""
        for item in self.lost:
            if not _LOST.fullmatch(item):
                raise ValueError(f"a lost host must be printable without ',' or spaces, "
                                 f"got {item!r}")
        return {JOB_ENV: self.job, RESTART_ENV: str(self.restart),
                SIZES_ENV: ",".join(str(n) for n in self.sizes),
                LOST_ENV: ",".join(self.lost), EVERY_ENV: str(self.snapshot_every)}


def elastic_env(env: Mapping[str, str] | None = None) -> ElasticEnv | None:
    """This launch of an elastic job (None: not one, or its variables are malformed:
    then snapshots are off and the job runs as any other)."""
    source = os.environ if env is None else env
    job = source.get(JOB_ENV, "")
    if not _JOB.fullmatch(job):
        return None
    try:
        restart = int(source.get(RESTART_ENV, "0"))
        sizes = tuple(int(n) for n in source.get(SIZES_ENV, "").split(",") if n)
        every = int(source.get(EVERY_ENV, "0"))
    except ValueError:
        return None
    lost = tuple(item for item in source.get(LOST_ENV, "").split(",") if item)
    if restart < 0 or every < 0 or any(n < 1 for n in sizes) or \
            not all(_LOST.fullmatch(item) for item in lost):
        return None
    return ElasticEnv(job, restart, sizes, lost, every)


def rank_env(launch: ElasticEnv) -> dict[str, str]:
    """The variables every rank of ``launch`` gets (:meth:`ElasticEnv.as_env`)."""
    return launch.as_env()


def set_job_secret(secret: bytes | None) -> None:
    """Keep the job's secret for the snapshots (``mpistrat run`` does, on every rank,
    once it holds the secret every rank shares)."""
    _SECRET[:] = [secret] if secret else []


def job_secret() -> bytes | None:
    """The job's secret (:func:`set_job_secret`), or None outside ``mpistrat run``."""
    return _SECRET[0] if _SECRET else None
