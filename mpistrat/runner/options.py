"""The options of ``mpistrat run``, validated once into a frozen record (no MPI needed)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..bench.recommend import resolve_spec

__all__ = ["RunOptions", "COMMUNICATIONS", "DEFAULT_STALL_CHECK", "TORCH_BACKENDS"]

COMMUNICATIONS = ("auto", "ring", "nccl")
# --torch-backend: what serves a torch.distributed script's gloo (and default-backend)
# process groups (mpistrat.runner.torchenv)
TORCH_BACKENDS = ("mpistrat", "gloo")
DEFAULT_STALL_CHECK = 60.0


@dataclass(frozen=True)
class RunOptions:
    """What ``mpistrat run`` was asked to do on every rank.

    Attributes:
        target: the script's path, or the module's name when ``module``.
        args: the script's arguments (``sys.argv[1:]`` inside it).
        module: run ``target`` as a module (``-m``), like ``python -m``.
        spec: the all-reduce spec text (a spec or ``@FILE``) of the default strategy's
            :class:`~mpistrat.MultiWorkerAllReduce`; None: the strategy's default.
        num_packs: that op's ``num_packs``; None: the strategy's default.
        communication: ``auto``, ``ring`` or ``nccl``.
        local_replicas: CPU replicas per rank (None: the strategy's default).
        gpus_per_rank: GPU replicas per rank (None: CPU replicas).
        tag_output: prefix every line a rank prints with ``[rank] ``.
        quiet_ranks: only rank 0's output is shown (failure reports always are).
        timeout: seconds a rank waits in a collective before the job aborts (None: never).
        stall_check: seconds before ranks missing from a collective are reported (0: off).
        report_dir: a directory (on a file system every host shares) where a rank that
            ends abnormally writes its report, ``rank-R.txt``; None: none.
        num_ps: parameter-server training: this many ps ranks (``MPISTRAT_NUM_PS`` for
            the script's :class:`~mpistrat.ParameterServerStrategy`), and no default
            strategy; None: synchronous training under the default strategy.
        torch_backend: ``"mpistrat"``: the script's ``torch.distributed`` process groups
            that ask for gloo, or for no backend, get the ``"mpistrat"`` backend
            (:func:`mpistrat.torch.use_instead_of_gloo`, before the script);
            ``"gloo"`` or None: torch's own choice, untouched.
        trace_dir: every rank writes its trace there (:mod:`mpistrat.trace`); None: off.
        trace_steps: the traced steps, ``"A:B"`` (None: the default window).
    """

    target: str
    args: tuple[str, ...] = ()
    module: bool = False
    spec: str | None = None
    num_packs: int | None = None
    communication: str = "auto"
    local_replicas: int | None = None
    gpus_per_rank: int | None = None
    tag_output: bool = False
    quiet_ranks: bool = False
    timeout: float | None = None
    stall_check: float = DEFAULT_STALL_CHECK
    report_dir: str | None = None
    num_ps: int | None = None
    torch_backend: str | None = None
    trace_dir: str | None = None
    trace_steps: str | None = None
    parsed_spec: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.target, str) or not self.target.strip():
            raise ValueError("give the script to run (mpistrat run script.py [args]) or a "
                             "module (mpistrat run -m package.module [args])")
        object.__setattr__(self, "args", tuple(self.args))
        if self.communication not in COMMUNICATIONS:
            raise ValueError(f"--communication must be one of {', '.join(COMMUNICATIONS)}, "
                             f"got {self.communication!r}")
        for name, value, least in (("--num-packs", self.num_packs, 0),
                                   ("--num-ps", self.num_ps, 1),
                                   ("--local-replicas", self.local_replicas, 1),
                                   ("--gpus-per-rank", self.gpus_per_rank, 1)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < least):
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        if self.local_replicas is not None and self.gpus_per_rank is not None:
            raise ValueError(f"--local-replicas {self.local_replicas} (CPU replicas) and "
                             f"--gpus-per-rank {self.gpus_per_rank} (GPU replicas) exclude "
                             f"each other; give one")
        if self.timeout is not None and not 0 < self.timeout < math.inf:
            raise ValueError(f"--timeout must be a number of seconds > 0, got {self.timeout!r}")
        if not 0 <= self.stall_check < math.inf:
            raise ValueError(f"--stall-check must be a number of seconds >= 0 (0: off), got "
                             f"{self.stall_check!r}")
        if self.report_dir is not None and (not isinstance(self.report_dir, str)
                                            or not self.report_dir.strip()):
            raise ValueError(f"--report-dir must be a directory path, got {self.report_dir!r}")
        if self.torch_backend is not None and self.torch_backend not in TORCH_BACKENDS:
            raise ValueError(f"--torch-backend must be one of {', '.join(TORCH_BACKENDS)}, "
                             f"got {self.torch_backend!r}")
        if self.trace_steps is not None:
            if self.trace_dir is None:
                raise ValueError("--trace-steps goes with --trace DIR")
            from ..trace import TraceError, parse_steps
            try:
                parse_steps(self.trace_steps)
            except TraceError as exc:
                raise ValueError(str(exc)) from None
        if self.trace_dir is not None and (not isinstance(self.trace_dir, str)
                                           or not self.trace_dir.strip()):
            raise ValueError(f"--trace must be a directory path, got {self.trace_dir!r}")
        if self.spec is not None and self.parsed_spec is None:
            object.__setattr__(self, "parsed_spec", resolve_spec(self.spec))

    def command_line(self) -> list[str]:
        """The ``mpistrat run`` arguments that give these options (for self-launching)."""
        argv: list[str] = []
        if self.spec is not None:
            argv += ["--spec", self.spec]
        if self.num_packs is not None:
            argv += ["--num-packs", str(self.num_packs)]
        if self.communication != "auto":
            argv += ["--communication", self.communication]
        if self.local_replicas is not None:
            argv += ["--local-replicas", str(self.local_replicas)]
        if self.gpus_per_rank is not None:
            argv += ["--gpus-per-rank", str(self.gpus_per_rank)]
        if self.tag_output:
            argv.append("--tag-output")
        if self.quiet_ranks:
            argv.append("--quiet-ranks")
        if self.timeout is not None:
            argv += ["--timeout", repr(self.timeout)]
        argv += ["--stall-check", repr(self.stall_check)]
        if self.report_dir is not None:
            argv += ["--report-dir", self.report_dir]
        if self.num_ps is not None:
            argv += ["--num-ps", str(self.num_ps)]
        if self.torch_backend is not None:
            argv += ["--torch-backend", self.torch_backend]
        if self.trace_dir is not None:
            argv += ["--trace", self.trace_dir]
        if self.trace_steps is not None:
            argv += ["--trace-steps", self.trace_steps]
        argv += ["-m", self.target] if self.module else [self.target]
        return argv + list(self.args)
