"""ga-train on a SLURM cluster of two nodes (scripts/slurm_two_nodes.sh: two slurmd, each in a
network and UTS namespace of its own, so each node has its own host name and address): srun and
the SLURM guide's sbatch script over both nodes, Hydra's submitit launcher with nodes=2, and a
node that dies in the middle of a window, the worker's and the chief's. Each ends with the weights
of the same training on one process (plain Keras' big batch, WORKER_JOB of test_distributed_cli).
"""

import functools
import glob
import json
import os
import re
import signal
import subprocess
import time

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_distributed_cli import WINDOW, WORKER_JOB
from test_slurm import ga_train_path, guide_sbatch_script, quiet_environment

from helpers import (
    compose_config,
    final_weights,
    ga_train_big_batch_reference,
    record,
    scalars,
    weights_difference,
)

SLURM_CONF = "/etc/slurm-gacli-two-nodes/slurm.conf"
NODES = ("gacli-node1", "gacli-node2")
ONE_PER_NODE = ("-N2", "--ntasks-per-node=1", "--cpus-per-task=1", "--time=10")
TWO_NODES = (*WORKER_JOB, "strategy=multi_worker", "strategy.cluster=slurm")
# Twice as long (48 updates), so that a node dies in the middle of a window, after a checkpoint.
LONGER_JOB = tuple("epochs=4" if a.startswith("epochs=") else a for a in WORKER_JOB)
# A frozen worker is taken as lost after this long (strategy.peer_timeout_seconds).
PEER_TIMEOUT = 10


@functools.cache
def _cluster_problem():
    """Why the two-node cluster cannot run jobs, or None when it can (asked once, when a
    test of this file first runs: sinfo waits seconds for a controller that is not there)."""
    if not os.path.exists(SLURM_CONF):
        return "the two-node SLURM cluster is not set up (bash scripts/slurm_two_nodes.sh)"
    state = subprocess.run(
        ["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, env=environment()
    )
    usable = [
        line.split()[0]
        for line in state.stdout.splitlines()
        if line.split()[1:] and line.split()[1] in ("idle", "mix", "alloc", "comp")
    ]
    if state.returncode or sorted(usable) != list(NODES):
        shown = state.stdout.strip() or state.stderr.strip()
        return f"the two-node SLURM cluster is not up ({shown}); bash scripts/slurm_two_nodes.sh"
    return None


def environment(**extra):
    return dict(quiet_environment(**extra), SLURM_CONF=SLURM_CONF)


pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,
    pytest.mark.distributed,
]


@pytest.fixture(autouse=True, scope="module")
def _cluster_is_up():
    problem = _cluster_problem()
    if problem is not None:
        pytest.skip(problem)


@pytest.fixture(scope="module")
def plain_keras_weights():
    """WORKER_JOB trained by plain Keras on one device, a ``train_on_batch`` per window."""
    return ga_train_big_batch_reference(compose_config(*WORKER_JOB), WINDOW)


def training_pid(node):
    """The process id of the ga-train running on ``node`` (in its network namespace), or None."""
    listed = subprocess.run(["ip", "netns", "pids", node], capture_output=True, text=True)
    for pid in listed.stdout.split():
        try:
            if open(f"/proc/{pid}/comm").read().strip() == "ga-train":
                return int(pid)
        except OSError:
            continue
    return None


def wait_for_checkpoint(run_dir, alive, what):
    deadline = time.time() + 300
    while not glob.glob(os.path.join(run_dir, "checkpoints", "ckpt-*.index")):
        assert alive() and time.time() < deadline, what()
        time.sleep(0.2)


def assert_chief_alone_wrote(run_dir):
    """TensorBoard files (one per start of the run) named by the chief's host (node 1) only,
    nothing named by node 2, and the effective batch, read back from each, counting both nodes'
    replicas. Returns that effective batch."""
    files = glob.glob(os.path.join(run_dir, "tensorboard", "events.out.tfevents.*"))
    assert files and all(f".{NODES[0]}." in os.path.basename(name) for name in files), files
    assert not glob.glob(os.path.join(run_dir, "**", f"*{NODES[1]}*"), recursive=True)
    effective = set()
    for name in files:
        events = EventAccumulator(name)
        events.Reload()
        assert set(scalars(events, "batch/replicas")) == {2.0}
        effective |= set(scalars(events, "batch/effective_size"))
    assert effective == {16 * 4 * 2.0}, effective  # micro-batch x accum_steps x 2 workers
    return effective.pop()


