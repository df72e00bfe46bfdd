"""``ga-report``: a sweep's runs side by side, as a table and as pictures.

The runs are found and read by :mod:`gacli.report.sweep`. Each becomes one row; the columns are the
overrides that differ between runs, the batch arithmetic, what the run did (updates, samples seen,
wall time), its training speed and peak memory, its final and best metrics, its gradient noise
scale and its status. The table goes to the terminal and, with the command of each run, to
``report.md``; the same values to ``report.json``; the curves to PNG files
(:mod:`gacli.report.plots`). TensorFlow is not imported
(:func:`gacli.report.run_events.use_tensorboard_stub`).
"""

import argparse
import dataclasses
import datetime
import json
import os
import sys

from gacli.errors import EXIT_USAGE, ConfigError
from gacli.report.sweep import (
    ReportError,
    find_runs,
    is_run_dir,
    lower_is_better,
    read_run_dir,
    record,
)

_HELP = """ga-report: a sweep of ga-train runs at a glance, as a table and as plots.

  ga-report multirun/unet/2025-01-01_12-00-00     the jobs of a ga-train -m sweep
  ga-report outputs/unet                          every run a shell loop left there
  ga-report outputs/unet multirun/unet --out cmp  several folders; files written to cmp/
  ga-report multirun/unet/<time> --sort samples_per_sec

Finds every run under the paths (finished, interrupted or failed, each marked), prints one row a
run, and writes report.md, report.json and PNG plots (validation against samples seen, speed and
memory against the swept setting, loss against wall time) into the one folder given, or --out.
The best value of each column is marked: lower is better for losses, wall time and memory,
higher for samples/s and other metrics.
"""


@dataclasses.dataclass(frozen=True)
class Column:
    """One column of the report: its key in a row, header, which way is better, how it prints."""

    key: str
    header: str
    better: str = None  # "lower", "higher", or None when no value is better than another
    kind: str = "text"  # int, bytes, seconds, rate, metric, text
    shown: bool = True


def _metric_columns(rows):
    names = sorted({key[6:] for row in rows for key in row if key.startswith("train_")})
    names = {name[:-5] if name.endswith("_best") else name for name in names}
    columns = []
    for metric in sorted(names, key=lambda name: (not lower_is_better(name), name)):
        better = "lower" if lower_is_better(metric) else "higher"
        for side in ("train", "val"):
            columns += [
                Column(f"{side}_{metric}", f"{side} {metric}", better, "metric"),
                Column(f"{side}_{metric}_best", f"{side} {metric} best", better, "metric"),
            ]
    return columns


def build_columns(rows, swept):
    """The report's columns for these rows; ``swept``: the override keys that differ."""
    batch_keys = ("micro_batch_size", "accum_steps", "replicas")
    columns = [Column("run", "run")]
    columns += [Column(key, key) for key in swept if key not in batch_keys]
    columns += [Column(key, key, kind="int", shown=key in swept) for key in batch_keys]
    columns += [
        Column("effective_batch_size", "micro x accum x replicas = effective", kind="batch"),
        Column("updates", "updates", kind="int"),
        Column("samples_seen", "samples seen", kind="int"),
        Column("wall_seconds", "wall time", "lower", "seconds"),
        Column("samples_per_sec", "train samples/s", "higher", "rate"),
        Column("host_peak_rss_bytes", "host peak RSS", "lower", "bytes"),
        Column("device_peak_bytes", "device peak", "lower", "bytes"),
        *_metric_columns(rows),
        Column("gradient_noise_scale", "noise scale", kind="rate"),
        Column("status", "status"),
    ]
    optional = {"device_peak_bytes", "gradient_noise_scale"}
    optional |= {column.key for column in columns if column.key.startswith("val_")}
    return [
        column
        for column in columns
        if column.key not in optional or any(row.get(column.key) is not None for row in rows)
    ]


def swept_keys(runs):
    """Override keys whose values differ between the runs (a key some runs lack differs)."""
    keys = dict.fromkeys(key for run in runs for key in run.overrides)
    keys = [key for key in keys if not key.startswith(("hydra.", "resume"))]
    return [key for key in keys if len({run.overrides.get(key) for run in runs}) > 1]


