"""ga-train under bad input: each case ends in one paragraph that names the file, key or sample,
exit code 2, no traceback, nothing trained, and no run directory left behind."""

import glob
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers import ga_train, run_dir_of


def assert_refused(code, output, first_line, tmp_path):
    assert code == 2, output
    assert "Traceback" not in output, output
    assert first_line in output, output
    # A run that stops on its input leaves nothing resume= could take for an unfinished run.
    outputs = tmp_path / "outputs"
    assert not outputs.exists() or not any(outputs.rglob("*.yaml")), list(outputs.rglob("*"))


YAML_CASES = {
    "syntax.yaml": (
        "defaults: [/train, _self_]\naccum_steps: [1\n",
        "ga-train: ./syntax.yaml:2:14: not valid YAML (while parsing a flow sequence",
    ),
    "tab.yaml": (
        "defaults: [/train, _self_]\n\tepochs: 2\n",
        "ga-train: ./tab.yaml:2:1: not valid",
    ),
    "empty.yaml": (
        "",
        "ga-train: config=./empty.yaml is empty; a ga-train config starts from "
        "gacli's defaults with these lines:\ndefaults:\n  - /train\n  - _self_",
    ),
    "nodefaults.yaml": (
        "accum_steps: 2\n",
        "ga-train: config=./nodefaults.yaml does not start from gacli's defaults",
    ),
    "unknown.yaml": (
        "defaults: [/train, _self_]\noptimizer:\n  learnig_rate: 0.1\n",
        "ga-train: config=./unknown.yaml: optimizer.learnig_rate is not a key "
        "ga-train reads, so setting it would change nothing; did you mean "
        "optimizer.learning_rate?",
    ),
    # Two batch keys set, the default job's accum_steps: 4 left in place.
    "no_null.yaml": (
        "defaults: [/train, _self_]\nmicro_batch_size: 16\neffective_batch_size: 256\n",
        "Set the one to derive to null in your YAML, e.g. accum_steps: null (then "
        "accum_steps = 16)",
    ),
    "group_by_name.yaml": (
        "defaults: [/train, _self_]\ndataset: {name: image_folder}\n",
        "'- override /dataset: image_folder' to the defaults list",
    ),
}


@pytest.mark.parametrize("name", sorted(YAML_CASES))
def test_a_users_yaml_is_checked_before_composition(name, tmp_path):
    content, first_line = YAML_CASES[name]
    (tmp_path / name).write_text(content)
    code, output = ga_train(f"config=./{name}", cwd=tmp_path)
    assert_refused(code, output, first_line, tmp_path)


OVERRIDE_CASES = [
    (["+foo=1"], "ga-train: +foo=1: foo is not a key ga-train reads"),
    (["+model.widht=3"], "ga-train: model.widht is not a key ga-train reads with model=mlp"),
    (
        ["acum_steps=4"],
        "ga-train: acum_steps=4: acum_steps is not a key ga-train reads, so "
        "setting it would change nothing; did you mean accum_steps?",
    ),
    # Hydra's own composition errors are input errors too: exit code 2.
    (["accum_steps=abc"], "Value 'abc' of type 'str' could not be converted to Integer"),
    (["model=transformerz"], "Could not find 'model/transformerz'"),
]


@pytest.mark.parametrize(
    "arguments, first_line", OVERRIDE_CASES, ids=[case[0][0] for case in OVERRIDE_CASES]
)
def test_keys_nothing_reads_are_refused(arguments, first_line, tmp_path):
    code, output = ga_train(*arguments, cwd=tmp_path)
    assert_refused(code, output, first_line, tmp_path)


def test_free_form_keys_stay_open(tmp_path):
    # A model of one's own takes any argument (its signature is checked when it is called).
    code, output = ga_train(
        "--cfg", "job", "model._target_=my_pkg.nets.Net", "model.width=3", cwd=tmp_path
    )
    assert code == 0 and "width: 3" in output, output


def test_a_shipped_recipe_name_says_which_file_it_took(tmp_path):
    (tmp_path / "unet.yaml").write_text("defaults: [/train, _self_]\nepochs: 1\n")
    code, output = ga_train("config=unet.yaml", "--cfg", "job", cwd=tmp_path)
    assert code == 0 and "config=./unet.yaml takes the file" in output, output
    code, output = ga_train("config=./unet.yaml", "--cfg", "job", cwd=tmp_path)
    assert code == 0 and "epochs: 1" in output and "takes the file" not in output, output


def write_npz(path, **arrays):
    np.savez(path, **arrays)
    return str(path)


