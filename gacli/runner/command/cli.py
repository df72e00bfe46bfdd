"""``ga-train``: compose a config with Hydra, validate it, call ``train()`` (training/run.py).

``config=`` picks the primary config: a shipped recipe (``config=unet.yaml``) or a path to your own
YAML file; every other argument is a Hydra override (``accum_steps=8``, ``-m accum_steps=1,2,4``).
TensorFlow is imported only once a config has composed and validated, so ``--help`` and config
errors answer at once.
"""

import contextlib
import os
import signal
import sys
import traceback
from dataclasses import dataclass, field

from gacli import rundir
from gacli.errors import (
    EXIT_FAILURE,
    EXIT_USAGE,
    ConfigError,
    Interrupted,
    ProcessUnusable,
    TrainingFailed,
)
from gacli.runner.command import overrides as command_line

# The rest of gacli.runner (OmegaConf, the config schema) is imported where it is used: main
# installs its signal handler before anything slow, so that a signal in the first moments says
# what became of the run too.

_RUN_DIR = "outputs/${config}/${now:%Y-%m-%d_%H-%M-%S-%f}"
_SWEEP_DIR = "multirun/${config}/${now:%Y-%m-%d_%H-%M-%S-%f}"

_HELP = """ga-train: train a Keras model with exact gradient accumulation.

  ga-train                                     the default job (MLP on digits)
  ga-train config=unet.yaml accum_steps=8      a shipped recipe, with an override
  ga-train config=my_run.yaml                  your YAML (it begins: defaults: [/train, _self_])
  ga-train effective_batch_size=256 micro_batch_size=16     any two of the three batch keys
  ga-train -m accum_steps=1,2,4,8              a sweep (Hydra multirun)
  ga-train config=unet.yaml resume=true        continue this command's interrupted run
  ga-train check=equivalence                   is one accumulated window the big batch's update
                                               on this job's model? (trains nothing)

Shipped recipes: {recipes}
Config groups: model={model}  dataset={dataset}
  optimizer={optimizer}  precision={precision}  strategy={strategy}  check={check}

Every key can be overridden as key=value; --cfg job prints the composed config, --info where
each part of it came from, --version the versions of gacli, TensorFlow and Keras. The config
reference (docs/reference/config.md in the repository) says what every key does. Exit codes:
0 finished, 1 failed while training (resumable), 2 bad input (nothing trained), 128+N stopped by
signal N.
"""

_HYDRA_HELP = """ga-train passes these Hydra options through:
  --cfg job|hydra|all      print the composed config and exit
  --resolve                with --cfg, resolve ${...} interpolations
  --info [all|config|defaults|defaults-tree|plugins|searchpath]
  -m, --multirun           one job per combination of comma-separated values
Hydra's own settings are keys under hydra., e.g. hydra.run.dir=runs/first; with -m, its
launcher and sweeper plugins (pip install "gacli[slurm]"):
  hydra/launcher=submitit_slurm|joblib     one SLURM job, or one local process, per setting
  hydra/sweeper=optuna                     a search that optimises the job's objective=
"""


def _names(package, group=None, suffix=".yaml"):
    from importlib import resources

    root = resources.files(package)
    folder = root / group if group else root
    return sorted(
        entry.name[: -len(suffix)] for entry in folder.iterdir() if entry.name.endswith(suffix)
    )


def _error(message):
    print(f"ga-train: {message}", file=sys.stderr)
    return EXIT_USAGE


def _versions():
    from importlib import metadata

    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return (
        f"gacli {version('gacli')} (TensorFlow {version('tensorflow')}, "
        f"Keras {version('keras')}, Hydra {version('hydra-core')})"
    )


def locate_config(value):
    """(config_path for hydra.main, config_name, label) for a ``config=`` value."""
    if value is None:
        return "pkg://gacli.configs", "train", "default"
    name = (
        value[:-5] if value.endswith(".yaml") else value[:-4] if value.endswith(".yml") else value
    )
    path_like = os.path.sep in value or value.startswith(".")
    if not path_like and name in _names("gacli.recipes"):
        if os.path.isfile(value):
            print(
                f"ga-train: config={value} is the shipped recipe; ./{value} here is not used "
                f"(config=./{value} takes the file).",
                file=sys.stderr,
            )
        return "pkg://gacli.recipes", name, name
    if os.path.isfile(value):
        path = os.path.abspath(value)
        stem = os.path.splitext(os.path.basename(path))[0]
        return os.path.dirname(path), os.path.basename(path), stem
    raise ConfigError(
        f"config={value} is neither a shipped recipe nor a YAML file that exists. Shipped "
        f"recipes: {', '.join(r + '.yaml' for r in _names('gacli.recipes'))}; or give the path to "
        "your own file, e.g. config=./my_run.yaml."
    )


