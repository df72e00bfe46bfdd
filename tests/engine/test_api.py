"""The library face: gradient-accumulator's names and arguments, wrap_model, AGC, clear errors."""

import subprocess
import sys

import keras
import numpy as np
import pytest

import gacli
from helpers import (
    agc_big_batch_reference,
    big_batch_reference,
    epoch_windows,
    make_data,
    max_weight_difference,
    mlp_layers,
    plain_model,
)

# Also run on the oldest supported TensorFlow and Keras (scripts/ci_oldest.sh).
pytestmark = pytest.mark.exactness


class SubclassedMLP(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(1)

    def call(self, inputs):
        return self.out(self.hidden(inputs))


def sequential_mlp(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)]
    )


def subclassed_mlp(seed=0):
    keras.utils.set_random_seed(seed)
    model = SubclassedMLP()
    model(np.zeros((1, 4), "float32"))
    return model


@pytest.mark.parametrize("kind", ["functional", "sequential", "subclassed"])
def test_wrap_model_trains_the_same_weights_exactly(kind):
    """wrap_model keeps the model's own weights (no copy, no re-init) and trains them exactly."""
    build = {"functional": plain_model, "sequential": sequential_mlp, "subclassed": subclassed_mlp}[
        kind
    ]
    x, y = make_data(70)
    original = build()
    initial = original.get_weights()
    model = gacli.wrap_model(original, accum_steps=4)
    assert model.count_params() == original.count_params()
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)

    reference = build()
    reference.set_weights(initial)
    reference.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    for window in epoch_windows(70, 64, 2):
        reference.train_on_batch(x[window], y[window])
    assert max_weight_difference(original, reference) <= 1e-6  # original's variables trained


def test_gradient_accumulator_arguments_are_accepted():
    inputs, outputs = mlp_layers()
    model = gacli.GradientAccumulateModel(
        accum_steps=4,
        mixed_precision=False,
        use_agc=True,
        clip_factor=0.02,
        eps=1e-3,
        experimental_distributed_support=True,
        inputs=inputs,
        outputs=outputs,
    )
    assert (model.accum_steps, model.use_agc, model.clip_factor) == (4, True, 0.02)
    optimizer = gacli.GradientAccumulateOptimizer(
        optimizer="SGD",
        accum_steps=4,
        reduction="MEAN",
        use_agc=False,
        mixed_precision=False,
        name="GradientAccumulateOptimizer",
        dtype="float32",
    )
    assert isinstance(optimizer.inner_optimizer, keras.optimizers.SGD)
    assert optimizer.reduction.value == "mean"
    # Keras' own keywords beside them: keras.Model's, an optimizer's clipping, a layer's.
    model = gacli.GradientAccumulateModel(
        2, inputs=inputs, outputs=outputs, name="frozen", trainable=False, reduction="sum"
    )
    assert (model.name, model.trainable, model.reduction.value) == ("frozen", False, "sum")
    wrapped = gacli.wrap_model(subclassed_mlp(), accum_steps=2, loss_scaling=False)
    assert wrapped.accum_steps == 2 and wrapped.loss_scaling is False
    optimizer = gacli.GradientAccumulateOptimizer("sgd", accum_steps=2, clipnorm=1.0, name="ga")
    assert optimizer.inner_optimizer.clipnorm == 1.0 and optimizer.name == "ga"
    layer = gacli.AccumBatchNormalization(
        accum_steps=2, momentum=0.9, epsilon=1e-3, trainable=False, name="bn"
    )
    assert (layer.momentum, layer.trainable, layer.name) == (0.9, False, "bn")


@pytest.mark.parametrize("wrapper", ["model", "optimizer"])
def test_agc_acts_once_on_the_accumulated_gradient(wrapper):
    """use_agc with k micro-batches equals AGC on the one big-batch gradient, clipped in NumPy."""
    x, y = make_data(128)
    reference = agc_big_batch_reference(
        lambda: keras.optimizers.SGD(0.5), epoch_windows(128, 64, 2), x, y, clip_factor=0.01
    )
    if wrapper == "model":
        inputs, outputs = mlp_layers()
        model = gacli.GradientAccumulateModel(
            accum_steps=4, use_agc=True, clip_factor=0.01, inputs=inputs, outputs=outputs
        )
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    else:
        model = plain_model()
        model.compile(
            optimizer=gacli.GradientAccumulateOptimizer(
                keras.optimizers.SGD(0.5), accum_steps=4, use_agc=True, clip_factor=0.01
            ),
            loss="mse",
        )
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert max_weight_difference(model, reference) <= 1e-6
    # Clipping was active: without AGC the weights end elsewhere.
    unclipped = big_batch_reference(
        lambda: keras.optimizers.SGD(0.5), epoch_windows(128, 64, 2), x, y
    )
    assert max_weight_difference(model, unclipped) > 1e-3


