"""A run directory's life: who owns it, whether it finished, which checkpoints it holds.

- A run holds an advisory lock on its directory from before Hydra writes into it until the process
  ends, so a second ``ga-train`` on the same directory stops with the holder's name instead of
  writing over it.
- ``result.json`` is written last, atomically: its presence marks a finished run, which nothing
  writes to again (``probe.json`` marks a finished ``probe=batch``, ``equivalence.json`` a finished
  ``check=equivalence``: :func:`finished_as`).
- A run removes only a directory it made and holds (:func:`discard_unstarted`), never one another
  run made or is running in.
- A run that failed while training leaves ``failure.json`` (exit code and message) beside its
  checkpoints; one that failed on its input before training leaves nothing. A resumed run that
  finishes sets the failure it was resumed from aside as ``failure-before-resume.json``, so that
  ``failure.json`` marks only a run that failed.

No TensorFlow here: these checks answer before TensorFlow loads. Which checkpoint can really be
restored is decided by :class:`gacli.runner.training.run_state.RunState`, which reads every tensor;
the cheap check here (an index file with its end marker, every data shard present) only picks
candidates.
"""

import contextlib
import glob
import json
import math
import os
import re
import shutil
import socket
import sys
import tempfile
import time

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; runs there are not protected from each other
    fcntl = None

from gacli.errors import ConfigError

RESULT_FILE = "result.json"
FAILURE_FILE = "failure.json"
# failure.json of a run that was resumed after it and then finished (kept as the run's history).
EARLIER_FAILURE_FILE = "failure-before-resume.json"
# The micro-batch a run chose for itself (micro_batch_size=auto, oom=recover); a resume keeps it.
BATCH_PLAN_FILE = "batch_plan.json"
CHECKPOINT_DIR = "checkpoints"
LOCK_FILE = ".gacli.lock"
# The last 8 bytes of every TensorFlow checkpoint index (a LevelDB-style table), little-endian.
_TABLE_MAGIC = (0xDB4775248B80FB57).to_bytes(8, "little")
_INDEX = re.compile(r"^ckpt-(\d+)\.index$")

_held = {}  # real path -> open lock file, for the locks this process holds
# Real paths whose lock file this process made: the run directories it started, which it alone
# may remove (discard_unstarted). A directory locked after another process, even one that has
# since ended, was not made by this one (a sweep's jobs may share one through hydra.sweep.subdir).
_created = set()
# Real path -> the closest of its parents that existed before lock() made it (hydra.run.dir=a/b/c
# makes a and b too): discard_unstarted removes those it made as well, while they are empty.
_made_under = {}


def is_chief():
    """Whether this process writes logs and checkpoints (worker 0 of a multi-worker cluster).

    From TF_CONFIG; without it, from SLURM's task rank (ga-train sets TF_CONFIG from SLURM only
    when it builds the strategy, after the run directory is locked).
    """
    return cluster_role() is None


def cluster_role():
    """None for the process that writes the run (a cluster's chief, or a process on its own);
    for any other worker, the words that say which one it is and where that is set, e.g.
    ``"worker 1 (TF_CONFIG)"``. ConfigError for a TF_CONFIG that cannot be read."""
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        rank = os.environ.get("SLURM_PROCID", "0")
        return None if rank == "0" else f"SLURM task {rank} (SLURM_PROCID={rank})"
    config = read_tf_config(raw)
    task, cluster = config.get("task", {}), config.get("cluster", {})
    kind, index = task.get("type", "chief"), task.get("index", 0)
    if kind == "chief" or (kind == "worker" and index == 0 and "chief" not in cluster):
        return None
    return f"{kind} {index} (TF_CONFIG)"


def read_tf_config(raw):
    """TF_CONFIG's JSON object, its ``task`` and ``cluster`` checked to be objects."""
    shape = (
        'e.g. TF_CONFIG=\'{"cluster": {"worker": ["host1:12345", "host2:12345"]}, "task": '
        '{"type": "worker", "index": 0}}\' for strategy=multi_worker (docs/guides/distributed.md)'
        ", or unset it (unset TF_CONFIG) to train in one process"
    )
    shown = raw if len(raw) <= 80 else raw[:77] + "..."
    try:
        config = json.loads(raw)
    except ValueError as error:
        raise ConfigError(
            f"TF_CONFIG is not valid JSON ({error.msg} at character {error.pos}): {shown!r}. "
            f"Give the cluster as a JSON object, {shape}."
        ) from None
    task = config.get("task", {}) if isinstance(config, dict) else None
    if (
        not isinstance(task, dict)
        or not isinstance(config.get("cluster", {}), dict)
        or not isinstance(task.get("index", 0), int)
    ):
        raise ConfigError(
            f'TF_CONFIG={shown!r} is JSON but not a cluster: it needs an object with "cluster" '
            f'(lists of "host:port" by task type) and "task" ({{"type": ..., "index": N}}); '
            f"{shape}."
        )
    return config


