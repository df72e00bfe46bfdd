"""Contract rows B1 and B2: BN statistics per window, and a BN swap that keeps a model's output."""

import keras
import numpy as np
import pytest

import gacli

# Also run on the oldest supported TensorFlow and Keras (scripts/ci_oldest.sh).
pytestmark = pytest.mark.exactness

K, MICRO = 4, 8


def conv_model(make_norm, seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6, 6, 2))
    x = keras.layers.Conv2D(3, 3, padding="same")(inputs)
    x = make_norm()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return inputs, keras.layers.Dense(1)(x)


def images(num_samples, seed=0):
    rng = np.random.default_rng(seed)
    # Micro-batches with different means, so the between-micro-batch variance term matters.
    x = (
        rng.normal(size=(num_samples, 6, 6, 2))
        + np.repeat(np.arange(num_samples // MICRO + 1), MICRO)[:num_samples, None, None, None]
    )
    y = rng.normal(size=(num_samples, 1))
    return x.astype("float32"), y.astype("float32")


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_b1_moving_statistics_after_one_window_equal_big_batch(momentum):
    x, y = images(MICRO * K)
    inputs, outputs = conv_model(lambda: keras.layers.BatchNormalization(momentum=momentum))
    reference = keras.Model(inputs, outputs)
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    reference.train_on_batch(x, y)  # one big-batch BN step

    # Same seed, same layer order: the same initial weights.
    inputs, outputs = conv_model(
        lambda: gacli.AccumBatchNormalization(accum_steps=K, momentum=momentum)
    )
    model = gacli.GradientAccumulateModel(accum_steps=K, inputs=inputs, outputs=outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)

    bn = model.layers[2]
    expected = reference.layers[2]
    np.testing.assert_allclose(bn.moving_mean.numpy(), expected.moving_mean.numpy(), atol=1e-5)
    np.testing.assert_allclose(
        bn.moving_variance.numpy(), expected.moving_variance.numpy(), atol=1e-5
    )
    assert int(bn.window_position.numpy()) == 0
    if momentum == 0.0:
        # The pooled variance is not the mean of the micro-batch variances (the older package's
        # estimate, biased low): the between-micro-batch term is large here.
        initial = keras.Model(*conv_model(lambda: keras.layers.BatchNormalization()))
        conv_output = keras.Model(initial.inputs, initial.layers[1].output).predict(x, verbose=0)
        per_channel = conv_output.reshape(K, -1, 3)
        mean_of_micro_variances = per_channel.var(axis=1).mean(axis=0)
        between_micro_batches = per_channel.mean(axis=1).var(axis=0)
        assert np.all(between_micro_batches > 0.1 * mean_of_micro_variances)
        np.testing.assert_allclose(
            bn.moving_variance.numpy(), mean_of_micro_variances + between_micro_batches, rtol=1e-4
        )


@pytest.mark.parametrize("axis, shape", [(-1, (5, 3)), (1, (3, 5)), (-1, (4, 4, 2, 3))])
def test_b1_windows_and_partial_window_over_epochs_any_rank_and_axis(axis, shape):
    """Frozen weights (lr=0), 2 epochs of 40 samples: windows of 32 and 8 each epoch; the moving
    statistics follow the big-batch BN steps on exactly those windows."""
    rng = np.random.default_rng(1)
    x = (rng.normal(size=(40, *shape)) * 2 + 1).astype("float32")
    y = rng.normal(size=(40, 1)).astype("float32")

    def build(norm):
        keras.utils.set_random_seed(0)
        inputs = keras.Input(shape)
        h = norm()(inputs)
        return inputs, keras.layers.Dense(1)(keras.layers.Flatten()(h))

    reference = keras.Model(
        *build(lambda: keras.layers.BatchNormalization(axis=axis, momentum=0.5))
    )
    reference.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    for _ in range(2):
        reference.train_on_batch(x[:32], y[:32])
        reference.train_on_batch(x[32:], y[32:])

    inputs, outputs = build(
        lambda: gacli.AccumBatchNormalization(accum_steps=K, axis=axis, momentum=0.5)
    )
    model = gacli.GradientAccumulateModel(accum_steps=K, inputs=inputs, outputs=outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    model.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0)
    bn, expected = model.layers[1], reference.layers[1]
    np.testing.assert_allclose(bn.moving_mean.numpy(), expected.moving_mean.numpy(), atol=1e-5)
    np.testing.assert_allclose(
        bn.moving_variance.numpy(), expected.moving_variance.numpy(), atol=1e-5
    )


def pretrained_bn_model():
    inputs, outputs = conv_model(lambda: keras.layers.BatchNormalization())
    model = keras.Model(inputs, outputs)
    rng = np.random.default_rng(3)
    bn = model.layers[2]
    for variable in (bn.gamma, bn.beta, bn.moving_mean):
        variable.assign(rng.normal(size=variable.shape).astype("float32"))
    bn.moving_variance.assign(
        rng.uniform(0.5, 2.0, size=bn.moving_variance.shape).astype("float32")
    )
    return model


def test_b2_swap_to_accumulate_keeps_inference_output():
    model = pretrained_bn_model()
    x, _ = images(16)
    expected = model.predict(x, verbose=0)
    swapped = gacli.apply_batchnorm_policy(model, "accumulate", accum_steps=K)
    assert isinstance(swapped.layers[2], gacli.AccumBatchNormalization)
    assert swapped.layers[2].accum_steps == K
    np.testing.assert_allclose(swapped.predict(x, verbose=0), expected, atol=1e-6)
    assert swapped.layers[1] is model.layers[1]  # other layers reused, not re-initialised


def test_bn_policies_freeze_group_norm_keep():
    x, y = images(32)
    frozen = gacli.apply_batchnorm_policy(pretrained_bn_model(), "freeze")
    statistics = frozen.layers[2].moving_mean.numpy().copy()
    frozen.compile(optimizer="sgd", loss="mse")
    frozen.fit(x, y, batch_size=8, verbose=0)
    np.testing.assert_array_equal(frozen.layers[2].moving_mean.numpy(), statistics)

    original = pretrained_bn_model()
    grouped = gacli.apply_batchnorm_policy(original, "group_norm", groups=32)
    norm = grouped.layers[2]
    assert isinstance(norm, keras.layers.GroupNormalization) and norm.groups == 3
    np.testing.assert_array_equal(norm.gamma.numpy(), original.layers[2].gamma.numpy())

    with pytest.warns(UserWarning, match="per micro-batch"):
        kept = gacli.apply_batchnorm_policy(pretrained_bn_model(), "keep", accum_steps=4)
    assert type(kept.layers[2]) is keras.layers.BatchNormalization


def test_accum_batchnorm_serialises_and_rejects_renorm(tmp_path):
    inputs, outputs = conv_model(lambda: gacli.AccumBatchNormalization(accum_steps=K))
    model = gacli.GradientAccumulateModel(accum_steps=K, inputs=inputs, outputs=outputs)
    model.compile(optimizer="sgd", loss="mse")
    model.save(tmp_path / "bn.keras")
    loaded = keras.models.load_model(tmp_path / "bn.keras")
    assert loaded.layers[2].accum_steps == K
    with pytest.raises(ValueError, match="renorm"):
        gacli.AccumBatchNormalization(accum_steps=2, renorm=True)
    with pytest.raises(ValueError, match="accum_steps=2"):
        inputs, outputs = conv_model(lambda: gacli.AccumBatchNormalization(accum_steps=K))
        gacli.GradientAccumulateModel(accum_steps=2, inputs=inputs, outputs=outputs).compile(
            optimizer="sgd", loss="mse"
        )


def test_an_empty_micro_batch_folds_in_as_nothing():
    """A replica may get no sample of a short last batch; its nan moments must not leak."""
    x = np.random.default_rng(0).normal(size=(8, 3)).astype("float32")
    layer = gacli.AccumBatchNormalization(accum_steps=2, momentum=0.0)
    layer(x[:0], training=True)
    layer(x, training=True)
    np.testing.assert_allclose(layer.moving_mean.numpy(), x.mean(axis=0), atol=1e-5)
    np.testing.assert_allclose(layer.moving_variance.numpy(), x.var(axis=0), atol=1e-5)


def test_accum_batchnorm_under_mixed_float16_matches_big_batch_bn():
    """float16 activations, float32 statistics: one window equals a big-batch BN step under the
    same policy (the same float16 inputs, pooled in float32)."""
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = images(MICRO * K)
        reference = keras.Model(*conv_model(lambda: keras.layers.BatchNormalization(momentum=0.0)))
        reference.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        reference.train_on_batch(x, y)
        inputs, outputs = conv_model(
            lambda: gacli.AccumBatchNormalization(accum_steps=K, momentum=0.0)
        )
        model = gacli.GradientAccumulateModel(accum_steps=K, inputs=inputs, outputs=outputs)
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        model.fit(x, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy(previous)
    bn, expected = model.layers[2], reference.layers[2]
    assert bn.compute_dtype == "float16" and bn.moving_variance.dtype == "float32"
    np.testing.assert_allclose(bn.moving_mean.numpy(), expected.moving_mean.numpy(), atol=1e-4)
    np.testing.assert_allclose(
        bn.moving_variance.numpy(), expected.moving_variance.numpy(), atol=1e-4
    )
