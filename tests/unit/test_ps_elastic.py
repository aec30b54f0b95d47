"""mpistrat/ps/elastic.py without MPI: who keeps the coordinator's partner copy, and
where it goes (the same directory a SnapshotStore on that host reads). The copy itself
travels in tests/launch/test_run_elastic_ps.py."""

from __future__ import annotations

import os

import pytest

from mpistrat.checkpoint.snapshot import DIR_ENV
from mpistrat.elastic.env import ElasticEnv
from mpistrat.ps.elastic import host_directory, job_directory, partner_of


@pytest.mark.parametrize("hosts, partner", [
    (("a", "a", "b", "b"), 2),
    (("a", "b", "a", "b"), 1),
    (("a", "a", "a"), None),  # one host: no other host to copy to
    (("a",), None),
])
def test_the_partner_is_the_lowest_rank_on_another_host(hosts, partner):
    """After the loss of rank 0's host, the relaunch's rank 0 is the first rank of the
    first host left (the host file keeps the order): the partner's host."""
    assert partner_of(hosts) == partner


def test_the_copy_goes_where_the_hosts_snapshot_store_looks(monkeypatch, tmp_path):
    monkeypatch.setenv(DIR_ENV, str(tmp_path))
    launch = ElasticEnv("ab" * 16, 1, (5, 4))
    job = job_directory(launch)
    assert job == os.path.join(str(tmp_path), f"mpistrat-elastic-{os.getuid()}-{'ab' * 16}")
    assert host_directory(launch, "node 2/x") == os.path.join(job, "node_2_x")
    assert host_directory(launch, "") == os.path.join(job, "host")
