"""ga-train distributed (D1, D3): MirroredStrategy with 1 and 2 replicas, and
MultiWorkerMirroredStrategy with two worker processes on 127.0.0.1 (TF_CONFIG), end with the
weights of a plain Keras big-batch run on one device; the two workers end identical and only the
chief writes. D2: with k=8 the workers exchange at most a quarter of the bytes they exchange with
k=1."""

import json
import os
import re
import subprocess
import sys

import pytest

from helpers import (
    ROOT,
    TESTS,
    compose_config,
    final_weights,
    free_ports,
    ga_train_big_batch_reference,
    record,
    run_difference,
    run_dir_of,
    weights_difference,
)

BYTES_SCRIPT = os.path.join(ROOT, "benchmarks", "allreduce_bytes.py")

# Global micro-batches of 32 (16 per worker), k=4: windows of 128; the digits' training split
# (1438 samples) ends each epoch with a short window of 30 samples.
WORKER_JOB = (
    "optimizer=momentum",
    "optimizer.learning_rate=0.05",
    "epochs=2",
    "progress=plain",
    "micro_batch_size=16",
    "accum_steps=4",
)
WINDOW = 32 * 4
BIG_BATCH_JOB = (
    "optimizer=momentum",
    "optimizer.learning_rate=0.05",
    "epochs=2",
    "progress=plain",
    "micro_batch_size=128",
    "accum_steps=1",
)


def tf_config(ports, index):
    return json.dumps(
        {
            "cluster": {"worker": [f"127.0.0.1:{port}" for port in ports]},
            "task": {"type": "worker", "index": index},
        }
    )


def ga_train_command():
    return [os.path.join(os.path.dirname(sys.executable), "ga-train")]


def run_workers(command, cwd, count=2, timeout=600):
    """Start ``count`` workers of one cluster; [(exit code, output)] in worker order."""
    ports = free_ports(count)
    environment = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    processes = [
        subprocess.Popen(
            command(index),
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=dict(environment, TF_CPP_MIN_LOG_LEVEL="3", TF_CONFIG=tf_config(ports, index)),
        )
        for index in range(count)
    ]
    return [(process.wait(timeout=timeout), process.communicate()[0]) for process in processes]


def fingerprint(output):
    return re.search(r"weights sha256\s*│\s*([0-9a-f]{16})", output).group(1)


@pytest.fixture(scope="module")
def plain_keras_weights():
    """WORKER_JOB trained by plain Keras on one device, one ``train_on_batch`` per window of
    WINDOW samples; its final weights."""
    cfg = compose_config(*WORKER_JOB)
    assert cfg.dataset.shuffle and cfg.partial_window.value == "apply"
    return ga_train_big_batch_reference(cfg, WINDOW)


@pytest.fixture(scope="module")
def big_batch_run(tmp_path_factory):
    """BIG_BATCH_JOB's run directory: ga-train's training, in this process (a reference that the
    console script would only start more slowly; the tests below run ga-train as users do)."""
    from gacli.runner.training.run import train

    run_dir = str(tmp_path_factory.mktemp("big_batch") / "run")
    train(compose_config(*BIG_BATCH_JOB), run_dir)
    return run_dir


