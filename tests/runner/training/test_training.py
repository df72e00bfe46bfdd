"""train(cfg) in-process: data loaders, model registry, schedules in updates, logging details."""

import json
import os

import factories
import keras
import numpy as np
import pytest
import tensorflow as tf

from gacli.runner.config.schema import ConfigError
from gacli.runner.training.run import train
from helpers import compose_config, event_tags, scalars


def run(tmp_path, *overrides):
    run_dir = str(tmp_path / "run")
    metrics = train(compose_config(*overrides), run_dir=run_dir)
    return run_dir, metrics


def test_npz_classification_and_segmentation(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "cls.npz", x=rng.normal(size=(40, 6)), y=rng.integers(0, 3, 40))
    run_dir, metrics = run(
        tmp_path,
        "dataset=npz",
        f"dataset.path={tmp_path / 'cls.npz'}",
        "dataset.validation_split=0.2",
        "epochs=1",
        "micro_batch_size=8",
        "accum_steps=2",
    )
    assert np.isfinite(metrics["loss"])
    result = json.load(open(os.path.join(run_dir, "result.json")))
    assert result["optimizer_step"] == 2  # 32 train samples / (8 x 2)

    np.savez(
        tmp_path / "seg.npz",
        images=rng.normal(size=(24, 8, 8, 1)),
        masks=(rng.random((24, 8, 8, 1)) > 0.5).astype("float32"),
    )
    _, metrics = run(
        tmp_path / "seg",
        "dataset=npz",
        f"dataset.path={tmp_path / 'seg.npz'}",
        "dataset.x_key=images",
        "dataset.y_key=masks",
        "model=unet",
        "model.depth=1",
        "model.base_filters=4",
        "epochs=1",
        "micro_batch_size=4",
        "accum_steps=2",
    )
    assert "iou" in metrics


def _write_images(root, classes=("cat", "dog"), per_class=6, size=12):
    rng = np.random.default_rng(0)
    for name in classes:
        os.makedirs(root / name)
        for index in range(per_class):
            image = tf.constant(rng.integers(0, 255, (size, size, 3)), dtype=tf.uint8)
            tf.io.write_file(str(root / name / f"{index}.png"), tf.io.encode_png(image))


def test_image_folder(tmp_path):
    _write_images(tmp_path / "images")
    _, metrics = run(
        tmp_path,
        "dataset=image_folder",
        f"dataset.path={tmp_path / 'images'}",
        "dataset.image_size=16",
        "model=cnn",
        "epochs=1",
        "micro_batch_size=4",
        "accum_steps=2",
        "dataset.validation_split=0.25",
    )
    assert "val_accuracy" in metrics


def test_tfrecord(tmp_path):
    path = str(tmp_path / "train.tfrecord")
    rng = np.random.default_rng(0)
    with tf.io.TFRecordWriter(path) as writer:
        for _ in range(20):
            feature = {
                "image": tf.train.Feature(
                    float_list=tf.train.FloatList(value=rng.normal(size=16).tolist())
                ),
                "label": tf.train.Feature(
                    int64_list=tf.train.Int64List(value=[int(rng.integers(0, 2))])
                ),
            }
            writer.write(
                tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()
            )
    _, metrics = run(
        tmp_path,
        "dataset=tfrecord",
        f"dataset.path={path}",
        "+dataset.features.image.shape=[4,4,1]",
        "dataset.features.image.shape=[4,4,1]",
        "epochs=1",
        "micro_batch_size=4",
        "accum_steps=2",
    )
    assert np.isfinite(metrics["loss"])


def test_user_factory_and_keras_applications(tmp_path):
    run_dir, metrics = run(
        tmp_path,
        "model._target_=factories.tiny_classifier",
        "epochs=1",
        "steps_per_epoch=2",
    )
    assert np.isfinite(metrics["loss"])
    with pytest.raises(ConfigError, match="keras.applications.MobileNetV2 cannot take inputs"):
        run(tmp_path / "app", "model=application", "model.architecture=MobileNetV2", "epochs=1")
    with pytest.raises(ConfigError, match="cannot be imported"):
        run(tmp_path / "bad", "model._target_=nowhere.at_all.build")


