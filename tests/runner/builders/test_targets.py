"""The user's own model, data, loss, metrics, optimizer and callbacks, named by Hydra's
``_target_`` (docs/guides/own-model.md): ga-train run as a user runs it on the project in
tests/user_project (on PYTHONPATH, as a user's installed package would be), and each bad target
refused before training with one paragraph that names the key."""

import json
import os
import re

import keras
import numpy as np
import pytest
from omegaconf import OmegaConf
from sklearn.datasets import load_digits
from user_project import nets

from gacli.engine.schedules import LinearWarmup
from gacli.errors import ConfigError
from gacli.runner.builders import targets
from gacli.runner.builders.optimizer import build_optimizer
from gacli.runner.command.user_input import check_overrides, check_user_yaml, replaced_sections
from gacli.runner.config import objective
from gacli.runner.config.arguments import section_arguments
from gacli.runner.config.validate import validate
from helpers import TESTS, compose_config, ga_train, shipped

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
    # user_project came from PYTHONPATH: running the job again needs it (ga-report shows it).
    resolved = OmegaConf.load(run_dir / "resolved.yaml").resolved
    assert resolved.pythonpath == os.path.realpath(TESTS), resolved
    # The subclassed model defines no get_config: its weights load into the same model, built.
    assert not (run_dir / "model.keras").exists()
    rebuilt = nets.Net(10, width=8)
    rebuilt(np.zeros((1, 8, 8, 1), "float32"))
    rebuilt.load_weights(str(run_dir / "model.weights.h5"))


def test_a_model_keras_cannot_rebuild_is_saved_as_weights_that_load_into_it(
    tmp_path, monkeypatch, capsys
):
    """DefaultsNet defines no get_config and is not registered: a model.keras of it would not
    load (keras.saving.load_model cannot find the class, and would build it with width 16, not
    8). Its weights are saved instead, said why, and give a new DefaultsNet the trained model's
    predictions."""
    import hashlib

    import gacli.runner.training.run

    trained = []
    save = gacli.runner.training.run._save_model
    monkeypatch.setattr(
        gacli.runner.training.run,
        "_save_model",
        lambda model, *rest: save(trained.append(model) or model, *rest),
    )
    run_dir = tmp_path / "run"
    gacli.runner.training.run.train(
        compose_config(
            "model._target_=user_project.nets.DefaultsNet",
            "model.width=8",
            "epochs=1",
            "steps_per_epoch=2",
        ),
        str(run_dir),
    )
    assert sorted(path.name for path in run_dir.glob("model.*")) == ["model.weights.h5"]
    output = " ".join(capsys.readouterr().out.split())
    assert "user_project.nets.DefaultsNet is not registered with" in output, output
    rebuilt = nets.DefaultsNet(width=8)
    images = load_digits().images[:16, :, :, None].astype("float32") / 16
    rebuilt(images[:1])
    rebuilt.load_weights(str(run_dir / "model.weights.h5"))
    np.testing.assert_array_equal(rebuilt(images), trained[0](images, training=False))
    fingerprint = hashlib.sha256(b"".join(w.tobytes() for w in rebuilt.get_weights()))
    result = json.loads((run_dir / "result.json").read_text())
    assert fingerprint.hexdigest()[:16] == result["weights_sha256"]


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


def test_a_target_of_ones_own_replaces_the_default_file():
    assert replaced_sections(["model._target_=a.Net", "model.width=3"]) == ["~model"]
    written = {"defaults": ["/train", "_self_"], "dataset": {"_target_": "a.make", "path": "x"}}
    assert replaced_sections([], written) == ["~dataset"]
    cfg = compose_config("model._target_=a.Net", "model.width=3")
    assert section_arguments(cfg.model, "model") == {"_target_": "a.Net", "width": 3}
    # With a file of the group chosen too, that file's keys are the target's arguments (a UNet
    # of one's own that takes the shipped one's depth and base_filters).
    assert replaced_sections(["model=unet", "model._target_=a.UNet"]) == []
    chosen = {"defaults": ["/train", {"override /model": "cnn"}], "model": {"_target_": "a.Net"}}
    assert replaced_sections([], chosen) == []
    cfg = compose_config("model=unet", "model._target_=a.UNet")
    assert section_arguments(cfg.model, "model") == {
        "_target_": "a.UNet",
        "depth": 3,
        "base_filters": 8,
    }
    # The optimizer is not replaced: a target of one's own keeps the default's learning_rate,
    # and its other keys are open as the target's arguments.
    assert replaced_sections(["optimizer._target_=keras.optimizers.Lion"]) == []
    check_overrides(["optimizer._target_=keras.optimizers.Lion", "optimizer.beta_1=0.9"])


