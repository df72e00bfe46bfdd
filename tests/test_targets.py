"""The user's own model, data, loss, metrics, optimizer and callbacks, named by Hydra's
``_target_`` (docs/guides/own-model.md): ga-train run as a user runs it on the project in
tests/user_project (on PYTHONPATH, as a user's installed package would be), and each bad target
refused before training with one paragraph that names the key."""

import json
import os

import keras
import numpy as np
import pytest
from sklearn.datasets import load_digits
from user_project import nets

from gacli.errors import ConfigError
from gacli.runner import objective, targets
from gacli.runner.user_config import own_sections
from gacli.runner.validate import validate
from helpers import compose_config, ga_train

TESTS = os.path.dirname(os.path.abspath(__file__))
USER_PATH = {"PYTHONPATH": os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))}


def run(tmp_path, *arguments):
    """ga-train for one epoch in ``tmp_path``/run; (exit code, output, run directory)."""
    code, output = ga_train(
        "hydra.run.dir=run", "progress=none", "epochs=1", *arguments, cwd=tmp_path, env=USER_PATH
    )
    return code, output, tmp_path / "run"


def error_lines(output):
    return [line for line in output.splitlines() if line.startswith("ga-train: ")]


def test_a_subclassed_model_with_its_own_loss_metrics_optimizer_and_callback(tmp_path):
    written = tmp_path / "epochs.jsonl"
    code, output, run_dir = run(
        tmp_path,
        "model._target_=user_project.nets.Net",
        "model.width=8",  # no +: the target's arguments are the section's keys
        "loss._target_=keras.losses.SparseCategoricalCrossentropy",
        "loss.from_logits=true",
        "loss.name=user_loss",
        "metrics=[{_target_: keras.metrics.SparseCategoricalAccuracy, name: acc}, "
        "sparse_top_k_categorical_accuracy]",
        "optimizer._target_=keras.optimizers.Lion",
        "optimizer.beta_1=0.8",
        f"callbacks=[{{_target_: user_project.hooks.WriteEpochs, path: '{written}'}}]",
        "objective=val_acc",
    )
    assert code == 0, output[-3000:]
    # width=8 from the config, num_outputs=10 from the data: 64*8+8 + 8*10+10 weights.
    assert "user_project.nets.Net (610 parameters)" in output
    result = json.loads((run_dir / "result.json").read_text())
    top_k = "val_sparse_top_k_categorical_accuracy"
    assert {"acc", "val_acc", top_k} <= set(result) and "val_accuracy" not in result
    (line,) = [json.loads(text) for text in written.read_text().splitlines()]
    assert line["logs"]["val_acc"] == pytest.approx(result["val_acc"])
    assert (line["optimizer"], line["inner"]) == ("GradientAccumulateOptimizer", "Lion")
    assert line["loss"] == ["SparseCategoricalCrossentropy", "user_loss", True]
    # The subclassed model defines no get_config: its weights load into the same model, built.
    assert not (run_dir / "model.keras").exists()
    rebuilt = nets.Net(10, width=8)
    rebuilt(np.zeros((1, 8, 8, 1), "float32"))
    rebuilt.load_weights(str(run_dir / "model.weights.h5"))


def test_named_inputs_and_sample_weights_from_a_dataset_target(tmp_path):
    """Only class 0 weighs anything: the model learns to say 0 for every digit, so its val
    accuracy is class 0's share of the validation digits (without the weights, 1 epoch reaches
    about 0.5, and its val_loss is above 1)."""
    job = (
        "dataset._target_=user_project.data.weighted_digits",
        "dataset.weighted_class=0",
        "model._target_=user_project.nets.two_inputs",
    )
    code, output, run_dir = run(tmp_path, *job)
    assert code == 0, output[-3000:]
    assert "1438 train / 359 val samples, inputs {pixels: (8, 8, 1), row_sums: (8,)}" in output
    result = json.loads((run_dir / "result.json").read_text())
    share = float(np.mean(load_digits().target[:359] == 0))
    assert result["val_accuracy"] == pytest.approx(share, abs=0.01)
    assert result["val_loss"] < 0.1
    # The equivalence check reads the same data: dict inputs and sample weights, one window.
    code, output = ga_train(
        "check=equivalence", "optimizer=sgd", *job, "hydra.run.dir=check", cwd=tmp_path,
        env=USER_PATH,
    )  # fmt: skip
    assert code == 0 and "EQUIVALENT: 4 micro-batches of 32" in output, output[-3000:]


