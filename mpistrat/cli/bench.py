"""``mpistrat bench``: time every all-reduce algorithm (nccl-tests conventions) and
recommend a spec. A thin layer over :mod:`mpistrat.bench`."""

from __future__ import annotations

import importlib
from typing import Any

import click

from ..errors import MpistratError
from ._ranked import RankedCommand

__all__ = ["bench"]

_BATCH_ONLY = ("num_packs", "agg_small_grads")
_SWEEP_ONLY = ("algorithms", "shards", "minbytes", "maxbytes", "stepfactor", "stepbytes",
               "op", "time_per_point", "min_iters", "max_iters", "gpus_per_rank",
               "ranks_per_node")
_MEASURING = _BATCH_ONLY + tuple(n for n in _SWEEP_ONLY if n != "ranks_per_node") + (
    "compare", "specs", "dtype", "warmup", "iters", "check", "local_replicas", "batch", "transport",
    "mpi_env", "plugin", "np_", "mpiexec")


class BenchCommand(RankedCommand):
    """Keeps the raw arguments (for self-launching) and lets only rank 0 print errors:
    every rank parses the same options, so every rank fails alike."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["mpistrat.bench.args"] = list(args)
        return super().parse_args(ctx, args)


def _given(ctx: click.Context, names: tuple[str, ...]) -> list[str]:
    source = click.core.ParameterSource.COMMANDLINE
    flags = {"specs": "--spec", "np_": "--np"}
    return [flags.get(name, "--" + name.replace("_", "-")) for name in names
            if ctx.get_parameter_source(name) is source]


def _self_launch(ctx: click.Context, np_: int, mpiexec: str | None) -> None:
    # here, not at the top: only this command needs it (start-up time)
    from ..bench.launch import relaunch_command
    from ..launch.hugepages import malloc_hugepages_env
    from ..launch.selflaunch import launch_argv, self_launch

    try:
        # the ranks start with the heap's huge-page tunable (instead of each starting over)
        argv = launch_argv("mpistrat bench", "--np", np_,
                           relaunch_command(ctx.meta["mpistrat.bench.args"]), mpiexec=mpiexec,
                           rank_env=malloc_hugepages_env())
    except (MpistratError, ValueError) as exc:
        raise click.UsageError(str(exc)) from None
    ctx.exit(self_launch(argv))


def _sweep_config(p: dict[str, Any]) -> Any:
    # here, not at the top: only this command needs it (start-up time)
    from ..bench.config import BenchConfig, parse_byte_count, parse_shards_list
    from ..bench.recommend import resolve_spec

    step_bytes = parse_byte_count(p["stepbytes"], "--stepbytes") if p["stepbytes"] else None
    return BenchConfig(
        algorithms=(tuple(t.strip() for t in p["algorithms"].split(",") if t.strip())
                    if p["algorithms"] is not None else None),
        shards=parse_shards_list(p["shards"]) if p["shards"] else None,
        specs=tuple(str(resolve_spec(s)) for s in p["specs"]),
        minbytes=parse_byte_count(p["minbytes"], "--minbytes"),
        maxbytes=parse_byte_count(p["maxbytes"], "--maxbytes"),
        stepfactor=p["stepfactor"] if step_bytes is None else None,
        stepbytes=step_bytes, dtype=p["dtype"], op=p["op"], warmup=p["warmup"],
        iters=p["iters"], time_per_point=p["time_per_point"], min_iters=p["min_iters"],
        max_iters=p["max_iters"], check_every=p["check"], local_replicas=p["local_replicas"],
        gpus_per_rank=p["gpus_per_rank"], ranks_per_node=p["ranks_per_node"],
        shared=p["shared"], compare=tuple(p["compare"]), quiet=p["quiet"])


def _batch_config(p: dict[str, Any]) -> Any:
    # here, not at the top: only this command needs it (start-up time)
    from ..bench.batch import load_shapes
    from ..bench.config import BatchConfig, parse_agg, parse_int_list
    from ..bench.recommend import resolve_spec

    if len(p["specs"]) > 1:
        raise ValueError("--batch measures one spec; give --spec once")
    name, shapes = load_shapes(p["batch"])
    agg_bytes, agg_group = parse_agg(p["agg_small_grads"])
    return BatchConfig(
        shapes=shapes, name=name,
        spec=str(resolve_spec(p["specs"][0])) if p["specs"] else "rechd",
        num_packs=parse_int_list(p["num_packs"], "--num-packs"),
        agg_bytes=agg_bytes, agg_group=agg_group, shared=p["shared"], dtype=p["dtype"],
        local_replicas=p["local_replicas"],
        warmup=p["warmup"] if p["warmup"] is not None else 3,
        iters=p["iters"] if p["iters"] is not None else 20,
        check_every=p["check"], compare=tuple(p["compare"]), quiet=p["quiet"])


def _outputs(p: dict[str, Any]) -> Any:
    # here, not at the top: only this command needs it (start-up time)
    from ..bench.runner import Outputs

    return Outputs(json=p["json_path"], csv=p["csv_path"], markdown=p["markdown_path"],
                   plot=p["plot_path"], recommend=p["recommend"], save=p["save"],
                   tolerance=p["tolerance"] / 100, model=p["model"],
                   predict_ranks=p["predict_ranks"],
                   predict_ranks_per_node=p["predict_ranks_per_node"] or p["ranks_per_node"],
                   model_with=_model_files(p["model_with"], "--model-with"),
                   model_from=(_model_files((p["model_from"],), "--model-from")[0]
                               if p["model_from"] else None))


def _model_files(paths: tuple[str, ...], option: str) -> tuple[str, ...]:
    """Check the saved sweeps given to the cost model now, not after measuring."""
    # here, not at the top: only this command needs it (start-up time)
    from ..bench.files import read_json

    for path in paths:
        try:
            read_json(path)
        except ValueError as exc:  # (it names the file and the field)
            raise ValueError(f"{option} {exc}") from None
    return tuple(paths)


_EPILOG = """\b
Examples:
  mpistrat bench --np 2 -b 4 -e 1M                     every algorithm, 4 B .. 1 MiB
  mpiexec -n 4 mpistrat bench --algorithms xring,rechd,pscpu --shards 1,2,all -c
  mpistrat bench --np 2 -b 4 -e 256M --recommend --save allreduce.spec --plot sweep.png
  mpistrat bench --np 2 --spec @allreduce.spec          measure a saved spec
  mpistrat bench --np 2 --batch resnet50 --num-packs 1,2,4 --agg-small-grads 64K:16
  mpistrat bench --np 2 --batch resnet50 --compare torch   ... and torch's gloo, mpistrat
  mpistrat bench --from-json sweep.json --model --predict-ranks 1024 --ranks-per-node 8
  mpistrat bench --from-json 2hosts.json --model-with 1host.json --model \
      --predict-ranks 1024 --predict-ranks-per-node 8     the two-level model