# What the old hand registry of optimizers built for each shipped choice: the shipped files must
# build the same optimizers (same class, same arguments, so the same update).
REGISTRY_BUILT = {
    "adam": lambda rate: keras.optimizers.Adam(rate),
    "adamw": lambda rate: keras.optimizers.AdamW(rate, weight_decay=0.01),
    "momentum": lambda rate: keras.optimizers.SGD(rate, momentum=0.9),
    "rmsprop": lambda rate: keras.optimizers.RMSprop(rate),
    "sgd": lambda rate: keras.optimizers.SGD(rate),
}


def tiny_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])


def one_update(optimizer):
    """A tiny model's weights after ``optimizer`` applied one fixed gradient (same start)."""
    model = tiny_model()
    gradients = [np.full(v.shape, 0.5, "float32") for v in model.trainable_variables]
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    return [v.numpy() for v in model.trainable_variables]


def test_every_shipped_optimizer_is_a_target_built_as_a_users_and_updates():
    """Each file of configs/optimizer is _target_ plus arguments, built by the code that builds
    a user's optimizer._target_, and makes the optimizer (and the update) the old registry made."""
    assert sorted(REGISTRY_BUILT) == shipped("gacli.configs", "optimizer")
    start = [v.numpy() for v in tiny_model().trainable_variables]
    for name, reference in REGISTRY_BUILT.items():
        cfg = compose_config(f"optimizer={name}", "optimizer.learning_rate=0.1")
        validate(cfg)
        assert "name" not in cfg.optimizer
        expected = reference(0.1)
        assert cfg.optimizer._target_ == f"keras.optimizers.{type(expected).__name__}", name
        made = build_optimizer(cfg.optimizer, effective_batch_size=128, total_updates=10)
        assert type(made) is type(expected), name
        assert made.get_config() == {**expected.get_config(), "name": made.name}, name
        after, wanted = one_update(made), one_update(expected)
        assert all(np.array_equal(a, b) for a, b in zip(after, wanted, strict=True)), name
        assert max(np.abs(a - b).max() for a, b in zip(after, start, strict=True)) > 1e-3, name
    # A target given replaces the default file's class and keeps ga-train's learning rate.
    cfg = compose_config("optimizer._target_=keras.optimizers.Lion", "optimizer.beta_1=0.8")
    made = build_optimizer(cfg.optimizer, effective_batch_size=128, total_updates=10)
    assert type(made) is keras.optimizers.Lion and made.beta_1 == 0.8
    assert float(made.learning_rate) == pytest.approx(0.003)  # configs/train.yaml's
    # ga-train's schedule is the learning rate the target gets: 4 updates' warm-up to 0.003.
    cfg = compose_config("optimizer=sgd", "optimizer.warmup_updates=4")
    made = build_optimizer(cfg.optimizer, effective_batch_size=128, total_updates=10)
    assert isinstance(made._learning_rate, LinearWarmup)
    rates = [float(made._learning_rate(update)) for update in (0, 1, 3, 9)]
    assert rates == pytest.approx([0.003 / 4, 0.003 * 2 / 4, 0.003, 0.003])
    # An argument the target does not take is refused in the target's terms (Keras' optimizers
    # take **kwargs, so Keras names it), before training.
    with pytest.raises(ConfigError) as refused:
        build_optimizer(compose_config("optimizer.momentum=0.5").optimizer, 128, 10)
    assert str(refused.value).startswith(
        "optimizer._target_=keras.optimizers.Adam raised ValueError: Argument(s) not recognized: "
        "{'momentum': 0.5}"
    )


