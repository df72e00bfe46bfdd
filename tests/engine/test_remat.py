"""Contract row M1: recomputing activations in the backward pass changes no number a user sees."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import gacli
from gacli.engine import remat
from helpers import MICRO, K, make_data, record, weights_difference

SGD_TOLERANCE, ADAM_TOLERANCE = 1e-6, 1e-5

# Plain batch norm in training mode under accumulation is the point here (its moving statistics),
# not the advice against it.
pytestmark = pytest.mark.filterwarnings("ignore::gacli.engine.batchnorm.BatchNormWarning")


def block_stack(seed=0, batchnorm="keep", accum_steps=K, name="stack"):
    """Two blocks of Dense, batch norm, ReLU and Dropout, and a Dense head: the blocks have
    random layers and moving statistics, the two things a naive recomputation gets wrong. (No
    bias before batch norm: its gradient is zero but for round-off, which Adam would scale up to
    a step of the learning rate whatever its sign.)"""
    keras.utils.set_random_seed(seed)

    def norm():
        if batchnorm == "accumulate":
            return gacli.AccumBatchNormalization(accum_steps=accum_steps, momentum=0.5)
        return keras.layers.BatchNormalization(momentum=0.5)

    layers = [keras.Input((4,))]
    for _ in range(2):
        layers += [
            keras.layers.Dense(8, use_bias=False),
            norm(),
            keras.layers.ReLU(),
            keras.layers.Dropout(0.3),
        ]
    layers.append(keras.layers.Dense(1))
    return keras.Sequential(layers, name=name)


def fit_pair(make_model, wrapper, optimizer, epochs=1, jit_compile=False, remat_choice="every"):
    """The same run without and with recomputation: (model, model) after fit()."""
    x, y = make_data(70)  # windows of 64 then 6: a ragged last micro-batch and window
    models = []
    for choice in (None, remat_choice):
        model = make_model()
        if wrapper == "model":
            model = gacli.wrap_model(model, accum_steps=K, remat=choice)
            model.compile(optimizer=optimizer(), loss="mse", jit_compile=jit_compile)
        else:
            if choice is not None:
                model = gacli.recompute(model, remat=choice)
            model.compile(
                optimizer=gacli.GradientAccumulateOptimizer(optimizer(), accum_steps=K),
                loss="mse",
                jit_compile=jit_compile,
            )
        callbacks = gacli.accumulation_callbacks(model.optimizer) if wrapper == "optimizer" else []
        model.fit(
            x, y, batch_size=MICRO, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks
        )
        models.append(model)
    return models


@pytest.mark.exactness
@pytest.mark.parametrize(
    "wrapper, batchnorm, optimizer, jit_compile",
    [
        ("model", "accumulate", "adam", False),
        # XLA's compile takes about 10 s: out of the in-process lane, in the full suite.
        pytest.param("optimizer", "keep", "adam", True, marks=pytest.mark.slow),
    ],
)
def test_m1_fit_with_recomputation_equals_fit_without(wrapper, batchnorm, optimizer, jit_compile):
    make_optimizer = {
        "sgd": lambda: keras.optimizers.SGD(0.1),
        "adam": lambda: keras.optimizers.Adam(0.01),
    }[optimizer]
    tolerance = SGD_TOLERANCE if optimizer == "sgd" else ADAM_TOLERANCE
    if batchnorm == "accumulate":
        # AccumBatchNormalization's window is the wrapper's: no BatchNormWarning then.
        plain, recomputed = _fit_accumulate(make_optimizer, jit_compile)
    else:
        plain, recomputed = fit_pair(
            lambda: block_stack(batchnorm=batchnorm),
            wrapper,
            make_optimizer,
            jit_compile=jit_compile,
        )
    accumulator = gacli.find_accumulating_optimizer(recomputed.optimizer)
    assert int(accumulator.optimizer_step.numpy()) == 2  # windows of 64 and 6 samples
    # get_weights holds the moving statistics (and the window sums) beside the trained weights.
    assert record(weights_difference(plain.get_weights(), recomputed.get_weights())) <= tolerance
    untrained = block_stack(batchnorm=batchnorm).trainable_weights
    assert weights_difference(untrained, recomputed.trainable_weights) > 1e-2  # it trained


def _fit_accumulate(make_optimizer, jit_compile):
    x, y = make_data(70)
    models = []
    for choice in (None, 2):  # runs of 2 blocks
        model = gacli.wrap_model(block_stack(batchnorm="accumulate"), accum_steps=K, remat=choice)
        model.compile(optimizer=make_optimizer(), loss="mse", jit_compile=jit_compile)
        model.fit(x, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
        models.append(model)
    return models


def custom_loop(model, steps=3, jit_compile=False):
    """A user's loop under tf.function: (gradients of the last step, final variables)."""
    x, y = make_data(32)
    optimizer = keras.optimizers.SGD(0.1)

    @tf.function(jit_compile=jit_compile)
    def step():
        with tf.GradientTape() as tape:
            predictions = tf.cast(model(x, training=True), "float32")
            loss = tf.reduce_mean((predictions - y) ** 2)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return gradients

    for _ in range(steps):
        gradients = step()
    return [g.numpy() for g in gradients], [v.numpy() for v in model.variables]


