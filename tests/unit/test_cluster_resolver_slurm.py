"""SlurmClusterResolver: host lists, tasks per node, placement and GPUs, from plain dicts."""

from __future__ import annotations

import types

import pytest

from mpistrat.cluster import (
    SlurmClusterResolver,
    expand_hostlist,
    expand_tasks_per_node,
    match_world,
    read_slurm_step,
)
from mpistrat.errors import TopologyError


def step_env(procid, nodelist="node[01-02]", tasks="2(x2)", **more):
    """The variables srun sets for task ``procid`` of a step (block distribution)."""
    env = {"SLURM_PROCID": str(procid), "SLURM_STEP_NODELIST": nodelist,
           "SLURM_STEP_TASKS_PER_NODE": tasks}
    env.update({key: str(value) for key, value in more.items()})
    return env


# --- Slurm list syntaxes -------------------------------------------------------------------


@pytest.mark.parametrize("text, hosts", [
    ("n1", ["n1"]),
    ("node[01-03,07],gpu-a[1-2]", ["node01", "node02", "node03", "node07", "gpu-a1", "gpu-a2"]),
    ("n[1,3-4],m5,o[6]", ["n1", "n3", "n4", "m5", "o6"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[08-10]", ["n08", "n09", "n10"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("n[1-2]-ib", ["n1-ib", "n2-ib"]),
    ("a-b-c, d", ["a-b-c", "d"]),
    ("n1,n1", ["n1", "n1"]),
])
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text, problem", [
    ("n[1-2", r"'\[' without '\]'"),
    ("n1-2]", r"'\]' without '\['"),
    ("n[[1]]", r"nested '\['"),
    ("n[a-b]", "range 'a-b' is not N or N-M"),
    ("n[]", "range '' is not N or N-M"),
    ("n[3-1]", "range '3-1' ends below its start"),
    ("a,,b", "an empty host name"),
    ("", "an empty host name"),
])
def test_expand_hostlist_errors_name_variable_and_value(text, problem):
    match = rf"SLURM_JOB_NODELIST='.*' is not a Slurm host list \({problem}"
    with pytest.raises(TopologyError, match=match):
        expand_hostlist(text, "SLURM_JOB_NODELIST")


@pytest.mark.parametrize("text, counts", [
    ("2(x3),1", [2, 2, 2, 1]), ("4", [4]), ("1(x2)", [1, 1]), (" 3 , 1 ", [3, 1]),
])
def test_expand_tasks_per_node(text, counts):
    assert expand_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["2(3)", "x", "", "2(x)", "-1"])
def test_expand_tasks_per_node_errors(text):
    match = "SLURM_TASKS_PER_NODE=.* is not a Slurm tasks-per-node"
    with pytest.raises(TopologyError, match=match):
        expand_tasks_per_node(text, "SLURM_TASKS_PER_NODE")


# --- the cluster of a step -----------------------------------------------------------------


@pytest.mark.parametrize("procid, host, local", [(0, "node01", 0), (1, "node01", 1),
                                                 (2, "node02", 0), (3, "node02", 1)])
def test_block_step(procid, host, local):
    resolver = SlurmClusterResolver(env=step_env(procid, SLURM_LOCALID=local,
                                                 SLURMD_NODENAME=host))
    assert resolver.cluster_spec() == {
        "worker": ["node01:8888", "node01:8889", "node02:8888", "node02:8889"]}
    assert (resolver.task_type, resolver.task_id, resolver.local_rank) == ("worker", procid, local)
    assert resolver.master() == f"grpc://{host}:{8888 + local}"
    assert resolver.master("worker", 0, rpc_layer="http") == "http://node01:8888"
    assert resolver.rpc_layer == "grpc" and resolver.environment == ""
    assert (resolver.num_workers, resolver.worker_index) == (4, procid)
    assert resolver.is_chief is (procid == 0)


def test_job_variables_and_fallbacks():
    env = {"SLURM_PROCID": "2", "SLURM_JOB_NODELIST": "a,b", "SLURM_TASKS_PER_NODE": "2,1",
           "SLURM_NTASKS": "3", "SLURM_NNODES": "2"}
    assert SlurmClusterResolver(env=env).cluster_spec() == {"worker": ["a:8888", "a:8889",
                                                                       "b:8888"]}
    env = {"SLURM_PROCID": "1", "SLURM_NODELIST": "a,b", "SLURM_NTASKS_PER_NODE": "1"}
    assert SlurmClusterResolver(env=env).master() == "grpc://b:8888"