def test_the_optimizer_spellings_that_went_are_refused_with_what_to_type(tmp_path):
    with pytest.raises(ConfigError) as refused:
        check_overrides(["optimizer.name=sgd"])
    assert str(refused.value).startswith("optimizer.name=sgd: optimizer.name is no longer read")
    assert "Type optimizer=sgd instead" in str(refused.value)
    with pytest.raises(ConfigError, match=r"one of adam, adamw, momentum, rmsprop, sgd instead"):
        check_overrides(["optimizer.name=adamm"])
    with pytest.raises(ConfigError, match=r"optimizer=own is no longer a choice"):
        check_overrides(["optimizer=own", "optimizer._target_=keras.optimizers.Lion"])
    path = tmp_path / "mine.yaml"
    path.write_text("defaults:\n  - /train\n  - _self_\noptimizer:\n  name: momentum\n")
    options = {"optimizer": shipped("gacli.configs", "optimizer")}
    with pytest.raises(ConfigError) as refused:
        check_user_yaml(str(path), "mine.yaml", options)
    assert "'- override /optimizer: momentum' to the defaults list" in str(refused.value)
    # Every other key of the optimizer section is the class's argument, but one this close to a
    # key ga-train reads is its misspelling, refused before TensorFlow loads.
    for misspelt, meant in (("learnig_rate", "learning_rate"), ("momentun", "momentum")):
        with pytest.raises(ConfigError, match=rf"did you mean optimizer\.{meant}\?"):
            check_overrides([f"optimizer.{misspelt}=0.1"])
    check_overrides(["optimizer.ema_momentum=0.9", "optimizer.clipvalue=1", "optimizer.beta_1=0.8"])


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


def test_early_stopping_that_sets_its_best_weights_back_reports_their_metrics(tmp_path):
    """EarlyStopping(restore_best_weights=True) as a callbacks= entry, watching val_accuracy with
    mode=min: the accuracy rises, so the first epoch is its best, training stops after the second
    and the run ends with the first epoch's weights. result.json and the returned metrics are that
    epoch's and say so; optimizer_step counts the updates applied; weights_sha256 is the saved
    model's."""
    import hashlib

    from gacli.runner.training.run import train
    from helpers import final_weights

    run_dir = tmp_path / "run"
    stopper = (
        "callbacks=[{_target_: keras.callbacks.EarlyStopping, monitor: val_accuracy, mode: min, "
        "patience: 1, restore_best_weights: true}]"
    )
    # The default job is one fit() per epoch (a compiled call of 4 micro-batches would run past
    # an epoch's end of 45): the callback's patience and best epoch hold over them all.
    returned = train(compose_config("epochs=3", stopper), str(run_dir))
    result = json.loads((run_dir / "result.json").read_text())
    kept = json.loads((run_dir / "checkpoints" / "epoch_logs.json").read_text())
    assert sorted(kept) == ["1", "2"]  # stopped after the second epoch
    assert kept["2"]["val_accuracy"] > kept["1"]["val_accuracy"]
    for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
        assert result[key] == returned[key] == kept["1"][key], key
    assert (result["weights_epoch"], result["weights_optimizer_step"]) == (1, 12)
    assert (result["optimizer_step"], result["micro_step"]) == (24, 90)
    saved = b"".join(np.ascontiguousarray(w).tobytes() for w in final_weights(str(run_dir)))
    assert hashlib.sha256(saved).hexdigest()[:16] == result["weights_sha256"]