def lock(run_dir, command="", resume=None):
    """Hold ``run_dir`` for this process until it ends (or :func:`release`); idempotent.

    Raises ConfigError naming the holder when another process holds it, and (before anything is
    written, the lock file's record of the holder included) :func:`check_usable`'s when it holds a
    finished run, or an unfinished one and no ``resume``: a refused command leaves an earlier
    run's directory exactly as it was.
    """
    path = os.path.realpath(run_dir)
    if path in _held or fcntl is None:
        return
    if finished_as(path) is not None:
        check_usable(run_dir, resume)  # refused before even a lock file is made in it
    existing = nearest_existing(path)
    os.makedirs(path, exist_ok=True)
    first = not os.path.lexists(os.path.join(path, LOCK_FILE))
    handle = open(os.path.join(path, LOCK_FILE), "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # Held now, so no run can finish or start in it meanwhile; a live holder was "in use".
        check_usable(run_dir, resume)
    except ConfigError:
        handle.close()
        if first:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(path, LOCK_FILE))
        raise
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "a process that did not say who it is"
        handle.close()
        raise ConfigError(
            f"{run_dir} is in use by another run: {holder}. Two runs in one directory would write "
            "over each other's checkpoints and results. Wait for that run to end (resume it "
            "afterwards with resume=<its directory> if it was stopped), or leave hydra.run.dir "
            "unset so that this run gets a directory of its own (in a sweep, keep "
            "${hydra.job.num} in hydra.sweep.subdir: one directory per job)."
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(
        f"ga-train, pid {os.getpid()} on {socket.gethostname()}, started "
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {command}\n"
    )
    handle.flush()
    _held[path] = handle
    if first:
        _created.add(path)
        if existing != path:
            _made_under[path] = existing


def held():
    """The run directories this process holds, as real paths."""
    return list(_held)


def release(run_dir):
    _created.discard(os.path.realpath(run_dir))
    _made_under.pop(os.path.realpath(run_dir), None)
    handle = _held.pop(os.path.realpath(run_dir), None)
    if handle is not None:
        handle.close()  # closing the file drops the lock


def check_usable(run_dir, resume):
    """ConfigError when ``run_dir`` holds a finished run (training, probe=batch or
    check=equivalence: every command that writes a run directory), or an unfinished one and no
    ``resume``."""
    what = finished_as(run_dir)
    if what is not None:
        kind = "run" if what == "training" else f"{what} run"
        raise ConfigError(
            f"{run_dir} holds a finished {kind}, which is never written to again"
            + ("; there is nothing to resume. " if resume else ". ")
            + "Leave hydra.run.dir unset (each run gets a new directory) or pick a new one."
        )
    if not resume and checkpoint_numbers(run_dir):
        raise ConfigError(
            f"{run_dir} holds an unfinished run; continue it with resume={run_dir} (or the same "
            "command with resume=true), or leave hydra.run.dir unset to start a new run."
        )


def check_writable(directory, what):
    """ConfigError, before any training, when files cannot be created in ``directory``.

    Creates the directory; tries a real file (``os.access`` says yes to root on a read-only mount).
    """
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".gacli-write-test-"):
            pass
    except OSError as error:
        raise ConfigError(
            f"{what} {directory} cannot be written ({error.strerror or error}); run from a "
            "directory you can write to, or point hydra.run.dir= at one."
        ) from None


def nearest_existing(path):
    """``path`` or the closest of its parents that exists."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def checkpoint_numbers(run_dir):
    """Numbers N of the ``ckpt-N`` index files in the run's checkpoint folder, newest first."""
    folder = os.path.join(run_dir, CHECKPOINT_DIR)
    if not os.path.isdir(folder):
        return []
    found = (_INDEX.match(name) for name in os.listdir(folder))
    return sorted((int(match.group(1)) for match in found if match), reverse=True)


def looks_intact(prefix):
    """Cheap check of checkpoint ``prefix``: an index that ends with its marker, every data shard
    present and not empty. A checkpoint that fails it cannot be restored; one that passes may
    still be damaged inside (RunState reads every tensor before restoring)."""
    try:
        with open(prefix + ".index", "rb") as index:
            index.seek(-len(_TABLE_MAGIC), os.SEEK_END)
            if index.read() != _TABLE_MAGIC:
                return False
    except OSError:
        return False
    shards = glob.glob(glob.escape(prefix) + ".data-*-of-*")
    if not shards:
        return False
    total = int(shards[0].rsplit("-of-", 1)[1])
    return len(shards) == total and all(os.path.getsize(shard) > 0 for shard in shards)


