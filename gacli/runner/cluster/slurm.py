"""A multi-worker cluster read from SLURM's environment, for ``strategy.cluster=slurm``.

One ``ga-train`` runs in each SLURM task (``srun``, or Hydra's submitit launcher). Every task reads
the same variables, so every task builds the same cluster: the step's node list expanded the way
``scontrol show hostnames`` does, the tasks of each node in rank order (SLURM's default block
distribution), and on each node one port per task from a base that the job id picks, so that two
jobs sharing a node do not collide. The result is written as ``TF_CONFIG``, which TensorFlow's
``MultiWorkerMirroredStrategy`` and gacli's chief check read.

GPUs come from SLURM's own variables (``CUDA_VISIBLE_DEVICES`` as SLURM sets it for the step,
``SLURM_STEP_GPUS``/``SLURM_JOB_GPUS``, ``SLURM_GPUS_ON_NODE``); nothing runs ``nvidia-smi``,
which TensorFlow's ``SlurmClusterResolver`` does and which fails on CPU nodes. Where the tasks of a
node all see the same GPUs, each takes its own equal share, before TensorFlow starts.

No TensorFlow import: every error here is the user's input and answers at once.
"""

import json
import os
import re
from dataclasses import dataclass

from gacli.errors import ConfigError

# Ports of one job step on one node: base, base + 1, ... one per task of the node. The base is
# derived from the job and step ids within [_FIRST_PORT, _FIRST_PORT + _PORT_BLOCKS * _BLOCK).
_FIRST_PORT = 20000
_BLOCK = 16
_PORT_BLOCKS = 2500
_ROOM = re.compile(r"\[([^\[\]]*)\]")
_REPEAT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def expand_hostlist(hostlist):
    """``"gpu[01-03,7],cpu-a"`` -> ``["gpu01", "gpu02", "gpu03", "gpu7", "cpu-a"]``.

    SLURM's compressed host list: names separated by commas outside brackets, each bracket a
    comma-separated list of numbers and ``low-high`` ranges (the width of ``low`` is kept, so
    ``[08-10]`` gives 08, 09, 10); several brackets in one name multiply out.
    Raises ValueError for anything else.
    """
    names, depth, start = [], 0, 0
    for position, character in enumerate(hostlist + ","):
        if character == "[":
            depth += 1
        elif character == "]":
            depth -= 1
        if depth not in (0, 1):
            raise ValueError("unbalanced brackets")
        if character == "," and depth == 0:
            part = hostlist[start:position].strip()
            if not part:
                raise ValueError("an empty name")
            names.extend(_expand_name(part))
            start = position + 1
    if depth:
        raise ValueError("unbalanced brackets")
    return names


def _expand_name(name):
    match = _ROOM.search(name)
    if match is None:
        if "[" in name or "]" in name:
            raise ValueError("unbalanced brackets")
        return [name]
    head, tail = name[: match.start()], name[match.end() :]
    return [
        head + number + rest for number in _numbers(match.group(1)) for rest in _expand_name(tail)
    ]


def _numbers(ranges):
    numbers = []
    for item in ranges.split(","):
        low, _, high = item.strip().partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"[{ranges}] is not a list of numbers and ranges")
        if high and int(high) < int(low):
            raise ValueError(f"the range {item} runs backwards")
        width = len(low)
        numbers.extend(str(n).zfill(width) for n in range(int(low), int(high or low) + 1))
    return numbers


def expand_tasks_per_node(text):
    """``"2(x3),1"`` -> ``[2, 2, 2, 1]``: SLURM's tasks on each node of the step, in node order."""
    counts = []
    for item in text.split(","):
        match = _REPEAT.match(item.strip())
        if match is None:
            raise ValueError(f"{item!r} is not N or N(xM)")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


@dataclass(frozen=True)
class SlurmTask:
    """This process's place in the step: every task of the step computes the same ``workers``."""

    workers: tuple  # "host:port" of every task, in rank order
    rank: int
    local_rank: int  # among the tasks of this node
    tasks_on_node: int

    def tf_config(self):
        return {
            "cluster": {"worker": list(self.workers)},
            "task": {"type": "worker", "index": self.rank},
        }


def _variable(environ, *names):
    for name in names:
        if environ.get(name):
            return name, environ[name]
    return None, None


def _integer(environ, name):
    value = environ.get(name, "")
    if not value.strip().isdigit():
        raise ConfigError(
            f"strategy.cluster=slurm: SLURM's {name}={value!r} is not a whole number, so the "
            "cluster cannot be built; start ga-train with srun inside an allocation, where SLURM "
            "sets it, or describe the cluster yourself with strategy.cluster=tf_config and "
            "TF_CONFIG."
        )
    return int(value)


