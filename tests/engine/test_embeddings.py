"""Contract row E5: an embedding's sparse gradient (tf.IndexedSlices) is accumulated row by row,
and a window equals the big batch with each repeated row's occurrences summed, which is the
dense big batch. The accumulation step builds no tensor the size of the table."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import gacli
from gacli.engine.options import Reduction
from gacli.engine.window import Window, squared_norm
from helpers import (
    EMBEDDING_DIM,
    MICRO,
    OPTIMIZERS,
    SEQUENCE,
    K,
    embedding_big_batch_reference,
    embedding_layers,
    embedding_model,
    epoch_windows,
    max_weight_difference,
    record,
    token_data,
    weights_difference,
)

# Also run on the oldest supported TensorFlow and Keras (scripts/ci_oldest.sh).
pytestmark = pytest.mark.exactness

SPARSE_OPTIMIZERS = ("adam", "adamw", "momentum")
# 70 samples, micro-batches of 16, k=4: windows of 64 and 6 samples each epoch (E2's raggedness).
SAMPLES, EPOCHS = 70, 3


def ragged_windows():
    return epoch_windows(SAMPLES, MICRO * K, EPOCHS)


def test_e5_the_summed_reference_is_the_dense_big_batch_and_raw_slices_are_not():
    """Why the reference sums repeated rows: Keras' Adam, handed the raw IndexedSlices, squares
    each occurrence of a row on its own in the second moment."""
    make_optimizer, _ = OPTIMIZERS["adam"]
    x, y = token_data(SAMPLES)
    summed, dense, raw = (
        embedding_big_batch_reference(make_optimizer, ragged_windows(), x, y, form=form)
        for form in ("summed", "dense", "raw")
    )
    assert record(weights_difference(summed.get_weights(), dense.get_weights())) <= 1e-7
    assert record(weights_difference(summed.get_weights(), raw.get_weights())) > 1e-3


@pytest.mark.parametrize(
    "optimizer, jit_compile, loss_scaling",
    [(name, False, False) for name in SPARSE_OPTIMIZERS]
    + [("adam", True, False), ("momentum", True, False), ("adam", False, True)],
)
def test_e5_model_wrapper_equals_summed_rows_big_batch(optimizer, jit_compile, loss_scaling):
    """Ragged windows; with XLA; with loss scaling, whose unscaling and non-finite check then
    act on the sparse rows."""
    make_optimizer, tolerance = OPTIMIZERS[optimizer]
    x, y = token_data(SAMPLES)
    reference = embedding_big_batch_reference(make_optimizer, ragged_windows(), x, y)
    inputs, outputs = embedding_layers()
    model = gacli.GradientAccumulateModel(
        accum_steps=K, loss_scaling=loss_scaling, inputs=inputs, outputs=outputs
    )
    model.compile(optimizer=make_optimizer(), loss="mse", jit_compile=jit_compile)
    model.fit(x, y, batch_size=MICRO, epochs=EPOCHS, shuffle=False, verbose=0)
    assert int(model.optimizer.optimizer_step.numpy()) == 2 * EPOCHS
    assert max_weight_difference(model, reference) <= tolerance


def sparse_micro_step(model, optimizer, micro):
    """A user's compiled micro-step for the embedding model (``micro``: its fixed size, or None),
    passing the micro-batch's sample count."""
    loss_fn = keras.losses.MeanSquaredError()

    @tf.function(
        input_signature=[
            tf.TensorSpec((micro, SEQUENCE), tf.int32),
            tf.TensorSpec((micro, 1), tf.float32),
        ]
    )
    def micro_step(x_batch, y_batch):
        with tf.GradientTape() as tape:
            loss = optimizer.scale_loss(loss_fn(y_batch, model(x_batch, training=True)))
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(
            zip(gradients, model.trainable_variables), sample_count=tf.shape(x_batch)[0]
        )

    return micro_step


@pytest.mark.parametrize("optimizer", SPARSE_OPTIMIZERS)
def test_e5_custom_loop_equals_summed_rows_big_batch(optimizer):
    make_optimizer, tolerance = OPTIMIZERS[optimizer]
    x, y = token_data(SAMPLES)
    reference = embedding_big_batch_reference(make_optimizer, ragged_windows(), x, y)
    model = embedding_model()
    accumulator = gacli.GradientAccumulateOptimizer(make_optimizer(), accum_steps=K)
    micro_step = sparse_micro_step(model, accumulator, micro=None)  # the last one is short
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(MICRO)
    for _ in range(EPOCHS):
        for x_batch, y_batch in dataset:
            micro_step(x_batch, y_batch)
        accumulator.finish_epoch()
    assert int(accumulator.iterations.numpy()) == 2 * EPOCHS
    assert max_weight_difference(model, reference) <= tolerance


# Ops that may hold the table's size in the accumulation step: reading a variable by its handle
# aliases its buffer (the forward pass's lookup reads the table that way).
NOT_A_COPY = {"ReadVariableOp", "VarHandleOp", "Placeholder"}


def micro_step_ops(graph):
    """``graph``'s own ops and those of the conditional that adds a micro-batch unless the
    non-finite check drops it (both run every micro-batch); not the bodies of the window's
    conditionals, which run once a window."""
    from gacli.engine.window import ADD_IF_KEPT

    for op in graph.get_operations():
        yield op
        if op.type in ("If", "StatelessIf") and ADD_IF_KEPT in op.name:
            for branch in ("then_branch", "else_branch"):
                yield from micro_step_ops(graph._get_function(op.get_attr(branch).name).graph)


