"""Resolvers against an MPI world: match_world (pure), MPIClusterResolver and
resolve_cluster on one process (COMM_SELF), and lazy MPI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mpistrat.cluster import (
    ClusterInfo,
    ClusterSpec,
    MPIClusterResolver,
    SimpleClusterResolver,
    SlurmClusterResolver,
    TFConfigClusterResolver,
    match_world,
    resolve_cluster,
    should_checkpoint,
)
from mpistrat.errors import TopologyError

CHIEF_2W = {"chief": ["c0:1"], "worker": ["w0:1", "w1:1"]}


def tf_config(cluster, task_type=None, index=None):
    config = {"cluster": cluster}
    if task_type is not None:
        config["task"] = {"type": task_type, "index": index}
    return TFConfigClusterResolver(env={"TF_CONFIG": json.dumps(config)})


@pytest.mark.parametrize("task_type, index, rank", [("chief", 0, 0), ("worker", 0, 1),
                                                    ("worker", 1, 2)])
def test_tf_config_matching_the_world(task_type, index, rank):
    info = match_world(tf_config(CHIEF_2W, task_type, index), rank, 3)
    assert (info.num_workers, info.worker_index, info.is_chief) == (3, rank, rank == 0)
    assert (info.task_type, info.task_id, info.hostnames) == (task_type, index, None)
    assert should_checkpoint(info) is (rank == 0)


def test_mismatch_names_both_sides_and_the_fix():
    with pytest.raises(TopologyError) as info:
        match_world(tf_config(CHIEF_2W, "worker", 1), 1, 4)
    assert str(info.value).startswith(
        "TF_CONFIG describes 3 workers (1 chief + 2 workers), task worker:1 = worker id 2, "
        "but the MPI communicator has 4 ranks and this is rank 1; fix: give every rank a "
        "TF_CONFIG with one chief or worker task per rank, in rank order")


def test_right_count_wrong_order_is_an_error():
    with pytest.raises(TopologyError, match="task worker:0 = worker id 1, but the MPI "
                                            "communicator has 3 ranks and this is rank 2"):
        match_world(tf_config(CHIEF_2W, "worker", 0), 2, 3)


def test_local_mode_is_one_worker():
    info = match_world(TFConfigClusterResolver(env={}), 0, 1)
    assert (info.num_workers, info.worker_index, info.is_chief, info.task_type) == (
        1, 0, True, None)
    with pytest.raises(TopologyError, match=r"TF_CONFIG describes no cluster \(local mode: 1 "
                                            r"worker\), but the MPI communicator has 2 ranks"):
        match_world(TFConfigClusterResolver(env={}), 1, 2)


@pytest.mark.parametrize("task_type, match", [
    ("evaluator", r"TF_CONFIG makes this task an evaluator \(evaluator:0\).*run the evaluator "
                  r"as its own process"),
    ("ps", r"TF_CONFIG makes this task a parameter server \(ps:0\).*no parameter servers"),
])
def test_evaluator_and_ps_cannot_be_ranks(task_type, match):
    cluster = {**CHIEF_2W, "ps": ["p0:1"]}
    with pytest.raises(TopologyError, match=match):
        match_world(tf_config(cluster, task_type, 0), 0, 3)


def test_invalid_tf_config_raises_its_own_error():
    with pytest.raises(TopologyError, match="but no task"):
        match_world(tf_config(CHIEF_2W), 0, 3)
    with pytest.raises(TopologyError, match="TF_CONFIG is not valid JSON"):
        match_world(TFConfigClusterResolver(env={"TF_CONFIG": "{"}), 0, 1)


def test_slurm_mismatch_points_at_mpirun_inside_an_allocation():
    env = {"SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "a", "SLURM_TASKS_PER_NODE": "1"}
    with pytest.raises(TopologyError, match=r"the Slurm step describes 1 worker \(1 worker\), "
                                            r"task worker:0 = worker id 0, but the MPI "
                                            r"communicator has 2 ranks and this is rank 1.*"
                                            r"under mpirun inside an allocation"):
        match_world(SlurmClusterResolver(env=env), 1, 2)


def test_other_resolvers_get_a_generic_fix():
    resolver = SimpleClusterResolver({"worker": ["a:1", "b:1"]}, task_type="worker", task_id=0)
    assert match_world(resolver, 0, 2).is_chief
    with pytest.raises(TopologyError, match="the cluster spec describes 2 workers.*make the "
                                            "resolver describe one worker per rank"):
        match_world(resolver, 0, 3)


# --- MPIClusterResolver and resolve_cluster on one process -------------------------------


@pytest.fixture
def comm_self():
    MPI = pytest.importorskip("mpi4py.MPI")
    return MPI.COMM_SELF


def test_mpi_resolver_on_comm_self(comm_self):
    MPI = pytest.importorskip("mpi4py.MPI")
    resolver = MPIClusterResolver(comm_self, gpus_per_rank=2, port_base=7000, rpc_layer="grpc")
    host = MPI.Get_processor_name()
    assert resolver.comm is comm_self
    assert resolver.hostnames() == (host,)
    assert resolver.cluster_spec() == ClusterSpec({"worker": [f"{host}:7000"]})
    assert (resolver.task_type, resolver.task_id) == ("worker", 0)
    assert (resolver.num_workers, resolver.worker_index, resolver.is_chief) == (1, 0, True)
    assert resolver.master() == f"grpc://{host}:7000"
    assert resolver.num_accelerators() == {"GPU": 2}
    assert resolver.num_accelerators("worker", 5) == {"GPU": 2}
    assert MPIClusterResolver(comm_self, gpus_per_rank=0).num_accelerators() == {}


def test_mpi_resolver_probes_local_gpus_by_default(comm_self, monkeypatch):
    monkeypatch.setattr("mpistrat.cluster.base.local_gpu_count", lambda: 4)
    assert MPIClusterResolver(comm_self).num_accelerators() == {"GPU": 4}


def test_mpi_resolver_addresses_count_up_per_host(comm_self):  # needs MPI.Get_processor_name
    class ThreeRanksTwoHosts:
        def Get_rank(self):
            return 2

        def Get_size(self):
            return 3

        def allgather(self, _name):
            return ["a", "b", "a"]

    resolver = MPIClusterResolver(ThreeRanksTwoHosts())
    assert resolver.cluster_spec() == {"worker": ["a:8888", "b:8888", "a:8889"]}
    assert (resolver.task_id, resolver.num_workers, resolver.is_chief) == (2, 3, False)
    assert resolver.master() == "a:8889"


@pytest.mark.parametrize("kwargs, match", [
    ({"gpus_per_rank": -1}, "gpus_per_rank must be an integer >= 0"),
    ({"gpus_per_rank": True}, "gpus_per_rank must be an integer >= 0"),
    ({"port_base": -5}, "port_base must be a port number"),
])
def test_mpi_resolver_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MPIClusterResolver(**kwargs)


def test_resolve_cluster_defaults_to_the_mpi_ranks(comm_self):
    MPI = pytest.importorskip("mpi4py.MPI")
    info = resolve_cluster(comm=comm_self)
    assert isinstance(info, ClusterInfo) and isinstance(info.resolver, MPIClusterResolver)
    assert (info.num_workers, info.worker_index, info.is_chief) == (1, 0, True)
    assert (info.task_type, info.task_id) == ("worker", 0)
    assert info.hostnames == (MPI.Get_processor_name(),)
    assert should_checkpoint(info.resolver)


def test_resolve_cluster_checks_other_resolvers(comm_self):
    info = resolve_cluster(TFConfigClusterResolver(env={}), comm_self)
    assert (info.num_workers, info.is_chief, info.hostnames) == (1, True, None)
    with pytest.raises(TopologyError, match="TF_CONFIG describes 3 workers"):
        resolve_cluster(tf_config(CHIEF_2W, "chief", 0), comm_self)


@pytest.mark.parametrize("bad", ["TF_CONFIG", {"worker": ["a:1"]}, ClusterSpec({})])
def test_resolve_cluster_rejects_non_resolvers(comm_self, bad):
    with pytest.raises(TopologyError, match="cluster_resolver must be an instance of "
                                            "mpistrat.ClusterResolver .*fix: pass one of them, "
                                            "or None"):
        resolve_cluster(bad, comm_self)


def test_resolvers_do_not_initialise_mpi_or_import_cupy():
    code = (
        "import sys\n"
        "from mpistrat.cluster import MPIClusterResolver, TFConfigClusterResolver, "
        "SlurmClusterResolver\n"
        "r = MPIClusterResolver(gpus_per_rank=1)\n"
        "assert r.num_accelerators() == {'GPU': 1}\n"
        "TFConfigClusterResolver(env={}).cluster_spec()\n"
        "SlurmClusterResolver(env={})\n"
        "assert 'mpi4py.MPI' not in sys.modules, 'mpi4py.MPI imported'\n"
        "assert 'cupy' not in sys.modules, 'cupy imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