def test_a_job_that_would_train_nothing_is_refused_before_training(tmp_path):
    """A model none of whose weights trains, as ga-train runs it; then the model and data checks
    it calls: a model of no weights, one that computes in float16 without loss scaling, and data
    whose every sample weight is 0 (the loss would be 0.0, which a sweep ranks best)."""
    from gacli.runner.builders.data import load_dataset
    from gacli.runner.builders.job import check_trainable
    from gacli.runner.config.schema import Policy
    from gacli.runner.training.run import train

    frozen = ("epochs=1", "model._target_=user_project.nets.frozen")
    with pytest.raises(ConfigError) as refused:
        train(compose_config(*frozen), run_dir=str(tmp_path))
    assert str(refused.value).startswith(
        "the model (user_project.nets.frozen) has 4 weights but none of them is trainable"
    )
    assert not (tmp_path / "result.json").exists()
    section = compose_config("model._target_=user_project.nets.weightless").model
    weightless, half = nets.weightless(10), nets.in_float16(10)
    for model in (weightless, half):
        model(np.zeros((1, 8, 8, 1), "float32"))
    with pytest.raises(ConfigError, match=r"has no weights, so training cannot change it"):
        check_trainable(weightless, section, Policy.fp32)
    with pytest.raises(ConfigError) as refused:
        check_trainable(half, section, Policy.fp32)
    assert "computes in float16 (3 of its layers: " in str(refused.value)
    assert "precision=fp32 trains without loss scaling" in str(refused.value)
    assert "Add precision=mixed_float16" in str(refused.value)
    check_trainable(half, section, Policy.mixed_float16)  # its loss is scaled there
    weightless_data = compose_config(
        "dataset._target_=user_project.data.weighted_digits",
        "+dataset.weighted_class=99",  # no digit is a 99: every weight is 0
    ).dataset
    with pytest.raises(ConfigError) as refused:
        load_dataset(weightless_data)
    assert str(refused.value).startswith(
        "dataset._target_=user_project.data.weighted_digits: every sample weight of its "
        "training data is 0, so no sample counts"
    )


def test_a_run_that_trains_nothing_fails_and_writes_no_result(tmp_path):
    """A loss no weight reaches stops after the first compiled call (0 updates of its 4
    micro-batches); windows that hold no sample weight (loss_normalization=window_weights), most
    of them here, count against precision.max_skipped_fraction under nonfinite=stop too."""
    from gacli.errors import TrainingFailed
    from gacli.runner.training.run import train

    with pytest.raises(TrainingFailed) as failed:
        train(
            compose_config("epochs=1", "loss._target_=user_project.losses.LabelsOnly"),
            run_dir=str(tmp_path / "labels_only"),
        )
    assert str(failed.value).startswith(
        "training stopped: no gradient of the loss reaches any of the model's trainable weights "
        "(the loss does not depend on them), so no update can change the model: 0 updates after "
        "4 micro-batches."
    )
    assert not (tmp_path / "labels_only" / "result.json").exists()
    padded = (
        "dataset._target_=user_project.data.mostly_padding",
        "dataset.shuffle=false",
        "dataset.validation_split=0",
        "loss_normalization=window_weights",
        "epochs=1",
        "steps_per_epoch=4",
    )
    with pytest.raises(TrainingFailed) as failed:
        train(compose_config(*padded), run_dir=str(tmp_path / "padded"))
    # 4 windows of 128 samples: only the first holds weight.
    assert str(failed.value).startswith(
        "training stopped at the end of epoch 1: 3 of its 4 windows so far (75%) were skipped "
        "because they held no sample weight (every sample weight 0, e.g. all padding, under "
        "loss_normalization=window_weights), more than precision.max_skipped_fraction=0.25"
    ), str(failed.value)
    assert not (tmp_path / "padded" / "result.json").exists()
    # Allowed to skip them all, a run whose 4 windows read none of the weighed samples still
    # fails at its end: no update was applied.
    allowed = (*padded, "+dataset.at_end=true", "precision.max_skipped_fraction=1")
    with pytest.raises(TrainingFailed) as failed:
        train(compose_config(*allowed), run_dir=str(tmp_path / "unweighed"))
    assert str(failed.value).startswith(
        "training ended without a single update after 16 micro-batches: every one of its 4 "
        "windows was skipped"
    ), str(failed.value)
    assert not (tmp_path / "unweighed" / "result.json").exists()


# -- the user's code that raises or does not fit ----------------------------------------------


