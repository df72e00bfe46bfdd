"""The runs of a sweep: found under some paths, each read into one record of what it did.

A run directory is what ``ga-train`` leaves (README, "What a run leaves behind"): Hydra's
``.hydra/``, ``resolved.yaml``, ``tensorboard/`` and, once finished, ``result.json``. Runs are
found however they were started: the job folders of a ``-m`` sweep, the runs of a shell loop under
``outputs/<recipe>/``, or one run. A record's final metrics, updates and host peak memory come from
``result.json`` when the run finished, from its event files otherwise; everything per update
(samples seen, best values, samples/s, device memory) comes from the event files, each update
counted once (:mod:`gacli.runner.run_logging` writes them, :mod:`gacli.report.run_events` reads them
back).

No TensorFlow here.
"""

import dataclasses
import json
import os
import shlex

from gacli.errors import ConfigError
from gacli.report.run_events import event_files, read_run
from gacli.rundir import FAILURE_FILE, LOCK_FILE, RESULT_FILE, has_restorable_checkpoint

FINISHED, INTERRUPTED, FAILED, UNFINISHED = "finished", "interrupted", "failed", "unfinished"
# result.json keys that are not a metric of the model.
_NOT_METRICS = {
    "optimizer_step",
    "micro_step",
    "gradient_noise_scale",
    "effective_batch_size",
    "weights_sha256",
    "host_peak_rss_bytes",
    "skipped_micro_batches",
    "skipped_windows",
    "loss_scale",
}
_NOT_SWEPT = ("hydra.", "resume")  # overrides that say where a run went, not what it did
_SKIP_DIRS = {"checkpoints", "tensorboard"}


class ReportError(ConfigError):
    """Input to ``ga-report`` the user can fix; the message says what to type."""


def lower_is_better(metric):
    """Whether a smaller value of ``metric`` is better: losses and errors, not accuracy or IoU."""
    return any(word in metric for word in ("loss", "error", "mse", "mae", "perplexity"))


def is_run_dir(path):
    return (
        os.path.isfile(os.path.join(path, RESULT_FILE))
        or os.path.isfile(os.path.join(path, FAILURE_FILE))
        or os.path.isfile(os.path.join(path, ".hydra", "overrides.yaml"))
        or bool(event_files(path))
    )


def find_runs(paths):
    """Every run directory under ``paths`` (each a run, a sweep, or a parent of either), sorted."""
    found = set()
    for path in paths:
        if not os.path.isdir(path):
            raise ReportError(
                f"{path} is not a directory. Give a sweep's directory (multirun/<recipe>/<time>), "
                "a run directory, or a folder that holds runs (outputs/<recipe>), e.g. "
                "ga-report multirun/unet/2025-01-01_12-00-00."
            )
        for folder, subfolders, _ in os.walk(path):
            if is_run_dir(folder):
                found.add(os.path.abspath(folder))
                subfolders[:] = []  # a run holds no other runs
            else:
                subfolders[:] = [
                    name
                    for name in subfolders
                    if not name.startswith(".") and name not in _SKIP_DIRS
                ]
    if not found:
        raise ReportError(
            f"no ga-train runs under {', '.join(paths)}: no directory there holds result.json, "
            ".hydra/overrides.yaml or tensorboard event files. Give the directory ga-train printed "
            "as 'run directory:' (or its parent, e.g. multirun/unet/<time> or outputs/unet)."
        )
    return sorted(found)


