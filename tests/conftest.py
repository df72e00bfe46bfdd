"""Shared fixtures: a tiny regression problem and big-batch reference runs.

Every exactness test compares an accumulated run with a plain Keras run that sees the same samples
as one batch per window, starting from the same weights.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

FEATURES = 4


def make_data(num_samples=70, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_samples, FEATURES)).astype("float32")
    y = (x @ rng.normal(size=(FEATURES, 1)) + 0.1 * rng.normal(size=(num_samples, 1)))
    return x, y.astype("float32")


def mlp_layers(seed=0):
    """Symbolic inputs/outputs of a small MLP with deterministic initial weights."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    outputs = keras.layers.Dense(1)(hidden)
    return inputs, outputs


def plain_model(seed=0):
    inputs, outputs = mlp_layers(seed)
    return keras.Model(inputs, outputs)


# Every weight difference a test measures, by test: printed at the end of the run, so the numbers
# behind each contract row are visible, not just "passed".
MEASURED = {}
_current_test = {"id": None}


@pytest.fixture(autouse=True)
def _name_measurements(request):
    _current_test["id"] = request.node.nodeid.split("::", 1)[-1]
    yield
    _current_test["id"] = None


def max_weight_difference(model_a, model_b):
    difference = max(
        float(np.max(np.abs(a - b))) for a, b in zip(model_a.get_weights(), model_b.get_weights())
    )
    MEASURED.setdefault(_current_test["id"], []).append(difference)
    return difference


def pytest_terminal_summary(terminalreporter):
    if not MEASURED:
        return
    terminalreporter.section("measured max abs weight differences")
    for test_id, values in sorted(MEASURED.items()):
        terminalreporter.write_line(f"{test_id:<72} {', '.join(f'{v:.2e}' for v in values)}")


def big_batch_reference(make_optimizer, windows, x, y, loss="mse", seed=0):
    """Plain Keras, one ``train_on_batch`` per window of sample indices; returns the model."""
    model = plain_model(seed)
    model.compile(optimizer=make_optimizer(), loss=loss)
    for window in windows:
        model.train_on_batch(x[window], y[window])
    return model


def epoch_windows(num_samples, window_size, epochs):
    """Windows of ``window_size`` consecutive samples, restarting each epoch (partial_window=apply)."""
    windows = []
    for _ in range(epochs):
        for start in range(0, num_samples, window_size):
            windows.append(np.arange(start, min(start + window_size, num_samples)))
    return windows


OPTIMIZERS = {
    "sgd": (lambda: keras.optimizers.SGD(0.1), 1e-6),
    "momentum": (lambda: keras.optimizers.SGD(0.1, momentum=0.9), 1e-6),
    "adam": (lambda: keras.optimizers.Adam(0.01), 1e-5),
    "adamw": (lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05), 1e-5),
    "rmsprop": (lambda: keras.optimizers.RMSprop(0.01), 1e-5),
}


@pytest.fixture(params=sorted(OPTIMIZERS))
def optimizer_case(request):
    """(name, optimizer factory, tolerance) for every optimizer of contract row E1."""
    make, tolerance = OPTIMIZERS[request.param]
    return request.param, make, tolerance
