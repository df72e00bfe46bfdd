"""What recomputation saves: peak resident memory and time per sample, with and without remat.

For each model, every (remat mode, micro-batch) runs in a fresh process: ``gacli.wrap_model``
with ``accum_steps`` chosen so that every micro-batch makes the same effective batch, a window
per compiled call (``steps_per_execution=k``), SGD, ``jit_compile`` off. Each process measures

    baseline   RSS after building and compiling, data in memory, before fit
    fit peak   high-water mark of fit() (VmHWM, reset at its start): tracing, the first
               updates and the timed window; "beyond baseline" subtracts the baseline
    window     high-water mark of the timed window alone (reset after the warm-up): what
               training holds once tracing is over
    process    the whole process's peak (ru_maxrss), what a memory limit has to hold
    s/sample   wall time of the timed window per sample

and the report gives, in that one run, the memory a bigger micro-batch adds (peak at the large
micro-batch minus peak at the small one, the same effective batch) with recomputation over the
same without it, the time ratio, and the largest micro-batch whose process peak fits a budget.

Models: the UNet of the unet recipe at 128x128 (3 levels, 8 base filters; remat off, "every"
and 2) and the text recipe's causal language model (width 64, 2 blocks, sequences of 64 bytes;
remat off and 2, which recomputes each transformer block as one, see ``docs/guides/recompute.md``).

    python benchmarks/remat_memory.py                       # both models, about 15 min on 2 cores
    python benchmarks/remat_memory.py --models unet --reps 2
    python benchmarks/remat_memory.py --quick --results-dir /tmp/q   # a smoke test, < 1 min
"""

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench  # noqa: E402  (fresh processes, the timed window and the RSS high-water mark)

MIB = 2**20
# remat modes as the report names them; None is off.
MODES = {"off": None, "every": "every", "2": 2}
MODELS = {
    "unet": dict(
        title="UNet 128x128x1, 3 levels, 8 base filters (the unet recipe's model)",
        task="segmentation",
        input_shape=[128, 128, 1],
        num_outputs=1,
        model={"name": "unet", "depth": 3, "base_filters": 8},
        effective_batch_size=64,
        micro_batch_sizes=[8, 16, 32, 64],
        pair=[8, 32],
        modes=["off", "every", "2"],
        warmup_updates=2,
        measure_updates=3,
    ),
    "text": dict(
        title="causal LM, width 64, 2 blocks, 4 heads, sequences of 64 bytes (the text_lm recipe)",
        task="text",
        sequence_length=64,
        width=64,
        depth=2,
        effective_batch_size=512,
        micro_batch_sizes=[32, 64, 128, 256],
        pair=[32, 256],
        modes=["off", "2"],
        warmup_updates=2,
        measure_updates=3,
    ),
}
QUICK_MODELS = {
    "unet": dict(
        MODELS["unet"],
        title="UNet 32x32x1, 2 levels, 4 base filters (quick)",
        input_shape=[32, 32, 1],
        model={"name": "unet", "depth": 2, "base_filters": 4},
        effective_batch_size=8,
        micro_batch_sizes=[4, 8],
        pair=[4, 8],
        modes=["off", "every"],
        warmup_updates=1,
        measure_updates=1,
    ),
    "text": dict(
        MODELS["text"],
        title="causal LM, width 16, 2 blocks, sequences of 16 bytes (quick)",
        sequence_length=16,
        width=16,
        effective_batch_size=16,
        micro_batch_sizes=[8, 16],
        pair=[8, 16],
        modes=["off", "2"],
        warmup_updates=1,
        measure_updates=1,
    ),
}


