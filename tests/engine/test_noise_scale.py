"""The gradient noise scale measured from the micro-batches (noise_scale=True) against a direct
calculation: every example's gradient of a softmax regression at fixed weights (learning rate 0),
computed in NumPy, gives |G|^2 and tr(Sigma) exactly."""

import json
import os

import pytest

from helpers import (
    event_tags,
    ga_train,
    mlp_layers,
    moving_average,
    noise_scale_run,
    run_dir_of,
    scalars,
)


@pytest.fixture(scope="module")
def clean_and_noisy():
    return noise_scale_run(1.5), noise_scale_run(4.0)


def test_noise_scale_agrees_with_per_example_gradients(clean_and_noisy):
    """Averaged over the windows of 4 epochs, the engine's |G|^2, tr(Sigma) and B_simple are
    within 5% of the direct values (measured: 0.5%, 1.5% and 1.0%); the smoothed B_simple
    within 15% (measured: 4.6%)."""
    (grad_sq, trace), windows, summary = clean_and_noisy[0]
    estimated_grad_sq, estimated_trace = windows.mean(axis=0)
    direct = trace / grad_sq
    estimated = estimated_trace / estimated_grad_sq
    print(
        f"direct |G|^2 {grad_sq:.4f} tr {trace:.4f} B_simple {direct:.2f}; engine "
        f"{estimated_grad_sq:.4f} {estimated_trace:.4f} {estimated:.2f}; smoothed "
        f"{summary['noise_scale']:.2f} over {summary['windows']} windows"
    )
    assert summary["windows"] == len(windows) == 4 * 64  # 64 windows an epoch, the ragged one too
    assert estimated_grad_sq == pytest.approx(grad_sq, rel=0.05)
    assert estimated_trace == pytest.approx(trace, rel=0.05)
    assert estimated == pytest.approx(direct, rel=0.05)
    assert summary["noise_scale"] == pytest.approx(direct, rel=0.15)


def test_noisier_labels_raise_the_noise_scale_by_the_direct_factor(clean_and_noisy):
    """Noisier labels: B_simple rises by the factor the direct calculation gives, within 5%
    (measured: x1.80 directly, x1.86 by the engine)."""
    ratios = []
    for (grad_sq, trace), windows, _ in clean_and_noisy:
        estimated_grad_sq, estimated_trace = windows.mean(axis=0)
        ratios.append((trace / grad_sq, estimated_trace / estimated_grad_sq))
    direct_factor = ratios[1][0] / ratios[0][0]
    engine_factor = ratios[1][1] / ratios[0][1]
    print(f"noisier labels: B_simple x{direct_factor:.3f} direct, x{engine_factor:.3f} engine")
    assert direct_factor > 1.3
    assert engine_factor == pytest.approx(direct_factor, rel=0.05)


def test_no_estimate_without_two_batch_sizes():
    """accum_steps=1 on one device: the micro-batch is the window, there is nothing to compare."""
    _, windows, summary = noise_scale_run(1.5, epochs=1, accum_steps=1)
    assert summary["windows"] == 0 and summary["noise_scale"] == 0.0
    assert not windows.any()  # the raw estimates were never set


@pytest.mark.slow
def test_ga_train_logs_the_noise_scale_and_says_what_it_means(tmp_path):
    """ga-train with monitor.gns=true: gns/* in TensorBoard (read back), the value in
    result.json, and one line in the summary comparing it with the effective batch. Off by
    default (it costs the MLP benchmark more than 2%: docs/guides/batch-size.md), which
    test_cli.py's default run checks (no gns/* tag, no such line)."""
    code, output = ga_train("epochs=2", "monitor.gns=true", cwd=tmp_path)
    assert code == 0, output
    run_dir = run_dir_of(output)
    tags, events = event_tags(run_dir)
    assert {"gns/noise_scale", "gns/grad_sq", "gns/trace_cov"} <= tags
    logged = scalars(events, "gns/noise_scale")
    result = json.load(open(os.path.join(run_dir, "result.json")))
    assert result["gradient_noise_scale"] == pytest.approx(logged[-1], rel=1e-6)
    assert logged[-1] > 0
    assert "noise scale" in output and "effective batch 128" in output


