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


class DefaultsNet(Net):
    """:class:`Net` with a default for every argument, and no get_config: Keras makes its config
    from those defaults (not the arguments it was built with), and cannot find its class when
    loading, as it is not registered."""

    def __init__(self, num_outputs=10, width=16, **kwargs):
        super().__init__(num_outputs, width, **kwargs)


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


def noisy(input_shape, num_outputs, width=16):
    """A functional classifier whose layers draw random numbers in training: Gaussian noise on its
    inputs, inside a Sequential of its own, and dropout after its hidden layer."""
    inputs = keras.Input(input_shape)
    front = keras.Sequential([keras.layers.Flatten(), keras.layers.GaussianNoise(0.5)])
    hidden = keras.layers.Dense(width, activation="relu")(front(inputs))
    outputs = keras.layers.Dense(num_outputs)(keras.layers.Dropout(0.3)(hidden))
    return keras.Model(inputs, outputs)


def frozen(num_outputs, width=16):
    """Wrong: a model none of whose weights trains (``trainable = False``)."""
    model = sequential(num_outputs, width)
    model.trainable = False
    return model


def weightless(num_outputs):
    """Wrong: a model with no weights at all (its outputs are the first pixels)."""
    return keras.Sequential(
        [keras.layers.Flatten(), keras.layers.Lambda(lambda x: x[:, :num_outputs])]
    )


def in_float16(num_outputs, width=16):
    """A model whose layers compute in float16 whatever policy it is built under."""
    return keras.Sequential(
        [
            keras.layers.Flatten(dtype="mixed_float16"),
            keras.layers.Dense(width, activation="relu", dtype="mixed_float16"),
            keras.layers.Dense(num_outputs, dtype="mixed_float16"),
        ]
    )


def accumulating(num_outputs, width=16):
    """Wrong: a model that accumulates already (ga-train wraps the plain one itself)."""
    import gacli

    return gacli.wrap_model(sequential(num_outputs, width), accum_steps=2)
