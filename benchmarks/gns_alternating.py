"""The noise scale's cost, measured in one process by alternation.

On a machine that other jobs share, a process's speed moves by a factor of 2 within minutes, so
the ratio of two fresh processes (``bench.py``'s ``gacli_model_gns`` against ``gacli_model``) needs
many repetitions to mean anything. Here both models (the model wrapper without and with
``noise_scale=True``, on ``bench.py``'s MLP, b=32, k=8, or with ``--model unet`` its UNet, b=8,
k=8; SGD, its data, a window per compiled call) are built and compiled once in the same
process, then trained in turns of a few windows each, the order swapped every round: a busy
second hits both alike. Each round gives one paired ratio (samples/s with the noise scale over
without); the median and range over the rounds are printed and written to
results/gns_alternating.md. Beside them, the ratio of each model's fastest turn: another job can
only slow a turn down, so the fastest is the least disturbed.

``--nonfinite stop`` runs both models with the non-finite check that ``ga-train`` runs by
default (``nonfinite=stop``): the cost of ``monitor.gns`` in the compiled step as ``ga-train``
runs it (``bench.py``'s ``ga_train_gns`` times ``ga-train``'s whole process).

``--per-call`` alternates single compiled calls instead of ``fit()`` turns: each round calls
each model's train function once (one window, ``steps_per_execution=k``) on an iterator of its
own and waits for its logs, the order swapped every round, after 20 calls of each to warm up.
A turn is then a few tens of milliseconds, so drift in the machine's speed hits both models of
a round alike; ``fit()``'s own start-up and callbacks are left out. ``--rounds`` counts calls.

    python benchmarks/gns_alternating.py [--model mlp|unet] [--rounds 30] [--windows 5]
        [--nonfinite stop] [--per-call] [--out benchmarks/results/NAME.md]
"""

import argparse
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent


def build(spec, jit, noise_scale, data, nonfinite=None):
    import keras

    import gacli
    from gacli.runner.config import ModelConfig
    from gacli.runner.models import build_model
    from gacli.runner.train import loss_and_metrics

    keras.utils.set_random_seed(0)
    model = build_model(
        ModelConfig(**spec["model"]), tuple(spec["input_shape"]), spec["num_outputs"], spec["task"]
    )
    loss, metrics = loss_and_metrics(spec["task"], spec["num_outputs"])
    k = spec["accum_steps"]
    model = gacli.wrap_model(model, accum_steps=k, noise_scale=noise_scale, nonfinite=nonfinite)
    model.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss=loss,
        metrics=metrics,
        jit_compile=jit,
        steps_per_execution=k,
    )
    model.fit(data, steps_per_epoch=2 * k, epochs=1, verbose=0)  # trace, compile, warm up
    return model


def both_models(spec, jit, nonfinite=None):
    """(data, {noise_scale: model}): the repeated micro-batches and both models, built and
    warmed up."""
    import tensorflow as tf
    from bench import synthetic_arrays

    x, y = synthetic_arrays(spec)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(spec["micro_batch_size"]).repeat()
    return data, {flag: build(spec, jit, flag, data, nonfinite) for flag in (False, True)}


def timed_turns(spec, jit, rounds, windows, nonfinite=None):
    """{noise_scale: [seconds of each round's turn]}, the two models' turns interleaved."""
    data, models = both_models(spec, jit, nonfinite)
    steps = spec["accum_steps"] * windows
    seconds = {False: [], True: []}
    for round_index in range(rounds):
        for noise_scale in (True, False) if round_index % 2 else (False, True):
            start = time.perf_counter()
            models[noise_scale].fit(data, steps_per_epoch=steps, epochs=1, verbose=0)
            seconds[noise_scale].append(time.perf_counter() - start)
    return seconds


def timed_calls(spec, jit, rounds, nonfinite=None):
    """{noise_scale: [seconds of each round's call]}: one compiled window per call, the two
    models' calls interleaved."""
    import tensorflow as tf

    data, models = both_models(spec, jit, nonfinite)
    iterators = {flag: iter(data) for flag in models}

    def call(flag):
        logs = models[flag].train_function(iterators[flag])
        # Wait for the call: its logs as NumPy.
        tf.nest.map_structure(lambda value: getattr(value, "numpy", lambda: value)(), logs)

    for flag in models:
        for _ in range(20):
            call(flag)
    seconds = {False: [], True: []}
    for round_index in range(rounds):
        for noise_scale in (True, False) if round_index % 2 else (False, True):
            start = time.perf_counter()
            call(noise_scale)
            seconds[noise_scale].append(time.perf_counter() - start)
    return seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["mlp", "unet"], default="mlp")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--windows", type=int, default=5, help="windows per turn")
    parser.add_argument(
        "--nonfinite",
        choices=["stop", "skip_micro_batch", "skip_window"],
        help="both models with this non-finite check (ga-train's default: stop)",
    )
    parser.add_argument(
        "--per-call",
        action="store_true",
        help="alternate single compiled calls (one window each) instead of fit() turns",
    )
    parser.add_argument("--out", default=str(HERE / "results" / "gns_alternating.md"))
    args = parser.parse_args()
    import keras
    import tensorflow as tf
    from bench import MODELS

    spec = dict(MODELS[args.model], seed=0)
    # The same TensorFlow thread pools as bench.py's workers.
    tf.config.threading.set_intra_op_parallelism_threads(2)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    check = f"nonfinite={args.nonfinite}" if args.nonfinite else "no non-finite check"
    lines = [
        f"# The noise scale's cost on the {spec['title']}, by alternation in one process",
        "",
        f"{datetime.now(timezone.utc).isoformat(timespec='seconds')}; TensorFlow "
        f"{tf.__version__}, Keras {keras.__version__}; {args.rounds} rounds of "
        + ("one compiled call (one window) of " if args.per_call else f"{args.windows} windows of ")
        + f"{spec['micro_batch_size'] * spec['accum_steps']} per model "
        f"(b={spec['micro_batch_size']}, k={spec['accum_steps']}), {check}; samples/s with "
        "noise_scale=True over without: the median of the rounds' paired ratios with their "
        "range, and the ratio of each model's fastest turn.",
        "",
        "| jit | median of rounds | min-max | fastest turns "
        "| µs a micro-batch, fastest (without, with) |",
        "|---|---:|---:|---:|---:|",
    ]
    micro_batches = spec["accum_steps"] * (1 if args.per_call else args.windows)
    for jit in (False, True):
        if args.per_call:
            seconds = timed_calls(spec, jit, args.rounds, args.nonfinite)
        else:
            seconds = timed_turns(spec, jit, args.rounds, args.windows, args.nonfinite)
        ratios = [a / b for a, b in zip(seconds[False], seconds[True])]
        fastest = {flag: min(values) for flag, values in seconds.items()}
        row = (
            f"| {'on' if jit else 'off'} | {statistics.median(ratios):.3f}x | "
            f"{min(ratios):.2f}-{max(ratios):.2f} | {fastest[False] / fastest[True]:.3f}x | "
            f"{fastest[False] / micro_batches * 1e6:,.0f}, "
            f"{fastest[True] / micro_batches * 1e6:,.0f} |"
        )
        print(row)
        lines.append(row)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
