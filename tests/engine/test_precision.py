"""Contract row P1: float32 accumulators whatever the compute dtype, settable."""

import keras
import numpy as np
import pytest

import gacli
from helpers import big_batch_reference, make_data, max_weight_difference, mlp_layers, plain_model

# Also run on the oldest supported TensorFlow and Keras (scripts/ci_oldest.sh).
pytestmark = pytest.mark.exactness


@pytest.fixture
def policy(request):
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(request.param)
    yield request.param
    keras.mixed_precision.set_global_policy(previous)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"], indirect=True)
def test_p1_accumulators_are_float32_under_mixed_policies(policy):
    x, y = make_data(70)
    inputs, outputs = mlp_layers()
    model = gacli.GradientAccumulateModel(accum_steps=4, inputs=inputs, outputs=outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    before = [w.copy() for w in model.get_weights()]
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    accumulator = model.accumulating_optimizer
    assert {a.dtype for a in accumulator._accumulators} == {"float32"}
    assert model.layers[1].compute_dtype == policy.split("_")[1]
    assert int(accumulator.optimizer_step.numpy()) == 4
    assert np.isfinite(history["loss"]).all()
    # The weights really moved: no silent division by a loss scale (the older package's bug).
    assert max(np.abs(a - b).max() for a, b in zip(model.get_weights(), before)) > 1e-3
    if policy == "mixed_float16":
        # The accumulator scales the loss itself, instead of Keras' LossScaleOptimizer.
        assert model.optimizer is accumulator and accumulator.loss_scaling


def test_p1_accumulator_dtype_is_settable():
    inputs, outputs = mlp_layers()
    model = gacli.GradientAccumulateModel(
        accum_steps=2, accumulator_dtype="float64", inputs=inputs, outputs=outputs
    )
    model.compile(optimizer="sgd", loss="mse")
    model.optimizer.build(model.trainable_variables)
    assert {a.dtype for a in model.accumulating_optimizer._accumulators} == {"float64"}


def inject_inf(x, micro_batch, micro=16):
    x = x.copy()
    x[micro_batch * micro : (micro_batch + 1) * micro] = np.inf
    return x


@pytest.mark.parametrize("wrapper", ["model", "optimizer"])
@pytest.mark.parametrize("policy_name", ["skip_micro_batch", "skip_window"])
def test_p2_nonfinite_micro_batch_policies(policy_name, wrapper):
    """An inf in micro-batch 2 of window 1: skip_micro_batch trains on the window without it,
    skip_window skips window 1; both equal the big-batch run on what is left, and are counted.
    Loss scaling runs in float32 here, so the comparison is exact."""
    x, y = make_data(128)
    x_bad = inject_inf(x, micro_batch=1)
    make_optimizer = lambda: keras.optimizers.Adam(0.01)  # noqa: E731
    if policy_name == "skip_micro_batch":
        windows = [np.r_[0:16, 32:64], np.arange(64, 128)]
    else:
        windows = [np.arange(64, 128)]
    reference = big_batch_reference(make_optimizer, windows, x, y)
    optimizer = gacli.GradientAccumulateOptimizer(
        make_optimizer(), accum_steps=4, loss_scaling=True, nonfinite=policy_name
    )
    if wrapper == "model":
        inputs, outputs = mlp_layers()
        model = gacli.GradientAccumulateModel(accum_steps=4, inputs=inputs, outputs=outputs)
    else:
        model = plain_model()
    model.compile(optimizer=optimizer, loss="mse", auto_scale_loss=False)
    history = model.fit(x_bad, y, batch_size=16, epochs=1, shuffle=False, verbose=0).history
    assert max_weight_difference(model, reference) <= 1e-5
    if wrapper == "model":  # the counts are in fit()'s logs, for progress bars and TensorBoard
        assert history["loss_scale"] == [2.0**14]
        counter = {"skip_micro_batch": "skipped_micro_batches", "skip_window": "skipped_windows"}[
            policy_name
        ]
        assert history[counter] == [1]
    assert float(optimizer.loss_scale.numpy()) == 2.0**14  # halved once, at the overflow
    if policy_name == "skip_micro_batch":
        assert int(optimizer.skipped_micro_batches.numpy()) == 1
        assert int(optimizer.skipped_windows.numpy()) == 0
        assert int(optimizer.optimizer_step.numpy()) == 2
    else:
        assert int(optimizer.skipped_windows.numpy()) == 1
        assert int(optimizer.optimizer_step.numpy()) == 1


def test_p2_loss_scale_grows_after_clean_updates():
    x, y = make_data(128)
    model = plain_model()
    optimizer = gacli.GradientAccumulateOptimizer(
        keras.optimizers.SGD(0.1),
        accum_steps=2,
        loss_scaling=True,
        initial_scale=4.0,
        dynamic_growth_steps=2,
    )
    model.compile(optimizer=optimizer, loss="mse", auto_scale_loss=False)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)  # 4 updates
    assert float(optimizer.loss_scale.numpy()) == 16.0


def _trained(policy_name, build_model, x, y):
    keras.mixed_precision.set_global_policy(policy_name)
    try:
        model = build_model()
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        return model
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("policy_name", ["mixed_float16", "mixed_bfloat16"])
def test_p2_p3_mixed_precision_matches_big_batch_at_rounding_level(policy_name):
    """Under the same policy, accumulation differs from the big batch only by the policy's
    rounding: no more than the policy itself moves the big-batch run away from float32. The loss
    scale starts low enough that neither run overflows, so both see the same samples."""
    x, y = make_data(128)
    float16 = policy_name == "mixed_float16"

    def accumulated():
        inputs, outputs = mlp_layers()
        model = gacli.GradientAccumulateModel(accum_steps=4, inputs=inputs, outputs=outputs)
        model.compile(
            optimizer=gacli.GradientAccumulateOptimizer(
                keras.optimizers.SGD(0.1),
                accum_steps=4,
                loss_scaling=float16,
                initial_scale=256.0,
            ),
            loss="mse",
            auto_scale_loss=False,
        )
        return model

    def big_batch():
        model = plain_model()
        optimizer = keras.optimizers.SGD(0.1)
        if float16:
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer, initial_scale=256.0)
        model.compile(optimizer=optimizer, loss="mse")
        model.fit = _with_batch_size(model.fit, 64)
        return model

    gacli_run = _trained(policy_name, accumulated, x, y)
    policy_run = _trained(policy_name, big_batch, x, y)
    float32_run = _trained("float32", big_batch, x, y)
    if float16:
        assert float(gacli_run.optimizer.loss_scale.numpy()) == 256.0  # no overflow, no skip
    accumulation_error = max_weight_difference(gacli_run, policy_run)
    rounding = max_weight_difference(policy_run, float32_run)
    moved = max_weight_difference(float32_run, plain_model())
    print(
        f"{policy_name}: accumulation vs big batch {accumulation_error:.2e}, "
        f"policy vs float32 {rounding:.2e}, weights moved {moved:.2e}"
    )
    assert moved > 0.05  # the weights really moved (no silent division by the loss scale)
    assert accumulation_error <= 2 * rounding + 1e-6


def _with_batch_size(fit, batch_size):
    def fit_with(x, y, batch_size_=None, **kwargs):
        kwargs.pop("batch_size", None)
        return fit(x, y, batch_size=batch_size, **kwargs)

    return fit_with
