"""``ga-report``: a sweep's runs side by side, as a table and as pictures.

The runs are found and read by :mod:`gacli.report.sweep`. Each becomes one row; the columns are the
overrides that differ between runs, the batch arithmetic, what the run did (updates, samples seen,
wall time), its training speed and peak memory, its final and best metrics, its gradient noise
scale and its status. The table goes to ``report.md`` with the command of each run; the same values
to ``report.json``; the curves to PNG files (:mod:`gacli.report.plots`). The terminal shows the
columns that fit its width, one line a run, the swept settings and the main metric first. A run
that cannot be read is left out and named with the reason; the others are reported. TensorFlow is
not imported (:func:`gacli.report.run_events.use_tensorboard_stub`).

Each file ga-report writes says so (report.md's first line, report.json's ``written_by``, the PNG
files' ``gacli-lines`` text chunk), and is written whole or not at all. A file of that name without
the mark is never replaced: ga-report stops before writing anything and asks for another ``--out``.
"""

import argparse
import dataclasses
import datetime
import json
import math
import os
import sys
import typing

from gacli.errors import EXIT_USAGE, ConfigError
from gacli.report.files import (
    MARKDOWN_MARK,
    WRITTEN_BY,
    write_atomically,
    written_by_report,
)
from gacli.report.sweep import (
    ReportError,
    Skipped,
    find_runs,
    is_run_dir,
    lower_is_better,
    metric_names,
    printable_path,
    read_runs,
    record,
    shared_process,
)

PLOT_NAMES = ("validation.png", "speed_memory.png", "loss_time.png")
SHARED_PROCESS_NOTE = {
    True: "runs shared one process: later runs include earlier runs' memory",
    None: "not recorded whether runs shared one process: a run's peak may include earlier runs' "
    "memory",
}

_HELP = """ga-report: a sweep of ga-train runs at a glance, as a table and as plots.

  ga-report multirun/unet/2025-01-01_12-00-00     the jobs of a ga-train -m sweep
  ga-report outputs/unet                          every run a shell loop left there
  ga-report outputs/unet multirun/unet --out cmp  several folders; files written to cmp/
  ga-report multirun/unet/<time> --sort samples_per_sec

Finds every run under the paths (finished, running, interrupted or failed, each marked; a
finished probe=batch or check=equivalence run says so), prints one row a run, and writes
report.md, report.json and PNG plots (validation against samples seen, speed and memory against
the swept setting, loss against wall time) into the one folder given, or --out.
The best value of each column is marked: lower is better for losses, wall time and memory,
higher for samples/s and other metrics; a loss only among runs of one loss. The terminal shows
the columns that fit its width; the files have them all. A run that cannot be read is named
with the reason and left out. Files of those names that ga-report did not write are never
replaced (give another --out).
"""


@dataclasses.dataclass(frozen=True)
class Column:
    """One column of the report: its key in a row, header, which way is better, how it prints."""

    key: str
    header: str
    better: str = None  # "lower", "higher", or None when no value is better than another
    kind: str = "text"  # int, bytes, seconds, rate, metric, text
    shown: bool = True


def _metric_columns(metrics):
    columns = []
    for metric in sorted(metrics, key=lambda name: (not lower_is_better(name), name)):
        better = "lower" if lower_is_better(metric) else "higher"
        for side in ("train", "val"):
            columns += [
                Column(f"{side}_{metric}", f"{side} {metric}", better, "metric"),
                Column(f"{side}_{metric}_best", f"{side} {metric} best", better, "metric"),
            ]
    return columns


def build_columns(rows, swept, metrics):
    """The report's columns for these rows; ``swept``: the override keys that differ;
    ``metrics``: the runs' metric names (:func:`gacli.report.sweep.metric_names`), the only names
    that get metric columns (an override named ``train_...`` is not one)."""
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
        *_metric_columns(metrics),
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
        row["status_short"] = run.status_text(short=True)
        row["loss_function"] = run.loss_function
        rows.append(row)
    metrics = set().union(*(metric_names(run) for run in runs))
    return rows, build_columns(rows, swept, metrics), swept


