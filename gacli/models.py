"""The models ``ga-train`` ships, as plain functions of the kind a user writes for ``_target_``.

Each takes the data's ``input_shape`` and ``num_outputs`` (and ``task``: ``"classification"``,
``"segmentation"`` or ``"regression"``), which ``ga-train`` fills in from the data, plus its own
keyword arguments, the keys of its file under ``configs/model/``; it returns an uncompiled
functional ``keras.Model`` with logits outputs (linear outputs of the targets' width for
regression). ``configs/model/unet.yaml`` is ``_target_: gacli.models.unet`` and its arguments,
exactly as a user's own model file would be (docs/guides/own-model.md).

Keras is imported inside each function: ``ga-train`` reads these signatures to check a config's
arguments before TensorFlow loads.

Example:
    >>> model = unet((32, 32, 1), 1, depth=2, base_filters=4)  # doctest: +SKIP
"""

from gacli.errors import ConfigError

# BN moving statistics move once per optimizer update under batchnorm=accumulate, as they would with
# one big batch: short runs have few updates, so these models use 0.9 rather than Keras' 0.99
# (0.99**60 leaves half of the initial statistics after 60 updates; 0.9**60 leaves 0.2%).
BN_MOMENTUM = 0.9


def _head(x, num_outputs, task):
    import keras

    if task == "segmentation":
        return keras.layers.Conv2D(num_outputs, 1, name="logits", dtype="float32")(x)
    x = keras.layers.GlobalAveragePooling2D()(x) if len(x.shape) == 4 else x
    return keras.layers.Dense(num_outputs, name="logits", dtype="float32")(x)


def _conv_block(x, filters):
    import keras

    x = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
    x = keras.layers.BatchNormalization(momentum=BN_MOMENTUM)(x)
    return keras.layers.Activation("relu")(x)


def _require_image(input_shape, name):
    if not isinstance(input_shape, (tuple, list)) or len(input_shape) != 3:
        shown = input_shape if isinstance(input_shape, dict) else tuple(input_shape)
        raise ConfigError(
            f"model={name} needs images (height, width, channels) but the dataset gives inputs "
            f"of shape {shown}; use model=mlp, or an image dataset."
        )


def _refuse_named_inputs(input_shape, name):
    if isinstance(input_shape, dict):
        shapes = ", ".join(f"{key}: {tuple(dims)}" for key, dims in input_shape.items())
        raise ConfigError(
            f"model={name} takes one input tensor, but the dataset gives named inputs "
            f"{{{shapes}}}; build a model of your own for them (model._target_=my_pkg.nets.build: "
            "it gets input_shape as {name: shape}; docs/guides/own-model.md), or give the "
            "dataset one input tensor a sample."
        )


def mlp(input_shape, num_outputs, task="classification", hidden_units=(128, 64), dropout=0.0):
    """Flatten, then Dense + ReLU layers of ``hidden_units`` (each followed by Dropout of rate
    ``dropout`` where it is above 0), then the head."""
    import keras

    _refuse_named_inputs(input_shape, "mlp")
    if task == "segmentation":
        raise ConfigError("model=mlp classifies or regresses; for segmentation use model=unet.")
    inputs = keras.Input(tuple(input_shape))
    x = keras.layers.Flatten()(inputs)
    for units in hidden_units:
        x = keras.layers.Dense(units, activation="relu")(x)
        if dropout:
            x = keras.layers.Dropout(dropout)(x)
    return keras.Model(inputs, _head(x, num_outputs, task), name="mlp")


def cnn(input_shape, num_outputs, task="classification", filters=(16, 32)):
    """One convolution + BatchNormalization + ReLU block per entry of ``filters``, each followed
    by 2x2 max pooling while the image is at least 4 pixels high, then the head."""
    import keras

    _refuse_named_inputs(input_shape, "cnn")
    _require_image(input_shape, "cnn")
    inputs = keras.Input(tuple(input_shape))
    x = inputs
    for width in filters:
        x = _conv_block(x, width)
        if x.shape[1] >= 4 and task != "segmentation":
            x = keras.layers.MaxPooling2D()(x)
    return keras.Model(inputs, _head(x, num_outputs, task), name="cnn")


