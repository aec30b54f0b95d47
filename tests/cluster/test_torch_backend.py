"""torch.distributed over the "mpistrat" backend across real hosts (bin/cluster-local):
every collective against a reference, a subgroup of one rank per host and torch's DDP,
on 2 hosts x 2 ranks (tests/cluster/_check_torch_backend.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster
pytest.importorskip("torch", reason="the check runs torch.distributed")

HERE = Path(__file__).resolve().parent


def test_torch_collectives_and_ddp_across_two_hosts(cluster):
    before = cluster.bytes()
    result = cluster.mpiexec("node1:2,node2:2",
                             [sys.executable, HERE / "_check_torch_backend.py"], timeout=150)
    moved = cluster.moved(before)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and len(lines) == 1, (
        f"the job failed ({result.returncode}):\n{result.stdout[-3000:]}"
        f"\n{result.stderr[-3000:]}")
    report = json.loads(lines[0][len("RESULT "):])
    assert [h.split(".")[0][-5:] for h in report["hosts"]] == \
        ["node1", "node1", "node2", "node2"], report["hosts"]
    assert not report["problems"], "\n".join(report["problems"][:30])
    # the 4 MiB all-reduces crossed the link (not a local shortcut)
    assert all(sent > 8 << 20 for sent in moved.values()), moved
