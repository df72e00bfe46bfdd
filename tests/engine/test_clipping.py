"""AGC's units per layer kind (contract row C2), checked against the NumPy formula in ``helpers``.

The axes of each kind's units are written out here from what the kernel's axes mean, never asked
of gacli: every weight by the NFNets rank rule, except the rank-3 kernels, which the rule cannot
tell apart. A 1D convolution's kernel has one unit per output channel over every other axis, as
its 2D and 3D versions do under the rule; an EinsumDense kernel one unit per output element, its
norm over the axes the equation sums over.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import gacli
from helpers import numpy_agc, record, weight_and_gradient

# Also run on the oldest supported TensorFlow and Keras (scripts/ci_oldest.sh).
pytestmark = pytest.mark.exactness

CLIP_FACTOR = 0.01
EPS = 1e-3
# float32 against a float64 reference: a few float32 ulps of gradients of order 1e-2. A wrong axis
# or a missed clip is off by 1e-4 or more (the gradients are scaled to make half the units clip).
ATOL = 1e-6

# kind: (the layer, its input shape, {weight: unit-norm axes}, None for the whole tensor).
KINDS = {
    "dense": (lambda: keras.layers.Dense(6), (4,), {"kernel": (0,), "bias": None}),
    "conv1d": (lambda: keras.layers.Conv1D(6, 3), (5, 4), {"kernel": (0, 1), "bias": None}),
    "conv1d-no-bias": (
        lambda: keras.layers.Conv1D(6, 3, use_bias=False),
        (5, 4),
        {"kernel": (0, 1)},
    ),
    # [w, out, in]: per input channel, as the NFNets rule reads a Conv2DTranspose kernel.
    "conv1d-transpose": (
        lambda: keras.layers.Conv1DTranspose(6, 3),
        (5, 4),
        {"kernel": (0, 1), "bias": None},
    ),
    "depthwise-conv1d": (
        lambda: keras.layers.DepthwiseConv1D(3, depth_multiplier=2),
        (5, 4),
        {"kernel": (0, 1), "bias": None},
    ),
    "separable-conv1d": (
        lambda: keras.layers.SeparableConv1D(6, 3, depth_multiplier=2),
        (5, 4),
        {"depthwise_kernel": (0, 1), "pointwise_kernel": (0, 1), "bias": None},
    ),
    "conv2d": (lambda: keras.layers.Conv2D(6, 3), (5, 5, 4), {"kernel": (0, 1, 2), "bias": None}),
    "conv3d": (
        lambda: keras.layers.Conv3D(6, 2),
        (3, 3, 3, 4),
        {"kernel": (0, 1, 2, 3), "bias": None},
    ),
    # [in, heads, dim] with a [heads, dim] bias (rank 2: axis 0 by the rule).
    "einsum-heads": (
        lambda: keras.layers.EinsumDense("abc,cde->abde", (5, 2, 3), bias_axes="de"),
        (5, 4),
        {"kernel": (0,), "bias": (0,)},
    ),
    "einsum-heads-no-bias": (
        lambda: keras.layers.EinsumDense("abc,cde->abde", (5, 2, 3)),
        (5, 4),
        {"kernel": (0,)},
    ),
    # [heads, dim, out], as MultiHeadAttention's output projection.
    "einsum-output-projection": (
        lambda: keras.layers.EinsumDense("abcd,cde->abe", (5, 6), bias_axes="e"),
        (5, 2, 3),
        {"kernel": (0, 1), "bias": None},
    ),
    # [position, in, out]: a weight per position, summed over the input alone.
    "einsum-per-position": (
        lambda: keras.layers.EinsumDense("abc,bcd->abd", (5, 6), bias_axes="d"),
        (5, 4),
        {"kernel": (1,), "bias": None},
    ),
    "multi-head-attention": (
        lambda: keras.layers.MultiHeadAttention(num_heads=2, key_dim=3),
        (5, 4),
        {
            **{f"{p}/{w}": (0,) for p in ("query", "key", "value") for w in ("kernel", "bias")},
            "attention_output/kernel": (0, 1),
            "attention_output/bias": None,
        },
    ),
    "multi-head-attention-no-bias": (
        lambda: keras.layers.MultiHeadAttention(num_heads=2, key_dim=3, use_bias=False),
        (5, 4),
        {
            "query/kernel": (0,),
            "key/kernel": (0,),
            "value/kernel": (0,),
            "attention_output/kernel": (0, 1),
        },
    ),
}
# The rank-3 kernels that the variables alone (no agc_unit_axes) read as a convolution's, (0, 1):
# nothing beside them tells a multi-head or per-position kernel from a Conv1D kernel.
READ_AS_CONVOLUTION_WITHOUT_LAYERS = {
    ("einsum-heads-no-bias", "kernel"),
    ("einsum-per-position", "kernel"),
    *(("multi-head-attention-no-bias", f"{p}/kernel") for p in ("query", "key", "value")),
}


def layer_weights_and_gradients(kind):
    """The built layer, its weights set to be clipped in half of their units, their gradients and
    the weights' names within the layer."""
    make, input_shape, axes = KINDS[kind]
    keras.utils.set_random_seed(0)
    layer = make()
    inputs = keras.Input(input_shape)
    if isinstance(layer, keras.layers.MultiHeadAttention):
        layer(inputs, inputs)  # self-attention: query and value from the same sequence
    else:
        layer(inputs)
    variables = layer.trainable_variables
    names = [variable.path.split("/", 1)[1] for variable in variables]
    assert sorted(names) == sorted(axes)
    gradients = []
    for seed, (variable, name) in enumerate(zip(variables, names)):
        weight, gradient = weight_and_gradient(variable.shape, axes[name], CLIP_FACTOR, seed)
        variable.assign(weight)
        gradients.append(gradient)
    return layer, gradients, names


