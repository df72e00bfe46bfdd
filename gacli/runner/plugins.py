"""Hydra's launcher and sweeper plugins chosen on the command line: installed, and used with -m.

``hydra/launcher=joblib`` or ``hydra/sweeper=optuna`` picks a plugin that Hydra finds among the
installed ``hydra_plugins`` packages. Hydra's own answer to a missing one is "Could not find
'hydra/launcher/joblib'"; here it names the package to install. A launcher or sweeper only acts
in a multirun, so one given without ``-m`` would silently run the job here, once: refused.
A job that a launcher ran in another process (joblib, submitit) cannot end the command with
``sys.exit``: the launcher would lose its result (submitit then waits for ever). It raises
:class:`JobFailed` instead, which Hydra hands back to this process and prints as one paragraph.
No TensorFlow import.
"""

from hydra.errors import CompactHydraException

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
