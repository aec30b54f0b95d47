"""What the tests of this directory share besides the fixtures: whether this process may
build clusters, and polling with a bound. (Imported as ``_cluster``: a helper module of its
own, since ``from conftest import`` could find another directory's conftest.)"""

from __future__ import annotations

import os
import sys
import time

import pytest


def unavailable() -> str | None:
    """Why no cluster can be built here, or None."""
    if not sys.platform.startswith("linux"):
        return f"bin/cluster-local needs Linux namespaces, not {sys.platform}"
    if os.environ.get("MPISTRAT_CLUSTER_UNAVAILABLE"):
        return os.environ["MPISTRAT_CLUSTER_UNAVAILABLE"]
    if os.geteuid() != 0:
        return "needs root to create network namespaces (run the tests as root, as CI does)"
    return None


def give_up(reason: str):
    """Skip with the reason, or fail with MPISTRAT_CLUSTER_REQUIRED=1 (CI as root)."""
    if os.environ.get("MPISTRAT_CLUSTER_REQUIRED") == "1":
        pytest.fail(f"multi-host tests required (MPISTRAT_CLUSTER_REQUIRED=1) but: {reason}",
                    pytrace=False)
    pytest.skip(reason)


def wait_until(predicate, timeout: float, what: str, interval: float = 0.1):
    """Poll ``predicate`` until it is true; fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not after {timeout} s")
        time.sleep(interval)