def test_srun_over_two_nodes_trains_as_one_process_would(tmp_path, plain_keras_weights):
    started = time.time()
    result = subprocess.run(
        ["srun", *ONE_PER_NODE, ga_train_path(), *TWO_NODES, "hydra.run.dir=runs/shared"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env=environment(),
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    record(time.time() - started, "test_srun_over_two_nodes: seconds of the srun job")
    # Each worker found the other by host name: the cluster TensorFlow printed, on both nodes.
    clusters = re.findall(r"cluster_spec = \{'worker': \[([^\]]*)\]", output)
    assert len(clusters) == 2 and len(set(clusters)) == 1, output[-3000:]
    assert [host.strip("' ").split(":")[0] for host in clusters[0].split(",")] == list(NODES)
    run_dir = str(tmp_path / "runs" / "shared")
    prints = re.findall(r"weights sha256\s*│\s*([0-9a-f]{16})", output)
    assert len(prints) == 2 and prints[0] == prints[1], output[-3000:]
    record(assert_chief_alone_wrote(run_dir), "test_srun_over_two_nodes: effective batch")
    measured = record(
        weights_difference(final_weights(run_dir), plain_keras_weights),
        "test_srun_over_two_nodes (2 nodes vs plain Keras big batch)",
    )
    assert measured <= 1e-6


def test_guide_sbatch_on_two_nodes_a_worker_killed_then_requeued_ends_at_the_weights(tmp_path):
    """The guide's script over two nodes (sbatch --nodes=2 --ntasks-per-node=1); node 2's worker
    is killed after the first checkpoint, mid-run: the chief stops at once, naming node 2, and
    the job fails. Requeued, it runs on the two nodes again and goes on from the checkpoint."""
    script = tmp_path / "train.sbatch"
    script.write_text(guide_sbatch_script())
    started = time.time()
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=1", str(script), *LONGER_JOB,
         "checkpoint_every_updates=2", f"strategy.peer_timeout_seconds={PEER_TIMEOUT}"],
        cwd=tmp_path, capture_output=True, text=True, check=True, env=environment(),
    )  # fmt: skip
    job_id = submitted.stdout.strip().split(";")[0]
    run_dir = str(tmp_path / "runs" / job_id)
    log_file = tmp_path / f"slurm-{job_id}.out"

    def job_state():
        listed = subprocess.run(
            ["scontrol", "show", "job", job_id], capture_output=True, text=True, env=environment()
        )
        return re.search(r"JobState=(\w+)", listed.stdout).group(1)

    wait_for_checkpoint(
        run_dir, lambda: job_state() in ("PENDING", "RUNNING"), lambda: log_file.read_text()
    )
    chief = training_pid(NODES[0])
    os.kill(training_pid(NODES[1]), signal.SIGKILL)
    killed = time.time()
    while os.path.exists(f"/proc/{chief}") and time.time() - killed < 120:
        time.sleep(0.1)
    waited = record(time.time() - killed, "test_sbatch_two_nodes: seconds the chief waited")
    while job_state() in ("RUNNING", "COMPLETING"):
        assert time.time() - killed < 120, log_file.read_text()[-3000:]
        time.sleep(0.2)
    assert job_state() == "FAILED", log_file.read_text()[-3000:]
    first = log_file.read_text()
    assert waited <= PEER_TIMEOUT + 5, first[-3000:]
    assert f"ga-train: lost the worker on {NODES[1]} (worker 1, {NODES[1]}:" in first, first
    # Told by a closed connection when the chief was calling it, else by the missing heartbeat.
    assert "its connection closed" in first or f"no heartbeat within {PEER_TIMEOUT} s" in first
    assert "Traceback" not in first
    assert not os.path.exists(os.path.join(run_dir, "result.json"))
    # Requeued (SLURM does this by itself for a node that fails; a killed process is requeued
    # by hand), on the same two nodes.
    subprocess.run(["scontrol", "requeue", job_id], check=True, env=environment())
    deadline = time.time() + 300
    while job_state() not in ("COMPLETED", "FAILED", "CANCELLED"):
        assert time.time() < deadline, log_file.read_text()[-3000:]
        time.sleep(1)
    log = log_file.read_text()
    record(time.time() - started, "test_sbatch_two_nodes: seconds from sbatch to the end")
    assert job_state() == "COMPLETED", log[-3000:]
    assert log.count(f"SLURM restart 1 of job {job_id}: going on from the checkpoints") == 2, log
    assert_chief_alone_wrote(run_dir)
    reference = ga_train_big_batch_reference(compose_config(*LONGER_JOB), WINDOW)
    measured = record(
        weights_difference(final_weights(run_dir), reference),
        "test_sbatch_two_nodes (worker killed, requeued once, vs plain Keras big batch)",
    )
    assert measured <= 1e-6


