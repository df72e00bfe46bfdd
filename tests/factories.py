"""A user's own model functions, as `ga-train model._target_=factories.tiny_classifier` imports
them."""

import keras
from user_project.nets import Net


def tiny_classifier(input_shape, num_outputs, task):
    inputs = keras.Input(input_shape)
    x = keras.layers.Flatten()(inputs)
    return keras.Model(inputs, keras.layers.Dense(num_outputs)(x))


def subclassed_classifier(input_shape, num_outputs, task, width=16):
    return Net(num_outputs, width=width)


def wrong_outputs(input_shape, num_outputs, task):
    return Net(num_outputs + 1)
