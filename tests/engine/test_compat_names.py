"""gradient-accumulator's seven public names on ``gacli``, checked against independent
calculations: its AGC functions against the NumPy formula in ``helpers`` (NFNets axes by rank,
float64, axes written here, never taken from gacli), ``replace_batchnorm_layers`` against
``apply_batchnorm_policy`` and the layer it replaces.
"""

import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf

import gacli
from helpers import NFNETS_AXES, numpy_agc, numpy_norm, record, weight_and_gradient

CLIP_FACTOR = 0.01
EPS = 1e-3
# float32 against a float64 reference: a few float32 ulps. Clipped gradients are of order 1e-2, so
# an absolute bound; norms (up to ~10) are bounded relative to their size. A wrong axis or a missed
# clip is off by 1e-4 or more (the gradients are scaled to make half the units clip).
ATOL = 1e-6
NORM_RTOL = 1e-6

SHAPES = {0: (), 1: (6,), 2: (4, 6), 3: (3, 4, 6), 4: (2, 3, 4, 6), 5: (2, 2, 3, 4, 6)}


@pytest.mark.parametrize("rank", sorted(SHAPES))
def test_unitwise_and_compute_norm_match_numpy(rank):
    """unitwise_norm by rank alone (rank 3: axis 0), the result shaped as the old one was: a
    scalar for ranks 0 and 1, dimensions kept for the others."""
    weight, _ = weight_and_gradient(SHAPES[rank], NFNETS_AXES[rank], CLIP_FACTOR)
    expected = numpy_norm(weight, NFNETS_AXES[rank])
    got = gacli.unitwise_norm(tf.constant(weight)).numpy()
    assert got.shape == np.shape(expected)
    relative = float(np.max(np.abs(got - expected) / expected))
    assert record(relative, f"unitwise_norm[rank{rank}] (relative)") <= NORM_RTOL
    axis = None if NFNETS_AXES[rank] is None else list(NFNETS_AXES[rank])
    got = gacli.compute_norm(tf.constant(weight), axis, axis is not None).numpy()
    assert float(np.max(np.abs(got - expected) / expected)) <= NORM_RTOL


@pytest.mark.parametrize("axis, keepdims", [(1, False), (1, True), ([0, 2], False), (None, True)])
def test_compute_norm_takes_any_axis_and_keepdims(axis, keepdims):
    """compute_norm(x, axis, keepdims) as the old one: an int or a list of axes, or None."""
    x = np.random.default_rng(6).normal(size=(3, 4, 5)).astype("float32")
    expected = np.sqrt(
        np.sum(
            np.asarray(x, np.float64) ** 2,
            axis=None if axis is None else tuple(np.atleast_1d(axis)),
            keepdims=keepdims,
        )
    )
    got = gacli.compute_norm(tf.constant(x), axis, keepdims).numpy()
    assert got.shape == expected.shape
    assert float(np.max(np.abs(got - expected) / expected)) <= NORM_RTOL


def test_unitwise_norm_rejects_rank_6_with_what_to_call():
    with pytest.raises(ValueError, match="compute_norm"):
        gacli.unitwise_norm(tf.zeros((1,) * 6))


@pytest.mark.parametrize("rank", sorted(SHAPES))
def test_adaptive_clip_grad_matches_numpy(rank):
    """The old name, parameters first, NFNets axes (rank 3: axis 0) for bare tensors."""
    axes = NFNETS_AXES[rank]
    weight, gradient = weight_and_gradient(SHAPES[rank], axes, CLIP_FACTOR)
    expected, clips = numpy_agc(weight, gradient, axes, CLIP_FACTOR, EPS)
    if axes is not None:  # both branches of the clip are exercised
        assert clips.any() and not clips.all()
    (got,) = gacli.adaptive_clip_grad(
        [tf.constant(weight)], [tf.constant(gradient)], clip_factor=CLIP_FACTOR, eps=EPS
    )
    difference = float(np.max(np.abs(got.numpy() - expected)))
    assert record(difference, f"adaptive_clip_grad[rank{rank}]") <= ATOL
    # The clip changed the gradient by far more than the tolerance.
    assert float(np.max(np.abs(expected - gradient))) > 100 * ATOL


def test_adaptive_clip_grad_defaults_are_the_old_ones():
    """Called without clip_factor and eps: 0.01 and 1e-3, as gradient-accumulator's."""
    weight, gradient = weight_and_gradient(SHAPES[2], NFNETS_AXES[2], 0.01)
    weight[:, 0] = 1e-5  # a unit whose norm is floored at eps
    expected, clips = numpy_agc(weight, gradient, NFNETS_AXES[2], 0.01, 1e-3)
    assert clips[0, 0]
    (got,) = gacli.adaptive_clip_grad([weight], [gradient])
    assert float(np.max(np.abs(got.numpy() - expected))) <= ATOL


def test_adaptive_clip_grad_passes_none_and_floors_zero_weights_at_eps():
    weight = np.zeros((4, 3), "float32")
    gradient = np.full((4, 3), 1.0, "float32")
    none, got = gacli.adaptive_clip_grad([weight, weight], [None, gradient])
    assert none is None
    # ||g_unit|| = 2 against max_norm = 0.01 * 1e-3: every unit is scaled to norm 1e-5.
    np.testing.assert_allclose(np.linalg.norm(got.numpy(), axis=0), 1e-5, rtol=1e-6)


