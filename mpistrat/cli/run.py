"""``mpistrat run``: run a training script on every rank. A thin layer over
:mod:`mpistrat.runner`."""

from __future__ import annotations

import os
import re
from typing import Any

import click

from ..config import Settings
from ..errors import MpistratError
from ._ranked import RankedCommand

__all__ = ["run"]

TORCH_BACKEND_ENV = "MPISTRAT_TORCH_BACKEND"  # --torch-backend's default


class _SetupError(click.ClickException):
    """A problem found before the script starts (exit status 2, like a usage error)."""

    exit_code = 2

    def format_message(self) -> str:
        return self.message


class RunCommand(RankedCommand):
    """Options end at the script (or at ``-m MODULE``): what follows is the script's.
    Every rank parses the same arguments, so only rank 0 prints an error."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, _end_options_at_module(args))


def _end_options_at_module(args: list[str]) -> list[str]:
    """``[..., -m, MOD, *rest]`` → ``[..., -m, MOD, --, *rest]``, so that ``rest`` goes
    to the module as ``python -m`` would pass it (only before the script position)."""
    takes_value = {"-n", "--np", "--mpiexec", "--spec", "--num-packs", "--communication",
                   "--local-replicas", "--gpus-per-rank", "--timeout", "--stall-check",
                   "--report-dir", "--num-ps", "--torch-backend", "--min-ranks",
                   "--max-restarts", "--snapshot-every", "--trace", "--trace-steps"}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--" or not arg.startswith("-"):
            return args
        if arg in ("-m", "--module"):
            return [*args[:i + 2], "--", *args[i + 2:]]
        if arg.startswith("-m") and not arg.startswith("--"):  # -mpackage.module
            return [*args[:i + 1], "--", *args[i + 1:]]
        i += 2 if arg in takes_value else 1
    return args


_EPILOG = """\b
Examples:
  mpiexec -n 4 mpistrat run train.py --epochs 10
  mpistrat run -n 2 train.py                      start mpiexec itself
  mpistrat run -n 2 -m mypackage.train --lr 0.1
  mpiexec -n 8 mpistrat run --spec @allreduce.spec --tag-output train.py
  srun --mpi=pmi2 python -m mpistrat run --timeout 600 train.py
  mpistrat run -n 4 --torch-backend mpistrat torch_ddp.py   a torchrun script
  mpistrat run -n 4 --min-ranks 2 --timeout 30 train.py   keep training when a host is lost