def test_tasks_per_node_and_port_base_arguments():
    env = step_env(3, nodelist="a,b", tasks="9")  # the argument wins over the variable
    resolver = SlurmClusterResolver(tasks_per_node=2, port_base=1000, rpc_layer=None, env=env)
    assert resolver.cluster_spec() == {"worker": ["a:1000", "a:1001", "b:1000", "b:1001"]}
    assert resolver.master() == "b:1001"
    by_host = SlurmClusterResolver(tasks_per_node={"a": 1, "b": 3}, env=env)
    assert by_host.cluster_spec().job_tasks("worker")[3] == "b:8890"
    with pytest.raises(TopologyError, match=r"tasks_per_node has no count for host\(s\) \['b'\]"):
        SlurmClusterResolver(tasks_per_node={"a": 4}, env=env).cluster_spec()


@pytest.mark.parametrize("procid, task", [(0, ("chief", 0)), (1, ("worker", 0)),
                                          (3, ("worker", 2))])
def test_jobs_take_ranks_in_job_name_order(procid, task):
    resolver = SlurmClusterResolver(jobs={"worker": 3, "chief": 1}, env=step_env(procid))
    assert resolver.cluster_spec() == {"chief": ["node01:8888"],
                                       "worker": ["node01:8889", "node02:8888", "node02:8889"]}
    assert (resolver.task_type, resolver.task_id) == task
    assert resolver.is_chief is (procid == 0)


def test_jobs_must_add_up_to_the_step():
    resolver = SlurmClusterResolver(jobs={"worker": 3}, env=step_env(0))
    with pytest.raises(TopologyError, match=r"jobs=\{'worker': 3\} ask for 3 tasks but the "
                                            r"Slurm step has 4 \(SLURM_STEP_NODELIST="):
        resolver.cluster_spec()


@pytest.mark.parametrize("env, match", [
    ({}, "SLURM_PROCID is not set: this process is not a task of a Slurm job step.*srun"),
    ({"SLURM_PROCID": "0"}, "neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is set"),
    ({"SLURM_PROCID": "0", "SLURM_STEP_NODELIST": "a"},
     "SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE is not set"),
])
def test_outside_slurm_is_a_runtime_error_on_first_use(env, match):
    resolver = SlurmClusterResolver(env=env)  # does not raise here
    for use in (resolver.cluster_spec, lambda: resolver.task_id, lambda: resolver.gpu_ids,
                resolver.num_accelerators, resolver.master):
        with pytest.raises(RuntimeError, match=match):
            use()
    assert "MPIClusterResolver" in str(pytest.raises(RuntimeError, resolver.cluster_spec).value)


@pytest.mark.parametrize("env, match", [
    (step_env(0, nodelist="n[1-"), r"SLURM_STEP_NODELIST='n\[1-' is not a Slurm host list"),
    (step_env(0, tasks="2,2,2"), r"SLURM_STEP_TASKS_PER_NODE='2,2,2' gives 3 node\(s\) but "
                                 r"SLURM_STEP_NODELIST='node\[01-02\]' lists 2"),
    (step_env(0, SLURM_STEP_NUM_TASKS=5), "SLURM_STEP_NUM_TASKS=5 but .* give 4 tasks"),
    (step_env(0, SLURM_STEP_NUM_NODES=3), "SLURM_STEP_NUM_NODES=3 but .* give 2 hosts"),
    (step_env(4), "SLURM_PROCID=4 is not below the 4 tasks"),
    (step_env("x"), "SLURM_PROCID='x' is not a non-negative integer"),
    (step_env(1, SLURM_LOCALID=0), r"SLURM_PROCID=1 should be task 1 on host node01 \(block "
                                   r"distribution .*but SLURM_LOCALID=0.*MPIClusterResolver"),
    (step_env(2, SLURMD_NODENAME="node01"), "should be task 0 on host node02.*SLURMD_NODENAME"),
    (step_env(0, SLURM_DISTRIBUTION="arbitrary"), "SLURM_DISTRIBUTION='arbitrary': cannot tell"),
])
def test_inconsistent_step_variables(env, match):
    with pytest.raises(TopologyError, match=match):
        SlurmClusterResolver(env=env).cluster_spec()


