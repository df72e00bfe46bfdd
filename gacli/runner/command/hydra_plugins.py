"""Hydra's launcher and sweeper plugins chosen on the command line: installed, and used with -m.

``hydra/launcher=joblib`` or ``hydra/sweeper=optuna`` picks a plugin that Hydra finds among the
installed ``hydra_plugins`` packages. Hydra's own answer to a missing one is "Could not find
'hydra/launcher/joblib'"; here it names the package to install. A launcher or sweeper only acts
in a multirun, so one given without ``-m`` would silently run the job here, once: refused.
A job that a launcher ran in another process (joblib, submitit) cannot end the command with
``sys.exit``: the launcher would lose its result (submitit then waits for ever). It raises
:class:`JobFailed` instead, which Hydra hands back to this process and prints as one paragraph.
What is the same for every job is checked once, before the first (:class:`SweepChecks`).
No TensorFlow import.
"""

import os
import sys

from hydra.errors import CompactHydraException
from hydra.experimental.callback import Callback

from gacli.errors import ConfigError

GROUPS = ("hydra/launcher", "hydra/sweeper")
# The plugins of Hydra's own repository, by the name a command line gives them, and their package.
PACKAGES = {
    "hydra/launcher": {
        "submitit_slurm": "hydra-submitit-launcher",
        "submitit_local": "hydra-submitit-launcher",
        "joblib": "hydra-joblib-launcher",
        "ray": "hydra-ray-launcher",
        "ray_aws": "hydra-ray-launcher",
        "rq": "hydra-rq-launcher",
    },
    "hydra/sweeper": {
        "optuna": "hydra-optuna-sweeper",
        "ax": "hydra-ax-sweeper",
        "nevergrad": "hydra-nevergrad-sweeper",
    },
}


def installed(group):
    """Names Hydra can load for ``group`` (``hydra/launcher``), the basic one included."""
    from hydra.core.config_store import ConfigStore
    from hydra.core.plugins import Plugins

    Plugins.instance()  # imports every installed hydra_plugins package, which registers its configs
    node = ConfigStore.instance().repo
    for part in group.split("/"):
        node = node.get(part, {})
    return sorted(name[: -len(".yaml")] for name in node if name.endswith(".yaml"))


def check_choices(assignments, multirun):
    """ConfigError for a ``hydra/launcher=`` or ``hydra/sweeper=`` choice that is not installed,
    or that is given without ``-m``."""
    for assignment in assignments:
        group, _, name = assignment.lstrip("+").partition("=")
        if group not in GROUPS:
            continue
        kind = group.split("/")[1]
        if not multirun:
            raise ConfigError(
                f"{assignment}: Hydra's {kind} acts only in a multirun; without -m the job would "
                f"run here, once. Add -m: ga-train -m {assignment} ..."
            )
        available = installed(group)
        if name in available:
            continue
        package = PACKAGES[group].get(name)
        advice = (
            f"install it with: pip install {package}"
            if package
            else f"the installed ones are {', '.join(available)}; install the package that "
            f"provides {name!r}"
        )
        raise ConfigError(
            f"{assignment}: Hydra's {kind} plugin {name!r} is not installed; {advice}."
        )


# Exit codes of the jobs that failed in other processes, as this process received them.
FAILED_JOBS = []


def _received(message, exit_code):
    FAILED_JOBS.append(exit_code)
    return JobFailed(message, exit_code)


class JobFailed(CompactHydraException):
    """A ga-train job run by a launcher in another process failed: its one paragraph (printed
    by Hydra without a traceback) and exit code. Unpickled in the launching process, it records
    the code in FAILED_JOBS, from which ga-train's own exit code follows."""

    def __init__(self, message, exit_code):
        super().__init__(message)
        self.exit_code = exit_code

    def __reduce__(self):
        return (_received, (str(self), self.exit_code))


# What is the same for every job of a sweep, checked by SweepChecks before the first one starts.
_SAME_FOR_EVERY_JOB = ("objective", "dataset", "metrics")


class SweepChecks(Callback):
    """Registered by ga-train for every multirun (``hydra.callbacks``): what is the same for every
    job of the sweep (an ``objective=`` no run logs, or one the sweeper would optimise the wrong
    way) is checked once, in the process that launches the jobs, before the first one starts.
    Left to each job, it would be said once per job that a launcher runs side by side (joblib),
    and end the sweep only after they all failed."""

    def on_multirun_start(self, config, **kwargs):
        from omegaconf.errors import OmegaConfBaseException

        from gacli.runner.command.cli import _sweeper_directions
        from gacli.runner.config import objective

        if _swept(config) & set(_SAME_FOR_EVERY_JOB):
            return  # each job checks its own
        try:
            settings = (config.objective, config.dataset.validation_split, config.get("metrics"))
            directions = _sweeper_directions(config.hydra)
        except OmegaConfBaseException:
            return  # a value a job sets, or one Hydra will refuse with its own message
        try:
            objective.check(*settings[:2], directions, settings[2])
            if settings[2] is None:
                # Under any sweeper, with the task's own metrics (names known without a model):
                # the jobs would each be refused it once their model is built.
                objective.check_logged(*settings[:2])
        except ConfigError as error:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            # One paragraph and exit code 2; SystemExit passes Hydra's own error report by.
            print(f"ga-train: {error}", file=sys.stderr, flush=True)
            sys.exit(error.exit_code)


def _swept(config):
    """The top-level keys (``dataset`` for ``dataset.validation_split``) a sweep varies: those
    of the command line's sweeps (``a=1,2``, ``a=choice(1,2)``) and of ``hydra.sweeper.params``
    (Optuna's)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    task = OmegaConf.to_container(config.hydra.overrides.task)
    parsed = OverridesParser.create().parse_overrides(task)
    keys = [override.key_or_group for override in parsed if override.is_sweep_override()]
    params = OmegaConf.select(config, "hydra.sweeper.params")
    keys += list(params or {})
    return {key.lstrip("+~").split(".")[0].split("/")[0] for key in keys}
