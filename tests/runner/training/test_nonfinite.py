"""Non-finite values never pass silently: nonfinite='stop' halts at the first bad micro-batch
with the weights of the last good update, ga-train names where and which samples, and result.json
stays strict JSON."""

import glob
import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import gacli
from gacli.runner.training.run_state import PassOrder, micro_batch_stream, pass_order
from helpers import (
    FEATURES,
    big_batch_reference,
    ga_train,
    make_data,
    max_weight_difference,
    mlp_layers,
    run_dir_of,
)


def test_stop_halts_at_the_first_bad_micro_batch_with_the_last_good_weights():
    x, y = make_data(64)
    x[40, 1] = np.nan  # micro-batch 6 of 8 (micro-batches of 8): the third window's second
    inputs, outputs = mlp_layers()
    model = gacli.GradientAccumulateModel(
        accum_steps=2, inputs=inputs, outputs=outputs, nonfinite="stop"
    )
    # Four micro-batches a compiled call: the call that meets the bad one runs on past it, and
    # neither it nor micro-batches 7 and 8 may reach the weights.
    model.compile(
        optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse", steps_per_execution=4
    )
    with pytest.raises(gacli.NonFiniteError) as stopped:
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert stopped.value.micro_step == 6
    assert "micro-batch 6" in str(stopped.value)
    reference = big_batch_reference(
        lambda: keras.optimizers.SGD(0.1, momentum=0.9), [np.arange(0, 16), np.arange(16, 32)], x, y
    )
    assert model.optimizer_step.numpy() == 2
    assert max_weight_difference(model, reference) <= 1e-6
    assert all(np.isfinite(weight).all() for weight in model.get_weights())


def test_stop_in_a_custom_loop_leaves_every_later_micro_batch_out():
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1)])
    optimizer = gacli.GradientAccumulateOptimizer(
        keras.optimizers.SGD(0.1), accum_steps=2, nonfinite="stop"
    )
    variables = model.trainable_variables
    finite = [tf.ones_like(v) for v in variables]
    optimizer.apply(finite, variables, sample_count=4)
    optimizer.apply(finite, variables, sample_count=4)  # update 1
    before = [v.numpy().copy() for v in variables]
    optimizer.apply([g * np.inf for g in finite], variables, sample_count=4)  # micro-step 3
    optimizer.apply(finite, variables, sample_count=4)
    optimizer.apply(finite, variables, sample_count=4)
    optimizer.flush()
    assert optimizer.halted_micro_step() == 3
    assert int(optimizer.optimizer_step.numpy()) == 1
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(before, variables))


def test_pass_order_names_the_samples_the_stream_reads():
    # The message of a halted run names samples through pass_order: it must follow the stream.
    data = tf.data.Dataset.range(50)
    stream = micro_batch_stream(data, 8, 7, start=0, count=14, order=PassOrder(3, buffer_size=50))
    read = np.concatenate([batch.numpy() for batch in stream])
    expected = np.concatenate(
        [pass_order(50, index, shuffle_seed=3, buffer_size=50) for index in (0, 1)]
    )
    assert np.array_equal(read, expected)


def strict(text):
    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.slow
def test_ga_train_stops_on_a_diverging_run_and_names_the_micro_batch(tmp_path):
    # A learning rate of 1e30 sends the weights to ~1e30 in one update: the next forward pass
    # overflows.
    code, output = ga_train(
        "optimizer.learning_rate=1e30",
        "epochs=2",
        "progress=plain",
        "checkpoint_every_updates=1",
        cwd=tmp_path,
    )
    assert code == 1, output
    assert "Traceback" not in output, output
    assert (
        "ga-train: training stopped at epoch 1, micro-batch 5 of 45: its loss or gradient was "
        "not finite (inf or nan). It held the samples at positions 128-159 of pass 1 over the "
        "training data (scikit-learn's digits: row "
    ) in output, output
    (run_dir,) = glob.glob(str(tmp_path / "outputs" / "default" / "*"))
    assert not os.path.exists(os.path.join(run_dir, "result.json"))
    assert not os.path.exists(os.path.join(run_dir, "model.keras"))
    failure = strict(open(os.path.join(run_dir, "failure.json")).read())
    assert failure["exit_code"] == 1 and "micro-batch 5 of 45" in failure["error"]
    # The checkpoint of update 1 is the last one: nothing after the bad micro-batch was saved.
    assert f"The last checkpoint, {run_dir}/checkpoints/ckpt-1, is from before it" in output
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == [
        "checkpoint",
        "ckpt-1.data-00000-of-00001",
        "ckpt-1.index",
    ]


