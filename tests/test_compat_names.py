"""gradient-accumulator's seven public names on ``gacli``, and AGC checked against NumPy.

The NumPy reference below is written from the NFNets formula (Brock et al. 2021): per-unit L2
norms, ``max_norm = clip_factor * max(||w_unit||, eps)``, and a unit whose ``||g_unit||`` exceeds
``max_norm`` is rescaled to ``max_norm / ||g_unit|| * g_unit``. It computes in float64 from the same
float32 inputs, so a difference is gacli's float32 rounding or a wrong axis, and the axes are
given per test, never taken from gacli.
"""

import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import MEASURED

import gacli

CLIP_FACTOR = 0.01
EPS = 1e-3
# float32 against a float64 reference: a few float32 ulps. Clipped gradients are of order 1e-2, so
# an absolute bound; norms (up to ~10) are bounded relative to their size. A wrong axis or a missed
# clip is off by 1e-4 or more (the gradients are scaled to make half the units clip).
ATOL = 1e-6
NORM_RTOL = 1e-6

# Unit-norm axes by rank as NFNets and gradient-accumulator define them (None: the whole tensor).
NFNETS_AXES = {1: None, 2: (0,), 3: (0,), 4: (0, 1, 2), 5: (0, 1, 2, 3)}
SHAPES = {1: (6,), 2: (4, 6), 3: (3, 4, 6), 4: (2, 3, 4, 6), 5: (2, 2, 3, 4, 6)}


def reference_norm(x, axes):
    x = np.asarray(x, np.float64)
    if axes is None:
        return np.sqrt(np.sum(x * x))
    return np.sqrt(np.sum(x * x, axis=axes, keepdims=True))


def reference_agc(weight, gradient, axes, clip_factor=CLIP_FACTOR, eps=EPS):
    gradient = np.asarray(gradient, np.float64)
    max_norm = clip_factor * np.maximum(reference_norm(weight, axes), eps)
    gradient_norm = reference_norm(gradient, axes)
    clips = gradient_norm > max_norm
    return np.where(clips, gradient * max_norm / np.maximum(gradient_norm, 1e-300), gradient), clips


def weight_and_gradient(shape, axes, seed=0):
    """A weight and a gradient whose units alternate between clipped and untouched."""
    rng = np.random.default_rng(seed)
    weight = rng.normal(size=shape).astype("float32")
    gradient = rng.normal(size=shape).astype("float32")
    # Unit-wise ratio ||g|| / ||w|| set to 0.005 or 0.05 around clip_factor=0.01.
    ratio = reference_norm(gradient, axes) / reference_norm(weight, axes)
    target = np.where(np.arange(np.size(ratio)).reshape(np.shape(ratio)) % 2, 0.05, 0.005)
    if axes is None:
        target = 0.05
    return weight, (gradient * target / ratio).astype("float32")


def record(name, difference):
    MEASURED.setdefault(name, []).append(difference)
    return difference


@pytest.mark.parametrize("rank", sorted(SHAPES))
def test_unitwise_and_compute_norm_match_numpy(rank):
    weight, _ = weight_and_gradient(SHAPES[rank], NFNETS_AXES[rank])
    expected = reference_norm(weight, NFNETS_AXES[rank])
    got = gacli.unitwise_norm(tf.constant(weight)).numpy()
    assert got.shape == np.shape(expected)
    relative = float(np.max(np.abs(got - expected) / expected))
    assert record(f"unitwise_norm[rank{rank}] (relative)", relative) <= NORM_RTOL
    axis = None if NFNETS_AXES[rank] is None else list(NFNETS_AXES[rank])
    got = gacli.compute_norm(tf.constant(weight), axis, axis is not None).numpy()
    assert float(np.max(np.abs(got - expected) / expected)) <= NORM_RTOL


def test_unitwise_norm_rejects_rank_6_with_what_to_call():
    with pytest.raises(ValueError, match="compute_norm"):
        gacli.unitwise_norm(tf.zeros((1,) * 6))


@pytest.mark.parametrize("rank", sorted(SHAPES))
def test_adaptive_clip_grad_matches_numpy(rank):
    """The old name, parameters first, NFNets axes (rank 3: axis 0) for bare tensors."""
    axes = NFNETS_AXES[rank]
    weight, gradient = weight_and_gradient(SHAPES[rank], axes)
    expected, clips = reference_agc(weight, gradient, axes)
    if axes is not None:  # both branches of the clip are exercised
        assert clips.any() and not clips.all()
    (got,) = gacli.adaptive_clip_grad([tf.constant(weight)], [tf.constant(gradient)],
                                      clip_factor=CLIP_FACTOR, eps=EPS)
    difference = float(np.max(np.abs(got.numpy() - expected)))
    assert record(f"adaptive_clip_grad[rank{rank}]", difference) <= ATOL
    # The clip changed the gradient by far more than the tolerance.
    assert float(np.max(np.abs(expected - gradient))) > 100 * ATOL


