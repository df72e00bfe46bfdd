"""A user's own model factory, as `ga-train model.factory=factories:tiny_classifier` imports it."""

import keras


def tiny_classifier(input_shape, num_outputs, task):
    inputs = keras.Input(input_shape)
    x = keras.layers.Flatten()(inputs)
    return keras.Model(inputs, keras.layers.Dense(num_outputs)(x))


class Net(keras.Model):
    """A subclassed model, unbuilt when returned: its shapes are known once it is called."""

    def __init__(self, num_outputs, width=16, **kwargs):
        super().__init__(**kwargs)
        self.flatten = keras.layers.Flatten()
        self.hidden = keras.layers.Dense(width, activation="relu")
        self.head = keras.layers.Dense(num_outputs)

    def call(self, inputs):
        return self.head(self.hidden(self.flatten(inputs)))


def subclassed_classifier(input_shape, num_outputs, task, width=16):
    return Net(num_outputs, width=width)


def wrong_outputs(input_shape, num_outputs, task):
    return Net(num_outputs + 1)
