"""The runs of a sweep: found under some paths, each read into one record of what it did.

A run directory is what ``ga-train`` leaves (docs/guides/resume.md, "What a run leaves behind"):
Hydra's ``.hydra/``, ``resolved.yaml``, ``tensorboard/`` and, once finished, ``result.json``. Runs
are found however they were started: the job folders of a ``-m`` sweep, the runs of a shell loop
under ``outputs/<recipe>/``, or one run. A record's final metrics, updates and host peak memory come
from ``result.json`` when the run finished, from its event files otherwise; everything per update
(samples seen, best values, samples/s, device memory) comes from the event files, each update
counted once (:mod:`gacli.runner.reporting.run_logs` writes them, :mod:`gacli.report.run_events`
reads them back). A finished ``probe=batch`` run has ``probe.json`` instead of ``result.json`` (its
row is its critical size's), a finished ``check=equivalence`` run ``equivalence.json``; a run whose
lock another process holds (:func:`gacli.rundir.live_holder`) is running, not interrupted.

A run whose files cannot be read (cut short, not the format ga-train writes, unreadable) is not
read at all: :func:`read_runs` names it with what is wrong, and the other runs are reported. So is
a run that holds a value ga-train never writes (a number too large for a float, NaN in JSON, text
that is not Unicode, nesting deeper than Python recurses, a folder name that is not UTF-8).
Event files are the exception: TensorBoard's reader keeps the events before a cut or a damaged
record, which is what a killed process leaves; a value in them that is not finite is a diverged
run's metric (shown as it is) or no measurement (left out), and one in a batch tag leaves the run
out.

No TensorFlow here.
"""

import dataclasses
import json
import math
import os
import re
import shlex
import stat

from gacli.errors import ConfigError
from gacli.report.run_events import event_files, read_run
from gacli.rundir import (
    EQUIVALENCE_FILE,
    FAILURE_FILE,
    LOCK_FILE,
    PROBE_FILE,
    RESULT_FILE,
    has_restorable_checkpoint,
    live_holder,
)

FINISHED, INTERRUPTED, FAILED, UNFINISHED = "finished", "interrupted", "failed", "unfinished"
RUNNING = "running"  # another process holds the run's lock (gacli.rundir.lock) and trains in it
# The largest file of a run ga-report reads: ga-train's own are a few kilobytes.
_MAX_FILE_BYTES = 2**25
# result.json keys that are not a metric of the model: settings, counters, memory, fingerprints.
# A key that names a setting of the run's config (resolved.yaml) is not one either.
_NOT_METRICS = {
    "accum_steps",
    "micro_batch_size",
    "replicas",
    "effective_batch_size",
    "optimizer_step",
    "micro_step",
    "samples_seen",
    "gradient_noise_scale",
    "weights_sha256",
    "weights_epoch",
    "weights_optimizer_step",
    "host_peak_rss_bytes",
    "device_peak_bytes",
    "skipped_micro_batches",
    "skipped_windows",
    "oom_recoveries",
    "loss_scale",
}
# result.json keys that hold a number (or null) in every run ga-train writes.
_NUMBERS = ("optimizer_step", "micro_step", "host_peak_rss_bytes", "gradient_noise_scale")
# A job folder of a -m sweep: "<job number>_<overrides>" (hydra.sweep.subdir), or the number alone.
_JOB_FOLDER = re.compile(r"^\d+(_.*)?$")
_NOT_SWEPT = ("hydra.", "resume")  # overrides that say where a run went, not what it did
# mlartifacts: the copies of runs' files that MLflow keeps beside a sweep's mlflow.db
# (logger=[mlflow]); its result.json files are not runs of their own.
_SKIP_DIRS = {"checkpoints", "tensorboard", "mlartifacts"}


class ReportError(ConfigError):
    """Input to ``ga-report`` the user can fix; the message says what to type."""


