"""An elastic parameter-server job across the two real hosts of conftest.py that loses
the host of its coordinator and ps: the relaunch, on the other host, restores from the
partner copy of the coordinator's snapshot that host keeps in its own /dev/shm.

``mpistrat run -n 6 --num-ps 1 --min-ranks 3`` over a host file of ``node1:2`` (rank 0,
the coordinator, and rank 1, the ps) and ``node2:4`` (the workers, rank 2 the partner);
node1's processes are all killed after 20 of 60 scheduled functions
(tests/launch/ps_scripts/elastic_train.py). The job must end with status 0 on node2's 4
ranks (1 coordinator, 1 ps, 2 workers), restored from node2's directory, with every
function's update applied exactly once."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from _cluster import Job, kill_host, script_ranks

pytestmark = pytest.mark.cluster

VENV_BIN = Path(sys.executable).parent
SCRIPT = Path(__file__).resolve().parents[1] / "launch" / "ps_scripts" / "elastic_train.py"
STEPS = 60


@pytest.mark.timeout(240)
def test_a_lost_coordinator_host_restores_from_the_partner_copy(cluster, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("node1:2\nnode2:4\n")
    argv = [VENV_BIN / "mpistrat", "run", "-n", "6", "--num-ps", "1", "--min-ranks", "3",
            "--timeout", "8", "--stall-check", "4", "--snapshot-every", "10",  # (at 9, 19, ...)
            SCRIPT, "none", str(STEPS)]
    with Job(cluster, argv, tmp_path, env={"HYDRA_HOST_FILE": str(hosts),
                                           "CKPT_DIR": str(tmp_path / "ckpt"),
                                           "STEP_SLEEP": "0.15"}) as job:
        job.wait_for(lambda: "@@ joined 20" in job.out.read_text(), 120, "20 functions done")
        assert script_ranks(cluster, "node1", SCRIPT.name), job.output
        kill_host(cluster, "node1")
        job.process.wait(120)
    output = job.output
    assert job.process.returncode == 0, output
    assert re.search(r"mpistrat run: lost host node1 \(ranks 0, 1\); restart 1 of 3 on 4 "
                     r"ranks \(node2:4\): 1 coordinator, 1 ps, 2 workers", output), output
    final = json.loads([line for line in job.out.read_text().splitlines()
                        if line.startswith("{")][-1])
    assert final["restart"] == 1 and final["workers"] == 2, output
    # the partner copy, in node2's own directory of the job (node1's is not read)
    assert re.search(r"/mpistrat-elastic-\d+-[0-9a-f]{32}/node2/slot-[01]\.data$",
                     final["restored"] or ""), output
    # (tests/launch/test_run_elastic_ps.py: the snapshots hold 9, 19, 29, ... functions)
    assert 19 <= final["start"] < STEPS and final["start"] % 10 == 9, output
    assert final["progress"] == [STEPS, STEPS * (STEPS - 1) // 2], output  # each once
    assert final["weights"] == [0.5 * STEPS] * 3, output