def test_a_factory_may_return_an_unbuilt_subclassed_model(tmp_path):
    """Its shapes are known once it is called: the runner calls it on one sample, checks it
    against the data, and trains it (it used to fail on the model's missing input_shape)."""
    run_dir, metrics = run(
        tmp_path,
        "model._target_=factories.subclassed_classifier",
        "model.width=8",
        "epochs=1",
        "steps_per_epoch=2",
    )
    assert np.isfinite(metrics["loss"])
    assert json.load(open(os.path.join(run_dir, "result.json")))["optimizer_step"] == 2
    # No get_config: the weights are saved instead of the whole model, and load into a new one.
    assert not os.path.exists(os.path.join(run_dir, "model.keras"))
    rebuilt = factories.subclassed_classifier((8, 8, 1), 10, "classification", width=8)
    rebuilt(np.zeros((1, 8, 8, 1)))
    rebuilt.load_weights(os.path.join(run_dir, "model.weights.h5"))
    assert rebuilt.count_params() > 0
    with pytest.raises(ConfigError, match="has 11 outputs but the data has 10 classes"):
        run(tmp_path / "wrong", "model._target_=factories.wrong_outputs")


def test_schedules_count_optimizer_updates_and_are_logged(tmp_path):
    run_dir, _ = run(
        tmp_path,
        "optimizer=sgd",
        "optimizer.learning_rate=0.1",
        "optimizer.schedule=exponential",
        "optimizer.decay_updates=1",
        "optimizer.decay_rate=0.5",
        "epochs=1",
        "steps_per_epoch=3",
        "micro_batch_size=16",
        "accum_steps=4",
    )
    _, events = event_tags(run_dir)
    # Logged after updates 1, 2, 3: the schedule at 1, 2, 3 updates (not 4, 8, 12 micro-steps).
    np.testing.assert_allclose(scalars(events, "optimizer/lr"), [0.05, 0.025, 0.0125], rtol=1e-6)
    assert scalars(events, "optimizer/micro_step") == [4.0, 8.0, 12.0]


def test_warmup_then_cosine_in_updates():
    from gacli.runner.builders.optimizer import learning_rate_schedule
    from gacli.runner.config.schema import OptimizerConfig, Schedule

    schedule = learning_rate_schedule(
        OptimizerConfig(learning_rate=1.0, schedule=Schedule.cosine, warmup_updates=4),
        effective_batch_size=256,
        total_updates=14,
    )
    values = [float(schedule(step)) for step in (0, 3, 4, 9, 14)]
    np.testing.assert_allclose(values, [0.25, 1.0, 1.0, 0.5, 0.0], atol=1e-6)
    config = keras.saving.serialize_keras_object(schedule)
    assert float(keras.saving.deserialize_keras_object(config)(9)) == pytest.approx(0.5)


def test_linear_lr_scaling():
    from gacli.runner.builders.optimizer import scaled_learning_rate
    from gacli.runner.config.schema import LRScaling

    assert scaled_learning_rate(0.1, 1024, LRScaling.linear, 256) == pytest.approx(0.4)
    assert scaled_learning_rate(0.1, 1024, LRScaling.sqrt, 256) == pytest.approx(0.2)
    assert scaled_learning_rate(0.1, 1024, LRScaling.linear, None) == 0.1  # a schedule's start