def rss_now():
    """The process's resident memory now, in bytes (Linux: VmRSS); None where /proc is missing."""
    try:
        with open("/proc/self/status") as handle:
            return next(int(line.split()[1]) * 1024 for line in handle if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None


# --------------------------------------------------------------------------------------------
# Worker: one (model, mode, micro-batch) in this fresh process.


def text_data(spec):
    """The text recipe's training sequences (x, y, padding weights), the same for every job."""
    from gacli.recipes.text_lm import pydoc_topics

    (x, y, w), _ = pydoc_topics(sequence_length=spec["sequence_length"])
    return x, y, w


def build(spec):
    """(compiled wrapped model, repeated dataset, micro-batch size) of ``spec``; records the
    baseline RSS and starts fit's high-water mark."""
    import keras
    import tensorflow as tf

    import gacli

    keras.utils.set_random_seed(spec["seed"])
    if spec["task"] == "text":
        from gacli.recipes.text_lm import causal_lm

        model = causal_lm(
            sequence_length=spec["sequence_length"],
            width=spec["width"],
            depth=spec["depth"],
            heads=4,
        )
        arrays = text_data(spec)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    else:
        model = bench.shipped_model(spec)
        # Four effective batches of seeded noise (bench.py's arrays): the same for every job.
        arrays = bench.synthetic_arrays(
            dict(spec, micro_batch_size=spec["effective_batch_size"], accum_steps=1)
        )
        loss = keras.losses.BinaryCrossentropy(from_logits=True)
    micro, k = spec["micro_batch_size"], spec["accum_steps"]
    data = tf.data.Dataset.from_tensor_slices(arrays).batch(micro, drop_remainder=True).repeat()
    model = gacli.wrap_model(model, accum_steps=k, remat=MODES[spec["mode"]])
    model.compile(
        optimizer=keras.optimizers.SGD(bench.LEARNING_RATE),
        loss=loss,
        jit_compile=False,
        steps_per_execution=k,
    )
    spec["baseline_rss_bytes"] = rss_now()
    bench.rss_high_water_mark(reset=True)  # fit's own peak from here
    return model, data, micro


def worker(spec):
    bench.run_worker(spec, build=build)
    path = Path(spec["result_path"])
    figures = json.loads(path.read_text())
    figures["baseline_rss_bytes"] = spec["baseline_rss_bytes"]
    path.write_text(json.dumps(figures))


# --------------------------------------------------------------------------------------------
# Parent: one fresh process per job, one after another; then the table.


def jobs_of(models, reps, seed, threads):
    jobs = []
    for rep in range(1, reps + 1):
        for key, spec in models.items():
            for mode in spec["modes"]:
                for micro in spec["micro_batch_sizes"]:
                    jobs.append(
                        dict(
                            spec,
                            rep=rep,
                            model_key=key,
                            jit=False,
                            config=f"remat_{mode}_b{micro}",
                            mode=mode,
                            micro_batch_size=micro,
                            accum_steps=spec["effective_batch_size"] // micro,
                            seed=seed,
                            threads=threads,
                        )
                    )
    return jobs


def figures_of(run):
    """The numbers of one run, in MiB and seconds per sample."""
    fit_peak = max(run["warmup_peak_rss_bytes"], run["window_peak_rss_bytes"])
    return {
        "baseline": run["baseline_rss_bytes"] / MIB,
        "fit_peak": fit_peak / MIB,
        "fit_beyond": (fit_peak - run["baseline_rss_bytes"]) / MIB,
        "window_beyond": (run["window_peak_rss_bytes"] - run["baseline_rss_bytes"]) / MIB,
        "process": run["peak_rss_bytes"] / MIB,
        "s_per_sample": run["wall_s"] / run["samples"],
    }


def medians(runs, key, mode, micro):
    found = [
        figures_of(run)
        for run in runs
        if run["status"] == "ok"
        and (run["model_key"], run["mode"], run["micro_batch_size"]) == (key, mode, micro)
    ]
    if not found:
        return None
    return {name: statistics.median(f[name] for f in found) for name in found[0]}


def budget_of(spec, runs, key, budget_mib):
    """The budget for ``key``: ``budget_mib`` or, without one, midway between the process peaks
    without recomputation at the two largest micro-batches: the largest fits without
    recomputation, the second largest does; does recomputation make the largest fit?"""
    if budget_mib is not None:
        return budget_mib
    peaks = [medians(runs, key, "off", micro) for micro in spec["micro_batch_sizes"][-2:]]
    if len(peaks) < 2 or None in peaks:
        return None
    return (peaks[0]["process"] + peaks[1]["process"]) / 2


def report(meta, runs, budgets):
    lines = [
        f"# Recomputation: peak resident memory and time per sample ({meta['name']})",
        "",
        f"{meta['date']}; {meta['cpu_count']} CPU cores, {meta['threads']} TF threads, no GPU; "
        f"TensorFlow {meta['tensorflow']}, Keras {meta['keras']}, gacli {meta['gacli']}; "
        f"{meta['reps']} repetition(s), medians."
        + (
            f" Load average (1 min) {meta['load_start']:.1f} at the start, "
            f"{meta['load_end']:.1f} at the end: above {meta['cpu_count']}, other jobs shared "
            "the cores and the times say little."
            if max(meta.get("load_start", 0), meta.get("load_end", 0)) > meta["cpu_count"]
            else ""
        ),
        "",
        "Each row ran in its own process, one after another: `gacli.wrap_model` with "
        "`accum_steps` = effective batch / micro-batch, a window per compiled call, SGD, "
        "jit_compile off. MiB of resident memory (host RSS): *baseline* after building and "
        "compiling, before fit; *fit peak* fit()'s high-water mark (tracing, warm-up and timed "
        "window); *beyond* = peak - baseline; *window* the timed window's high-water mark beyond "
        "the baseline; *process* the whole process's peak. s/sample: wall time of the timed "
        "window over its samples.",
        "",
    ]
    for key, spec in meta["models"].items():
        small, large = spec["pair"]
        lines += [
            f"## {spec['title']}",
            "",
            f"Effective batch {spec['effective_batch_size']}; timed window "
            f"{spec['measure_updates']} updates after {spec['warmup_updates']} warm-up updates.",
            "",
            "| remat | micro-batch | k | baseline | fit peak | beyond | window | process "
            "| s/sample |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for mode in spec["modes"]:
            for micro in spec["micro_batch_sizes"]:
                m = medians(runs, key, mode, micro)
                k = spec["effective_batch_size"] // micro
                if m is None:
                    lines.append(f"| {mode} | {micro} | {k} | failed |" + " |" * 5)
                    continue
                lines.append(
                    f"| {mode} | {micro} | {k} | {m['baseline']:,.0f} | {m['fit_peak']:,.0f} "
                    f"| {m['fit_beyond']:,.0f} | {m['window_beyond']:,.0f} "
                    f"| {m['process']:,.0f} | {m['s_per_sample'] * 1e3:.2f} ms |"
                )
        lines += [
            "",
            f"Memory that micro-batch {large} adds over {small} (same effective batch), and its "
            "ratio to remat off's; time per sample at micro-batch "
            f"{small} and {large} over remat off's:",
            "",
            f"| remat | added: fit peak | x off | added: window | x off | added: process | x off "
            f"| time x off (b={small}) | time x off (b={large}) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        off = {micro: medians(runs, key, "off", micro) for micro in (small, large)}
        for mode in spec["modes"]:
            now = {micro: medians(runs, key, mode, micro) for micro in (small, large)}
            if None in now.values() or None in off.values():
                lines.append(f"| {mode} | failed |" + " |" * 7)
                continue
            cells = []
            for name in ("fit_beyond", "window_beyond", "process"):
                added = now[large][name] - now[small][name]
                added_off = off[large][name] - off[small][name]
                ratio = f"{added / added_off:.2f}x" if added_off > 0 else "n/a"
                cells += [f"{added:,.0f}", ratio]
            times = [
                f"{now[micro]['s_per_sample'] / off[micro]['s_per_sample']:.2f}x"
                for micro in (small, large)
            ]
            lines.append(f"| {mode} | " + " | ".join(cells + times) + " |")
        budget = budgets.get(key)
        lines += [""]
        if budget is not None:
            fits = []
            for mode in spec["modes"]:
                under = [
                    micro
                    for micro in spec["micro_batch_sizes"]
                    if (m := medians(runs, key, mode, micro)) and m["process"] <= budget
                ]
                fits.append(f"remat {mode}: {max(under) if under else 'none'}")
            lines += [
                f"Largest micro-batch whose process peak fits {budget:,.0f} MiB: "
                + "; ".join(fits)
                + ".",
                "",
            ]
    failed = [run for run in runs if run["status"] != "ok"]
    for run in failed:
        lines.append(f"- {run['model_key']} {run['config']} failed: {run.get('error')}")
    return "\n".join(lines) + "\n"


def parse_budgets(parser, words, models):
    """{model: MiB} from ``--budget-mib`` words such as ``unet=1200``."""
    budgets = {}
    for word in words:
        key, _, value = word.partition("=")
        if key not in models or not value.replace(".", "", 1).isdigit():
            parser.error(f"--budget-mib {word}: give MODEL=MIB with MODEL one of {list(models)}")
        budgets[key] = float(value)
    return budgets


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--modes", nargs="+", choices=list(MODES), help="default: each model's")
    parser.add_argument(
        "--micro-batch-sizes", nargs="+", type=int, help="default: each model's (and its pair)"
    )
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny models: a smoke test")
    parser.add_argument(
        "--budget-mib",
        nargs="+",
        default=[],
        metavar="MODEL=MIB",
        help="memory budget per model, e.g. unet=1200 (default: midway between the process "
        "peaks without recomputation at the two largest micro-batches)",
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds per process")
    parser.add_argument("--out", help="result name (default: remat_memory, quick with --quick)")
    parser.add_argument("--results-dir", default=str(HERE / "results"))
    parser.add_argument(
        "--render", metavar="JSON", help="rewrite the table of an earlier run from its raw JSON"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    if args.render:
        raw = json.loads(Path(args.render).read_text())
        budget_mib = parse_budgets(parser, args.budget_mib, raw["meta"]["models"])
        return write_reports(raw["meta"], raw["runs"], budget_mib, Path(args.render).parent)
    sizes = QUICK_MODELS if args.quick else MODELS
    models = {key: dict(sizes[key]) for key in args.models}
    for spec in models.values():
        if args.modes:
            spec["modes"] = ["off"] + [m for m in args.modes if m != "off"]  # ratios need off
        if args.micro_batch_sizes:
            chosen = set(args.micro_batch_sizes) | set(spec["pair"])
            spec["micro_batch_sizes"] = sorted(chosen)
    budget_mib = parse_budgets(parser, args.budget_mib, models)
    meta = dict(
        bench.versions(),
        name=args.out or ("quick" if args.quick else "remat_memory"),
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        cpu_count=os.cpu_count(),
        threads=args.threads,
        reps=args.reps,
        quick=args.quick,
        python=platform.python_version(),
        machine=platform.machine(),
        argv=sys.argv[1:],
        models=models,
    )
    meta["load_start"] = os.getloadavg()[0]
    runs = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gacli-remat-") as work_dir:
        for job in jobs_of(models, args.reps, args.seed, args.threads):
            run = bench.run_job(job, work_dir, args.threads, args.timeout, script=__file__)
            run.update(mode=job["mode"], micro_batch_size=job["micro_batch_size"])
            runs.append(run)
            if run["status"] == "ok":
                f = figures_of(run)
                print(
                    f"{job['model_key']} remat={job['mode']} b={job['micro_batch_size']}: "
                    f"fit peak {f['fit_peak']:,.0f} MiB ({f['fit_beyond']:,.0f} beyond the "
                    f"baseline), process {f['process']:,.0f} MiB, "
                    f"{f['s_per_sample'] * 1e3:.2f} ms/sample",
                    flush=True,
                )
            else:
                print(f"{job['model_key']} {job['config']}: failed: {run['error']}", flush=True)
    meta["total_s"] = time.perf_counter() - started
    meta["load_end"] = os.getloadavg()[0]
    return write_reports(meta, runs, budget_mib, args.results_dir)


def write_reports(meta, runs, budget_mib, results_dir):
    """<name>.md and <name>.json under ``results_dir``; prints the table. 1 if a job failed."""
    models = meta["models"]
    budgets = {key: budget_of(models[key], runs, key, budget_mib.get(key)) for key in models}
    meta["budgets_mib"] = budgets
    text = report(meta, runs, budgets)
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    base = results_dir / meta["name"]
    base.with_suffix(".md").write_text(text)
    base.with_suffix(".json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    print("\n" + text)
    print(f"wrote {base}.md and .json (the run took {meta['total_s'] / 60:.1f} min)")
    return 1 if any(run["status"] != "ok" for run in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