def _sortable(value):
    """Numbers by value, before text; a missing value last."""
    if value is None:
        return (2, 0, "")
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return (1, 0, str(value))
    return (0, number, "") if not math.isnan(number) else (1, 0, "nan")


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


LOSS_COLUMNS = ("train_loss", "train_loss_best", "val_loss", "val_loss_best")


def unlike_losses(rows):
    """Why no loss is marked best, where the runs' losses are of different kinds (a
    cross-entropy against a squared error: their values do not compare); else None."""
    kinds = {}
    for row in rows:
        kinds.setdefault(row.get("loss_function"), []).append(str(row["run"]))
    if len(kinds) < 2:
        return None
    listed = "; ".join(
        f"{kind or 'not recorded'} in {', '.join(runs)}" for kind, runs in kinds.items()
    )
    return (
        f"no best train or val loss is marked: the runs trained different losses ({listed}), "
        "and a loss of one kind does not compare with another's. Report runs of one loss "
        "together (give ga-report their folders)."
    )


def is_best(best, column, row):
    return column.key in best and best[column.key] == row.get(column.key)


def format_value(column, row, short=False):
    """The text of one cell; ``short``: a failed run's status without its reason."""
    value = row.get(column.key)
    if column.key == "status":
        return row.get("status_short" if short else "status_text") or str(value)
    if column.kind == "batch":
        parts = [row.get(k) for k in ("micro_batch_size", "accum_steps", "replicas")]
        return " x ".join("?" if p is None else str(p) for p in parts) + f" = {value}"
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # nan, inf: a diverged run's logged metric, or a damaged event file
    if column.kind == "bytes":
        return f"{value / 2**20:,.0f} MiB"
    if column.kind == "seconds":
        return f"{value:.1f} s" if value < 120 else f"{int(value // 60)} min {value % 60:02.0f} s"
    if column.kind == "rate":
        return f"{value:,.1f}" if value >= 10 else f"{value:.3g}"
    if column.kind == "metric":
        return f"{value:.4f}"
    return str(value)


def terminal_order(columns, swept):
    """(the column keys a terminal shows, most wanted first; how many it always shows).

    Always: the run, the swept settings, the main metric (the first validation metric, the loss
    when there is one, else the first training one) and the status. Then the other final
    validation metrics, speed, memory, the batch, training metrics, what the run did, the best
    values and the noise scale.
    """
    keys = [column.key for column in columns if column.shown]
    metrics = [column.key for column in columns if column.shown and column.kind == "metric"]
    finals = [key for key in metrics if not key.endswith("_best")]
    val_finals = [key for key in finals if key.startswith("val_")]
    always = ["run", *[key for key in keys if key in swept], *(val_finals or finals)[:1], "status"]
    wanted = [
        *val_finals,
        "samples_per_sec",
        "device_peak_bytes",
        "host_peak_rss_bytes",
        "effective_batch_size",
        *finals,
        "updates",
        "wall_seconds",
        "samples_seen",
        *metrics,
        *keys,
    ]
    order = list(dict.fromkeys(key for key in always + wanted if key in keys))
    return order, len(dict.fromkeys(always))