def test_adaptive_clip_grad_passes_none_and_floors_zero_weights_at_eps():
    weight = np.zeros((4, 3), "float32")
    gradient = np.full((4, 3), 1.0, "float32")
    none, got = gacli.adaptive_clip_grad([weight, weight], [None, gradient])
    assert none is None
    # ||g_unit|| = 2 against max_norm = 0.01 * 1e-3: every unit is scaled to norm 1e-5.
    np.testing.assert_allclose(np.linalg.norm(got.numpy(), axis=0), 1e-5, rtol=1e-6)


def rank3_layers_model(seed=0):
    """Conv1D with and without bias, a multi-head EinsumDense [in, heads, dim] with a bias over
    (heads, dim), and a Dense head: every rank-3 reading gacli makes."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5, 4))
    h = keras.layers.Conv1D(6, 3, padding="same", name="conv")(inputs)
    h = keras.layers.Conv1D(4, 2, padding="same", use_bias=False, name="conv_no_bias")(h)
    h = keras.layers.EinsumDense("abc,cde->abde", output_shape=(5, 2, 3), bias_axes="de",
                                 name="heads")(h)
    outputs = keras.layers.Dense(1, name="head")(keras.layers.Flatten()(h))
    return keras.Model(inputs, outputs)


# The axes gacli takes per layer kind, written out here (not asked of gacli): a Conv1D kernel
# [w, in, out] has one unit per output channel, a multi-head kernel [in, heads, dim] one per
# (head, dim).
CHOSEN_AXES = {"conv/kernel": (0, 1), "conv_no_bias/kernel": (0, 1), "heads/kernel": (0,),
               "heads/bias": (0,), "head/kernel": (0,)}
# The other reading of each rank-3 kernel, which a test shows gacli does not take.
OTHER_AXES = {**CHOSEN_AXES, "conv/kernel": (0,), "conv_no_bias/kernel": (0,),
              "heads/kernel": (0, 1)}


def reference_axes(variable, table=CHOSEN_AXES):
    if len(variable.shape) <= 1:
        return None
    return table[variable.path]


def test_adaptive_clip_gradients_reads_rank_3_kernels_by_layer():
    model = rank3_layers_model()
    variables = model.trainable_variables
    assert {v.path for v in variables if len(v.shape) == 3} == {
        "conv/kernel", "conv_no_bias/kernel", "heads/kernel"}
    rng = np.random.default_rng(1)
    gradients = [(0.02 * rng.normal(size=v.shape)).astype("float32") for v in variables]
    clipped = gacli.adaptive_clip_gradients(gradients, variables, CLIP_FACTOR, EPS)
    for variable, gradient, got in zip(variables, gradients, clipped):
        axes = reference_axes(variable)
        expected, _ = reference_agc(variable.numpy(), gradient, axes)
        difference = float(np.max(np.abs(got.numpy() - expected)))
        assert record(f"adaptive_clip_gradients[{variable.path}]", difference) <= ATOL
    # The rank-3 readings differ: each kernel's other reading would be far off.
    for path, other in (("conv/kernel", (0,)), ("heads/kernel", (0, 1))):
        (index,) = [i for i, v in enumerate(variables) if v.path == path]
        wrong, _ = reference_agc(variables[index].numpy(), gradients[index], other)
        assert float(np.max(np.abs(clipped[index].numpy() - wrong))) > 100 * ATOL


def test_adaptive_clip_gradients_reads_multi_head_attention_projections():
    """Query, key and value kernels [in, heads, dim] per (head, dim); the output projection
    [heads, dim, out] per output channel, over its whole fan-in (heads, dim)."""
    keras.utils.set_random_seed(0)
    attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=3, name="attention")
    sequence = keras.Input((5, 4))
    attention(sequence, sequence)
    variables = attention.trainable_variables
    rng = np.random.default_rng(3)
    gradients = [(0.02 * rng.normal(size=v.shape)).astype("float32") for v in variables]
    clipped = gacli.adaptive_clip_gradients(gradients, variables, CLIP_FACTOR, EPS)
    expected_axes = {"query/kernel": (0,), "key/kernel": (0,), "value/kernel": (0,),
                     "attention_output/kernel": (0, 1)}
    seen = set()
    for variable, gradient, got in zip(variables, gradients, clipped):
        suffix = "/".join(variable.path.split("/")[-2:])
        axes = expected_axes.get(suffix, None if len(variable.shape) <= 1 else (0,))
        seen.add(suffix)
        expected, _ = reference_agc(variable.numpy(), gradient, axes)
        difference = float(np.max(np.abs(got.numpy() - expected)))
        assert record(f"adaptive_clip_gradients[mha {suffix}]", difference) <= ATOL
        if suffix in ("query/kernel", "attention_output/kernel"):  # the other reading is far off
            wrong, _ = reference_agc(variable.numpy(), gradient, (0, 1) if axes == (0,) else (0,))
            assert float(np.max(np.abs(got.numpy() - wrong))) > 100 * ATOL, suffix
    assert set(expected_axes) <= seen


def numpy_update(model, x, y, learning_rate, table=CHOSEN_AXES):
    """Big-batch MSE gradient from a plain tape, clipped in NumPy, one SGD step in NumPy."""
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
    gradients = tape.gradient(loss, model.trainable_variables)
    updated = {}
    for variable, gradient in zip(model.trainable_variables, gradients):
        axes = reference_axes(variable, table)
        clipped, _ = reference_agc(variable.numpy(), gradient.numpy(), axes)
        updated[variable.path] = variable.numpy() - learning_rate * clipped
    return updated


@pytest.mark.parametrize("wrapper", ["model", "optimizer"])
def test_use_agc_wrappers_clip_rank_3_kernels_by_layer(wrapper):
    """One window of 2 micro-batches with use_agc=True equals one NumPy-clipped big-batch step."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(8, 5, 4)).astype("float32")
    y = rng.normal(size=(8, 1)).astype("float32")
    learning_rate = 0.5
    expected = numpy_update(rank3_layers_model(), x, y, learning_rate)
    other = numpy_update(rank3_layers_model(), x, y, learning_rate, OTHER_AXES)
    base = rank3_layers_model()
    if wrapper == "model":
        model = gacli.GradientAccumulateModel(accum_steps=2, use_agc=True, clip_factor=CLIP_FACTOR,
                                              eps=EPS, inputs=base.inputs, outputs=base.outputs)
        model.compile(optimizer=keras.optimizers.SGD(learning_rate), loss="mse")
    else:
        model = base
        model.compile(optimizer=gacli.GradientAccumulateOptimizer(
            keras.optimizers.SGD(learning_rate), accum_steps=2, use_agc=True,
            clip_factor=CLIP_FACTOR, eps=EPS), loss="mse")
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    differences = [
        float(np.max(np.abs(variable.numpy() - expected[variable.path])))
        for variable in model.trainable_variables
    ]
    assert record(f"use_agc_rank3[{wrapper}]", max(differences)) <= 1e-6
    # The other rank-3 reading would move these kernels differently, by far more than 1e-6.
    for path in ("conv/kernel", "conv_no_bias/kernel", "heads/kernel"):
        (variable,) = [v for v in model.trainable_variables if v.path == path]
        assert float(np.max(np.abs(variable.numpy() - other[path]))) > 1e-4, path