def _label(path, root):
    """The run's path under ``root``; a sweep job's folder by its job number alone."""
    relative = os.path.relpath(path, root)
    head, name = os.path.split(relative)
    number = name.split("_", 1)[0]
    if number.isdigit() and "=" in name:
        return os.path.join(head, number)
    return "." if relative == "." else relative


def make_rows(runs, root):
    """(rows, columns, swept keys) of ``runs``, rows in the order of ``runs``."""
    swept = swept_keys(runs)
    rows = []
    for run in runs:
        row = {"run": _label(run.path, root)}
        row.update({key: run.overrides.get(key) for key in swept})
        row.update(record(run))
        row.update(path=run.path, command=run.command, status_text=run.status_text())
        rows.append(row)
    return rows, build_columns(rows, swept), swept


def _sortable(value):
    """Numbers by value, before text; a missing value last."""
    if value is None:
        return (2, 0, "")
    try:
        return (0, float(value), "")
    except (TypeError, ValueError):
        return (1, 0, str(value))


def sort_rows(rows, columns, key=None, swept=()):
    """``rows`` sorted by column ``key``, the best first; by the swept overrides when None."""
    if key is None:
        return sorted(rows, key=lambda row: [_sortable(row.get(k)) for k in (*swept, "run")])
    known = {column.key: column for column in columns}
    if key not in known:
        raise ReportError(
            f"--sort {key}: no such column. Sort by one of: {', '.join(known)} "
            "(e.g. --sort samples_per_sec, --sort val_loss)."
        )
    ordered = sorted(rows, key=lambda row: _sortable(row.get(key)))
    if known[key].better == "higher":
        present = [row for row in ordered if row.get(key) is not None]
        ordered = present[::-1] + [row for row in ordered if row.get(key) is None]
    return ordered


def best_values(rows, columns):
    """column key -> its best value, for the columns where one is better and values differ."""
    best = {}
    for column in columns:
        values = [row.get(column.key) for row in rows if row.get(column.key) is not None]
        if column.better and len(set(values)) > 1:
            best[column.key] = min(values) if column.better == "lower" else max(values)
    return best


def is_best(best, column, row):
    return column.key in best and best[column.key] == row.get(column.key)


def format_value(column, row):
    """The text of one cell."""
    value = row.get(column.key)
    if column.key == "status":
        return row.get("status_text") or str(value)
    if column.kind == "batch":
        parts = [row.get(k) for k in ("micro_batch_size", "accum_steps", "replicas")]
        return " x ".join("?" if p is None else str(p) for p in parts) + f" = {value}"
    if value is None:
        return "-"
    if column.kind == "bytes":
        return f"{value / 2**20:,.0f} MiB"
    if column.kind == "seconds":
        return f"{value:.1f} s" if value < 120 else f"{int(value // 60)} min {value % 60:02.0f} s"
    if column.kind == "rate":
        return f"{value:,.1f}" if value >= 10 else f"{value:.3g}"
    if column.kind == "metric":
        return f"{value:.4f}"
    return str(value)


def rich_table(rows, columns, best, title):
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, header_style="bold")
    shown = [column for column in columns if column.shown]
    for column in shown:
        table.add_column(
            column.header,
            justify="left" if column.kind == "text" else "right",
            no_wrap=column.kind in ("batch", "seconds", "bytes"),
        )
    for row in rows:
        table.add_row(
            *(
                Text(
                    format_value(column, row),
                    style="bold green" if is_best(best, column, row) else "",
                )
                for column in shown
            )
        )
    return table


def markdown(rows, columns, best, paths, plots):
    """``report.md``: the table (best values in bold), each run's command, the plots."""
    shown = [column for column in columns if column.shown]

    def cell(column, row):
        text = format_value(column, row).replace("|", "\\|")
        return f"**{text}**" if is_best(best, column, row) else text

    lines = [
        "# ga-report",
        "",
        f"{len(rows)} runs under {', '.join(f'`{p}`' for p in paths)}. The best value of each "
        "column is in **bold**: lower is better for losses, wall time and memory, higher for "
        "training samples/s and the other metrics.",
        "",
        "| " + " | ".join(column.header for column in shown) + " |",
        "|" + "|".join("---" if column.kind == "text" else "---:" for column in shown) + "|",
    ]
    lines += ["| " + " | ".join(cell(column, row) for column in shown) + " |" for row in rows]
    lines += ["", "## Commands", ""]
    lines += [f"- `{row['run']}`: `{row['command']}`" for row in rows]
    if plots:
        lines += ["", "## Plots", ""]
        lines += [f"![{title}]({os.path.basename(path)})" for title, path in plots]
    return "\n".join(lines) + "\n"