def test_device_memory_and_hparams_are_logged(tmp_path, monkeypatch):
    """No GPU here: the GPU memory reading is mocked; the tags and values must reach the file.
    tf32=off is in force while the job runs (the HParams tab and result.json say so) and the
    caller's TF32 setting is back afterwards."""
    from tensorboard.plugins.hparams import plugin_data_pb2

    import gacli.runner.reporting.run_logs

    monkeypatch.setattr(
        gacli.runner.reporting.run_logs, "device_memory_bytes", lambda: (1234, 5678)
    )
    tf.config.experimental.enable_tensor_float_32_execution(True)
    run_dir, _ = run(tmp_path, "epochs=1", "steps_per_epoch=2", "tf32=off")
    assert tf.config.experimental.tensor_float_32_execution_enabled()
    tags, events = event_tags(run_dir)
    assert scalars(events, "memory/device_current_bytes") == [1234.0, 1234.0]
    assert scalars(events, "memory/device_peak_bytes") == [5678.0, 5678.0]
    assert all(value > 1e7 for value in scalars(events, "memory/host_rss_bytes"))
    assert "_hparams_/session_start_info" in tags
    # The hparams travel in the summary's metadata, as the HParams plugin's content.
    content = events.SummaryMetadata("_hparams_/session_start_info").plugin_data.content
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["tf32"].bool_value is False
    assert hparams["accum_steps"].number_value > 0
    assert json.load(open(os.path.join(run_dir, "result.json")))["tf32"] is False


def test_mixed_float16_run_logs_loss_scale(tmp_path):
    run_dir, metrics = run(tmp_path, "precision=mixed_float16", "epochs=1", "steps_per_epoch=2")
    tags, events = event_tags(run_dir)
    assert {"precision/loss_scale", "precision/skipped_micro_batches"} <= tags
    assert np.isfinite(metrics["loss"])


@pytest.mark.parametrize("partial_window, updates", [("apply", 6), ("drop", 4), ("carry", 5)])
def test_optimizer_wrapper_closes_windows_per_partial_window(tmp_path, partial_window, updates):
    """wrapper=optimizer on 36 samples, micro 8, k 2: 5 micro-batches an epoch, 2 epochs."""
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "cls.npz", x=rng.normal(size=(36, 6)), y=rng.integers(0, 3, 36))
    run_dir, _ = run(
        tmp_path,
        "dataset=npz",
        f"dataset.path={tmp_path / 'cls.npz'}",
        "dataset.validation_split=0",
        "wrapper=optimizer",
        f"partial_window={partial_window}",
        "epochs=2",
        "micro_batch_size=8",
        "accum_steps=2",
    )
    result = json.load(open(os.path.join(run_dir, "result.json")))
    assert (result["optimizer_step"], result["micro_step"]) == (updates, 10)


@pytest.mark.parametrize(
    "terminal, expected", [(True, "micro 8"), (False, "epoch 1/1  update 4/4")]
)
def test_progress_is_a_bar_on_a_terminal_and_lines_otherwise(
    tmp_path, monkeypatch, terminal, expected
):
    import io

    from rich.console import Console

    import gacli.runner.training.run

    buffer = io.StringIO()
    monkeypatch.setattr(
        gacli.runner.training.run,
        "make_console",
        lambda: Console(file=buffer, force_terminal=terminal, width=160),
    )
    train(
        compose_config("progress=auto", "epochs=1", "steps_per_epoch=4", "accum_steps=2"),
        run_dir=str(tmp_path / "run"),
    )
    output = buffer.getvalue()
    assert expected in output and "samples/s" in output
    assert "effective batch  64 = micro_batch_size 32 x accum_steps 2 x replicas 1" in output


def test_the_console_shows_what_the_user_gave_and_what_holds(tmp_path, capsys):
    """ga-train's own console, as a user sees it (a sweep job's directory named by its
    overrides, a model with batch norm): the brackets of the path are printed, not read as
    markup; batch norm under accumulation is said once, in ga-train's words, naming the exact
    policy, and not as Python's warning; the tf32 line and result.json say what holds on this
    machine; each epoch's line shows every metric logged."""
    import re
    import warnings

    import gacli
    from gacli.engine.tf32 import gpus_with_tf32, tf32_enabled, tf32_used

    run_dir = str(tmp_path / "logger=[tensorboard,csv]" / "0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(
            compose_config(
                "model=cnn", "accum_steps=2", "epochs=1", "steps_per_epoch=2", "progress=plain"
            ),
            run_dir=run_dir,
        )
    output = capsys.readouterr().out
    assert output.count(f"run directory: {run_dir}") == 2, output
    assert not [w for w in caught if issubclass(w.category, gacli.BatchNormWarning)]
    (advice,) = [line for line in output.splitlines() if line.startswith("batch norm: ")]
    # Keras numbers layer names on within a process: the cnn's two are batch_normalization_<n>.
    assert re.search(
        r"2 BatchNormalization layers \(batch_normalization(_\d+)?, batch_norm", advice
    )
    assert "accum_steps=2" in advice and "batchnorm=freeze" in advice, advice
    result = json.load(open(os.path.join(run_dir, "result.json")))
    assert result["tf32"] is tf32_used(tf32_enabled())
    if not gpus_with_tf32():
        assert result["tf32"] is False
        assert "tf32             auto (no effect: no GPU that uses TF32 is visible" in output
    (epoch_line,) = [line for line in output.splitlines() if line.startswith("epoch 1/1")]
    assert "accuracy" in epoch_line and "val_loss" in epoch_line, epoch_line


