"""The model registry of ``ga-train``: a name, a builder, a clear error for anything else.

Every builder takes ``(input_shape, num_outputs, task, cfg)`` and returns an uncompiled functional
``keras.Model`` with logits outputs (for regression, linear outputs of the targets' width).
The user's own model is ``model._target_=package.module.callable`` (``model=own``, built by
:mod:`gacli.runner.targets`), or the older ``model.factory=package.module:function``; any
``keras.applications`` name works with ``weights=None``.
"""

import importlib

import keras

from gacli.runner import targets
from gacli.runner.config import ConfigError, is_own

# BN moving statistics move once per optimizer update under batchnorm=accumulate, as they would with
# one big batch: short runs have few updates, so the registry's models use 0.9 rather than Keras'
# 0.99 (0.99**60 leaves half of the initial statistics after 60 updates; 0.9**60 leaves 0.2%).
_BN_MOMENTUM = 0.9


def _head(x, num_outputs, task):
    if task == "segmentation":
        return keras.layers.Conv2D(num_outputs, 1, name="logits", dtype="float32")(x)
    x = keras.layers.GlobalAveragePooling2D()(x) if len(x.shape) == 4 else x
    return keras.layers.Dense(num_outputs, name="logits", dtype="float32")(x)


def mlp(input_shape, num_outputs, task, cfg):
    if task == "segmentation":
        raise ConfigError("model=mlp classifies or regresses; for segmentation use model=unet.")
    inputs = keras.Input(input_shape)
    x = keras.layers.Flatten()(inputs)
    for units in cfg.hidden_units:
        x = keras.layers.Dense(units, activation="relu")(x)
        if cfg.dropout:
            x = keras.layers.Dropout(cfg.dropout)(x)
    return keras.Model(inputs, _head(x, num_outputs, task), name="mlp")


def _conv_block(x, filters):
    x = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
    x = keras.layers.BatchNormalization(momentum=_BN_MOMENTUM)(x)
    return keras.layers.Activation("relu")(x)


def _require_image(input_shape, name):
    if len(input_shape) != 3:
        raise ConfigError(
            f"model={name} needs images (height, width, channels) but the dataset gives inputs "
            f"of shape {tuple(input_shape)}; use model=mlp, or an image dataset."
        )


def cnn(input_shape, num_outputs, task, cfg):
    _require_image(input_shape, "cnn")
    inputs = keras.Input(input_shape)
    x = inputs
    for filters in cfg.filters:
        x = _conv_block(x, filters)
        if x.shape[1] >= 4 and task != "segmentation":
            x = keras.layers.MaxPooling2D()(x)
    return keras.Model(inputs, _head(x, num_outputs, task), name="cnn")


def unet(input_shape, num_outputs, task, cfg):
    _require_image(input_shape, "unet")
    factor = 2**cfg.depth
    if input_shape[0] % factor or input_shape[1] % factor:
        raise ConfigError(
            f"model=unet with model.depth={cfg.depth} halves the image {cfg.depth} times, so its "
            f"height and width must be multiples of {factor}; got {input_shape[:2]}. Use "
            f"dataset.image_size={max(factor, input_shape[0] // factor * factor)} or a smaller "
            "model.depth."
        )
    if task != "segmentation":
        raise ConfigError("model=unet segments images; use dataset=shapes or a mask dataset.")
    inputs = keras.Input(input_shape)
    x, skips = inputs, []
    for level in range(cfg.depth):
        filters = cfg.base_filters * 2**level
        x = _conv_block(_conv_block(x, filters), filters)
        skips.append(x)
        x = keras.layers.MaxPooling2D()(x)
    x = _conv_block(x, cfg.base_filters * 2**cfg.depth)
    for level in reversed(range(cfg.depth)):
        filters = cfg.base_filters * 2**level
        x = keras.layers.Conv2DTranspose(filters, 2, strides=2, padding="same")(x)
        x = keras.layers.Concatenate()([x, skips[level]])
        x = _conv_block(_conv_block(x, filters), filters)
    return keras.Model(inputs, _head(x, num_outputs, task), name="unet")