def report_json(rows, columns, best, swept, paths):
    """``report.json``: the rows' values (numbers as the runs hold them), the columns, the best."""
    from gacli.rundir import strict_json

    return strict_json(
        {
            "created": datetime.datetime.now().isoformat(timespec="seconds"),
            "paths": [os.path.abspath(path) for path in paths],
            "swept": list(swept),
            "columns": [
                {"key": c.key, "header": c.header, "better": c.better, "shown": c.shown}
                for c in columns
            ],
            "best": best,
            "runs": [{key: value for key, value in row.items()} for row in rows],
        }
    )


def output_dir(paths, out):
    """``--out``; else the one folder given, or the folder the paths share, above any run."""
    if out:
        return out
    folder = os.path.commonpath([os.path.abspath(path) for path in paths])
    while is_run_dir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    return folder


def parse_arguments(argv):
    parser = argparse.ArgumentParser(
        prog="ga-report",
        description=_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("paths", nargs="+", metavar="PATH", help="sweep, run, or folder of runs")
    parser.add_argument("--sort", metavar="COLUMN", help="sort by a column, best first")
    parser.add_argument("--out", metavar="DIR", help="where the files go (default: see above)")
    parser.add_argument("--no-plots", action="store_true", help="write no PNG files")
    return parser.parse_args(argv)


def run_report(paths, sort=None, out=None, plots=True, console=None):
    """Find, read and report the runs under ``paths``; the report's JSON data.

    Raises ReportError on input the user can fix.
    """
    from gacli.report.run_events import use_tensorboard_stub

    use_tensorboard_stub(paths)
    runs = [read_run_dir(path) for path in find_runs(paths)]
    out = output_dir(paths, out)
    rows, columns, swept = make_rows(runs, out)
    rows = sort_rows(rows, columns, sort, swept)
    best = best_values(rows, columns)
    title = f"ga-report: {len(rows)} runs, sorted by {sort or ', '.join(swept) or 'run'}"
    if console is not None:
        console.print(rich_table(rows, columns, best, title))
    _writable(out)
    written = []
    if plots:
        from gacli.report.plots import write_plots

        written = write_plots(runs, rows, swept, out)
    data = report_json(rows, columns, best, swept, paths)
    with open(os.path.join(out, "report.json"), "w") as handle:
        json.dump(data, handle, indent=2, allow_nan=False)
    with open(os.path.join(out, "report.md"), "w") as handle:
        handle.write(markdown(rows, columns, best, paths, written))
    if console is not None:
        console.print(
            f"wrote report.md, report.json and {len(written)} plots to {out}", soft_wrap=True
        )
    return data


def _writable(folder):
    from gacli.rundir import check_writable

    try:
        check_writable(folder, "the report's folder")
    except ConfigError:
        raise ReportError(
            f"the report's folder {folder} cannot be written; give one you can write to with "
            "--out DIR (the runs are only read)."
        ) from None


def _console():
    from rich.console import Console

    if sys.stdout.isatty() or "COLUMNS" in os.environ:
        return Console(highlight=False)
    return Console(highlight=False, width=240)  # a log file: the whole row on one line


def main(argv=None):
    arguments = parse_arguments(sys.argv[1:] if argv is None else argv)
    try:
        run_report(
            arguments.paths,
            sort=arguments.sort,
            out=arguments.out,
            plots=not arguments.no_plots,
            console=_console(),
        )
    except ReportError as error:
        print(f"ga-report: {error}", file=sys.stderr)
        return EXIT_USAGE
    return 0


if __name__ == "__main__":
    sys.exit(main())