def test_users_code_that_raises_in_training_is_named_and_the_run_resumes(tmp_path, monkeypatch):
    """A loss function of (y_true, y_pred) given as loss._target_ trains; a callback that raises
    as epoch 2 begins stops the run (TrainingFailed: exit 1) naming its key and first line, with
    epoch 1's checkpoint kept. Resumed after the model's code changed (a wider layer), it is
    refused naming the variable and both shapes; with the code as it was and the callback fixed,
    it goes on from epoch 2 to the end."""
    from user_project import hooks

    from gacli.errors import TrainingFailed
    from gacli.runner.training.run import train

    run_dir = tmp_path / "run"
    job = (
        "epochs=2",
        "steps_per_epoch=4",
        "accum_steps=2",
        "model._target_=user_project.nets.sequential",
        "model.width=8",
        "loss._target_=user_project.losses.sparse_cross_entropy",
        "callbacks=[{_target_: user_project.hooks.FailsAtEpoch}]",
    )
    with pytest.raises(TrainingFailed) as failed:
        train(compose_config(*job), str(run_dir))
    message = str(failed.value)
    assert message.startswith(
        "training stopped at epoch 2, after micro-batch 0 of 8: callbacks[0]._target_="
        "user_project.hooks.FailsAtEpoch raised RuntimeError: no logs for epoch 1 yet. The last "
        f"checkpoint, {run_dir / 'checkpoints' / 'ckpt-1'} (epoch 2, micro-batch 0), is kept"
    ), message
    assert f"continue from it with resume={run_dir} (the same command" in message
    plain = nets.sequential
    monkeypatch.setattr(
        nets, "sequential", lambda num_outputs, width: plain(num_outputs, 2 * width)
    )
    with pytest.raises(ConfigError) as refused:
        train(compose_config(*job, f"resume={run_dir}"), str(run_dir))
    assert re.match(
        r"resume: the model built now does not fit the checkpoint ckpt-1: its variable \S*dense"
        r"\S*/kernel has shape \(64, 16\) in the model built now and \(64, 8\) in the checkpoint\.",
        str(refused.value),
    ), str(refused.value)
    assert "restore it as it was to continue this run, or start a new run" in str(refused.value)
    monkeypatch.setattr(nets, "sequential", plain)
    monkeypatch.setattr(hooks.FailsAtEpoch, "broken", False)
    train(compose_config(*job, f"resume={run_dir}"), str(run_dir))
    result = json.loads((run_dir / "result.json").read_text())
    assert result["optimizer_step"] == 2 * 4  # steps_per_epoch=4 updates an epoch


class _LossWithABug(keras.losses.Loss):
    def call(self, y_true, y_pred):
        raise ValueError("a loss with a bug")


class _MetricWithABug(keras.metrics.Mean):
    def update_state(self, y_true, y_pred, sample_weight=None):
        raise KeyError("a metric with a bug")


def _loss_that_asserts(y_true, y_pred):
    import tensorflow as tf

    # Fails as the step runs (a TensorFlow error), not as it is traced.
    tf.debugging.assert_less(keras.ops.max(y_pred), -1.0, message="logits too large")
    return keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)


def test_the_users_part_that_raised_in_fit_is_found():
    """Which of the parts a user's _target_s built raised from fit(): a loss's call as Keras
    traces the step, a metric's update_state, a loss function's assertion as the step runs;
    an error of Keras' own (labels of the wrong rank for its loss) names none."""
    x, y = np.ones((8, 3), "float32"), np.zeros(8, "int32")
    sparse = "sparse_categorical_crossentropy"
    metric = _MetricWithABug()
    cases = [
        (_LossWithABug(), [], y, ("loss._target_=a.L", "ValueError: a loss with a bug")),
        (sparse, [metric], y, ("metrics[0]._target_=a.M", "KeyError: 'a metric with a bug'")),
        (_loss_that_asserts, [], y, "loss._target_=a.L"),
        (sparse, [], np.zeros((8, 5, 5), "int32"), None),
    ]
    for loss, metrics, labels, expected in cases:
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss=loss, metrics=metrics)
        with pytest.raises(Exception) as error:
            model.fit(x, labels, verbose=0)
        parts = [("loss._target_=a.L", loss), ("model._target_=a.Net", model)]
        found = targets.raised_by(error.value, [*parts, ("metrics[0]._target_=a.M", metric)])
        if isinstance(expected, str):  # the operation's own message, not "Graph execution error"
            assert found[0] == expected and found[1].startswith(
                "InvalidArgumentError: assertion failed: [logits too large]"
            ), found
        else:
            assert found == expected, found


