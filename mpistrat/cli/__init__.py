"""The ``mpistrat`` command line: a thin click layer over library functions.

Heavy modules are imported only when a subcommand runs, and none initialises MPI unless
it needs a communicator: ``mpistrat --help``, ``--version`` and ``validate`` never do.
"""

from __future__ import annotations

import click

from .. import __version__
from .bench import bench
from .info import info
from .run import run
from .trace import trace
from .validate import validate

__all__ = ["cli", "main"]

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


@click.group(context_settings=CONTEXT_SETTINGS)
@click.version_option(__version__, "-V", "--version", prog_name="mpistrat")
def cli() -> None:
    """TensorFlow's tf.distribute all-reduce machinery over MPI.

    \b
    Examples:
      mpistrat validate 'nccl#2:1K:pscpu/pscpu#2'
      mpistrat validate 'pscpu/pscpu#2' --workers 4 --nodes 2
      mpiexec -n 4 mpistrat info
    """


cli.add_command(validate)
cli.add_command(info)
cli.add_command(bench)
cli.add_command(run)
cli.add_command(trace)


def main(args: list[str] | None = None, prog_name: str | None = None) -> None:
    """Entry point of the ``mpistrat`` console script."""
    cli.main(args=args, prog_name=prog_name or "mpistrat")