def test_a_frozen_chief_node_ends_the_worker_within_the_timeout_and_a_rerun_resumes(tmp_path):
    """Node 1 (the chief, which also holds TensorFlow's coordination service) stops answering
    mid-run (SIGSTOP: its connections stay open, as with a cut network). The worker on node 2
    gives up within strategy.peer_timeout_seconds, naming node 1; the same command with resume=
    on the two nodes ends at the uninterrupted weights."""
    command = [
        "srun", *ONE_PER_NODE, ga_train_path(), *LONGER_JOB, "strategy=multi_worker",
        "strategy.cluster=slurm", "checkpoint_every_updates=2",
        f"strategy.peer_timeout_seconds={PEER_TIMEOUT}", "hydra.run.dir=runs/shared",
    ]  # fmt: skip
    started = time.time()
    job = subprocess.Popen(
        command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=environment(),
    )  # fmt: skip
    run_dir = str(tmp_path / "runs" / "shared")
    wait_for_checkpoint(run_dir, lambda: job.poll() is None, lambda: job.communicate()[0])
    chief, worker = training_pid(NODES[0]), training_pid(NODES[1])
    os.kill(chief, signal.SIGSTOP)
    frozen = time.time()
    try:
        while os.path.exists(f"/proc/{worker}") and time.time() - frozen < 120:
            time.sleep(0.1)
        waited = record(time.time() - frozen, "test_frozen_chief: seconds the worker waited")
    finally:
        os.kill(chief, signal.SIGKILL)
    output = job.communicate(timeout=120)[0]
    assert job.returncode != 0
    assert waited <= PEER_TIMEOUT + 5, output[-3000:]
    assert f"ga-train: lost the worker on {NODES[0]} (worker 0, {NODES[0]}:" in output, output
    assert f"no heartbeat within {PEER_TIMEOUT} s" in output and "Traceback" not in output
    assert f"srun: error: {NODES[1]}: task 1: Exited with exit code 1" in output, output[-2000:]
    again = subprocess.run(
        [*command, f"resume={run_dir}"], cwd=tmp_path, capture_output=True, text=True,
        timeout=600, env=environment(),
    )  # fmt: skip
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    record(time.time() - started, "test_frozen_chief: seconds to the end, resume included")
    reference = ga_train_big_batch_reference(compose_config(*LONGER_JOB), WINDOW)
    measured = record(
        weights_difference(final_weights(run_dir), reference),
        "test_frozen_chief (chief frozen, resumed once, vs plain Keras big batch)",
    )
    assert measured <= 1e-6


def test_submitit_two_nodes_make_one_two_worker_job(tmp_path, plain_keras_weights):
    started = time.time()
    result = subprocess.run(
        [ga_train_path(), "-m", "hydra/launcher=submitit_slurm", "hydra.launcher.nodes=2",
         "hydra.launcher.tasks_per_node=1", "hydra.launcher.cpus_per_task=1",
         "hydra.launcher.timeout_min=10", "hydra.sweep.dir=sweep", *TWO_NODES],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env=environment(),
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    record(time.time() - started, "test_submitit_two_nodes: seconds for the 2-node job")
    (run_dir,) = glob.glob(str(tmp_path / "sweep" / "0_*"))
    result = json.load(open(os.path.join(run_dir, "result.json")))
    assert result["effective_batch_size"] == 128 and result["micro_batch_size"] == 16
    logs = glob.glob(str(tmp_path / "sweep" / ".submitit" / "*" / "*_1_log.*"))
    task_1 = "".join(open(path).read() for path in logs)
    assert f"'{NODES[0]}:" in task_1 and "task_id = 1" in task_1, "task 1 took part, on node 2"
    assert_chief_alone_wrote(run_dir)
    measured = record(
        weights_difference(final_weights(run_dir), plain_keras_weights),
        "test_submitit_two_nodes (vs plain Keras big batch)",
    )
    assert measured <= 1e-6