def unet(input_shape, num_outputs, task="segmentation", depth=3, base_filters=8):
    """A UNet of ``depth`` levels, ``base_filters`` wide at the top and doubling per level: two
    convolution blocks a level, max pooling down, transposed convolutions up, skip connections."""
    import keras

    _refuse_named_inputs(input_shape, "unet")
    _require_image(input_shape, "unet")
    factor = 2**depth
    if input_shape[0] % factor or input_shape[1] % factor:
        raise ConfigError(
            f"model=unet with model.depth={depth} halves the image {depth} times, so its "
            f"height and width must be multiples of {factor}; got {tuple(input_shape[:2])}. Use "
            f"dataset.image_size={max(factor, input_shape[0] // factor * factor)} or a smaller "
            "model.depth."
        )
    if task != "segmentation":
        raise ConfigError("model=unet segments images; use dataset=shapes or a mask dataset.")
    inputs = keras.Input(tuple(input_shape))
    x, skips = inputs, []
    for level in range(depth):
        width = base_filters * 2**level
        x = _conv_block(_conv_block(x, width), width)
        skips.append(x)
        x = keras.layers.MaxPooling2D()(x)
    x = _conv_block(x, base_filters * 2**depth)
    for level in reversed(range(depth)):
        width = base_filters * 2**level
        x = keras.layers.Conv2DTranspose(width, 2, strides=2, padding="same")(x)
        x = keras.layers.Concatenate()([x, skips[level]])
        x = _conv_block(_conv_block(x, width), width)
    return keras.Model(inputs, _head(x, num_outputs, task), name="unet")


def resnet(input_shape, num_outputs, task="classification", depth=3, base_filters=16):
    """A small ResNet: a stem block, then ``depth`` stages of one residual block each, the first
    ``base_filters`` wide and each next one twice as wide (stride 2 while the image allows)."""
    import keras

    _refuse_named_inputs(input_shape, "resnet")
    _require_image(input_shape, "resnet")
    if task == "segmentation":
        raise ConfigError("model=resnet classifies or regresses; for segmentation use model=unet.")
    layers = keras.layers
    inputs = keras.Input(tuple(input_shape))
    x = _conv_block(inputs, base_filters)
    for stage in range(depth):
        width = base_filters * 2**stage
        stride = 1 if stage == 0 or x.shape[1] < 4 else 2
        shortcut = x
        y = layers.Conv2D(width, 3, strides=stride, padding="same", use_bias=False)(x)
        y = layers.Activation("relu")(layers.BatchNormalization(momentum=BN_MOMENTUM)(y))
        y = layers.Conv2D(width, 3, padding="same", use_bias=False)(y)
        y = layers.BatchNormalization(momentum=BN_MOMENTUM)(y)
        if stride != 1 or shortcut.shape[-1] != width:
            shortcut = layers.Conv2D(width, 1, strides=stride, use_bias=False)(shortcut)
            shortcut = layers.BatchNormalization(momentum=BN_MOMENTUM)(shortcut)
        x = layers.Activation("relu")(layers.Add()([shortcut, y]))
    return keras.Model(inputs, _head(x, num_outputs, task), name="resnet")


def application(
    input_shape, num_outputs, task="classification", architecture="MobileNetV2", **arguments
):
    """Any ``keras.applications`` classifier by its name (``architecture``: ``ResNet50``,
    ``EfficientNetB0`` ...), built with ``weights=None`` (nothing is downloaded) and logits
    outputs; ``arguments`` go to it as they are (e.g. ``alpha=0.5`` for MobileNetV2)."""
    import keras

    _refuse_named_inputs(input_shape, architecture)
    builder = getattr(keras.applications, str(architecture), None)
    if not (str(architecture)[:1].isupper() and callable(builder)):
        names = [n for n in dir(keras.applications) if n[:1].isupper()]
        from difflib import get_close_matches

        near = get_close_matches(str(architecture), names, n=1)
        hint = f"did you mean model.architecture={near[0]}? " if near else ""
        raise ConfigError(
            f"model.architecture={architecture} is not a keras.applications model; {hint}"
            "Give one of its names, e.g. model.architecture=ResNet50, MobileNetV2 or "
            "EfficientNetB0."
        )
    if task != "classification":
        raise ConfigError(
            f"model.architecture={architecture} (keras.applications) classifies; for "
            "segmentation use model=unet."
        )
    try:
        return builder(
            weights=None,
            input_shape=tuple(input_shape),
            classes=num_outputs,
            classifier_activation=None,
            **arguments,
        )
    except ValueError as error:
        raise ConfigError(
            f"keras.applications.{architecture} cannot take inputs of shape "
            f"{tuple(input_shape)}: {error} Resize the images (dataset.image_size=..., "
            "dataset.channels=3) or pick a smaller model."
        ) from None