def _split_config_argument(argv):
    config, rest = None, []
    for argument in argv:
        if argument.startswith("config="):
            if "," in argument:
                raise ConfigError(
                    f"{argument}: config= takes one recipe or file; sweep over other keys "
                    "(e.g. -m accum_steps=1,2,4) and run each recipe on its own."
                )
            config = command_line.value(argument)
        else:
            rest.append(argument)
    return config, rest


@dataclass(frozen=True)
class _Command:
    """A command line, checked: what Hydra is started with."""

    config_path: str  # for hydra.main
    config_name: str
    label: str  # the config= value as runs are named by it
    options: list  # Hydra's own (-m, --cfg job, ...)
    assignments: list  # key=value
    overrides: list  # both, as given (resume= resolved)


@dataclass
class _Launch:
    """What ``main`` learnt before Hydra ran, for the job(s) it runs."""

    command: str
    kept_dir: str = None  # a hydra.run.dir that existed before this run: never removed
    started: bool = False  # a job began here; before it, an exit of 1 is Hydra's config error
    in_other_process: bool = False  # jobs run by a launcher's processes (joblib, submitit)
    multirun: bool = False  # -m
    run_dir: str = None  # the directory of the job that runs (or ran last) in this process
    jobs: int = 0  # jobs of a sweep begun in this process
    completed: int = 0  # of them, those that returned an objective
    searching: bool = False  # under a sweeper that optimises (Optuna): failed trials end at 0
    failures: list = field(default_factory=list)  # _Failure of each job that ended early here
    sweep_dir: str = None  # a multirun's hydra.sweep.dir
    # hydra.output_subdir=... as given: the job writes Hydra's record itself (_hold_back_record)
    record_subdir: list = field(default_factory=list)
    record: tuple = None  # (folder, {file name: YAML}) of the job that runs here (_job_record)


@dataclass(frozen=True)
class _Failure:
    """A sweep's job that was refused (exit code 2) or failed in training (1), and why."""

    job: str  # "#<num> (<its overrides>)"
    exit_code: int
    reason: str


def _check_run_dirs(options, assignments, launch):
    """Before Hydra writes into it: the run directory must be usable, writable and ours alone."""
    fixed = command_line.values(assignments, "hydra.run.dir")
    multirun = any(o in ("-m", "--multirun") for o in options)
    if multirun:
        sweep = command_line.values(assignments, "hydra.sweep.dir")
        if sweep and os.path.isdir(sweep[-1]) and os.listdir(sweep[-1]):
            raise ConfigError(
                f"hydra.sweep.dir={sweep[-1]} already holds a sweep's runs; a sweep never writes "
                "into another's directory. Give a new hydra.sweep.dir, or leave it unset (each "
                "sweep gets a new directory)."
            )
        rundir.check_writable(
            rundir.nearest_existing(sweep[-1] if sweep else os.getcwd()),
            "the directory for run outputs,",
        )
        return
    if not fixed or "${" in fixed[-1] or fixed[-1].startswith("~"):
        # Hydra resolves those itself; the job checks and locks the directory it gets.
        rundir.check_writable(os.getcwd(), "the directory for run outputs,")
        return
    run_dir = os.path.abspath(fixed[-1])
    resume = command_line.given(assignments, "resume")
    chief = rundir.is_chief()  # other workers of a cluster share the chief's directory
    if os.path.isdir(run_dir):
        launch.kept_dir = run_dir
        if chief and not resume:
            rundir.check_ours(run_dir)  # before the lock file is made
    rundir.check_writable(rundir.nearest_existing(run_dir), "the run directory's parent,")
    if chief:
        # First: a live run is "in use", not "unfinished"; a refused command writes nothing there.
        rundir.lock(run_dir, launch.command, resume)
    rundir.check_usable(run_dir, resume)
    if chief and not resume and rundir.started_but_never_saved(run_dir):
        _start_again_in(run_dir, assignments)


