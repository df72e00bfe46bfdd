"""``python -m gacli.selfcheck``: does gacli hold on this machine's accelerator?

One command for a user or maintainer with a GPU (it runs on a CPU too, and says what it could not
check there). In order:

1. the machine: TensorFlow and Keras, the GPUs TensorFlow sees and whether TF32 is on;
2. exactness with TF32 off: both wrappers, with XLA and without, SGD with momentum and Adam, on
   ragged data for the model wrapper, against one big batch (docs/contract.md's tolerances); the
   same once with TF32 on, shown, not judged (what TF32 does to the comparison);
3. where the engine's state lives: every variable of the accumulating optimizer on the GPU;
4. ``ga-train`` as a user runs it: float32, ``mixed_float16`` (its loss scale logged) and
   ``jit_compile=true``, each a short run of the default job, with device memory logged on a GPU;
5. speed: samples per second of the model wrapper over plain ``fit`` at the same micro-batch,
   with XLA off and on (skipped with ``--quick``).

It ends with one table and exits 0 when every check passed, 1 otherwise. See docs/guides/gpu.md.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

PASS, FAIL, SKIP, INFO = "pass", "FAIL", "skip", "info"

MICRO, K = 16, 4
TOLERANCES = {"momentum": 1e-6, "adam": 1e-5}


def _optimizer(name):
    import keras

    if name == "momentum":
        return keras.optimizers.SGD(0.1, momentum=0.9)
    return keras.optimizers.Adam(0.01)


def _mlp(seed=0):
    import keras

    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(32, activation="tanh")(inputs)
    return inputs, keras.layers.Dense(1)(hidden)


def _data(samples):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, 8)).astype("float32")
    return x, (x @ rng.normal(size=(8, 1))).astype("float32")


def _big_batch(name, x, y, window, epochs):
    """Plain Keras, one ``train_on_batch`` per window of ``window`` samples."""
    import keras

    model = keras.Model(*_mlp())
    model.compile(optimizer=_optimizer(name), loss="mse")
    for _ in range(epochs):
        for start in range(0, len(x), window):
            model.train_on_batch(x[start : start + window], y[start : start + window])
    return model


def _accumulated(wrapper, name, x, y, epochs, jit_compile):
    import keras

    import gacli

    if wrapper == "model":
        inputs, outputs = _mlp()
        model = gacli.GradientAccumulateModel(accum_steps=K, inputs=inputs, outputs=outputs)
        optimizer = _optimizer(name)
    else:
        model = keras.Model(*_mlp())
        optimizer = gacli.GradientAccumulateOptimizer(_optimizer(name), accum_steps=K)
    model.compile(optimizer=optimizer, loss="mse", jit_compile=jit_compile)
    model.fit(x, y, batch_size=MICRO, epochs=epochs, shuffle=False, verbose=0)
    return model


def _difference(model, reference):
    import numpy as np

    return max(
        float(np.max(np.abs(a - b))) for a, b in zip(model.get_weights(), reference.get_weights())
    )


def exactness_checks(tf32_on_too=True):
    """(check, status, detail) rows: each wrapper, XLA off and on, both optimizers, TF32 off."""
    from gacli.engine.tf32 import tf32_mode

    rows = []
    with tf32_mode("off"):
        for wrapper in ("model", "optimizer"):
            # A plain fit() gives the optimizer wrapper whole windows only (it cannot see a
            # short micro-batch); the model wrapper gets ragged data: windows of 64 and 6.
            samples = 70 if wrapper == "model" else 128
            x, y = _data(samples)
            for name, tolerance in TOLERANCES.items():
                reference = _big_batch(name, x, y, MICRO * K, 3)
                for jit_compile in (False, True):
                    label = (
                        f"exact, {wrapper} wrapper, {name}, XLA {'on' if jit_compile else 'off'}"
                    )
                    try:
                        model = _accumulated(wrapper, name, x, y, 3, jit_compile)
                    except Exception as error:  # reported in the table: the check failed
                        rows.append((label, FAIL, f"{type(error).__name__}: {error}"[:200]))
                        continue
                    difference = _difference(model, reference)
                    status = PASS if difference <= tolerance else FAIL
                    rows.append((label, status, f"{difference:.2e} (at most {tolerance:g})"))
    if tf32_on_too:
        with tf32_mode("on"):
            x, y = _data(70)
            difference = _difference(
                _accumulated("model", "adam", x, y, 3, False), _big_batch("adam", x, y, 64, 3)
            )
        rows.append(("the same with TF32 on (model, adam)", INFO, f"{difference:.2e}"))
    return rows


def placement_check(gpus):
    """Every variable of the accumulating optimizer placed on the GPU."""
    if not gpus:
        return [("engine state on the GPU", SKIP, "no GPU visible")]
    import keras

    import gacli

    model = keras.Model(*_mlp())
    optimizer = gacli.GradientAccumulateOptimizer(
        keras.optimizers.Adam(0.01), accum_steps=K, noise_scale=True, use_agc=True
    )
    model.compile(optimizer=optimizer, loss="mse", jit_compile=True)
    x, y = _data(MICRO * K)
    model.fit(x, y, batch_size=MICRO, epochs=1, verbose=0)
    elsewhere = [v.path for v in optimizer.variables if "GPU" not in v.value.device.upper()]
    if elsewhere:
        return [("engine state on the GPU", FAIL, f"off the GPU: {', '.join(elsewhere[:4])}")]
    return [("engine state on the GPU", PASS, f"{len(optimizer.variables)} variables")]


def ga_train_checks(gpus, folder):
    """Short runs of the default job through the installed command line."""
    runs = {
        "ga-train, float32": ["precision=fp32"],
        "ga-train, mixed_float16": ["precision=mixed_float16"],
        "ga-train, jit_compile=true": ["jit_compile=true"],
    }
    command = [sys.executable, "-m", "gacli.runner.command.cli"]
    rows = []
    for index, (label, overrides) in enumerate(runs.items()):
        run_dir = os.path.join(folder, f"run{index}")
        arguments = ["epochs=1", "steps_per_epoch=20", "progress=none", "tf32=off"]
        finished = subprocess.run(
            [*command, *arguments, *overrides, f"hydra.run.dir={run_dir}"],
            capture_output=True,
            text=True,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
        )
        result_path = os.path.join(run_dir, "result.json")
        if finished.returncode != 0 or not os.path.exists(result_path):
            last = (finished.stderr or finished.stdout).strip().splitlines()[-1:] or ["no output"]
            rows.append((label, FAIL, f"exit {finished.returncode}: {last[0][:160]}"))
            continue
        with open(result_path) as file:
            result = json.load(file)
        detail = f"loss {result.get('loss', float('nan')):.4g}, {result['optimizer_step']} updates"
        memory = _device_peak(run_dir)
        if gpus:
            detail += f", device peak {memory / 2**20:.0f} MiB" if memory else ", NO device memory"
        rows.append((label, PASS if (memory or not gpus) else FAIL, detail))
    return rows


def _device_peak(run_dir):
    """The largest ``memory/device_peak_bytes`` a run logged (0 where it logged none)."""
    from gacli.report.run_events import event_files, read_file

    peaks = [
        point.value
        for path in event_files(run_dir)
        for point in read_file(path)[0].get("memory/device_peak_bytes", [])
    ]
    return max(peaks, default=0.0)


def speed_checks(repetitions=3):
    """Samples per second of the model wrapper over plain fit at the same micro-batch."""
    import keras
    import numpy as np

    import gacli

    x, y = _data(MICRO * K * 40)
    rows = []
    for jit_compile in (False, True):
        speeds = {"plain": [], "gacli": []}
        for _ in range(repetitions):
            for kind in ("plain", "gacli"):
                if kind == "plain":
                    model = keras.Model(*_mlp())
                else:
                    inputs, outputs = _mlp()
                    model = gacli.GradientAccumulateModel(
                        accum_steps=K, inputs=inputs, outputs=outputs
                    )
                model.compile(optimizer=_optimizer("adam"), loss="mse", jit_compile=jit_compile)
                model.fit(x[: MICRO * K], y[: MICRO * K], batch_size=MICRO, verbose=0)  # warm up
                start = time.perf_counter()
                model.fit(x, y, batch_size=MICRO, epochs=2, verbose=0)
                speeds[kind].append(2 * len(x) / (time.perf_counter() - start))
        ratio = float(np.median(speeds["gacli"]) / np.median(speeds["plain"]))
        rows.append(
            (
                f"speed, XLA {'on' if jit_compile else 'off'}",
                INFO,
                f"model wrapper / plain fit: {ratio:.2f}x "
                f"({np.median(speeds['plain']):,.0f} samples/s plain)",
            )
        )
    return rows


def machine_rows():
    import keras
    import tensorflow as tf

    from gacli.engine.tf32 import gpus_with_tf32, tf32_enabled

    gpus = tf.config.list_physical_devices("GPU")
    names = []
    for device in gpus:
        details = tf.config.experimental.get_device_details(device)
        capability = ".".join(str(part) for part in details.get("compute_capability", ()))
        names.append(f"{details.get('device_name', device.name)} (compute {capability or '?'})")
    rows = [
        ("TensorFlow / Keras", INFO, f"{tf.__version__} / {keras.__version__}"),
        ("GPUs", INFO if gpus else SKIP, "; ".join(names) or "none visible: CPU only"),
        (
            "TF32",
            INFO,
            ("on" if tf32_enabled() else "off")
            + (f", used by {gpus_with_tf32()[0]}" if gpus_with_tf32() else ", used by no device"),
        ),
    ]
    return rows, gpus


def print_table(rows, file=sys.stdout, verdict=True):
    width = max(len(check) for check, _, _ in rows)
    print(f"\n{'check'.ljust(width)}  result  detail", file=file, flush=True)
    for check, status, detail in rows:
        print(f"{check.ljust(width)}  {status.ljust(6)}  {detail}", file=file, flush=True)
    if not verdict:
        return
    failed = sum(status == FAIL for _, status, _ in rows)
    passed = sum(status == PASS for _, status, _ in rows)
    verdict = "FAILED" if failed else "PASSED"
    print(f"\ngacli self-check {verdict}: {passed} passed, {failed} failed", file=file)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m gacli.selfcheck",
        description="Check gacli's exactness, state placement, ga-train and speed on this "
        "machine's GPU (or CPU).",
    )
    parser.add_argument("--quick", action="store_true", help="skip the speed measurement")
    parser.add_argument("--no-ga-train", action="store_true", help="skip the ga-train runs")
    arguments = parser.parse_args(argv)
    started = time.time()
    rows, gpus = machine_rows()
    print_table(rows, verdict=False)  # the machine, before what may take minutes
    rows += exactness_checks()
    rows += placement_check(gpus)
    if not arguments.no_ga_train:
        with tempfile.TemporaryDirectory(prefix="gacli-selfcheck-") as folder:
            rows += ga_train_checks(gpus, folder)
    if not arguments.quick:
        rows += speed_checks()
    rows.append(("time", INFO, f"{time.time() - started:.0f} s"))
    print_table(rows)
    return 1 if any(status == FAIL for _, status, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