def digits_like(samples=60, seed=0):
    rng = np.random.default_rng(seed)
    return rng.random((samples, 8, 8, 1)).astype("float32"), rng.integers(0, 3, samples)


def npz_case(tmp_path, kind):
    x, y = digits_like()
    path = tmp_path / "train.npz"
    if kind == "nan-pixel":
        x[17, 3, 4, 0] = np.nan
    if kind == "negative-label":
        y[23] = -1
    if kind == "label-over-num-classes":
        y[5] = 7
    write_npz(path, x=x, y=y)
    if kind == "garbage":
        path.write_bytes(b"this is not an npz file at all" * 10)
    if kind == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    if kind == "pickled":
        np.savez(path, x=np.array([object(), object()], dtype=object), y=y[:2])
    return ["dataset=npz", f"dataset.path={path}", "model=mlp"] + (
        ["dataset.num_classes=3"] if kind == "label-over-num-classes" else []
    )


DATA_CASES = {
    "nan-pixel": "ga-train: train.npz: the inputs of 1 sample (the first: row 17) hold inf or nan",
    "negative-label": "ga-train: train.npz: the labels of 1 sample (the first: row 23) lie "
    "outside 0 .. 2 (the first is -1)",
    "label-over-num-classes": "ga-train: train.npz: the labels of 1 sample (the first: row 5) lie "
    "outside 0 .. 2 (the first is 7); set dataset.num_classes",
    "garbage": "is not a readable .npz file",
    "truncated": "is not a readable .npz file",
    "pickled": "it holds pickled Python objects, which are not loaded for safety",
}


# Marked slow below: those ga-train runs load TensorFlow to read the data or to set up training
# before they answer (seconds apiece).
@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(DATA_CASES))
def test_bad_arrays_are_named_before_training(kind, tmp_path):
    code, output = ga_train(*npz_case(tmp_path, kind), cwd=tmp_path)
    assert_refused(code, output, DATA_CASES[kind], tmp_path)
    assert "allow_pickle" not in output  # numpy's advice would be the wrong one


@pytest.mark.slow
def test_a_micro_batch_larger_than_the_data_is_refused(tmp_path):
    """Refused from the data's size, before the model is built: the message, and no run directory
    named (the refusal removes the one Hydra made) nor left behind."""
    code, output = ga_train("micro_batch_size=5000", "accum_steps=1", cwd=tmp_path)
    assert_refused(
        code,
        output,
        "ga-train: micro_batch_size = 5000 is larger than the training "
        "set, which holds 1438 samples",
        tmp_path,
    )
    assert "run directory:" not in output, output
    assert not glob.glob(str(tmp_path / "outputs" / "*" / "*")), "the run's directory is removed"
    code, output = ga_train("micro_batch_size=500", "accum_steps=4", cwd=tmp_path)
    assert_refused(
        code,
        output,
        "ga-train: effective_batch_size = 2000 is larger than the "
        "training set, which holds 1438 samples (dataset digits, after "
        "validation_split=0.2): every update would see 1438 samples, not "
        "2000. Use accum_steps=2 (effective batch 1000) or fewer",
        tmp_path,
    )


