"""``python -m mpistrat.launch -n N [--mpiexec PATH] -- COMMAND...``: run a command on N ranks
with the mpiexec that matches mpi4py's MPI library (and the flags its flavour needs)."""

from __future__ import annotations

import argparse
import subprocess
import sys

from ..errors import MpistratError
from .mpiexec import find_launcher


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpistrat.launch", description=__doc__)
    parser.add_argument("-n", "--np", type=int, required=True, help="number of ranks")
    parser.add_argument("--mpiexec", help="path of the mpiexec to use")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    try:
        argv_ = find_launcher(args.mpiexec).argv(args.np, command)
    except (MpistratError, ValueError) as exc:
        parser.error(str(exc))
    return subprocess.call(argv_)


if __name__ == "__main__":
    sys.exit(main())
