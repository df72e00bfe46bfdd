"""Models saved by an earlier release of gacli still load (contract row C4 across releases).

The files in tests/fixtures/release_0_1_0/ were saved by gacli 0.1.0 (commit b67c725, Keras 3.15,
TensorFlow 2.21), before gacli's modules moved into folders: Keras finds gacli's classes by their
registered names ("gacli>GradientAccumulateModel", ...), which must outlive the modules' paths.
They were made by this code, with the layers and schedule that gacli registers:

    x, y = rng.normal(size=(24, 4)), rng.normal(size=(24, 1))  # rng = default_rng(0), float32
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    h = gacli.AccumBatchNormalization(accum_steps=3)(keras.layers.Dense(6)(inputs))
    h = BatchGroupNormalization(groups=2, axis=-2)(keras.layers.Reshape((6, 1))(h))
    outputs = keras.layers.Dense(1)(keras.layers.Flatten()(h))
    model = gacli.GradientAccumulateModel(
        accum_steps=3, partial_window="drop", inputs=inputs, outputs=outputs
    )
    schedule = LinearWarmup(keras.optimizers.schedules.ExponentialDecay(0.01, 10, 0.9), 2)
    model.compile(optimizer=keras.optimizers.Adam(schedule), loss="mse")
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False)  # 6 micro-batches: 2 windows
    model.save("model_wrapper.keras")

    keras.utils.set_random_seed(1)
    plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    plain.compile(optimizer=gacli.GradientAccumulateOptimizer(optimizer, accum_steps=2), loss="mse")
    plain.fit(x, y, batch_size=4, epochs=1, shuffle=False)
    plain.save("optimizer_wrapper.keras")

expected.npz holds x and both models' predictions on it at the time they were saved.
"""

import os
import subprocess
import sys

import keras
import numpy as np

import gacli

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "release_0_1_0")


def _expected():
    return np.load(os.path.join(FIXTURES, "expected.npz"))


def test_a_model_wrapper_saved_by_0_1_0_loads_with_its_settings_and_weights():
    expected = _expected()
    model = keras.models.load_model(os.path.join(FIXTURES, "model_wrapper.keras"))
    assert isinstance(model, gacli.GradientAccumulateModel)
    assert (model.accum_steps, model.partial_window.value) == (3, "drop")
    kinds = {type(layer).__name__ for layer in model.layers}
    assert {"AccumBatchNormalization", "BatchGroupNormalization"} <= kinds
    optimizer = model.optimizer
    assert isinstance(optimizer, gacli.GradientAccumulateOptimizer)
    assert int(optimizer.micro_step.numpy()) == int(expected["model_micro_step"]) == 6
    schedule = optimizer.inner_optimizer.get_config()["learning_rate"]
    assert schedule["registered_name"] == "gacli>LinearWarmup"
    np.testing.assert_array_equal(
        model.predict(expected["x"], verbose=0), expected["model_wrapper"]
    )


def test_an_optimizer_wrapper_saved_by_0_1_0_loads_with_its_window():
    expected = _expected()
    model = keras.models.load_model(os.path.join(FIXTURES, "optimizer_wrapper.keras"))
    optimizer = model.optimizer
    assert isinstance(optimizer, gacli.GradientAccumulateOptimizer)
    assert optimizer.accum_steps == 2
    assert int(optimizer.micro_step.numpy()) == int(expected["optimizer_micro_step"]) == 6
    assert isinstance(optimizer.inner_optimizer, keras.optimizers.SGD)
    np.testing.assert_array_equal(
        model.predict(expected["x"], verbose=0), expected["optimizer_wrapper"]
    )


def test_import_gacli_alone_lets_keras_load_them():
    """The package's docstring promises: ``import gacli`` and then ``load_model`` (no other
    import of gacli's modules), in a fresh process."""
    code = (
        "import gacli, keras, sys\n"
        f"model = keras.models.load_model({os.path.join(FIXTURES, 'model_wrapper.keras')!r})\n"
        "print(type(model).__name__, type(model.optimizer).__name__, model.accum_steps)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == [
        "GradientAccumulateModel",
        "GradientAccumulateOptimizer",
        "3",
    ]