def image_folder(tmp_path, bad=True):
    import tensorflow as tf

    rng = np.random.default_rng(0)
    root = tmp_path / "images"
    for label in ("cats", "dogs"):
        (root / label).mkdir(parents=True)
        for index in range(12):
            pixels = rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)
            (root / label / f"{index:02d}.png").write_bytes(tf.io.encode_png(pixels).numpy())
    if bad:
        good = (root / "cats" / "00.png").read_bytes()
        (root / "cats" / "cut.png").write_bytes(good[: len(good) // 2])
        (root / "dogs" / "fake.png").write_text("not an image")
    return [
        "dataset=image_folder",
        f"dataset.path={root}",
        "model=mlp",
        "dataset.image_size=16",
        "dataset.validation_split=0.25",
        "micro_batch_size=4",
        "epochs=1",
    ]


@pytest.mark.slow
def test_images_that_do_not_decode_are_named_before_training(tmp_path):
    code, output = ga_train(*image_folder(tmp_path), cwd=tmp_path)
    assert_refused(code, output, "2 of 26 images cannot be decoded", tmp_path)
    assert "cut.png (Invalid PNG data" in output and "fake.png (Unknown image file format" in output
    assert "dataset.skip_bad_files=true" in output


@pytest.mark.slow
def test_skip_bad_files_trains_without_them(tmp_path):
    code, output = ga_train(
        *image_folder(tmp_path), "dataset.skip_bad_files=true", "progress=plain", cwd=tmp_path
    )
    assert code == 0, output
    assert "skipping 2 image(s) that cannot be decoded" in output, output
    # 24 readable images, a quarter for validation.
    assert "image_folder: 18 train / 6 val samples" in output, output


def tfrecord_file(path, records=40):
    import tensorflow as tf

    rng = np.random.default_rng(0)
    with tf.io.TFRecordWriter(str(path)) as writer:
        for _ in range(records):
            feature = {
                "image": tf.train.Feature(float_list=tf.train.FloatList(value=rng.random(16))),
                "label": tf.train.Feature(
                    int64_list=tf.train.Int64List(value=[int(rng.integers(0, 3))])
                ),
            }
            example = tf.train.Example(features=tf.train.Features(feature=feature))
            writer.write(example.SerializeToString())


@pytest.mark.slow
def test_a_damaged_tfrecord_file_is_named(tmp_path):
    good, bad = tmp_path / "a.tfrecord", tmp_path / "b.tfrecord"
    tfrecord_file(good)
    tfrecord_file(bad)
    content = bytearray(bad.read_bytes())
    content[len(content) // 2] ^= 0xFF
    bad.write_bytes(bytes(content))
    arguments = [
        "dataset=tfrecord",
        f"dataset.path={tmp_path}/*.tfrecord",
        "model=mlp",
        "dataset.features.image={shape:[16],dtype:float32}",
    ]
    code, output = ga_train(*arguments, cwd=tmp_path)
    assert_refused(code, output, f"ga-train: {bad} is damaged after its first", tmp_path)


@pytest.mark.slow
def test_an_unwritable_checkpoint_folder_is_found_at_start(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").write_text("a file where the folder should be")
    code, output = ga_train(f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert code == 2 and "Traceback" not in output, output
    assert f"the checkpoint folder {run_dir}/checkpoints cannot be written" in output, output
    assert not (run_dir / "tensorboard").exists()  # found before training, not at the first save
    assert (run_dir / "checkpoints").read_text() == "a file where the folder should be"


@pytest.mark.slow
def test_a_second_run_on_a_held_directory_is_refused(tmp_path):
    command = [
        os.path.join(os.path.dirname(sys.executable), "ga-train"),
        "epochs=4",
        "progress=plain",
        "hydra.run.dir=shared",
    ]
    first = subprocess.Popen(
        command,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
    )
    lock = tmp_path / "shared" / ".gacli.lock"
    deadline = time.time() + 120
    while not (lock.exists() and lock.read_text()):
        assert first.poll() is None and time.time() < deadline
        time.sleep(0.05)
    hydra_record = tmp_path / "shared" / ".hydra" / "overrides.yaml"
    while not (hydra_record.exists() and hydra_record.read_text()):  # created, then written
        assert first.poll() is None and time.time() < deadline
        time.sleep(0.05)
    recorded = hydra_record.read_text()
    code, output = ga_train("epochs=1", "hydra.run.dir=shared", cwd=tmp_path)
    assert code == 2 and "Traceback" not in output, output
    assert f"shared is in use by another run: ga-train, pid {first.pid}" in output, output
    first_output = first.communicate(timeout=300)[0]
    assert first.returncode == 0, first_output
    # The refused run wrote nothing: not Hydra's record of the job, not a result.
    assert hydra_record.read_text() == recorded
    assert run_dir_of(first_output).endswith("shared")


def test_bad_input_never_removes_a_directory_that_holds_something_else(tmp_path):
    # A folder of the user's is now refused as a run directory before anything else is checked
    # (test_run_directories.py), so the bad data path is never reached; the folder stays whole.
    existing = tmp_path / "mine"
    existing.mkdir()
    (existing / "notes.txt").write_text("the user's own file")
    code, output = ga_train(
        "dataset=npz",
        f"dataset.path={tmp_path}/missing.npz",
        f"hydra.run.dir={existing}",
        cwd=tmp_path,
    )
    assert code == 2 and "already holds files that ga-train did not write (notes.txt)" in output
    assert os.listdir(existing) == ["notes.txt"]
    assert (existing / "notes.txt").read_text() == "the user's own file"


def test_a_sweep_never_writes_into_another_sweeps_directory(tmp_path):
    (tmp_path / "sweep" / "0_accum_steps=1").mkdir(parents=True)
    (tmp_path / "sweep" / "0_accum_steps=1" / "result.json").write_text("{}")
    code, output = ga_train("-m", "accum_steps=1,2", "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert code == 2 and "Traceback" not in output, output
    assert "hydra.sweep.dir=sweep already holds a sweep's runs" in output, output
    assert os.listdir(tmp_path / "sweep" / "0_accum_steps=1") == ["result.json"]
