"""Settings ga-train refuses before it trains, as a hostile user tries them: every numeric key's
range, keys that the run's choices do not read, a user's YAML with a key twice or a config group
set as a key, devices that are not there, and a sweep asked to show its config. Each ends with
one paragraph and exit code 2 before training, no traceback, and no run directory left behind."""

import glob

import pytest

from helpers import ga_train

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


def first_error_line(output):
    lines = [line for line in output.splitlines() if line.startswith("ga-train:")]
    return lines[0] if lines else output


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


@pytest.mark.parametrize(
    "body, expected",
    [
        (
            "epochs: 2\naccum_steps: 2\nepochs: 3\n",
            "ga-train: ./my.yaml:6:1: the key 'epochs' is given twice (the first would be "
            "ignored); keep one of the two lines",
        ),
        (
            "optimizer:\n  learning_rate: 0.1\n  learning_rate: 0.2\n",
            "ga-train: ./my.yaml:6:3: the key 'learning_rate' is given twice",
        ),
        (
            "precision: mixed_bfloat16\n",
            "ga-train: config=./my.yaml sets precision: mixed_bfloat16, but precision is a config "
            "group, chosen in the defaults list: add '- override /precision: mixed_bfloat16'",
        ),
    ],
)
def test_a_users_yaml_with_a_key_twice_or_a_group_as_a_key(tmp_path, body, expected):
    (tmp_path / "my.yaml").write_text("defaults:\n  - /train\n  - _self_\n" + body)
    code, output = ga_train("config=./my.yaml", cwd=tmp_path)
    assert code == 2 and "Traceback" not in output, output
    assert first_error_line(output).startswith(expected), output


def test_a_sweep_cannot_show_its_config(tmp_path):
    # Hydra refused the pair with a ValueError and a traceback.
    code, output = ga_train("-m", "accum_steps=1,2", "--cfg", "job", cwd=tmp_path)
    assert code == 2 and "Traceback" not in output, output
    assert first_error_line(output).startswith(
        "ga-train: -m cannot be combined with --cfg: Hydra shows the config"
    ), output
