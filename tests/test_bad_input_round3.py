"""Bad input, third pass, as a hostile user tries it: every numeric key's range, keys that the
run's choices do not read, devices that are not there, damaged and empty data files, and other
people's files in the run directory. Each ends with one paragraph and exit code 2 before
training, no traceback, nothing of the user's touched."""

import glob
import os
import re
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

from helpers import ga_train, start_ga_train

RANGES = [
    ("seed=-1", "seed=-1 must be >= 0 and <= 4294967295"),
    ("optimizer.base_batch_size=0", "optimizer.base_batch_size=0 must be >= 1"),
    ("model.dropout=1.0", "model.dropout=1.0 must be >= 0.0 and < 1.0"),
    ("optimizer.momentum=-0.1", "optimizer.momentum=-0.1 must be >= 0.0 and <= 1.0"),
    ("optimizer.clipnorm=0", "optimizer.clipnorm=0.0 must be > 0.0"),
    ("optimizer.warmup_updates=-5", "optimizer.warmup_updates=-5 must be >= 0"),
    ("optimizer.weight_decay=-1", "optimizer.weight_decay=-1.0 must be >= 0.0"),
    ("dataset.num_classes=-1", "dataset.num_classes=-1 must be >= 0"),
    ("model.hidden_units=[64,0]", "model.hidden_units=[64, 0] and model.filters=[16, 32]"),
    ("dataset.channels=2", "dataset.channels=2 must be 1 (grey) or 3 (colour)"),
    ("monitor.gns_every=0", "monitor.gns_every=0 must be >= 1"),
]
INERT = [
    (("dataset.image_size=16",), "dataset.image_size is read only with dataset=shapes or"),
    (("optimizer.momentum=0.5",), "optimizer.momentum is read only with optimizer=momentum"),
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


def test_npz_that_is_text_or_empty(tmp_path):
    (tmp_path / "text.npz").write_text("x,y\n1,2\n")
    np.savez(tmp_path / "empty.npz", x=np.zeros((0, 8), "float32"), y=np.zeros(0, "int32"))
    code, output = ga_train("dataset=npz", "dataset.path=text.npz", cwd=tmp_path)
    assert code == 2 and "it is not a numpy file: it begins b'x,y\\n1,'" in output, output
    assert "pickled" not in output
    code, output = ga_train("dataset=npz", "dataset.path=empty.npz", cwd=tmp_path)
    assert code == 2 and "empty.npz holds no samples" in output, output
    assert "validation_split" not in output


TFRECORD_FEATURES = (
    "dataset.features={image:{shape:[4,4,1],dtype:float32},label:{shape:[],dtype:int64}}"
)


def _write_tfrecord(path, count):
    """``count`` records of a 16-float "image" and an int64 "label" (0, 1, 2, ...); ``path``."""
    import tensorflow as tf

    rng = np.random.default_rng(0)
    with tf.io.TFRecordWriter(str(path)) as writer:
        for index in range(count):
            feature = {
                "image": tf.train.Feature(float_list=tf.train.FloatList(value=rng.normal(size=16))),
                "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[index % 3])),
            }
            example = tf.train.Example(features=tf.train.Features(feature=feature))
            writer.write(example.SerializeToString())
    return path


@pytest.mark.parametrize(
    "cut, expected",
    [
        (3, "is damaged after its first 100 records: 3 bytes at its end are not a whole record"),
        (13, "is damaged after its first 100 records (truncated record at"),
        (0, None),  # a clean end at a record: nothing tells it from a shorter file
    ],
)
def test_a_tfrecord_file_cut_short_is_refused(tmp_path, cut, expected):
    path = _write_tfrecord(tmp_path / "train.tfrecord", 200)
    data = path.read_bytes()
    record = len(data) // 200
    path.write_bytes(data[: 100 * record + cut])
    code, output = ga_train(
        "dataset=tfrecord", "dataset.path=train.tfrecord", TFRECORD_FEATURES, "epochs=1",
        "progress=none", "accum_steps=2", cwd=tmp_path,
    )  # fmt: skip
    if expected is None:
        assert code == 0 and "90 train / 10 val samples" in output, output
        return
    assert code == 2 and "Traceback" not in output, output
    assert f"train.tfrecord {expected}" in output, output


@pytest.mark.slow
@pytest.mark.parametrize(
    "features, expected",
    [
        (
            "dataset.features={image:{shape:[4,4,2],dtype:float32},label:{shape:[],dtype:int64}}",
            "Number of float values != expected.  Values size: 16 but output shape: [4,4,2]",
        ),
        (
            "dataset.features={image:{shape:[4,4,1],dtype:int64},label:{shape:[],dtype:int64}}",
            "Data types don't match. Data type: float but expected type: int64",
        ),
    ],
)
def test_a_tfrecord_feature_mismatch_keeps_its_reason(tmp_path, features, expected):
    # TensorFlow's reason came after the op's long name and was cut off at 160 characters.
    _write_tfrecord(tmp_path / "train.tfrecord", 40)
    code, output = ga_train(
        "dataset=tfrecord", "dataset.path=train.tfrecord", features, "epochs=1", cwd=tmp_path
    )
    assert code == 2 and "Traceback" not in output, output
    assert first_error_line(output).startswith(
        "ga-train: train.tfrecord record 0 does not match dataset.features (Name: <unknown>, "
        f"Key: image, Index: 0.  {expected}); describe its features as they are stored"
    ), output


def test_a_folder_of_the_users_is_never_written_into(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "model.keras").write_text("the user's own model")
    code, output = ga_train("hydra.run.dir=mine", "epochs=1", cwd=tmp_path)
    assert code == 2 and "already holds files that ga-train did not write (model.keras)" in (
        output
    ), output
    assert os.listdir(tmp_path / "mine") == ["model.keras"]
    assert (tmp_path / "mine" / "model.keras").read_text() == "the user's own model"
    (tmp_path / "empty").mkdir()
    code, output = ga_train("hydra.run.dir=empty", "epochs=1", "progress=none", cwd=tmp_path)
    assert code == 0, output  # an empty folder is fine


@pytest.mark.slow
def test_a_run_killed_before_its_first_checkpoint_is_not_mixed_with_another(tmp_path):
    first = ("hydra.run.dir=run", "epochs=3", "progress=plain", "micro_batch_size=8")
    process = start_ga_train(*first, cwd=tmp_path)
    deadline = time.time() + 120
    while not glob.glob(str(tmp_path / "run" / "tensorboard" / "events.*")):
        assert process.poll() is None and time.time() < deadline, process.communicate()[0]
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not glob.glob(str(tmp_path / "run" / "checkpoints" / "ckpt-*"))
    old_events = glob.glob(str(tmp_path / "run" / "tensorboard" / "events.*"))
    code, output = ga_train("hydra.run.dir=run", "epochs=1", cwd=tmp_path)
    assert code == 2 and "holds an earlier run of another command" in output, output
    assert glob.glob(str(tmp_path / "run" / "tensorboard" / "events.*")) == old_events
    code, output = ga_train(*first[:2], "progress=none", first[3], cwd=tmp_path)
    assert code == 0, output  # the same command (progress may change) starts again, clean
    events = glob.glob(str(tmp_path / "run" / "tensorboard" / "events.*"))
    assert len(events) == 1 and events != old_events


@pytest.mark.slow
def test_micro_batch_size_auto_on_the_default_job_fits_the_training_set(tmp_path):
    code, output = ga_train("micro_batch_size=auto", "epochs=1", "progress=none", cwd=tmp_path)
    assert code == 0, output[-3000:]
    # Nothing runs out of memory on a CPU: the choice is the largest size as fast as the fastest
    # (docs/guides/batch-probe.md), so it moves with the timings; its bound does not.
    assert "sizes up to 359: 1438 training samples / accum_steps 4" in output, output
    assert "        359  fits" in output and "        360  " not in output
    (effective, micro) = re.search(
        r"effective batch  (\d+) = micro_batch_size (\d+) x accum_steps 4", output
    ).groups()
    assert 1 <= int(micro) <= 359 and int(effective) == 4 * int(micro)


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


@pytest.fixture
def small_disk(tmp_path):
    """A 420 KiB tmpfs: room for the default job's first checkpoint, not its second."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=420k", "tmpfs", str(mount_point)],
        capture_output=True,
    )
    if done.returncode != 0:
        pytest.skip(f"could not mount a tmpfs: {done.stderr.decode().strip()}")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=False)


@pytest.mark.slow
def test_a_full_disk_is_named_as_such_and_the_run_resumes_once_there_is_room(tmp_path, small_disk):
    # TensorFlow reports a full disk while checkpointing as a resource exhausted: it was taken
    # for out of device memory ("try micro_batch_size=16"), then failure.json could not be
    # written either (a traceback) and its 0-byte temporary file stayed.
    run_dir = small_disk / "run"
    code, output = ga_train("epochs=2", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert code == 1 and "Traceback" not in output, output
    message = [line for line in output.splitlines() if line.startswith("ga-train: ")][-1]
    assert message.startswith(f"ga-train: the disk of {run_dir} is full ("), message
    assert "This is disk space, not device memory" in message and "micro_batch_size" not in message
    assert f"continue with resume={run_dir}" in message
    assert not glob.glob(str(run_dir / ".writing-*")) and not glob.glob(str(run_dir / ".model-*"))
    subprocess.run(["mount", "-o", "remount,size=3m", str(small_disk)], check=True)
    code, output = ga_train("epochs=2", f"resume={run_dir}", cwd=tmp_path)
    assert code == 0, output
    assert "resume: from epoch 2, micro-batch 0 of it" in output
    assert os.path.exists(run_dir / "result.json") and os.path.exists(run_dir / "model.keras")


def _image_folder(root, classes=("cat", "dog"), per_class=12):
    from PIL import Image

    rng = np.random.default_rng(0)
    for name in classes:
        (root / name).mkdir(parents=True)
        for index in range(per_class):
            pixels = rng.integers(0, 255, (12, 12, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{index}.png")
    return root


@pytest.mark.slow
@pytest.mark.parametrize(
    "settings, expected",
    [
        (
            ("dataset.num_classes=5",),
            "ga-train: dataset.num_classes=5 but images has 2 class folders (cat, dog), and an "
            "image folder's classes are its sub-folders",
        ),
        (
            ("dataset.validation_split=0.99",),
            "ga-train: the training set is empty: dataset image_folder leaves no sample for "
            "training after validation_split=0.99",
        ),
        (
            ("dataset.image_size=100000",),
            "ga-train: the model does not fit in memory: building mlp for inputs of shape "
            "(100000, 100000, 3) ran out of memory",
        ),
    ],
)
def test_image_folder_settings_that_cannot_work_are_refused(tmp_path, settings, expected):
    # A folder of 2 classes: more classes than folders trained silently; an empty training set
    # was told to use micro_batch_size=1; a size whose model cannot be built was a traceback.
    _image_folder(tmp_path / "images")
    code, output = ga_train(
        "dataset=image_folder", "dataset.path=images", "dataset.channels=3", *settings,
        "micro_batch_size=4", "accum_steps=2", "epochs=1", cwd=tmp_path,
    )  # fmt: skip
    assert code == 2 and "Traceback" not in output, output
    assert first_error_line(output).startswith(expected), output
    assert not glob.glob(str(tmp_path / "outputs" / "*" / "*")), "the run directory stays"


def test_a_sweep_cannot_show_its_config(tmp_path):
    # Hydra refused the pair with a ValueError and a traceback.
    code, output = ga_train("-m", "accum_steps=1,2", "--cfg", "job", cwd=tmp_path)
    assert code == 2 and "Traceback" not in output, output
    assert first_error_line(output).startswith(
        "ga-train: -m cannot be combined with --cfg: Hydra shows the config"
    ), output
