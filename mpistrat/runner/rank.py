"""What every rank does under ``mpistrat run``: check, set up, run the script, end together."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from ..elastic.env import set_job_secret
from ..errors import RunSetupError
from ..launch.env import detect
from ..ps.roles import NUM_PS_ENV
from ..runtime import stall
from ..runtime._mpi import mpi
from ..strategy.mirrored import LOCAL_REPLICAS
from .. import trace
from . import auth, sidecar, torchenv
from .execute import check_target, default_strategy, run_target, set_default_strategy
from .failure import Outcome, finish, outcome_of
from .monitor import MONITOR_ENV, MonitorClient
from .options import RunOptions
from .output import RankOutput
from .reports import report_path
from .watchdog import Watchdog

__all__ = ["run", "RunSetupError"]


def run(options: RunOptions, *,
        strategy_factory: Callable[[RunOptions], Any] | None = default_strategy,
        set_strategy: Callable[[Any], None] = set_default_strategy,
        env: Mapping[str, str] | None = None) -> int:
    """Run ``options.target`` on this rank; every rank of ``COMM_WORLD`` calls it.

    Before the script, torchrun's variables (``RANK``, ``MASTER_ADDR``, ...) are set where
    unset (:mod:`~mpistrat.runner.torchenv`; undone when this returns), and with
    ``--torch-backend mpistrat`` gloo process groups become ``"mpistrat"`` ones.

    Args:
        options: what to run and how.
        strategy_factory: builds the default strategy from the options (collective);
            None runs the script without one.
        set_strategy: makes a strategy current process-wide (None: back to the default).
        env: the environment, for launcher detection (default ``os.environ``).

    Returns:
        The job's exit status, the same on every rank (the highest of any rank). When a
        rank fails while the others still run, it aborts the job instead of returning.

    Raises:
        RunSetupError: on every rank, before the script starts (see the class).
    """
    world = mpi().COMM_WORLD
    size = world.Get_size()
    mismatch = detect(env).mismatch(size)
    if mismatch is not None:
        raise RunSetupError(f"mpistrat run: {mismatch}; or let 'mpistrat run -n N ...' start "
                            f"the matching mpiexec")
    problems = world.allgather(check_target(options))
    bad = {text: [r for r, t in enumerate(problems) if t == text] for text in problems if text}
    if bad:
        text, ranks = next(iter(bad.items()))
        where = "" if len(ranks) == size else f" (on rank(s) {ranks} of {size})"
        raise RunSetupError(f"mpistrat run: {text}{where}")
    # torchrun's variables, for torch.distributed scripts (undone when run returns)
    saved = torchenv.set_torch_env(world)
    try:
        if options.torch_backend == "mpistrat":
            torchenv.use_mpistrat_backend(world)
        return _run_job(options, world, strategy_factory, set_strategy, env)
    finally:
        torchenv.restore_env(saved)


def _run_job(options: RunOptions, world: Any,
             strategy_factory: Callable[[RunOptions], Any] | None,
             set_strategy: Callable[[Any], None], env: Mapping[str, str] | None) -> int:
    rank, size = world.Get_rank(), world.Get_size()
    done = world.Dup()
    try:
        output = RankOutput(rank, size, tag=options.tag_output,
                            quiet=options.quiet_ranks and rank != 0)
        with output:
            watch = stall.watch(options.stall_check or None, options.timeout,
                                 report=output.report)
            host = mpi().Get_processor_name()
            # the job's secret (docs/security.md): mpistrat run -n's, else rank 0's own;
            # every rank holds rank 0's, broadcast over MPI (the job's own channel)
            mine = auth.take_secret(env)
            secret = world.bcast((mine or auth.new_secret()) if rank == 0 else None, root=0)
            set_job_secret(secret)  # (snapshots of an elastic job are authenticated with it)
            if MONITOR_ENV in (os.environ if env is None else env):  # mpistrat run -n
                client = MonitorClient.connect(env, rank, host, secret)
            else:  # a plain mpiexec across hosts: the job's own monitor (collective)
                client = sidecar.start(world, rank, host, secret)
            notify = client.end if client is not None else None
            dog = None
            try:
                if watch is not None:
                    report_file = (report_path(options.report_dir, rank)
                                   if options.report_dir else None)
                    dog = Watchdog.start(watch, watch.side, output.report, report_file,
                                         (lambda status, text: notify(status))
                                         if notify is not None else None, secret=secret)
                    dog.phase = "running the script"
                if options.trace_dir is not None:
                    start_trace(world, options.trace_dir, options.trace_steps)
                outcome = _run_script(options, strategy_factory, set_strategy)
                trace.flush()  # (a failed rank may abort the job in finish)
                if dog is not None:
                    dog.phase = ("finished the script" if outcome.status == 0 else
                                 f"ending after a failure (status {outcome.status})")
                    dog.ending = outcome.status != 0
                if watch is not None and outcome.status == 0:
                    watch.announce("finished the script")
                status = finish(done, outcome, output, watchdog=dog, notify=notify)
                trace.stop(collective=status == 0)  # (every rank got here)
                if notify is not None:
                    notify(status)
                return status
            finally:
                if dog is not None:
                    dog.stop()
                stall.unwatch()
    finally:
        done.Free()


def start_trace(world: Any, directory: str, steps: str | None) -> None:
    """``--trace``: every rank's trace into ``directory`` (a relaunch of an elastic job
    into ``directory/restart-K``, so the launches' files stay apart)."""
    restart = os.environ.get("MPISTRAT_ELASTIC_RESTART", "0")
    if restart.isdigit() and int(restart) > 0:
        directory = os.path.join(directory, f"restart-{int(restart)}")
    elif world.Get_rank() == 0:
        _clear_old_relaunches(directory)
    try:
        trace.start(directory, steps, comm=world)
    except trace.TraceError as exc:
        raise RunSetupError(f"mpistrat run --trace: {exc}") from None


