"""Models saved by an earlier release of gacli still load (contract row C4 across releases).

The models are saved by gacli 0.1.0 itself (commit b67c725, before gacli's modules moved into
folders), taken from the repository's git history and run by
tests/fixtures/release_0_1_0/make_models.py in a process of its own; the current gacli then loads
them. Keras finds gacli's classes by their registered names ("gacli>GradientAccumulateModel",
...), which must outlive the modules' paths. They are made at test time, not kept in git (saved
models are run outputs).
"""

import os
import shutil
import subprocess
import sys

import keras
import numpy as np
import pytest

import gacli

# Slow: gacli 0.1.0 saves its models in a Python process of its own, and one test loads them in
# another, each loading TensorFlow.
pytestmark = pytest.mark.slow

RELEASE = "b67c725"  # gacli 0.1.0
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAKER = os.path.join(ROOT, "tests", "fixtures", "release_0_1_0", "make_models.py")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The folder holding what gacli 0.1.0 saved: model_wrapper.keras, optimizer_wrapper.keras
    and expected.npz."""
    known = subprocess.run(
        ["git", "-C", ROOT, "cat-file", "-e", f"{RELEASE}^{{commit}}"], capture_output=True
    )
    if shutil.which("git") is None or known.returncode != 0:
        pytest.skip(f"needs the repository's git history (commit {RELEASE}, gacli 0.1.0)")
    source, out = tmp_path_factory.mktemp("gacli_0_1_0"), tmp_path_factory.mktemp("saved")
    archive = subprocess.run(
        ["git", "-C", ROOT, "archive", "--format=tar", RELEASE, "gacli"],
        capture_output=True,
        check=True,
    )
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive.stdout, check=True)
    made = subprocess.run(
        [sys.executable, MAKER, str(source)],
        cwd=out,
        env=dict(os.environ, PYTHONPATH=str(source), TF_CPP_MIN_LOG_LEVEL="3"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-2000:]
    return str(out)


def test_a_model_wrapper_saved_by_0_1_0_loads_with_its_settings_and_weights(saved):
    expected = np.load(os.path.join(saved, "expected.npz"))
    model = keras.models.load_model(os.path.join(saved, "model_wrapper.keras"))
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


def test_an_optimizer_wrapper_saved_by_0_1_0_loads_with_its_window(saved):
    expected = np.load(os.path.join(saved, "expected.npz"))
    model = keras.models.load_model(os.path.join(saved, "optimizer_wrapper.keras"))
    optimizer = model.optimizer
    assert isinstance(optimizer, gacli.GradientAccumulateOptimizer)
    assert optimizer.accum_steps == 2
    assert int(optimizer.micro_step.numpy()) == int(expected["optimizer_micro_step"]) == 6
    assert isinstance(optimizer.inner_optimizer, keras.optimizers.SGD)
    np.testing.assert_array_equal(
        model.predict(expected["x"], verbose=0), expected["optimizer_wrapper"]
    )


def test_import_gacli_alone_lets_keras_load_them(saved):
    """The package's docstring promises: ``import gacli`` and then ``load_model`` (no other
    import of gacli's modules), in a fresh process."""
    code = (
        "import gacli, keras, sys\n"
        f"model = keras.models.load_model({os.path.join(saved, 'model_wrapper.keras')!r})\n"
        "print(type(model).__name__, type(model.optimizer).__name__, model.accum_steps)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == [
        "GradientAccumulateModel",
        "GradientAccumulateOptimizer",
        "3",
    ]