def test_seven_old_names_with_old_signatures():
    """gradient-accumulator 0.5's public names and arguments, in their order, with their
    defaults; gacli's own extra arguments all have defaults."""
    old = {
        "adaptive_clip_grad": ["parameters", "gradients", ("clip_factor", 0.01), ("eps", 1e-3)],
        "unitwise_norm": ["x"],
        "compute_norm": ["x", "axis", "keepdims"],
        "replace_batchnorm_layers": ["model", "accum_steps", ("position", "replace")],
        "GradientAccumulateModel": [
            ("accum_steps", 1), ("mixed_precision", False), ("use_agc", False),
            ("clip_factor", 0.01), ("eps", 1e-3), ("experimental_distributed_support", False),
        ],
        "GradientAccumulateOptimizer": [
            ("optimizer", "sgd"), ("accum_steps", 1), ("reduction", "mean"), ("use_agc", False),
            ("mixed_precision", False), ("name", "GradientAccumulateOptimizer"),
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
        assert all(p.default is not inspect.Parameter.empty or p.name in old_names
                   or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params), name
    # The old GradientAccumulateOptimizer's dtype (tf.float32) and AccumBatchNormalization's
    # momentum, epsilon and trainable reach gacli by keyword with the same meaning.
    optimizer = gacli.GradientAccumulateOptimizer("SGD", accum_steps=2, reduction="MEAN",
                                                  dtype=tf.float32)
    assert optimizer.accumulator_dtype == "float32"
    layer = gacli.AccumBatchNormalization(accum_steps=2, momentum=0.99, epsilon=1e-3,
                                          trainable=True)
    assert (layer.momentum, layer.epsilon, layer.trainable) == (0.99, 1e-3, True)
    assert gacli.AccumBatchNormalization().momentum == 0.99  # the old default


def bn_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    h = keras.layers.BatchNormalization(name="bn")(keras.layers.Dense(3)(inputs))
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
        np.testing.assert_array_equal(getattr(bn, name).numpy(),
                                      getattr(model.get_layer("bn"), name).numpy())
    np.testing.assert_allclose(swapped.predict(x, verbose=0), expected, atol=1e-6)
    record("replace_batchnorm_layers[inference]",
           float(np.max(np.abs(swapped.predict(x, verbose=0) - expected))))


@pytest.mark.parametrize("position", ["after", "before"])
def test_replace_batchnorm_layers_other_positions_say_what_to_pass(position):
    with pytest.raises(ValueError, match="position='replace'"):
        gacli.replace_batchnorm_layers(bn_model(), accum_steps=3, position=position)
