"""Plot a ga-train run's gradient noise scale (gns/noise_scale) against the optimizer step.

Reads the run's TensorBoard events (every point, not TensorBoard's sample of them) and draws the
smoothed noise scale per update, with a horizontal line at the run's effective batch size and, when
every update was logged, the samples seen on a second axis.

    python benchmarks/gns_plot.py RUN_DIR OUT.png [--title TEXT]

RUN_DIR is the directory ga-train prints at the end ("run directory: ..."); its ``tensorboard/``
subdirectory is read, or RUN_DIR itself when it holds the event files.
"""

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

NOISE_TAG = "gns/noise_scale"
EFFECTIVE_TAG = "batch/effective_size"
SAMPLES_TAG = "batch/update_samples"


def read_series(event_dir):
    """{tag: (steps, values)} of every scalar in ``event_dir``, sorted by step; a step written
    twice (a resumed run) keeps its last value."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    accumulator = EventAccumulator(str(event_dir), size_guidance={"tensors": 0})
    accumulator.Reload()
    series = {}
    for tag in accumulator.Tags()["tensors"]:
        points = {}
        for event in accumulator.Tensors(tag):
            value = make_ndarray(event.tensor_proto)
            if value.size == 1:
                points[event.step] = float(value.reshape(()))
        if points:
            steps = sorted(points)
            series[tag] = (steps, [points[step] for step in steps])
    return series


def samples_seen(series, steps):
    """Samples trained on by each of ``steps``, when every update's size was logged; else None."""
    if SAMPLES_TAG not in series:
        return None
    logged, sizes = series[SAMPLES_TAG]
    if logged != list(range(1, len(logged) + 1)):
        return None  # updates without a logged size: the running total would be wrong
    total, totals = 0.0, {}
    for step, size in zip(logged, sizes):
        total += size
        totals[step] = total
    return [totals[step] for step in steps] if all(s in totals for s in steps) else None


def plot(run_dir, out_path, title=None):
    """Draw ``run_dir``'s noise scale into ``out_path``; returns (steps, noise scales, batch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    run_dir = Path(run_dir)
    event_dir = run_dir / "tensorboard" if (run_dir / "tensorboard").is_dir() else run_dir
    series = read_series(event_dir)
    if NOISE_TAG not in series:
        raise SystemExit(
            f"no {NOISE_TAG} in {event_dir} (was the run made with monitor.gns=false?)"
        )
    steps, noise = series[NOISE_TAG]
    effective = series[EFFECTIVE_TAG][1][-1] if EFFECTIVE_TAG in series else None

    figure, axes = plt.subplots(figsize=(7, 4), constrained_layout=True)
    axes.plot(steps, noise, marker=".", markersize=3, label="gradient noise scale (B_simple)")
    if effective is not None:
        axes.axhline(
            effective, color="tab:red", linestyle="--", label=f"effective batch {effective:g}"
        )
    axes.set_xlabel("optimizer step (update)")
    axes.set_ylabel("samples")
    axes.set_ylim(bottom=min(0.0, min(noise)))
    axes.grid(alpha=0.3)
    axes.legend(loc="best")
    axes.set_title(title or f"{NOISE_TAG} over training")
    seen = samples_seen(series, steps)
    if seen is not None and len(steps) > 1:
        steps_axis, seen_axis = np.asarray(steps, float), np.asarray(seen, float)
        top = axes.secondary_xaxis(
            "top",
            functions=(
                lambda x: np.interp(x, steps_axis, seen_axis),
                lambda x: np.interp(x, seen_axis, steps_axis),
            ),
        )
        top.set_xlabel("samples seen")
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out_path, dpi=120)
    plt.close(figure)
    return steps, noise, effective


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a ga-train run directory (or its tensorboard/ directory)")
    parser.add_argument("out", help="the PNG to write")
    parser.add_argument("--title", help="the figure's title")
    args = parser.parse_args(argv)
    steps, noise, effective = plot(args.run_dir, args.out, args.title)
    batch = "unknown" if effective is None else f"{effective:g}"
    print(
        f"{len(steps)} points, steps {steps[0]}-{steps[-1]}; noise scale first {noise[0]:.3g}, "
        f"last {noise[-1]:.3g}, min {min(noise):.3g}, max {max(noise):.3g}; effective batch "
        f"{batch}; wrote {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