@pytest.mark.parametrize("distribution, tasks, order", [
    ("cyclic", "2(x2)", [("a", 0), ("b", 0), ("a", 1), ("b", 1)]),
    ("cyclic:block", "3,1", [("a", 0), ("b", 0), ("a", 1), ("a", 2)]),
    ("plane=2", "3,2", [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("a", 2)]),
    ("block:cyclic", "2(x2)", [("a", 0), ("a", 1), ("b", 0), ("b", 1)]),
])
def test_distributions_place_ranks(distribution, tasks, order):
    env = step_env(0, nodelist="a,b", tasks=tasks, SLURM_DISTRIBUTION=distribution)
    expected = [f"{host}:{8888 + local}" for host, local in order]
    assert SlurmClusterResolver(env=env).cluster_spec() == {"worker": expected}
    last = len(order) - 1
    env = step_env(last, nodelist="a,b", tasks=tasks, SLURM_DISTRIBUTION=distribution,
                   SLURM_LOCALID=order[last][1], SLURMD_NODENAME=order[last][0])
    assert SlurmClusterResolver(env=env).local_rank == order[last][1]


# --- GPUs ------------------------------------------------------------------------------


def test_node_wide_gpus_are_shared_out_by_local_id():
    env = step_env(3, tasks="4", nodelist="n", SLURM_GPUS_ON_NODE=4,
                   CUDA_VISIBLE_DEVICES="0,1,2,3")
    resolver = SlurmClusterResolver(env=env)
    assert resolver.gpu_ids == ("3",) and resolver.num_accelerators() == {"GPU": 1}
    assert env["CUDA_VISIBLE_DEVICES"] == "3" and resolver.device_ordinals == (0,)


def test_without_auto_set_gpu_the_environment_is_left_alone():
    env = step_env(1, tasks="2", nodelist="n", SLURM_GPUS_ON_NODE=8,
                   CUDA_VISIBLE_DEVICES="4,5,6,7,8,9,10,11")
    resolver = SlurmClusterResolver(auto_set_gpu=False, env=env)
    assert resolver.gpu_ids == ("8", "9", "10", "11")
    assert resolver.device_ordinals == (4, 5, 6, 7)
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7,8,9,10,11"


def test_gpus_bound_per_task_by_slurm_are_used_as_given():
    env = step_env(1, tasks="4", nodelist="n", SLURM_GPUS_PER_TASK=1, SLURM_GPUS_ON_NODE=4,
                   CUDA_VISIBLE_DEVICES="1")
    resolver = SlurmClusterResolver(auto_set_gpu=False, env=env)
    assert resolver.gpu_ids == ("1",) and resolver.device_ordinals == (0,)
    assert resolver.num_accelerators("worker", 3) == {"GPU": 1}


def test_gpus_per_task_without_binding_picks_by_local_id():
    env = step_env(3, SLURM_GPUS_PER_TASK="a100:2", CUDA_VISIBLE_DEVICES="0,1,2,3")
    resolver = SlurmClusterResolver(env=env)
    assert resolver.gpu_ids == ("2", "3") and env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert resolver.num_accelerators() == {"GPU": 2}


def test_without_cuda_visible_devices_gpus_are_numbered_from_the_node_count():
    env = step_env(3, SLURM_GPUS_ON_NODE=4)
    resolver = SlurmClusterResolver(env=env)
    assert resolver.gpu_ids == ("2", "3") and env["CUDA_VISIBLE_DEVICES"] == "2,3"
    explicit = SlurmClusterResolver(gpus_per_node=2, auto_set_gpu=False, env=step_env(1))
    assert explicit.gpu_ids == ("1",) and explicit.device_ordinals == (1,)


def test_no_gpus_reports_zero_and_sets_nothing():
    env = step_env(1)
    resolver = SlurmClusterResolver(env=env)
    assert resolver.num_accelerators() == {"GPU": 0} and resolver.gpu_ids == ()
    assert "CUDA_VISIBLE_DEVICES" not in env
    assert SlurmClusterResolver(env=step_env(1, CUDA_VISIBLE_DEVICES="NoDevFiles")).gpu_ids == ()


def test_read_only_environment_is_not_written():
    env = types.MappingProxyType(step_env(1, SLURM_GPUS_ON_NODE=4))
    resolver = SlurmClusterResolver(env=env)
    assert resolver.gpu_ids == ("2", "3") and resolver.device_ordinals == (2, 3)


