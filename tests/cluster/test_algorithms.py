"""Every CPU all-reduce algorithm, flat and hierarchical, correct and bitwise identical on
every rank across real hosts (bin/cluster-local), on four layouts.

Each layout is one ``mpiexec`` job running ``_check_allreduce.py`` (its docstring lists
the cases: every CPU algorithm name of the registry plus shard variants, G = 1 and 2,
SUM and MEAN, float32/float64/int32, lengths 0 to 16 MiB). The job reports every failing
case; the test also checks where the ranks ran and that the link byte counters moved, so
the bytes really crossed the links rather than shared memory.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster

CHECK = Path(__file__).with_name("_check_allreduce.py")
MPIEXEC = Path(sys.executable).parent / "mpiexec"
# What the issue asks for at least; the script takes the names from the registry itself.
REQUIRED_SPECS = {"xring", "rechd", "pscpu", "native", "shm", "pscpu/pscpu", "shm/xring",
                  "shm/rechd", "shm/pscpu", "xring#2", "pscpu#2", "pscpu/pscpu#2"}

LAYOUTS = {  # id: (mpiexec's -hosts, -n, the host of every rank)
    "2x2": ("node1:2,node2:2", 4, ["node1", "node1", "node2", "node2"]),
    "2x1": ("node1:1,node2:1", 2, ["node1", "node2"]),
    "3+1": ("node1:3,node2:1", 4, ["node1", "node1", "node1", "node2"]),
    # one slot per host, 4 ranks: hydra goes round the hosts, so a host's ranks are not
    # contiguous (0, 2 on node1; 1, 3 on node2)
    "round-robin": ("node1:1,node2:1", 4, ["node1", "node2", "node1", "node2"]),
}


def run_check(cluster, tmp_path, hosts: str, n: int, rotate: int, timeout: float = 90) -> dict:
    """Run the check script on ``n`` ranks over ``hosts``; its RESULT, or fail saying
    why (with the case each rank was in when the job hung or died)."""
    progress = tmp_path / "progress"
    progress.mkdir()
    command = [str(MPIEXEC), "-hosts", hosts, "-n", str(n),
               sys.executable, str(CHECK), str(rotate)]

    def where() -> dict[str, str]:
        return {p.name: p.read_text() for p in sorted(progress.iterdir())}

    try:
        result = cluster.run(command, env={"CHECK_PROGRESS_DIR": str(progress)},
                             timeout=timeout)
    except pytest.fail.Exception as exc:  # it hung: say in which case each rank was
        pytest.fail(f"{exc}\neach rank's last case: {where()}", pytrace=False)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and len(lines) == 1, (
        f"the check job failed (exit status {result.returncode}); each rank's last case: "
        f"{where()}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return json.loads(lines[0][len("RESULT "):])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_algorithm_is_exact_and_identical_on_every_rank(cluster, tmp_path, layout):
    hosts, n, placement = LAYOUTS[layout]
    before = cluster.bytes()
    report = run_check(cluster, tmp_path, hosts, n, rotate=list(LAYOUTS).index(layout))
    moved = cluster.moved(before)
    assert report["hosts"] == placement, f"ranks ran on {report['hosts']}, not {placement}"
    assert report["nodes"] == 2, f"the job saw {report['nodes']} node group(s), not 2"
    expected_nodes = [int(h[-1]) - 1 for h in placement]
    assert report["node_of_rank"] == expected_nodes, (
        f"node groups {report['node_of_rank']} do not follow the hosts {placement}")
    missing = REQUIRED_SPECS - set(report["specs"])
    assert not missing, f"the check did not run {sorted(missing)}"
    assert report["cases"] >= len(REQUIRED_SPECS) * 31, report["cases"]  # 31 per spec
    assert not report["problems"], (
        f"{len(report['problems'])} problem(s) on layout {layout} ({hosts}, {n} ranks):\n"
        + "\n".join(report["problems"][:40]))
    # every host sent at least a few of the large buffers over its link
    assert all(sent > 32 << 20 for sent in moved.values()), (
        f"bytes sent over each host's link during the job: {moved}; expected > 32 MiB each "
        f"(did the ranks talk through shared memory?)")
