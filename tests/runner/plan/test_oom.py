"""oom=recover: an out-of-memory error in the middle of a window puts the window back to its
start, halves the micro-batch and goes on; the run ends with the weights of plain Keras' big
batch, as an uninterrupted run does. oom=fail (the default) stops with what to type instead.
The error is real (tf.errors.ResourceExhaustedError from a failed allocation inside the compiled
step), injected with GACLI_FAKE_OOM_ABOVE / GACLI_FAKE_OOM_FROM_MICRO_STEP
(gacli/runner/training/fault_injection.py)."""

import json
import os

import keras
import numpy as np
import pytest

from gacli.runner.builders.data import load_dataset
from gacli.runner.plan.batch import BatchPlan
from gacli.runner.plan.out_of_memory import (
    WindowStart,
    position_in,
    smaller_micro_batch,
    smaller_plan,
)
from gacli.runner.reporting.throughput import ChangedLayout, MicroBatchLayout
from gacli.runner.training.run import train
from helpers import (
    compose_config,
    event_tags,
    final_weights,
    ga_report,
    ga_train,
    ga_train_big_batch_reference,
    record,
    run_dir_of,
    scalars,
    weights_difference,
)

# The digits MLP, momentum SGD, windows of 128 samples (micro-batches of 16 x 8), two epochs.
JOB = (
    "optimizer=momentum",
    "optimizer.learning_rate=0.05",
    "epochs=2",
    "micro_batch_size=16",
    "accum_steps=8",
)
WINDOW = 128


@pytest.fixture(scope="module")
def plain_keras():
    return ga_train_big_batch_reference(compose_config(*JOB), WINDOW)


def test_the_micro_batch_halves_to_a_divisor_and_the_position_follows_the_samples():
    assert [smaller_micro_batch(n) for n in (16, 6, 9, 5, 1)] == [8, 3, 3, 1, None]
    assert smaller_plan(BatchPlan(6, 4, 2)) == BatchPlan(3, 8, 2)
    assert smaller_plan(BatchPlan(1, 4, 1)) is None
    assert position_in((1, 24), BatchPlan(16, 8, 1), BatchPlan(8, 16, 1)) == (1, 48)
    # 10 samples a pass in micro-batches of 4 (4, 4, 2), then of 2 from micro-batch 4 on, which
    # starts 4 samples into the second pass.
    layout = ChangedLayout(MicroBatchLayout(10, 4), 4, 2)
    assert [layout.samples_in(i, i + 1) for i in range(2, 9)] == [2, 4, 2, 2, 2, 2, 2]
    assert layout.samples_before(4) == 14 and layout.samples_before(7) == 20


def test_the_call_that_compiles_again_after_a_recovery_is_not_timed():
    import tensorflow as tf

    from gacli.runner.reporting.throughput import TrainingClock

    class Counter:
        micro_step = tf.Variable(0, dtype="int64")

    clock = TrainingClock(Counter, train_size=10, global_micro_batch_size=4)
    for end in (1, 2, 4):  # the first call, then two counted ones (the pass's 2-sample batch)
        clock.on_train_batch_begin(0)
        Counter.micro_step.assign(end)
        clock.on_train_batch_end(0)
    counted = clock.seconds
    clock.replan(BatchPlan(2, 2, 1), 1)  # from micro-batch 4 on, micro-batches of 2
    for end in (6, 8):  # the compiling call, then one counted
        clock.on_train_batch_begin(0)
        Counter.micro_step.assign(end)
        clock.on_train_batch_end(0)
    samples, seconds = clock.reading(8)
    # Counted: micro-batches 1..3 (4, 2 and 4 samples) and 6..7 (2 and 2); 0 traced, 4..5 compiled.
    assert samples == 14 and seconds > counted


