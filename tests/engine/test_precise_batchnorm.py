"""Precise BN: moving statistics recomputed exactly, and no trace on training."""

import random

import keras
import numpy as np
import pytest
import tensorflow as tf

import gacli
from helpers import MEASURED, current_test, record

MICRO = 8


def bn_model(dropout=0.0, seed=0):
    """Two BN layers in a row (the second sees the first's batch-normalised output)."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6, 6, 2))
    x = keras.layers.Conv2D(4, 3, padding="same")(inputs)
    x = keras.layers.BatchNormalization(name="bn_1")(x)
    x = keras.layers.ReLU()(x)
    if dropout:
        x = keras.layers.Dropout(dropout, seed=seed)(x)
    x = keras.layers.Conv2D(3, 3)(x)
    x = keras.layers.BatchNormalization(name="bn_2")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return inputs, keras.layers.Dense(1)(x)


def images(num_samples, seed=0):
    rng = np.random.default_rng(seed)
    # Micro-batches with different means: the between-micro-batch variance must be pooled too.
    shift = np.repeat(np.arange(num_samples // MICRO + 1), MICRO)[:num_samples, None, None, None]
    x = rng.normal(size=(num_samples, 6, 6, 2)) + 2.0 * shift
    y = rng.normal(size=(num_samples, 1))
    return x.astype("float32"), y.astype("float32")


def test_statistics_are_the_exact_pooled_moments_of_each_bn_input():
    x, _ = images(30)  # 4 micro-batches of 8, the last one short (6 samples)
    model = keras.Model(*bn_model())
    bn_1, bn_2 = model.get_layer("bn_1"), model.get_layer("bn_2")
    probe_inputs = keras.Model(model.input, [bn_1.input, bn_2.input])
    # The reference: each BN layer's input in a training-mode forward pass (bn_1 normalising by
    # each micro-batch's own statistics), pooled over all samples in float64.
    seen = [probe_inputs(x[start : start + MICRO], training=True) for start in range(0, 30, MICRO)]
    for layer in (bn_1, bn_2):  # the reference pass moved them; the recompute must overwrite
        layer.moving_mean.assign(np.full(layer.moving_mean.shape, 5.0))
    samples = gacli.BatchNormStatistics(model).recompute(
        tf.data.Dataset.from_tensor_slices(x).batch(MICRO)
    )
    assert samples == 30
    differences = []
    for index, layer in enumerate((bn_1, bn_2)):
        pooled = np.concatenate([np.asarray(batch[index], "float64") for batch in seen])
        pooled = pooled.reshape(-1, pooled.shape[-1])
        differences += [
            np.max(np.abs(layer.moving_mean.numpy() - pooled.mean(0))),
            np.max(np.abs(layer.moving_variance.numpy() - pooled.var(0)) / pooled.var(0)),
        ]
    MEASURED.setdefault(current_test["id"] + " (mean, relative variance)", []).extend(differences)
    assert max(differences) < 1e-5, differences
    # The data make the between-micro-batch term matter: the mean of the micro-batch variances
    # (weighted by size), which the older way of pooling gives, is well below.
    variances = [np.asarray(batch[1], "float64").reshape(-1, 3).var(0) for batch in seen]
    within = np.average(variances, axis=0, weights=[len(batch[1]) for batch in seen])
    assert np.max(bn_2.moving_variance.numpy() / within) > 1.05


def train(with_precise_bn, epochs=2):
    """A BN + dropout model trained with accumulation; returns (model, history, callback)."""
    x, y = images(44)
    inputs, outputs = bn_model(dropout=0.3)
    model = gacli.GradientAccumulateModel(accum_steps=2, inputs=inputs, outputs=outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    callback = gacli.PreciseBatchNorm(x, micro_batches=3, batch_size=MICRO)
    history = model.fit(
        x,
        y,
        batch_size=MICRO,
        epochs=epochs,
        validation_data=(x[:16], y[:16]),
        callbacks=[callback] if with_precise_bn else [],
        verbose=0,
        shuffle=False,
    )
    return model, history.history, callback


def training_state(model):
    """Everything the training maths reads or writes, except the BN moving statistics."""
    state = [v.numpy() for v in model.trainable_variables]
    state += [v.numpy() for v in model.optimizer.variables]
    state += [np.asarray(model.micro_step.numpy()), np.asarray(model.optimizer_step.numpy())]
    state += [
        layer.seed_generator.state.numpy()
        for layer in model.layers
        if isinstance(layer, keras.layers.Dropout)
    ]
    return state


def test_precise_bn_leaves_no_trace_on_training_and_validation_sees_it():
    plain, plain_history, _ = train(with_precise_bn=False)
    precise, precise_history, callback = train(with_precise_bn=True)
    difference = max(
        float(np.max(np.abs(a - b))) for a, b in zip(training_state(plain), training_state(precise))
    )
    assert record(difference) == 0.0
    assert plain_history["loss"] == precise_history["loss"]
    moved = [model.get_layer("bn_1").moving_mean.numpy() for model in (precise, plain)]
    assert np.max(np.abs(moved[0] - moved[1])) > 0.05
    # Validation ran on the recomputed statistics: no update came after the last one, so
    # evaluating now gives the last epoch's val_loss; the plain model's differs.
    val_x, val_y = images(44)[0][:16], images(44)[1][:16]
    assert precise.evaluate(val_x, val_y, batch_size=MICRO, verbose=0) == pytest.approx(
        precise_history["val_loss"][-1], rel=1e-6
    )
    assert abs(plain_history["val_loss"][-1] - precise_history["val_loss"][-1]) > 1e-3
    # A recompute draws no random number anywhere, and gives the same statistics again.
    before = (np.random.get_state()[1].copy(), random.getstate(), training_state(precise))
    mean = precise.get_layer("bn_2").moving_mean.numpy()
    callback.recompute()
    assert np.array_equal(np.random.get_state()[1], before[0]) and random.getstate() == before[1]
    assert all(np.array_equal(a, b) for a, b in zip(training_state(precise), before[2]))
    np.testing.assert_array_equal(precise.get_layer("bn_2").moving_mean.numpy(), mean)


def test_frozen_layers_keep_their_statistics_and_policy_precise_changes_no_layer():
    x, _ = images(16)
    model = keras.Model(*bn_model())
    assert gacli.apply_batchnorm_policy(model, "precise", accum_steps=4) is model
    model.get_layer("bn_1").trainable = False
    frozen = model.get_layer("bn_1").moving_mean.numpy()
    gacli.BatchNormStatistics(model).recompute([x[:MICRO]])
    np.testing.assert_array_equal(model.get_layer("bn_1").moving_mean.numpy(), frozen)
    assert np.max(np.abs(model.get_layer("bn_2").moving_mean.numpy())) > 0.0


def test_bad_arguments_say_what_to_pass():
    x, _ = images(16)
    with pytest.raises(ValueError, match="micro_batches=0 must be a whole number >= 1"):
        gacli.PreciseBatchNorm(x, micro_batches=0, batch_size=MICRO)
    with pytest.raises(ValueError, match="without batch_size; pass the training micro-batch"):
        gacli.PreciseBatchNorm(x)

    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.norm = keras.layers.BatchNormalization()

        def call(self, inputs):
            return self.norm(inputs)

    with pytest.raises(ValueError, match="needs a functional or Sequential model"):
        gacli.BatchNormStatistics(Subclassed())
