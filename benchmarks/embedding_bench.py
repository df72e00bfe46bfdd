"""Embeddings under accumulation: throughput and peak memory of a text classifier, large table.

The model: ``Embedding(200_000, 64)`` on sequences of 64 tokens, mean pooling, ``Dense(2)``;
Adam; micro-batch b=32, k=8. Its table's gradient is a ``tf.IndexedSlices`` of 32 x 64 rows per
micro-batch. Every configuration runs in a fresh process, repetition after repetition, in a
seeded random order (the machinery of ``bench.py``); the verdict is a paired ratio.

    python benchmarks/embedding_bench.py            # 3 repetitions, jit off and on
    python benchmarks/embedding_bench.py --quick    # a small table, 1 repetition: a smoke test

Configurations:
    A            plain fit, batch b
    B            plain fit, batch k*b: one Adam update per k*b samples, as gacli's windows
    C            Keras' own gradient_accumulation_steps=k, batch b
    gacli_dense  gacli.wrap_model, steps_per_execution=k, each micro-batch's gradient made dense
                 before it is accumulated: gacli before sparse accumulation
    gacli        gacli.wrap_model, steps_per_execution=k (a window per compiled call)
    gacli_1      gacli.wrap_model, one micro-batch per call (Keras' default)

Writes results/<name>.md (medians, paired ratios, the targets) and results/<name>.json (every raw
number). ``embedding_floor.py`` splits a window's time into its parts.
"""

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from bench import HERE, _mib, _ratio, paired, run_job, run_worker, versions

CONFIGS = {
    "A": "A: fit, batch b",
    "B": "B: fit, batch k*b",
    "C": "C: Keras gradient_accumulation_steps",
    "gacli_dense": "gacli before (dense gradients)",
    "gacli": "gacli wrap_model",
    "gacli_1": "gacli wrap_model, steps_per_execution=1",
}
WINDOW_PER_CALL = ("gacli_dense", "gacli")
LEARNING_RATE = 1e-3
SIZES = dict(
    title="Embedding(200,000, 64), sequence 64, mean pooling, Dense(2); Adam",
    vocabulary=200_000,
    embedding_dim=64,
    sequence=64,
    micro_batch_size=32,
    accum_steps=8,
    warmup_updates=2,
    measure_updates=5,
)
QUICK_SIZES = dict(
    SIZES,
    title="Embedding(2,000, 16), sequence 16, mean pooling, Dense(2); Adam (quick)",
    vocabulary=2_000,
    embedding_dim=16,
    sequence=16,
    micro_batch_size=8,
    accum_steps=2,
    measure_updates=4,
)
# Targets: gacli's samples/s against B, and its peak RSS over A's within the accumulator's
# bytes (one float32 table) plus 10%.
TARGET_VS_B = 0.7
RSS_MARGIN = 1.1


def text_classifier(vocabulary, embedding_dim, sequence):
    import keras

    inputs = keras.Input((sequence,), dtype="int32")
    embedded = keras.layers.Embedding(vocabulary, embedding_dim)(inputs)
    pooled = keras.layers.GlobalAveragePooling1D()(embedded)
    return keras.Model(inputs, keras.layers.Dense(2)(pooled))


def token_arrays(spec):
    """Four windows of token sequences, seeded: token r drawn with probability ~ 1/(r+1), as
    word frequencies fall off (Zipf), so rows repeat within and across micro-batches."""
    import numpy as np

    rng = np.random.default_rng(spec["seed"])
    count = 4 * spec["micro_batch_size"] * spec["accum_steps"]
    weights = 1.0 / np.arange(1, spec["vocabulary"] + 1)
    tokens = rng.choice(
        spec["vocabulary"], size=(count, spec["sequence"]), p=weights / weights.sum()
    )
    return tokens.astype("int32"), rng.integers(0, 2, size=count).astype("int32")


def dense_gradient_accumulator(optimizer, accum_steps):
    """gacli's optimizer wrapper handed dense gradients: what every micro-batch cost before
    sparse gradients were accumulated row by row (a table-sized tensor, then a table-sized add)."""
    import tensorflow as tf

    import gacli

    class DenseGradients(gacli.GradientAccumulateOptimizer):
        def apply(self, grads, trainable_variables=None, **kwargs):
            grads = [
                tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads
            ]
            return super().apply(grads, trainable_variables, **kwargs)

    return DenseGradients(optimizer, accum_steps=accum_steps)