def test_rewind_puts_back_batch_norm_statistics_counters_and_accumulators():
    import gacli

    inputs = keras.Input((4,))
    hidden = keras.layers.BatchNormalization()(keras.layers.Dense(8)(inputs))
    model = gacli.GradientAccumulateModel(
        accum_steps=4, inputs=inputs, outputs=keras.layers.Dense(1)(hidden)
    )
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    x, y = np.random.default_rng(0).normal(size=(2, 32, 4)).astype("float32")[:, :, :4]
    model.fit(x[:16], y[:16, :1], batch_size=4, verbose=0)  # one window, applied
    accumulator = model.optimizer
    start = WindowStart(accumulator, lambda: (0, 4))
    start.set_model(model)
    start.on_train_batch_begin(0)
    before = [v.numpy() for v in model.variables]
    counters = [variable.numpy() for variable in accumulator.shared_state]
    model.train_on_batch(x[16:20], y[16:20, :1])  # half a window: statistics and sums move
    assert int(accumulator.window_micro_steps.numpy()) == 1
    assert any(np.any(a.numpy()) for a in accumulator._window.accumulators)
    assert start.rewind() == (0, 4)
    assert int(accumulator.window_micro_steps.numpy()) == 0
    assert not any(np.any(a.numpy()) for a in accumulator._window.accumulators)
    for saved, variable in zip(counters, accumulator.shared_state):
        np.testing.assert_array_equal(saved, variable.numpy())
    for saved, variable in zip(before, model.variables):
        np.testing.assert_array_equal(saved, variable.numpy())


def test_recovery_mid_window_ends_with_the_big_batch_weights(tmp_path, monkeypatch, plain_keras):
    # A call per micro-batch: the error comes at micro-step 20, in the middle of the third window.
    monkeypatch.setenv("GACLI_FAKE_OOM_ABOVE", "8")
    monkeypatch.setenv("GACLI_FAKE_OOM_FROM_MICRO_STEP", "20")
    run_dir = str(tmp_path / "run")
    train(compose_config(*JOB, "steps_per_execution=1", "oom=recover"), run_dir)
    result = json.load(open(os.path.join(run_dir, "result.json")))
    # Two windows of 16 x 8, then 8 x 16: 1438 samples an epoch in 16 + 148 micro-batches, then
    # 180; 12 windows an epoch as before.
    assert (result["micro_batch_size"], result["accum_steps"]) == (8, 16)
    assert (result["optimizer_step"], result["micro_step"]) == (24, 16 + 148 + 180)
    plan = json.load(open(os.path.join(run_dir, "batch_plan.json")))
    assert (plan["micro_batch_size"], plan["oom_recoveries"]) == (8, 1)
    _, events = event_tags(run_dir)
    recoveries = scalars(events, "batch/oom_recoveries")
    assert recoveries[0] == 0 and recoveries[-1] == 1
    measured = record(
        weights_difference(final_weights(run_dir), plain_keras),
        "test_recovery_mid_window vs plain Keras big batch",
    )
    assert measured <= 1e-6


@pytest.mark.slow  # about 25 s: out of the in-process lane
def test_after_two_recoveries_the_metrics_describe_the_saved_model(tmp_path, monkeypatch):
    # One call per window (steps_per_execution follows accum_steps: 8, 16, then 32 micro-batches
    # a call): the micro-batch halves twice, 16 -> 8 -> 4, in the middle of the first epoch.
    # Keras kept its evaluate function traced for 8 steps a call, so validation saw only some of
    # its batches; the epoch's training metrics covered only the micro-batches after the last
    # recovery; a second halving failed on the clock's layout.
    cfg = compose_config(*JOB, "epochs=1", "oom=recover")
    plain_dir, recovered_dir = str(tmp_path / "plain"), str(tmp_path / "recovered")
    train(cfg, plain_dir)
    monkeypatch.setenv("GACLI_FAKE_OOM_ABOVE", "4")
    monkeypatch.setenv("GACLI_FAKE_OOM_FROM_MICRO_STEP", "20")
    train(cfg, recovered_dir)
    plain, recovered = (
        json.load(open(os.path.join(run, "result.json"))) for run in (plain_dir, recovered_dir)
    )
    assert (recovered["micro_batch_size"], recovered["accum_steps"]) == (4, 32)
    assert json.load(open(os.path.join(recovered_dir, "batch_plan.json")))["oom_recoveries"] == 2
    for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
        assert recovered[key] == pytest.approx(plain[key], rel=1e-5), key
    data = load_dataset(cfg.dataset, cfg.seed)
    saved = keras.saving.load_model(os.path.join(recovered_dir, "model.keras"))
    evaluated = saved.evaluate(data.validation.batch(64), verbose=0, return_dict=True)
    assert evaluated["loss"] == pytest.approx(recovered["val_loss"], rel=1e-5)
    assert evaluated["accuracy"] == pytest.approx(recovered["val_accuracy"], rel=1e-6)


