"""Run the user's script (or module) as ``__main__``, inside the default strategy.

The script sees what ``python script.py ARGS`` would give it: ``sys.argv`` is
``[script, *ARGS]``, ``sys.path[0]`` is the script's directory (for ``-m``: the working
directory, and ``sys.argv[0]`` is the module's file), and ``__name__ == "__main__"``.
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..cross_device_ops import MultiWorkerAllReduce
from ..strategy import MultiWorkerMirroredStrategy
from ..strategy.context import set_launcher_strategy
from ..strategy.mirrored import RING_SPEC
from .options import RunOptions

__all__ = ["default_strategy", "set_default_strategy", "check_target", "run_target"]


def default_strategy(options: RunOptions) -> Any:
    """The strategy every rank's script starts in: a
    :class:`~mpistrat.MultiWorkerMirroredStrategy` over ``COMM_WORLD`` built from the
    options (``--spec``/``--num-packs`` give it a :class:`~mpistrat.MultiWorkerAllReduce`).
    Collective: every rank builds it, and a bad option raises on every rank."""
    cross_device_ops = None
    if options.parsed_spec is not None or options.num_packs is not None:
        cross_device_ops = MultiWorkerAllReduce(
            num_gpus_per_worker=options.gpus_per_rank or 0,
            all_reduce_spec=(options.parsed_spec if options.parsed_spec is not None
                             else RING_SPEC),
            num_packs=options.num_packs if options.num_packs is not None else 1)
    return MultiWorkerMirroredStrategy(
        communication=options.communication, cross_device_ops=cross_device_ops,
        local_replicas=options.local_replicas, gpus_per_rank=options.gpus_per_rank)


def set_default_strategy(strategy: Any) -> None:
    """Make ``strategy`` current for the whole process (None: the default strategy); a
    script's own strategy takes over inside its ``scope()``."""
    set_launcher_strategy(strategy)


def check_target(options: RunOptions, cwd: str | None = None) -> str | None:
    """Why the script or module cannot be run on this rank, or None when it can."""
    cwd = os.getcwd() if cwd is None else cwd
    if options.module:
        try:
            with _path0(cwd):
                spec = importlib.util.find_spec(options.target)
        except (ImportError, ValueError) as exc:
            spec, why = None, f" ({type(exc).__name__}: {exc})"
        else:
            why = ""
        if spec is None:
            return (f"no module named {options.target!r}{why} on sys.path (working directory "
                    f"{cwd}); check the name, install the package, or add its directory to "
                    f"PYTHONPATH")
        return None
    path = os.path.join(cwd, options.target)
    if not os.path.exists(path):
        return (f"script {options.target!r} not found (working directory {cwd}); give the "
                f"path of a Python file, relative to the working directory or absolute "
                f"(with a launcher, every rank must see the file)")
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "__main__.py")):
        return (f"{options.target!r} is a directory without __main__.py; give the path of "
                f"a Python file")
    return None


def run_target(options: RunOptions) -> None:
    """Run the script or module as ``__main__``; whatever it raises propagates."""
    if options.module:
        spec = importlib.util.find_spec(options.target)
        origin = spec.origin if spec is not None and spec.origin else options.target
        with _argv([origin, *options.args]), _path0(os.getcwd()):
            runpy.run_module(options.target, run_name="__main__", alter_sys=True)
    else:
        script_dir = os.path.dirname(os.path.realpath(options.target))
        with _argv([options.target, *options.args]), _path0(script_dir):
            runpy.run_path(options.target, run_name="__main__")


@contextmanager
def _argv(argv: list[str]) -> Iterator[None]:
    saved = sys.argv
    sys.argv = list(argv)
    try:
        yield
    finally:
        sys.argv = saved


@contextmanager
def _path0(directory: str) -> Iterator[None]:
    saved = list(sys.path)
    sys.path[:1] = [directory]
    try:
        yield
    finally:
        sys.path[:] = saved

