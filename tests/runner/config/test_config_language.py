"""One config language: every shipped model, dataset and optimizer is a file of ``_target_`` and
arguments, read by the code that reads a user's; the spellings that went are refused, before
TensorFlow loads, with the one to type; and every shipped option and recipe is proven by a dry
run of one update."""

import json
import os
import subprocess
import sys

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


# Each spelling that went, and what the refusal must tell the user to type instead.
GONE = [
    (["model.name=unet"], "Type model=unet instead"),
    (["model.name=ResNet50"], "Type model=application model.architecture=ResNet50 instead"),
    (["model.name=transformer"], "Type model=<name>, one of application, cnn, mlp,"),
    (["model=factory", "model.factory=pkg.nets:build"], "model._target_=my_pkg.models.build"),
    (["model.factory=pkg.nets:build"], "Type model._target_=pkg.nets.build instead"),
    (["+model.kwargs.width=3"], "Type model.width=3 instead"),
    (["model=own", "model._target_=pkg.Net"], "model._target_=my_pkg.nets.Net (with its"),
    (["dataset=own"], "dataset._target_=my_pkg.data.make (with its"),
    (["dataset.name=npz"], "Type dataset=npz instead"),
    (["optimizer.name=sgd"], "Type optimizer=sgd instead"),
    (["optimizer.lr_scaling=sqrt"], "Type lr_scaling=sqrt lr_reference_batch=256"),
    (["optimizer.base_batch_size=512"], "type lr_reference_batch=512 instead"),
    (["precision.policy=mixed_bfloat16"], "Type precision=mixed_bfloat16 instead"),
    # The arguments of a shipped model or dataset are checked against its function.
    (["model.depth=4"], "model.depth is read only with model=resnet or model=unet, and this run"),
    (["model=unet", "model.dept=4"], "model.dept is not a key ga-train reads with model=unet"),
    (["dataset.image_size=64"], "dataset.image_size is read only with dataset=image_folder or"),
    (["model.hidden_units=[0]"], "model.hidden_units=[0] must hold layer widths >= 1"),
    # Their kinds too, told by the function's defaults: Hydra reads depth=abc as a string.
    (["model=unet", "model.depth=abc"], "model.depth=abc must be a whole number, as its"),
    (["model.hidden_units=[a]"], "model.hidden_units=['a'] must be a list of whole numbers"),
    (["model.dropout=true"], "model.dropout=true must be a number"),
    # Not a spelling that went, but refused as early: recomputation needs the model wrapper.
    (["remat=every", "wrapper=optimizer"], "remat recomputes in the model wrapper's train step"),
]
FILES = [
    ("model: {name: cnn}", "Add '- override /model: cnn' to the defaults list"),
    ("model: {factory: 'pkg.nets:build'}", "Type model._target_=pkg.nets.build instead"),
    ("dataset: {name: shapes}", "Add '- override /dataset: shapes' to the defaults list"),
    ("optimizer: {lr_scaling: linear}", "Type lr_scaling=linear lr_reference_batch=256"),
]
CHECK = """
import contextlib, io, json, sys
from gacli.runner.command.cli import main
results = []
for arguments in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
        try:
            code = main(arguments)
        except SystemExit as stop:
            code = stop.code
    results.append([code, err.getvalue()])
print(json.dumps({"results": results, "tensorflow": "tensorflow" in sys.modules}))
"""


def test_the_spellings_that_went_are_refused_before_tensorflow_with_the_one_to_type(tmp_path):
    cases = [arguments for arguments, _ in GONE]
    for index, (text, _) in enumerate(FILES):
        (tmp_path / f"old{index}.yaml").write_text(f"defaults: [/train, _self_]\n{text}\n")
        cases.append([f"config=./old{index}.yaml"])
    found = subprocess.run(
        [sys.executable, "-c", CHECK, json.dumps(cases)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert found.returncode == 0, found.stderr[-3000:]
    answer = json.loads(found.stdout.splitlines()[-1])
    assert answer["tensorflow"] is False  # every refusal came before TensorFlow loaded
    for (code, output), wanted in zip(answer["results"], [w for _, w in GONE + FILES]):
        lines = [line for line in output.splitlines() if line.startswith("ga-train: ")]
        assert code == 2 and len(lines) == 1 and "Traceback" not in output, output
        assert wanted in lines[0], (wanted, lines[0])


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