def build_config(spec):
    """(compiled model, repeated dataset, batch size) of one configuration."""
    import keras
    import tensorflow as tf

    import gacli

    name, k = spec["config"], spec["accum_steps"]
    batch_size = spec["micro_batch_size"] * (k if name == "B" else 1)
    x, y = token_arrays(spec)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size).repeat()
    keras.utils.set_random_seed(spec["seed"])
    model = text_classifier(spec["vocabulary"], spec["embedding_dim"], spec["sequence"])
    optimizer = keras.optimizers.Adam(
        LEARNING_RATE, gradient_accumulation_steps=k if name == "C" else None
    )
    if name.startswith("gacli"):
        model = gacli.wrap_model(model, accum_steps=k)
    if name == "gacli_dense":
        optimizer = dense_gradient_accumulator(optimizer, k)
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=spec["jit"],
        steps_per_execution=k if name in WINDOW_PER_CALL else 1,
    )
    return model, data, batch_size


def summarise(runs, jits, configs):
    """{(jit, config): medians and paired ratios against A and B}."""
    summary = {}
    for jit in jits:
        for config in configs:
            ok = [r for r in runs if (r["jit"], r["config"], r["status"]) == (jit, config, "ok")]
            failed = [r for r in runs if (r["jit"], r["config"]) == (jit, config) and r not in ok]
            row = {"reps_ok": len(ok), "error": failed[-1]["error"] if failed else None}
            for field in ("samples_per_s", "peak_rss_bytes", "window_peak_rss_bytes", "warmup_s"):
                values = [r[field] for r in ok if r.get(field) is not None]
                row[field] = statistics.median(values) if values else None
            row["updates_in_window"] = sorted({r["updates_in_window"] for r in ok})
            key = ("text", jit)
            row["vs_A"] = paired(runs, key, config, "A")
            row["vs_B"] = paired(runs, key, config, "B")
            row["rss_minus_A"] = [
                ratio - 1.0 for ratio in paired(runs, key, config, "A", "peak_rss_bytes")
            ]
            summary[(jit, config)] = row
    return summary


def targets(summary, jits, accumulator_bytes, rss_a):
    """[(target, measured, met)] for the gacli configuration run a window per call."""
    found = []
    for jit in jits:
        row = summary.get((jit, "gacli"))
        if not row or not row["reps_ok"]:
            continue
        label = f"jit {'on' if jit else 'off'}"
        speed = statistics.median(row["vs_B"]) if row["vs_B"] else None
        if speed is not None:
            found.append(
                (
                    f"{label}: gacli samples/s >= {TARGET_VS_B}x B",
                    f"{speed:.2f}x",
                    speed >= TARGET_VS_B,
                )
            )
        if row["rss_minus_A"] and rss_a.get(jit):
            extra = statistics.median(row["rss_minus_A"]) * rss_a[jit]
            limit = RSS_MARGIN * accumulator_bytes
            found.append(
                (
                    f"{label}: gacli peak RSS - A's <= {_mib(limit)} MiB (the accumulator + 10%)",
                    f"{_mib(extra)} MiB",
                    extra <= limit,
                )
            )
    return found


