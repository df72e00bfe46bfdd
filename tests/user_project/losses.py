"""Losses of the user's own."""

import keras
from keras import ops


class LabelsOnly(keras.losses.Loss):
    """Wrong: a loss of the labels alone, which no weight of the model reaches."""

    def call(self, y_true, y_pred):
        return ops.ones_like(ops.cast(ops.reshape(y_true, (-1,)), "float32"))


def sparse_cross_entropy(y_true, y_pred, scale=1.0):
    """A loss function of (y_true, y_pred), as Keras takes one: cross-entropy of logits against
    class labels, times ``scale``."""
    return scale * keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)