def _start_again_in(run_dir, assignments):
    """A directory whose run stopped before its first checkpoint: the same command starts again
    in it, clean; another command is refused (its files would mix with the earlier start's)."""
    from gacli.runner.training.resume import same_command

    if not same_command(
        run_dir, [a for a in assignments if not command_line.key(a).startswith("hydra")]
    ):
        raise ConfigError(
            f"hydra.run.dir={run_dir} holds an earlier run of another command that stopped before "
            "its first checkpoint; its logs and settings would mix with this run's. Give a new "
            "hydra.run.dir, or delete that directory if its start is of no use."
        )
    rundir.clear_unsaved_start(run_dir)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    launch = _Launch(command=" ".join(["ga-train", *argv]))
    with _stop_before_training(launch):  # first: a signal from the first moment is answered
        if "--version" in argv:
            print(_versions())
            return 0
        if "--hydra-help" in argv:
            print(_HYDRA_HELP)
            return 0
        from gacli.runner.training.resume import AlreadyFinished

        try:
            checked = _check_command_line(argv, launch)
        except ConfigError as error:
            return _error(error)
        except AlreadyFinished as finished:
            print(f"ga-train: {finished}", file=sys.stderr)
            return 0
        if checked is None:
            return 0  # --help was printed
        return _run_hydra(checked, launch)


@contextlib.contextmanager
def _stop_before_training(launch):
    """SIGTERM and SIGINT outside training (while Hydra composes, TensorFlow loads, the data and
    the model are made) end ga-train at once with one line saying what was saved, and exit code
    128 + N. While it trains, training's own handler takes over and stops after a checkpoint
    (gacli.runner.training.run_state.StopSignals; micro_batch_size=auto's probe has its own too),
    then
    hands back to this one."""
    previous = {}
    for number in (signal.SIGTERM, signal.SIGINT):
        try:
            previous[number] = signal.signal(number, lambda n, frame: _stopped(n, launch))
        except ValueError:  # not the main thread: leave signals alone
            pass
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _stopped(number, launch):
    """End the process on signal ``number`` outside training, saying what its run directory
    keeps; a new run's directory that holds nothing yet is removed (rundir.discard_unstarted)."""
    name = signal.Signals(number).name
    message = f"stopped by {name} before training started: nothing was trained or saved."
    # The directory this process holds; else the last job's (released when the job ended).
    run_dirs = rundir.held() or ([launch.run_dir] if launch.run_dir else [])
    for run_dir in run_dirs:
        what = rundir.finished_as(run_dir)
        if what is not None:
            message = f"stopped by {name} after the run finished; its results are in {run_dir}."
        elif rundir.checkpoint_numbers(run_dir):
            message = (
                f"stopped by {name} outside training, without a new checkpoint; the checkpoints "
                f"in {run_dir} are kept: continue with resume={run_dir}."
            )
        else:
            rundir.discard_unstarted(run_dir)
            removed = (
                "" if os.path.isdir(run_dir) else f", and its run directory {run_dir} is removed"
            )
            message = (
                f"stopped by {name} before training started: nothing was trained or saved{removed}."
            )
    if launch.multirun and launch.started:
        message += " The sweep's jobs that ended before it keep their directories."
    sys.stdout.flush()
    print(f"ga-train: {message}", file=sys.stderr, flush=True)
    os._exit(128 + number)  # at once: TensorFlow may be half-started, nothing is left to save


def _check_command_line(argv, launch):
    """Everything checked before Hydra starts: the config file, the overrides, the run
    directories. Returns a :class:`_Command`, or None after printing --help."""
    from gacli.runner.config.schema import GROUPS
    from gacli.runner.config.validate import check_tolerance_argument
    from gacli.runner.training.resume import resolve_resume, resume_after_requeue

    config, overrides = _split_config_argument(argv)
    config_path, config_name, label = locate_config(config)
    if any(flag in overrides for flag in ("--help", "-h")):
        print(
            _HELP.format(
                recipes=", ".join(r + ".yaml" for r in _names("gacli.recipes")),
                **{group: ", ".join(_names("gacli.configs", group)) for group in GROUPS},
            )
        )
        return None
    rundir.is_chief()  # a TF_CONFIG that cannot be read is refused here, before Hydra starts
    from gacli.runner.command.user_input import check_overrides, replaced_sections

    content = _primary_content(config_path, config_name, config)
    # model._target_=... (on the command line or in the file) replaces the default model's file.
    overrides = replaced_sections([a for a in overrides if a[:1] != "-"], content) + overrides
    # Hydra's parser wants its options (-m, --cfg job, ...) before the key=value overrides;
    # a bare --info would take the next override for its argument. ~model deletes a default.
    options = [
        "--info=all" if a == "--info" else a
        for a in overrides
        if a.startswith("-") or ("=" not in a and not a.startswith("~"))
    ]
    check_overrides([a for a in overrides if a not in options and a != "--info"])
    shows = [o for o in options if o.startswith(("--cfg", "--info", "-c", "-i", "--shell"))]
    if shows and any(o in ("-m", "--multirun") for o in options):
        raise ConfigError(
            f"-m cannot be combined with {shows[0].split('=')[0]}: Hydra shows the config (or its "
            "information) of one job, not of a sweep. Drop -m and give one value of each swept "
            "key, e.g. ga-train accum_steps=4 --cfg job."
        )
    check_tolerance_argument(overrides)
    from gacli.runner.command.hydra_plugins import check_choices

    check_choices(
        [a for a in overrides if a not in options], any(o in ("-m", "--multirun") for o in options)
    )
    overrides = resolve_resume(resume_after_requeue(overrides), label)
    assignments = [a for a in overrides if a not in options and a != "--info"]
    launch.multirun = any(o in ("-m", "--multirun") for o in options)
    if not any(o.startswith(("--cfg", "--info", "-c", "-i")) for o in options):
        _check_run_dirs(options, assignments, launch)
    return _Command(config_path, config_name, label, options, assignments, overrides)


