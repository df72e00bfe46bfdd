"""The engine keeps what a window needs in variables and one settings object, never in attributes
learnt while tracing: a restore, a retrace or a second fit() cannot change the maths. One test per
piece of state that used to be hidden (the multi-replica restored case is in
test_distribution.py), and the settings object shared by every wrapper."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import gacli
from gacli.engine.accumulate_model import AccumulatingModelWrapper
from gacli.engine.settings import AccumulationConfig

# Also run on the oldest supported TensorFlow and Keras (scripts/ci_oldest.sh).
pytestmark = pytest.mark.exactness

FEATURES = 4


def _two_variables():
    keras.utils.set_random_seed(0)
    return [
        keras.Variable(np.ones((FEATURES, 1), "float32"), name="w"),
        keras.Variable(np.ones((1,), "float32"), name="frozen"),
    ]


def test_a_restored_window_updates_only_the_variables_that_had_gradients(tmp_path):
    """The second variable never gets a gradient. AdamW's weight decay would shrink it if the
    restored window were applied to it with a zero gradient, as a guess of "every variable"
    did: the saved gradient mask says which variables the window holds."""
    x = np.random.default_rng(0).normal(size=(8, FEATURES)).astype("float32")

    def make():
        variables = _two_variables()
        optimizer = gacli.GradientAccumulateOptimizer(
            keras.optimizers.AdamW(0.01, weight_decay=0.5), accum_steps=4
        )
        optimizer.build(variables)
        return variables, optimizer

    variables, optimizer = make()
    for row in x[:3]:  # three micro-batches of a window of four
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.matmul(row[None], variables[0]) ** 2)
        optimizer.apply([tape.gradient(loss, variables[0]), None], variables, sample_count=1)
    path = tf.train.Checkpoint(optimizer=optimizer, v=variables).save(str(tmp_path / "ckpt"))

    restored_variables, restored = make()
    tf.train.Checkpoint(optimizer=restored, v=restored_variables).restore(path)
    assert list(restored.gradient_mask.numpy()) == [1, 0]
    restored.flush()
    optimizer.flush()
    np.testing.assert_array_equal(restored_variables[1].numpy(), [1.0])
    np.testing.assert_array_equal(restored_variables[0].numpy(), variables[0].numpy())
    assert not np.allclose(variables[0].numpy(), 1.0)  # the window was applied


def test_unweighted_and_weighted_micro_batches_each_count_as_they_were_given():
    """A micro-batch without a sample count counts once; one with counts by its samples. The
    window's divisor is kept in two variables, not decided by the last trace."""
    variables = _two_variables()
    optimizer = gacli.GradientAccumulateOptimizer(keras.optimizers.SGD(1.0), accum_steps=3)
    optimizer.build(variables)
    ones = [tf.ones((FEATURES, 1)), tf.ones((1,))]
    optimizer.apply(ones, variables)  # unweighted: a mean gradient of 1
    optimizer.apply([2.0 * g for g in ones], variables, sample_count=4)  # 4 samples, mean 2
    assert float(optimizer.window_unweighted.numpy()) == 1.0
    assert float(optimizer.window_weight.numpy()) == 4.0
    optimizer.apply([3.0 * g for g in ones], variables, sample_count=5)
    # (1 + 2*4 + 3*5) / (1 + 4 + 5) = 2.4
    np.testing.assert_allclose(variables[1].numpy(), [1.0 - 2.4], rtol=1e-6)