def table_sized_tensors(graph, table_size):
    """(op type, name, shape) of every tensor of ``micro_step_ops(graph)`` with at least
    ``table_size`` elements or a size unknown when traced."""
    found = []
    for op in micro_step_ops(graph):
        if op.type in NOT_A_COPY:
            continue
        for output in op.outputs:
            if output.dtype == tf.resource or output.shape.rank in (None, 0):
                continue
            size = output.shape.num_elements()
            if size is None or size >= table_size:
                found.append((op.type, op.name, output.shape.as_list()))
    return found


@pytest.mark.parametrize(
    "settings",
    [{}, {"loss_scaling": True, "nonfinite": "skip_micro_batch", "noise_scale": True}],
    ids=["plain", "loss-scaling-nonfinite-noise-scale"],
)
def test_e5_an_accumulation_step_builds_no_table_sized_tensor(settings):
    """The traced micro-step (forward, backward, unscaling, non-finite check, squared norm,
    accumulation) holds nothing as large as the table. Densifying the gradient, as gacli did
    before, made 1 such tensor a micro-batch, 7 with these settings. The window's update (a
    graph conditional) may read the table once a window."""
    # A table larger than any activation of the step (16 x 6 x 8 values).
    vocabulary = 1000
    model = embedding_model(vocabulary=vocabulary)
    optimizer = gacli.GradientAccumulateOptimizer(
        keras.optimizers.Adam(0.01), accum_steps=K, **settings
    )
    optimizer.build(model.trainable_variables)
    graph = sparse_micro_step(model, optimizer, MICRO).get_concrete_function().graph
    assert table_sized_tensors(graph, vocabulary * EMBEDDING_DIM) == []
    assert "ResourceScatterAdd" in {op.type for op in micro_step_ops(graph)}


def table_window():
    """A (6, 2) table and a Window over it, its state in plain variables."""

    def add_state(name, shape=(), dtype="float32", per_replica=False, initial_value=0.0):
        return tf.Variable(tf.fill(shape, tf.cast(initial_value, dtype)))

    table = tf.Variable(tf.zeros((6, 2)))
    window = Window(accum_steps=2, reduction=Reduction.mean, dtype="float32")
    window.build(add_state, [table])
    return table, window


def test_e5_window_sums_repeated_rows_and_squares_their_sum():
    """Window.add on rows with repeats: the accumulator holds their dense sum, and
    window.squared_norm (the noise scale's |g_i|^2) is that of the summed rows, not of each
    occurrence."""
    table, window = table_window()
    values = np.array([[1.0, 2.0], [3.0, -1.0], [0.5, 0.5], [-4.0, 1.0]], "float32")
    indices = np.array([4, 1, 4, 4], "int32")
    dense = np.zeros((6, 2), "float32")
    np.add.at(dense, indices, 2.0 * values)
    rows = tf.IndexedSlices(tf.constant(values), tf.constant(indices), (6, 2))
    window.add({0: rows}, factor=tf.constant(2.0), keep=tf.constant(True))
    squared = squared_norm([rows], tf.constant(2.0))
    np.testing.assert_allclose(window.accumulators[0].numpy(), dense)
    np.testing.assert_allclose(float(squared), float(np.sum(dense**2)), rtol=1e-6)
    window.add(
        {0: tf.IndexedSlices(tf.constant(values), tf.constant(indices), (6, 2))},
        factor=None,
        keep=tf.constant(False),
    )
    np.testing.assert_allclose(window.accumulators[0].numpy(), dense)


def test_e5_window_update_takes_and_zeroes_only_the_rows_it_holds():
    """Without XLA, a sparse accumulator's window gradient is the tf.IndexedSlices of the rows
    it holds, each once, whose dense form is the dense window gradient; the reset after the
    update zeroes those rows in place and no other (no table-sized zeros)."""
    table, window = table_window()
    values = np.array([[1.0, 2.0], [3.0, -1.0], [0.5, 0.5]], "float32")
    indices = np.array([4, 1, 4], "int32")
    window.add({0: tf.IndexedSlices(tf.constant(values), tf.constant(indices), (6, 2))}, None, None)
    dense = window.accumulators[0].numpy() / 4.0
    (rows_gradient,), rows = window.gradients([0], [table], tf.constant(4.0), by_rows=True)
    assert isinstance(rows_gradient, tf.IndexedSlices)
    assert sorted(rows_gradient.indices.numpy().tolist()) == [1, 4]
    np.testing.assert_array_equal(tf.convert_to_tensor(rows_gradient).numpy(), dense)
    (dense_gradient,), no_rows = window.gradients([0], [table], tf.constant(4.0))
    assert no_rows == {} and not isinstance(dense_gradient, tf.IndexedSlices)
    np.testing.assert_array_equal(dense_gradient.numpy(), dense)
    # A value in a row the window did not hold stays: only the rows given are zeroed.
    window.accumulators[0].scatter_nd_update([[2]], [[7.0, 7.0]])
    window.reset(rows)
    expected = np.zeros((6, 2), "float32")
    expected[2] = 7.0
    np.testing.assert_array_equal(window.accumulators[0].numpy(), expected)