def _primary_content(config_path, config_name, config):
    """The content of the primary YAML: a shipped recipe's, or the user's file's, checked
    (:func:`gacli.runner.command.user_input.check_user_yaml`); None for the default job."""
    from importlib import resources

    import yaml

    from gacli.runner.command.user_input import check_user_yaml
    from gacli.runner.config.schema import GROUPS

    if not config_path.startswith("pkg://"):
        return check_user_yaml(
            os.path.join(config_path, config_name),
            config,
            {group: _names("gacli.configs", group) for group in GROUPS},
        )
    if config_name == "train":
        return None
    package = config_path[len("pkg://") :]
    return yaml.safe_load((resources.files(package) / f"{config_name}.yaml").read_text())


def _run_hydra(command, launch):
    """Compose the config with Hydra and run the job(s); the exit code."""
    import hydra

    from gacli.runner.config.schema import register_configs

    register_configs()
    assignments, extra = _hydra_overrides(command)
    if not any(o.startswith(("--cfg", "--info", "-c", "-i", "--shell")) for o in command.options):
        assignments, extra = _hold_back_record(assignments, extra, launch)
    if _shows_job_config(command.options):
        try:
            _validate_shown_config(command, assignments + extra)
        except ConfigError as error:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            return _error(error)

    def task(cfg):
        return _task(cfg, launch)

    saved_argv = sys.argv
    sys.argv = [sys.argv[0] if sys.argv else "ga-train"]
    sys.argv += command.options + assignments + extra
    try:
        hydra.main(
            version_base="1.3", config_path=command.config_path, config_name=command.config_name
        )(task)()
    except SystemExit as stop:
        if launch.failures and not launch.searching:  # a later job ended the sweep
            _end_of_sweep(launch)
        if stop.code == 1 and not launch.started:
            from gacli.runner.command.hydra_plugins import FAILED_JOBS

            # A job another process ran failed (Hydra printed its paragraph): its exit code.
            # Otherwise Hydra could not compose the config (a malformed override, a value of
            # the wrong type), and said why: the run directory taken for it before Hydra
            # started goes, if this command made it.
            for run_dir in rundir.held():
                rundir.discard_unstarted(run_dir)
            return max(FAILED_JOBS) if FAILED_JOBS else EXIT_USAGE
        raise
    finally:
        sys.argv = saved_argv
    if launch.failures and not launch.searching:
        return _end_of_sweep(launch)
    return 0