@pytest.mark.exactness
def test_m1_custom_loop_gradients_and_statistics_equal():
    gradients, variables = custom_loop(block_stack())
    model = block_stack()
    recomputing = gacli.recompute(model)
    assert recomputing.trainable_variables == model.trainable_variables  # the same weights
    recomputed_gradients, recomputed_variables = custom_loop(recomputing)
    assert record(weights_difference(gradients, recomputed_gradients)) <= SGD_TOLERANCE
    # model.variables: weights, moving statistics and the dropout layers' seed states.
    assert record(weights_difference(variables, recomputed_variables)) <= SGD_TOLERANCE


def test_naive_recomputation_fails_what_m1_asserts(monkeypatch):
    """What plain tf.recompute_grad does, one half at a time: without the seed generators set
    back, the second pass draws new dropout masks (the gradients of a forward pass that never ran,
    so other weights); without the state put back, batch norm's moving statistics are updated
    twice a step. The comparison M1 makes fails for each."""
    model = block_stack()
    _, variables = custom_loop(model)
    paths = [v.path for v in model.variables]
    moving = [i for i, path in enumerate(paths) if "moving_" in path]
    trained = [
        i for i, path in enumerate(paths) if path in {v.path for v in model.trainable_variables}
    ]
    block_variables = remat._block_variables
    differences = {}
    for left_out in ("seeds", "state"):

        def naive(layers, left_out=left_out):
            seeds, state = block_variables(layers)
            return ([] if left_out == "seeds" else seeds), ([] if left_out == "state" else state)

        monkeypatch.setattr(remat, "_block_variables", naive)
        _, naive_variables = custom_loop(gacli.recompute(block_stack()))
        differences[left_out] = [
            record(
                weights_difference([variables[i] for i in part], [naive_variables[i] for i in part])
            )
            for part in (trained, moving)
        ]
    assert differences["seeds"][0] > 1e-2  # other masks: other weights
    assert differences["state"][0] == 0.0 and differences["state"][1] > 1e-2  # statistics twice


class Doubled(keras.layers.Layer):
    """x * 2, counting its calls (eager: one per forward pass, recomputed ones too)."""

    calls = 0

    def call(self, inputs):
        Doubled.calls += 1
        return inputs * 2.0


def test_blocks_really_run_again_in_the_backward_pass():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(8)(inputs)
    h = Doubled()(h)
    h = keras.layers.Dense(8)(h)
    outputs = keras.layers.Dense(1)(Doubled()(h))
    model = keras.Model(inputs, outputs)
    x, _ = make_data(8)
    counts = []
    for runner in (model, gacli.recompute(model)):
        Doubled.calls = 0
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(runner(x, training=True))
        after_forward = Doubled.calls
        tape.gradient(loss, model.trainable_variables)
        counts.append((after_forward, Doubled.calls))
    assert counts == [(2, 2), (2, 4)]  # each block's forward ran once more, in the backward pass
    assert [len(r) for r in (remat.plan_for(model, "every").segments,)] == [3]


