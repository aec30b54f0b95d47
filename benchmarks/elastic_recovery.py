#!/usr/bin/env python
"""How long an elastic job takes from a lost host to its first step on the survivors
(docs/elastic.md), on two real hosts of ``bin/cluster-local`` (as root).

    sudo .venv/bin/python benchmarks/elastic_recovery.py [--runs 3]

Runs the kill and partition scenarios of ``tests/cluster/test_elastic.py`` ``--runs``
times each (``mpistrat run -n 4 --min-ranks 2 --timeout 8`` over node1 and node2, two
ranks each, node2 lost at step 20), which record each recovery's phases in a JSON-lines
file (``MPISTRAT_ELASTIC_FIGURES``), and prints their medians as a Markdown table:

* detection and tear-down: from the fault until the launch's last rank on node1 ended;
* relaunch: from then until the relaunched script started (``mpiexec``, Python, MPI);
* restore: from the script's start until ``restore_or_initialize()`` returned;
* first step: from then until the first step on the survivors was done.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("detection and tear-down", "relaunch", "restore", "first step", "total")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        figures = os.path.join(directory, "figures.jsonl")
        env = {**os.environ, "MPISTRAT_ELASTIC_FIGURES": figures,
               "MPISTRAT_CLUSTER_REQUIRED": "1"}
        for run in range(args.runs):
            result = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                 "tests/cluster/test_elastic.py", "-k", "killed or partition"],
                cwd=ROOT, env=env, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                print(result.stdout[-3000:] + result.stderr[-2000:], file=sys.stderr)
                return result.returncode
            print(f"run {run + 1} of {args.runs} done", file=sys.stderr)
        with open(figures) as file:
            rows = [json.loads(line) for line in file]
    print(f"| scenario (`--timeout {rows[0]['timeout']}`) | "
          + " | ".join(PHASES) + " | steps redone |")
    print("| --- |" + " ---: |" * (len(PHASES) + 1))
    for scenario in dict.fromkeys(row["scenario"] for row in rows):
        mine = [row for row in rows if row["scenario"] == scenario]
        cells = [f"{statistics.median(r['phases'][p] for r in mine):.2f} s" for p in PHASES]
        redone = sorted({r["steps_redone"] for r in mine})
        print(f"| {scenario} | " + " | ".join(cells) + f" | {', '.join(map(str, redone))} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