def read_task(environ, port=None):
    """This task's :class:`SlurmTask`, from SLURM's variables in ``environ``.

    ``port``: the first port of each node (``strategy.port``); None picks one from the job id.
    Raises ConfigError with what to do when the variables are missing or do not fit together.
    """
    if not environ.get("SLURM_JOB_ID") or not environ.get("SLURM_PROCID"):
        raise ConfigError(
            "strategy.cluster=slurm reads the cluster from SLURM's environment, which is not set "
            "here (no SLURM_JOB_ID/SLURM_PROCID): run ga-train through srun inside an allocation "
            "(an sbatch script: srun ga-train ... strategy=multi_worker strategy.cluster=slurm), "
            "or through Hydra's submitit launcher (-m hydra/launcher=submitit_slurm), or use "
            "strategy.cluster=tf_config with a TF_CONFIG of your own."
        )
    ntasks, rank = _integer(environ, "SLURM_NTASKS"), _integer(environ, "SLURM_PROCID")
    if "SLURM_STEP_ID" not in environ and ntasks > 1:
        raise ConfigError(
            f"strategy.cluster=slurm: this is the batch script of a job of {ntasks} tasks, which "
            "runs once, so the other workers would never start. Put srun in front of ga-train in "
            "the script (srun ga-train ...) to start one ga-train per task."
        )
    list_name, hostlist = _variable(
        environ, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"
    )
    counts_name, counts = _variable(environ, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    try:
        hosts = expand_hostlist(hostlist or "")
        per_node = expand_tasks_per_node(counts or "")
    except ValueError as error:
        raise ConfigError(
            f"strategy.cluster=slurm: SLURM's {list_name or 'SLURM_STEP_NODELIST'}={hostlist!r} "
            f"and {counts_name or 'SLURM_STEP_TASKS_PER_NODE'}={counts!r} cannot be read ({error})."
            " They are SLURM's own; if they were set by hand, give them as SLURM writes them "
            "(node[01-04], 2(x4)), or use strategy.cluster=tf_config with TF_CONFIG."
        ) from None
    if len(hosts) != len(per_node) or sum(per_node) != ntasks or not 0 <= rank < ntasks:
        raise ConfigError(
            f"strategy.cluster=slurm: SLURM's variables disagree: {len(hosts)} node(s) "
            f"({hostlist}) with {counts} tasks per node, but SLURM_NTASKS={ntasks} and "
            f"SLURM_PROCID={rank}. Start ga-train with srun in an allocation without changing "
            "these variables, or use strategy.cluster=tf_config with TF_CONFIG."
        )
    base = port if port else _port_base(environ)
    if base + max(per_node) > 65536:
        raise ConfigError(
            f"strategy.port={base}: the ports {base}-{base + max(per_node) - 1} do not all exist; "
            "give a port below 65000, e.g. strategy.port=29500."
        )
    workers = [f"{host}:{base + i}" for host, count in zip(hosts, per_node) for i in range(count)]
    node = _node_of(rank, per_node)
    return SlurmTask(
        workers=tuple(workers),
        rank=rank,
        local_rank=rank - sum(per_node[:node]),
        tasks_on_node=per_node[node],
    )


def _node_of(rank, per_node):
    first = 0
    for node, count in enumerate(per_node):
        if rank < first + count:
            return node
        first += count
    raise AssertionError("rank checked against SLURM_NTASKS before")


def _port_base(environ):
    job = (
        int(environ["SLURM_JOB_ID"].split("_")[0])
        if environ["SLURM_JOB_ID"].split("_")[0].isdigit()
        else 0
    )
    step = (
        int(environ.get("SLURM_STEP_ID", "0")) if environ.get("SLURM_STEP_ID", "").isdigit() else 0
    )
    return _FIRST_PORT + _BLOCK * ((job * 7 + step) % _PORT_BLOCKS)


def visible_gpus(environ, task):
    """The ``CUDA_VISIBLE_DEVICES`` this task should have, or None to leave it as it is.

    SLURM binds GPUs per task itself with ``--gpus-per-task`` (or ``--gpu-bind``); then each task
    already sees its own and nothing changes. When the tasks of a node all see the node's GPUs,
    each takes an equal share in local-rank order, as one worker per GPU group expects.
    """
    if environ.get("SLURM_GPUS_PER_TASK") or task.tasks_on_node == 1:
        return None
    _, listed = _variable(environ, "CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS")
    if listed is not None:
        gpus = [gpu.strip() for gpu in listed.split(",") if gpu.strip()]
    else:
        count = environ.get("SLURM_GPUS_ON_NODE", "")
        gpus = [str(index) for index in range(int(count))] if count.isdigit() else []
    if len(gpus) <= 1:
        return None  # a CPU node, or one GPU the tasks were given to share or bound to already
    if len(gpus) % task.tasks_on_node:
        raise ConfigError(
            f"strategy.cluster=slurm: {task.tasks_on_node} tasks on this node share {len(gpus)} "
            f"GPUs ({','.join(gpus)}), which do not split evenly between them. Ask SLURM for a "
            "number of tasks per node that divides the GPUs, or bind them yourself with "
            "--gpus-per-task=N."
        )
    share = len(gpus) // task.tasks_on_node
    return ",".join(gpus[task.local_rank * share : (task.local_rank + 1) * share])


def configure(environ=None, port=None):
    """Read this task's place from SLURM and set ``TF_CONFIG`` (and its share of the GPUs) in
    ``environ`` (default: this process's environment). Call before TensorFlow starts its GPUs.
    Returns the :class:`SlurmTask`."""
    environ = os.environ if environ is None else environ
    task = read_task(environ, port)
    tf_config = json.dumps(task.tf_config())
    if environ.get("TF_CONFIG") == tf_config:
        return task  # configured already (the GPUs split once)
    gpus = visible_gpus(environ, task)
    if gpus is not None:
        environ["CUDA_VISIBLE_DEVICES"] = gpus
    environ["TF_CONFIG"] = tf_config
    return task


def restart_count(environ=None):
    """How often SLURM has started this job again (requeue, preemption); 0 outside SLURM."""
    value = (os.environ if environ is None else environ).get("SLURM_RESTART_COUNT", "0")
    return int(value) if value.isdigit() else 0