def _hydra_overrides(command):
    """(the command's assignments, the overrides gacli adds): its config, where runs and sweeps
    go, and its logging."""
    overrides, assignments = command.overrides, command.assignments
    # hydra/job_logging=stdout: Python logging to the terminal only, no empty <job>.log per run.
    extra = [
        f"config={command.label}",
        "hydra.searchpath=[pkg://gacli.configs]",
        "hydra/job_logging=stdout",
    ]
    if not rundir.is_chief():
        # Other workers share the chief's run directory (or have one that holds nothing): only
        # the chief writes Hydra's record of the job there.
        assignments = [a for a in assignments if command_line.key(a) != "hydra.output_subdir"]
        extra.append("hydra.output_subdir=null")
    if not any(o.startswith("hydra.run.dir=") for o in overrides):
        extra.append(f"hydra.run.dir={_RUN_DIR}")
    if not any(o.startswith("hydra.sweep.dir=") for o in overrides):
        extra.append(f"hydra.sweep.dir={_SWEEP_DIR}")
    if any(o in ("-m", "--multirun") for o in command.options):
        extra.append(
            "++hydra.callbacks.gacli_sweep._target_=gacli.runner.command.hydra_plugins.SweepChecks"
        )
    if not any(o.startswith("hydra.sweep.subdir=") for o in overrides):
        # One directory per job named by its overrides: a sweep opens in TensorBoard as a
        # comparison of, e.g., accum_steps=1 ... accum_steps=8.
        extra += [
            "hydra.sweep.subdir=${hydra.job.num}_${hydra.job.override_dirname}",
            "hydra.job.config.override_dirname.exclude_keys=[config]",
        ]
    return assignments, extra


def _hold_back_record(assignments, extra, launch):
    """Hydra writes its record of a job (config.yaml, hydra.yaml and overrides.yaml under
    hydra.output_subdir) into the job's directory before the job starts, so before ga-train can
    see whether that directory is a new one: a sweep's job given a finished run's directory
    (hydra.sweep.subdir) would rewrite that run's record, and two jobs given one directory would
    each write the other's. Hydra is told to write none (hydra.output_subdir=null); the job writes
    the same files there once it holds the directory and has checked it (_write_record)."""
    given = [a for a in assignments + extra if command_line.key(a) == "hydra.output_subdir"]
    launch.record_subdir = given
    assignments = [a for a in assignments if a not in given]
    extra = [a for a in extra if a not in given]
    return assignments, [*extra, "hydra.output_subdir=null"]


def _job_record(cfg, launch):
    """Hydra's record of the job as its run_job would have written it: (folder, {file name: YAML
    text}); None where no record is kept (hydra.output_subdir=null, or a worker that is not the
    chief). Taken when the job starts, before anything changes its config."""
    import copy

    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf, flag_override

    given = launch.record_subdir
    folder = OverridesParser.create().parse_override(given[-1]).value() if given else ".hydra"
    if folder is None:
        return None
    hydra_cfg = copy.deepcopy(HydraConfig.instance().cfg)
    with flag_override(hydra_cfg.hydra, "readonly", False):
        hydra_cfg.hydra.output_subdir = folder
        # Hydra's list of the command's hydra.* overrides, with the one given, not ga-train's.
        listed = OmegaConf.to_container(hydra_cfg.hydra.overrides.hydra)  # ${...} unresolved
        hydra_cfg.hydra.overrides.hydra = [
            o for o in listed + given if o != "hydra.output_subdir=null"
        ]
        folder = hydra_cfg.hydra.output_subdir  # resolved, as Hydra resolves it
    files = {
        "config.yaml": OmegaConf.to_yaml(cfg),
        "hydra.yaml": OmegaConf.to_yaml(hydra_cfg),
        "overrides.yaml": OmegaConf.to_yaml(hydra_cfg.hydra.overrides.task),
    }
    return folder, files


def _write_record(run_dir, record):
    """Write Hydra's record of the job (:func:`_job_record`) into ``run_dir``, which this process
    holds and has checked."""
    if record is None:
        return
    folder, files = record
    path = os.path.join(run_dir, folder)
    os.makedirs(path, exist_ok=True)
    for name, text in files.items():
        with open(os.path.join(path, name), "w", encoding="utf-8") as handle:
            handle.write(text)


def _shows_job_config(options):
    """Whether the options ask Hydra to print the job's config (``--cfg job`` or ``--cfg all``)."""
    for index, option in enumerate(options):
        if option.startswith(("--cfg=", "-c=")):
            shown = option.split("=", 1)[1]
        elif option in ("--cfg", "-c") and index + 1 < len(options):
            shown = options[index + 1]
        else:
            continue
        if shown in ("job", "all"):
            return True
    return False


def _validate_shown_config(command, overrides):
    """``--cfg job`` prints the config without running the job: the config is composed here and
    checked as a run checks it before training, so that a config a run refuses is refused here
    too (ConfigError). A config Hydra itself cannot compose is left to Hydra, which says why."""
    from hydra import compose, initialize_config_dir, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from gacli.runner.config import objective
    from gacli.runner.config.validate import validate

    if command.config_path.startswith("pkg://"):
        initialize = initialize_config_module(
            command.config_path[len("pkg://") :], version_base="1.3"
        )
    else:
        initialize = initialize_config_dir(command.config_path, version_base="1.3")
    try:
        with initialize:
            cfg = compose(command.config_name, overrides=overrides, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException):
        return
    given = {command_line.key(override) for override in cfg.hydra.overrides.task if "=" in override}
    validate(cfg, given)
    objective.check(cfg.objective, cfg.dataset.validation_split, None, cfg.get("metrics"))


