"""ga-train on a real one-node SLURM cluster (scripts/slurm_local.sh): two srun tasks training
together, the SLURM guide's sbatch script requeued in the middle of its run, and Hydra's submitit
launcher submitting a sweep and a job of two tasks. Each ends with the weights of the same
training on one process (plain Keras' big batch, WORKER_JOB of test_distributed_cli)."""

import functools
import glob
import json
import os
import re
import shutil
import subprocess
import time

import pytest
from test_distributed_cli import WINDOW, WORKER_JOB

from helpers import (
    ROOT,
    compose_config,
    final_weights,
    ga_report,
    ga_train,
    ga_train_big_batch_reference,
    record,
    weights_difference,
)

SLURM_GUIDE = os.path.join(ROOT, "docs", "guides", "distributed.md")
# The job of test_distributed_cli as 2 workers x micro-batches of 16 (global 32), k=4.
TWO_TASKS = (*WORKER_JOB, "strategy=multi_worker", "strategy.cluster=slurm")


@functools.cache
def _cluster_problem():
    """Why the local SLURM cluster cannot run jobs, or None when it can (asked once, when a
    test of this file first runs: sinfo waits seconds for a controller that is not there)."""
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return "SLURM's commands are not installed (bash scripts/slurm_local.sh installs them)"
    state = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True)
    # A node that answers (no '*'), busy or not: idle, mix, alloc, comp (a job completing).
    usable = [s for s in state.stdout.split() if s in ("idle", "mix", "alloc", "comp")]
    if state.returncode or not usable:
        shown = state.stdout.strip() or state.stderr.strip()
        return f"no SLURM node is up ({shown}); start one with bash scripts/slurm_local.sh"
    return None


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