def rich_table(rows, columns, best, title, width=None, swept=()):
    """(the rich Table, the headers left out): the columns that fit ``width`` terminal columns
    with each row on one line, in the report's order; all of them when ``width`` is None.

    A column is as wide as its widest cell (headers wrap at spaces): rich then never folds a
    cell. Only when the columns always shown do not fit does a cell fold, onto more lines.
    """
    from rich.cells import cell_len
    from rich.table import Table
    from rich.text import Text

    shown = [column for column in columns if column.shown]
    texts = {
        column.key: [format_value(column, row, short=width is not None) for row in rows]
        for column in shown
    }
    needed = {
        column.key: max(cell_len(text) for text in [*column.header.split(), *texts[column.key]])
        for column in shown
    }
    order, always = terminal_order(shown, swept)
    chosen, used = set(), 1  # the table's left edge
    for rank, key in enumerate(order):
        cost = needed[key] + 3  # one space each side and the border on the right
        if width is None or rank < always or used + cost <= width:
            chosen.add(key)
            used += cost
    table = Table(title=title, header_style="bold")
    kept = [column for column in shown if column.key in chosen]
    for column in kept:
        table.add_column(
            column.header,
            justify="left" if column.kind == "text" else "right",
            width=needed[column.key],
            overflow="fold",
        )
    for index, row in enumerate(rows):
        table.add_row(
            *(
                Text(
                    texts[column.key][index],
                    style="bold green" if is_best(best, column, row) else "",
                )
                for column in kept
            )
        )
    return table, [column.header for column in shown if column.key not in chosen]


class Table(typing.NamedTuple):
    """The report's table: a row per run, its columns, the best value of each column."""

    rows: list
    columns: list
    best: dict


def markdown(table, paths, plots, skipped=(), memory_note=None, loss_note=None):
    """``report.md``: the table (best values in bold), each run's command, the plots, the runs
    left out; its first line marks it as ga-report's. ``loss_note``: why no loss is in bold."""
    rows, columns, best = table
    shown = [column for column in columns if column.shown]

    def cell(column, row):
        text = format_value(column, row).replace("|", "\\|")
        return f"**{text}**" if is_best(best, column, row) else text

    lines = [
        MARKDOWN_MARK,
        "# ga-report",
        "",
        f"{len(rows)} runs under {', '.join(f'`{printable_path(p)}`' for p in paths)}. The best "
        "value of each column is in **bold**: lower is better for losses, wall time and memory, "
        "higher for training samples/s and the other metrics.",
        "",
        "| " + " | ".join(column.header for column in shown) + " |",
        "|" + "|".join("---" if column.kind == "text" else "---:" for column in shown) + "|",
    ]
    lines += ["| " + " | ".join(cell(column, row) for column in shown) + " |" for row in rows]
    if loss_note:
        lines += ["", f"Losses: {loss_note}"]
    if memory_note:
        lines += ["", f"Peak memory: {memory_note}."]
    lines += ["", "## Commands", ""]
    lines += [f"- `{row['run']}`: `{row['command']}`" for row in rows]
    if plots:
        lines += ["", "## Plots", ""]
        lines += [f"![{title}]({os.path.basename(path)})" for title, path in plots]
    if skipped:
        lines += ["", "## Runs left out", ""]
        lines += [f"- `{place.path}`: {place.reason}" for place in skipped]
    return "\n".join(lines) + "\n"


