"""Resuming: which directory ``resume=`` names (or a SLURM requeue implies), and the guard that
refuses to write over a finished run or to resume with settings that change the maths.

Imports no TensorFlow: ``ga-train`` reads the command line with it before Hydra composes."""

import os
import sys
import time

from omegaconf import OmegaConf

from gacli import rundir
from gacli.errors import ConfigError
from gacli.rundir import (
    check_usable,
)
from gacli.runner.command import overrides as command_line
from gacli.runner.config.schema import FREE_ON_RESUME


def guard_run_dir(cfg, run_dir):
    """Refuse to write over a finished run, or into an unfinished one without ``resume``, or to
    resume with settings that change the maths."""
    check_usable(run_dir, cfg.resume)
    resolved = os.path.join(run_dir, "resolved.yaml")
    if cfg.resume and os.path.exists(resolved):
        before = OmegaConf.to_container(OmegaConf.load(resolved))
        now = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
        changed = _differences(
            {k: v for k, v in before.items() if k not in FREE_ON_RESUME + ("resolved",)},
            {k: v for k, v in now.items() if k not in FREE_ON_RESUME},
        )
        if now["monitor"]["gns"] and not before.get("monitor", {}).get("gns", False):
            raise ConfigError(
                f"resume: {run_dir} was started without monitor.gns, so its checkpoints hold no "
                "noise-scale state to go on from. Resume without monitor.gns=true (the noise "
                "scale can be measured in a new run), or start a new run with it."
            )
        if changed:
            shown = ", ".join(f"{key}={old!r} (now {new!r})" for key, old, new in changed[:4])
            raise ConfigError(
                f"resume: {run_dir} was started with {shown}; a resumed run must use the settings "
                f"it started with ({resolved}). Drop those overrides, or start a new run without "
                "resume=."
            )


def _differences(before, now, prefix=""):
    """[(dotted key, before, now)] where two nested dicts differ."""
    changed = []
    for key in sorted(set(before) | set(now)):
        old, new = before.get(key), now.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            changed += _differences(old, new, f"{prefix}{key}.")
        elif old != new:
            changed.append((f"{prefix}{key}", old, new))
    return changed


_YES = ("true", "yes", "on", "1")


_NO = ("false", "no", "off", "0", "null", "none", "")


def same_command(run_dir, assignments):
    """Whether ``run_dir`` was started with these key=value overrides (in any order)."""
    from omegaconf import OmegaConf

    path = os.path.join(run_dir, ".hydra", "overrides.yaml")
    if not os.path.isfile(path):
        return False
    free = ("config",) + FREE_ON_RESUME
    started = {o for o in OmegaConf.load(path) if command_line.key(o) not in free}
    return started == {o for o in assignments if command_line.key(o) not in free}


def _last_unfinished_run(label, assignments):
    """The newest run of this command under outputs/<label>/ that has a checkpoint to go on from.

    Runs that never reached a checkpoint (stopped on their input, or killed in their first epoch)
    are passed over: there is nothing in them to resume.
    """
    root = os.path.join("outputs", label)
    runs = sorted(os.listdir(root), reverse=True) if os.path.isdir(root) else []
    # A finished probe=batch or check=equivalence run has no result.json, but is finished too.
    unfinished = [
        os.path.join(root, run) for run in runs if not rundir.finished_as(os.path.join(root, run))
    ]
    same = [run_dir for run_dir in unfinished if same_command(run_dir, assignments)]
    for run_dir in same:
        if rundir.live_holder(run_dir) is not None:
            rundir.check_resumable(run_dir, "resume=true")  # the newest is running: refused
        if rundir.has_restorable_checkpoint(run_dir):
            return run_dir
    if same:
        raise ConfigError(
            f"resume=true: no unfinished run of this command under {root}/ has a checkpoint to "
            f"go on from ({'; '.join(same[:3])} stopped before their first). Start the command "
            "again without resume=; a run whose checkpoints were deleted cannot be continued."
        )
    for run in runs:  # this command's newest probe or check says why it is not resumed
        run_dir = os.path.join(root, run)
        if rundir.finished_as(run_dir) not in (None, "training"):
            if same_command(run_dir, assignments):
                rundir.check_resumable(run_dir, "resume=true")
    listed = "; ".join(unfinished[:3]) or "none"
    raise ConfigError(
        f"resume=true found no unfinished run of this command under {root}/ (unfinished runs "
        f"there: {listed}). Give the run directory instead, e.g. resume={root}/<run>, or start a "
        "new run without resume=."
    )