def wait_for_job(job_id, timeout=600):
    """Wait until SLURM no longer lists ``job_id`` (finished, failed or cancelled)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        listed = subprocess.run(
            ["squeue", "-h", "-j", str(job_id), "-o", "%T"], capture_output=True, text=True
        )
        if not listed.stdout.strip():
            return
        time.sleep(2)
    subprocess.run(["scancel", str(job_id)])
    raise AssertionError(f"SLURM job {job_id} still listed after {timeout} s")


def test_srun_two_tasks_train_together_as_one_process_would(tmp_path, plain_keras_weights):
    started = time.time()
    result = subprocess.run(
        ["srun", "-n2", "--cpus-per-task=1", "--time=10", ga_train_path(), *TWO_TASKS,
         "hydra.run.dir=runs/shared"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env=quiet_environment(),
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    record(time.time() - started, "test_srun_two_tasks: seconds of the srun job")
    run_dir = str(tmp_path / "runs" / "shared")
    printed = [line.split(": ", 1)[1] for line in output.splitlines() if "run directory: " in line]
    assert printed == [run_dir] * 4, output[-3000:]  # first and last, by each task
    prints = re.findall(r"weights sha256\s*│\s*([0-9a-f]{16})", output)
    assert len(prints) == 2 and prints[0] == prints[1], output[-3000:]
    assert json.load(open(os.path.join(run_dir, "result.json")))["weights_sha256"] == prints[0]
    assert os.listdir(os.path.join(run_dir, ".hydra")) != []  # the chief's record, once
    measured = record(
        weights_difference(final_weights(run_dir), plain_keras_weights),
        "test_srun_two_tasks (2 SLURM tasks vs plain Keras big batch)",
    )
    assert measured <= 1e-6
    one_process = one_process_run(tmp_path)
    for key in ("loss", "val_loss"):
        difference = abs(
            json.load(open(os.path.join(run_dir, "result.json")))[key]
            - json.load(open(os.path.join(one_process, "result.json")))[key]
        )
        assert record(difference, f"test_srun_two_tasks final {key} vs one process") <= 1e-4


def test_guide_sbatch_script_requeued_goes_on_to_the_uninterrupted_weights(
    tmp_path, plain_keras_weights
):
    script = tmp_path / "train.sbatch"
    script.write_text(guide_sbatch_script())
    started = time.time()
    submitted = subprocess.run(
        ["sbatch", "--parsable", str(script), *WORKER_JOB, "checkpoint_every_updates=2"],
        cwd=tmp_path, capture_output=True, text=True, check=True, env=quiet_environment(),
    )  # fmt: skip
    job_id = submitted.stdout.strip().split(";")[0]
    run_dir = tmp_path / "runs" / job_id
    deadline = time.time() + 300
    while not glob.glob(str(run_dir / "checkpoints" / "ckpt-*.index")):
        assert time.time() < deadline, (tmp_path / f"slurm-{job_id}.out").read_text()
        time.sleep(0.2)
    subprocess.run(["scontrol", "requeue", job_id], check=True)
    wait_for_job_to_restart_and_end(job_id)
    log = (tmp_path / f"slurm-{job_id}.out").read_text()
    record(time.time() - started, "test_requeue: seconds from sbatch to the end (one requeue)")
    assert "DUE TO JOB REQUEUE" in log, log[-3000:]
    assert log.count(f"SLURM restart 1 of job {job_id}: going on from the checkpoints") == 2
    assert (run_dir / "result.json").exists(), log[-3000:]
    assert "Traceback" not in log
    measured = record(
        weights_difference(final_weights(str(run_dir)), plain_keras_weights),
        "test_requeue (2 SLURM tasks, requeued once, vs plain Keras big batch)",
    )
    assert measured <= 1e-6
    # A requeue after the run finished leaves it as it is.
    again = subprocess.run(
        [ga_train_path(), *WORKER_JOB, "strategy=multi_worker", "strategy.cluster=slurm",
         f"hydra.run.dir=runs/{job_id}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env=quiet_environment(SLURM_RESTART_COUNT="2", SLURM_JOB_ID=job_id, SLURM_PROCID="0"),
    )  # fmt: skip
    assert again.returncode == 0 and "finished before the restart" in again.stderr, again.stderr


def test_submitit_sweep_one_slurm_job_per_setting_and_ga_report_reads_it(tmp_path):
    started = time.time()
    code, output = ga_train(
        "-m", "hydra/launcher=submitit_slurm", "hydra.launcher.timeout_min=10",
        "hydra.launcher.cpus_per_task=1", "hydra.sweep.dir=sweep", "epochs=1", "progress=none",
        "accum_steps=1,2", cwd=tmp_path, timeout=900,
    )  # fmt: skip
    assert code == 0, output[-4000:]
    record(time.time() - started, "test_submitit_sweep: seconds for 2 SLURM jobs")
    jobs = sorted(glob.glob(str(tmp_path / "sweep" / "*_accum_steps=*")))
    assert [os.path.basename(job)[:15] for job in jobs] == ["0_accum_steps=1", "1_accum_steps=2"]
    results = [json.load(open(os.path.join(job, "result.json"))) for job in jobs]
    assert [result["accum_steps"] for result in results] == [1, 2]
    submitted = glob.glob(str(tmp_path / "sweep" / ".submitit" / "*" / "*_submitted.pkl"))
    # One SLURM job per setting: submitit submits them as the elements of one job array.
    assert len({os.path.basename(os.path.dirname(path)) for path in submitted}) == 2, submitted
    code, report = ga_report("sweep", "--out", "report", cwd=tmp_path)
    assert code == 0, report
    assert "ga-report: 2 runs" in report
    runs = json.load(open(tmp_path / "report" / "report.json"))["runs"]
    assert [(run["status"], run["accum_steps"]) for run in runs] == [
        ("finished", 1),
        ("finished", 2),
    ]


def test_submitit_two_tasks_per_node_make_one_two_worker_job(tmp_path, plain_keras_weights):
    started = time.time()
    code, output = ga_train(
        "-m", "hydra/launcher=submitit_slurm", "hydra.launcher.tasks_per_node=2",
        "hydra.launcher.cpus_per_task=1", "hydra.launcher.timeout_min=10",
        "hydra.sweep.dir=sweep", *TWO_TASKS, cwd=tmp_path, timeout=900,
    )  # fmt: skip
    assert code == 0, output[-4000:]
    record(time.time() - started, "test_submitit_two_tasks: seconds for the 2-task job")
    (run_dir,) = glob.glob(str(tmp_path / "sweep" / "0_*"))
    result = json.load(open(os.path.join(run_dir, "result.json")))
    assert result["effective_batch_size"] == 128 and result["micro_batch_size"] == 16
    logs = glob.glob(str(tmp_path / "sweep" / ".submitit" / "*" / "*_1_log.out"))
    assert (
        logs
        and "Using MirroredStrategy"
        in open(logs[0]).read() + open(logs[0].replace(".out", ".err")).read()
    ), "task 1 took part"
    measured = record(
        weights_difference(final_weights(run_dir), plain_keras_weights),
        "test_submitit_two_tasks (vs plain Keras big batch)",
    )
    assert measured <= 1e-6


def test_submitit_preempted_job_is_requeued_and_goes_on_to_the_uninterrupted_weights(
    tmp_path, plain_keras_weights
):
    """Preemption as submitit meets it: SIGUSR2 to the job; submitit requeues it and runs the
    job again in its directory, where ga-train goes on from the last checkpoint."""
    job = [a for a in WORKER_JOB if not a.startswith("micro_batch_size")]
    sweep = subprocess.Popen(
        [ga_train_path(), "-m", "hydra/launcher=submitit_slurm", "hydra.launcher.timeout_min=20",
         "hydra.launcher.cpus_per_task=1", "hydra.sweep.dir=sweep", *job, "micro_batch_size=32",
         "checkpoint_every_updates=2"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=quiet_environment(),
    )  # fmt: skip
    deadline = time.time() + 300
    while not glob.glob(str(tmp_path / "sweep" / "0_*" / "checkpoints" / "ckpt-*.index")):
        assert sweep.poll() is None and time.time() < deadline, sweep.communicate()[0][-3000:]
        time.sleep(0.2)
    (job_id,) = [
        os.path.basename(p) for p in glob.glob(str(tmp_path / "sweep" / ".submitit" / "*"))
    ]
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    output = sweep.communicate(timeout=600)[0]
    assert sweep.returncode == 0, output[-3000:]
    (run_dir,) = glob.glob(str(tmp_path / "sweep" / "0_*"))
    log = "".join(
        open(p).read() for p in glob.glob(str(tmp_path / "sweep" / ".submitit" / "*" / "*_log.*"))
    )
    assert "this job is preempted" in log and "ga-train: SLURM restart 1: going on from" in log, log
    measured = record(
        weights_difference(final_weights(run_dir), plain_keras_weights),
        "test_submitit_preempted (requeued by submitit once, vs plain Keras big batch)",
    )
    assert measured <= 1e-6


# -- helpers ------------------------------------------------------------------------------------
def ga_train_path():
    return os.path.join(os.path.dirname(os.sys.executable), "ga-train")


def quiet_environment(**extra):
    environment = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return dict(environment, TF_CPP_MIN_LOG_LEVEL="3", **extra)


def one_process_run(tmp_path):
    """WORKER_JOB on one process with the same global micro-batches (32, k=4)."""
    job = [a for a in WORKER_JOB if not a.startswith("micro_batch_size")]
    code, output = ga_train(*job, "micro_batch_size=32", "hydra.run.dir=one", cwd=tmp_path)
    assert code == 0, output[-3000:]
    return str(tmp_path / "one")


def guide_sbatch_script():
    """The sbatch script of the SLURM guide (docs/guides/distributed.md), as it stands there."""
    text = open(SLURM_GUIDE).read()
    blocks = re.findall(r"```bash\n(#!/bin/bash\n#SBATCH.*?)```", text, re.S)
    assert len(blocks) == 1, "the SLURM guide shows one sbatch script"
    return blocks[0]


def wait_for_job_to_restart_and_end(job_id, timeout=600):
    """A requeued job waits (BeginTime, about two minutes here), runs again and ends."""
    wait_for_job(job_id, timeout)