def test_fit_continues_is_a_visible_switch_and_a_second_fit_applies():
    """The end of a fit() inside fit_continues() leaves a carried window open; the attribute that
    says so is public and put back afterwards; the next fit() ends training and applies it."""
    x = np.random.default_rng(0).normal(size=(24, FEATURES)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    model = gacli.GradientAccumulateModel(
        accum_steps=4, partial_window="carry", inputs=inputs, outputs=keras.layers.Dense(1)(inputs)
    )
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    optimizer = model.optimizer
    assert optimizer.fit_ends_training
    with optimizer.fit_continues():
        assert not optimizer.fit_ends_training
        model.fit(x[:20], y[:20], batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert optimizer.fit_ends_training
    assert int(optimizer.window_micro_steps.numpy()) == 1  # 5 micro-batches, windows of 4
    model.fit(x[:12], y[:12], batch_size=4, epochs=1, shuffle=False, verbose=0)
    # 1 + 3 = a full window; nothing is left open at the end of training.
    assert int(optimizer.window_micro_steps.numpy()) == 0
    assert int(optimizer.optimizer_step.numpy()) == 2


def test_a_loss_scale_optimizer_around_the_accumulator_is_refused_with_the_fix():
    """One loss-scaling path: the accumulator's. Keras' compile would wrap it in a
    LossScaleOptimizer under mixed_float16; that is refused at compile, with what to type."""
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        inputs = keras.Input((FEATURES,))
        model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
        accumulator = gacli.GradientAccumulateOptimizer(keras.optimizers.SGD(0.1), accum_steps=2)
        assert accumulator.loss_scaling  # on by default under mixed_float16
        with pytest.raises(ValueError, match="auto_scale_loss=False"):
            model.compile(optimizer=accumulator, loss="mse")
        model.compile(optimizer=accumulator, loss="mse", auto_scale_loss=False)
        with pytest.raises(ValueError, match="LossScaleOptimizer"):
            keras.optimizers.LossScaleOptimizer(
                gacli.GradientAccumulateOptimizer(keras.optimizers.SGD(0.1), accum_steps=2)
            )
        # The other way round, LossScaleOptimizer(opt) given to the accumulator, is accepted:
        # tests/engine/test_older_package.py.
    finally:
        keras.mixed_precision.set_global_policy(previous)


class _Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(1)

    def call(self, inputs):
        return self.dense(inputs)


def test_functional_and_subclassed_models_take_the_same_settings():
    settings = dict(
        accum_steps=3,
        mixed_precision=False,
        experimental_distributed_support=True,
        use_agc=True,
        clip_factor=0.02,
        partial_window="drop",
        nonfinite="stop",
        initial_scale=128.0,
    )
    inputs = keras.Input((FEATURES,))
    functional = gacli.wrap_model(keras.Model(inputs, keras.layers.Dense(1)(inputs)), **settings)
    subclassed = gacli.wrap_model(_Subclassed(), **settings)
    assert isinstance(subclassed, AccumulatingModelWrapper)
    assert functional.accumulation_config == subclassed.accumulation_config
    config = functional.accumulation_config
    assert (config.accum_steps, config.partial_window, config.initial_scale) == (
        3,
        gacli.PartialWindow.drop,
        128.0,
    )
    for model in (functional, subclassed):
        model.compile(optimizer="sgd", loss="mse")
        # The model and its optimizer hold the same choices, as the same enum members.
        assert model.partial_window is model.optimizer.partial_window is gacli.PartialWindow.drop
        assert model.optimizer.config.replace(loss_scaling=None) == config


def test_unknown_settings_say_which_exist():
    with pytest.raises(TypeError, match="accum_steps"):
        AccumulationConfig.from_kwargs(accum_stpes=4)
    with pytest.raises(ValueError, match="accum_steps=4"):
        AccumulationConfig(accum_steps=0.5)
    with pytest.raises(ValueError, match="clip_factor"):
        AccumulationConfig(clip_factor=-1)


def test_the_settings_round_trip_through_get_config(tmp_path):
    config = AccumulationConfig(
        accum_steps=4,
        reduction="mean",
        use_agc=True,
        clip_factor=0.05,
        partial_window="carry",
        nonfinite="skip_window",
        loss_scaling=True,
        initial_scale=64.0,
        dynamic_growth_steps=7,
    )
    optimizer = gacli.GradientAccumulateOptimizer(keras.optimizers.Adam(0.01), config=config)
    again = gacli.GradientAccumulateOptimizer.from_config(optimizer.get_config())
    assert again.config == optimizer.config == config
    inputs = keras.Input((FEATURES,))
    model = gacli.GradientAccumulateModel(
        inputs=inputs,
        outputs=keras.layers.Dense(1)(inputs),
        config=config.replace(loss_normalization="window_weights", loss_scaling=None),
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.accumulation_config == model.accumulation_config
    assert loaded.optimizer.config == model.optimizer.config


def test_the_older_readmes_agc_argument_is_use_agc():
    """The older package's README writes GradientAccumulateModel(accum_steps=4, agc=True, ...)."""
    inputs = keras.Input((FEATURES,))
    model = gacli.GradientAccumulateModel(
        accum_steps=4, agc=True, inputs=inputs, outputs=keras.layers.Dense(1)(inputs)
    )
    assert model.use_agc and model.accumulation_config.use_agc
    assert gacli.GradientAccumulateOptimizer("sgd", accum_steps=2, agc=True).use_agc
    with pytest.raises(ValueError, match="agc and use_agc"):
        gacli.GradientAccumulateOptimizer("sgd", agc=True, use_agc=False)