def _task(cfg, launch):
    """One job: validate, train, return the objective a sweeper optimises
    (gacli.runner.config.objective).

    Under a sweeper that optimises (Optuna), a job that fails on its settings or in training
    returns None, a failed trial, and the search goes on (a search none of whose trials completed
    ends with their reasons). In a sweep whose jobs run one after another in this process (Hydra's
    basic launcher), such a job is recorded, the next one starts, and the sweep's end names it
    (:func:`_end_of_sweep`). Elsewhere it ends the command with its exit code.
    """
    from hydra.core.hydra_config import HydraConfig

    from gacli.runner.config import objective

    launch.started = True
    launch.jobs += 1
    hydra_config = HydraConfig.get()
    launch.in_other_process = _parallel_jobs(hydra_config)
    run_dir = hydra_config.runtime.output_dir
    launch.run_dir = run_dir
    directions = _sweeper_directions(hydra_config)
    launch.searching = directions is not None
    launch.sweep_dir = hydra_config.sweep.dir
    launch.record = _job_record(cfg, launch)
    try:
        objective.check(cfg.objective, cfg.dataset.validation_split, directions, cfg.get("metrics"))
    except ConfigError as error:  # the same for every trial: the sweep itself is wrong
        _exit_on(error, run_dir, cfg, launch)
    try:
        metrics = _train(cfg, hydra_config, run_dir, launch)
        if metrics is None:  # check=equivalence passed: nothing was trained, no objective
            return None
        name = objective.metric_name(cfg.objective, cfg.dataset.validation_split)
        value = objective.value(name, metrics)
        launch.completed += 1
        return value
    except (ConfigError, TrainingFailed) as error:
        return _job_failed(error, cfg, hydra_config, run_dir, launch)
    except Interrupted as stop:
        _exit_on(stop, run_dir, cfg, launch)
    except Exception as error:
        if rundir.is_chief():
            rundir.record_failure(run_dir, 1, f"{type(error).__name__}: {error}")
        raise  # an error nobody foresaw: Hydra prints where it happened, exit code 1
    finally:
        rundir.release(run_dir)


def _job_failed(error, cfg, hydra_config, run_dir, launch):
    """A job refused on its settings or failed in training: the command ends with its exit
    code, or (a sweep whose jobs run in turn here, or a search) it is recorded and the sweep goes
    on: None for the launcher, a failed trial for a search."""
    from hydra.types import RunMode

    from gacli.runner.config import objective

    in_turn = hydra_config.mode == RunMode.MULTIRUN and not launch.in_other_process
    if isinstance(error, ProcessUnusable) or not (launch.searching or in_turn):
        _exit_on(error, run_dir, cfg, launch)
    _record(error, run_dir, cfg, launch)
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        traceback.print_exception(error)
    job = " ".join(o for o in hydra_config.overrides.task if command_line.key(o) != "config")
    launch.failures.append(
        _Failure(f"#{hydra_config.job.num} ({job})", error.exit_code, str(error))
    )
    if not launch.searching:
        # Jobs run one after another here (Hydra's basic launcher): the next one is started and
        # the sweep's end names the jobs that did not finish.
        what = "was refused" if error.exit_code == EXIT_USAGE else "failed"
        print(
            f"ga-train: job {launch.failures[-1].job} {what}, the sweep goes on: {error}",
            file=sys.stderr,
        )
        return None
    if _no_trial_can_complete(hydra_config, launch):
        sys.exit(_end_of_sweep(launch))
    print(f"ga-train: this trial failed, the sweep goes on: {error}", file=sys.stderr)
    return objective.FAILED


def _no_trial_can_complete(hydra_config, launch):
    """Whether this was an Optuna search's last trial and none of them completed, every one run
    here: Optuna would end it with "No trials are completed yet" and a traceback."""
    sweeper = hydra_config.sweeper
    trials = sweeper.get("n_trials")
    return (
        trials is not None
        and sweeper.get("storage") is None  # a stored study may hold trials of earlier sweeps
        and not launch.in_other_process
        and launch.completed == 0
        and hydra_config.job.num + 1 >= trials
    )