@pytest.mark.slow
def test_skip_policies_stay_opt_in_and_result_json_is_strict(tmp_path):
    # Beyond precision.max_skipped_fraction (0.25) of micro-batches skipped, the run fails: it has
    # not trained on most of its data (here 12 of 16 micro-batches are skipped).
    job = ("optimizer.learning_rate=1e30", "epochs=1", "steps_per_epoch=4")
    code, output = ga_train(*job, "precision.nonfinite=skip_micro_batch", cwd=tmp_path)
    assert code == 1 and "Traceback" not in output, output
    assert (
        "ga-train: training stopped at the end of epoch 1: 12 of its 16 micro-batches so far (75%) "
        "were skipped because their loss or gradient was not finite (inf or nan), more than "
        "precision.max_skipped_fraction=0.25"
    ) in output, output
    (failed,) = glob.glob(str(tmp_path / "outputs" / "default" / "*"))
    assert not os.path.exists(os.path.join(failed, "result.json"))
    assert strict(open(os.path.join(failed, "failure.json")).read())["exit_code"] == 1
    # Allowed to skip them all, it finishes; nan is written as null in result.json.
    code, output = ga_train(
        *job,
        "precision.nonfinite=skip_micro_batch",
        "precision.max_skipped_fraction=1",
        cwd=tmp_path,
    )
    assert code == 0, output
    result = strict(open(os.path.join(run_dir_of(output), "result.json")).read())
    assert result["loss"] is None  # nan in the metrics: null, never NaN
    # Every micro-batch after the first update is non-finite and skipped: so are their windows.
    assert (result["optimizer_step"], result["micro_step"]) == (1, 16)


