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
