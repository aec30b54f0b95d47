"""Run a benchmark end to end: validate on every rank, measure, print and write results.

Two phases with different failure rules (mpi4py's ``run.py`` and the project's
reliability rules):

* **validation** (:func:`prepare_sweep`): every check runs on every rank and the
  verdicts are exchanged, so a bad option or a missing package is the same error on
  every rank, raised before any measurement;
* **measurement**: an exception on any rank after that is a bug or a broken machine;
  the rank prints its traceback tagged with its rank and aborts the job, so no rank is
  left waiting in a collective.

Only rank 0 prints and writes files.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

from ..backends import get_backend
from ..backends.capabilities import probe_gpus
from ..errors import BackendUnavailable, MpistratError
from ..layout import Layout
from ..runtime._mpi import Comm, world
from ..runtime.topology import get_topology
from ..spec import format_bytes
from . import costmodel, files
from .config import BenchConfig
from .entries import Entry, select_entries
from .metadata import collect
from .peers import TorchPeer, join_mpistrat, require_torch
from .plot import plot, require_matplotlib
from .progress import Progress
from .recommend import Recommendation, recommend, write_spec_file
from .report import Table, describe_run, format_ratio, summary_lines
from .results import Point, baseline_of, group_by_size
from .timing import Sweep

__all__ = ["Outputs", "SweepPlan", "SweepResult", "prepare_sweep", "run_sweep", "analyse",
           "analyse_file", "collective_check", "abort_on_error", "best_lines", "command_line",
           "join_torch", "close_peers"]


@dataclass(frozen=True)
class Outputs:
    """What to produce besides the table (all on rank 0).

    Attributes:
        json, csv, markdown, plot: files to write (None: not written).
        recommend: print the recommended spec; ``save``: also write it to this file.
        tolerance: ties within this fraction of the fastest (see ``recommend``).
        model: print the cost model; ``predict_ranks``/``predict_ranks_per_node``:
            also predict that job size (ranks per node default: the measured job's).
        model_with: more ``--json`` sweeps (other layouts) to fit the model on;
            model_from: use the model saved in this ``--json`` file instead of fitting
            (its errors on this run's points are what ``model`` prints).
    """

    json: str | None = None
    csv: str | None = None
    markdown: str | None = None
    plot: str | None = None
    recommend: bool = False
    save: str | None = None
    tolerance: float = 0.03
    model: bool = False
    predict_ranks: int | None = None
    predict_ranks_per_node: int | None = None
    model_with: tuple[str, ...] = ()
    model_from: str | None = None


@dataclass
class SweepPlan:
    """A validated sweep: what every rank is about to measure."""

    comm: Comm
    config: BenchConfig
    entries: list[Entry]
    sizes: list[int]
    layout: Layout
    notes: list[str]
    peers: list[TorchPeer] = field(default_factory=list)


@dataclass
class SweepResult:
    """What a sweep produced (complete on rank 0)."""

    meta: dict[str, Any]
    points: list[Point]
    recommendation: Recommendation | None = None
    model: costmodel.CostModel | None = None
    prediction: costmodel.Prediction | None = None
    runs: dict[int, dict[str, Any]] = field(default_factory=dict)


# ----------------------------------------------------------------- failure handling


def collective_check(comm: Comm, check: Callable[[], Any]) -> Any:
    """Run ``check`` on every rank; if it raised a user error (ValueError, TypeError,
    MpistratError) on any rank, raise on every rank: the rank's own error where it
    failed, a ``RuntimeError`` naming the failing rank elsewhere."""
    result, error = None, None
    try:
        result = check()
    except (ValueError, TypeError, MpistratError) as exc:
        error = exc
    verdicts = comm.allgather(None if error is None else str(error))
    failed = [(r, text) for r, text in enumerate(verdicts) if text is not None]
    if error is not None:
        raise error
    if failed:
        rank, text = failed[0]
        raise RuntimeError(f"rank {rank}: {text}")
    return result


@contextlib.contextmanager
def abort_on_error(comm: Comm) -> Iterator[None]:
    """Turn an exception on any rank into a tagged traceback and ``MPI_Abort``."""
    try:
        yield
    except KeyboardInterrupt:
        raise
    except BaseException:
        rank = comm.Get_rank()
        text = traceback.format_exc()
        sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))
        sys.stderr.flush()
        comm.Abort(1)
        raise


# ----------------------------------------------------------------- validation


def _gpu_preflight(replicas: int) -> None:
    probe = probe_gpus()
    if not probe.usable or len(probe.devices) < replicas:
        reason = probe.reason or f"{len(probe.devices)} device(s) visible"
        raise BackendUnavailable(f"--gpus-per-rank {replicas} needs {replicas} CUDA "
                                 f"device(s) per rank through CuPy: {reason}")
    import cupy  # only with GPUs: importing mpistrat never imports CuPy

    get_backend(cupy.zeros(1, dtype=cupy.float32))


def prepare_sweep(config: BenchConfig, comm: Comm, outputs: Outputs | None = None) -> SweepPlan:
    """Validate a sweep on every rank (collective; raises the same error everywhere)."""
    outputs = outputs or Outputs()
    topology = collective_check(comm, lambda: get_topology(comm, config.ranks_per_node))
    replicas = config.replicas_per_rank
    layout = Layout(comm.Get_size(), replicas, bool(config.gpus_per_rank), topology.num_nodes)

    def check() -> tuple[list[Entry], list[str], list[int]]:
        if config.gpus_per_rank:
            _gpu_preflight(replicas)
        if outputs.plot:
            require_matplotlib()
        entries, notes = select_entries(layout, config.algorithms, config.shards,
                                        config.specs, config.compare)
        if comm.Get_size() == 1:
            notes.append("one rank: nothing crosses ranks, busbw is 0")
        return entries, notes, config.sizes()

    entries, notes, sizes = collective_check(comm, check)
    peers = join_torch(comm, config.np_dtype, notes) if config.compare else []
    joined = {peer.label for peer in peers}
    entries = [e for e in entries if e.kind != "torch" or e.label in joined]
    return SweepPlan(comm, config, entries, sizes, layout, notes, peers)


def join_torch(comm: Comm, dtype: Any, notes: list[str]) -> list[TorchPeer]:
    """``--compare torch``: check on every rank that PyTorch can reduce ``dtype``, join a
    gloo group over ``comm`` (torch's default group) and, where it can be made, a group of
    the ``"mpistrat"`` backend over the same ranks; note each, or why the second is
    missing (collective; gloo failing is an error on every rank)."""
    collective_check(comm, lambda: require_torch(comm, dtype))
    with abort_on_error(comm):  # a rank failing to join would leave the others waiting
        peers = [TorchPeer(comm, "gloo")]
        mpistrat, problem = join_mpistrat(comm)
    if mpistrat is not None:
        peers.append(mpistrat)
    notes.extend(peer.note() for peer in peers)
    if problem is not None:
        notes.append(f"torch-mpistrat: not measured: {problem}")
    return peers


def close_peers(peers: Sequence[TorchPeer]) -> None:
    """Destroy the peers' groups, the ``new_group`` ones before the default group."""
    for peer in reversed(peers):
        peer.close()


def _options(config: BenchConfig, plan: SweepPlan) -> dict[str, Any]:
    options = asdict(config)
    options.update({
        "entries": [e.label for e in plan.entries],
        "sizes": plan.sizes,
        "size_range": (f"{format_bytes(plan.sizes[0])} .. {format_bytes(plan.sizes[-1])} "
                       + (f"(x{config.stepfactor})" if config.stepfactor
                          else f"(+{config.stepbytes} B)")),
        "replicas_per_rank": config.replicas_per_rank,
        "dtype": str(config.np_dtype), "op": config.reduce_op.name.lower(),
        "warmup": config.warmup if config.warmup is not None else "adaptive",
        "iters": (config.iters if config.iters is not None else
                  f"adaptive (~{config.time_per_point:g} s per point, "
                  f"{config.min_iters}..{config.max_iters})"),
        "check": "every iteration" if config.check_every else "one iteration per point",
    })
    return options


# ----------------------------------------------------------------- analysis


def analyse(meta: Mapping[str, Any], points: Sequence[Point], outputs: Outputs,
            out: TextIO, *, runs: Mapping[int, Any] | None = None) -> SweepResult:
    """Footer, recommendation, cost model, prediction and files from measured points
    (rank 0, or offline from a JSON file)."""
    result = SweepResult(dict(meta), list(points), runs=dict(runs or {}))
    for line in summary_lines(points) + best_lines(points):
        print(line, file=out)
    try:
        result.recommendation = recommend(points, outputs.tolerance)
    except ValueError as exc:
        if outputs.recommend or outputs.save:
            raise
        if any(p.kind == "algorithm" for p in points):
            print(f"# no recommendation: {exc}", file=out)
    if outputs.recommend or outputs.save:
        for line in result.recommendation.lines():  # type: ignore[union-attr]
            print(line, file=out)
    ranks, nodes = int(meta.get("ranks", 1)), int(meta.get("nodes", 1))
    result.model = costmodel.model_for_run(meta, points, model_with=outputs.model_with,
                                           model_from=outputs.model_from)
    if outputs.model or outputs.predict_ranks:
        for line in result.model.lines() + result.model.error_lines():
            print(line, file=out)
    if outputs.predict_ranks:
        per_node = outputs.predict_ranks_per_node or max(1, -(-ranks // nodes))
        result.prediction = costmodel.predict(result.model, outputs.predict_ranks, per_node,
                                              sorted({p.nbytes for p in points}))
        for line in result.prediction.lines():
            print(line, file=out)
    _write_outputs(result, outputs, complete=True)
    out.flush()
    return result


def best_lines(points: Sequence[Point]) -> list[str]:
    """Per size, the fastest correct single algorithm and its speedup over native."""
    parts = []
    for nbytes, group in group_by_size(points).items():
        candidates = [p for p in group if p.kind == "algorithm" and p.correct]
        if not candidates:
            continue
        best = min(candidates, key=lambda p: p.median)
        parts.append(f"{format_bytes(nbytes)} {best.label} "
                     f"{format_ratio(best.speedup_over(baseline_of(group)))}")
    return ["# Best vs native: " + ", ".join(parts)] if parts else []


def _extra(result: SweepResult) -> dict[str, Any]:
    return {
        "runs": {str(k): v for k, v in result.runs.items()},
        "recommendation": result.recommendation.as_dict() if result.recommendation else None,
        "cost_model": result.model.as_dict() if result.model else None,
        "prediction": result.prediction.as_dict() if result.prediction else None,
    }


def _markdown(result: SweepResult, table: Table) -> str:
    meta = result.meta
    lines = [f"### mpistrat bench: {meta.get('ranks')} rank(s), "
             f"{meta.get('options', {}).get('dtype')} {meta.get('options', {}).get('op')}",
             "", *[f"- {line[2:]}" for line in describe_run(meta)],
             f"- date: {meta.get('date')}; command: `{command_line(meta)}`", "",
             table.markdown(result.points), ""]
    lines += [f"- {ln[2:]}" for ln in summary_lines(result.points) + best_lines(result.points)]
    if result.recommendation:
        lines += ["", "```", *result.recommendation.lines(), "```"]
    return "\n".join(lines) + "\n"


def command_line(meta: Mapping[str, Any]) -> str:
    """The run's command as a user would type it (``mpiexec -n N mpistrat bench ...``)."""
    argv = list(meta.get("argv") or [])
    args = " ".join(shlex.quote(a) for a in argv[1:])
    if argv and (argv[0].endswith("__main__.py") or os.path.basename(argv[0]) == "mpistrat"):
        return f"mpiexec -n {meta.get('ranks', '?')} mpistrat {args}"
    return " ".join(shlex.quote(a) for a in argv)


def _write_outputs(result: SweepResult, outputs: Outputs, complete: bool) -> None:
    if outputs.json:
        files.write_json(outputs.json, result.meta, result.points, complete=complete,
                         extra=_extra(result))
    if not complete:
        return
    if outputs.csv:
        files.write_csv(outputs.csv, result.meta, result.points)
    if outputs.markdown:
        table = Table(p.label for p in result.points)
        files.write_text(outputs.markdown, _markdown(result, table))
    if outputs.plot:
        plot(result.points, outputs.plot, result.meta)
    if outputs.save and result.recommendation:
        meta = result.meta
        opts = meta.get("options", {})
        write_spec_file(outputs.save, result.recommendation, [
            f"{meta.get('ranks')} rank(s) x {opts.get('replicas_per_rank', 1)} replica(s) on "
            f"{meta.get('nodes')} node(s), {opts.get('dtype')} {opts.get('op')}, "
            f"{meta.get('date')}",
            f"MPI: {meta.get('mpi_library')}",
        ])


def analyse_file(path: str, outputs: Outputs, out: TextIO | None = None) -> SweepResult:
    """Re-read a ``--json`` result and print its table and analyses (no MPI)."""
    out = out or sys.stdout
    meta, points, document = files.read_json(path)
    if not points:
        raise ValueError(f"{path} holds no results")
    for line in describe_run(meta) if "size_range" in meta.get("options", {}) else []:
        print(line, file=out)
    table = Table(p.label for p in points)
    print(table.header(), file=out)
    for group in group_by_size(points).values():
        print(table.rows(group), file=out)
    runs = {int(k): v for k, v in (document.get("runs") or {}).items()}
    return analyse(meta, points, outputs, out, runs=runs)


# ----------------------------------------------------------------- the sweep


def run_sweep(config: BenchConfig, outputs: Outputs | None = None, comm: Comm | None = None,
              out: TextIO | None = None, mpi_env: Mapping[str, str] | None = None
              ) -> SweepResult | None:
    """Validate, measure every size, print the table as it goes, then analyse and write
    files (collective over ``comm``, default a duplicate of ``COMM_WORLD``).

    Returns:
        The result on rank 0, None on the other ranks.

    Raises:
        ValueError, TypeError, MpistratError, RuntimeError: invalid options, on every
            rank alike (before anything is measured).
    """
    outputs = outputs or Outputs()
    out = out or sys.stdout
    comm = (world() if comm is None else comm).Dup()
    try:
        plan = prepare_sweep(config, comm, outputs)
        rank = comm.Get_rank()
        with abort_on_error(comm):
            meta = collect(comm, _options(config, plan), ranks_per_node=config.ranks_per_node,
                           mpi_env=mpi_env, notes=plan.notes)
            table = Table(e.label for e in plan.entries)
            if rank == 0:
                print("\n".join(describe_run(meta)), file=out)
                print(table.header(), file=out, flush=True)
            progress = Progress(len(plan.sizes), enabled=rank == 0 and not config.quiet)
            sweep = Sweep(comm, config, plan.entries, plan.peers)
            result = SweepResult(meta, [])
            started = time.perf_counter()
            try:
                for nbytes in plan.sizes:
                    progress.start(format_bytes(nbytes))
                    points, run = sweep.measure(nbytes)
                    if rank != 0:
                        continue
                    result.points.extend(points or [])
                    result.runs[nbytes] = run
                    progress.echo(table.rows(points or []), out)
                    progress.step(format_bytes(nbytes),
                                  f"{run['iters']} iterations after {run['warmup']} "
                                  f"warm-up, {run['seconds']:.1f} s")
                    _write_outputs(result, outputs, complete=False)
            finally:
                progress.close()
                close_peers(plan.peers)
    finally:
        comm.Free()
    if rank != 0:
        return None
    # every collective is done: the analysis is rank 0's alone
    result.meta["seconds"] = time.perf_counter() - started
    final = analyse(result.meta, result.points, outputs, out, runs=result.runs)
    print(f"# took {result.meta['seconds']:.1f} s", file=out, flush=True)
    return final