def _end_of_sweep(launch):
    """Print, as one paragraph, the sweep's jobs that did not finish and why; the exit code: 2
    if every one was refused on its input, else 1. Each is printed once."""
    failures, launch.failures = launch.failures, []
    refused = all(failure.exit_code == EXIT_USAGE for failure in failures)
    kind = "trials" if launch.searching else "jobs"
    by_reason = {}  # the same reason, for several jobs, is said once
    for failure in failures:
        by_reason.setdefault((failure.exit_code, failure.reason), []).append(failure.job)
    ended = []
    for (code, reason), jobs in by_reason.items():
        what = (
            "failed" if code != EXIT_USAGE else "was refused" if len(jobs) == 1 else "were refused"
        )
        ended.append(f"{', '.join(jobs)} {what}: {reason.rstrip('.')}.")
    if launch.searching and launch.completed == 0:
        head = (
            f"no trial of the search completed, so it has no best one ({len(failures)} {kind} ran)."
        )
    else:
        head = f"{len(failures)} of the sweep's {launch.jobs} {kind} did not finish."
    tail = (
        "Nothing of a refused job was trained; fix its setting and run it on its own."
        if refused
        else f"A failed job keeps its checkpoints and failure.json under {launch.sweep_dir}."
    )
    print(f"ga-train: {head} {' '.join(ended)} {tail}", file=sys.stderr, flush=True)
    return EXIT_USAGE if refused else EXIT_FAILURE


def _train(cfg, hydra_config, run_dir, launch):
    """Validate, take the run directory, start TensorFlow and train; the final metrics."""
    given = {
        command_line.key(override) for override in hydra_config.overrides.task if "=" in override
    }
    from gacli.runner.config.validate import validate
    from gacli.runner.training.resume import resume_requeued_job

    validate(cfg, given)
    resume_requeued_job(cfg, run_dir)
    _join_slurm_cluster(cfg)
    _refuse_lone_worker(cfg, run_dir, launch)
    if rundir.is_chief():
        rundir.lock(run_dir, launch.command, cfg.resume)
    # Every command that writes a run directory (training, probe=batch, check=equivalence) is
    # refused a finished one; under -m the command line could not check the job's directory.
    rundir.check_usable(run_dir, cfg.resume)
    if rundir.is_chief():
        _write_record(run_dir, launch.record)
    from gacli.runner.command.quiet_stderr import tensorflow_startup

    with tensorflow_startup():
        import tensorflow as tf

        tf.config.list_physical_devices()  # CUDA's probe, and its messages, happen here
    if cfg.probe.name == "batch":
        from gacli.runner.tools.batch_probe import probe_batch

        return probe_batch(cfg, run_dir, parallel_jobs=_parallel_jobs(hydra_config))
    if cfg.check.name.value == "equivalence":
        from gacli.runner.tools.equivalence_check import run_equivalence_check

        run_equivalence_check(cfg, run_dir, given)
        return None
    from gacli.runner.training.run import train

    return train(cfg, run_dir=run_dir, given=given, parallel_jobs=_parallel_jobs(hydra_config))


def _join_slurm_cluster(cfg):
    """TF_CONFIG (and each task's GPUs) from SLURM, before the chief check and TensorFlow; and a
    refusal of several SLURM tasks that would each train alone."""
    from gacli.runner.cluster import slurm
    from gacli.runner.config.schema import ClusterSource, StrategyName

    several = cfg.strategy.name == StrategyName.multi_worker
    if several and cfg.strategy.cluster == ClusterSource.slurm:
        slurm.configure(port=cfg.strategy.port)
        return
    tasks = os.environ.get("SLURM_NTASKS", "1")
    if "SLURM_STEP_ID" in os.environ and tasks.isdigit() and int(tasks) > 1 and not several:
        raise ConfigError(
            f"this is one of {tasks} SLURM tasks, but strategy={cfg.strategy.name.value} trains "
            "in one process, so each task would train the same model alone. To train together, "
            "add strategy=multi_worker strategy.cluster=slurm; to train once, start one task "
            "(srun -n1, or hydra.launcher.tasks_per_node=1)."
        )


