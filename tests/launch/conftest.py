"""Launch tests: start ``mpiexec`` in a subprocess and check exit codes and output.

Each run is bounded by a timeout, so a hang fails the test instead of the suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mpistrat.launch.mpiexec import find_launcher

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def launcher():
    return find_launcher()


@pytest.fixture
def mpirun(launcher):
    """Run ``command`` on ``n`` ranks; returns the CompletedProcess (text, both streams)."""

    def run(n, command, *, env=None, timeout=120):
        argv = launcher.argv(n, command)
        return subprocess.run(
            argv, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True,
            text=True, timeout=timeout, check=False,
        )

    return run


@pytest.fixture
def mpistrat_cmd():
    return [sys.executable, "-m", "mpistrat"]
