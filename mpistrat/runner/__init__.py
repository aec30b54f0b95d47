"""``mpistrat run``: run a training script on every rank, in a default strategy, and end
the job together — with every failure shown once — instead of leaving ranks waiting.

* :mod:`~mpistrat.runner.options` — the options, validated once (:class:`RunOptions`);
* :mod:`~mpistrat.runner.execute` — the script or module as ``__main__``, the default
  :class:`~mpistrat.MultiWorkerMirroredStrategy` (:func:`default_strategy`);
* :mod:`~mpistrat.runner.output` — rank tags (``--tag-output``), ``--quiet-ranks``;
* :mod:`~mpistrat.runner.failure` — tracebacks tagged with the rank, the job's end and
  its abort;
* :mod:`~mpistrat.runner.rank` — what every rank does (:func:`run`);
* :mod:`~mpistrat.runner.torchenv` — torchrun's variables (``RANK``, ``MASTER_ADDR``, ...)
  for ``torch.distributed`` scripts, and ``--torch-backend mpistrat``;
* :mod:`~mpistrat.runner.launch` — ``-n N``: starting ``mpiexec`` itself;
* :mod:`~mpistrat.runner.elastic` — ``-n N --min-ranks M``: launching the job again on
  the ranks left when ranks are lost (:func:`~mpistrat.runner.elastic.run_elastic`);
* :mod:`~mpistrat.runner.watchdog`, :mod:`~mpistrat.runner.monitor`,
  :mod:`~mpistrat.runner.sidecar` — ``--timeout`` inside MPI calls, and a lost host named
  from within the job, from ``mpistrat run -n`` and beside a plain ``mpiexec``
  (:mod:`~mpistrat.runner.hosts`: ranks and hosts in words).

The stall check and ``--timeout`` live with the agreement every collective starts with
(:mod:`mpistrat.runtime.stall`); :func:`watch_collectives` turns them on without ``mpistrat run``.
"""

from __future__ import annotations

from ..runtime.stall import unwatch as unwatch_collectives
from ..runtime.stall import watch as watch_collectives
from .execute import default_strategy
from .launch import launch_command, self_launch
from .options import RunOptions
from .rank import RunSetupError, run

__all__ = ["RunOptions", "RunSetupError", "run", "default_strategy", "launch_command",
           "self_launch", "watch_collectives", "unwatch_collectives"]