def report_json(table, swept, paths, skipped=(), shared=None, loss_note=None):
    """``report.json``: the rows' values (numbers as the runs hold them), the columns, the best
    (and why no loss has one, where the runs' losses differ), the runs left out, whether runs
    shared one process (None: not recorded)."""
    rows, columns, best = table
    from gacli.rundir import strict_json

    return strict_json(
        {
            "written_by": WRITTEN_BY,
            "created": datetime.datetime.now().isoformat(timespec="seconds"),
            "paths": [printable_path(os.path.abspath(path)) for path in paths],
            "swept": list(swept),
            "columns": [
                {"key": c.key, "header": c.header, "better": c.better, "shown": c.shown}
                for c in columns
            ],
            "best": best,
            "no_best_loss": loss_note,
            "runs": [{key: value for key, value in row.items()} for row in rows],
            "skipped": [dataclasses.asdict(place) for place in skipped],
            "runs_shared_one_process": shared,
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

    Runs that cannot be read are left out and named (on standard error when ``console`` is
    given). Raises ReportError on input the user can fix: no run could be read, or a file to be
    written is there and ga-report did not write it.
    """
    from gacli.report.run_events import use_tensorboard_stub

    use_tensorboard_stub(paths)
    runs, skipped = _readable_runs(paths, console)
    if not runs:
        raise ReportError(
            f"no run under {', '.join(paths)} could be read: each of the {len(skipped)} places "
            "found is named above with what is wrong with it (a file cut short, not valid "
            "YAML or JSON, unreadable). Repair or remove them, or give the paths of other runs."
        )
    out = output_dir(paths, out)
    names = ["report.md", "report.json", *(PLOT_NAMES if plots else ())]
    _check_ours(out, names, paths)
    rows, columns, swept = make_rows(runs, out)
    rows = sort_rows(rows, columns, sort, swept)
    best = best_values(rows, columns)
    loss_note = unlike_losses(rows)
    if loss_note:
        for key in LOSS_COLUMNS:
            best.pop(key, None)
    memory = any(row.get(k) for row in rows for k in ("host_peak_rss_bytes", "device_peak_bytes"))
    shared = shared_process(runs) if len(runs) > 1 and memory else False
    title = f"ga-report: {len(rows)} runs, sorted by {sort or ', '.join(swept) or 'run'}"
    if console is not None:
        table, hidden = rich_table(rows, columns, best, title, console.width, swept)
        console.print(table)
        if hidden:
            console.print(f"also in report.md and report.json: {', '.join(hidden)}")
        if loss_note:
            console.print(loss_note, markup=False, soft_wrap=True)
    _writable(out)
    written = []
    if plots:
        from gacli.report.plots import write_plots

        written = write_plots(runs, rows, swept, out, SHARED_PROCESS_NOTE.get(shared))
    results = Table(rows, columns, best)
    data = report_json(results, swept, paths, skipped, shared, loss_note)
    write_atomically(
        os.path.join(out, "report.json"),
        lambda handle: json.dump(data, handle, indent=2, allow_nan=False),
    )
    text = markdown(results, paths, written, skipped, SHARED_PROCESS_NOTE.get(shared), loss_note)
    write_atomically(os.path.join(out, "report.md"), lambda handle: handle.write(text))
    if console is not None:
        left_out = f"; {len(skipped)} left out (named above)" if skipped else ""
        console.print(
            f"wrote report.md, report.json and {len(written)} plots to "
            f"{printable_path(out)}{left_out}",
            soft_wrap=True,
        )
    return data


def _readable_runs(paths, console):
    """(the runs read under ``paths``, the places skipped, by path, each named on standard error
    when there is a ``console``)."""
    found, skipped = find_runs(paths)
    runs, damaged = read_runs(found)
    skipped = sorted(
        (
            Skipped(printable_path(place.path), printable_path(place.reason))
            for place in skipped + damaged
        ),
        key=lambda place: place.path,
    )
    if console is not None:
        for place in skipped:
            print(f"ga-report: skipped {place.path}: {place.reason}", file=sys.stderr)
    return runs, skipped


def _check_ours(out, names, paths):
    """ReportError before anything is written when a file ga-report would write is there and
    ga-report did not write it."""
    for name in names:
        path = os.path.join(out, name)
        if os.path.lexists(path) and not written_by_report(path):
            elsewhere = os.path.join(out, "ga-report")
            raise ReportError(
                f"{path} is there and ga-report did not write it (it has no ga-report mark), so "
                "it is left as it is and nothing was written: ga-report never replaces files it "
                "did not write. Write the report into another folder, e.g. ga-report "
                f"{' '.join(paths)} --out {elsewhere}, or move {name} away first."
            )


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

    # No markup: the runs' paths and commands hold brackets (logger=[tensorboard,csv]).
    if sys.stdout.isatty() or "COLUMNS" in os.environ:
        return Console(highlight=False, markup=False)
    # A log file: the whole row on one line.
    return Console(highlight=False, markup=False, width=240)


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
