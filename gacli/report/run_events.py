"""A run's TensorBoard scalars, read back: one series per tag, each update counted once.

A run writes one event file per process
(:class:`gacli.runner.reporting.run_logs.TensorBoardLogger`): a
resumed run has a second one, which starts again from the last checkpoint. Updates the first process
logged after that checkpoint were done again by the second, so a later file supersedes every step
of the earlier files from its own first step on: the merged series hold each update once, with the
values of the process whose training the run kept.

Event files are read with TensorBoard's own reader. TensorBoard would import TensorFlow to read a
local file (seconds of start-up); :func:`use_tensorboard_stub` makes it use the stub it ships
instead, unless TensorFlow is already loaded or a path needs TensorFlow's file systems.
"""

import dataclasses
import glob
import math
import os
import sys
import types

EVENT_PATTERN = "events.out.tfevents.*"


def use_tensorboard_stub(paths=()):
    """Make TensorBoard read local event files without TensorFlow.

    TensorBoard's ``tensorboard.compat.tf`` takes its stub when a module named
    ``tensorboard.compat.notf`` can be imported (its own switch for builds without TensorFlow).
    Left alone when TensorFlow is already imported, or when a path names a remote file system
    (``gs://``, ``s3://``, ...) that only TensorFlow's ``gfile`` reads.
    """
    if "tensorflow" in sys.modules or any("://" in str(path) for path in paths):
        return
    sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("tensorboard.compat.notf"))


@dataclasses.dataclass
class Point:
    step: int  # the optimizer update the value was logged at
    wall_time: float  # seconds since the epoch
    value: float


@dataclasses.dataclass
class RunEvents:
    """The merged scalars of a run's event files.

    Args:
        files: the event files, oldest process first.
        series: tag -> points ordered by step, each step once.
        logged_points: scalar points in all files before merging (a resumed run's overlap makes
            this larger than the merged count).
        segments: (first, last) wall time of each process's events, oldest first.
    """

    files: list
    series: dict
    logged_points: int
    segments: list

    @property
    def training_seconds(self):
        """Wall time from each process's first event (its training's start) to its last, summed
        over processes: the time between a stop and the resume is not counted."""
        return sum(last - first for first, last in self.segments)

    def elapsed(self, wall_time):
        """Seconds of :attr:`training_seconds` behind an event written at ``wall_time``."""
        behind = 0.0
        for first, last in self.segments:
            if wall_time <= last:
                return behind + max(wall_time - first, 0.0)
            behind += last - first
        return behind

    def values(self, tag):
        return [point.value for point in self.series.get(tag, [])]

    def last(self, tag):
        points = self.series.get(tag)
        return points[-1].value if points else None


def event_files(run_dir):
    """The run's event files, in the order their processes started (their first event)."""
    files = glob.glob(os.path.join(glob.escape(run_dir), "tensorboard", EVENT_PATTERN))
    return sorted(files, key=lambda path: (_start_time(path), path))


def _start_time(path):
    """The wall time TensorBoard writes into the file name (``...tfevents.<seconds>.<host>...``)."""
    try:
        return int(os.path.basename(path).split(".")[3])
    except (IndexError, ValueError):
        return 0


def _scalar(value):
    """The float held by one summary value, or None when it is not a scalar."""
    tensor = value.tensor
    for field in (tensor.float_val, tensor.double_val, tensor.int_val, tensor.int64_val):
        if len(field) == 1:
            return float(field[0])
    return None


def read_file(path):
    """(points by tag, first wall time, last wall time) of one event file.

    A file cut short (a killed process) yields the events before the cut.
    """
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    points, first, last = {}, None, None
    for event in EventFileLoader(path).Load():
        # A damaged file's NaN or infinite time is no time: it would make the run's own endless.
        if event.wall_time and math.isfinite(event.wall_time):
            first = event.wall_time if first is None else first
            last = event.wall_time
        if not event.HasField("summary"):
            continue
        for value in event.summary.value:
            number = _scalar(value)
            if number is not None:
                points.setdefault(value.tag, []).append(Point(event.step, event.wall_time, number))
    return points, first, last


def read_run(run_dir):
    """The :class:`RunEvents` of ``run_dir`` (empty series when it has no event file)."""
    files = event_files(run_dir)
    merged, logged, segments = {}, 0, []
    for path in files:
        points, first, last = read_file(path)
        logged += sum(len(series) for series in points.values())
        if first is not None:
            segments.append((first, last))
        # This process restarted from a checkpoint before its first update: what earlier
        # processes logged from that update on was done again here. (Its updates, not a
        # validation it may log at the checkpoint's own step, say where it started.)
        updates = points.get("optimizer/step") or [p for s in points.values() for p in s]
        if not updates:
            continue
        restart = min(point.step for point in updates)
        for tag in merged:
            merged[tag] = {step: p for step, p in merged[tag].items() if step < restart}
        for tag, series in points.items():
            by_step = merged.setdefault(tag, {})
            for point in series:
                by_step[point.step] = point
    series = {tag: [by_step[s] for s in sorted(by_step)] for tag, by_step in merged.items()}
    return RunEvents(files, {tag: s for tag, s in series.items() if s}, logged, segments)
