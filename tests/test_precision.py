"""Contract row P1: float32 accumulators whatever the compute dtype, settable."""

import keras
import numpy as np
import pytest
from conftest import make_data, mlp_layers

import gacli


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
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)


def test_p1_accumulator_dtype_is_settable():
    inputs, outputs = mlp_layers()
    model = gacli.GradientAccumulateModel(
        accum_steps=2, accumulator_dtype="float64", inputs=inputs, outputs=outputs
    )
    model.compile(optimizer="sgd", loss="mse")
    model.optimizer.build(model.trainable_variables)
    assert {a.dtype for a in model.accumulating_optimizer._accumulators} == {"float64"}
