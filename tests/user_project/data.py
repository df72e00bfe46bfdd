"""Data of the user's own, from scikit-learn's bundled digits (no download)."""

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits


def _digits():
    digits = load_digits()
    return (digits.images / 16.0).astype("float32"), digits.target.astype("int32")


def weighted_digits(weighted_class=None, validation_share=0.2):
    """(train, validation) as tf.data.Datasets of unbatched ({"pixels", "row_sums"}, label,
    sample weight): every sample weighs 1, or with ``weighted_class`` only that class's do (the
    others weigh 0, so a model learns to predict that class alone)."""
    images, labels = _digits()
    weights = np.ones(len(labels), "float32")
    if weighted_class is not None:
        weights = (labels == weighted_class).astype("float32")
    inputs = {"pixels": images[..., None], "row_sums": images.sum(axis=2)}
    data = tf.data.Dataset.from_tensor_slices((inputs, labels, weights))
    held_out = int(len(labels) * validation_share)
    return data.skip(held_out), data.take(held_out)


def digit_arrays(scale=1.0):
    """(train, None) as NumPy arrays (x, y): ga-train holds out dataset.validation_split."""
    images, labels = _digits()
    return (images.astype("float64") * scale, labels), None


def broken(path):
    """Wrong: raises, as a loader whose file is missing would."""
    raise FileNotFoundError(f"no such file: {path}")


def mostly_padding(weighted=64, at_end=False):
    """(train, None) as NumPy arrays (x, y, sample_weight): digits of which only the first
    ``weighted`` (``at_end``: the last) weigh 1 and every other weighs 0, as a corpus of mostly
    padding would."""
    images, labels = _digits()
    weights = (np.arange(len(labels)) < weighted).astype("float32")
    return (images[..., None], labels, weights[::-1] if at_end else weights), None


def grid_targets():
    """(train, None) as arrays whose regression targets are a 2x3 grid a sample, not flat."""
    images, labels = _digits()
    grids = np.repeat(labels, 6).reshape(-1, 2, 3).astype("float32")
    return (images.reshape(len(images), -1), grids), None


def endless():
    """(train, None): a generator's tf.data.Dataset that never ends, of unknown size."""

    def digits_forever():
        images, labels = _digits()
        while True:
            yield from zip(images, labels)

    train = tf.data.Dataset.from_generator(
        digits_forever,
        output_signature=(tf.TensorSpec((8, 8), tf.float32), tf.TensorSpec((), tf.int32)),
    )
    return train, None
