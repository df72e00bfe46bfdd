"""What gradient-accumulator's users write, honoured or refused with what to write instead:
its LossScaleOptimizer recipe, clipping arguments on the wrapper, ``.optimizer``, a fourth
positional argument, ``lr`` and ``decay``, one AccumBatchNormalization shared by two layers, and
batch normalisation in training mode, which must not pass silently (docs/migrating.md)."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import gacli
from helpers import (
    MICRO,
    K,
    big_batch_reference,
    custom_loop,
    epoch_windows,
    make_data,
    max_weight_difference,
    mlp_layers,
    plain_model,
    weights_difference,
)


@pytest.fixture
def mixed_float16():
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy(previous)


def float16_model(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(16, activation="tanh")(inputs)
    return inputs, keras.layers.Dense(1, dtype="float32")(hidden)


def test_loss_scale_optimizer_given_to_the_optimizer_wrapper_is_its_loss_scaling(mixed_float16):
    """``GradientAccumulateOptimizer(LossScaleOptimizer(opt))``: the accumulator scales the loss
    itself with the LossScaleOptimizer's settings, and trains as if they were given to it."""
    x, y = make_data(70)

    def run(optimizer):
        inputs, outputs = float16_model()
        model = keras.Model(inputs, outputs)
        custom_loop_scaled(model, optimizer, x, y)
        return model, optimizer

    older = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=2.0**10, dynamic_growth_steps=7
    )
    model, optimizer = run(gacli.GradientAccumulateOptimizer(older, accum_steps=K))
    assert optimizer.optimizer is older.inner_optimizer  # the older package's attribute
    assert optimizer.loss_scaling and optimizer.dynamic_growth_steps == 7
    assert optimizer.initial_scale == 2.0**10
    given = gacli.GradientAccumulateOptimizer(
        keras.optimizers.SGD(0.1),
        accum_steps=K,
        loss_scaling=True,
        initial_scale=2.0**10,
        dynamic_growth_steps=7,
    )
    reference, _ = run(given)
    assert int(optimizer.optimizer_step.numpy()) == 2
    assert max_weight_difference(model, reference) == 0.0
    assert float(optimizer.loss_scale.numpy()) == float(given.loss_scale.numpy())
    with pytest.raises(ValueError, match="loss_scaling=False"):
        gacli.GradientAccumulateOptimizer(older, accum_steps=K, loss_scaling=False)


def custom_loop_scaled(model, optimizer, x, y):
    """One epoch of a custom loop with the accumulator's loss scaling (its scale_loss)."""

    @tf.function
    def micro_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply_gradients(
            zip(grads, model.trainable_variables), sample_count=tf.shape(xb)[0]
        )

    for xb, yb in tf.data.Dataset.from_tensor_slices((x, y)).batch(MICRO):
        micro_step(xb, yb)
    optimizer.finish_epoch()


def test_the_older_mixed_precision_recipe_trains_the_model_wrapper(mixed_float16):
    """gradient-accumulator's README and tests: ``mixed_precision=True`` and
    ``compile(optimizer=LossScaleOptimizer(Adam))``. Accepted, with the same weights as the
    accumulator's own loss scaling at the same settings."""
    x, y = make_data(70)

    def run(optimizer):
        inputs, outputs = float16_model()
        model = gacli.GradientAccumulateModel(
            accum_steps=K, mixed_precision=True, inputs=inputs, outputs=outputs
        )
        model.compile(optimizer=optimizer, loss="mse")
        history = model.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0)
        return model, history.history["loss"]

    older = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01), initial_scale=512.0)
    model, losses = run(older)
    accumulator = model.accumulating_optimizer
    assert accumulator.inner_optimizer is older.inner_optimizer
    assert accumulator.loss_scaling and accumulator.initial_scale == 512.0
    assert int(accumulator.optimizer_step.numpy()) == 4
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    reference, _ = run(keras.optimizers.Adam(0.01))
    # The reference's scale starts at 2**15: with no overflow, scales are powers of two, so
    # unscaling is exact and the weights agree to the last bit.
    assert max_weight_difference(model, reference) == 0.0


@pytest.mark.parametrize(
    "clipping", [{"clipnorm": 0.02}, {"global_clipnorm": 0.03}, {"clipvalue": 0.005}]
)
def test_clipping_given_to_the_wrapper_clips_the_window_once(clipping):
    """``GradientAccumulateOptimizer(SGD(0.1), clipnorm=...)`` (the older package's users pass
    clipping to the wrapper) equals the big batch clipped once per update, ragged data included;
    the clipping bites (an unclipped run ends elsewhere)."""
    x, y = make_data(70)
    make_clipped = lambda: keras.optimizers.SGD(0.1, **clipping)  # noqa: E731
    reference = big_batch_reference(make_clipped, epoch_windows(70, MICRO * K, 3), x, y)
    unclipped = big_batch_reference(
        lambda: keras.optimizers.SGD(0.1), epoch_windows(70, MICRO * K, 3), x, y
    )
    model = plain_model()
    optimizer = gacli.GradientAccumulateOptimizer(
        keras.optimizers.SGD(0.1), accum_steps=K, **clipping
    )
    custom_loop(model, optimizer, x, y, MICRO, epochs=3)
    assert max_weight_difference(model, reference) <= 1e-6
    assert max_weight_difference(model, unclipped) > 1e-3
    ((key, value),) = clipping.items()
    assert getattr(optimizer.optimizer, key) == value


