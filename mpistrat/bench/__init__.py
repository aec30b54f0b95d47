"""``mpistrat bench``: measure every all-reduce algorithm the way nccl-tests and the OSU
micro-benchmarks do, and turn the result into an all-reduce spec.

The pieces, each usable from Python (the CLI is a thin layer over them):

* :mod:`.config` — the options (:class:`BenchConfig`, :class:`BatchConfig`), sizes;
* :mod:`.entries` — what is measured (algorithms x shards, whole specs, peers);
* :mod:`.timing` — the measurement loop (barrier, interleaved rounds, slowest rank);
* :mod:`.check` — exact inputs, the reference result, wrong-element counts;
* :mod:`.results`, :mod:`.report` — points, statistics (median/min/max, algbw,
  busbw = algbw x 2(n-1)/n) and the nccl-tests-style table;
* :mod:`.recommend` — the fastest algorithm per size range as a spec; spec files;
* :mod:`.costmodel` — alpha-beta fits and predictions for other job sizes;
* :mod:`.files`, :mod:`.plot`, :mod:`.progress` — JSON/CSV/Markdown, PNG, progress bar;
* :mod:`.batch` — a whole gradient batch through ``batch_reduce``;
* :mod:`.peers` — torch.distributed (gloo, and the "mpistrat" backend) for comparison;
* :mod:`.runner` — validation on every rank, the sweep, the outputs.

Importing this package does not initialise MPI; :func:`run_sweep` and
:func:`run_batch` do.
"""

from __future__ import annotations

from .batchrun import run_batch
from .config import BatchConfig, BenchConfig, sizes
from .costmodel import CostModel, Fit, Prediction, fit, predict
from .entries import Entry, select_entries
from .files import read_json, write_csv, write_json
from .recommend import Recommendation, read_spec_file, recommend, resolve_spec, write_spec_file
from .results import Point, bus_factor
from .runner import Outputs, SweepResult, analyse_file, run_sweep

__all__ = [
    "BenchConfig", "BatchConfig", "sizes", "Entry", "select_entries", "Point", "bus_factor",
    "Outputs", "SweepResult", "run_sweep", "run_batch", "analyse_file",
    "Recommendation", "recommend", "read_spec_file", "write_spec_file", "resolve_spec",
    "CostModel", "Fit", "Prediction", "fit", "predict",
    "read_json", "write_json", "write_csv",
]