def markdown_report(meta, summary, jits, configs):
    spec = meta["sizes"]
    window = spec["micro_batch_size"] * spec["accum_steps"]
    lines = [
        f"# Embeddings under accumulation: {meta['name']}",
        "",
        f"{meta['date']}; {meta['cpu_count']} CPU cores; TensorFlow {meta['tensorflow']}, Keras "
        f"{meta['keras']}, gacli {meta['gacli']}; {meta['reps']} repetitions. {spec['title']}; "
        f"b={spec['micro_batch_size']}, k={spec['accum_steps']}; timed window "
        f"{spec['measure_updates'] * window} samples after {spec['warmup_updates']} warm-up "
        "updates. Each configuration ran in its own process; `x A` and `x B` are paired ratios "
        "(median, min-max over repetitions); `RSS - A` is the paired excess of peak RSS over "
        "A's, as a fraction of A's.",
    ]
    rss_a = {}
    for jit in jits:
        rss_a[jit] = summary[(jit, "A")]["peak_rss_bytes"]
        lines += [
            "",
            f"## jit_compile={jit}",
            "",
            "| config | samples/s | x A | x B | peak RSS MiB | RSS - A | timed-window peak RSS "
            "MiB | updates in window | warm-up s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for config in configs:
            row = summary[(jit, config)]
            if not row["reps_ok"]:
                lines.append(f"| {CONFIGS[config]} | failed: {row['error']} |||||||")
                continue
            excess = row["rss_minus_A"]
            lines.append(
                f"| {CONFIGS[config]} | {row['samples_per_s']:,.1f} | {_ratio(row['vs_A'])} "
                f"| {_ratio(row['vs_B'])} | {_mib(row['peak_rss_bytes'])} "
                f"| {'-' if not excess else f'{statistics.median(excess):+.1%}'} "
                f"| {_mib(row['window_peak_rss_bytes'])} "
                f"| {'/'.join(map(str, row['updates_in_window']))} | {row['warmup_s']:.1f} |"
            )
    accumulator_bytes = 4 * spec["vocabulary"] * spec["embedding_dim"]
    met_text = {True: "yes", False: "**no**"}
    lines += ["", "## Targets", "", "| target | measured (paired medians) | met |", "|---|---|---|"]
    lines += [
        f"| {title} | {measured} | {met_text[met]} |"
        for title, measured, met in targets(summary, jits, accumulator_bytes, rss_a)
    ]
    return "\n".join(lines) + "\n"


def run_all(args):
    sizes = dict(QUICK_SIZES if args.quick else SIZES)
    sizes["measure_updates"] = args.measure_updates or sizes["measure_updates"]
    jits = {"off": [False], "on": [True], "both": [False, True]}[args.jit]
    meta = dict(
        versions(),
        name=args.out,
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        cpu_count=os.cpu_count(),
        reps=args.reps,
        sizes=sizes,
        argv=sys.argv[1:],
    )
    jobs = [
        dict(sizes, model_key="text", jit=jit, config=config, seed=0, threads=args.threads)
        for jit in jits
        for config in args.configs
    ]
    runs = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gacli-embedding-") as work_dir:
        for rep in range(1, args.reps + 1):
            order = list(jobs)
            random.Random(rep).shuffle(order)
            for index, job in enumerate(order, 1):
                result = run_job(
                    dict(job, rep=rep), work_dir, args.threads, args.timeout, Path(__file__)
                )
                runs.append(result)
                what = f"jit={'on' if job['jit'] else 'off'} {job['config']}"
                done = (
                    f"{result['samples_per_s']:,.1f} samples/s"
                    if result["status"] == "ok"
                    else f"failed: {result['error']}"
                )
                print(f"[rep {rep}/{args.reps}, {index}/{len(order)}] {what}: {done}", flush=True)
    meta["total_s"] = time.perf_counter() - started
    return meta, runs, jits


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small table: a smoke test")
    parser.add_argument("--reps", type=int, help="repetitions (default 3; 1 with --quick)")
    parser.add_argument("--jit", choices=["off", "on", "both"], default="both")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--measure-updates", type=int, help="optimizer updates in the timed window")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--timeout", type=float, default=900, help="seconds per worker process")
    parser.add_argument("--out", help="result name (default: embedding, or embedding_quick)")
    parser.add_argument("--results-dir", default=str(HERE / "results"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        run_worker(json.loads(args.worker), build_config)
        return 0
    args.reps = args.reps or (1 if args.quick else 3)
    args.out = args.out or ("embedding_quick" if args.quick else "embedding")
    args.configs = [c for c in CONFIGS if c in set(args.configs) | {"A", "B"}]
    meta, runs, jits = run_all(args)
    report = markdown_report(meta, summarise(runs, jits, args.configs), jits, args.configs)
    base = Path(args.results_dir) / args.out
    base.parent.mkdir(parents=True, exist_ok=True)
    base.with_suffix(".md").write_text(report)
    base.with_suffix(".json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    print("\n" + report + f"\nwrote {base}.md and .json ({meta['total_s'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