def resnet(input_shape, num_outputs, task, cfg):
    """A small ResNet: ``depth`` stages of one residual block, width doubling per stage."""
    _require_image(input_shape, "resnet")
    if task == "segmentation":
        raise ConfigError("model=resnet classifies or regresses; for segmentation use model=unet.")
    inputs = keras.Input(input_shape)
    x = _conv_block(inputs, cfg.base_filters)
    for stage in range(cfg.depth):
        filters = cfg.base_filters * 2**stage
        stride = 1 if stage == 0 or x.shape[1] < 4 else 2
        shortcut = x
        y = keras.layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False)(x)
        y = keras.layers.Activation("relu")(
            keras.layers.BatchNormalization(momentum=_BN_MOMENTUM)(y)
        )
        y = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(y)
        y = keras.layers.BatchNormalization(momentum=_BN_MOMENTUM)(y)
        if stride != 1 or shortcut.shape[-1] != filters:
            shortcut = keras.layers.Conv2D(filters, 1, strides=stride, use_bias=False)(shortcut)
            shortcut = keras.layers.BatchNormalization(momentum=_BN_MOMENTUM)(shortcut)
        x = keras.layers.Activation("relu")(keras.layers.Add()([shortcut, y]))
    return keras.Model(inputs, _head(x, num_outputs, task), name="resnet")


def application(input_shape, num_outputs, task, cfg):
    builder = getattr(keras.applications, cfg.name, None)
    if task != "classification":
        raise ConfigError(f"model={cfg.name} (keras.applications) classifies; use model=unet.")
    try:
        return builder(
            weights=None,
            input_shape=tuple(input_shape),
            classes=num_outputs,
            classifier_activation=None,
            **dict(cfg.kwargs),
        )
    except ValueError as error:
        raise ConfigError(
            f"keras.applications.{cfg.name} cannot take inputs of shape {tuple(input_shape)}: "
            f"{error} Resize the images (dataset.image_size=..., dataset.channels=3) or pick a "
            "smaller model."
        ) from None


def factory(input_shape, num_outputs, task, cfg):
    module_name, _, function_name = str(cfg.factory).partition(":")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as error:
        raise ConfigError(
            f"model.factory={cfg.factory} cannot be imported ({error}); it must name a function "
            "in an importable module, e.g. model.factory=mypkg.models:build_model."
        ) from None
    model = function(tuple(input_shape), num_outputs, task, **dict(cfg.kwargs))
    if not targets.MODEL.accepts(model):
        raise ConfigError(
            f"model.factory={cfg.factory} returned {targets.described(model)}, not "
            f"{targets.MODEL.what}; {targets.MODEL.instead}."
        )
    return model


REGISTRY = {"mlp": mlp, "cnn": cnn, "unet": unet, "resnet": resnet}


def build_model(cfg, input_shape, num_outputs, task):
    """The uncompiled model named by ``cfg`` for data of ``input_shape``."""
    if is_own(cfg):
        # input_shape: a tuple, or {input name: tuple} for data whose inputs are a dict.
        shape = (
            {name: tuple(dims) for name, dims in input_shape.items()}
            if isinstance(input_shape, dict)
            else tuple(input_shape)
        )
        fill = {"input_shape": shape, "num_outputs": num_outputs, "task": task}
        return targets.build("model", targets.own_arguments(cfg, "model"), targets.MODEL, fill)
    if isinstance(input_shape, dict):
        shapes = ", ".join(f"{name}: {tuple(dims)}" for name, dims in input_shape.items())
        chosen = f"model.factory={cfg.factory}" if cfg.factory else f"model={cfg.name}"
        raise ConfigError(
            f"{chosen} takes one input tensor, but the dataset gives named "
            f"inputs {{{shapes}}}; build a model of your own for them (model._target_=my_pkg."
            "nets.build: it gets input_shape as {name: shape}; docs/guides/own-model.md), or "
            "give the dataset one input tensor a sample."
        )
    if cfg.factory:
        return factory(input_shape, num_outputs, task, cfg)
    builder = REGISTRY.get(cfg.name)
    if builder is not None:
        return builder(input_shape, num_outputs, task, cfg)
    if cfg.name[:1].isupper() and callable(getattr(keras.applications, cfg.name, None)):
        return application(input_shape, num_outputs, task, cfg)
    raise ConfigError(
        f"model.name={cfg.name} is not a known model; use one of {', '.join(sorted(REGISTRY))}, "
        "a keras.applications name (e.g. model=application model.name=MobileNetV2), or your own "
        "with model=factory model.factory=package.module:function."
    )
