"""Plot ga-train runs' effective batch and training loss against the samples they trained on.

Reads each run's TensorBoard events (every point): ``batch/effective_size`` and ``train/loss`` per
optimizer update, placed by the samples seen (the running sum of ``batch/update_samples``), and
``val/loss`` per epoch; the validation loss and the stages (result.json's ``accum_schedule``) go in
the legend. One line per run, so a schedule and a fixed effective batch can be compared over the
same data.

    python benchmarks/schedule_plot.py OUT.png RUN_DIR[=LABEL] [RUN_DIR[=LABEL] ...] [--title T]

RUN_DIR is the directory ga-train prints at the end ("run directory: ...").
"""

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from gns_plot import read_series  # noqa: E402  (this folder is the script's)


def run_curves(run_dir):
    """(samples seen per update, effective batch per update, train loss per update, the last
    val loss or None, result.json or {})."""
    series = read_series(Path(run_dir) / "tensorboard")
    missing = [
        t for t in ("batch/update_samples", "batch/effective_size", "train/loss") if t not in series
    ]
    if missing:
        raise SystemExit(f"{run_dir}: no {', '.join(missing)} in its TensorBoard events")
    _, samples = series["batch/update_samples"]
    seen, total = [], 0
    for count in samples:
        total += count
        seen.append(total)
    validation = series.get("val/loss", (None, [None]))[1][-1]
    result_file = Path(run_dir) / "result.json"
    result = json.loads(result_file.read_text()) if result_file.exists() else {}
    return seen, series["batch/effective_size"][1], series["train/loss"][1], validation, result


def plot(runs, out, title):
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (batch_axis, loss_axis) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for run_dir, label in runs:
        seen, effective, loss, validation, result = run_curves(run_dir)
        updates = result.get("optimizer_step", len(seen))
        shown = f"{label}: {updates} updates" + (
            f", final val loss {validation:.3f}" if validation is not None else ""
        )
        batch_axis.step(seen, effective, where="post", label=shown)
        loss_axis.plot(seen, loss, label=label, linewidth=1)
    batch_axis.set_ylabel("effective batch")
    batch_axis.set_yscale("log", base=2)
    batch_axis.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    batch_axis.legend(fontsize=8)
    # Keras' train/loss: the mean over the epoch so far, read at each update.
    loss_axis.set_ylabel("training loss\n(epoch's running mean)")
    loss_axis.set_yscale("log")
    loss_axis.set_xlabel("samples seen")
    loss_axis.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    print(f"wrote {out}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("runs", nargs="+", help="RUN_DIR or RUN_DIR=LABEL")
    parser.add_argument("--title", default="effective batch and loss over training")
    options = parser.parse_args(argv)
    runs = [
        tuple(run.split("=", 1)) if "=" in run else (run, os.path.basename(run))
        for run in options.runs
    ]
    plot(runs, options.out, options.title)


if __name__ == "__main__":
    sys.exit(main())
