"""Models of the user's own: a subclassed one (unbuilt when returned), an unbuilt Sequential, one
with named inputs, and two that a target must not be."""

import keras


class Net(keras.Model):
    """A subclassed classifier: its shapes are known once it is called.

    Args:
        num_outputs: classes (ga-train passes the data's where the config does not).
        width: the hidden layer's units.
    """

    def __init__(self, num_outputs, width=16, **kwargs):
        super().__init__(**kwargs)
        self.flatten = keras.layers.Flatten()
        self.hidden = keras.layers.Dense(width, activation="relu")
        self.head = keras.layers.Dense(num_outputs)

    def call(self, inputs):
        return self.head(self.hidden(self.flatten(inputs)))


def sequential(num_outputs, width=16):
    """An unbuilt Sequential model: no Input, so no shapes until it is called."""
    return keras.Sequential(
        [
            keras.layers.Flatten(),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(num_outputs),
        ]
    )


def two_inputs(input_shape, num_outputs):
    """A functional model of named inputs: ``input_shape`` is {name: shape}."""
    inputs = {name: keras.Input(shape, name=name) for name, shape in input_shape.items()}
    joined = keras.layers.Concatenate()([keras.layers.Flatten()(x) for x in inputs.values()])
    hidden = keras.layers.Dense(32, activation="relu")(joined)
    return keras.Model(inputs, keras.layers.Dense(num_outputs)(hidden))


def just_a_layer(width=4):
    """Wrong: a layer, not a model."""
    return keras.layers.Dense(width)


def broken(width):
    """Wrong: raises for the width it is given."""
    raise ValueError(f"width={width} is not a width this model can have")
