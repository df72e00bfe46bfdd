"""A run directory's life: who owns it, whether it finished, which checkpoints it holds.

- A run holds an advisory lock on its directory from before Hydra writes into it until the process
  ends, so a second ``ga-train`` on the same directory stops with the holder's name instead of
  writing over it.
- ``result.json`` is written last, atomically: its presence marks a finished run, which nothing
  writes to again.
- A run that failed while training leaves ``failure.json`` (exit code and message) beside its
  checkpoints; one that failed on its input before training leaves nothing. A resumed run that
  finishes sets the failure it was resumed from aside as ``failure-before-resume.json``, so that
  ``failure.json`` marks only a run that failed.

No TensorFlow here: these checks answer before TensorFlow loads. Which checkpoint can really be
restored is decided by :class:`gacli.runner.runstate.RunState`, which reads every tensor; the cheap
check here (an index file with its end marker, every data shard present) only picks candidates.
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


def is_chief():
    """Whether this process writes logs and checkpoints (worker 0 of a multi-worker cluster).

    From TF_CONFIG; without it, from SLURM's task rank (ga-train sets TF_CONFIG from SLURM only
    when it builds the strategy, after the run directory is locked).
    """
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        return os.environ.get("SLURM_PROCID", "0") == "0"
    try:
        config = json.loads(raw)
    except ValueError:
        raise ConfigError(f"TF_CONFIG is not valid JSON: {raw!r}.") from None
    task = config.get("task", {})
    return task.get("type", "chief") == "chief" or (
        task.get("type") == "worker"
        and task.get("index", 0) == 0
        and "chief" not in config.get("cluster", {})
    )


def lock(run_dir, command=""):
    """Hold ``run_dir`` for this process until it ends (or :func:`release`); idempotent.

    Raises ConfigError naming the holder when another process holds it.
    """
    path = os.path.realpath(run_dir)
    if path in _held or fcntl is None:
        return
    os.makedirs(path, exist_ok=True)
    handle = open(os.path.join(path, LOCK_FILE), "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "a process that did not say who it is"
        handle.close()
        raise ConfigError(
            f"{run_dir} is in use by another run: {holder}. Two runs in one directory would write "
            "over each other's checkpoints and results. Wait for that run to end (resume it "
            "afterwards with resume=<its directory> if it was stopped), or leave hydra.run.dir "
            "unset so that this run gets a directory of its own."
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(
        f"ga-train, pid {os.getpid()} on {socket.gethostname()}, started "
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {command}\n"
    )
    handle.flush()
    _held[path] = handle


def release(run_dir):
    handle = _held.pop(os.path.realpath(run_dir), None)
    if handle is not None:
        handle.close()  # closing the file drops the lock


def check_usable(run_dir, resume):
    """ConfigError when ``run_dir`` holds a finished run, or an unfinished one and no ``resume``."""
    if os.path.exists(os.path.join(run_dir, RESULT_FILE)):
        raise ConfigError(
            f"{run_dir} holds a finished run, which is never written to again"
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
    """Write ``value`` as strict JSON, atomically: readers see the old file or the whole new one."""
    directory = os.path.dirname(os.path.abspath(path))
    handle = tempfile.NamedTemporaryFile(
        "w", dir=directory, prefix=".writing-", suffix=".json", delete=False
    )
    try:
        with handle:
            json.dump(strict_json(value), handle, indent=2, allow_nan=False)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(handle.name, path)
    except BaseException:
        # A full disk, or an interrupt: no half-written file stays behind under its own name.
        with contextlib.suppress(OSError):
            os.remove(handle.name)
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
# checkpoint folder it checked it could write to, and (late) the resolved config and event file.
_BEFORE_TRAINING = {".hydra", LOCK_FILE, CHECKPOINT_DIR, "resolved.yaml", "tensorboard"}


def discard_unstarted(run_dir):
    """Remove the directory of a new run that stopped on its input before training: it holds
    nothing worth keeping, and left behind it would look like an unfinished run. Only a directory
    that holds nothing but what such a run writes is removed; anything else (a finished run, a
    checkpoint, a file of the user's) leaves it as it is."""
    if not os.path.isdir(run_dir) or checkpoint_numbers(run_dir):
        return
    for name in os.listdir(run_dir):
        path = os.path.join(run_dir, name)
        empty_log = name.endswith(".log") and os.path.isfile(path) and not os.path.getsize(path)
        if name not in _BEFORE_TRAINING and not empty_log:
            return
    # Removed while still locked, so that no other run can start in it half-removed.
    shutil.rmtree(run_dir, ignore_errors=True)
    release(run_dir)


def check_ours(run_dir):
    """ConfigError when ``run_dir`` holds files that no ga-train run wrote (a run's directory holds
    its lock file from the first moment): ga-train never writes among a user's own files."""
    names = sorted(name for name in os.listdir(run_dir) if not name.startswith(".writing-"))
    # A run from before runs held a lock file holds only names a run writes (a model.keras alone
    # is a user's file: a run writes it last, beside its result).
    ours = _BEFORE_TRAINING | {FAILURE_FILE, EARLIER_FAILURE_FILE, RESULT_FILE, BATCH_PLAN_FILE}
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
    """Whether ``run_dir`` holds a ga-train run that stopped before its first checkpoint."""
    return (
        os.path.exists(os.path.join(run_dir, LOCK_FILE))
        and not os.path.exists(os.path.join(run_dir, RESULT_FILE))
        and not checkpoint_numbers(run_dir)
        and os.path.isdir(os.path.join(run_dir, ".hydra"))
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
