"""The noise scale's cost on the MLP, measured in one process by alternation.

On a machine that other jobs share, a process's speed moves by a factor of 2 within minutes, so
the ratio of two fresh processes (``bench.py``'s ``gacli_model_gns`` against ``gacli_model``) needs
many repetitions to mean anything. Here both models (the model wrapper without and with
``noise_scale=True``, MLP 784-512-256-10, b=32, k=8, SGD, a window per compiled call) are built
and compiled once in the same process, then trained in turns of a few windows each, the order
swapped every round: a busy second hits both alike. Each round gives one paired ratio (samples/s
with the noise scale over without); the median and range over the rounds are printed and written
to results/gns_alternating.md.

    python benchmarks/gns_alternating.py [--rounds 30] [--windows 5]
"""

import argparse
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent


def build(jit, noise_scale, data):
    import keras

    import gacli

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((784,)),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model = gacli.wrap_model(model, accum_steps=8, noise_scale=noise_scale)
    model.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit,
        steps_per_execution=8,
    )
    model.fit(data, steps_per_epoch=32, epochs=1, verbose=0)  # trace, compile, warm up
    return model


def paired_ratios(jit, rounds, windows):
    """One ratio per round: samples/s with the noise scale over without."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.random((2560, 784), dtype=np.float32)
    y = rng.integers(0, 10, 2560)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(32).repeat()
    models = {False: build(jit, False, data), True: build(jit, True, data)}
    ratios = []
    for round_index in range(rounds):
        seconds = {}
        for noise_scale in (True, False) if round_index % 2 else (False, True):
            start = time.perf_counter()
            models[noise_scale].fit(data, steps_per_epoch=8 * windows, epochs=1, verbose=0)
            seconds[noise_scale] = time.perf_counter() - start
        ratios.append(seconds[False] / seconds[True])
    return ratios


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--windows", type=int, default=5, help="windows of 256 per turn")
    parser.add_argument("--out", default=str(HERE / "results" / "gns_alternating.md"))
    args = parser.parse_args()
    import keras
    import tensorflow as tf

    lines = [
        "# The noise scale's cost on the MLP, by alternation in one process",
        "",
        f"{datetime.now(timezone.utc).isoformat(timespec='seconds')}; TensorFlow "
        f"{tf.__version__}, Keras {keras.__version__}; {args.rounds} rounds of "
        f"{args.windows} windows of 256 per model; samples/s with noise_scale=True over without.",
        "",
        "| jit | median | min-max |",
        "|---|---:|---:|",
    ]
    for jit in (False, True):
        ratios = paired_ratios(jit, args.rounds, args.windows)
        row = f"| {'on' if jit else 'off'} | {statistics.median(ratios):.3f}x | "
        row += f"{min(ratios):.2f}-{max(ratios):.2f} |"
        print(row)
        lines.append(row)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
