"""``ga-report``'s pictures: a sweep's runs on shared axes, as PNG files.

- ``validation.png``: each validation metric against samples seen, one line per run. Samples, not
  TensorBoard's optimizer updates, put runs of different ``accum_steps`` on one axis.
- ``speed_memory.png``: training samples/s and peak memory against the swept setting
  (``accum_steps`` when it was swept), one point per run.
- ``loss_time.png``: training loss against wall time, one line per run.

Run ``i`` of the report has colour ``C<i>`` of matplotlib's cycle in every plot. Each PNG carries
its lines' labels by axes in a ``gacli-lines`` text chunk (JSON), so that what a plot shows can be
checked without reading pixels, and the notes under its titles in ``gacli-notes``; the chunk also
marks the file as ga-report's (:func:`gacli.report.files.written_by_report`). When the runs shared
one process (a ``-m`` sweep's basic launcher), the memory panel says that later runs include earlier
runs' memory: their peaks grow from run to run whatever the setting. Figures are drawn with the
object API and the Agg canvas: no pyplot, no change to a caller's matplotlib backend.
"""

import json
import os
import textwrap

from gacli.report.files import write_atomically
from gacli.report.sweep import lower_is_better, samples_at_steps

_MIB = 2**20


def _figure(axes_count):
    from matplotlib.figure import Figure

    figure = Figure(figsize=(5.2 * axes_count, 4.0), layout="constrained")
    return figure, figure.subplots(1, axes_count, squeeze=False)[0]


def _save(figure, axes, lines, path, notes=None):
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            # "best" searches every point for room: seconds for long runs' loss curves.
            points = sum(len(line.get_xdata()) for line in ax.get_lines())
            ax.legend(fontsize="small", loc="best" if points < 500 else "upper right")
    metadata = {"gacli-lines": json.dumps(lines), "gacli-notes": json.dumps(notes or {})}
    write_atomically(
        path,
        lambda handle: figure.savefig(handle, format="png", dpi=100, metadata=metadata),
        binary=True,
    )
    return path


def _colour(index):
    return f"C{index % 10}"


def validation_plot(runs, labels, path):
    """Each validation metric against samples seen; None when no run logged validation."""
    metrics = sorted({t[4:] for run in runs for t in run.events.series if t.startswith("val/")})
    if not metrics:
        return None
    metrics.sort(key=lambda metric: not lower_is_better(metric))  # the loss first
    figure, axes = _figure(len(metrics))
    lines = {}
    for ax, metric in zip(axes, metrics):
        title = f"validation {metric}"
        lines[title] = []
        for index, (run, label) in enumerate(zip(runs, labels)):
            points = run.events.series.get(f"val/{metric}")
            if not points:
                continue
            seen = samples_at_steps(run)
            x = [max((s for u, s in seen.items() if u <= p.step), default=0) for p in points]
            ax.plot(x, [p.value for p in points], "o-", color=_colour(index), label=label)
            lines[title].append(label)
        ax.set(title=title, xlabel="training samples seen", ylabel=metric)
    return _save(figure, axes, lines, path)


def loss_time_plot(runs, labels, path):
    """Training loss against wall time since the run's training started; None without loss."""
    figure, axes = _figure(1)
    lines = {"training loss": []}
    for index, (run, label) in enumerate(zip(runs, labels)):
        points = run.events.series.get("train/loss")
        if not points:
            continue
        x = [run.events.elapsed(point.wall_time) for point in points]
        axes[0].plot(
            x, [p.value for p in points], "o-", markersize=3, color=_colour(index), label=label
        )
        lines["training loss"].append(label)
    if not lines["training loss"]:
        return None
    axes[0].set(title="training loss", xlabel="wall time (s)", ylabel="loss")
    return _save(figure, axes, lines, path)


def _x_axis(rows, swept):
    """(name, positions, tick labels) of the swept setting: accum_steps first, else the first
    swept override, else the run names."""
    key = "accum_steps" if "accum_steps" in swept else (swept[0] if swept else "run")
    values = [row.get(key) for row in rows]
    try:
        numbers = [float(value) for value in values]
    except (TypeError, ValueError):
        return key, list(range(len(rows))), [str(value) for value in values]
    return key, numbers, None


def speed_memory_plot(rows, labels, swept, path, memory_note=None):
    """Training samples/s and peak memory (device where tracked, else host RSS) against the
    swept setting, one point per run in its colour; ``memory_note`` under the memory title
    (why the peaks may not be each run's own)."""
    key, x, ticks = _x_axis(rows, swept)
    device = any(row.get("device_peak_bytes") is not None for row in rows)
    memory_key = "device_peak_bytes" if device else "host_peak_rss_bytes"
    panels = [
        ("samples_per_sec", "training samples/s", 1),
        (memory_key, ("device" if device else "host RSS") + " peak memory (MiB)", _MIB),
    ]
    figure, axes = _figure(2)
    lines, notes = {}, {}
    for ax, (column, title, unit) in zip(axes, panels):
        present = [(x[i], row[column] / unit, i) for i, row in enumerate(rows) if row.get(column)]
        lines[title] = [labels[i] for _, _, i in present]
        # A line through memory peaks that earlier runs raised would read as a trend: left out.
        shared = column == memory_key and memory_note and len(present) > 1
        if present and ticks is None and not shared:
            ordered = sorted(present)
            ax.plot([p[0] for p in ordered], [p[1] for p in ordered], "-", color="0.6", zorder=1)
        for xi, yi, i in present:
            ax.scatter([xi], [yi], s=50, color=_colour(i), zorder=2, label=labels[i])
        ax.set(title=title, xlabel=key, ylabel=title)
        if shared:
            notes[title] = memory_note
            ax.set_title("\n".join([title, *textwrap.wrap(memory_note, 44)]), color="firebrick")
        if ticks is not None:
            ax.set_xticks(x, ticks, rotation=30, ha="right", fontsize="small")
        elif key == "accum_steps" and len(set(x)) > 1:
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted(set(x)), [f"{v:g}" for v in sorted(set(x))])
    return _save(figure, axes, lines, path, notes)


def write_plots(runs, rows, swept, out_dir, memory_note=None):
    """Write the plots of ``rows`` (the report's order) into ``out_dir``; [(title, path)].
    ``memory_note``: why the peaks may not be each run's own, or None."""
    by_path = {run.path: run for run in runs}
    ordered = [by_path[row["path"]] for row in rows]
    labels = [", ".join(f"{key}={row.get(key)}" for key in swept) or row["run"] for row in rows]
    written = [
        (
            "validation against samples seen",
            validation_plot(ordered, labels, os.path.join(out_dir, "validation.png")),
        ),
        (
            "training samples/s and peak memory",
            speed_memory_plot(
                rows, labels, swept, os.path.join(out_dir, "speed_memory.png"), memory_note
            ),
        ),
        (
            "training loss against wall time",
            loss_time_plot(ordered, labels, os.path.join(out_dir, "loss_time.png")),
        ),
    ]
    return [(title, path) for title, path in written if path is not None]
