"""Data files ga-train cannot train on, as a hostile user hands them over: an .npz that is text
or holds no sample, a TFRecord file cut short or whose records do not match dataset.features, and
image-folder settings that cannot work. Each ends with one paragraph and exit code 2 before
training and no traceback, keeping TensorFlow's own reason where it says what is wrong; a file
cut cleanly at a record trains on what it holds.

Slow, all of it: each ga-train here loads TensorFlow to read the data (seconds apiece)."""

import glob

import numpy as np
import pytest

from helpers import ga_train

pytestmark = pytest.mark.slow


def first_error_line(output):
    lines = [line for line in output.splitlines() if line.startswith("ga-train:")]
    return lines[0] if lines else output


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