@pytest.mark.parametrize("policy", ["stop", "skip_micro_batch"])
def test_under_xla_a_non_finite_gradient_is_found_as_without_it(policy):
    """Under XLA on a CPU the non-finite elements of a gradient of 512 or more are counted by a
    matrix product (a reduction to one number is a slow sequential loop there). A nan in one
    sample of micro-batch 6 (of 8) reaches only some elements of the 40x70 kernel's gradient:
    XLA and not find it alike, and end with the same weights (measured: 2.98e-08 and 4.47e-08
    apart, stop and skip_micro_batch)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 40)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")
    x[40, 7] = np.nan
    ends = []
    for jit in (False, True):
        inputs, outputs = mlp_layers(0, features=40, hidden=70)
        model = gacli.GradientAccumulateModel(
            accum_steps=2, inputs=inputs, outputs=outputs, nonfinite=policy
        )
        model.compile(
            optimizer=keras.optimizers.SGD(0.1), loss="mse", steps_per_execution=4, jit_compile=jit
        )
        if policy == "stop":
            with pytest.raises(gacli.NonFiniteError) as stopped:
                model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
            assert stopped.value.micro_step == 6
            assert model.optimizer_step.numpy() == 2
        else:
            model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
            assert int(model.accumulating_optimizer.skipped_micro_batches.numpy()) == 1
            assert model.optimizer_step.numpy() == 4
        assert all(np.isfinite(weight).all() for weight in model.get_weights())
        ends.append(model.get_weights())
    apart = max(float(np.max(np.abs(a - b))) for a, b in zip(*ends))
    print(f"{policy}: XLA and not {apart:.2e} apart")
    assert apart <= 1e-6


def test_the_finiteness_test_by_a_scaled_product_finds_every_non_finite_element():
    """Without XLA on a CPU, a float32 gradient is tested by its product with a column of
    2**-64, summed: a nan, an infinity or both signs of it anywhere make it non-finite; finite
    elements as large as float32 holds (whose plain sum overflows) do not. Shapes with rows of
    16 or more take the product; a short row takes TensorFlow's own test; both agree with
    NumPy on every case."""
    import numpy as np
    import tensorflow as tf

    from gacli.engine import window

    rng = np.random.default_rng(0)
    traced_all_finite = tf.function(window._all_finite)  # one trace a shape, values as tensors
    for shape in [(784, 512), (512,), (3, 3, 8, 32), (40, 3), (16,)]:
        assert (window._scaled_product_rows(tf.zeros(shape)) is not None) == (shape[-1] >= 16)
        base = rng.normal(size=shape).astype("float32")
        cases = {"normal": base, "largest finite": np.full(shape, 3.4e38, "float32")}
        for name, value in [("nan", np.nan), ("inf", np.inf), ("-inf", -np.inf)]:
            bad = base.copy()
            bad.flat[rng.integers(bad.size)] = value
            cases[name] = bad
        both = base.copy()
        both.flat[0], both.flat[-1] = np.inf, -np.inf
        cases["inf and -inf"] = both
        huge_and_nan = cases["largest finite"].copy()
        huge_and_nan.flat[huge_and_nan.size // 2] = np.nan
        cases["largest finite and a nan"] = huge_and_nan
        for name, array in cases.items():
            expected = bool(np.isfinite(array).all())
            eager = bool(window._all_finite(tf.constant(array)))
            traced = bool(traced_all_finite(tf.constant(array)))
            assert eager == traced == expected, (shape, name)


def test_the_finiteness_test_by_the_squared_norm_keeps_finite_squares_that_overflow():
    """Without XLA the non-finite check reads the micro-batch's squared norm (which the noise
    scale shares): finite only if every element is, and where it is not (an inf or nan, or
    finite elements whose squares overflow float32) every element is tested. Both ways agree
    with NumPy on every case, traced without and with XLA."""
    from gacli.engine import window

    rng = np.random.default_rng(1)
    shapes = [(64, 32), (32,), (3, 3, 4, 16)]
    base = [rng.normal(size=shape).astype("float32") for shape in shapes]
    cases = {"normal": base, "squares overflow": [np.full(s, 1e20, "float32") for s in shapes]}
    for name, value in [("nan", np.nan), ("inf", np.inf), ("-inf", -np.inf)]:
        bad = [array.copy() for array in base]
        bad[2].flat[rng.integers(bad[2].size)] = value
        cases[name] = bad
    huge_and_nan = [array.copy() for array in cases["squares overflow"]]
    huge_and_nan[1].flat[5] = np.nan
    cases["squares overflow and a nan"] = huge_and_nan

    def check(gradients):
        return window.all_finite(gradients, window.squared_norm(gradients))

    def check_marked(gradients):
        # Under XLA on a CPU the check reads the noise scale's marked norm (no conditional).
        squared = window.squared_norm(gradients, marked=True)
        return window.all_finite(gradients, squared, marked=True), squared

    # Traced once each (the cases share shapes and dtypes; their values are tensors).
    traced = {
        jit: (tf.function(check, jit_compile=jit), tf.function(check_marked, jit_compile=jit))
        for jit in (False, True)
    }
    for name, arrays in cases.items():
        expected = all(bool(np.isfinite(array).all()) for array in arrays)
        gradients = [tf.constant(array) for array in arrays]
        squared = float(window.squared_norm(gradients))
        assert np.isfinite(squared) == (name == "normal"), name  # the fallback is exercised
        for jit in (False, True):
            found = bool(traced[jit][0](gradients))
            assert found == expected, (name, jit)
            found, marked = traced[jit][1](gradients)
            assert bool(found) == expected, (name, jit, "marked")
            # The same norm where every element is finite (inf where squares overflow).
            if expected:
                np.testing.assert_allclose(float(marked), squared, rtol=1e-6)


@pytest.mark.parametrize("jit", [False, True], ids=["eager-graph", "xla"])
@pytest.mark.parametrize("noise_scale", [False, True])
def test_a_micro_batch_whose_squares_overflow_is_kept_and_a_nan_one_dropped(noise_scale, jit):
    """In the engine, with the noise scale or without, with XLA and without: a micro-batch of
    finite gradients of 1e20 (their squared norm is inf in float32) is added as any other; one
    with a nan is dropped alone (skip_micro_batch), counted once. The kernel (40x32) is large
    enough for XLA's sums by matrix product on a CPU (the check's count of non-finite elements
    and the noise scale's squared norm)."""
    from gacli.engine import window

    model = keras.Sequential([keras.Input((40,)), keras.layers.Dense(32)])
    assert model.trainable_variables[0].shape.num_elements() >= 4 * window._ROW
    optimizer = gacli.GradientAccumulateOptimizer(
        keras.optimizers.SGD(1.0),
        accum_steps=3,
        nonfinite="skip_micro_batch",
        noise_scale=noise_scale,
    )
    variables = model.trainable_variables
    before = [v.numpy().copy() for v in variables]
    step = tf.function(
        lambda grads: optimizer.apply(grads, variables, sample_count=4), jit_compile=jit
    )
    huge = [tf.fill(v.shape, 1e20) for v in variables]
    ones = [tf.ones_like(v) for v in variables]
    step(huge)
    kernel = np.ones(variables[0].shape, "float32")
    kernel.flat[0] = np.nan
    step([tf.constant(kernel)] + ones[1:])
    step(ones)
    assert int(optimizer.skipped_micro_batches.numpy()) == 1
    assert int(optimizer.optimizer_step.numpy()) == 1
    # The window is the mean of the two kept micro-batches: (1e20 + 1) / 2 per element.
    for start, after in zip(before, variables):
        np.testing.assert_allclose(start - after.numpy(), np.full(start.shape, 5e19), rtol=1e-6)