"""


@click.command(cls=BenchCommand, epilog=_EPILOG)
@click.option("--np", "-np", "np_", type=click.IntRange(min=1), metavar="N",
              help="Start N ranks with the mpiexec that matches mpi4py and run there "
                   "(instead of mpiexec -n N mpistrat bench).")
@click.option("--mpiexec", metavar="PATH", help="With --np: the mpiexec to use.")
@click.option("--algorithms", metavar="LIST",
              help="Comma list of algorithm[#shards] (xring,rechd,pscpu#2,pscpu/pscpu,...). "
                   "Default: every algorithm usable here. native is always measured.")
@click.option("--shards", metavar="LIST",
              help="Shard counts for algorithms that take them ('all': the whole gather "
                   "pool). Default: 1,2 (rings) and 1,2,all (shuffles).")
@click.option("--spec", "specs", multiple=True, metavar="SPEC|@FILE",
              help="Also measure a whole spec (repeatable); @FILE reads a saved spec.")
@click.option("-b", "--minbytes", default="4", show_default=True, metavar="BYTES",
              help="Smallest size per rank (K/M/G: powers of two).")
@click.option("-e", "--maxbytes", default="64M", show_default=True, metavar="BYTES",
              help="Largest size per rank.")
@click.option("-f", "--stepfactor", type=click.IntRange(min=2), default=4, show_default=True,
              help="Multiply the size by this factor each step.")
@click.option("-i", "--stepbytes", metavar="BYTES", help="Add this many bytes each step "
              "instead of -f.")
@click.option("-d", "--dtype", default="float32", show_default=True,
              help="float32, float64, float16, bfloat16, int32, int64, ...")
@click.option("-o", "--op", type=click.Choice(["sum", "mean", "min", "max"],
                                              case_sensitive=False),
              default="sum", show_default=True)
@click.option("-w", "--warmup", type=click.IntRange(min=0),
              help="Warm-up rounds per size (default: adaptive, at least 3).")
@click.option("-n", "--iters", type=click.IntRange(min=1),
              help="Timed rounds per size (default: adaptive, see --time-per-point).")
@click.option("--time-per-point", type=click.FloatRange(min=0, min_open=True), default=1.0,
              show_default=True, metavar="SECONDS",
              help="Adaptive --iters aims at this much measured time per (size, algorithm).")
@click.option("--min-iters", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--max-iters", type=click.IntRange(min=1), default=1000, show_default=True)
@click.option("-c", "--check", is_flag=True,
              help="Verify every iteration's result, not only one per point.")
@click.option("--local-replicas", type=click.IntRange(min=1), default=1, show_default=True,
              metavar="K", help="CPU replicas per rank.")
@click.option("--gpus-per-rank", type=click.IntRange(min=0), default=0, metavar="G",
              help="GPU replicas per rank (CuPy buffers).")
@click.option("--ranks-per-node", type=click.IntRange(min=1), metavar="R",
              help="Virtual nodes of R ranks (as MPISTRAT_RANKS_PER_NODE), and the ranks per "
                   "node of --predict-ranks.")
@click.option("--shared", is_flag=True,
              help="Allocate the buffers in shared memory (mpistrat.shared_empty), so 'shm' "
                   "reads them in place: its zero-copy mode. With --batch: the row of "
                   "tensors kept in one buffer uses mpistrat.shared_arrays.")
@click.option("--batch", metavar="resnet50|FILE.json",
              help="Reduce a whole gradient batch through batch_reduce instead of a sweep.")
@click.option("--num-packs", default="1,2,4", show_default=True, metavar="LIST",
              help="With --batch: one batch_reduce row per num_packs value.")
@click.option("--agg-small-grads", default="64K:16", show_default=True,
              metavar="BYTES:GROUP|0", help="With --batch: the small-tensor aggregation row.")
@click.option("--json", "json_path", metavar="FILE", help="Write every sample and the metadata.")
@click.option("--csv", "csv_path", metavar="FILE", help="Write one row per sample.")
@click.option("--markdown", "markdown_path", metavar="FILE", help="Write the table as Markdown.")
@click.option("--plot", "plot_path", metavar="FILE.png",
              help="Draw busbw and latency against size (needs matplotlib).")
@click.option("--recommend", is_flag=True,
              help="Print the fastest algorithm per size range as a spec.")
@click.option("--tolerance", type=click.FloatRange(min=0), default=3.0, show_default=True,
              metavar="PERCENT", help="For --recommend: within this of the fastest is a tie.")
@click.option("--save", metavar="FILE", help="Write the recommended spec (implies --recommend).")
@click.option("--model", is_flag=True, help="Print the fitted alpha-beta cost model.")
@click.option("--predict-ranks", type=click.IntRange(min=1), metavar="P",
              help="Predict every algorithm at P ranks from the cost model.")
@click.option("--predict-ranks-per-node", type=click.IntRange(min=1), metavar="R",
              help="Ranks per node for --predict-ranks (default --ranks-per-node, else as "
                   "measured).")
@click.option("--model-with", multiple=True, metavar="FILE.json",
              help="Fit the cost model on this saved sweep too (repeatable): another layout, "
                   "e.g. one host, which separates the intra-host and link terms, or a "
                   "repeat (sweeps of one layout count as the median of their medians).")
@click.option("--model-from", metavar="FILE.json",
              help="Use the cost model saved in this --json file instead of fitting; --model "
                   "prints its error on this run's points and --model-with's (validation).")
@click.option("--compare", type=click.Choice(["torch"]), multiple=True,
              help="Also measure torch.distributed over gloo and over the 'mpistrat' "
                   "backend (torch-gloo, torch-mpistrat), when PyTorch is installed; with "
                   "--batch: all_reduce per tensor, all_reduce_coalesced, and one flat "
                   "tensor (torch.cat), each over both.")
@click.option("--transport", type=click.Choice(["auto", "net"]), default="auto",
              show_default=True,
              help="net: turn the MPI library's shared-memory path off (inter-node-like).")
@click.option("--mpi-env", multiple=True, metavar="KEY=VALUE",
              help="Set an MPI library variable before MPI starts (repeatable).")
@click.option("--from-json", metavar="FILE",
              help="Analyse a saved --json result instead of measuring (no MPI).")
@click.option("--plugin", multiple=True, metavar="MODULE",
              help="Import MODULE first (e.g. one that registers an algorithm).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar or progress lines.")
@click.pass_context
def bench(ctx: click.Context, **p: Any) -> None:
    """Time all-reduce algorithms against the MPI library's own (native).

    Run it under MPI (mpiexec -n N mpistrat bench ...) or let it start the ranks (--np N).
    Rank 0 prints, per size and algorithm: time (µs; median over iterations of the slowest
    rank, with min and max), algbw and busbw (GB/s; busbw = algbw x 2(n-1)/n), #wrong and
    the speedup over native. Wrong results make the exit status 1.
    """
    # here, not at the top: only this command needs it (start-up time)
    from ..bench.launch import apply_env, parse_env, transport_env

    if p["from_json"]:
        given = _given(ctx, _MEASURING)
        if given:
            raise click.UsageError(f"--from-json analyses a saved run; leave out "
                                   f"{', '.join(given)} (used only when measuring)")
    if p["batch"]:
        given = _given(ctx, _SWEEP_ONLY)
        if given:
            raise click.UsageError(f"--batch does not use {', '.join(given)}; leave it out")
    elif _given(ctx, _BATCH_ONLY):
        raise click.UsageError(f"{', '.join(_given(ctx, _BATCH_ONLY))}: used only with --batch")
    if p["save"]:
        p["recommend"] = True
    try:
        outputs = _outputs(p)
        if p["from_json"]:
            # here, not at the top: only this command needs it (start-up time)
            from ..bench.runner import analyse_file

            analyse_file(p["from_json"], outputs)
            return
        config = _batch_config(p) if p["batch"] else _sweep_config(p)
        env = {**transport_env(p["transport"]), **parse_env(p["mpi_env"])}
    except (ValueError, TypeError, MpistratError) as exc:
        raise click.UsageError(str(exc)) from None
    # here, not at the top: only this command needs it (start-up time)
    from ..launch.hugepages import restart_with_hugepages

    if p["np_"]:  # (the launcher hands its ranks the tunable)
        _self_launch(ctx, p["np_"], p["mpiexec"])
    elif p["mpiexec"]:
        raise click.UsageError("--mpiexec only applies with --np")
    restart_with_hugepages()  # measure what mpistrat run runs (before MPI starts)
    for module in p["plugin"]:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise click.UsageError(f"--plugin {module}: {exc}") from None
    try:
        apply_env(env)
        result: Any  # run_batch's dict or run_sweep's SweepResult; None off rank 0
        if p["batch"]:
            # here, not at the top: only this command needs it (start-up time)
            from ..bench.batchrun import run_batch

            result = run_batch(config, outputs, mpi_env=env)
            points = result["points"] if result else []
        else:
            # here, not at the top: only this command needs it (start-up time)
            from ..bench.runner import run_sweep

            result = run_sweep(config, outputs, mpi_env=env)
            points = result.points if result else []
    except (ValueError, TypeError, MpistratError, RuntimeError) as exc:
        # raised on every rank alike before anything was measured (see bench.runner)
        raise click.UsageError(str(exc)) from None
    if any(point.wrong for point in points):
        ctx.exit(1)  # as nccl-tests: wrong results fail the run (rank 0's status)