def test_seven_old_names_with_old_signatures():
    """gradient-accumulator 0.5's public names and arguments, in their order, with their
    defaults; gacli's own extra arguments all have defaults."""
    old = {
        "adaptive_clip_grad": ["parameters", "gradients", ("clip_factor", 0.01), ("eps", 1e-3)],
        "unitwise_norm": ["x"],
        "compute_norm": ["x", "axis", "keepdims"],
        "replace_batchnorm_layers": ["model", "accum_steps", ("position", "replace")],
        "GradientAccumulateModel": [
            ("accum_steps", 1),
            ("mixed_precision", False),
            ("use_agc", False),
            ("clip_factor", 0.01),
            ("eps", 1e-3),
            ("experimental_distributed_support", False),
        ],
        "GradientAccumulateOptimizer": [
            ("optimizer", "sgd"),
            ("accum_steps", 1),
            ("reduction", "mean"),
            ("use_agc", False),
            ("mixed_precision", False),
            ("name", "GradientAccumulateOptimizer"),
        ],
        "AccumBatchNormalization": [("accum_steps", 1)],
    }
    for name, parameters in old.items():
        assert name in dir(gacli)
        target = getattr(gacli, name)
        signature = inspect.signature(target.__init__ if inspect.isclass(target) else target)
        params = [p for p in signature.parameters.values() if p.name != "self"]
        names = [p.name for p in params]
        positions = []
        for parameter in parameters:
            key, default = parameter if isinstance(parameter, tuple) else (parameter, None)
            assert key in names, (name, key)
            found = signature.parameters[key]
            if isinstance(parameter, tuple):
                # gacli spells the optimizer and the reduction in lower case and accepts both.
                assert str(found.default).lower() == str(default).lower(), (name, key)
            else:
                assert found.default is inspect.Parameter.empty, (name, key)
            positions.append(names.index(key))
        assert positions == sorted(positions), name
        old_names = {p if isinstance(p, str) else p[0] for p in parameters}
        assert all(
            p.default is not inspect.Parameter.empty
            or p.name in old_names
            or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            for p in params
        ), name
    # The old GradientAccumulateOptimizer's dtype (tf.float32) and AccumBatchNormalization's
    # momentum, epsilon and trainable reach gacli by keyword with the same meaning.
    optimizer = gacli.GradientAccumulateOptimizer(
        "SGD", accum_steps=2, reduction="MEAN", dtype=tf.float32
    )
    assert optimizer.accumulator_dtype == "float32"
    layer = gacli.AccumBatchNormalization(
        accum_steps=2, momentum=0.99, epsilon=1e-3, trainable=True
    )
    assert (layer.momentum, layer.epsilon, layer.trainable) == (0.99, 1e-3, True)
    assert gacli.AccumBatchNormalization().momentum == 0.99  # the old default


def bn_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    # Not Keras' default momentum and epsilon: the swapped layer must carry them over.
    h = keras.layers.BatchNormalization(momentum=0.9, epsilon=0.01, name="bn")(
        keras.layers.Dense(3)(inputs)
    )
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    rng = np.random.default_rng(4)
    bn = model.get_layer("bn")
    for variable in (bn.gamma, bn.beta, bn.moving_mean):
        variable.assign(rng.normal(size=variable.shape).astype("float32"))
    bn.moving_variance.assign(rng.uniform(0.5, 2.0, size=3).astype("float32"))
    return model


def test_replace_batchnorm_layers_keeps_weights_and_inference_output():
    model = bn_model()
    x = np.random.default_rng(5).normal(size=(6, 4)).astype("float32")
    expected = model.predict(x, verbose=0)
    swapped = gacli.replace_batchnorm_layers(model, accum_steps=3)
    bn = swapped.get_layer("bn")
    assert isinstance(bn, gacli.AccumBatchNormalization) and bn.accum_steps == 3
    for name in ("gamma", "beta", "moving_mean", "moving_variance"):
        np.testing.assert_array_equal(
            getattr(bn, name).numpy(), getattr(model.get_layer("bn"), name).numpy()
        )
    difference = float(np.max(np.abs(swapped.predict(x, verbose=0) - expected)))
    assert record(difference, "replace_batchnorm_layers[inference]") <= 1e-6


def test_replace_batchnorm_layers_is_apply_batchnorm_policy_accumulate():
    """The old name builds what apply_batchnorm_policy(model, "accumulate", k) builds: the same
    layers with the same configuration (the BN layer's own, plus accum_steps), the same weights
    (the window state included) and the same training-mode output; every other layer with weights
    is the original's own object, not a copy."""
    model = bn_model()
    swapped = gacli.replace_batchnorm_layers(model, 3)
    policy = gacli.apply_batchnorm_policy(model, "accumulate", 3)
    assert [type(layer) for layer in swapped.layers] == [type(layer) for layer in policy.layers]
    assert [layer.get_config() for layer in swapped.layers] == [
        layer.get_config() for layer in policy.layers
    ]
    original = model.get_layer("bn").get_config()
    assert swapped.get_layer("bn").get_config() == {**original, "accum_steps": 3}
    assert [weight.path for weight in swapped.weights] == [weight.path for weight in policy.weights]
    for a, b in zip(swapped.weights, policy.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    for before, after in zip(model.layers, swapped.layers):
        if before.weights:
            assert (after is before) == (after.name != "bn"), after.name
    x = np.random.default_rng(7).normal(size=(6, 4)).astype("float32")
    np.testing.assert_array_equal(swapped(x, training=True), policy(x, training=True))


@pytest.mark.parametrize("position", ["after", "before"])
def test_replace_batchnorm_layers_other_positions_say_what_to_pass(position):
    with pytest.raises(ValueError, match="position='replace'"):
        gacli.replace_batchnorm_layers(bn_model(), accum_steps=3, position=position)