def _load_yaml(path):
    import yaml

    if not os.path.isfile(path):
        return None
    with open(path) as handle:
        return yaml.load(handle, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def _load_json(path):
    if not os.path.isfile(path):
        return None
    with open(path) as handle:
        return json.load(handle)


@dataclasses.dataclass
class Run:
    """One run directory, read: what it was asked (overrides), what it did (result, events).

    Args:
        path: the run directory.
        overrides: key -> value of the command line it was first started with.
        batch: micro_batch_size, accum_steps, replicas, effective_batch_size (``resolved.yaml``).
        result: ``result.json`` (finished runs), else None.
        failure: ``failure.json`` (runs that failed while training), else None.
        events: the merged :class:`~gacli.report.run_events.RunEvents`.
        command: the ``ga-train`` command that runs it again.
    """

    path: str
    overrides: dict
    batch: dict
    result: dict
    failure: dict
    events: object
    command: str

    @property
    def status(self):
        if self.result is not None:
            return FINISHED
        if has_restorable_checkpoint(self.path):
            return INTERRUPTED
        return FAILED if self.failure is not None else UNFINISHED

    def status_text(self):
        """The status, with how often the run was resumed and why a failed run stopped."""
        text = {INTERRUPTED: "interrupted (resumable)"}.get(self.status, self.status)
        if self.failure is not None and self.result is None:
            reason = str(self.failure.get("error", "")).splitlines()[0][:60]
            text = f"failed (exit {self.failure.get('exit_code')}: {reason})" + (
                ", resumable" if self.status == INTERRUPTED else ""
            )
        starts = len(self.events.files)
        return text + (f", resumed {starts - 1}x" if starts > 1 else "")


def _first_known(*values):
    return next((value for value in values if value is not None), None)


def read_run_dir(path):
    """The :class:`Run` in directory ``path``."""
    listed = _load_yaml(os.path.join(path, ".hydra", "overrides.yaml")) or []
    overrides = {}
    for item in listed:
        key, _, value = str(item).partition("=")
        overrides[key.lstrip("+~")] = value
    events = read_run(path)
    resolved = (_load_yaml(os.path.join(path, "resolved.yaml")) or {}).get("resolved") or {}
    # What the run trained with last (oom=recover may have halved the micro-batch), else what
    # it started with.
    batch = {
        key: _first_known(events.last(tag), resolved.get(key))
        for key, tag in (
            ("micro_batch_size", "batch/micro_size"),
            ("accum_steps", "batch/accum_steps"),
            ("replicas", "batch/replicas"),
            ("effective_batch_size", "batch/effective_size"),
        )
    }
    batch = {key: None if value is None else int(value) for key, value in batch.items()}
    return Run(
        path=path,
        overrides=overrides,
        batch=batch,
        result=_load_json(os.path.join(path, RESULT_FILE)),
        failure=_load_json(os.path.join(path, FAILURE_FILE)),
        events=events,
        command=_command(path, listed),
    )


def _command(path, overrides):
    """``ga-train config=<recipe or file> <overrides>``: the run's job as one command.

    The ``config=`` argument is taken from the command in the run's lock file (as typed: a shipped
    recipe or a path); a sweep's ``-m a=1,2`` becomes this job's own values.
    """
    launched = []
    try:
        with open(os.path.join(path, LOCK_FILE)) as handle:
            launched = shlex.split(handle.read().split(": ", 1)[-1])
    except (OSError, ValueError):  # no lock file, or not one ga-train wrote: use overrides.yaml
        launched = []
    config = [word for word in launched if word.startswith("config=")]
    words = config[-1:] or [
        f"config={o.split('=', 1)[1]}" for o in overrides if o.startswith("config=")
    ]
    words += [str(o) for o in overrides if not str(o).startswith(("config=",) + _NOT_SWEPT)]
    return shlex.join(["ga-train", *words])


def metric_names(run):
    """The model's metrics the run logged (``loss``, ``iou``, ...), without train/val prefixes."""
    names = {key[4:] if key.startswith("val_") else key for key in (run.result or {})}
    names -= _NOT_METRICS
    names |= {
        tag.split("/", 1)[1] for tag in run.events.series if tag.startswith(("train/", "val/"))
    }
    return names


def _best(values, metric):
    values = [value for value in values if value is not None]
    if not values:
        return None
    return min(values) if lower_is_better(metric) else max(values)


def _samples_seen(run):
    """Samples in the run's updates, each update once (None without logged updates)."""
    seen = samples_at_steps(run)
    return seen[max(seen)] if seen else None


def record(run):
    """The run's row of the report, as plain values (the numbers of report.json).

    Finished runs take the final metrics, updates, noise scale and host peak from result.json;
    the others from the last logged update. Best values are over every logged value (the train
    metrics Keras logs each update are the epoch's running means) and the final one.
    """
    result, events = run.result or {}, run.events
    steps = events.series.get("optimizer/step", [])
    updates = result.get("optimizer_step", steps[-1].step if steps else None)
    device_peaks = events.values("memory/device_peak_bytes")
    host_peaks = events.values("memory/host_peak_rss_bytes")
    row = {
        **run.batch,
        "updates": updates,
        "samples_seen": _samples_seen(run),
        "wall_seconds": round(events.training_seconds, 3) if events.segments else None,
        "samples_per_sec": events.last("throughput/mean_samples_per_sec"),
        "host_peak_rss_bytes": result.get(
            "host_peak_rss_bytes", int(max(host_peaks)) if host_peaks else None
        ),
        "device_peak_bytes": int(max(device_peaks)) if device_peaks else None,
    }
    for metric in sorted(metric_names(run)):
        for side, key in (("train", metric), ("val", f"val_{metric}")):
            final = result.get(key, events.last(f"{side}/{metric}"))
            row[f"{side}_{metric}"] = final
            row[f"{side}_{metric}_best"] = _best(
                events.values(f"{side}/{metric}") + [final], metric
            )
    row["gradient_noise_scale"] = (
        result.get("gradient_noise_scale") if run.result else events.last("gns/noise_scale")
    )
    row["status"] = run.status
    row["event_files"] = len(events.files)
    return row


def samples_at_steps(run):
    """update step -> samples in the run's updates up to and including it.

    Each logged point holds ``batch/update_samples``, the samples of its own update. A point that
    follows the previous one by several updates (``steps_per_execution`` above ``accum_steps``
    applies several in one call) adds a full effective batch for each update in between: only an
    epoch's last window can be short. Event files that predate ``batch/update_samples`` count a
    full effective batch per update.
    """
    effective = run.batch["effective_batch_size"] or 0
    per_update = run.events.series.get("batch/update_samples")
    if not per_update:
        return {p.step: p.step * effective for p in run.events.series.get("optimizer/step", [])}
    seen, total, previous = {}, 0, 0
    for point in per_update:
        total += point.value + max(point.step - previous - 1, 0) * effective
        seen[point.step], previous = int(total), point.step
    return seen