@pytest.mark.parametrize("kwargs, env, match", [
    ({}, step_env(0, SLURM_GPUS_PER_TASK=2, CUDA_VISIBLE_DEVICES="0,1,2"),
     r"CUDA_VISIBLE_DEVICES='0,1,2' lists 3 GPU\(s\): neither this task's 2 "
     r"\(SLURM_GPUS_PER_TASK\) nor enough for the 2 tasks on this node \(2 x 2 = 4\)"),
    ({"gpus_per_task": 3}, step_env(0, SLURM_GPUS_ON_NODE=4),
     r"requested more GPUs per node than available: 2 tasks on this node x 3 GPUs per task "
     r"\(gpus_per_task=3\) = 6 > 4 \(SLURM_GPUS_ON_NODE\)"),
    ({}, step_env(0, SLURM_GPUS_PER_TASK="two"), "SLURM_GPUS_PER_TASK='two' is not"),
    ({}, step_env(0, SLURM_GPUS_ON_NODE="-1"), "SLURM_GPUS_ON_NODE='-1' is not a non-negative"),
])
def test_gpu_errors(kwargs, env, match):
    with pytest.raises(TopologyError, match=match):
        SlurmClusterResolver(env=env, **kwargs).gpu_ids


def test_gpus_per_node_argument_wins_over_the_variable():
    step = read_slurm_step(step_env(1, SLURM_GPUS_ON_NODE=8), gpus_per_node=2)
    assert (step.gpus_per_task, step.gpu_ids, step.num_tasks, step.node) == (1, ("1",), 4, 0)


@pytest.mark.parametrize("kwargs, match", [
    ({"jobs": {"worker": -1}}, "jobs must map job names to task counts"),
    ({"jobs": ["worker"]}, "jobs must map job names to task counts"),
    ({"port_base": 70000}, "port_base must be a port number"),
    ({"port_base": "8888"}, "port_base must be a port number"),
    ({"gpus_per_node": -1}, "gpus_per_node must be an integer >= 0"),
    ({"gpus_per_task": 1.0}, "gpus_per_task must be an integer >= 0"),
    ({"tasks_per_node": 0}, "tasks_per_node must be an integer >= 1"),
    ({"tasks_per_node": {"a": 0}}, "tasks_per_node must be an integer >= 1"),
])
def test_bad_arguments_raise_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SlurmClusterResolver(env=step_env(0), **kwargs)


# --- environments recorded from Slurm 22.05.8 (one node named localhost) ----------------

SRUN_N2_TASK1 = {  # srun -n 2 ..., task 1
    "SLURMD_NODENAME": "localhost", "SLURM_JOB_NODELIST": "localhost",
    "SLURM_JOB_NUM_NODES": "1", "SLURM_LOCALID": "1", "SLURM_NNODES": "1",
    "SLURM_NODEID": "0", "SLURM_NODELIST": "localhost", "SLURM_NTASKS": "2",
    "SLURM_PROCID": "1", "SLURM_STEP_NODELIST": "localhost", "SLURM_STEP_NUM_NODES": "1",
    "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2",
    "SLURM_TASKS_PER_NODE": "2",
}

MPIEXEC_IN_SBATCH_N2_RANK1 = {  # sbatch -n 2 with mpiexec -n 2 (Hydra starts one srun task)
    "SLURMD_NODENAME": "localhost", "SLURM_DISTRIBUTION": "cyclic",
    "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_NUM_NODES": "1", "SLURM_LOCALID": "0",
    "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_NODELIST": "localhost",
    "SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "localhost", "SLURM_STEP_NUM_NODES": "1",
    "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_TASKS_PER_NODE": "1",
    "SLURM_TASKS_PER_NODE": "1",
}


def test_recorded_srun_task():
    resolver = SlurmClusterResolver(env=dict(SRUN_N2_TASK1))
    assert resolver.cluster_spec() == {"worker": ["localhost:8888", "localhost:8889"]}
    assert (resolver.task_id, resolver.local_rank, resolver.master()) == (
        1, 1, "grpc://localhost:8889")


def test_recorded_mpiexec_rank_sees_the_launcher_step_not_the_ranks():
    resolver = SlurmClusterResolver(env=dict(MPIEXEC_IN_SBATCH_N2_RANK1))
    assert (resolver.num_workers, resolver.task_id) == (1, 0)
    with pytest.raises(TopologyError, match="the MPI communicator has 2 ranks and this is "
                                            "rank 1; fix: .*under mpirun inside an allocation"):
        match_world(resolver, 1, 2)