def _clear_old_relaunches(directory: str) -> None:
    """An earlier job's ``restart-K`` folders in a trace directory: their rank files go
    (so that none is read as this job's), and the folders too once empty; anything else
    in them is left alone."""
    try:
        names = os.listdir(directory)
    except OSError:
        return  # (not there yet: trace.start makes it, or says why it cannot)
    for name in names:
        folder = os.path.join(directory, name)
        if not re.fullmatch(r"restart-\d+", name) or os.path.islink(folder) \
                or not os.path.isdir(folder):
            continue
        for inner in os.listdir(folder):
            if re.fullmatch(r"rank-\d+\.json", inner):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(folder, inner))
        with contextlib.suppress(OSError):
            os.rmdir(folder)


def _end_parameter_servers(failed: bool) -> None:
    module = sys.modules.get("mpistrat.ps.strategy")
    if module is not None:
        module.shutdown_all(failed)


def _run_script(options: RunOptions, strategy_factory: Callable[[RunOptions], Any] | None,
                set_strategy: Callable[[Any], None]) -> Outcome:
    strategy = None
    if strategy_factory is not None and options.num_ps is None:  # (ps: the script's own)
        try:
            strategy = strategy_factory(options)
        except Exception as exc:  # noqa: BLE001 - reported like the script's own failures
            return Outcome(1, "mpistrat run: could not create the default strategy from the "
                              "options: " + "".join(traceback.format_exception_only(exc)))
    try:
        if strategy is not None:
            set_strategy(strategy)
        if options.num_ps is not None:
            os.environ[NUM_PS_ENV] = str(options.num_ps)
        if options.local_replicas is not None:  # (also for the script's own strategies)
            os.environ[LOCAL_REPLICAS] = str(options.local_replicas)
        # a parameter-server job ends when the coordinator's script does: its workers and
        # ps serve until then, so they are released before the ranks end together (after
        # a failure with functions still running, the job's abort ends them)
        try:
            run_target(options)
        except BaseException:
            _end_parameter_servers(failed=True)
            raise
        _end_parameter_servers(failed=False)
    except BaseException as exc:  # noqa: BLE001 - every way a script can end is reported
        return outcome_of(exc, options.target)
    finally:
        if strategy is not None:
            try:
                set_strategy(None)
            except RuntimeError:
                pass  # the script left a scope() open; the process ends anyway
    return Outcome(0)
