"""dataset.task=regression as a user runs it: float targets from an npz file, k linear outputs,
mean squared error, mae and rmse logged, named by an objective and reported by ga-report."""

import json
import os

import numpy as np
import pytest
from omegaconf import OmegaConf

from helpers import compose_config, event_tags, ga_report, ga_train, run_dir_of

REGRESSION = (
    "dataset=npz",
    "dataset.path=train.npz",
    "dataset.task=regression",
    "epochs=3",
    "micro_batch_size=8",
    "accum_steps=2",
    "progress=none",
)


def _write_linear(folder, samples=200, widths=(4, None)):
    """A noisy linear function of 4 features saved as folder/train.npz; its targets."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, widths[0])).astype("float32")
    weights = rng.normal(size=(widths[0], widths[1] or 1)) * 2
    y = x @ weights + 0.1 * rng.normal(size=(samples, widths[1] or 1))
    y = (y[:, 0] if widths[1] is None else y).astype("float32")
    np.savez(os.path.join(folder, "train.npz"), x=x, y=y)
    return y


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(the folder, the targets, the run directory, its result.json) of one regression run."""
    cwd = tmp_path_factory.mktemp("regression")
    targets = _write_linear(cwd)
    code, output = ga_train(*REGRESSION, "objective=val_mae", cwd=cwd)
    assert code == 0, output[-3000:]
    run_dir = run_dir_of(output)
    with open(os.path.join(run_dir, "result.json")) as handle:
        return cwd, targets, run_dir, json.load(handle)


# Slow: the tests of the run fixture share one ga-train run (TensorFlow loads in it).
@pytest.mark.slow
def test_a_regression_run_learns_and_logs_mae_and_rmse(run):
    _, targets, run_dir, result = run
    assert {"mae", "rmse", "val_mae", "val_rmse"} <= set(result)
    assert "accuracy" not in result and "val_accuracy" not in result
    # Predicting the mean would give the targets' variance; the linear function is learnt.
    assert result["val_loss"] < 0.25 * float(np.var(targets)), result
    # The loss is the mean squared error, so rmse is its square root over the same samples.
    assert result["val_rmse"] == pytest.approx(np.sqrt(result["val_loss"]), rel=1e-3)
    tags, _ = event_tags(run_dir)
    assert {"train/mae", "val/mae", "train/rmse", "val/rmse"} <= tags, sorted(tags)
    # Recorded, so that ga-report marks no best loss between it and a classifier's run.
    resolved = OmegaConf.load(os.path.join(run_dir, "resolved.yaml")).resolved
    assert resolved.loss == "mean_squared_error", resolved


@pytest.mark.slow
def test_an_objective_regression_does_not_log_is_refused_with_the_metrics_it_does(run):
    cwd = run[0]
    code, output = ga_train(*REGRESSION, "objective=val_accuracy", cwd=cwd)
    assert code == 2, output[-3000:]
    first = next(line for line in output.splitlines() if line.startswith("ga-train:"))
    assert first.startswith("ga-train: objective=val_accuracy is not a metric this run logs")
    assert "val_mae" in first and "val_rmse" in first, first


@pytest.mark.slow
def test_ga_report_shows_the_regression_metrics_lower_is_better(run):
    cwd, _, run_dir, result = run
    code, output = ga_report(os.path.dirname(run_dir), "--out", str(cwd / "report"), cwd=cwd)
    assert code == 0, output
    with open(cwd / "report" / "report.json") as handle:
        report = json.load(handle)
    better = {column["key"]: column["better"] for column in report["columns"]}
    assert better["val_mae"] == better["val_rmse"] == better["val_mae_best"] == "lower", better
    (row,) = report["runs"]
    assert row["val_mae"] == pytest.approx(result["val_mae"])
    assert "val mae" in (cwd / "report" / "report.md").read_text()


