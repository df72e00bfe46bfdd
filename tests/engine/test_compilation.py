"""Contract rows X1 and X2: XLA and steps_per_execution, with the decision inside the graph."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import gacli
from helpers import (
    MICRO,
    K,
    accumulating_model,
    big_batch_reference,
    epoch_windows,
    make_data,
    max_weight_difference,
    mlp_layers,
)

# Also run on the oldest supported TensorFlow and Keras (scripts/ci_oldest.sh).
pytestmark = pytest.mark.exactness


@pytest.mark.parametrize("wrapper", ["model", "optimizer"])
@pytest.mark.parametrize(
    "compile_options", [{"jit_compile": True}, {"steps_per_execution": 4}], ids=["xla", "spe4"]
)
@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_x1_compiled_training_equals_big_batch(wrapper, compile_options, name):
    make_optimizer, tolerance = {
        "sgd": (lambda: keras.optimizers.SGD(0.1, momentum=0.9), 1e-6),
        "adam": (lambda: keras.optimizers.Adam(0.01), 1e-5),
    }[name]
    # The model wrapper is checked on ragged data; a plain model's fit() gives the optimizer
    # wrapper full windows (see test_c1_counters).
    samples = 70 if wrapper == "model" else 128
    x, y = make_data(samples)
    reference = big_batch_reference(make_optimizer, epoch_windows(samples, MICRO * K, 3), x, y)
    model = accumulating_model(make_optimizer, wrapper)
    model.compile(optimizer=model.optimizer, loss="mse", **compile_options)
    model.fit(x, y, batch_size=MICRO, epochs=3, shuffle=False, verbose=0)
    assert int(gacli.find_accumulating_optimizer(model.optimizer).optimizer_step.numpy()) == 6
    assert max_weight_difference(model, reference) <= tolerance


@pytest.mark.parametrize("jit_compile", [False, True])
def test_x2_one_trace_serves_accumulate_and_apply_steps(jit_compile):
    """The train function is traced once, yet some calls update and some only accumulate: the
    apply/accumulate decision is a graph conditional, not Python branching per micro-step."""

    class TraceCountingModel(gacli.GradientAccumulateModel):
        traces = 0

        def train_step(self, data):
            TraceCountingModel.traces += 1  # runs in Python only while tracing
            return super().train_step(data)

    x, y = make_data(128)
    inputs, outputs = mlp_layers()
    model = TraceCountingModel(accum_steps=K, inputs=inputs, outputs=outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=jit_compile)
    model.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0)
    assert TraceCountingModel.traces == 1
    assert int(model.micro_step.numpy()) == 16
    assert int(model.optimizer_step.numpy()) == 4


def test_x1_under_xla_the_accumulators_are_zero_after_each_update():
    """Under jit_compile the model wrapper compiles the window's update as an XLA computation
    of its own, which zeroes the accumulators it has just read: after whole windows every
    accumulator is zero, and one micro-batch later (a window kept open over the end of fit)
    it holds that micro-batch's gradient, not the last window's plus it."""
    x, y = make_data(MICRO * (K + 1))
    inputs, outputs = mlp_layers()
    model = gacli.GradientAccumulateModel(
        accum_steps=K, partial_window="carry", inputs=inputs, outputs=outputs
    )
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=True)
    model.fit(x[: MICRO * K], y[: MICRO * K], batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
    accumulator = gacli.find_accumulating_optimizer(model.optimizer)
    assert accumulator.update_compiled_apart
    assert int(accumulator.optimizer_step.numpy()) == 1
    assert all(not a.numpy().any() for a in accumulator._window.accumulators)
    with accumulator.fit_continues():
        model.fit(x[MICRO * K :], y[MICRO * K :], batch_size=MICRO, shuffle=False, verbose=0)
    with tf.GradientTape() as tape:
        predictions = model(x[MICRO * K :], training=True)
        loss = tf.reduce_mean(keras.losses.mean_squared_error(y[MICRO * K :], predictions))
    grads = tape.gradient(loss, model.trainable_variables)
    # The window holds the micro-batch's gradient times its sample count (normalised later).
    for accumulated, grad in zip(accumulator._window.accumulators, grads):
        np.testing.assert_allclose(accumulated.numpy(), MICRO * grad.numpy(), rtol=1e-5, atol=1e-7)