class AlreadyFinished(Exception):
    """A requeued job whose run had finished before SLURM stopped it: nothing is left to do."""


def resume_after_requeue(overrides):
    """A SLURM job started again (requeued, or preempted with --requeue) goes on from its run.

    SLURM runs the job's script again with the same job id, so ``hydra.run.dir=runs/$SLURM_JOB_ID``
    names the first start's directory; ``SLURM_RESTART_COUNT`` says it is a restart. Its
    checkpoints are continued (``resume=<that dir>``); a run that finished meanwhile is left as it
    is. A directory without checkpoints is started afresh, as it would be on the first start.
    """
    from gacli.runner.cluster import slurm

    given = command_line.last(overrides, "hydra.run.dir")
    if (
        not slurm.restart_count()
        or not given
        or "${" in given
        or command_line.given(overrides, "resume")
    ):
        return overrides
    run_dir = os.path.abspath(os.path.expanduser(given))
    if os.path.exists(os.path.join(run_dir, rundir.RESULT_FILE)):
        raise AlreadyFinished(
            f"SLURM restart {slurm.restart_count()} of job {os.environ.get('SLURM_JOB_ID')}: "
            f"{run_dir} holds the run, finished before the restart; nothing to do."
        )
    if not rundir.checkpoint_numbers(run_dir):
        return overrides
    print(
        f"ga-train: SLURM restart {slurm.restart_count()} of job "
        f"{os.environ.get('SLURM_JOB_ID')}: going on from the checkpoints in {run_dir}",
        file=sys.stderr,
    )
    return [*overrides, f"resume={run_dir}"]


def resolve_resume(overrides, label):
    """``resume=true`` or ``resume=<run dir>`` becomes that directory, as the run directory too.

    Hydra's own files of the resumed job go to ``.hydra/resumed-<time>`` in it, so that nothing
    of the first start is overwritten.
    """
    chosen = [o for o in overrides if command_line.key(o) == "resume"]
    rest = [o for o in overrides if command_line.key(o) != "resume"]
    value = command_line.last(chosen, "resume")
    if value is None or value.lower() in _NO:
        return rest
    if any(o in ("-m", "--multirun") for o in rest):
        raise ConfigError(
            "resume= continues one run, not a sweep; resume a sweep's job on its own with its "
            "overrides and resume=<its directory>."
        )
    given_dir = command_line.values(rest, "hydra.run.dir")
    assignments = [
        o
        for o in rest
        if "=" in o and not o.startswith("-") and not command_line.key(o).startswith("hydra.")
    ]
    if value.lower() in _YES and not given_dir and "strategy=multi_worker" in assignments:
        raise ConfigError(
            "resume=true cannot tell the workers' run directories apart (only the chief's holds "
            "the checkpoints); give every worker the chief's: resume=<chief's run dir>, on storage "
            "all workers read."
        )
    if value.lower() in _YES:
        run_dir = given_dir[-1] if given_dir else _last_unfinished_run(label, assignments)
    else:
        run_dir = value
    run_dir = os.path.abspath(os.path.expanduser(run_dir))
    if not os.path.isdir(run_dir):
        raise ConfigError(
            f"resume={value}: {run_dir} is not a directory; give the directory of the run to "
            "continue (ga-train prints it at start), or resume=true for this command's last one."
        )
    rundir.check_resumable(run_dir, f"resume={value}")
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    return [o for o in rest if command_line.key(o) != "hydra.run.dir"] + [
        f"resume='{run_dir}'",
        f"hydra.run.dir='{run_dir}'",
        f"hydra.output_subdir=.hydra/resumed-{stamp}",
    ]


def resume_requeued_job(cfg, run_dir):
    """A job that SLURM started again inside a launcher (submitit requeues a preempted job and
    runs the same job in the same directory) goes on from its checkpoints."""
    from gacli.runner.cluster import slurm

    if not cfg.resume and slurm.restart_count() and rundir.checkpoint_numbers(run_dir):
        print(
            f"ga-train: SLURM restart {slurm.restart_count()}: going on from the checkpoints in "
            f"{run_dir}",
            file=sys.stderr,
        )
        cfg.resume = run_dir