class DamagedRun(Exception):
    """A run directory that cannot be read; the message names the file and what is wrong."""


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A run ``ga-report`` found and left out, and why (one line)."""

    path: str
    reason: str


def lower_is_better(metric):
    """Whether a smaller value of ``metric`` is better: losses and errors, not accuracy or IoU."""
    return any(word in metric for word in ("loss", "error", "mse", "mae", "perplexity"))


def is_run_dir(path):
    # exists, not isfile: a result.json that is a folder is a damaged run, not no run.
    return (
        os.path.exists(os.path.join(path, RESULT_FILE))
        or os.path.exists(os.path.join(path, FAILURE_FILE))
        or os.path.exists(os.path.join(path, ".hydra", "overrides.yaml"))
        or bool(event_files(path))
    )


def _not_a_directory(path):
    return ReportError(
        f"{path} is not a directory. Give a sweep's directory (multirun/<recipe>/<time>), "
        "a run directory, or a folder that holds runs (outputs/<recipe>), e.g. "
        "ga-report multirun/unet/2025-01-01_12-00-00."
    )


def find_runs(paths):
    """(every run directory under ``paths``, sorted; the :class:`Skipped` places).

    Each path is a run, a sweep, or a parent of either. Skipped: a path that is not a directory
    (when another path holds runs), a folder that cannot be listed, and a file where a sweep has
    its job folders.
    """
    found, skipped = set(), []

    def unlisted(error):
        skipped.append(Skipped(os.fsdecode(error.filename), f"cannot be listed ({_why(error)})"))

    for path in paths:
        if not os.path.isdir(path):
            skipped.append(Skipped(path, "not a directory"))
            continue
        for folder, subfolders, files in os.walk(path, onerror=unlisted):
            if is_run_dir(folder):
                found.add(os.path.abspath(folder))
                subfolders[:] = []  # a run holds no other runs
                continue
            subfolders[:] = [
                name for name in subfolders if not name.startswith(".") and name not in _SKIP_DIRS
            ]
            if "multirun.yaml" in files:
                skipped += [
                    Skipped(os.path.abspath(os.path.join(folder, name)), "a file, not a run folder")
                    for name in sorted(files)
                    if _JOB_FOLDER.match(name)
                ]
    if not found and skipped and all(place.reason == "not a directory" for place in skipped):
        raise _not_a_directory(skipped[0].path)
    if not found and not skipped:
        raise ReportError(
            f"no ga-train runs under {', '.join(paths)}: no directory there holds result.json, "
            ".hydra/overrides.yaml or tensorboard event files. Give the directory ga-train printed "
            "as 'run directory:' (or its parent, e.g. multirun/unet/<time> or outputs/unet)."
        )
    return sorted(found), skipped


def read_runs(paths):
    """(the :class:`Run` of each directory that could be read, the :class:`Skipped` others)."""
    runs, skipped = [], []
    for path in paths:
        try:
            runs.append(read_run_dir(path))
        except DamagedRun as error:
            skipped.append(Skipped(path, str(error)))
    return runs, skipped


def printable_path(path):
    """``path`` (or a message naming one) as text that can be printed and written: a name that
    is not UTF-8 (held by Python as surrogate escapes) with its bytes as ``\\xff``."""
    try:
        raw = os.fsencode(path)
    except UnicodeEncodeError:
        raw = path.encode("utf-8", "backslashreplace")
    return raw.decode("utf-8", "backslashreplace")


def _not_utf8(text):
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _why(error):
    return error.strerror or str(error)


def _regular_file(path, name):
    """DamagedRun when ``path`` is there but is not a file ga-report can read whole (a FIFO or a
    device would hang or never end; a file of many megabytes is not ga-train's)."""
    try:
        mode = os.stat(path)
    except OSError:
        return  # missing or unreadable: the open that follows says which
    if stat.S_ISDIR(mode.st_mode):
        return
    if not stat.S_ISREG(mode.st_mode):
        what = "is not a regular file (a FIFO, socket or device)"
        raise DamagedRun(f"{printable_path(name)} {what}")
    if mode.st_size > _MAX_FILE_BYTES:
        what = f"holds {mode.st_size:,} bytes, far more than ga-train writes"
        raise DamagedRun(f"{printable_path(name)} {what}")


def _read_text(run_dir, name):
    """The text of file ``name`` of the run, or None when there is none."""
    _regular_file(os.path.join(run_dir, name), name)
    try:
        with open(os.path.join(run_dir, name), encoding="utf-8") as handle:
            return handle.read()
    except FileNotFoundError:
        return None
    except OSError as error:  # a folder of that name, no permission, an I/O error
        raise DamagedRun(f"{name} cannot be read ({_why(error)})") from None
    except UnicodeDecodeError:
        raise DamagedRun(f"{name} is not text (not UTF-8)") from None


def _of_type(value, expected, name):
    """``value`` when it is an ``expected`` (dict or list): what ga-train writes there."""
    if not isinstance(value, expected):
        held = "nothing" if value is None else f"a {type(value).__name__}"
        wanted = "a mapping" if expected is dict else "a list"
        raise DamagedRun(f"{name} holds {held}, not {wanted} (cut short or not ga-train's?)")
    return value


def _load_yaml(run_dir, name, expected):
    import yaml

    text = _read_text(run_dir, name)
    if text is None:
        return None
    try:
        # The pure-Python loader: libyaml's (CSafeLoader) crashes the process on deep nesting.
        value = yaml.load(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as error:
        where = getattr(error, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        raise DamagedRun(f"{name} is not valid YAML{line} (cut short or edited?)") from None
    except RecursionError:
        raise DamagedRun(f"{name} is nested too deeply to be ga-train's") from None
    except ValueError as error:  # an integer of more digits than Python converts
        raise DamagedRun(f"{name} is not ga-train's: {str(error)[:80]}") from None
    return _plain_text(_of_type(value, expected, name), name)


def _load_json(run_dir, name):
    text = _read_text(run_dir, name)
    if text is None:
        return None
    try:
        value = json.loads(text)
    except RecursionError:
        raise DamagedRun(f"{name} is nested too deeply to be ga-train's") from None
    except ValueError as error:
        raise DamagedRun(f"{name} is not valid JSON (cut short?): {error}") from None
    return _plain_text(_of_type(value, dict, name), name)


def _plain_text(value, name):
    """``value`` when its text can be printed: JSON and YAML escapes can make lone surrogates
    (``\\udcff``), which no terminal or UTF-8 file takes. Anchors that refer to themselves, or
    nesting deeper than Python recurses, are not ga-train's either."""
    try:
        json.dumps(value, ensure_ascii=False, default=str, skipkeys=True).encode("utf-8")
    except UnicodeEncodeError:
        raise DamagedRun(f"{name} holds text that is not Unicode (a lone surrogate)") from None
    except (ValueError, RecursionError):  # a circular reference, or nesting too deep
        raise DamagedRun(f"{name} refers to itself or is nested too deeply") from None
    return value


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _shown_value(value):
    """``value`` for a one-line message: a long number by its digits, a long text cut short."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**20:
        return f"a {len(str(abs(value)))}-digit number"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _number_problem(value):
    """Why ``value`` is not a number the report can print and compare; None when it is one."""
    if not _is_number(value):
        return "not a number"
    try:
        finite = math.isfinite(float(value))
    except OverflowError:
        return "too large for a number (ga-train writes floats)"
    # ga-train writes null where a value is not finite (JSON has no NaN), and checks its batch.
    return None if finite else "not a finite number"


def _check_numbers(result, keys, name):
    for key in keys:
        value = result.get(key)
        problem = None if value is None else _number_problem(value)
        if problem:
            raise DamagedRun(f"{name}: {key} is {_shown_value(value)}, {problem}")


def _whole_number(value, name, key):
    if value is None:
        return None
    problem = _number_problem(value)
    if problem == "not a number" or problem is None and value != int(value):
        problem = "not a whole number"
    if problem is not None:
        raise DamagedRun(f"{name}: {key} is {_shown_value(value)}, {problem}")
    return int(value)


@dataclasses.dataclass
class Run:
    """One run directory, read: what it was asked (overrides), what it did (result, events).

    Args:
        path: the run directory.
        overrides: key -> value of the command line it was first started with.
        batch: micro_batch_size, accum_steps, replicas, effective_batch_size (``resolved.yaml``;
            a probe's critical size and a check's window from their records).
        result: ``result.json`` (finished runs; a ``probe=batch`` run's: its critical size's
            row of ``probe.json``), else None.
        failure: ``failure.json`` (runs that failed while training), else None.
        events: the merged :class:`~gacli.report.run_events.RunEvents`.
        command: the ``ga-train`` command that runs it again.
        settings: the top-level keys of the run's config (``resolved.yaml``).
        processes: ``host:pid`` of each process that trained it (event file names, lock file);
            empty when none is recorded.
        finished_as: ``"probe=batch"`` or ``"check=equivalence"`` for a run that trains nothing
            and finished (its ``probe.json`` or ``equivalence.json`` written), else None.
        outcome: that record.
        live: the lock file's first line while another process runs in the directory, else None.
        loss_function: what its loss is (:func:`loss_function`): runs whose losses differ have
            no best loss between them.
    """

    path: str
    overrides: dict
    batch: dict
    result: dict
    failure: dict
    events: object
    command: str
    settings: frozenset = frozenset()
    processes: frozenset = frozenset()
    finished_as: str = None
    outcome: dict = None
    live: str = None
    loss_function: str = None

    @property
    def status(self):
        if self.finished_as == CHECK:
            return FINISHED if self.outcome["passed"] else FAILED
        if self.result is not None:
            return FINISHED
        if self.live is not None:
            return RUNNING
        if has_restorable_checkpoint(self.path):
            return INTERRUPTED
        return FAILED if self.failure is not None else UNFINISHED

    def status_text(self, short=False):
        """The status, with how often the run was resumed and why a failed run stopped (not
        when ``short``)."""
        status = self.status
        text = {INTERRUPTED: "interrupted (resumable)"}.get(status, status)
        if self.finished_as == PROBE:
            text += f" ({PROBE}: critical batch {self.batch['effective_batch_size']})"
        elif self.finished_as == CHECK:
            text += f" ({CHECK}: {'passed' if self.outcome['passed'] else 'not equivalent'})"
        elif status == RUNNING:
            holder = _LOCK_HOLDER.match(self.live)
            if holder and not short:
                text += f" (pid {holder[1]} on {holder[2]})"
        elif self.failure is not None and self.result is None:
            reason = (str(self.failure.get("error", "")).splitlines() or ["?"])[0][:60]
            exit_code = f"exit {_shown_value(self.failure.get('exit_code'))}"
            text = f"failed ({exit_code}" + ("" if short else f": {reason}") + ")"
            text += ", resumable" if status == INTERRUPTED else ""
        starts = len(self.events.files)
        return text + (f", resumed {starts - 1}x" if starts > 1 else "")


PROBE, CHECK = "probe=batch", "check=equivalence"
# The keys of a probe.json size's row that are not the model's metrics.
_PROBE_ROW = {"effective_batch_size", "accum_steps", "updates", "samples_per_second", "seconds"}
_PROBE_ROW |= {"run_dir"}


def _first_known(*values):
    return next((value for value in values if value is not None), None)


def _read_events(path):
    for file in event_files(path):
        _regular_file(file, os.path.relpath(file, path))
    try:
        return read_run(path)
    except OSError as error:  # a folder named like an event file, no permission
        name = os.path.relpath(os.fsdecode(error.filename or "tensorboard"), path)
        raise DamagedRun(f"{printable_path(name)} cannot be read ({_why(error)})") from None
    except UnicodeError:  # TensorBoard's reader takes UTF-8 file names only
        raise DamagedRun("an event file's name is not valid UTF-8; rename it") from None


def _probe_outcome(path):
    """(probe.json, batch, result) of a finished ``probe=batch`` run: the batch and result of
    its critical size's row."""
    outcome = _load_json(path, PROBE_FILE)
    critical = _whole_number(outcome.get("critical_batch_size"), PROBE_FILE, "critical_batch_size")
    sizes = _of_type(outcome.get("sizes"), list, f"{PROBE_FILE}'s sizes:")
    rows = [row for row in sizes if isinstance(row, dict)]
    row = next((r for r in rows if r.get("effective_batch_size") == critical), None)
    if critical is None or row is None:
        raise DamagedRun(f"{PROBE_FILE}: no size is its critical_batch_size {critical!r}")
    micro = _whole_number(outcome.get("micro_batch_size"), PROBE_FILE, "micro_batch_size")
    accum = _whole_number(row.get("accum_steps"), PROBE_FILE, "accum_steps")
    replicas = critical // (micro * accum) if micro and accum else None
    batch = dict(
        micro_batch_size=micro, accum_steps=accum, replicas=replicas, effective_batch_size=critical
    )
    result = {key: value for key, value in row.items() if key not in _PROBE_ROW}
    result["optimizer_step"] = _whole_number(row.get("updates"), PROBE_FILE, "updates")
    return outcome, batch, result


def _check_outcome(path):
    """(record, batch) of a finished ``check=equivalence`` run, from equivalence.json."""
    outcome = _load_json(path, EQUIVALENCE_FILE)
    if not isinstance(outcome.get("passed"), bool):
        shown_passed = _shown_value(outcome.get("passed"))
        raise DamagedRun(f"{EQUIVALENCE_FILE}: passed is {shown_passed}, not true or false")
    window = _of_type(outcome.get("window") or {}, dict, f"{EQUIVALENCE_FILE}'s window:")
    batch = {
        key: _whole_number(window.get(key), EQUIVALENCE_FILE, key)
        for key in ("micro_batch_size", "accum_steps", "replicas")
    }
    batch["replicas"] = 1 if batch["replicas"] is None else batch["replicas"]
    known = [batch[key] for key in ("micro_batch_size", "accum_steps")]
    batch["effective_batch_size"] = (
        None if None in known else known[0] * known[1] * batch["replicas"]
    )
    return outcome, batch


def read_run_dir(path):
    """The :class:`Run` in directory ``path``; DamagedRun when a file of it cannot be read."""
    if _not_utf8(path):
        raise DamagedRun(
            "its path is not valid UTF-8, which TensorBoard's reader needs; rename the folder"
        )
    if not os.path.isdir(path):
        raise DamagedRun("not a directory")
    overrides_name = os.path.join(".hydra", "overrides.yaml")
    listed = _load_yaml(path, overrides_name, list) or []
    overrides = {}
    for item in listed:
        key, _, value = str(item).partition("=")
        overrides[key.lstrip("+~")] = value
    events = _read_events(path)
    config = _load_yaml(path, "resolved.yaml", dict) or {}
    resolved = _of_type(config.get("resolved") or {}, dict, "resolved.yaml's resolved:")
    # What the run trained with last (oom=recover may have halved the micro-batch), else what
    # it started with.
    batch = {}
    for key, tag in (
        ("micro_batch_size", "batch/micro_size"),
        ("accum_steps", "batch/accum_steps"),
        ("replicas", "batch/replicas"),
        ("effective_batch_size", "batch/effective_size"),
    ):
        logged = events.last(tag)
        where, name = ("resolved.yaml", key) if logged is None else ("tensorboard", tag)
        batch[key] = _whole_number(_first_known(logged, resolved.get(key)), where, name)
    result = _load_json(path, RESULT_FILE)
    if result is not None:
        _check_numbers(result, _NUMBERS, RESULT_FILE)
    finished_as, outcome = None, None
    if result is None and os.path.exists(os.path.join(path, PROBE_FILE)):
        finished_as = PROBE
        outcome, batch, result = _probe_outcome(path)
    elif result is None and os.path.exists(os.path.join(path, EQUIVALENCE_FILE)):
        finished_as = CHECK
        outcome, batch = _check_outcome(path)
    holder, launched = _lock_file_command(path)
    run = Run(
        path=path,
        overrides=overrides,
        batch=batch,
        result=result,
        failure=_load_json(path, FAILURE_FILE),
        events=events,
        command=_command(launched, listed, resolved.get("pythonpath")),
        settings=frozenset(config),
        loss_function=loss_function(config),
        processes=frozenset(_event_processes(events.files) + holder),
        finished_as=finished_as,
        outcome=outcome,
        live=live_holder(path) if result is None and finished_as is None else None,
    )
    metric_names(run)  # DamagedRun when a metric of result.json is not a number
    return run


def loss_function(config):
    """What the run's loss is, from its ``resolved.yaml`` (``config``): the name of the loss
    it trained with (``resolved.loss``); for a run that did not record it, the ``loss._target_``
    it was given, else the task or the data its loss was chosen for; None where the file says
    none of these."""
    named = (config.get("resolved") or {}).get("loss")
    if isinstance(named, str):
        return named
    own, dataset = config.get("loss"), config.get("dataset")
    if isinstance(own, dict) and own.get("_target_"):
        return str(own["_target_"])
    if isinstance(dataset, dict):
        if dataset.get("task") not in (None, "auto"):
            return f"the {dataset['task']} task's"
        source = dataset.get("_target_") or dataset.get("name")
        if source:
            return f"the one for {source}"
    return None


_LOCK_HOLDER = re.compile(r"^ga-train, pid (\d+) on (\S+), started ")


def _lock_file_command(path):
    """([``host:pid``] of the process that last held the run, the command it was started with)
    from the run's lock file; ([], []) when there is none or it is not one ga-train wrote."""
    try:
        _regular_file(os.path.join(path, LOCK_FILE), LOCK_FILE)
        with open(os.path.join(path, LOCK_FILE)) as handle:
            text = handle.read()
        holder = _LOCK_HOLDER.match(text)
        launched = shlex.split(text.split(": ", 1)[-1])
    except (OSError, ValueError, DamagedRun):  # none, or not ga-train's: use overrides.yaml
        return [], []
    return ([f"{holder[2]}:{holder[1]}"] if holder else []), launched


def _event_processes(files):
    """``host:pid`` of each event file's process: TensorFlow names the file
    ``events.out.tfevents.<seconds>.<host>.<pid>.<number>[.v2]`` (a host may hold dots)."""
    processes = []
    for path in files:
        name = os.path.basename(path).split(".", 4)[-1].removesuffix(".v2")
        host, _, rest = name.rpartition(".")[0].rpartition(".")
        if host and rest.isdigit():
            processes.append(f"{host}:{rest}")
    return processes


def shared_process(runs):
    """True when two of ``runs`` trained in one process (a ``-m`` sweep's basic launcher runs
    its jobs one after another in one), False when each recorded its own, None when some run
    recorded no process."""
    seen = {}
    for run in runs:
        for process in run.processes:
            if seen.setdefault(process, run.path) != run.path:
                return True
    return None if any(not run.processes for run in runs) else False


def _command(launched, overrides, pythonpath=None):
    """``ga-train config=<recipe or file> <overrides>``: the run's job as one command.

    The ``config=`` argument is taken from the command in the run's lock file (as typed: a shipped
    recipe or a path); a sweep's ``-m a=1,2`` becomes this job's own values. ``pythonpath``: the
    folders the job imported the user's modules from (``resolved.yaml``), set before it.
    """
    config = [word for word in launched if word.startswith("config=")]
    words = config[-1:] or [
        f"config={o.split('=', 1)[1]}" for o in overrides if o.startswith("config=")
    ]
    words += [str(o) for o in overrides if not str(o).startswith(("config=",) + _NOT_SWEPT)]
    command = shlex.join(["ga-train", *words])
    if isinstance(pythonpath, str) and pythonpath:
        command = f"PYTHONPATH={shlex.quote(pythonpath)} {command}"
    return command


def metric_names(run):
    """The model's metrics the run logged (``loss``, ``iou``, ...), without train/val prefixes.

    From the event files' ``train/`` and ``val/`` tags, and result.json's numbers that are not a
    setting, a counter or memory (``accum_steps``, ``optimizer_step``, ...: ``_NOT_METRICS``, and
    any key of the run's config).
    """
    result = run.result or {}
    logged = {
        tag.split("/", 1)[1] for tag in run.events.series if tag.startswith(("train/", "val/"))
    }
    names = {key.removeprefix("val_") for key, value in result.items() if _is_number(value)}
    names -= _NOT_METRICS | run.settings
    names |= logged
    for key in [key for name in names for key in (name, f"val_{name}") if key in result]:
        _check_numbers(result, [key], RESULT_FILE)
    return names


def _best(values, metric):
    values = [value for value in values if value is not None]
    if not values:
        return None
    return min(values) if lower_is_better(metric) else max(values)


def _finite(values):
    """The values an event file may hold that are finite (a damaged one can hold NaN or inf)."""
    return [value for value in values if math.isfinite(value)]


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
    device_peaks = _finite(events.values("memory/device_peak_bytes"))
    host_peaks = _finite(events.values("memory/host_peak_rss_bytes"))
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
        samples = point.value if math.isfinite(point.value) else effective
        total += samples + max(point.step - previous - 1, 0) * effective
        seen[point.step], previous = int(total), point.step
    return seen