def check_against_numpy(kind, variables, gradients, names, clipped, axes_of):
    """Each clipped gradient against NumPy's over ``axes_of(name)``."""
    for variable, gradient, name, got in zip(variables, gradients, names, clipped):
        axes = axes_of(name)
        expected, clips = numpy_agc(variable.numpy(), gradient, axes, CLIP_FACTOR, EPS)
        if axes is not None and axes == KINDS[kind][2][name]:
            assert clips.any() and not clips.all(), name  # both branches of the clip are exercised
        difference = float(np.max(np.abs(got.numpy() - expected)))
        assert record(difference) <= ATOL, name
        if len(variable.shape) == 3:  # the other reading of a rank-3 kernel is far off
            other = (0, 1) if axes == (0,) else (0,)
            wrong, _ = numpy_agc(variable.numpy(), gradient, other, CLIP_FACTOR, EPS)
            assert float(np.max(np.abs(got.numpy() - wrong))) > 100 * ATOL, name


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_layer_kind_clips_its_units_as_numpy_does(kind):
    """adaptive_clip_gradients with the table agc_unit_axes reads from the layer."""
    layer, gradients, names = layer_weights_and_gradients(kind)
    variables = layer.trainable_variables
    clipped = gacli.adaptive_clip_gradients(
        gradients, variables, CLIP_FACTOR, EPS, unit_axes=gacli.agc_unit_axes(layer)
    )
    check_against_numpy(kind, variables, gradients, names, clipped, KINDS[kind][2].get)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_without_the_layers_only_bias_free_einsum_kernels_read_as_convolutions(kind):
    """adaptive_clip_gradients given the variables alone, as the wrappers call it today: every
    kind as above but the rank-3 kernels nothing beside them tells apart."""
    layer, gradients, names = layer_weights_and_gradients(kind)
    variables = layer.trainable_variables
    clipped = gacli.adaptive_clip_gradients(gradients, variables, CLIP_FACTOR, EPS)

    def axes_of(name):
        if (kind, name) in READ_AS_CONVOLUTION_WITHOUT_LAYERS:
            return (0, 1)
        return KINDS[kind][2][name]

    check_against_numpy(kind, variables, gradients, names, clipped, axes_of)


