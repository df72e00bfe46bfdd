"""Where a run's host memory goes: peak RSS per phase of a fit, for bench.py's configurations.

bench.py's "peak RSS" is the whole process's high-water mark. This script splits it, in a fresh
process per configuration, into the phases of one fit() of 2 + 4 windows:

    start      RSS before fit (TensorFlow imported, model built and compiled, data in memory)
    first      peak while the first compiled call runs: tracing, Grappler or XLA's compiler,
               then the call's own steps
    held       RSS right after the first call
    live       RSS after glibc's malloc_trim(0) gives free pages back: what the first call left
               alive (accumulators, compiled code, runtime caches)
    window     peak over the next 4 windows, after the trim

The trim here is the probe's own, done for every configuration alike (A and C included), so that
"held - live" shows what compiling left free but resident. gacli's fit trims at the same point by
itself (gacli.engine.host_memory); plain Keras does not, so its RSS stays at "held" in a real run.

    python benchmarks/rss_phases.py                     # UNet, jit off and on, 2 repetitions
    python benchmarks/rss_phases.py --models mlp --reps 1
    python benchmarks/rss_phases.py --quick --models mlp --jit off --reps 1   # a smoke test
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench  # noqa: E402  (the same models, data and configurations as the benchmark)

CONFIGS = ("A", "C", "gacli_model", "gacli_optimizer")
PHASES = ("start", "first", "held", "live", "window")


def worker(spec):
    import keras
    import tensorflow as tf

    from gacli.engine.host_memory import release_free_memory
    from gacli.runner.reporting.run_logs import host_memory_bytes

    def rss_now():
        return host_memory_bytes()[0]

    tf.config.threading.set_intra_op_parallelism_threads(spec["threads"])
    tf.config.threading.set_inter_op_parallelism_threads(spec["threads"])
    model, data, batch_size = bench.build_library_config(spec)
    steps_per_window = spec["micro_batch_size"] * spec["accum_steps"] // batch_size
    phases = {}

    class Phases(keras.callbacks.Callback):
        calls = 0

        def on_train_batch_end(self, batch, logs=None):
            self.calls += 1
            if self.calls == 1:
                phases["first"] = bench.rss_high_water_mark()
                phases["held"] = rss_now()
                release_free_memory()
                phases["live"] = rss_now()
                bench.rss_high_water_mark(reset=True)

    bench.rss_high_water_mark(reset=True)
    phases["start"] = rss_now()
    model.fit(
        data,
        epochs=1,
        steps_per_epoch=model.steps_per_execution + 4 * steps_per_window,
        verbose=0,
        callbacks=[Phases()],
    )
    phases["window"] = bench.rss_high_water_mark()
    return phases


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(bench.MODELS), default=["unet"])
    parser.add_argument("--jit", choices=["off", "on", "both"], default="both")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny models: a smoke test")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    jits = {"off": [False], "on": [True], "both": [False, True]}[args.jit]
    models = bench.QUICK_MODELS if args.quick else bench.MODELS
    results = {}
    for rep in range(args.reps):
        for model_key in args.models:
            for jit in jits:
                for config in CONFIGS:
                    spec = dict(
                        models[model_key], config=config, jit=jit, seed=rep, threads=args.threads
                    )
                    done = subprocess.run(
                        [sys.executable, __file__, "--worker", json.dumps(spec)],
                        env=bench.worker_env(args.threads),
                        capture_output=True,
                        text=True,
                    )
                    if done.returncode:
                        print(
                            f"{model_key} jit={jit} {config}: failed: "
                            f"{bench.failure_reason(done.stderr)}",
                            file=sys.stderr,
                        )
                        continue
                    phases = json.loads(done.stdout.strip().splitlines()[-1])
                    results.setdefault((model_key, jit, config), []).append(phases)
    lines = [
        f"Peak and current RSS per phase of one fit, MiB; medians of {args.reps} "
        "repetitions, each configuration in a fresh process.",
        "",
    ]
    for model_key in args.models:
        for jit in jits:
            lines += [
                f"### {models[model_key]['title']}, jit_compile={jit}",
                "",
                "| config | " + " | ".join(PHASES) + " | held - live |",
                "|---|" + "---:|" * (len(PHASES) + 1),
            ]
            for config in CONFIGS:
                runs = results.get((model_key, jit, config))
                if not runs:
                    lines.append(f"| {bench.CONFIGS[config]} |" + " - |" * (len(PHASES) + 1))
                    continue
                median = {p: statistics.median(r[p] for r in runs) / 2**20 for p in PHASES}
                lines.append(
                    f"| {bench.CONFIGS[config]} | "
                    + " | ".join(f"{median[p]:,.0f}" for p in PHASES)
                    + f" | {median['held'] - median['live']:,.0f} |"
                )
            lines.append("")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