@pytest.mark.slow
def test_under_xla_the_run_stops_and_resumes_with_the_smaller_micro_batch(tmp_path, plain_keras):
    """XLA leaves the variables unusable after a failed allocation: the run stops (exit 1, no
    abort) and resume=true goes on from the last checkpoint (update 2, saved in micro-batches of
    16) in micro-batches of 8."""
    arguments = (*JOB, "jit_compile=true", "oom=recover", "checkpoint_every_updates=2")
    fault = {"GACLI_FAKE_OOM_ABOVE": "8", "GACLI_FAKE_OOM_FROM_MICRO_STEP": "20"}
    code, output = ga_train(*arguments, cwd=tmp_path, env=fault)
    assert code == 1, output
    assert "Traceback" not in output and "resume=true" in output
    run_dir = output.split("run directory: ", 1)[1].split("\n", 1)[0]  # printed first only
    code, output = ga_train(*arguments, f"resume={run_dir}", cwd=tmp_path, env=fault)
    assert code == 0, output
    assert "micro-batch      8, as before (oom=recover)" in output
    assert "from epoch 1, micro-batch 16 of it (update 2" in output
    result = json.load(open(os.path.join(run_dir, "result.json")))
    assert (result["micro_batch_size"], result["accum_steps"], result["optimizer_step"]) == (
        8,
        16,
        24,
    )
    measured = record(
        weights_difference(final_weights(run_dir), plain_keras),
        "test_under_xla_the_run_stops_and_resumes vs plain Keras big batch",
    )
    assert measured <= 1e-6
    # ga-report counts the samples of the whole run, across the stop and the change of size:
    # two passes over the 1438 training samples.
    code, output = ga_report(run_dir, "--no-plots", "--out", str(tmp_path / "report"), cwd=tmp_path)
    assert code == 0, output
    (row,) = json.load(open(tmp_path / "report" / "report.json"))["runs"]
    assert row["samples_seen"] == 2 * 1438, row


@pytest.mark.slow
def test_without_recover_the_error_says_what_to_type(tmp_path):
    code, output = ga_train(*JOB, "epochs=1", cwd=tmp_path, env={"GACLI_FAKE_OOM_ABOVE": "8"})
    assert code == 1, output
    assert "Traceback" not in output
    message = [line for line in output.splitlines() if line.startswith("ga-train: ")][-1]
    assert message.startswith("ga-train: Out of device memory at micro_batch_size=16 (OOM when")
    assert "micro_batch_size=8 accum_steps=16" in message and "oom=recover" in message


@pytest.mark.slow
def test_when_nothing_fits_the_error_says_so_without_a_traceback(tmp_path):
    # Every micro-batch fails: recover halves 2 -> 1, then says that halving cannot help.
    code, output = ga_train(
        *JOB, "micro_batch_size=2", "accum_steps=64", "epochs=1", "oom=recover", cwd=tmp_path,
        env={"GACLI_FAKE_OOM_ABOVE": "0"},
    )  # fmt: skip
    assert code == 1 and "Traceback" not in output, output
    message = [line for line in output.splitlines() if line.startswith("ga-train: ")][-1]
    assert message.startswith("ga-train: Out of device memory at micro_batch_size=1 (OOM when")
    assert "not even one sample per micro-batch fits" in message, message


@pytest.mark.slow
def test_bad_settings_are_refused_before_training(tmp_path):
    code, output = ga_train(*JOB, cwd=tmp_path, env={"GACLI_FAKE_OOM_ABOVE": "many"})
    assert code == 2 and "GACLI_FAKE_OOM_ABOVE='many' must be a whole number" in output, output
    code, output = ga_train(*JOB, "oom=recover", "partial_window=carry", cwd=tmp_path)
    assert code == 2 and "use partial_window=apply (or drop) with oom=recover" in output, output
    code, output = ga_train(*JOB, "oom=recover", "strategy=multi_worker", cwd=tmp_path)
    assert code == 2 and "work on one machine only" in output, output


@pytest.mark.slow
@pytest.mark.distributed
def test_recovery_under_two_replicas(tmp_path, plain_keras):
    code, output = ga_train(
        *JOB,
        "micro_batch_size=8",
        "strategy=mirrored",
        "strategy.logical_cpus=2",
        "oom=recover",
        cwd=tmp_path,
        env={"GACLI_FAKE_OOM_ABOVE": "4", "GACLI_FAKE_OOM_FROM_MICRO_STEP": "16"},
    )
    assert code == 0, output
    assert "the window starts again with micro_batch_size=4 x accum_steps=16" in output
    run_dir = run_dir_of(output)
    measured = record(
        weights_difference(final_weights(run_dir), plain_keras),
        "test_recovery_under_two_replicas vs plain Keras big batch",
    )
    assert measured <= 1e-6