def test_agc_unit_axes_reads_nested_models_and_layers():
    keras.utils.set_random_seed(0)
    inner = keras.Sequential(
        [keras.Input((5, 4)), keras.layers.Conv1D(4, 2, name="conv")], name="inner"
    )
    inputs = keras.Input((5, 4))
    h = inner(inputs)
    h = keras.layers.MultiHeadAttention(2, 3, use_bias=False, name="attention")(h, h)
    model = keras.Model(inputs, keras.layers.Dense(1, name="head")(keras.layers.Flatten()(h)))
    assert gacli.agc_unit_axes(model) == {
        "inner/conv/kernel": (0, 1),
        "inner/conv/bias": None,
        "attention/query/kernel": (0,),
        "attention/key/kernel": (0,),
        "attention/value/kernel": (0,),
        "attention/attention_output/kernel": (0, 1),
        "head/kernel": (0,),
        "head/bias": None,
    }


def rank3_layers_model(seed=0):
    """Conv1D with and without bias, a multi-head EinsumDense [in, heads, dim] with a bias over
    (heads, dim), and a Dense head: every rank-3 reading gacli makes from the variables alone."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5, 4))
    h = keras.layers.Conv1D(6, 3, padding="same", name="conv")(inputs)
    h = keras.layers.Conv1D(4, 2, padding="same", use_bias=False, name="conv_no_bias")(h)
    heads = keras.layers.EinsumDense(
        "abc,cde->abde", output_shape=(5, 2, 3), bias_axes="de", name="heads"
    )(h)
    # Without a bias, only its layer tells this kernel [in, heads, dim] from a Conv1D's.
    bare = keras.layers.EinsumDense("abc,cde->abde", output_shape=(5, 2, 3), name="heads_no_bias")(
        h
    )
    both = keras.layers.Concatenate()([keras.layers.Flatten()(heads), keras.layers.Flatten()(bare)])
    outputs = keras.layers.Dense(1, name="head")(both)
    return keras.Model(inputs, outputs)


# rank3_layers_model's units (rank 1: the whole tensor).
CHOSEN_AXES = {
    "conv/kernel": (0, 1),
    "conv_no_bias/kernel": (0, 1),
    "heads/kernel": (0,),
    "heads/bias": (0,),
    "heads_no_bias/kernel": (0,),
    "head/kernel": (0,),
}
# The other reading of each rank-3 kernel, which a test shows gacli does not take.
OTHER_AXES = {
    **CHOSEN_AXES,
    "conv/kernel": (0,),
    "conv_no_bias/kernel": (0,),
    "heads/kernel": (0, 1),
    "heads_no_bias/kernel": (0, 1),
}


def reference_axes(variable, table=CHOSEN_AXES):
    if len(variable.shape) <= 1:
        return None
    return table[variable.path]


def numpy_update(model, x, y, learning_rate, table=CHOSEN_AXES):
    """Big-batch MSE gradient from a plain tape, clipped in NumPy, one SGD step in NumPy."""
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
    gradients = tape.gradient(loss, model.trainable_variables)
    updated = {}
    for variable, gradient in zip(model.trainable_variables, gradients):
        axes = reference_axes(variable, table)
        clipped, _ = numpy_agc(variable.numpy(), gradient.numpy(), axes, CLIP_FACTOR, EPS)
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
        model = gacli.GradientAccumulateModel(
            accum_steps=2,
            use_agc=True,
            clip_factor=CLIP_FACTOR,
            eps=EPS,
            inputs=base.inputs,
            outputs=base.outputs,
        )
        model.compile(optimizer=keras.optimizers.SGD(learning_rate), loss="mse")
    else:
        model = base
        # A plain model's optimizer learns the layers from the model's table.
        model.compile(
            optimizer=gacli.GradientAccumulateOptimizer(
                keras.optimizers.SGD(learning_rate),
                accum_steps=2,
                use_agc=True,
                clip_factor=CLIP_FACTOR,
                eps=EPS,
                agc_unit_axes=gacli.agc_unit_axes(base),
            ),
            loss="mse",
        )
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    differences = [
        float(np.max(np.abs(variable.numpy() - expected[variable.path])))
        for variable in model.trainable_variables
    ]
    assert record(max(differences), f"use_agc_rank3[{wrapper}]") <= 1e-6
    # The other rank-3 reading would move these kernels differently, by far more than 1e-6.
    for path in ("conv/kernel", "conv_no_bias/kernel", "heads/kernel", "heads_no_bias/kernel"):
        (variable,) = [v for v in model.trainable_variables if v.path == path]
        assert float(np.max(np.abs(variable.numpy() - other[path]))) > 1e-4, path