def test_a_model_loss_or_metric_that_cannot_train_is_refused_before_training():
    from gacli.runner.builders.data import load_dataset
    from gacli.runner.builders.job import check_fits
    from gacli.runner.builders.model import build_model

    with pytest.raises(ConfigError) as refused:
        targets.build_metrics(["accuracy", "accuracyy"])
    assert str(refused.value).startswith(
        "metrics[1] is accuracyy, which is not a metric Keras knows by name; did you mean "
        "accuracy? Or give a name such as"
    )
    # A loss function of (y_true, y_pred) is the loss; its other arguments are bound to it.
    function = {"_target_": "user_project.losses.sparse_cross_entropy"}
    assert targets.build_loss(OmegaConf.create(function)).__name__ == "sparse_cross_entropy"
    scaled = targets.build_loss(OmegaConf.create({**function, "scale": 2.0}))
    labels, logits = np.array([1]), np.array([[0.0, 1.0]], "float32")
    assert float(scaled(labels, logits)[0]) == pytest.approx(2 * np.log1p(np.exp(-1.0)), rel=1e-6)
    with pytest.raises(ConfigError, match=r"^loss.y_true is not an argument to give"):
        targets.build_loss(OmegaConf.create({**function, "y_true": 1}))
    with pytest.raises(ConfigError) as refused:
        accumulating = {"_target_": "user_project.nets.accumulating"}
        targets.build("model", accumulating, targets.MODEL, {"num_outputs": 10})
    assert str(refused.value).startswith(
        "model._target_=user_project.nets.accumulating returned an AccumulatingModelWrapper "
        "(from gacli.engine.accumulate_model), not a plain keras.Model; return the plain Keras "
        "model"
    ), str(refused.value)
    assert "ga-train wraps it for accumulation itself" in str(refused.value)
    mlp = compose_config().model
    with pytest.raises(ConfigError) as refused:
        build_model(mlp, {"pixels": (8, 8, 1), "row_sums": (8,)}, 10, "classification")
    assert str(refused.value).startswith(
        "model=mlp takes one input tensor, but the dataset gives named inputs {pixels: (8, 8, 1), "
        "row_sums: (8,)}; build a model of your own for them"
    )
    digits = load_dataset(compose_config().dataset)
    grid = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Dense(10)])
    with pytest.raises(ConfigError) as refused:
        check_fits(grid, digits)
    assert str(refused.value).startswith(
        "the model predicts outputs of shape (8, 8, 10) a sample, but the data's class labels are "
        "of shape () a sample, so it must predict (10,): one logit per class; end the model"
    ), str(refused.value)
    check_fits(grid, digits, own_loss=True)  # a loss of its own says what the outputs mean


def test_data_from_a_dataset_target_that_cannot_train_is_refused(monkeypatch):
    """Regression targets of more than one axis a sample; a generator that never ends (its size
    unknown), read up to a limit (lowered here from its million)."""
    from gacli.runner.builders import data

    grids = compose_config(
        "dataset._target_=user_project.data.grid_targets", "dataset.task=regression"
    ).dataset
    with pytest.raises(ConfigError) as refused:
        data.load_dataset(grids)
    assert str(refused.value).startswith(
        "dataset._target_=user_project.data.grid_targets: dataset.task=regression needs targets "
        "of shape () or (k,) a sample"
    )
    assert "its targets are of shape (2, 3) a sample" in str(refused.value)
    monkeypatch.setattr(data, "UNKNOWN_SIZE_LIMIT", 3000)
    endless = compose_config("dataset._target_=user_project.data.endless").dataset
    with pytest.raises(ConfigError) as refused:
        data.load_dataset(endless)
    assert str(refused.value).startswith(
        "dataset._target_=user_project.data.endless: its training data has given 3,072 elements "
        "and not ended, and its size is unknown"
    ), str(refused.value)
    assert "assert_cardinality(n)" in str(refused.value)


def test_the_folders_of_user_modules_a_new_shell_would_not_search(monkeypatch, tmp_path):
    config = {
        "model": {"_target_": "user_project.nets.Net", "width": 8},
        "loss": {"_target_": None},
        "callbacks": [{"_target_": "keras.callbacks.TerminateOnNaN"}],  # installed: not named
    }
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "elsewhere"), TESTS]))
    assert targets.import_roots(config) == [os.path.realpath(TESTS)]
    monkeypatch.delenv("PYTHONPATH")
    assert targets.import_roots(config) == []  # as if installed (here: pytest's own sys.path)
    monkeypatch.chdir(TESTS)  # found through the working directory
    assert targets.import_roots(config) == [os.path.realpath(TESTS)]