class TwoBlocks(keras.Model):
    """A subclassed model whose blocks are attributes; training reaches them by call context."""

    def __init__(self, batchnorm="keep", **kwargs):
        super().__init__(**kwargs)
        self.block_a = keras.Sequential(
            [keras.layers.Dense(8), keras.layers.BatchNormalization(), keras.layers.Dropout(0.3)],
            name="block_a",
        )
        self.block_b = keras.Sequential(
            [keras.layers.Dense(8), keras.layers.BatchNormalization(), keras.layers.Dropout(0.3)],
            name="block_b",
        )
        self.head = keras.layers.Dense(1)

    def call(self, inputs):
        return self.head(self.block_b(tf.nn.relu(self.block_a(inputs))))


@pytest.mark.exactness
def test_m1_subclassed_model_with_named_blocks():
    x, y = make_data(70)
    models = []
    for choice in (None, ["block_a", "block_b"]):
        keras.utils.set_random_seed(0)
        model = TwoBlocks()
        model = gacli.wrap_model(model, accum_steps=K, remat=choice)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0)
        models.append(model)
    assert models[1].remat == ("block_a", "block_b")
    assert record(weights_difference(models[0].get_weights(), models[1].get_weights())) <= (
        SGD_TOLERANCE
    )


def test_remat_is_saved_with_the_model(tmp_path):
    model = gacli.wrap_model(block_stack(), accum_steps=K, remat=2)
    model.compile(optimizer="sgd", loss="mse")
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    assert loaded.remat == 2 and loaded.accumulation_config == model.accumulation_config
    x, _ = make_data(8)
    assert np.array_equal(loaded(x), model(x))


def test_refusals_name_what_to_pass():
    with pytest.raises(ValueError, match="Did you mean 'block_a'"):
        gacli.wrap_model(TwoBlocks(), accum_steps=2, remat=["blok_a"])
    with pytest.raises(ValueError, match="subclassed model.*remat=\\['block_a', 'block_b'\\]"):
        gacli.wrap_model(TwoBlocks(), accum_steps=2, remat="every")
    with pytest.raises(ValueError, match="not a choice of blocks"):
        gacli.wrap_model(block_stack(), accum_steps=2, remat=0)
    with pytest.raises(ValueError, match="setting of the model wrappers"):
        gacli.GradientAccumulateOptimizer("sgd", accum_steps=2, remat="every")
    # A skip connection from the input to the output spans every tensor in between: no cut.
    inputs = keras.Input((4,))
    h = keras.layers.Dense(4)(keras.layers.Dense(4)(inputs))
    spanned = keras.Model(inputs, keras.layers.Add()([inputs, h]))
    with pytest.raises(ValueError, match="cannot cut model"):
        gacli.recompute(spanned)
    with pytest.raises(ValueError, match="runs of 3 of its 3 blocks"):
        gacli.recompute(block_stack(), remat=3)  # 3 blocks (2 and the head): one run of all


@pytest.mark.exactness
@pytest.mark.parametrize("wrapper", ["model", "optimizer"])
def test_m1_check_equivalence_runs_with_recomputation_on(wrapper):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="tanh")(keras.layers.Dense(8)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    x, y = make_data(64)
    result = gacli.check_equivalence(
        model,
        x,
        y,
        accum_steps=4,
        micro_batch_size=16,
        optimizer=keras.optimizers.SGD(0.1),
        loss="mse",
        wrapper=wrapper,
        config=gacli.AccumulationConfig(accum_steps=4, remat="every"),
    )
    assert result.settings["remat"] == "every"
    assert result.passed and record(result.max_abs_diff) <= SGD_TOLERANCE