@pytest.mark.slow
@pytest.mark.distributed
def test_ga_train_one_device_big_batch_matches_plain_keras(big_batch_run, plain_keras_weights):
    """ga-train with accum_steps=1 and micro-batches of WINDOW, the run the distributed runs
    were first compared with, is plain Keras' run too."""
    measured = record(
        weights_difference(final_weights(big_batch_run), plain_keras_weights),
        "test_ga_train_big_batch (k=1, 1 device) vs plain Keras",
    )
    assert measured <= 1e-6


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("replicas, steps_per_execution", [(1, None), (2, None), (1, 7), (2, 1)])
def test_ga_train_mirrored_matches_big_batch(
    tmp_path, plain_keras_weights, big_batch_run, replicas, steps_per_execution
):
    # Per replica micro-batches of 32 / replicas: global micro-batches of 32 either way. An epoch
    # is 45 micro-batches: the default steps_per_execution (accum_steps=4) and 7 do not divide
    # it, so each epoch is a fit() of its own; 7 also splits windows between calls.
    job = [a for a in WORKER_JOB if not a.startswith("micro_batch_size")]
    if steps_per_execution:
        job.append(f"steps_per_execution={steps_per_execution}")
    result = subprocess.run(
        ga_train_command()
        + [
            *job,
            f"micro_batch_size={32 // replicas}",
            "strategy=mirrored",
            f"strategy.logical_cpus={replicas}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"({replicas} replica" in result.stdout
    run_dir = run_dir_of(result.stdout)
    label = (
        f"test_ga_train_mirrored[{replicas} replicas, "
        f"steps_per_execution={steps_per_execution or 4}"
    )
    measured = record(
        weights_difference(final_weights(run_dir), plain_keras_weights),
        f"{label} vs plain Keras big batch]",
    )
    assert measured <= 1e-6
    assert record(run_difference(run_dir, big_batch_run), f"{label} vs ga-train k=1]") <= 1e-6


@pytest.mark.slow
@pytest.mark.distributed
def test_ga_train_multi_worker_matches_big_batch_and_only_the_chief_writes(
    tmp_path, plain_keras_weights, big_batch_run
):
    results = run_workers(
        lambda index: (
            ga_train_command()
            + [*WORKER_JOB, "strategy=multi_worker", f"hydra.run.dir={tmp_path / f'worker{index}'}"]
        ),
        cwd=tmp_path,
    )
    for code, output in results:
        assert code == 0, output[-4000:]
    chief_dir, other_dir = (run_dir_of(output) for _, output in results)
    assert fingerprint(results[0][1]) == fingerprint(results[1][1])
    for name in ("tensorboard", "checkpoints", "model.keras", "result.json", "resolved.yaml"):
        assert os.path.exists(os.path.join(chief_dir, name)), name
        assert not os.path.exists(os.path.join(other_dir, name)), name
    measured = record(
        weights_difference(final_weights(chief_dir), plain_keras_weights),
        "test_ga_train_multi_worker (2 workers vs plain Keras big batch)",
    )
    assert measured <= 1e-6
    # The metrics of all the data, not of the chief's shard of it (the chief's val_accuracy was
    # 0.8722 where the whole validation set gives 0.8774).
    chief_result, one_process = (
        json.load(open(os.path.join(run, "result.json"))) for run in (chief_dir, big_batch_run)
    )
    for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
        assert chief_result[key] == pytest.approx(one_process[key], rel=1e-4), key
    assert (
        record(
            run_difference(chief_dir, big_batch_run),
            "test_ga_train_multi_worker (2 workers vs ga-train k=1)",
        )
        <= 1e-6
    )


@pytest.mark.slow
@pytest.mark.distributed
def test_d2_one_all_reduce_per_window_in_bytes(tmp_path):
    """Bytes on the loopback interface for the same micro-batches, k=1 vs k=8 (2 workers)."""
    result = subprocess.run(
        [sys.executable, BYTES_SCRIPT, "--quick", "--json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    ratio = record(
        measured["gacli"]["8"]["bytes"] / measured["gacli"]["1"]["bytes"],
        "test_d2 bytes ratio k=8 / k=1",
    )
    assert ratio <= 0.25, measured


@pytest.mark.slow
@pytest.mark.distributed
def test_library_multi_worker_fit_and_custom_loop_match_big_batch(tmp_path):
    """D1/D3 for the library under MultiWorkerMirroredStrategy: the model wrapper in fit() and
    the optimizer wrapper in a custom loop, ragged data, two worker processes."""
    script = os.path.join(TESTS, "multiworker_cases.py")
    results = run_workers(lambda index: [sys.executable, script], cwd=tmp_path)
    measured = []
    for code, output in results:
        assert code == 0, output[-4000:]
        line = next(line for line in output.splitlines() if line.startswith("RESULTS "))
        measured.append(json.loads(line[len("RESULTS ") :]))
    chief, other = measured
    for case in ("fit-model-wrapper", "custom-loop"):
        assert chief[f"{case}-digest"] == other[f"{case}-digest"], case
        assert record(chief[case], f"test_library_multi_worker[{case}]") <= 1e-6, case
