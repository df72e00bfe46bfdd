"""strategy.cluster=slurm without a cluster: the cluster each task builds from SLURM's variables
(node lists as ``scontrol show hostnames`` expands them, tasks per node, ports, each task's GPUs),
and the one-paragraph errors for an environment that cannot describe one. No TensorFlow."""

import json

import pytest

from gacli.errors import ConfigError
from gacli.runner.cluster import slurm
from helpers import ga_train


@pytest.mark.parametrize(
    "hostlist, hosts",
    [
        ("vm", ["vm"]),
        ("node[1-3]", ["node1", "node2", "node3"]),
        ("gpu[08-10,15],cpu-a", ["gpu08", "gpu09", "gpu10", "gpu15", "cpu-a"]),
        ("r[1-2]-n[01-02]", ["r1-n01", "r1-n02", "r2-n01", "r2-n02"]),
        ("a,b[7],c[009-011]", ["a", "b7", "c009", "c010", "c011"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ],
)
def test_host_lists_expand_as_scontrol_does(hostlist, hosts):
    assert slurm.expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("hostlist", ["node[1-3", "node1-3]", "node[3-1]", "node[a-c]", "a,,b", ""])
def test_host_lists_that_cannot_be_expanded(hostlist):
    with pytest.raises(ValueError):
        slurm.expand_hostlist(hostlist)


def test_tasks_per_node():
    assert slurm.expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert slurm.expand_tasks_per_node("4") == [4]
    with pytest.raises(ValueError):
        slurm.expand_tasks_per_node("2(3)")


def environment(rank, nodes="gpu[1-2]", per_node="2(x2)", ntasks=4, job="4242", **extra):
    """SLURM's variables in one task of an srun step (values as SLURM writes them)."""
    return {
        "SLURM_JOB_ID": job,
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": str(rank),
        "SLURM_NTASKS": str(ntasks),
        "SLURM_STEP_NODELIST": nodes,
        "SLURM_STEP_TASKS_PER_NODE": per_node,
        **extra,
    }


def test_every_task_builds_the_same_cluster_with_distinct_ports_per_node():
    tasks = [slurm.read_task(environment(rank)) for rank in range(4)]
    workers = tasks[0].workers
    assert all(task.workers == workers for task in tasks)
    base = int(workers[0].split(":")[1])
    assert workers == (f"gpu1:{base}", f"gpu1:{base + 1}", f"gpu2:{base}", f"gpu2:{base + 1}")
    assert [(t.rank, t.local_rank, t.tasks_on_node) for t in tasks] == [
        (0, 0, 2),
        (1, 1, 2),
        (2, 0, 2),
        (3, 1, 2),
    ]
    assert 20000 <= base < 60000
    other_job = slurm.read_task(environment(0, job="4243")).workers[0]
    assert other_job != workers[0], "two jobs sharing a node need different ports"
    assert slurm.read_task(environment(0), port=29500).workers[:2] == ("gpu1:29500", "gpu1:29501")


def test_configure_writes_tf_config_and_splits_the_nodes_gpus_once():
    env = environment(3, CUDA_VISIBLE_DEVICES="0,1,2,3")
    slurm.configure(env)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert json.loads(env["TF_CONFIG"])["task"] == {"type": "worker", "index": 3}
    assert len(json.loads(env["TF_CONFIG"])["cluster"]["worker"]) == 4
    slurm.configure(env)  # the strategy calls it again: the share is not split twice
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"


@pytest.mark.parametrize(
    "extra, expected",
    [
        ({}, None),  # a CPU node: nothing to split
        ({"SLURM_GPUS_ON_NODE": "4"}, "2,3"),  # no CUDA_VISIBLE_DEVICES: the node's count
        ({"SLURM_STEP_GPUS": "4,5,6,7"}, "6,7"),
        ({"CUDA_VISIBLE_DEVICES": "5", "SLURM_GPUS_PER_TASK": "1"}, None),  # bound by SLURM
        ({"CUDA_VISIBLE_DEVICES": "0"}, None),  # one GPU: left as SLURM gave it
    ],
)
def test_gpus_from_slurm_variables(extra, expected):
    env = environment(1, nodes="gpu1", per_node="2", ntasks=2, **extra)
    assert slurm.visible_gpus(env, slurm.read_task(env)) == expected


def test_gpus_that_do_not_split_evenly_are_refused():
    env = environment(0, nodes="gpu1", per_node="2", ntasks=2, CUDA_VISIBLE_DEVICES="0,1,2")
    with pytest.raises(ConfigError, match="do not split evenly.*--gpus-per-task"):
        slurm.visible_gpus(env, slurm.read_task(env))


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, "not set here"),
        (environment(0, nodes="gpu[1-2"), "cannot be read"),
        (environment(0, per_node="2(x3)"), "variables disagree"),
        (environment(5), "variables disagree"),
        (dict(environment(0), SLURM_NTASKS="two"), "not a whole number"),
        ({k: v for k, v in environment(0).items() if k != "SLURM_STEP_ID"}, "put srun in front"),
    ],
)
def test_environments_that_describe_no_cluster(env, expected):
    with pytest.raises(ConfigError, match=f"(?i){expected}"):
        slurm.read_task(env)


def test_restart_count():
    assert slurm.restart_count({}) == 0
    assert slurm.restart_count({"SLURM_RESTART_COUNT": "2"}) == 2


# The CLI: a one-paragraph error and exit code 2 before TensorFlow, never a traceback.
SLURM_JOB = ("strategy=multi_worker", "strategy.cluster=slurm", "epochs=1")


@pytest.mark.parametrize(
    "env, first_line",
    [
        (None, "ga-train: strategy.cluster=slurm reads the cluster from SLURM's environment"),
        (
            {**environment(0, nodes="node[1-"), "SLURM_STEP_TASKS_PER_NODE": "2"},
            "ga-train: strategy.cluster=slurm: SLURM's SLURM_STEP_NODELIST='node[1-'",
        ),
    ],
)
def test_ga_train_slurm_errors(tmp_path, env, first_line):
    code, output = ga_train(*SLURM_JOB, cwd=tmp_path, env=env)
    assert code == 2, output
    assert output.strip().splitlines()[0].startswith(first_line), output
    assert "Traceback" not in output


def test_ga_train_several_tasks_without_multi_worker_is_refused(tmp_path):
    env = environment(1, nodes="vm", per_node="2", ntasks=2)
    code, output = ga_train("epochs=1", cwd=tmp_path, env=env)
    assert code == 2 and "Traceback" not in output, output
    assert "one of 2 SLURM tasks" in output and "strategy=multi_worker strategy.cluster=slurm" in (
        output.replace("\n", " ")
    )
