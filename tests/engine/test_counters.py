"""Contract rows C1 and C2: two counters, and everything per-update acting once per update."""

import keras
import pytest

from helpers import (
    MICRO,
    K,
    accumulating_model,
    big_batch_reference,
    epoch_windows,
    make_data,
    max_weight_difference,
)

# Also run on the oldest supported TensorFlow and Keras (scripts/ci_oldest.sh).
pytestmark = pytest.mark.exactness

PER_UPDATE_FEATURES = {
    # A fast decay: counting micro-steps instead of updates would shrink the LR 16x per window.
    "lr_schedule": lambda: keras.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(0.2, decay_steps=1, decay_rate=0.5)
    ),
    "ema": lambda: keras.optimizers.Adam(0.02, use_ema=True, ema_momentum=0.5),
    "clipnorm": lambda: keras.optimizers.SGD(0.1, clipnorm=0.05),
    "global_clipnorm": lambda: keras.optimizers.SGD(0.1, global_clipnorm=0.05),
    "clipvalue": lambda: keras.optimizers.SGD(0.1, clipvalue=0.01),
    "weight_decay": lambda: keras.optimizers.AdamW(0.02, weight_decay=0.5),
}


@pytest.mark.parametrize("wrapper", ["model", "optimizer"])
@pytest.mark.parametrize("feature", sorted(PER_UPDATE_FEATURES))
def test_c2_per_update_features_match_big_batch(feature, wrapper):
    make_optimizer = PER_UPDATE_FEATURES[feature]
    x, y = make_data(128)
    windows = epoch_windows(128, MICRO * K, 2)
    reference = big_batch_reference(make_optimizer, windows, x, y)
    reference.optimizer.finalize_variable_values(reference.trainable_variables)  # as fit() does
    model = accumulating_model(make_optimizer, wrapper)
    model.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0)
    tolerance = 1e-5 if "adam" in type(reference.optimizer).__name__.lower() else 1e-6
    assert max_weight_difference(model, reference) <= tolerance
    if feature == "lr_schedule":
        # The schedule was evaluated at update 4, not micro-step 16.
        assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(0.2 * 0.5**4)


@pytest.mark.parametrize("wrapper", ["model", "optimizer"])
def test_c1_counters(wrapper):
    x, y = make_data(70)
    model = accumulating_model(lambda: keras.optimizers.SGD(0.1), wrapper)
    model.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0)
    optimizer = model.optimizer
    assert int(optimizer.micro_step.numpy()) == 10  # 5 micro-batches an epoch
    if wrapper == "model":
        assert int(optimizer.optimizer_step.numpy()) == 4  # a full and a partial window an epoch
    else:
        # A plain keras.Model's fit() tells the optimizer neither batch sizes nor epoch ends: its
        # windows run across epochs (micro-batches 1-4, 5-8) and the open one (9-10) is applied
        # when fit() ends.
        assert int(optimizer.optimizer_step.numpy()) == 3
    assert int(optimizer.window_micro_steps.numpy()) == 0
    assert optimizer.iterations is optimizer.inner_optimizer.iterations