def test_clipping_in_two_places_and_older_no_ops_are_refused():
    with pytest.raises(ValueError, match="set the clipping in one place"):
        gacli.GradientAccumulateOptimizer(keras.optimizers.SGD(0.1, clipnorm=1.0), clipvalue=0.5)
    with pytest.raises(ValueError, match="Only one of clipnorm"):
        gacli.GradientAccumulateOptimizer("sgd", clipnorm=1.0, clipvalue=0.5)
    for key in ("lr", "decay"):
        with pytest.raises(ValueError, match="no update used"):
            gacli.GradientAccumulateOptimizer("sgd", accum_steps=2, **{key: 0.1})


def test_a_fourth_positional_argument_is_read_as_the_older_releases_read_it():
    named = gacli.GradientAccumulateOptimizer("sgd", 4, "mean", "my_accumulator")
    assert (named.name, named.use_agc, named.accum_steps) == ("my_accumulator", False, 4)
    clipped = gacli.GradientAccumulateOptimizer("sgd", 4, "mean", True)
    assert clipped.use_agc and clipped.name == "GradientAccumulateOptimizer"
    with pytest.raises(TypeError, match="Pass the rest by keyword"):
        gacli.GradientAccumulateOptimizer("sgd", 4, "mean", True, False)
    with pytest.raises(TypeError, match="Pass the rest by keyword"):
        gacli.GradientAccumulateOptimizer("sgd", 4, "mean", 0.01)


def test_the_agc_names_are_accepted_and_the_usual_typo_is_refused_naming_use_agc():
    """gradient-accumulator takes ``use_agc`` (its README writes ``agc``), ``mixed_precision`` and
    ``experimental_distributed_support``; ``use_acg`` was never one of its names, and a typo that
    did nothing would train without the clipping asked for (docs/migrating.md)."""
    inputs, outputs = mlp_layers()
    makers = {
        "wrap_model": lambda **given: gacli.wrap_model(plain_model(), accum_steps=2, **given),
        "GradientAccumulateModel": lambda **given: gacli.GradientAccumulateModel(
            accum_steps=2, inputs=inputs, outputs=outputs, **given
        ),
        "GradientAccumulateOptimizer": lambda **given: gacli.GradientAccumulateOptimizer(
            "sgd", accum_steps=2, **given
        ),
    }
    for called, make in makers.items():
        for name in ("agc", "use_agc"):
            assert make(**{name: True}).use_agc
        with pytest.raises(TypeError, match=rf"^{called}\(\) got an unexpected keyword argument "):
            make(use_acg=True)
        with pytest.raises(TypeError, match=r"'use_acg' \(did you mean 'use_agc'\?\)"):
            make(use_acg=True)
    for make in (makers["wrap_model"], makers["GradientAccumulateModel"]):
        assert make(mixed_precision=False, experimental_distributed_support=True).accum_steps == 2


def test_one_accum_batchnorm_in_two_places_is_refused_with_what_to_write():
    """The older package's test_bn_convnd shares one layer between a Conv2D output and a Dense
    output; its window would count both calls and pool both inputs."""
    shared = gacli.AccumBatchNormalization(accum_steps=2)
    with pytest.raises(ValueError, match="rank 4 and rank 2.*one layer per place"):
        keras.Sequential(
            [
                keras.Input((8, 8, 1)),
                keras.layers.Conv2D(4, 3),
                shared,
                keras.layers.Flatten(),
                keras.layers.Dense(4),
                shared,
                keras.layers.Dense(1),
            ]
        )
    shared = gacli.AccumBatchNormalization(accum_steps=2)
    inputs = keras.Input((4,))
    hidden = shared(keras.layers.Dense(4)(inputs))
    outputs = keras.layers.Dense(1)(shared(keras.layers.Dense(4)(hidden)))
    model = gacli.GradientAccumulateModel(accum_steps=2, inputs=inputs, outputs=outputs)
    with pytest.raises(ValueError, match="applied at two places"):
        model.compile(optimizer="sgd", loss="mse")


def bn_model(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8,))
    hidden = keras.layers.BatchNormalization(name="bn_a")(keras.layers.Dense(8)(inputs))
    return keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Activation("tanh")(hidden)))


def test_batch_norm_in_training_mode_warns_once_and_freeze_is_exact():
    """Batch norm normalises each micro-batch by its own statistics: the wrapped model ends away
    from the big batch, and compile says so once, naming the layer and the policies. 'freeze',
    the exact remedy the warning names first, gives the big batch's weights."""
    x, y = make_data(128)
    x = np.concatenate([x, x], axis=1)  # 8 features
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = gacli.wrap_model(bn_model(), accum_steps=K)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    found = [w for w in caught if issubclass(w.category, gacli.BatchNormWarning)]
    assert len(found) == 1
    text = str(found[0].message)
    assert "bn_a" in text and "accum_steps=4" in text
    assert all(policy in text for policy in ("'freeze'", "'precise'", "'accumulate'"))
    model.fit(x, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)

    big = bn_model()
    big.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    big.fit(x, y, batch_size=MICRO * K, epochs=1, shuffle=False, verbose=0)
    assert weights_difference(model.get_weights(), big.get_weights()) > 1e-4  # not exact

    frozen_big = gacli.apply_batchnorm_policy(bn_model(), "freeze")
    frozen_big.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    frozen_big.fit(x, y, batch_size=MICRO * K, epochs=1, shuffle=False, verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gacli.BatchNormWarning)  # frozen: nothing to warn of
        frozen = gacli.wrap_model(gacli.apply_batchnorm_policy(bn_model(), "freeze"), accum_steps=K)
        frozen.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    frozen.fit(x, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
    assert weights_difference(frozen.get_weights(), frozen_big.get_weights()) <= 1e-6
