"""On a GPU: engine state TensorFlow keeps on the device, TF32, device memory, loss scaling.

The first tests run everywhere: they enumerate the state both wrappers make with every feature
on and refuse int32 (TensorFlow keeps an int32 variable in host memory, where an XLA computation
on a GPU cannot reach it), and check the TF32 switch. The tests marked ``gpu`` need a visible GPU
and skip with the reason elsewhere; ``python -m gacli.selfcheck`` runs them on a GPU machine
(docs/guides/gpu.md).
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import gacli
from gacli.engine.tf32 import set_tf32, tf32_description, tf32_enabled, tf32_mode
from helpers import (
    MICRO,
    K,
    accumulating_model,
    big_batch_reference,
    compose_config,
    epoch_windows,
    event_tags,
    make_data,
    max_weight_difference,
    scalars,
)

GPUS = tf.config.list_physical_devices("GPU")
needs_gpu = pytest.mark.skipif(not GPUS, reason="no GPU visible to TensorFlow")

VOCABULARY = 20


def every_feature_model(wrapper):
    """An Embedding, an AccumBatchNormalization and a Dense head, with AGC, the noise scale,
    loss scaling and the non-finite stop all on, by either wrapper; built by one fit()."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,), dtype="int64")
    hidden = keras.layers.Flatten()(keras.layers.Embedding(VOCABULARY, 4)(inputs))
    hidden = gacli.AccumBatchNormalization(accum_steps=K)(keras.layers.Dense(8)(hidden))
    outputs = keras.layers.Dense(1)(hidden)
    features = dict(
        use_agc=True, noise_scale=True, loss_scaling=True, nonfinite="stop", accum_steps=K
    )
    if wrapper == "model":
        model = gacli.GradientAccumulateModel(inputs=inputs, outputs=outputs, **features)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", auto_scale_loss=False)
    else:
        model = keras.Model(inputs, outputs)
        optimizer = gacli.GradientAccumulateOptimizer(keras.optimizers.Adam(0.01), **features)
        model.compile(optimizer=optimizer, loss="mse", auto_scale_loss=False)
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCABULARY, (MICRO * K, 6))
    y = rng.normal(size=(MICRO * K, 1)).astype("float32")
    model.fit(x, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
    return model


@pytest.mark.parametrize("wrapper", ["model", "optimizer"])
def test_no_engine_state_is_int32(wrapper):
    """Every variable of the accumulating optimizer (its window, loss scale, non-finite guard,
    noise scale and the inner optimizer) and of the model (AccumBatchNormalization's window) is
    in a dtype TensorFlow keeps on the device."""
    model = every_feature_model(wrapper)
    accumulator = gacli.find_accumulating_optimizer(model.optimizer)
    state = list(accumulator.variables) + list(model.variables)
    names = {v.path.rsplit("/", 1)[-1] for v in state}
    # The enumeration reaches every part: a feature whose state went missing would pass vacuously.
    assert {"gradient_mask", "loss_scale", "halted_at_micro_step", "gns_state"} <= names
    assert "window_position" in names  # AccumBatchNormalization's
    assert any(name.endswith("_accumulator") for name in names)
    assert int(accumulator.optimizer_step.numpy()) == 1
    int32 = sorted(v.path for v in state if v.dtype == "int32")
    assert int32 == [], f"int32 state, kept in host memory on a GPU: {int32}"


def test_tf32_mode_sets_and_restores():
    before = set_tf32("on")
    try:
        with tf32_mode("off") as inside:
            assert inside is False and not tf32_enabled()
        assert tf32_enabled()
        with pytest.raises(RuntimeError), tf32_mode("off"):
            raise RuntimeError("restored even after an error")
        assert tf32_enabled()
        with tf32_mode("auto") as inside:
            assert inside is True  # auto leaves the caller's choice
        assert "no GPU" in tf32_description(True) or GPUS
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(before)


@needs_gpu
@pytest.mark.gpu
def test_engine_state_lives_on_the_gpu():
    model = every_feature_model("optimizer")
    accumulator = gacli.find_accumulating_optimizer(model.optimizer)
    elsewhere = [
        (v.path, v.value.device)
        for v in accumulator.variables
        if "GPU" not in v.value.device.upper()
    ]
    assert elsewhere == []


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("wrapper", ["model", "optimizer"])
def test_both_wrappers_exact_in_fit_under_xla_on_the_gpu(wrapper):
    """Keras' jit_compile="auto" becomes XLA on a GPU: the optimizer wrapper must train inside
    fit() there (it could not while its gradient mask was int32), exact with TF32 off."""
    make_optimizer = lambda: keras.optimizers.Adam(0.01)  # noqa: E731
    with tf32_mode("off"):
        x, y = make_data(128)
        reference = big_batch_reference(make_optimizer, epoch_windows(128, MICRO * K, 3), x, y)
        model = accumulating_model(make_optimizer, wrapper)
        model.compile(optimizer=model.optimizer, loss="mse", jit_compile=True)
        model.fit(x, y, batch_size=MICRO, epochs=3, shuffle=False, verbose=0)
        assert max_weight_difference(model, reference) <= 1e-5


@needs_gpu
@pytest.mark.gpu
def test_ga_train_on_the_gpu_logs_device_memory_and_loss_scale(tmp_path):
    from gacli.runner.training.run import train

    run_dir = str(tmp_path / "run")
    metrics = train(
        compose_config("epochs=1", "precision=mixed_float16", "tf32=off"), run_dir=run_dir
    )
    assert np.isfinite(metrics["loss"])
    tags, events = event_tags(run_dir)
    assert max(scalars(events, "memory/device_peak_bytes")) > 0
    assert scalars(events, "precision/loss_scale")[-1] >= 1.0
    result = json.load(open(os.path.join(run_dir, "result.json")))
    assert result["tf32"] is False


def compilations_by_epoch(output):
    """XLA programs compiled before the first epoch's line of ``progress=plain`` and after it, from
    TensorFlow's log of its XLA compilation cache (one line per program compiled)."""
    first, later, seen_epoch = 0, 0, False
    for line in output.splitlines():
        if line.startswith("epoch 1/"):
            seen_epoch = True
        elif "Instantly compiling for signature" in line:
            if seen_epoch:
                later += 1
            else:
                first += 1
    assert seen_epoch, output[-3000:]
    return first, later


@pytest.mark.slow
@pytest.mark.parametrize("wrapper", ["model", "optimizer"])
def test_ragged_epochs_under_xla_compile_nothing_after_the_first(tmp_path, wrapper):
    """70 samples: micro-batches of 16, 16, 16, 6 (train 52 + 18 validation: a short last
    micro-batch, a short last window, a short last validation batch). The first epoch compiles
    a program per shape; epochs 2 and 3 compile none (a new program per epoch was the suspect
    when a GPU run slowed near each epoch's end)."""
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "data.npz", x=rng.normal(size=(70, 6)), y=rng.integers(0, 3, 70))
    environment = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    environment.update(
        PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="device_compiler=2"
    )
    arguments = (
        "dataset=npz",
        f"dataset.path={tmp_path / 'data.npz'}",
        "dataset.validation_split=0.25",
        "micro_batch_size=16",
        "accum_steps=2",
        "epochs=3",
        f"wrapper={wrapper}",
        "partial_window=apply" if wrapper == "model" else "partial_window=carry",
        "jit_compile=true",
        "progress=plain",
        "hydra.run.dir=run",
    )
    # One stream, in the order written: the epoch lines (stdout) among TensorFlow's log (stderr).
    finished = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "ga-train"), *arguments],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
        env=environment,
    )
    code, output = finished.returncode, finished.stdout
    assert code == 0, output[-3000:]
    first, later = compilations_by_epoch(output)
    assert first >= 2, output[
        -4000:
    ]  # the log was read: at least the micro-step and the evaluation
    assert later == 0, f"{later} XLA programs compiled after the first epoch"


@pytest.mark.slow
def test_the_self_check_passes_and_reports_every_exactness_case(capsys):
    """``python -m gacli.selfcheck --quick --no-ga-train`` in-process: on a CPU it compares both
    wrappers with the big batch with TF32 off (XLA off and on, two optimizers), says that no GPU
    was there to check, and exits 0."""
    from gacli.runner.tools.selfcheck import main

    assert main(["--quick", "--no-ga-train"]) == 0
    output = capsys.readouterr().out
    exact = [line for line in output.splitlines() if line.startswith("exact, ")]
    assert len(exact) == 8 and all("  pass  " in line for line in exact), output
    assert "the same with TF32 on" in output
    if not GPUS:
        assert "engine state on the GPU" in output and "no GPU visible" in output
    assert "gacli self-check PASSED: 8 passed, 0 failed" in output
