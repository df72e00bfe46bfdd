"""Settings ga-train refuses before it trains, as a hostile user tries them: every numeric key's
range, keys that the run's choices do not read, devices that are not there, and the spellings of
the config language that went (refused before TensorFlow loads, with the one to type), the
arguments of a shipped model or dataset checked against its function among them. Each ends with
one paragraph and exit code 2 before training, no traceback, and no run directory left behind."""

import glob
import json
import subprocess
import sys

import pytest

from helpers import first_error_line, ga_train

RANGES = [
    ("seed=-1", "seed=-1 must be >= 0 and <= 4294967295"),
    ("lr_reference_batch=0", "lr_reference_batch=0 must be >= 1"),
    ("model.dropout=1.0", "model.dropout=1.0 must be >= 0.0 and < 1.0"),
    ("optimizer.momentum=-0.1", "optimizer.momentum=-0.1 must be >= 0.0 and <= 1.0"),
    ("optimizer.clipnorm=0", "optimizer.clipnorm=0.0 must be > 0.0"),
    ("optimizer.warmup_updates=-5", "optimizer.warmup_updates=-5 must be >= 0"),
    ("optimizer.weight_decay=-1", "optimizer.weight_decay=-1.0 must be >= 0.0"),
    ("dataset.num_classes=-1", "dataset.num_classes=-1 must be >= 0"),
    ("model.hidden_units=[64,0]", "model.hidden_units=[64, 0] must hold layer widths >= 1"),
    ("dataset.channels=2", "dataset.channels=2 must be 1 (grey) or 3 (colour)"),
    ("monitor.gns_every=0", "monitor.gns_every=0 must be >= 1"),
]
INERT = [
    (
        ("dataset.image_size=16",),
        "dataset.image_size is read only with dataset=image_folder or dataset=shapes",
    ),
    (("optimizer.clip_factor=0.02",), "optimizer.clip_factor is read only with optimizer.use_agc"),
    (("model.filters=[8]",), "model.filters is read only with model=cnn"),
    (("strategy.logical_cpus=2",), "strategy.logical_cpus is read only with strategy=mirrored"),
    (("strategy.port=29500",), "strategy.port is read only with strategy.cluster=slurm"),
    (("optimizer.decay_rate=0.9",), "optimizer.decay_rate is read only with"),
    (("dataset=shapes", "dataset.x_key=images"), "dataset.x_key is read only with dataset=npz"),
    (("monitor.gns_every=4",), "monitor.gns_every is read only with monitor.gns=true"),
]


@pytest.mark.parametrize("argument, expected", RANGES, ids=[a for a, _ in RANGES])
def test_every_numeric_key_is_checked_against_its_range(tmp_path, argument, expected):
    code, output = ga_train(argument, cwd=tmp_path)
    assert code == 2 and "Traceback" not in output, output
    assert first_error_line(output).startswith(f"ga-train: {expected}"), output
    assert ", e.g. " in first_error_line(output)


@pytest.mark.parametrize("arguments, expected", INERT, ids=[a[-1] for a, _ in INERT])
def test_a_key_the_run_does_not_read_is_refused(tmp_path, arguments, expected):
    code, output = ga_train(*arguments, cwd=tmp_path)
    assert code == 2 and "Traceback" not in output, output
    assert first_error_line(output).startswith(f"ga-train: {expected}"), output
    assert "would change nothing" in output
    assert not glob.glob(str(tmp_path / "outputs" / "*" / "*")), "the run's directory is removed"


# Slow: naming the devices a machine has loads TensorFlow in each ga-train (seconds apiece).
@pytest.mark.slow
@pytest.mark.parametrize(
    "arguments, expected",
    [
        (
            ("strategy=one_device", "strategy.devices=[/gpu:0]"),
            "ga-train: strategy.devices names /gpu:0, which this machine does not have; it has "
            "/cpu:0",
        ),
        (  # this one used to hang, deaf to SIGTERM
            ("strategy=mirrored", "strategy.devices=[/gpu:0,/gpu:1]"),
            "ga-train: strategy.devices names /gpu:0",
        ),
        (("strategy=tpu",), "ga-train: strategy=tpu found no TPU"),
    ],
)
def test_a_device_that_is_not_there_is_named(tmp_path, arguments, expected):
    code, output = ga_train(*arguments, "epochs=1", cwd=tmp_path, timeout=180)
    assert code == 2 and "Traceback" not in output, output
    assert first_error_line(output).startswith(expected), output
    assert not glob.glob(str(tmp_path / "outputs" / "*" / "*")), "the run's directory is removed"


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
