"""The effective batch over training (accum_schedule): each stage's updates against plain Keras'
big batch of that size, the counters against arithmetic, a resume in the middle of a schedule
against the uninterrupted run, growth with the noise scale against the noise scale computed from
every example's gradient, and bad input."""

import glob
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from gacli.runner.plan.accum_schedule import grown_accum_steps, power_of_two_nearest, stage_records
from helpers import (
    compose_config,
    event_tags,
    final_weights,
    ga_train,
    ga_train_big_batch_reference,
    noise_scale_data,
    noise_scale_direct,
    record,
    run_difference,
    run_dir_of,
    scalars,
    start_ga_train,
    weights_difference,
)

SCHEDULE = "accum_schedule={0:1,1:2,2:4}"
# Momentum SGD at a constant rate: plain Keras' big batch is the reference. The default job's
# digits: 1438 training samples, 45 micro-batches of 32 an epoch (the last holds 30). A rate
# scaled up to 0.05 (x4): at 0.2 this model's training amplifies the round-off of two replicas'
# summation order to 2.3e-03 in the weights (the same run at 0.05: 8.9e-08).
JOB = ("optimizer=momentum", "optimizer.learning_rate=0.0125", "epochs=3", "micro_batch_size=32")
MICRO_BATCHES = 45


def _run(tmp_path, *overrides):
    from gacli.runner.training.run import train

    run_dir = str(tmp_path / "run")
    train(compose_config(*overrides), run_dir=run_dir)
    return run_dir, json.load(open(os.path.join(run_dir, "result.json")))


# -- bad input --------------------------------------------------------------------------------
CHECK = """
import sys
from gacli.runner.command.cli import main
try:
    print("exit code:", main(sys.argv[1:]))  # refused before Hydra starts: returns the code
except SystemExit as stop:
    print("exit code:", stop.code)
print("tensorflow imported:", "tensorflow" in sys.modules)
"""

BAD = [
    (("accum_schedule={a:1}",), "accum_schedule: the key 'a' is not an epoch"),
    (("accum_schedule={-1:2}",), "accum_schedule: the key -1 is not an epoch"),
    (("accum_schedule={0.5:2}",), "accum_schedule: the key 0.5 is not an epoch"),
    (("accum_schedule={0:0}",), "accum_schedule: epoch 0 maps to accum_steps=0"),
    (("accum_steps=0",), "accum_steps=0 must be a whole number >= 1"),
    (("accum_schedule=gns",), "accum_schedule=gns grows accum_steps with the measured"),
    (("accum_schedule=gns", "monitor.gns=true", "accum_steps=1"), "accum_schedule=gns starts"),
    (("accum_schedule={0:1,10:2}",), "accum_schedule: epoch 10 is past the run's last epoch"),
    (("lr_scaling=linear",), "lr_scaling=linear scales the learning rate with the effective"),
    (
        (SCHEDULE, "lr_scaling=sqrt", "optimizer.lr_scaling=linear"),
        "optimizer.lr_scaling=linear: optimizer.lr_scaling is no longer read",
    ),
    ((SCHEDULE, "partial_window=carry"), "accum_schedule changes accum_steps at epoch starts"),
]


