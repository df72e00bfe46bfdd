"""The shipped configs: every shipped model, dataset and optimizer is a file of ``_target_`` and
arguments, read by the code that reads a user's (the spellings that went are refused in
test_setting_refusals.py), and every shipped option and recipe is proven by a dry run of one
update."""

import json
import os

import numpy as np
import pytest
import yaml

from helpers import ROOT, compose_config, shipped

CONFIGS = os.path.join(ROOT, "configs")


def test_every_shipped_model_dataset_and_optimizer_file_is_a_target_and_its_arguments():
    for group, module in (
        ("model", "gacli.models."),
        ("dataset", "gacli.datasets."),
        ("optimizer", "keras.optimizers."),
    ):
        for name in shipped("gacli.configs", group):
            with open(os.path.join(CONFIGS, group, name + ".yaml")) as handle:
                content = yaml.safe_load(handle)
            assert "name" not in content, (group, name)
            assert str(content["_target_"]).startswith(module), (group, name)


# -- every shipped option proven by one update ---------------------------------------------------
@pytest.fixture(scope="module")
def user_data(tmp_path_factory):
    """Small files for the datasets that read a user's: 8x8x1 digits-like arrays of 10 classes
    (npz, tfrecord) and a folder of 32x32 colour images of 2 classes."""
    import tensorflow as tf

    folder = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    x = rng.random((60, 8, 8, 1), dtype="float32")
    y = np.arange(60) % 10
    np.savez(folder / "train.npz", x=x, y=y)
    with tf.io.TFRecordWriter(str(folder / "train.tfrecord")) as writer:
        for image, label in zip(x, y):
            feature = {
                "image": tf.train.Feature(float_list=tf.train.FloatList(value=image.ravel())),
                "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(label)])),
            }
            example = tf.train.Example(features=tf.train.Features(feature=feature))
            writer.write(example.SerializeToString())
    for label in ("cats", "dogs"):
        (folder / "images" / label).mkdir(parents=True)
        for index in range(6):
            pixels = rng.integers(0, 255, (32, 32, 3), dtype="uint8")
            png = tf.io.encode_png(pixels).numpy()
            (folder / "images" / label / f"{index}.png").write_bytes(png)
    return folder


# Each model, dataset, optimizer and precision option at least once, paired so that each model
# gets data it can take; the parameters are those the hand registry built before the models were
# functions of gacli.models (the same layers, and the same initial weights for one seed).
DRY_RUNS = {
    "mlp digits adam fp32": (("model=mlp", "dataset=digits", "optimizer=adam"), 17226),
    "cnn npz sgd mixed_float16": (
        ("model=cnn", "dataset=npz", "dataset.path={data}/train.npz", "optimizer=sgd",
         "precision=mixed_float16"),
        5274,
    ),
    "resnet tfrecord momentum mixed_bfloat16": (
        ("model=resnet", "dataset=tfrecord", "dataset.path={data}/train.tfrecord",
         "dataset.features.image.shape=[8,8,1]", "optimizer=momentum", "precision=mixed_bfloat16"),
        78426,
    ),
    "unet shapes rmsprop": (("model=unet", "dataset=shapes", "optimizer=rmsprop"), 84617),
    "application image_folder adamw": (
        ("model=application", "model.alpha=0.35", "dataset=image_folder",
         "dataset.path={data}/images", "dataset.image_size=32", "optimizer=adamw",
         "micro_batch_size=4", "accum_steps=2"),
        None,
    ),
}  # fmt: skip
RECIPES = {name: ((f"config={name}.yaml",), None) for name in shipped("gacli.recipes")}


def _dry_run(arguments, run_dir, capsys):
    """One optimizer update of the job of ``arguments`` (a recipe: composed from its file), by
    ga-train's own code in this process; (result.json, the start-up panel's output)."""
    from gacli.runner.config.validate import validate
    from gacli.runner.training.run import train

    recipe = [a.split("=", 1)[1][: -len(".yaml")] for a in arguments if a.startswith("config=")]
    others = [a for a in arguments if not a.startswith("config=")]
    # The mirrored recipe's two logical CPUs must be set before TensorFlow starts: its own run
    # (test_recipes) trains it so; here it takes its one update on the default strategy.
    one = ["epochs=1", "steps_per_epoch=1", "checkpoint=false", "strategy=default"]
    one += ["strategy.logical_cpus=0"] if recipe else []
    if recipe:
        cfg = _compose_recipe(recipe[0], [*others, *one])
    else:
        cfg = compose_config(*others, *one)
    validate(cfg)
    capsys.readouterr()
    train(cfg, str(run_dir))
    with open(os.path.join(run_dir, "result.json")) as handle:
        return json.load(handle), capsys.readouterr().out


def _compose_recipe(name, overrides):
    from hydra import compose, initialize_config_module

    from gacli.runner.command.user_input import replaced_sections
    from gacli.runner.config.schema import register_configs

    register_configs()
    with initialize_config_module("gacli.recipes", version_base="1.3"):
        deleted = replaced_sections(overrides, _recipe_content(name))
        searchpath = "hydra.searchpath=[pkg://gacli.configs]"  # as ga-train composes a recipe
        return compose(name, overrides=[searchpath, "progress=none", *deleted, *overrides])


def _recipe_content(name):
    from importlib import resources

    return yaml.safe_load((resources.files("gacli.recipes") / f"{name}.yaml").read_text())


# Out of the in-process lane, in the full suite: MobileNetV2, whose first compiled step takes
# about 25 s on 2 cores, and the recipes (5 to 8 s each; tests/recipes runs each as shipped).
CASES = [
    pytest.param(
        case, marks=[pytest.mark.slow] if case.startswith("application") or case in RECIPES else []
    )
    for case in [*DRY_RUNS, *RECIPES]
]


@pytest.mark.parametrize("case", CASES)
def test_every_shipped_option_and_recipe_takes_one_update(case, user_data, tmp_path, capsys):
    arguments, parameters = {**DRY_RUNS, **RECIPES}[case]
    arguments = [a.replace("{data}", str(user_data)) for a in arguments]
    result, output = _dry_run(arguments, tmp_path / "run", capsys)
    assert result["optimizer_step"] == 1 and np.isfinite(result["loss"]), result
    if parameters is not None:
        assert f"({parameters:,} parameters)" in output or f"({parameters} parameters)" in output


def test_every_option_of_every_group_is_covered_by_a_dry_run_or_composes():
    """The dry runs above name every model, dataset, optimizer and precision file; the groups
    that name no _target_ (strategy, check, probe) compose and pass validation for each option
    (the strategies that need devices or a cluster run in their own tests)."""
    from gacli.runner.config.validate import validate

    covered = {a for arguments, _ in DRY_RUNS.values() for a in arguments}
    covered.add("precision=fp32")  # the default job's
    for group in ("model", "dataset", "optimizer", "precision"):
        for name in shipped("gacli.configs", group):
            assert f"{group}={name}" in covered, f"{group}={name} has no dry run"
    extra = {"strategy=multi_worker": ["strategy.cluster=slurm"]}
    for group in ("strategy", "check", "probe"):
        for name in shipped("gacli.configs", group):
            choice = f"{group}={name}"
            validate(compose_config(choice, *extra.get(choice, [])), given=())