def test_targets_of_width_k_give_k_linear_outputs(tmp_path):
    from gacli.runner.builders.data import load_dataset
    from gacli.runner.builders.job import check_fits, loss_and_metrics
    from gacli.runner.builders.model import build_model

    _write_linear(tmp_path, samples=40, widths=(4, 3))
    cfg = compose_config(*REGRESSION[:3], f"dataset.path={tmp_path / 'train.npz'}")
    data = load_dataset(cfg.dataset, cfg.seed)
    assert (data.task, data.num_outputs, data.label_shape) == ("regression", 3, (3,))
    model = build_model(cfg.model, data.input_shape, data.num_outputs, data.task)
    assert model.output_shape == (None, 3)
    assert model.layers[-1].get_config()["activation"] == "linear"
    check_fits(model, data)
    loss, metrics = loss_and_metrics(data.task, data.num_outputs)
    assert type(loss).__name__ == "MeanSquaredError"
    assert [metric.name for metric in metrics] == ["mae", "rmse"]


def test_tfrecord_targets_train_as_rows_of_their_values(tmp_path):
    import tensorflow as tf

    from gacli.runner.builders.data import load_dataset

    def floats(values):
        return tf.train.Feature(float_list=tf.train.FloatList(value=values))

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(10, 4)), rng.normal(size=(10, 2))
    with tf.io.TFRecordWriter(str(tmp_path / "train.tfrecord")) as writer:
        for inputs, targets in zip(x, y):
            features = {"image": floats(inputs), "label": floats(targets)}
            example = tf.train.Example(features=tf.train.Features(feature=features))
            writer.write(example.SerializeToString())
    cfg = compose_config(
        "dataset=tfrecord",
        f"dataset.path={tmp_path / 'train.tfrecord'}",
        "dataset.task=regression",
        "dataset.validation_split=0",
        "dataset.features.image={shape:[4],dtype:float32}",
        "dataset.features.label={shape:[2],dtype:float32}",
    )
    data = load_dataset(cfg.dataset, cfg.seed)
    assert (data.task, data.num_outputs, data.label_shape) == ("regression", 2, (2,))
    read = np.stack([targets for _, targets in data.train.as_numpy_iterator()])
    np.testing.assert_allclose(read, y, rtol=1e-6)


@pytest.mark.parametrize(
    "arguments, first_line",
    [
        (
            ("dataset=image_folder", "dataset.path=.", "dataset.task=regression"),
            "ga-train: dataset.task=regression reads float targets from dataset=npz, "
            "dataset=tfrecord or a dataset of your own (dataset._target_=...)",
        ),
        pytest.param(
            ("dataset=npz", "dataset.path=strings.npz", "dataset.task=regression"),
            "ga-train: strings.npz: dataset.task=regression needs float targets",
            marks=pytest.mark.slow,  # refused once TensorFlow has read the file
        ),
    ],
    ids=["image_folder", "string_targets"],
)
def test_what_regression_cannot_train_on_is_refused_before_training(
    tmp_path, arguments, first_line
):
    np.savez(tmp_path / "strings.npz", x=np.zeros((20, 4), "float32"), y=np.array(["a"] * 20))
    code, output = ga_train(*arguments, "progress=none", cwd=tmp_path)
    assert code == 2, output[-3000:]
    first = next(line for line in output.splitlines() if line.startswith("ga-train:"))
    assert first.startswith(first_line), first
    assert "Traceback" not in output and not list(tmp_path.glob("outputs/**/result.json"))


def test_targets_whose_squared_error_overflows_float32_are_refused(tmp_path):
    """Targets near 1e30: the mean squared error of an untrained model is inf in float32 (its
    gradient is not), so such data is refused where it is read, naming the row."""
    from gacli.errors import ConfigError
    from gacli.runner.builders.data import load_dataset

    x = np.zeros((20, 4), "float32")
    y = np.ones(20, "float32")
    np.savez(tmp_path / "fine.npz", x=x, y=y * 1e18)  # squares sum to 2e37: finite
    y[7] = 1e30
    np.savez(tmp_path / "huge.npz", x=x, y=y)
    config = ("dataset=npz", "dataset.task=regression")
    load_dataset(compose_config(*config, f"dataset.path={tmp_path / 'fine.npz'}").dataset)
    with pytest.raises(ConfigError) as refused:
        load_dataset(compose_config(*config, f"dataset.path={tmp_path / 'huge.npz'}").dataset)
    assert str(refused.value).startswith(
        "huge.npz: the targets are too large to train on in float32: row 7 holds "
        "1e+30, and the squares of such targets, summed over the 20 samples, exceed float32's "
        "largest number (3.4e+38), so the mean squared error would be inf."
    ), str(refused.value)
