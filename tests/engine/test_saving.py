"""Contract rows C4 and C5: wrapping adds no weights; saving keeps settings and the open window."""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import gacli
from helpers import MICRO, K, accumulating_model, make_data, max_weight_difference, plain_model

# Also run on the oldest supported TensorFlow and Keras (scripts/ci_oldest.sh).
pytestmark = pytest.mark.exactness


@pytest.mark.parametrize("wrapper", ["model", "optimizer"])
def test_c4_count_params_unchanged_and_save_load_keeps_settings(wrapper, tmp_path):
    x, y = make_data(70)
    model = accumulating_model(
        lambda: keras.optimizers.Adam(0.01),
        wrapper,
        partial_window="drop",
        accumulator_dtype="float64",
    )
    assert model.count_params() == plain_model().count_params()
    model.fit(x, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
    assert model.count_params() == plain_model().count_params()
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    optimizer = loaded.optimizer
    assert isinstance(optimizer, gacli.GradientAccumulateOptimizer)
    assert optimizer.accum_steps == K
    assert optimizer.partial_window.value == "drop"
    assert optimizer.accumulator_dtype == "float64"
    assert int(optimizer.micro_step.numpy()) == 5
    assert isinstance(optimizer.inner_optimizer, keras.optimizers.Adam)
    if wrapper == "model":
        assert isinstance(loaded, gacli.GradientAccumulateModel)
        assert (loaded.accum_steps, loaded.partial_window) == (K, "drop")
    assert max_weight_difference(model, loaded) == 0.0
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


class SaveMidWindow(keras.callbacks.Callback):
    """Saves the model after micro-batch 6 of the first epoch: half-way through window 2."""

    def __init__(self, path):
        super().__init__()
        self.path = path

    def on_train_batch_end(self, batch, logs=None):
        if batch == 5 and not self.path.exists():
            self.model.save(self.path)


@pytest.mark.parametrize("wrapper", ["model", "optimizer"])
def test_c5_resume_mid_window_equals_uninterrupted(wrapper, tmp_path):
    x, y = make_data(128)  # 8 micro-batches an epoch
    path = tmp_path / "mid_window.keras"
    make_optimizer = lambda: keras.optimizers.Adam(0.01)  # noqa: E731
    uninterrupted = accumulating_model(make_optimizer, wrapper)
    uninterrupted.fit(
        x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0, callbacks=[SaveMidWindow(path)]
    )
    resumed = keras.models.load_model(path)
    accumulator = gacli.find_accumulating_optimizer(resumed.optimizer)
    assert int(accumulator.window_micro_steps.numpy()) == 2  # the open window was saved
    assert float(np.abs(accumulator._accumulators[0].numpy()).sum()) > 0
    # The rest of epoch 1 (micro-batches 7 and 8), then epoch 2.
    resumed.fit(x[96:], y[96:], batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
    resumed.fit(x, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
    assert int(accumulator.micro_step.numpy()) == 16
    assert int(accumulator.optimizer_step.numpy()) == 4
    assert max_weight_difference(resumed, uninterrupted) <= 1e-6


def test_c5_tf_train_checkpoint_carries_the_open_window(tmp_path):
    """tf.train.Checkpoint (what ga-train writes) also holds accumulators and both counters."""
    x, y = make_data(128)
    model = accumulating_model(lambda: keras.optimizers.SGD(0.1), "model")
    model.fit(x[:48], y[:48], batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
    # 3 micro-batches are not a full window, but the epoch ended: the window was applied.
    optimizer = model.accumulating_optimizer
    grads = [tf.ones_like(v) for v in model.trainable_variables]
    optimizer.apply(grads, model.trainable_variables, sample_count=8)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    saved = checkpoint.write(str(tmp_path / "ckpt"))

    other = accumulating_model(lambda: keras.optimizers.SGD(0.1), "model", seed=1)
    other.optimizer.build(other.trainable_variables)
    tf.train.Checkpoint(model=other, optimizer=other.optimizer).read(saved).assert_consumed()
    restored = other.accumulating_optimizer
    assert int(restored.micro_step.numpy()) == 4
    assert int(restored.optimizer_step.numpy()) == 1
    assert int(restored.window_micro_steps.numpy()) == 1
    assert float(restored.window_weight.numpy()) == 8.0
    for a, b in zip(restored._accumulators, optimizer._accumulators):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert max_weight_difference(model, other) == 0.0


SAVE_ALL_KINDS = """
import sys
import keras, numpy as np
import gacli
x, y = np.ones((8, 3), "float32"), np.ones((8, 1), "float32")
inputs = keras.Input((3,))
functional = gacli.GradientAccumulateModel(accum_steps=2, inputs=inputs,
                                           outputs=keras.layers.Dense(1)(inputs))
wrapped = gacli.wrap_model(keras.Sequential([
    keras.Input((3,)), keras.layers.Dense(2), gacli.AccumBatchNormalization(accum_steps=2),
    keras.layers.Dense(1)]), 2)
plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
for name, model, optimizer in (("functional", functional, "adam"), ("wrapped", wrapped, "sgd"),
                               ("plain", plain, gacli.GradientAccumulateOptimizer("adam", 2))):
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=4, verbose=0)
    model.save(f"{sys.argv[1]}/{name}.keras")
"""

LOAD = """
{imports}
import sys
for name in ("functional", "wrapped", "plain"):
    model = keras.models.load_model(f"{{sys.argv[1]}}/{{name}}.keras")
    print(name, type(model).__name__, type(model.optimizer).__name__)
"""


ENVIRONMENT = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("saved")
    saved = subprocess.run(
        [sys.executable, "-c", SAVE_ALL_KINDS, str(folder)],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENVIRONMENT,
    )
    assert saved.returncode == 0, saved.stderr[-3000:]
    return folder


# Slow: a Python process a case, each loading TensorFlow.
@pytest.mark.slow
@pytest.mark.parametrize(
    "imports",
    [
        "import gacli\nimport keras",
        "import keras\nimport gacli",
        "import gacli\nimport tensorflow as tf\nkeras = tf.keras",
        # A gacli module that imports Keras itself, first: the other modules register too.
        "from gacli.engine.accumulation import GradientAccumulateOptimizer\nimport keras",
    ],
)
def test_saved_models_load_in_a_new_process_after_import_gacli(imports, saved_models):
    """No other import: gacli's classes are registered when Keras loads."""
    loaded = subprocess.run(
        [sys.executable, "-c", LOAD.format(imports=imports), str(saved_models)],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENVIRONMENT,
    )
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert loaded.stdout.split("\n")[:3] == [
        "functional GradientAccumulateModel GradientAccumulateOptimizer",
        "wrapped GradientAccumulateModel GradientAccumulateOptimizer",  # a Sequential wraps as one
        "plain Sequential GradientAccumulateOptimizer",
    ], loaded.stdout