def test_the_progress_bar_counts_the_runs_updates_beside_the_epoch_it_is_in():
    """A run resumed in its second of three epochs: the bar's label is that epoch of three, and
    its count says it is the run's updates, not the epoch's."""
    import io
    import types

    from rich.console import Console

    from gacli.runner.config.schema import Progress
    from gacli.runner.reporting.console import ProgressCallback

    counters = {"optimizer_step": 5, "micro_step": 20}
    accumulator = types.SimpleNamespace(after_call=counters.get)
    clock = types.SimpleNamespace(reading=lambda micro_step: (640, 2.0))
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, color_system=None, width=200)
    bar = ProgressCallback(console, Progress.rich, None, accumulator, 12, 3, clock=clock)
    bar.on_train_begin()
    bar.on_epoch_begin(1)
    bar.on_train_batch_end(0, {"loss": 1.0})
    bar.close()
    shown = [line for line in buffer.getvalue().split("\r") if "micro 20" in line][-1]
    assert "epoch 2/3" in shown and "5/12 updates of the run" in shown, shown


def test_progress_lines_show_every_metric_logged():
    """The text recipe's val_perplexity, regression's rmse and a user's metric, beside the loss;
    the engine's counts and a metric of several numbers are left to TensorBoard."""
    from gacli.runner.reporting.console import _format_logs

    logs = {
        "loss": 1.5,
        "rmse": 0.25,
        "val_perplexity": np.float32(4.76),
        "acc": 0.5,
        "skipped_windows": 0,
        "f1_score": np.array([0.5, 0.25]),
    }
    assert _format_logs(logs) == "loss 1.5  rmse 0.25  val_perplexity 4.76  acc 0.5"


def test_train_puts_back_the_callers_precision_policy(tmp_path):
    """A notebook that set its own policy keeps it after a ga-train job trained in float32."""
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        run(tmp_path, "epochs=1", "micro_batch_size=64", "accum_steps=2", "checkpoint=false")
        assert keras.mixed_precision.global_policy().name == "mixed_bfloat16"
    finally:
        keras.mixed_precision.set_global_policy(previous)


def test_the_job_steps_run_alone(tmp_path):
    """train()'s steps take what they need and can be run one by one."""
    from gacli.runner.builders.data import load_dataset
    from gacli.runner.builders.job import build_job
    from gacli.runner.plan.batch import resolve_batch
    from gacli.runner.plan.job_plan import PlanSettings, make_plan

    cfg = compose_config("epochs=2", "micro_batch_size=64", "accum_steps=4")
    plan = resolve_batch(64, 4, None, 1)
    data = load_dataset(cfg.dataset, cfg.seed)
    schedule = make_plan(PlanSettings.of(cfg), data.train_size, plan).steps
    assert schedule.micro_batches == -(-data.train_size // 64)
    assert schedule.total_updates == 2 * -(-schedule.micro_batches // 4)
    job = build_job(cfg, plan, data, schedule, tf.distribute.get_strategy())
    assert job.accumulator.config.accum_steps == 4
    assert job.accumulator.config.nonfinite.value == "stop"  # ga-train's default in float32
    assert job.model.accumulation_config.accum_steps == 4
