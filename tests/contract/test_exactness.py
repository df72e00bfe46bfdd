"""Contract rows E1, E2, E4 and C3: accumulated training equals big-batch training."""

import keras
import numpy as np
import pytest

import gacli
from helpers import (
    MICRO,
    K,
    accumulating_model,
    big_batch_reference,
    custom_loop,
    epoch_windows,
    make_data,
    max_weight_difference,
    plain_model,
)

# Also run on the oldest supported TensorFlow and Keras (scripts/ci_oldest.sh).
pytestmark = pytest.mark.exactness


@pytest.mark.parametrize("wrapper", ["model", "optimizer"])
def test_e1_full_micro_batches_equal_big_batch(optimizer_case, wrapper):
    _, make_optimizer, tolerance = optimizer_case
    x, y = make_data(128)  # 2 windows an epoch, 3 epochs: 6 updates
    reference = big_batch_reference(make_optimizer, epoch_windows(128, MICRO * K, 3), x, y)
    model = accumulating_model(make_optimizer, wrapper)
    model.fit(x, y, batch_size=MICRO, epochs=3, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 6
    assert max_weight_difference(model, reference) <= tolerance


def test_e2_e4_ragged_data_model_wrapper(optimizer_case):
    """70 samples, micro 16, k 4: windows of 64 then 6 each epoch, weighted by real size."""
    _, make_optimizer, tolerance = optimizer_case
    x, y = make_data(70)
    reference = big_batch_reference(make_optimizer, epoch_windows(70, 64, 3), x, y)
    model = accumulating_model(make_optimizer, "model")
    model.fit(x, y, batch_size=MICRO, epochs=3, shuffle=False, verbose=0)
    accumulator = model.accumulating_optimizer
    assert int(accumulator.optimizer_step.numpy()) == 6
    assert int(accumulator.micro_step.numpy()) == 15
    assert int(accumulator.window_micro_steps.numpy()) == 0  # nothing left open
    assert max_weight_difference(model, reference) <= tolerance


def test_e2_e4_ragged_data_optimizer_wrapper_custom_loop(optimizer_case):
    _, make_optimizer, tolerance = optimizer_case
    x, y = make_data(70)
    reference = big_batch_reference(make_optimizer, epoch_windows(70, 64, 3), x, y)
    model = plain_model()
    optimizer = gacli.GradientAccumulateOptimizer(make_optimizer(), accum_steps=K)
    custom_loop(model, optimizer, x, y, MICRO, epochs=3)
    assert int(optimizer.iterations.numpy()) == 6
    assert int(optimizer.micro_step.numpy()) == 15
    assert max_weight_difference(model, reference) <= tolerance


def test_e4_drop_discards_the_partial_window():
    make_optimizer = lambda: keras.optimizers.Adam(0.01)  # noqa: E731
    x, y = make_data(70)
    windows = [np.arange(64)] * 3
    reference = big_batch_reference(make_optimizer, windows, x, y)
    model = accumulating_model(make_optimizer, "model", partial_window="drop")
    model.fit(x, y, batch_size=MICRO, epochs=3, shuffle=False, verbose=0)
    assert int(model.optimizer_step.numpy()) == 3
    assert int(model.micro_step.numpy()) == 15
    assert max_weight_difference(model, reference) <= 1e-5


def test_e4_carry_spans_epochs_and_is_applied_at_the_end():
    """carry: windows of 4 micro-batches across epoch ends; the remainder applied after fit."""
    make_optimizer = lambda: keras.optimizers.Adam(0.01)  # noqa: E731
    x, y = make_data(70)
    micro_batches = [np.arange(s, min(s + MICRO, 70)) for s in range(0, 70, MICRO)] * 3
    windows = [
        np.concatenate(micro_batches[i : i + K]) for i in range(0, len(micro_batches), K)
    ]  # 15 micro-batches: 3 full windows and one of 3 micro-batches at the end
    reference = big_batch_reference(make_optimizer, windows, x, y)
    model = accumulating_model(make_optimizer, "model", partial_window="carry")
    model.fit(x, y, batch_size=MICRO, epochs=3, shuffle=False, verbose=0)
    assert int(model.optimizer_step.numpy()) == 4
    assert max_weight_difference(model, reference) <= 1e-5


def test_e4_partial_window_is_applied_before_validation():
    """Validation loss after each epoch equals the big-batch model's, so the flush came first."""
    make_optimizer = lambda: keras.optimizers.SGD(0.1)  # noqa: E731
    x, y = make_data(70)
    x_val, y_val = make_data(20, seed=1)
    reference = plain_model()
    reference.compile(optimizer=make_optimizer(), loss="mse")
    expected = reference.fit(
        x, y, batch_size=64, epochs=2, shuffle=False, verbose=0, validation_data=(x_val, y_val)
    ).history
    model = accumulating_model(make_optimizer, "model")
    history = model.fit(
        x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0, validation_data=(x_val, y_val)
    ).history
    np.testing.assert_allclose(history["val_loss"], expected["val_loss"], rtol=1e-6)


@pytest.mark.parametrize("wrapper", ["model", "optimizer"])
def test_c3_history_loss_and_metrics_match_big_batch(wrapper):
    make_optimizer = lambda: keras.optimizers.Adam(0.01)  # noqa: E731
    samples = 70 if wrapper == "model" else 128  # the optimizer wrapper in plain fit: full windows
    x, y = make_data(samples)
    reference = plain_model()
    reference.compile(optimizer=make_optimizer(), loss="mse", metrics=["mae"])
    expected = reference.fit(x, y, batch_size=64, epochs=3, shuffle=False, verbose=0).history
    model = accumulating_model(make_optimizer, wrapper)
    model.compile(optimizer=model.optimizer, loss="mse", metrics=["mae"])
    history = model.fit(x, y, batch_size=MICRO, epochs=3, shuffle=False, verbose=0).history
    np.testing.assert_allclose(history["loss"], expected["loss"], rtol=1e-6)
    np.testing.assert_allclose(history["mae"], expected["mae"], rtol=1e-6)
    assert history["loss"][0] > history["loss"][-1]  # it trained


@pytest.mark.parametrize("wrapper", ["model", "optimizer"])
def test_closed_windows_leave_nothing_to_flush_at_epoch_ends(wrapper):
    """An epoch of whole windows ends with none open: no window function is traced (it cost
    seconds and ~10 MB of host memory at the first epoch end); a ragged epoch still flushes."""
    make_optimizer = lambda: keras.optimizers.SGD(0.1)  # noqa: E731
    x, y = make_data(128)
    model = accumulating_model(make_optimizer, wrapper)
    model.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0)
    accumulator = gacli.find_accumulating_optimizer(model.optimizer)
    assert accumulator._window_functions == {}
    assert int(accumulator.optimizer_step.numpy()) == 4
    model.fit(x[:80], y[:80], batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
    assert {kind for kind, _ in accumulator._window_functions} == {"flush"}
    assert (
        int(accumulator.optimizer_step.numpy()),
        int(accumulator.window_micro_steps.numpy()),
    ) == (6, 0)