def has_restorable_checkpoint(run_dir):
    folder = os.path.join(run_dir, CHECKPOINT_DIR)
    return any(looks_intact(os.path.join(folder, f"ckpt-{n}")) for n in checkpoint_numbers(run_dir))


def strict_json(value):
    """``value`` with every non-finite float as None: JSON has no NaN or Infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    return value


def write_json(path, value):
    """Write ``value`` as strict JSON, atomically: readers see the old file or the whole new one.

    The file gets the permissions the process umask gives, as the run's other files do (a
    ``tempfile`` scratch file would be 0600)."""
    directory, name = os.path.split(os.path.abspath(path))
    scratch = os.path.join(directory, f".writing-{os.getpid()}-{os.urandom(4).hex()}-{name}")
    try:
        descriptor = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with open(descriptor, "w") as handle:
            json.dump(strict_json(value), handle, indent=2, allow_nan=False)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(scratch, path)
    except BaseException:
        # A full disk, or an interrupt: no half-written file stays behind under its own name.
        with contextlib.suppress(OSError):
            os.remove(scratch)
        raise


def read_json(path):
    """The JSON value in ``path``, or None when there is no such file."""
    try:
        with open(path) as handle:
            return json.load(handle)
    except FileNotFoundError:
        return None


def write_result(run_dir, result):
    """Write ``result.json``, which marks the run finished, then set aside the ``failure.json``
    of an earlier attempt that this run was resumed from (renamed ``failure-before-resume.json``):
    a finished run carries no failure.json."""
    write_json(os.path.join(run_dir, RESULT_FILE), result)
    with contextlib.suppress(FileNotFoundError):
        os.replace(os.path.join(run_dir, FAILURE_FILE), os.path.join(run_dir, EARLIER_FAILURE_FILE))


def record_failure(run_dir, exit_code, message):
    """Mark a run that failed while training (its checkpoints stay; it can be resumed)."""
    if os.path.isdir(run_dir) and not os.path.exists(os.path.join(run_dir, RESULT_FILE)):
        try:
            write_json(
                os.path.join(run_dir, FAILURE_FILE),
                {
                    "exit_code": exit_code,
                    "error": message,
                    "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                },
            )
        except OSError as error:  # a full disk: the message on the terminal is the record
            print(f"ga-train: {FAILURE_FILE} could not be written ({error})", file=sys.stderr)


# What a new run writes before training starts: Hydra's record of the job, the lock, the
# checkpoint folder it checked it could write to, and (late) the resolved config and the files of
# its loggers (gacli.runner.reporting.writers): event files, metrics.csv, its MLflow run's id.
_BEFORE_TRAINING = {
    ".hydra",
    LOCK_FILE,
    CHECKPOINT_DIR,
    "resolved.yaml",
    "tensorboard",
    "metrics.csv",
    "mlflow_run.json",
}


def discard_unstarted(run_dir):
    """Remove the directory of a new run that stopped on its input before training: it holds
    nothing worth keeping, and left behind it would look like an unfinished run. Only a directory
    that this process made and holds (:func:`lock`) is removed, never one another run made or is
    running in, and only while it holds nothing but what such a run writes; anything else (a
    finished run, a checkpoint, a file of the user's) leaves it as it is."""
    path = os.path.realpath(run_dir)
    if path not in _held or path not in _created:
        return
    if not os.path.isdir(run_dir) or checkpoint_numbers(run_dir):
        return
    for name in os.listdir(run_dir):
        entry = os.path.join(run_dir, name)
        empty_log = name.endswith(".log") and os.path.isfile(entry) and not os.path.getsize(entry)
        if name not in _BEFORE_TRAINING and not empty_log:
            return
    # Removed while still locked, so that no other run can start in it half-removed.
    shutil.rmtree(run_dir, ignore_errors=True)
    parent, existing = os.path.dirname(path), _made_under.get(path)
    release(run_dir)
    while existing and parent.startswith(existing + os.sep):
        try:
            os.rmdir(parent)  # only while empty: another run may have begun in it meanwhile
        except OSError:
            break
        parent = os.path.dirname(parent)


def check_ours(run_dir):
    """ConfigError when ``run_dir`` holds files that no ga-train run wrote (a run's directory holds
    its lock file from the first moment): ga-train never writes among a user's own files."""
    names = sorted(name for name in os.listdir(run_dir) if not name.startswith(".writing-"))
    # A run from before runs held a lock file holds only names a run writes (a model.keras alone
    # is a user's file: a run writes it last, beside its result).
    ours = _BEFORE_TRAINING | {FAILURE_FILE, EARLIER_FAILURE_FILE, RESULT_FILE, BATCH_PLAN_FILE}
    ours |= {PROBE_FILE, "probe.png", "branches", EQUIVALENCE_FILE}  # probe=batch, check=...
    if (
        LOCK_FILE in names
        or set(names) <= ours
        or RESULT_FILE in names
        and (set(names) <= ours | {"model.keras"})
    ):
        return
    if names:
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise ConfigError(
            f"hydra.run.dir={run_dir} already holds files that ga-train did not write ({shown}); "
            "a run would write its model.keras, checkpoints and logs among them. Give a new or "
            "empty directory, e.g. hydra.run.dir=runs/first, or leave hydra.run.dir unset (each "
            "run gets a new directory)."
        )


def started_but_never_saved(run_dir):
    """Whether ``run_dir`` holds a ga-train run that stopped before its first checkpoint: nothing
    in it but what a run writes before then (not a finished probe's or check's record, not a
    probe's branches, which are runs of their own)."""
    names = set(os.listdir(run_dir)) if os.path.isdir(run_dir) else set()
    unsaved = _BEFORE_TRAINING | {FAILURE_FILE, BATCH_PLAN_FILE}
    return (
        LOCK_FILE in names
        and ".hydra" in names
        and finished_as(run_dir) is None
        and not checkpoint_numbers(run_dir)
        and all(
            name in unsaved or name.endswith(".log") or name.startswith(".writing-")
            for name in names
        )
    )


def clear_unsaved_start(run_dir):
    """Remove what a run that stopped before its first checkpoint left (its logs, its record of
    the job and resolved config), so that the same command starting again in the directory starts
    clean; the lock file stays."""
    for name in os.listdir(run_dir):
        if name == LOCK_FILE:
            continue
        path = os.path.join(run_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


# The record a run that trains nothing leaves instead of result.json, written last and atomically
# (gacli.runner.tools.batch_probe and gacli.runner.tools.equivalence_check): its presence marks it
# finished.
PROBE_FILE = "probe.json"
EQUIVALENCE_FILE = "equivalence.json"
_FINISHED_WITHOUT_RESULT = ((PROBE_FILE, "probe=batch"), (EQUIVALENCE_FILE, "check=equivalence"))


def finished_as(run_dir):
    """What finished in ``run_dir``: ``"training"`` (result.json), ``"probe=batch"`` (probe.json),
    ``"check=equivalence"`` (equivalence.json, passed or not); None when nothing finished there."""
    if os.path.exists(os.path.join(run_dir, RESULT_FILE)):
        return "training"
    for name, what in _FINISHED_WITHOUT_RESULT:
        if os.path.exists(os.path.join(run_dir, name)):
            return what
    return None


def live_holder(run_dir):
    """Who holds ``run_dir``'s lock (the lock file's text, or a placeholder) while another process
    is running in it; None when no process holds it (or this one does, or locks are unknown).

    Takes a shared lock for an instant, never waiting: a ga-train starting in that instant is told
    the directory is in use, as it would be by a live run."""
    path = os.path.realpath(run_dir)
    if fcntl is None or path in _held:
        return None
    try:
        # O_NONBLOCK: a FIFO named like the lock file must not hang the caller.
        descriptor = os.open(os.path.join(path, LOCK_FILE), os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(descriptor, "rb") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                text = handle.read(4096).decode("utf-8", "replace").strip()
            except OSError:
                text = ""
            return text.splitlines()[0] if text else "a process that did not say who it is"
        except OSError:
            return None
        fcntl.flock(handle, fcntl.LOCK_UN)
    return None


def check_resumable(run_dir, given):
    """ConfigError, saying what to type instead, when ``run_dir`` (named by the user as ``given``,
    e.g. ``resume=true``) holds nothing to resume: a finished run, probe or check, or a run that
    another process is training now."""
    what = finished_as(run_dir)
    if what == "training":
        raise ConfigError(
            f"{given}: {run_dir} holds a finished run; there is nothing to resume. Start a new run "
            "without resume=."
        )
    if what is not None:
        record = dict((kind, name) for name, kind in _FINISHED_WITHOUT_RESULT)[what]
        raise ConfigError(
            f"{given}: {run_dir} holds a finished {what} run (its {record} is written); it trained "
            f"nothing to go on from, so there is nothing to resume. Run {what} again without "
            "resume= (a new directory), or read its result with ga-report "
            f"{os.path.dirname(run_dir) or '.'}."
        )
    # Only the process that writes the run is refused: the other workers of a multi-worker job
    # (a requeued SLURM job's task 1, say) join the run that their chief, holding it, resumes.
    holder = live_holder(run_dir) if is_chief() else None
    if holder is not None:
        raise ConfigError(
            f"{given}: {run_dir} is running now ({holder}); it is not interrupted, so there is "
            "nothing to resume. Wait for it to end (if it is stopped before it finishes, resume it "
            f"then with resume={run_dir}), or start a new run without resume=."
        )