def test_under_xla_the_squared_norms_and_estimates_are_those_without_it():
    """Under XLA on a CPU the squares are summed by a matrix product (a reduction to one number
    is a sequential loop there, a quarter of the MLP's micro-step): the sums and the noise scale
    equal TensorFlow's own kernel's, to float32 rounding. Sizes with and without a remainder
    of 128, and one below the product's threshold. Measured: sums within 1e-6 of float64,
    B_simple 3.1e-06 apart, one window's raw |G|^2 3.8e-06 apart (of terms of ~60)."""
    import keras
    import numpy as np
    import tensorflow as tf

    import gacli
    from gacli.engine.window import sum_of_squares

    rng = np.random.default_rng(0)
    tensors = [rng.normal(size=shape).astype("float32") for shape in [(784, 130), (640,), (7, 9)]]
    compiled = tf.function(lambda t: sum_of_squares(t), jit_compile=True)
    for tensor in tensors:
        # The product is what is traced for 512 elements or more, not for the 63 of (7, 9).
        graph = compiled.get_concrete_function(tf.TensorSpec(tensor.shape)).graph
        by_product = "MatMul" in {op.type for op in graph.get_operations()}
        assert by_product == (tensor.size >= 512)
        exact = float(np.sum(np.square(tensor.astype(np.float64))))
        assert float(compiled(tf.constant(tensor))) == pytest.approx(exact, rel=1e-6)
        assert float(sum_of_squares(tf.constant(tensor))) == pytest.approx(exact, rel=1e-6)

    x = rng.normal(size=(160, 784)).astype("float32")
    y = rng.integers(0, 10, 160)
    estimates = []
    for jit in (False, True):
        inputs, outputs = mlp_layers(1, features=784, hidden=130, outputs=10, activation="relu")
        model = gacli.GradientAccumulateModel(
            accum_steps=4, noise_scale=True, inputs=inputs, outputs=outputs
        )
        model.compile(
            optimizer=keras.optimizers.SGD(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=jit,
        )
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        estimates.append(model.accumulating_optimizer.noise_scale())
    plain, xla = estimates
    print(plain, xla)
    assert plain["windows"] == xla["windows"] == 3  # two full windows and the short one
    for key in ("noise_scale", "grad_sq", "trace_cov", "trace_raw"):
        assert xla[key] == pytest.approx(plain[key], rel=1e-5), key
    # One window's |G|^2 is a difference of two squared norms of the order of tr(Sigma) / b,
    # which cancel here (-0.24 from terms of ~60): their rounding is its scale.
    assert xla["grad_sq_raw"] == pytest.approx(plain["grad_sq_raw"], abs=1e-6 * plain["trace_raw"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_windows_estimates_are_the_formulas_on_its_gradients(dtype):
    """One window of ragged micro-batches given to the optimizer wrapper: its raw |G|^2 and
    tr(Sigma) are the two-size formulas worked in float64 on the gradients handed in, to
    float32 rounding. With float32 variables |G_B|^2 comes from the gradient the update
    applies; with bfloat16 ones that gradient is rounded to bfloat16, so it comes from the
    float32 accumulators. Measured: tr(Sigma) 1.5e-7 and 1.7e-7 off; from the rounded gradient
    it was 3.4e-4 off."""
    import keras
    import numpy as np
    import tensorflow as tf

    import gacli

    rng = np.random.default_rng(3)
    counts = [3, 5, 8]
    shapes = [(40, 7), (7,)]
    # Gradients in the variables' dtype; the reference works on their values in float64.
    grads = [
        [np.asarray(tf.cast(rng.normal(size=shape), dtype), "float64") for shape in shapes]
        for _ in counts
    ]
    variables = [keras.Variable(np.zeros(shape), dtype=dtype) for shape in shapes]
    optimizer = gacli.GradientAccumulateOptimizer(
        keras.optimizers.SGD(0.0), accum_steps=len(counts), noise_scale=True
    )
    for micro, count in zip(grads, counts):
        optimizer.apply([tf.constant(g, dtype) for g in micro], variables, sample_count=count)

    def squared(gradients):
        return sum(float(np.sum(np.square(g))) for g in gradients)

    big = sum(counts)
    window = [sum(c * micro[i] for c, micro in zip(counts, grads)) / big for i in range(2)]
    mean_sq = np.mean([squared(micro) for micro in grads])
    mean_inverse = np.mean([1.0 / c for c in counts])
    spread = mean_inverse - 1.0 / big
    trace = (mean_sq - squared(window)) / spread
    grad_sq = (squared(window) * mean_inverse - mean_sq / big) / spread
    measured = optimizer.noise_scale()
    print(dtype, measured, grad_sq, trace)
    assert measured["windows"] == 1
    assert measured["trace_raw"] == pytest.approx(trace, rel=1e-5)
    # |G|^2 is a difference of terms of the order of tr(Sigma) / b: their rounding is its scale.
    assert measured["grad_sq_raw"] == pytest.approx(grad_sq, abs=1e-6 * trace)


def test_measured_every_third_window_the_estimates_are_those_windows():
    """noise_scale_every=3 measures windows 0, 3, 6, ... of the optimizer's updates and no
    other: at fixed weights each measured window's raw estimates equal those of the run that
    measures every window, and the smoothed values are the bias-corrected moving average
    (decay 0.95) of those windows alone. Measured: equal to the last digit."""
    import numpy as np

    _, every_window, _ = noise_scale_run(1.5, epochs=1)
    _, raw, summary = noise_scale_run(1.5, epochs=1, every=3)
    measured = every_window[::3]
    assert summary["windows"] == len(measured) == 22  # 64 windows: 0, 3, ..., 63
    # After window w the raw estimates are those of the last measured window at or before w.
    np.testing.assert_array_equal(raw, every_window[(np.arange(len(raw)) // 3) * 3])
    grad_sq, trace = moving_average(measured)
    print(summary, trace / grad_sq)
    assert summary["grad_sq"] == pytest.approx(grad_sq, rel=1e-5)
    assert summary["trace_cov"] == pytest.approx(trace, rel=1e-5)
    assert summary["noise_scale"] == pytest.approx(trace / grad_sq, rel=1e-5)


def test_the_reading_is_float32_arithmetic_on_the_state():
    """The logger's reading of the state vector, worked in Python floats, gives the numbers
    NumPy's float32 arithmetic gives: on random states over float32's whole range and on every
    combination of signed zeros, infinities, nan, the largest and smallest float32 numbers and
    weights about the 1e-12 floor."""
    import itertools
    import math

    import numpy as np

    from gacli.engine.window import NoiseScale

    def in_float32(state):
        with np.errstate(all="ignore"):
            weight = np.maximum(state[4], np.float32(1e-12))
            grad_sq, trace = state[2] / weight, state[3] / weight
            scale = trace / grad_sq if grad_sq != 0 else np.float32(0.0)
        return [float(v) for v in (grad_sq, trace, scale, state[0], state[1])] + [int(state[5])]

    rng = np.random.default_rng(0)
    with np.errstate(over="ignore"):  # beyond float32's range: an infinity
        states = [
            np.append(rng.normal(size=5) * 10.0 ** rng.integers(-45, 39, size=5), 7).astype(
                "float32"
            )
            for _ in range(5000)
        ]
    largest = float(np.finfo(np.float32).max)
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, largest, -largest, 1e-45, -1e-45]
    special += [1e-12, 1e-13, 1.5]
    states += [
        np.array([1, 2, g, t, w, 4], "float32") for g, t, w in itertools.product(special, repeat=3)
    ]
    noise = NoiseScale(0.9)
    for state in states:
        for got, want in zip(noise.reading(state), in_float32(state)):
            assert type(got) is type(want)
            assert (math.isnan(got) and math.isnan(want)) or (
                got == want and math.copysign(1, got) == math.copysign(1, want)
            ), (state, got, want)
