"""Data files ga-train cannot train on, as a hostile user hands them over: an .npz that is text,
holds no sample, is cut short, holds pickled objects, or holds a nan input or a label outside the
classes; a TFRecord file cut short, damaged, or whose records do not match dataset.features; image
files that do not decode, and image-folder settings that cannot work. Each ends with one
paragraph naming the file or sample and exit code 2 before training and no traceback, keeping
TensorFlow's own reason where it says what is wrong; a file cut cleanly at a record trains on what
it holds, and dataset.skip_bad_files=true trains without the images that do not decode.

Slow, all of it: each ga-train here loads TensorFlow to read the data (seconds apiece)."""

import glob

import numpy as np
import pytest

from helpers import assert_refused, first_error_line, ga_train

pytestmark = pytest.mark.slow


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


def _image_folder(root, classes=("cat", "dog"), per_class=12):
    from PIL import Image

    rng = np.random.default_rng(0)
    for name in classes:
        (root / name).mkdir(parents=True)
        for index in range(per_class):
            pixels = rng.integers(0, 255, (12, 12, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{index}.png")
    return root


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


@pytest.mark.parametrize("kind", sorted(DATA_CASES))
def test_bad_arrays_are_named_before_training(kind, tmp_path):
    code, output = ga_train(*npz_case(tmp_path, kind), cwd=tmp_path)
    assert_refused(code, output, DATA_CASES[kind], tmp_path)
    assert "allow_pickle" not in output  # numpy's advice would be the wrong one


def _with_two_bad_images(tmp_path):
    """An image folder of 24 PNG files and two that do not decode (one cut in half, one text);
    the arguments that train on it."""
    root = _image_folder(tmp_path / "images", classes=("cats", "dogs"))
    good = (root / "cats" / "0.png").read_bytes()
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


def test_images_that_do_not_decode_are_named_before_training(tmp_path):
    code, output = ga_train(*_with_two_bad_images(tmp_path), cwd=tmp_path)
    assert_refused(code, output, "2 of 26 images cannot be decoded", tmp_path)
    assert "cut.png (Invalid PNG data" in output and "fake.png (Unknown image file format" in output
    assert "dataset.skip_bad_files=true" in output


def test_skip_bad_files_trains_without_them(tmp_path):
    code, output = ga_train(
        *_with_two_bad_images(tmp_path),
        "dataset.skip_bad_files=true",
        "progress=plain",
        cwd=tmp_path,
    )
    assert code == 0, output
    assert "skipping 2 image(s) that cannot be decoded" in output, output
    # 24 readable images, a quarter for validation.
    assert "image_folder: 18 train / 6 val samples" in output, output


def test_a_damaged_tfrecord_file_is_named(tmp_path):
    good, bad = tmp_path / "a.tfrecord", tmp_path / "b.tfrecord"
    _write_tfrecord(good, 40)
    _write_tfrecord(bad, 40)
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