"""


def _settings() -> Any:
    return Settings.from_env()


def _elastic_options(np_: int | None, min_ranks: int | None, max_restarts: int | None,
                     snapshot_every: int | None, options: Any) -> Any:
    """The checked ElasticOptions of --min-ranks (None: not an elastic job)."""
    if min_ranks is None:
        given = [name for name, value in (("--max-restarts", max_restarts),
                                          ("--snapshot-every", snapshot_every))
                 if value is not None]
        if given:
            many = len(given) > 1
            raise click.UsageError(f"{' and '.join(given)} {'go' if many else 'goes'} with "
                                   f"--min-ranks M (elastic training); add --min-ranks or "
                                   f"leave {'them' if many else 'it'} out")
        return None
    if np_ is None:
        raise click.UsageError("--min-ranks goes with -n N: mpistrat run launches a job "
                               "again only when it starts mpiexec itself")
    # here, not at the top: only this command needs it (start-up time)
    from ..runner.elastic import DEFAULT_MAX_RESTARTS, DEFAULT_SNAPSHOT_EVERY, ElasticOptions

    if snapshot_every is not None:
        text = str(snapshot_every).strip().lower()
        if text == "auto":
            snapshot_every = 0
        elif re.fullmatch(r"\d{1,9}", text) and int(text) >= 1:
            snapshot_every = int(text)
        else:
            raise click.UsageError(f"--snapshot-every must be a number of steps >= 1, or "
                                   f"auto, got {snapshot_every!r}")
    try:
        return ElasticOptions(
            ranks=np_, min_ranks=min_ranks,
            max_restarts=DEFAULT_MAX_RESTARTS if max_restarts is None else max_restarts,
            snapshot_every=(DEFAULT_SNAPSHOT_EVERY if snapshot_every is None
                            else snapshot_every),
            timeout=options.timeout, num_ps=options.num_ps)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


@click.command(cls=RunCommand, epilog=_EPILOG,
               context_settings={"allow_interspersed_args": False})
@click.option("-n", "--np", "np_", type=click.IntRange(min=1), metavar="N",
              help="Start N ranks with the mpiexec that matches mpi4py (instead of "
                   "mpiexec -n N mpistrat run ...).")
@click.option("--mpiexec", metavar="PATH", help="With -n: the mpiexec to use.")
@click.option("-m", "--module", metavar="MODULE",
              help="Run a module as __main__ (like python -m); arguments after it are the "
                   "module's.")
@click.option("--spec", metavar="SPEC|@FILE",
              help="All-reduce spec of the default strategy's MultiWorkerAllReduce, e.g. "
                   "'rechd:64K:xring', or @FILE (a spec saved by mpistrat bench --save).")
@click.option("--num-packs", type=click.IntRange(min=0), metavar="K",
              help="num_packs of that MultiWorkerAllReduce (0: no packing).")
@click.option("--communication", type=click.Choice(["auto", "ring", "nccl"],
                                                   case_sensitive=False),
              default="auto", show_default=True,
              help="The default strategy's CollectiveCommunication.")
@click.option("--local-replicas", type=click.IntRange(min=1), metavar="K",
              help="CPU replicas per rank (default MPISTRAT_LOCAL_REPLICAS or 1).")
@click.option("--gpus-per-rank", type=click.IntRange(min=1), metavar="G",
              help="GPU replicas per rank (needs CuPy).")
@click.option("--tag-output", is_flag=True, help="Prefix every output line with [rank].")
@click.option("--quiet-ranks", is_flag=True,
              help="Show only rank 0's output (failure reports are always shown).")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), metavar="SECONDS",
              help="End the job when a rank stays longer than this in one collective "
                   "(waiting for the others, or exchanging the data), naming the ranks or "
                   "hosts that did not come or do not answer [default: "
                   "MPISTRAT_COLLECTIVE_TIMEOUT, else never].")
@click.option("--stall-check", type=click.FloatRange(min=0), metavar="SECONDS",
              help="Report the ranks missing from a collective after this long; 0: off "
                   "[default: MPISTRAT_STALL_CHECK, else 60].")
@click.option("--report-dir", metavar="DIR",
              help="A rank that ends abnormally (a failure, a timeout, a lost host) also "
                   "writes its report to DIR/rank-R.txt: the only copy that survives when "
                   "its host is cut off from the launcher. Use a directory every host "
                   "shares [default: MPISTRAT_REPORT_DIR, else none].")
@click.option("--num-ps", type=click.IntRange(min=1), metavar="P",
              help="Parameter-server training: ranks 1..P hold the variables, rank 0 "
                   "coordinates, the rest are workers (MPISTRAT_NUM_PS for the script's "
                   "ParameterServerStrategy); no default strategy is installed.")
@click.option("--torch-backend", type=click.Choice(["mpistrat", "gloo"], case_sensitive=False),
              help="What serves a torch.distributed script's gloo process groups (and "
                   "those asking for no backend): mpistrat = the 'mpistrat' backend, over "
                   "MPI (needs mpistrat[torch]); gloo = torch's own [default: "
                   "MPISTRAT_TORCH_BACKEND, else the script's choice, untouched]. Either "
                   "way, torchrun's RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, "
                   "... are set from MPI.")
@click.option("--min-ranks", type=int, metavar="M",
              help="With -n: elastic training. When ranks are lost (a host, or on one host "
                   "a rank, dies; a partition), launch the job again on the ranks left, "
                   "as long as at least M (1..N) are; needs --timeout. A failure the script "
                   "raises is not restarted.")
@click.option("--max-restarts", type=int, metavar="R",
              help="With --min-ranks: launch the job again at most R times (0: never) "
                   "[default: 3].")
@click.option("--snapshot-every", metavar="K|auto",
              help="With --min-ranks: snapshot the state into each host's RAM every K "
                   "steps; auto: every step unless that costs more than 3% of the "
                   "training time (then as often as 3% allows) [default: auto].")
@click.option("--trace", "trace_dir", metavar="DIR",
              help="Every rank writes its trace to DIR/rank-R.json (Perfetto, "
                   "chrome://tracing and HTA open it; mpistrat trace merge/summary DIR). "
                   "Use a directory every host shares [default: MPISTRAT_TRACE, else off].")
@click.option("--trace-steps", metavar="A:B",
              help="With --trace: record steps A to B-1 (A: from A on; N: the first N) "
                   "[default: MPISTRAT_TRACE_STEPS, else 0:100].")
@click.argument("script_and_args", nargs=-1, type=click.UNPROCESSED, metavar="SCRIPT [ARGS]...")
@click.pass_context
def run(ctx, np_, mpiexec, module, spec, num_packs, communication, local_replicas,
        gpus_per_rank, tag_output, quiet_ranks, timeout, stall_check, report_dir, num_ps,
        torch_backend, min_ranks, max_restarts, snapshot_every, trace_dir, trace_steps,
        script_and_args):
    """Run a training script on every rank in a default MultiWorkerMirroredStrategy.

    The script runs as __main__ with its arguments; mpistrat.get_strategy() returns the
    strategy the options describe. With --num-ps, no strategy is installed: the script
    constructs a ParameterServerStrategy, and the job ends when rank 0's script does.

    An uncaught exception or a non-zero sys.exit on any rank prints that rank's
    traceback, tagged with its rank, once, and ends the whole job with a non-zero
    status. Ranks missing from a collective are named after --stall-check seconds; with
    --timeout, no rank stays longer than that in one collective (its data exchange
    included), and ranks or hosts that cannot be reached are named. With -n and
    --min-ranks, a job that loses ranks is launched again on the ranks left (the ranks
    resume from their snapshots or checkpoints).
    """
    # here, not at the top: only this command needs it (start-up time)
    from ..launch.hugepages import restart_with_hugepages
    from ..runner import RunOptions, RunSetupError

    if np_ is None:  # a rank (with -n, the launcher hands the ranks the tunable instead)
        restart_with_hugepages()  # (returns when nothing changes; MPI has not started yet)
    args = list(script_and_args)
    if module is None:
        if not args:
            raise click.UsageError("give the script to run: mpistrat run [OPTIONS] SCRIPT "
                                   "[ARGS]... (or -m MODULE [ARGS]...)")
        target, args = args[0], args[1:]
    else:
        target = module
    if args[:1] == ["--"]:
        args = args[1:]
    settings = _settings()
    if timeout is None and settings.collective_timeout:
        timeout = settings.collective_timeout
    if stall_check is None:
        stall_check = 60.0 if settings.stall_check is None else settings.stall_check
    if report_dir is None:
        report_dir = os.environ.get("MPISTRAT_REPORT_DIR") or None
    if report_dir is not None:
        report_dir = os.path.abspath(report_dir)  # the ranks may start elsewhere
    if torch_backend is None:
        torch_backend = os.environ.get(TORCH_BACKEND_ENV) or None
    if trace_dir is None:
        trace_dir = os.environ.get("MPISTRAT_TRACE") or None
    if trace_steps is None:
        trace_steps = os.environ.get("MPISTRAT_TRACE_STEPS") or None
    if trace_steps is not None and trace_dir is None:
        raise click.UsageError("--trace-steps goes with --trace DIR")
    if trace_dir is not None:
        trace_dir = os.path.abspath(trace_dir)  # the ranks may start elsewhere
    try:
        options = RunOptions(
            target=target, args=tuple(args), module=module is not None, spec=spec,
            num_packs=num_packs, communication=communication.lower(),
            local_replicas=local_replicas, gpus_per_rank=gpus_per_rank,
            tag_output=tag_output, quiet_ranks=quiet_ranks, timeout=timeout,
            stall_check=stall_check, report_dir=report_dir, num_ps=num_ps,
            torch_backend=None if torch_backend is None else torch_backend.lower(),
            trace_dir=trace_dir, trace_steps=trace_steps)
    except MpistratError as exc:  # the spec
        raise click.UsageError(f"--spec {spec}: {exc}") from None
    except ValueError as exc:
        if torch_backend is not None and "--torch-backend" in str(exc):
            raise click.UsageError(f"{exc} (from {TORCH_BACKEND_ENV})") from None
        raise click.UsageError(str(exc)) from None
    if mpiexec is not None and np_ is None:
        raise click.UsageError("--mpiexec goes with -n N (mpistrat run starts mpiexec only "
                               "with -n)")
    elastic = _elastic_options(np_, min_ranks, max_restarts, snapshot_every, options)
    try:
        if np_ is not None:
            # here, not at the top: only this command needs it (start-up time)
            from ..runner import launch_command, self_launch
            from ..runner.execute import check_target
            from ..runner.launch import job_hosts
            from ..runner.monitor import JobMonitor, bind_address

            problem = check_target(options)  # the ranks check again, on their nodes
            if problem is not None:
                raise _SetupError(f"mpistrat run: {problem}")
            if elastic is not None:
                from ..runner.elastic import run_elastic

                ctx.exit(run_elastic(options, elastic, mpiexec).status)
            # the monitor names lost hosts when the launcher cannot (runner/monitor.py);
            # it listens where only the job's hosts can reach it
            with JobMonitor(np_, timeout=options.timeout, report_dir=options.report_dir,
                            bind=bind_address(job_hosts(),
                                              os.environ.get("HYDRA_IFACE"))) as monitor:
                status = monitor.finish(self_launch(launch_command(options, np_, mpiexec)))
            ctx.exit(status)
        # here, not at the top: only this command needs it (start-up time)
        from ..runner import run as run_job

        ctx.exit(run_job(options))
    except RunSetupError as exc:
        raise _SetupError(str(exc)) from None
    except MpistratError as exc:
        raise _SetupError(f"mpistrat run: {exc}") from None