def test_arrays_and_an_unbuilt_sequential_from_the_users_yaml(tmp_path):
    """(train, None) as arrays: dataset.validation_split of them is held out (10% of 1797)."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "own.yaml").write_text(
        "defaults:\n  - /train\n  - _self_\n"
        "dataset:\n  _target_: user_project.data.digit_arrays\n  scale: 1.0\n"
        "model:\n  _target_: user_project.nets.sequential\n  width: 8\n"
    )
    code, output, run_dir = run(tmp_path, "config=./mine/own.yaml")
    assert code == 0, output[-3000:]
    assert "user_project.data.digit_arrays: 1617 train / 180 val samples" in output
    result = json.loads((run_dir / "result.json").read_text())
    assert result["optimizer_step"] == 13  # 51 micro-batches of 32, in windows of 4
    loaded = keras.saving.load_model(run_dir / "model.keras")
    assert loaded.count_params() == 64 * 8 + 8 + 8 * 10 + 10


@pytest.mark.parametrize(
    "arguments, first_line",
    [
        (
            ("model._target_=user_project.nets.Nett",),
            "ga-train: model._target_=user_project.nets.Nett cannot be imported: "
            "user_project.nets has no 'Nett'; did you mean model._target_=user_project.nets.Net?",
        ),
        (
            ("optimizer._target_=keras.losses.Huber",),
            "ga-train: optimizer._target_=keras.losses.Huber returned a Huber (from "
            "keras.src.losses.losses), not a Keras optimizer; return a plain "
            "keras.optimizers.Optimizer",
        ),
        (
            ("dataset._target_=user_project.data.broken", "dataset.path=missing.npz"),
            "ga-train: dataset._target_=user_project.data.broken raised FileNotFoundError: no "
            "such file: missing.npz (called with path='missing.npz').",
        ),
    ],
    ids=["not importable", "wrong kind returned", "raises"],
)
def test_a_bad_target_is_refused_before_training(arguments, first_line, tmp_path):
    code, output, run_dir = run(tmp_path, *arguments)
    assert code == 2 and "Traceback" not in output, output[-3000:]
    assert error_lines(output)[0].startswith(first_line), error_lines(output)
    assert not run_dir.exists(), "refused before training: its directory is removed"


# -- in-process: the checks behind those messages --------------------------------------------


def test_arguments_are_checked_against_the_targets_signature():
    with pytest.raises(ConfigError) as refused:
        targets.build(
            "model", {"_target_": "user_project.nets.sequential", "widht": 8}, targets.MODEL
        )
    assert str(refused.value) == (
        "model.widht is not an argument of model._target_=user_project.nets.sequential, which "
        "takes num_outputs, width; did you mean model.width? Drop model.widht, or give the "
        "target an argument of that name."
    )
    with pytest.raises(ConfigError, match=r"needs the argument width, which is not given"):
        targets.build("model", {"_target_": "user_project.nets.broken"}, targets.MODEL)
    filled = targets.build(
        "model",
        {"_target_": "user_project.nets.sequential", "width": 4},
        targets.MODEL,
        {"num_outputs": 3, "input_shape": (5,)},  # it takes no input_shape: not passed
    )
    assert filled.layers[-1].units == 3
    with pytest.raises(ConfigError, match=r"is a module, not a class or function"):
        targets.build("loss", {"_target_": "keras.losses"}, targets.LOSS)


def test_a_target_chooses_the_own_section_and_opens_it():
    assert own_sections(["model._target_=a.Net", "model.width=3"]) == ({"model"}, ["model=own"])
    assert own_sections(["model=own", "model._target_=a.Net"]) == ({"model"}, [])
    written = {"defaults": ["/train", "_self_"], "dataset": {"_target_": "a.make", "path": "x"}}
    assert own_sections([], written) == ({"dataset"}, ["dataset=own"])
    chosen = {"defaults": ["/train", {"override /model": "cnn"}], "model": {"_target_": "a.Net"}}
    assert own_sections([], chosen) == ({"model"}, [])  # validate refuses it, naming both
    with pytest.raises(ConfigError) as refused:
        validate(compose_config("model=unet", "model._target_=a.Net"))
    assert str(refused.value).startswith(
        "model._target_=a.Net names your own model, but this run chooses model=unet"
    )
    cfg = compose_config("model=own", "model._target_=a.Net", "model.width=3")
    assert targets.own_arguments(cfg.model, "model") == {"_target_": "a.Net", "width": 3}


def test_a_sweep_may_optimise_a_metric_of_its_own():
    metrics = [
        {"_target_": "keras.metrics.MeanAbsoluteError"},
        "mse",
        {"_target_": "a.F", "name": "f"},
    ]
    assert objective.logged_metrics(metrics) == ("loss", "mean_absolute_error", "mse", "f")
    objective.check("val_mean_absolute_error", 0.1, "minimize", metrics)
    with pytest.raises(ConfigError, match=r"it logs loss, mean_absolute_error, mse, f, val_loss"):
        objective.check("val_accuracy", 0.1, "maximize", metrics)