@pytest.mark.parametrize("jit", [False, True], ids=["graph", "xla"])
@pytest.mark.parametrize("noise_scale", [False, True])
def test_sparse_rows_whose_squares_overflow_are_kept_and_nan_rows_dropped(noise_scale, jit):
    """An embedding's gradient (tf.IndexedSlices): with the noise scale on, its finiteness is
    read from the squared norm of its summed rows, shared with the noise scale (under XLA
    too); without, its values are tested. Either way a micro-batch of finite rows of 1e20 is
    added, one with a nan row is dropped alone and counted once."""
    model = keras.Sequential([keras.Input((2,), dtype="int32"), keras.layers.Embedding(10, 4)])
    optimizer = gacli.GradientAccumulateOptimizer(
        keras.optimizers.SGD(1.0),
        accum_steps=3,
        nonfinite="skip_micro_batch",
        noise_scale=noise_scale,
    )
    (table,) = model.trainable_variables
    before = table.numpy().copy()

    def rows(values, indices):
        values = tf.constant(np.asarray(values, "float32"))
        return tf.IndexedSlices(values, tf.constant(indices), dense_shape=tf.constant([10, 4]))

    step = tf.function(
        lambda grad: optimizer.apply([grad], [table], sample_count=2), jit_compile=jit
    )
    step(rows(np.full((2, 4), 1e20), [1, 1]))  # a repeated row: 2e20 in row 1
    bad = np.ones((2, 4))
    bad[1, 2] = np.nan
    step(rows(bad, [3, 5]))
    step(rows(np.ones((2, 4)), [3, 5]))
    assert int(optimizer.skipped_micro_batches.numpy()) == 1
    assert int(optimizer.optimizer_step.numpy()) == 1
    expected = np.zeros((10, 4), "float32")
    expected[1], expected[3], expected[5] = 1e20, 0.5, 0.5  # the mean of the 2 kept ones
    np.testing.assert_allclose(before - table.numpy(), expected, rtol=1e-6, atol=1e-6)


def test_a_micro_batch_without_gradients_passes_the_check():
    """Gradients that are all None (no variable was used) give the check nothing to test: the
    micro-step is counted and nothing is skipped."""
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1)])
    optimizer = gacli.GradientAccumulateOptimizer(
        keras.optimizers.SGD(0.1), accum_steps=2, nonfinite="stop"
    )
    variables = model.trainable_variables
    optimizer.apply([tf.ones_like(v) for v in variables], variables, sample_count=4)
    tf.function(lambda: optimizer.apply([None] * len(variables), variables, sample_count=4))()
    assert int(optimizer.skipped_micro_batches.numpy()) == 0
    assert optimizer.halted_micro_step() == 0


@pytest.mark.slow  # about 10 s: out of the in-process lane
def test_stop_halts_at_a_loss_that_overflowed_though_its_gradient_is_finite():
    """Targets near 1e30 in one micro-batch: its squared error overflows float32 to inf while its
    gradient (twice the error) stays finite. The loss is checked as the gradient is: the run
    halts there, and no update uses it."""
    x, y = make_data(32)
    y[16:24] = 1e30  # micro-batch 3 of 4 (micro-batches of 8): the second window's first
    inputs, outputs = mlp_layers()
    model = gacli.GradientAccumulateModel(
        accum_steps=2, inputs=inputs, outputs=outputs, nonfinite="stop"
    )
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    with pytest.raises(gacli.NonFiniteError) as stopped:
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert stopped.value.micro_step == 3
    assert model.optimizer_step.numpy() == 1
    reference = big_batch_reference(lambda: keras.optimizers.SGD(0.1), [np.arange(0, 16)], x, y)
    assert max_weight_difference(model, reference) <= 1e-6
