"""Where a run's scalars go: ``logger=[tensorboard,csv,mlflow]`` (docs/guides/loggers.md).

One callback, :class:`gacli.runner.reporting.run_logs.RunLogger`, works out the scalars once per
optimizer update (and the validation metrics once per epoch) and hands every writer the same (tag,
number) pairs at the same step: ``tensorboard`` writes the event file under ``tensorboard/`` (the
default), ``csv`` the run directory's ``metrics.csv`` (:mod:`gacli.runner.reporting.csv_file`),
``mlflow`` a run in an MLflow tracking store (:mod:`gacli.runner.reporting.mlflow_run`). Only the
chief process writes.

Nothing here imports TensorFlow or MLflow: the names, and whether MLflow is installed, are
checked with the rest of the config before anything is built.
"""

import contextlib
import importlib.util
import os

from gacli.errors import ConfigError, Interrupted

# The loggers, each with what it writes: the order of the refusal's list.
LOGGERS = {
    "tensorboard": "event files in the run directory's tensorboard/, the default",
    "csv": "metrics.csv in the run directory, a row per optimizer update",
    "mlflow": "a run in an MLflow tracking store, by default sqlite next to the run directory",
}
CSV_FILE = "metrics.csv"


def logger_names(value):
    """The names ``logger=`` gives (a list, or one name), in order, each once."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    return tuple(dict.fromkeys(str(name) for name in value))


def check_loggers(cfg, given=()):
    """ConfigError, before training, for a ``logger=`` that names something other than loggers,
    for ``mlflow`` where MLflow is not installed, and for ``mlflow.*`` keys given on the command
    line without ``mlflow`` among the loggers (they would change nothing)."""
    from omegaconf import OmegaConf

    value = cfg.logger
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value)
    known = ", ".join(f"{name} ({what})" for name, what in LOGGERS.items())
    if not (value is None or isinstance(value, (str, list))) or (
        isinstance(value, list) and not all(isinstance(name, str) for name in value)
    ):
        raise ConfigError(
            f"logger={value} must be a list of logger names; the loggers are {known}. E.g. "
            "'logger=[tensorboard,csv]' (quoted, for the shell)."
        )
    names = logger_names(value)
    unknown = [name for name in names if name not in LOGGERS]
    if unknown:
        raise ConfigError(
            f"logger= names {unknown[0]!r}, which is not a logger ga-train has; the loggers are "
            f"{known}. Give a list of them, e.g. 'logger=[tensorboard,csv]' (quoted, for the "
            "shell)."
        )
    if "mlflow" in names and importlib.util.find_spec("mlflow") is None:
        raise ConfigError(
            f"logger=[{','.join(names)}] includes mlflow, which is not installed in this Python "
            '(pip install "gacli[mlflow]" installs it); or drop mlflow from logger=.'
        )
    inert = sorted(key for key in given if key.split(".")[0] == "mlflow")
    if inert and "mlflow" not in names:
        raise ConfigError(
            f"{inert[0]} is read only with mlflow among the loggers, and this run has "
            f"logger=[{','.join(names)}], so setting it would change nothing. Add it, e.g. "
            f"'logger=[{','.join([*names, 'mlflow'])}]', or drop {inert[0]}."
        )


def check_logger_files(cfg, run_dir):
    """ConfigError, before anything is built, where a logger's file or store cannot be used:
    ``metrics.csv`` (:func:`gacli.runner.reporting.csv_file.check_table`) and the MLflow tracking
    store
    (:func:`gacli.runner.reporting.mlflow_run.check_store`, seconds, without importing MLflow)."""
    names = logger_names(cfg.logger)
    if "csv" in names:
        from gacli.runner.reporting.csv_file import check_table

        check_table(os.path.join(run_dir, CSV_FILE))
    if "mlflow" in names:
        from gacli.runner.reporting.mlflow_run import check_store

        check_store(cfg, run_dir)


class ScalarWriter:
    """Where :class:`~gacli.runner.reporting.run_logs.RunLogger` writes the run's scalars. A writer
    implements :meth:`write`; the other steps do nothing unless it needs them."""

    def start(self, step):
        """The job's first fit() begins at optimizer update ``step`` (a resumed run's, restored)."""

    def write(self, step, scalars):
        """``scalars``, (tag, number) pairs, at optimizer update ``step``."""
        raise NotImplementedError

    def flush(self):
        """Make what was written so far visible to readers."""

    def checkpointed(self):
        """A checkpoint holds every update written so far: a resumed run redoes none of them."""

    def close(self):
        """Training ended, before the run's result and model are written."""

    def end(self, status, reason=None):
        """The job ended (``status``: FINISHED, FAILED or KILLED, as MLflow names them), after
        the result and model were written when it finished; ``reason``: why it did not."""


@contextlib.contextmanager
def ended_with_the_job(logger):
    """Ends ``logger``'s writers (a RunLogger, or None where this process writes none) with the
    job: FINISHED when the block returns (the result and model written), KILLED when a signal
    stopped it, FAILED on any other error, which goes on up."""
    try:
        yield
    except BaseException as error:
        if logger is not None:
            stopped = isinstance(error, (Interrupted, KeyboardInterrupt))
            logger.end("KILLED" if stopped else "FAILED", f"{type(error).__name__}: {error}")
        raise
    if logger is not None:
        logger.end("FINISHED")
