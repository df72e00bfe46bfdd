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

``--ga-train`` times what ``ga-train`` does for each update, without its process: its own two
jobs (``monitor.gns`` off and on, its default ``nonfinite=stop``) are made by its own steps up to
``fit()`` (``gacli.runner.training.run.Run``: model, engine, data stream, callbacks), and each round
runs one compiled call (one window) of each, followed by the callbacks ``fit()`` runs after a
call (the counters taken from the call's logs, the TensorBoard logger's point), in alternation.
Between it and ``bench.py``'s ``ga_train_gns`` lie ``fit()``'s own loop, turns of ten updates
instead of one, and the two processes (their memory, their threads).

    python benchmarks/gns_alternating.py [--model mlp|unet] [--rounds 30] [--windows 5]
        [--nonfinite stop] [--per-call | --ga-train] [--out benchmarks/results/NAME.md]
"""

import argparse
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent


def build(spec, jit, noise_scale, data, nonfinite=None):
    import keras
    from bench import shipped_model

    import gacli
    from gacli.runner.builders.job import loss_and_metrics

    keras.utils.set_random_seed(0)
    model = shipped_model(spec)
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


def alternate(turn, rounds, warm=0):
    """{flag: [what ``turn(flag)`` returned each round]}: ``warm`` turns of each flag first
    (not kept), then ``rounds`` rounds of one turn each, the order swapped every round."""
    for flag in (False, True):
        for _ in range(warm):
            turn(flag)
    kept = {False: [], True: []}
    for round_index in range(rounds):
        for flag in (True, False) if round_index % 2 else (False, True):
            kept[flag].append(turn(flag))
    return kept


def timed_turns(spec, jit, rounds, windows, nonfinite=None):
    """{noise_scale: [seconds of each round's turn]}, the two models' turns interleaved."""
    data, models = both_models(spec, jit, nonfinite)
    steps = spec["accum_steps"] * windows

    def turn(noise_scale):
        start = time.perf_counter()
        models[noise_scale].fit(data, steps_per_epoch=steps, epochs=1, verbose=0)
        return time.perf_counter() - start

    return alternate(turn, rounds)


def timed_calls(spec, jit, rounds, nonfinite=None):
    """{noise_scale: [seconds of each round's call]}: one compiled window per call, the two
    models' calls interleaved."""
    import tensorflow as tf

    data, models = both_models(spec, jit, nonfinite)
    iterators = {flag: iter(data) for flag in models}

    def call(flag):
        start = time.perf_counter()
        logs = models[flag].train_function(iterators[flag])
        # Wait for the call: its logs as NumPy.
        tf.nest.map_structure(lambda value: getattr(value, "numpy", lambda: value)(), logs)
        return time.perf_counter() - start

    return alternate(call, rounds, warm=20)


def ga_train_runs(spec, jit, windows, directory):
    """{monitor.gns: gacli.runner.training.run.Run}: ga-train's own two jobs on bench.py's arrays,
    made by its own steps up to fit() (the model, engine and callbacks as ga-train builds
    them), with a stream of ``windows`` windows each."""
    import numpy as np
    from bench import ga_train_overrides, synthetic_arrays
    from hydra import compose, initialize_config_module

    from gacli.runner.config.schema import register_configs
    from gacli.runner.training.run import Run
    from gacli.runner.training.run_state import micro_batch_stream

    x, y = synthetic_arrays(spec)
    data_path = str(Path(directory) / "data.npz")
    np.savez(data_path, x=x, y=y)
    register_configs()
    runs = {}
    for gns in (False, True):
        overrides = ga_train_overrides(dict(spec, jit=jit), data_path, windows, gns)
        with initialize_config_module("gacli.configs", version_base="1.3"):
            cfg = compose("train", overrides=overrides)
        run = Run(cfg, str(Path(directory) / f"run_gns_{gns}"))
        run.check_run_dir()
        run.plan_batch()
        run.load_data()
        run.settle_plan()
        run.build()
        run.make_callbacks()
        run.stream = micro_batch_stream(
            run.data.train,
            run.plan.global_micro_batch_size,
            run.steps.micro_batches,
            start=0,
            count=windows * spec["accum_steps"],
            order=run.order,
        )
        runs[gns] = run
    return runs


def timed_updates(spec, jit, rounds):
    """{monitor.gns: [seconds of each round's update]}: ga-train's two jobs, each round one
    compiled call (one window) of each and then the callbacks fit() runs after it, in
    alternation; and {monitor.gns: [seconds of those callbacks]}."""
    import tempfile

    import keras

    from gacli.engine.accumulate_model import CountersFromLogs

    warm = 20
    with tempfile.TemporaryDirectory() as directory:
        runs = ga_train_runs(spec, jit, rounds + warm, directory)
        steps, callbacks, iterators = {}, {}, {}
        for gns, run in runs.items():
            model = run.job.model
            model.make_train_function()
            # fit()'s list as the model wrapper's fit() makes it for ga-train.
            listed = [CountersFromLogs(model.optimizer), *run.callbacks.in_order]
            callbacks[gns] = keras.callbacks.CallbackList(
                listed, model=model, epochs=1, steps=run.steps.fit_steps
            )
            callbacks[gns].on_train_begin()
            callbacks[gns].on_epoch_begin(0)
            iterators[gns] = iter(run.stream)
            steps[gns] = 0

        def update(gns):
            model, listed = runs[gns].job.model, callbacks[gns]
            start = time.perf_counter()
            listed.on_train_batch_begin(steps[gns])
            logs = model.train_function(iterators[gns])
            steps[gns] += spec["accum_steps"]
            called = time.perf_counter()
            listed.on_train_batch_end(steps[gns] - 1, logs)
            end = time.perf_counter()
            return end - start, end - called

        try:
            timed = alternate(update, rounds, warm=warm)
        finally:
            for run in runs.values():
                run.close()
    seconds = {gns: [total for total, _ in pairs] for gns, pairs in timed.items()}
    in_callbacks = {gns: [after for _, after in pairs] for gns, pairs in timed.items()}
    return seconds, in_callbacks


def ga_train_report(spec, rounds, out):
    """--ga-train: the table of ga-train's per-update cost of monitor.gns, without and with
    XLA, printed and written to ``out``."""
    import keras
    import tensorflow as tf

    update = spec["micro_batch_size"] * spec["accum_steps"]
    lines = [
        f"# The cost of monitor.gns in ga-train's updates on the {spec['title']}, "
        "by alternation in one process",
        "",
        f"{datetime.now(timezone.utc).isoformat(timespec='seconds')}; TensorFlow "
        f"{tf.__version__}, Keras {keras.__version__}; ga-train's own two jobs (monitor.gns off "
        "and on; nonfinite=stop, its default), built by its own steps; "
        f"{rounds} rounds of one update of {update} (b={spec['micro_batch_size']}, "
        f"k={spec['accum_steps']}) per job: one compiled call, then the callbacks fit() runs "
        "after it (the TensorBoard logger's point included). Samples/s with monitor.gns over "
        "without: the median of the rounds' paired ratios with their range, and the ratio of "
        "each job's fastest update; the callbacks' median time an update.",
        "",
        "| jit | median of rounds | min-max | fastest updates "
        "| callbacks µs an update, median (without, with) |",
        "|---|---:|---:|---:|---:|",
    ]
    for jit in (False, True):
        seconds, in_callbacks = timed_updates(spec, jit, rounds)
        ratios = [a / b for a, b in zip(seconds[False], seconds[True])]
        row = (
            f"| {'on' if jit else 'off'} | {statistics.median(ratios):.3f}x | "
            f"{min(ratios):.2f}-{max(ratios):.2f} | "
            f"{min(seconds[False]) / min(seconds[True]):.3f}x | "
            f"{statistics.median(in_callbacks[False]) * 1e6:,.0f}, "
            f"{statistics.median(in_callbacks[True]) * 1e6:,.0f} |"
        )
        print(row)
        lines.append(row)
    Path(out).write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


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
    parser.add_argument(
        "--ga-train",
        action="store_true",
        help="ga-train's own two jobs (monitor.gns off, on), one update each in turn, with the "
        "callbacks fit() runs after it",
    )
    parser.add_argument(
        "--out",
        help="default: benchmarks/results/gns_alternating.md (--ga-train: "
        "gns_alternating_ga_train.md)",
    )
    args = parser.parse_args()
    if args.ga_train and (args.per_call or args.nonfinite not in (None, "stop")):
        parser.error("--ga-train runs ga-train's jobs as they are: one call a turn, nonfinite=stop")
    import keras
    import tensorflow as tf
    from bench import MODELS

    spec = dict(MODELS[args.model], seed=0)
    # The same TensorFlow thread pools as bench.py's workers.
    tf.config.threading.set_intra_op_parallelism_threads(2)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    if args.out is None:
        name = "gns_alternating_ga_train.md" if args.ga_train else "gns_alternating.md"
        args.out = str(HERE / "results" / name)
    if args.ga_train:
        ga_train_report(spec, args.rounds, args.out)
        return
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
