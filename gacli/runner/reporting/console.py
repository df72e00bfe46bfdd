"""What ``ga-train`` shows on the terminal: a start-up panel, progress, a summary table.

On a terminal a rich progress bar shows updates and micro-batches, loss, samples/s and the ETA; when
output is not a terminal, or jobs of a multirun share it, the same facts come as plain lines.
Samples/s is the run's mean training throughput so far, as :mod:`gacli.runner.reporting.throughput`
defines it: the number TensorBoard's ``throughput/mean_samples_per_sec`` holds at the same update.
"""

import os
import sys
import time

import keras
import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from gacli.runner.config.schema import Progress as ProgressMode
from gacli.runner.reporting.throughput import samples_per_second


def make_console():
    """The terminal's width on a terminal; into a file or a pipe, lines are not wrapped (rich
    would wrap at 80 columns there: progress lines are printed with soft_wrap) and the panel may
    be as wide as its longest line.

    Without rich's markup: what is printed holds the user's text (paths, overrides such as
    ``logger=[tensorboard,csv]``, model names), which rich would read as style tags and drop.
    """
    if sys.stdout.isatty() or "COLUMNS" in os.environ:
        return Console(file=sys.stdout, highlight=False, markup=False)
    return Console(file=sys.stdout, highlight=False, markup=False, width=_LOG_WIDTH)


_LOG_WIDTH = 160  # columns of the start-up panel in a log file


def startup_panel(console, cfg, plan, facts):
    """The resolved batch arithmetic and the run's choices, before training starts."""
    lines = [
        f"effective batch  {plan.effective_batch_size} = micro_batch_size {plan.micro_batch_size}"
        f" x accum_steps {plan.accum_steps} x replicas {plan.replicas}",
    ]
    lines += [f"{key:<16} {value}" for key, value in facts.items()]
    # A panel's title is read as markup whatever the console's setting.
    title = escape(f"ga-train: {cfg.config}")
    console.print(Panel("\n".join(lines), title=title, expand=False))


def summary_table(console, rows):
    table = Table(title="summary", show_header=False)
    for key, value in rows.items():
        table.add_row(key, str(value))
    console.print(table)


# The engine's counts beside the metrics in fit()'s logs: TensorBoard's precision/ tags and the
# summary table show them; a progress line shows the loss and the metrics.
_ENGINE_LOGS = ("loss_scale", "skipped_micro_batches", "skipped_windows")


def _format_logs(logs):
    """Every metric fit() logged (the loss, the compiled metrics, the user's, their val_ ones)
    as ``name value``; a metric of several numbers (a per-class score) is left to TensorBoard."""
    shown = []
    for key, value in (logs or {}).items():
        number = np.asarray(value)
        if key in _ENGINE_LOGS or number.size != 1 or not np.issubdtype(number.dtype, np.number):
            continue
        shown.append(f"{key} {float(number):.4g}")
    return "  ".join(shown)


def micro_batches_done(batch, params):
    """Micro-batches of the epoch done at the end of the call that reported ``batch``.

    A call runs steps_per_execution micro-batches, fewer at an epoch's end, where Keras still
    reports the index the full call would have ended at.
    """
    return min(batch + 1, params.get("steps") or batch + 1)


class ProgressCallback(keras.callbacks.Callback):
    """Progress by optimizer update and micro-batch, as a rich bar or as plain lines.

    ``total_updates``: the run's optimizer updates (a schedule's stages summed; under
    ``accum_schedule=gns``, re-estimated at each stage by :meth:`set_total`). ``clock``: the run's
    :class:`~gacli.runner.reporting.throughput.TrainingClock`, placed before this callback.
    """

    def __init__(
        self,
        console,
        mode,
        plan,
        accumulator,
        total_updates,
        epochs,
        parallel_jobs=False,
        *,
        clock,
    ):
        super().__init__()
        self.console = console
        self.plan = plan
        self.accumulator = accumulator
        self.clock = clock
        self.total_updates = total_updates
        self.epochs = epochs
        if mode == ProgressMode.auto:
            mode = (
                ProgressMode.rich
                if console.is_terminal and not parallel_jobs
                else (ProgressMode.plain)
            )
        self.mode = mode
        self._progress = None
        self._task = None
        self._started = False
        self._last_line = 0.0

    def replan(self, plan, recoveries):
        self.plan = plan

    def set_total(self, total_updates):
        """The run's updates, known better now (accum_schedule=gns after a stage began)."""
        self.total_updates = total_updates
        if self._progress is not None:
            self._progress.update(self._task, total=total_updates)

    def on_train_begin(self, logs=None):
        # Called once per fit(); a resumed run's first epoch is a fit() of its own.
        if self._started:
            return
        self._started = True
        if self.mode == ProgressMode.rich:
            # The bar is the whole run's: its updates over every epoch, the epoch beside it.
            self._progress = Progress(
                TextColumn(f"epoch {{task.fields[epoch]}}/{self.epochs}", markup=False),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("updates of the run  micro {task.fields[micro]}", markup=False),
                TextColumn("{task.fields[metrics]}", markup=False),
                TextColumn("{task.fields[speed]}", markup=False),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._progress.start()
            self._task = self._progress.add_task(
                "train",
                total=self.total_updates,
                epoch=1,
                micro=0,
                metrics="",
                speed="",
            )

    def _speed(self, micro_step):
        rate = samples_per_second(self.clock.reading(micro_step))
        return "" if rate is None else f"{rate:.1f} samples/s"

    def on_train_batch_end(self, batch, logs=None):
        if self.mode == ProgressMode.rich and time.perf_counter() - self._last_line > 0.1:
            # Ten refreshes a second at most: reading the counters costs a fast step's time.
            self._refresh(logs)
        elif self.mode == ProgressMode.plain and time.perf_counter() - self._last_line > 10:
            self._last_line = time.perf_counter()
            self._line(logs)

    def _refresh(self, logs):
        self._last_line = time.perf_counter()
        micro_step = int(self.accumulator.after_call("micro_step"))
        self._progress.update(
            self._task,
            completed=int(self.accumulator.after_call("optimizer_step")),
            micro=micro_step,
            metrics=_format_logs(logs),
            speed=self._speed(micro_step),
        )

    def _line(self, logs, prefix=""):
        micro_step = int(self.accumulator.after_call("micro_step"))
        self.console.print(
            f"{prefix}update {int(self.accumulator.after_call('optimizer_step'))}"
            f"/{self.total_updates}  micro-batch {micro_step}  "
            f"{_format_logs(logs)}  {self._speed(micro_step)}",
            soft_wrap=True,
        )

    def on_epoch_begin(self, epoch, logs=None):
        # A resumed run's first fit() begins at its checkpoint's epoch, not the first.
        if self._progress is not None:
            self._progress.update(self._task, epoch=epoch + 1)

    def on_epoch_end(self, epoch, logs=None):
        if self.mode == ProgressMode.rich:
            self._refresh({k: v for k, v in (logs or {}).items() if not k.startswith("val_")})
            self._progress.console.print(
                f"epoch {epoch + 1}/{self.epochs}  {_format_logs(logs)}", soft_wrap=True
            )
        elif self.mode == ProgressMode.plain:
            self._line(logs, prefix=f"epoch {epoch + 1}/{self.epochs}  ")

    def close(self):
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