@pytest.mark.parametrize("arguments, first_line", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_schedules_are_one_paragraph_and_exit_2_before_tensorflow(
    tmp_path, arguments, first_line
):
    result = subprocess.run(
        [sys.executable, "-c", CHECK, *arguments],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = result.stdout + result.stderr
    assert "exit code: 2" in output and "tensorflow imported: False" in output, output
    assert "Traceback" not in output, output
    (line,) = [line for line in output.splitlines() if line.startswith("ga-train:")]
    assert line.startswith(f"ga-train: {first_line}"), output


# -- stages against the big batch of their size ----------------------------------------------
def _warmup_then_cosine(updates, peak=0.0125, warmup=10, decay=70):
    """The configured rate after ``updates`` updates: linear warm-up over 10, then a cosine
    decay over the remaining 70 of the run's 80 (gacli.engine.schedules.LinearWarmup)."""
    updates = np.asarray(updates, "float64")
    return np.where(
        updates < warmup,
        peak * (updates + 1) / warmup,
        peak * 0.5 * (1 + np.cos(np.pi * np.minimum(updates - warmup, decay) / decay)),
    )


@pytest.mark.parametrize("wrapper", ["model", "optimizer"])
def test_each_stage_updates_as_the_big_batch_of_its_size(tmp_path, wrapper):
    """Stages of 32, 64 and 128 samples, a warm-up and cosine decay counted in updates across
    them, times each stage's linear factor (1, 2, 4): plain Keras' train_on_batch on windows of
    those sizes at those rates. The optimizer wrapper weighs every micro-batch the same, so its
    training set is cut to 1440 = 45 x 32 samples."""
    data = ("dataset.validation_split=0.1986",) if wrapper == "optimizer" else ()
    schedule = ("optimizer.schedule=cosine", "optimizer.warmup_updates=10")
    overrides = (*JOB, *data, SCHEDULE, "lr_scaling=linear", *schedule, f"wrapper={wrapper}")
    run_dir, result = _run(tmp_path, *overrides)
    cfg = compose_config(*(o for o in overrides if o not in schedule))
    reference = ga_train_big_batch_reference(
        cfg, [32, 64, 128], lambda epoch, updates: _warmup_then_cosine(updates) * 2**epoch
    )
    measured = record(
        weights_difference(final_weights(run_dir), reference),
        f"test_accum_schedule[{wrapper}] stages 32/64/128 vs plain Keras' big batches",
    )
    assert measured <= 1e-6

    # The counters against arithmetic: ceil(45 / k) updates an epoch at k = 1, 2, 4.
    updates = [math.ceil(MICRO_BATCHES / k) for k in (1, 2, 4)]
    train_size = 1440 if wrapper == "optimizer" else 1438
    assert result["optimizer_step"] == sum(updates) == 80
    assert result["micro_step"] == 3 * MICRO_BATCHES
    assert result["samples_seen"] == 3 * train_size
    assert result["accum_schedule"] == [
        {"epoch": epoch, "accum_steps": k, "effective_batch_size": 32 * k, "updates": u}
        for epoch, k, u in zip(range(3), (1, 2, 4), updates)
    ]
    assert (result["accum_steps"], result["effective_batch_size"]) == (4, 128)

    # TensorBoard: each stage a line of its own, one point an update; the samples of each
    # epoch's updates add up to the training set; optimizer/lr at update u is the rate the next
    # update applies, the stage's factor included.
    _, events = event_tags(run_dir, every_point=True)
    stage_of_update = np.repeat([1, 2, 4], updates)
    assert scalars(events, "batch/accum_steps") == list(stage_of_update)
    assert scalars(events, "batch/effective_size") == list(32 * stage_of_update)
    samples = np.array(scalars(events, "batch/update_samples"))
    assert [samples[: updates[0]].sum(), samples[updates[0] : 68].sum(), samples[68:].sum()] == [
        train_size
    ] * 3
    steps = [event.step for event in events.Tensors("optimizer/lr")]
    assert steps == list(range(1, 81))
    np.testing.assert_allclose(
        scalars(events, "optimizer/lr"),
        _warmup_then_cosine(steps) * stage_of_update,
        rtol=1e-5,
        atol=1e-8,
    )


def test_accum_batchnorm_follows_the_stage(tmp_path):
    """batchnorm=accumulate: the moving statistics of a CNN's batch norm are those of plain
    Keras' big batch at each stage's size (its BatchNormalization sees the whole window). The
    forward pass normalises by micro-batch, so the weights are held still (a learning rate of
    1e-12) and the statistics compared: one update of them per window, from the window's samples."""
    overrides = (
        *JOB,
        "optimizer.learning_rate=1e-12",
        "epochs=2",
        "model=cnn",
        "model.filters=[4]",
        "batchnorm=accumulate",
        "accum_schedule={0:2,1:4}",
    )
    run_dir, result = _run(tmp_path, *overrides)
    import keras

    import gacli.engine.accumulate_model  # noqa: F401

    model = keras.saving.load_model(os.path.join(run_dir, "model.keras"))
    layers = [layer for layer in model.layers if "BatchNormalization" in type(layer).__name__]
    assert [layer.accum_steps for layer in layers] == [4]
    reference = ga_train_big_batch_reference(compose_config(*overrides), [64, 128])
    kept = ("kernel", "bias", "gamma", "beta", "moving_mean", "moving_variance")
    names = [v.path for v in model.weights if v.path.split("/")[-1] in kept]
    weights = [v.numpy() for v in model.weights if v.path.split("/")[-1] in kept]
    assert len(weights) == len(reference), names
    measured = record(
        weights_difference(weights, reference),
        "test_accum_schedule AccumBN stages 64/128 vs plain Keras' big batches",
    )
    assert measured <= 1e-5
    assert [s["accum_steps"] for s in result["accum_schedule"]] == [2, 4]


# -- precise batch norm across stages ---------------------------------------------------------
def _precise_statistics(model, x):
    """Precise BN's statistics, computed here: the mean and variance of the batch norm's input
    (the convolution's output, which no micro-batch grouping changes) over every training
    sample, in float64; set on ``model``'s layer."""
    import keras

    (layer,) = [
        layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)
    ]
    inputs = np.asarray(keras.Model(model.input, layer.input)(x), "float64")
    inputs = inputs.reshape(-1, inputs.shape[-1])
    layer.moving_mean.assign(inputs.mean(0).astype("float32"))
    layer.moving_variance.assign(inputs.var(0).astype("float32"))


def _micro_batch_bn_reference(cfg, accum_by_epoch):
    """Plain TensorFlow on ga-train's CNN and data in its order: one momentum SGD update per
    window of ``accum_by_epoch[epoch]`` micro-batches, the gradient of the window's summed loss
    over its samples, each micro-batch normalised by its own statistics (plain batch norm in
    training mode); after each epoch the statistics of _precise_statistics and the val_loss.
    Returns (final weights, val_loss per epoch)."""
    import keras
    import tensorflow as tf

    from gacli.runner.builders.data import load_dataset
    from gacli.runner.builders.model import build_model
    from gacli.runner.training.run_state import pass_order

    data = load_dataset(cfg.dataset, cfg.seed)
    x, y = (np.stack(column) for column in zip(*data.train.as_numpy_iterator()))
    val_x, val_y = (np.stack(column) for column in zip(*data.validation.as_numpy_iterator()))
    keras.utils.set_random_seed(cfg.seed)
    model = build_model(cfg.model, data.input_shape, data.num_outputs, data.task)
    optimizer = keras.optimizers.SGD(cfg.optimizer.learning_rate, momentum=cfg.optimizer.momentum)
    summed = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    micro, val_losses = cfg.micro_batch_size, []
    for epoch, accum in enumerate(accum_by_epoch):
        order = pass_order(data.train_size, epoch, shuffle_seed=cfg.seed, buffer_size=10_000)
        for start in range(0, data.train_size, micro * accum):
            window = order[start : start + micro * accum]
            with tf.GradientTape() as tape:
                parts = [window[i : i + micro] for i in range(0, len(window), micro)]
                total = sum(summed(y[p], model(x[p], training=True)) for p in parts)
                value = total / len(window)
            gradients = tape.gradient(value, model.trainable_variables)
            optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        _precise_statistics(model, x)
        logits = model(val_x, training=False)
        val_losses.append(float(summed(val_y, logits)) / len(val_y))
    return model.get_weights(), val_losses


def test_precise_batchnorm_follows_the_stage(tmp_path):
    """batchnorm=precise with accum_schedule={0:1,1:2}: training normalises each micro-batch by
    its own statistics at every stage, and before each validation and at the end the moving
    statistics are those of the whole training set under the current weights. Against plain
    TensorFlow stage by stage: the final weights and statistics, and each epoch's val_loss."""
    overrides = (
        *JOB,
        "epochs=2",
        "model=cnn",
        "model.filters=[4]",
        "batchnorm=precise",
        "precise_bn_micro_batches=45",  # every training micro-batch
        "accum_schedule={0:1,1:2}",
    )
    run_dir, result = _run(tmp_path, *overrides)
    weights, val_losses = _micro_batch_bn_reference(compose_config(*overrides), [1, 2])
    measured = record(
        weights_difference(final_weights(run_dir), weights),
        "test_accum_schedule precise BN stages 32/64 vs plain TensorFlow",
    )
    assert measured <= 1e-5
    _, events = event_tags(run_dir, every_point=True)
    np.testing.assert_allclose(scalars(events, "val/loss"), val_losses, rtol=1e-5)
    assert [s["accum_steps"] for s in result["accum_schedule"]] == [1, 2]
    assert result["optimizer_step"] == 45 + 23


def test_the_progress_total_is_the_sum_of_the_stages_updates(tmp_path, capsys):
    """Stages of 45, 23 and 12 updates: 80 in all, not 3 x ceil(80 / 3) = 81, on every line."""
    _, result = _run(tmp_path, *JOB, SCHEDULE, "progress=plain")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch ")]
    totals = [line.split("update ", 1)[1].split()[0] for line in lines]
    assert totals == ["45/80", "68/80", "80/80"], lines
    assert result["optimizer_step"] == 80


# -- resume in the middle of a schedule -------------------------------------------------------
RESUMED_JOB = (
    *JOB,
    SCHEDULE,
    "lr_scaling=sqrt",
    "progress=plain",
    "checkpoint_every_updates=5",
    # A call a micro-batch: SIGTERM stops inside a window.
    "steps_per_execution=1",
)


def _interrupt_at_checkpoint(process, run_pattern, number, signal_number):
    """Wait for checkpoint ``number`` of the run, send ``signal_number``; the output."""
    deadline = time.time() + 300
    while not glob.glob(os.path.join(run_pattern, "checkpoints", f"ckpt-{number}.index")):
        assert process.poll() is None and time.time() < deadline, process.communicate()[0]
        time.sleep(0.02)
    process.send_signal(signal_number)
    return process.communicate(timeout=300)[0]


@pytest.mark.slow
def test_resume_in_the_middle_of_a_schedule_equals_the_uninterrupted_run(tmp_path):
    """SIGTERM in the second stage (inside a window of 2), then kill -9 in the third: each resume
    goes on at the stage it stopped in, with its learning rate, to the uninterrupted weights."""
    uninterrupted, _ = _run(tmp_path, *RESUMED_JOB)

    cwd = tmp_path / "b"
    cwd.mkdir()
    runs = str(cwd / "outputs" / "default" / "*")
    # Checkpoints every 5 updates and at epoch ends: ckpt-11 is update 50, in epoch 2 (k=2).
    output = _interrupt_at_checkpoint(
        start_ga_train(*RESUMED_JOB, cwd=cwd), runs, 11, signal.SIGTERM
    )
    assert "stopped by SIGTERM at epoch 2" in output, output
    (run_dir,) = glob.glob(runs)

    # A different schedule is refused, the key named.
    changed = [a if a != SCHEDULE else "accum_schedule={0:1,1:4}" for a in RESUMED_JOB]
    code, output = ga_train(*changed, f"resume={run_dir}", cwd=cwd)
    assert code == 2 and "accum_schedule.1=2 (now 4)" in output, output

    process = start_ga_train(*RESUMED_JOB, f"resume={run_dir}", cwd=cwd)
    # ckpt-17 is update 75, in epoch 3 (k=4).
    _interrupt_at_checkpoint(process, runs, 17, signal.SIGKILL)
    assert process.returncode == -signal.SIGKILL
    code, output = ga_train(*RESUMED_JOB, "resume=true", cwd=cwd)
    assert code == 0, output
    assert "resume: from epoch 3" in output, output
    measured = record(
        run_difference(run_dir, uninterrupted),
        "test_accum_schedule resume (SIGTERM in stage 2, kill -9 in stage 3)",
    )
    assert measured == 0.0
    first, second = (
        json.load(open(os.path.join(folder, "result.json"))) for folder in (run_dir, uninterrupted)
    )
    assert first["accum_schedule"] == second["accum_schedule"]
    assert first["optimizer_step"] == second["optimizer_step"] == 80


# -- two replicas -----------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.distributed
def test_schedule_under_two_replicas_equals_the_big_batch(tmp_path):
    overrides = (*JOB, SCHEDULE, "lr_scaling=linear", "micro_batch_size=16")
    code, output = ga_train(
        *overrides, "strategy=mirrored", "strategy.logical_cpus=2", "progress=none", cwd=tmp_path
    )
    assert code == 0, output
    assert "(2 replicas)" in output
    cfg = compose_config(*(a for a in JOB if not a.startswith("micro")), SCHEDULE)
    rate = cfg.optimizer.learning_rate
    reference = ga_train_big_batch_reference(cfg, [32, 64, 128], [rate, 2 * rate, 4 * rate])
    measured = record(
        weights_difference(final_weights(run_dir_of(output)), reference),
        "test_accum_schedule 2 replicas, stages 32/64/128 vs plain Keras' big batches",
    )
    assert measured <= 1e-6
    result = json.load(open(os.path.join(run_dir_of(output), "result.json")))
    assert [s["effective_batch_size"] for s in result["accum_schedule"]] == [32, 64, 128]


# -- growth with the noise scale --------------------------------------------------------------
def test_the_gns_rule():
    assert [power_of_two_nearest(v) for v in (1, 1.4, 1.5, 2.9, 3, 5.6, 5.7)] == [
        1,
        1,
        2,
        4,
        4,
        4,
        8,
    ]
    # Nearest on a log scale, never lower, at most the largest.
    assert grown_accum_steps(2, 16 * 11.4, 16, 64) == 16
    assert grown_accum_steps(2, 16 * 11.2, 16, 64) == 8
    assert grown_accum_steps(8, 16 * 2, 16, 64) == 8
    assert grown_accum_steps(2, 16 * 1000, 16, 64) == 64
    assert grown_accum_steps(4, 0.0, 16, 64) == 4  # not measured yet: kept
    assert stage_records([2, 2, 8, 8, 0], [0, 10, 20, 23, 0], 26, 16) == [
        {"epoch": 0, "accum_steps": 2, "effective_batch_size": 32, "updates": 20},
        {"epoch": 2, "accum_steps": 8, "effective_batch_size": 128, "updates": 6},
    ]


GNS_LABEL_NOISE = 1.0


@pytest.fixture(scope="module")
def gns_data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gns")
    x, y = noise_scale_data(GNS_LABEL_NOISE)
    np.savez(folder / "data.npz", x=x, y=y)
    return str(folder / "data.npz")


def _gns_job(path):
    return (
        "dataset=npz",
        f"dataset.path={path}",
        "dataset.validation_split=0",
        "dataset.shuffle=false",
        # Softmax regression 16 gradient-descent steps from zero: B_simple ~520 (computed below).
        "model._target_=helpers.gns_softmax_model",
        "model.descent_steps=16",
        "optimizer=sgd",
        # Weights that barely move: the noise scale stays that of the initial weights.
        "optimizer.learning_rate=1e-9",
        "micro_batch_size=16",
        "accum_steps=4",
        "accum_schedule=gns",
        "monitor.gns=true",
        "epochs=2",
        "progress=plain",
    )


def test_gns_growth_follows_the_noise_scale_of_every_example(tmp_path, gns_data, capsys):
    """Softmax regression whose noise scale is computed here from every example's gradient: at
    the second epoch's start accum_steps grows from 4 to the power of two nearest B_simple / 16
    (32 here); a resumed
    run (from the first epoch's checkpoint) decides the same from the checkpointed averages."""
    import keras

    from gacli.runner.builders.data import load_dataset
    from gacli.runner.builders.model import build_model

    cfg = compose_config(*_gns_job(gns_data))
    data = load_dataset(cfg.dataset, cfg.seed)
    keras.utils.set_random_seed(cfg.seed)
    model = build_model(cfg.model, data.input_shape, data.num_outputs, data.task)
    x, y = noise_scale_data(GNS_LABEL_NOISE)
    grad_sq, trace = noise_scale_direct(model, x, y)
    direct = trace / grad_sq
    expected = power_of_two_nearest(direct / 16)
    # Far from a boundary between two powers of two, so the estimate's noise cannot flip it.
    assert abs(math.log2(direct / 16) - round(math.log2(direct / 16))) < 0.3, direct

    run_dir, result = _run(tmp_path, *_gns_job(gns_data))
    printed = capsys.readouterr().out
    (decision,) = [line for line in printed.splitlines() if line.startswith("accum_schedule=gns")]
    assert f"accum_steps 4 -> {expected}" in decision, (decision, direct)
    _, events = event_tags(run_dir)
    (logged,) = scalars(events, "schedule/noise_scale")
    assert scalars(events, "schedule/accum_steps") == [expected]
    # The engine's moving averages weigh the last ~20 windows (decay 0.95) of 4 micro-batches:
    # a noisier estimate than test_noise_scale's average over every window, well inside the
    # rule's bins (a factor of 1.41 either side of a power of two).
    measured = record(abs(logged / direct - 1), "test_accum_schedule gns: B_simple vs direct")
    assert measured < 0.35, (logged, direct)
    assert [s["accum_steps"] for s in result["accum_schedule"]] == [4, expected]
    # The progress total follows the growth: the last line counts the run's updates.
    (last,) = [line for line in printed.splitlines() if line.startswith("epoch 2/2")]
    assert "update {0}/{0} ".format(result["optimizer_step"]) in last, last

    # The run again from its first epoch's checkpoint, as after a kill -9 there.
    resumed = str(tmp_path / "resumed")
    shutil.copytree(run_dir, resumed)
    for name in ("result.json", "model.keras"):
        os.remove(os.path.join(resumed, name))
    checkpoints = os.path.join(resumed, "checkpoints")
    numbers = sorted(int(p.split("-")[-1][:-6]) for p in glob.glob(checkpoints + "/ckpt-*.index"))
    for path in glob.glob(os.path.join(checkpoints, f"ckpt-{numbers[-1]}.*")):
        os.remove(path)
    with open(os.path.join(checkpoints, "checkpoint"), "w") as index:
        index.write(f'model_checkpoint_path: "ckpt-{numbers[0]}"\n')
    from gacli.runner.training.run import train

    train(compose_config(*_gns_job(gns_data), f"resume={resumed}"), run_dir=resumed)
    printed = capsys.readouterr().out.splitlines()
    again = [line for line in printed if line.startswith("accum_schedule=gns")]
    assert again == [decision]
    assert run_difference(resumed, run_dir) == 0.0