def test_reduction_sum_adds_micro_batch_gradients():
    """reduction="sum" with SGD(lr) and k equal micro-batches is SGD(k * lr) on the big batch."""
    x, y = make_data(128)
    reference = big_batch_reference(
        lambda: keras.optimizers.SGD(0.4), epoch_windows(128, 64, 1), x, y
    )
    model = plain_model()
    model.compile(
        optimizer=gacli.GradientAccumulateOptimizer(
            keras.optimizers.SGD(0.1), accum_steps=4, reduction="sum"
        ),
        loss="mse",
    )
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert max_weight_difference(model, reference) <= 1e-6


def mixed_precision_model_without_policy():
    inputs, outputs = mlp_layers()
    return gacli.GradientAccumulateModel(
        accum_steps=2, mixed_precision=True, inputs=inputs, outputs=outputs
    )


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: gacli.GradientAccumulateOptimizer("adam", accum_steps=0),
            "accum_steps=0 must be >= 1",
        ),
        (lambda: gacli.GradientAccumulateOptimizer("adam", accum_steps=2.5), "whole number"),
        (
            lambda: gacli.GradientAccumulateOptimizer("adam", partial_window="later"),
            "partial_window='later'",
        ),
        (
            lambda: gacli.GradientAccumulateOptimizer("adam", weight_decay=0.1),
            "belong to the inner optimizer",
        ),
        (
            lambda: gacli.GradientAccumulateOptimizer("adam", mixed_precision=True),
            "set_global_policy('mixed_float16')",
        ),
        (
            lambda: gacli.GradientAccumulateOptimizer(gacli.GradientAccumulateOptimizer("sgd")),
            "cannot wrap another",
        ),
        (
            lambda: gacli.GradientAccumulateOptimizer(
                keras.optimizers.SGD(gradient_accumulation_steps=2)
            ),
            "already accumulates",
        ),
        (lambda: mixed_precision_model_without_policy(), "mixed_float16"),
    ],
)
def test_bad_arguments_say_what_to_pass(make, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make()


def compiled_mlp():
    model = plain_model()
    model.compile(optimizer="sgd", loss="mse")
    return model


@pytest.mark.parametrize(
    "make, misspelt, nearest",
    [
        (
            lambda **given: gacli.wrap_model(plain_model(), accum_steps=2, **given),
            "mixed_precission",
            "mixed_precision",
        ),
        (
            lambda **given: gacli.wrap_model(subclassed_mlp(), accum_steps=2, **given),
            "partial_windows",
            "partial_window",
        ),
        (
            lambda **given: gacli.GradientAccumulateModel(
                accum_steps=2, inputs=mlp_layers()[0], outputs=mlp_layers()[1], **given
            ),
            "trainabel",
            "trainable",
        ),
        (
            lambda **given: gacli.GradientAccumulateOptimizer("sgd", **given),
            "accum_step",
            "accum_steps",
        ),
        (
            lambda **given: gacli.AccumBatchNormalization(accum_steps=2, **given),
            "momentun",
            "momentum",
        ),
        (
            lambda **given: gacli.check_equivalence(compiled_mlp(), None, None, **given),
            "micro_batch",
            "micro_batch_size",
        ),
        (
            lambda **given: gacli.AccumulationConfig().replace(**given),
            "reducton",
            "reduction",
        ),
    ],
    ids=[
        "wrap_model",
        "wrap_model-subclassed",
        "GradientAccumulateModel",
        "GradientAccumulateOptimizer",
        "AccumBatchNormalization",
        "check_equivalence",
        "AccumulationConfig.replace",
    ],
)
def test_a_misspelt_keyword_is_refused_with_the_nearest_name(make, misspelt, nearest):
    """Keras' functional Model passes over a keyword it does not know: a misspelt setting given
    to a model wrapper would do nothing. Every entry point that takes ``**kwargs`` refuses it as
    Python refuses an unknown keyword, naming the nearest accepted one and listing them."""
    with pytest.raises(TypeError) as error:
        make(**{misspelt: 2})
    message = str(error.value)
    assert f"unexpected keyword argument {misspelt!r} (did you mean {nearest!r}?)" in message
    accepted = message.split(". It takes ")[1].rstrip(".").split(", ")
    assert nearest in accepted and misspelt not in accepted


def test_model_and_optimizer_accum_steps_must_agree():
    inputs, outputs = mlp_layers()
    model = gacli.GradientAccumulateModel(accum_steps=4, inputs=inputs, outputs=outputs)
    with pytest.raises(ValueError, match="pass the plain optimizer"):
        model.compile(optimizer=gacli.GradientAccumulateOptimizer("sgd", accum_steps=2), loss="mse")


def test_import_gacli_does_not_import_tensorflow():
    code = "import sys, gacli; print('tensorflow' in sys.modules, gacli.__version__)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.split()[0] == "False"