def _refuse_lone_worker(cfg, run_dir, launch):
    """A process that is not its cluster's chief never writes the run directory; under a strategy
    of one process it would train alone and save nothing: refused before training."""
    from gacli.runner.config.schema import StrategyName

    if cfg.strategy.name == StrategyName.multi_worker:
        return
    role = rundir.cluster_role()
    if role is None:
        _refuse_lone_chief(cfg)
        return
    if os.path.isdir(run_dir) and not os.listdir(run_dir):
        # The empty directory Hydra made for this process: held, so that the refusal removes it.
        with contextlib.suppress(ConfigError):
            rundir.lock(run_dir, launch.command)
    variable = "TF_CONFIG" if os.environ.get("TF_CONFIG") else "SLURM_PROCID"
    raise ConfigError(
        f"this process is {role}, not its cluster's chief, and only the chief writes the run "
        f"directory; strategy={cfg.strategy.name.value} trains in this one process, so it would "
        "train alone and save nothing. To train with the other workers, add "
        "strategy=multi_worker (under SLURM: strategy=multi_worker strategy.cluster=slurm); to "
        f"train on its own, unset {variable} (a process on its own is its own chief)."
    )


def _refuse_lone_chief(cfg):
    """The chief of a TF_CONFIG cluster of several tasks, under a strategy of one process, would
    train alone while the cluster's other tasks wait for it or train copies of their own:
    refused before training, as the other workers are."""
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        return
    config = rundir.read_tf_config(raw)
    cluster = config.get("cluster", {})
    # An evaluator reads checkpoints beside the cluster; it takes no part in training.
    tasks = sum(
        len(hosts) if isinstance(hosts, (list, dict)) else 1
        for kind, hosts in cluster.items()
        if kind != "evaluator"
    )
    if tasks <= 1:
        return
    task = config.get("task", {})
    raise ConfigError(
        f"TF_CONFIG names a cluster of {tasks} tasks, and this process is its chief "
        f"({task.get('type', 'chief')} {task.get('index', 0)}), but "
        f"strategy={cfg.strategy.name.value} trains in this one process, so it would train "
        "alone, without the others. To train with the other workers, add "
        "strategy=multi_worker; to train on its own, unset TF_CONFIG."
    )


def _record(error, run_dir, cfg, launch):
    """What a failed job leaves: failure.json after training began; nothing before it."""
    if isinstance(error, ConfigError) or getattr(error, "before_training", False):
        if not cfg.resume and os.path.realpath(run_dir) != os.path.realpath(launch.kept_dir or ""):
            if rundir.is_chief() and os.path.isdir(run_dir):
                # Taken now if no run holds it (the error may come before the job takes it):
                # a directory this job made goes; one another run made or holds stays.
                with contextlib.suppress(ConfigError):
                    rundir.lock(run_dir, launch.command)
            rundir.discard_unstarted(run_dir)
    elif isinstance(error, TrainingFailed) and rundir.is_chief():
        rundir.record_failure(run_dir, error.exit_code, str(error))


def _exit_on(error, run_dir, cfg, launch):
    """End the command on ``error``: its one paragraph and exit code (a traceback with
    HYDRA_FULL_ERROR=1)."""
    _record(error, run_dir, cfg, launch)
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise error
    print(f"ga-train: {error}", file=sys.stderr)
    if launch.in_other_process and not isinstance(error, ProcessUnusable):
        from gacli.runner.command.hydra_plugins import JobFailed

        raise JobFailed(f"ga-train: {error}", error.exit_code) from None
    if isinstance(error, ProcessUnusable):
        rundir.release(run_dir)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(error.exit_code)  # freeing the damaged variables would abort the process
    sys.exit(error.exit_code)


def _sweeper_directions(hydra_config):
    """The direction(s) the job's sweeper optimises, or None for one that optimises nothing."""
    from omegaconf import OmegaConf

    sweeper = hydra_config.sweeper
    if "direction" in sweeper:  # Optuna: minimize, maximize, or a list for several objectives
        direction = sweeper.direction
        return list(direction) if OmegaConf.is_list(direction) else direction
    maximize = OmegaConf.select(sweeper, "optim.maximize")  # Nevergrad
    if maximize is None:
        minimize = OmegaConf.select(sweeper, "ax_config.experiment.minimize")  # Ax
        maximize = None if minimize is None else not minimize
    return None if maximize is None else ("maximize" if maximize else "minimize")


def _parallel_jobs(hydra_config):
    """Whether jobs of this multirun may share the terminal (no live progress bar then)."""
    from hydra.types import RunMode

    launcher = str(hydra_config.launcher.get("_target_", ""))
    return hydra_config.mode == RunMode.MULTIRUN and "BasicLauncher" not in launcher


if __name__ == "__main__":
    sys.exit(main())
