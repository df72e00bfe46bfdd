"""The MLflow run of a ga-train job (``logger=[mlflow]``, docs/guides/loggers.md).

A run records the resolved config as parameters (dotted keys, ``resolved.*`` the batch
arithmetic), every scalar TensorBoard gets as a metric of the same name stepped by optimizer
update, and at the end ``result.json``, the model and ``resolved.yaml`` as artifacts; it ends as
FINISHED, FAILED or KILLED with the job. The tracking store is ``mlflow.tracking_uri``, by default
a SQLite file beside the run directory, ``mlflow.db``, which the jobs of a sweep share (one
experiment, a run per job); artifacts of such a store go to ``mlartifacts/`` beside it.

The run's id is kept in the run directory (``mlflow_run.json``): a resumed run continues the same
MLflow run. Metrics are sent when a checkpoint holds them (each epoch end, each
``checkpoint_every_updates``; without checkpoints, at each flush) and at the end, so that the
updates a resumed run trains again were never sent: each step has one value. Sent in batches:
a call to the store per update would cost more than a small model's update.

The store is checked before anything is built (:func:`check_store`): a SQLite file that is not a
database, is locked or cannot be written, and a server that does not answer, are refused in
seconds (exit 2), rather than after MLflow's own retries (about 100 s for a SQLite file it cannot
open, 4 minutes for a server).
"""

import contextlib
import fcntl
import json
import logging
import os
import pathlib
import re
import sqlite3
import ssl
import sys
import tempfile
import time
import urllib.error
import urllib.request

from gacli.errors import ConfigError, first_line
from gacli.rundir import read_json, write_json
from gacli.runner.reporting.writers import ScalarWriter

RUN_FILE = "mlflow_run.json"  # in the run directory: the tracking URI and the run's id
ARTIFACTS_DIR = "mlartifacts"  # beside a SQLite store's file (ga-report does not look in it)
ENDED_BY = "gacli.ended_by"  # the tag of a run that failed or was stopped: the error
ARTIFACTS = ("result.json", "model.keras", "model.weights.h5", "resolved.yaml")
# MLflow's limits: names of word characters, ".", "/", "-" and spaces, at most 250 long; param
# values at most 6000 characters, tags 5000 (the lowest of the 2.x and 3.x releases); batches of
# at most 1000 metrics and 100 params.
_NOT_IN_NAMES = re.compile(r"[^\w./\- ]")
_NAME_LENGTH, _VALUE_LENGTH, _TAG_LENGTH = 250, 6000, 5000
_METRICS_PER_BATCH, _PARAMS_PER_BATCH = 1000, 100
# How long the check at start waits, in seconds: for a SQLite file another process holds locked,
# and for a tracking server's first answer.
_LOCK_WAIT_S, _SERVER_WAIT_S = 5.0, 5.0
# MLflow's HTTP settings while a run logs, where the environment does not set them: a request
# waits 10 s and is tried 3 times, about 35 s at most (MLflow's own: 120 s and 7 retries, over 4
# minutes), so that a server gone away costs a checkpoint seconds, not minutes.
_HTTP_SETTINGS = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
}
_INSTEAD = (
    "Give another store, e.g. mlflow.tracking_uri=sqlite:///mlflow.db or http://localhost:5000, "
    "or leave mlflow.tracking_uri unset for mlflow.db beside the run directory; or drop mlflow "
    "from logger=, e.g. 'logger=[tensorboard,csv]'."
)


def default_tracking_uri(run_dir):
    """``sqlite:///`` a file ``mlflow.db`` in the run directory's parent: a sweep's directory, or
    ``outputs/<config>/`` for single runs."""
    return "sqlite:///" + os.path.join(os.path.dirname(os.path.abspath(run_dir)), "mlflow.db")


def flat_params(record, prefix=""):
    """{dotted key: text} of a nested mapping, as MLflow takes parameters: names it accepts,
    values cut to its limit, numbers, lists and null as JSON writes them."""
    params = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            params.update(flat_params(value, f"{name}."))
            continue
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        params[metric_name(name)] = text[:_VALUE_LENGTH]
    return params


def metric_name(tag):
    """``tag`` as an MLflow name: characters MLflow refuses become ``_``."""
    return _NOT_IN_NAMES.sub("_", tag)[:_NAME_LENGTH]


def tracking_uri(cfg, run_dir):
    """The job's tracking store: ``mlflow.tracking_uri``, else the default beside the run."""
    return cfg.mlflow.tracking_uri or default_tracking_uri(run_dir)


def check_store(cfg, run_dir):
    """ConfigError, within seconds and before anything is built, for a tracking store MLflow
    would fail on or wait on: a SQLite file that is not a database, is locked by another process
    or cannot be written, and a tracking server that does not answer. Other stores are left to
    MLflow (:meth:`MlflowRun.open` names what it says)."""
    uri = tracking_uri(cfg, run_dir)
    if uri.startswith("sqlite:///"):
        path = uri[len("sqlite:///") :].split("?", 1)[0]
        if path and path != ":memory:":
            problem = _sqlite_problem(uri, os.path.abspath(path))
            if problem:
                raise ConfigError(
                    f"mlflow.tracking_uri={uri}: MLflow cannot use it: {problem}. {_INSTEAD}"
                )
    elif uri.startswith(("http://", "https://")):
        problem = _server_problem(uri)
        if problem:
            raise ConfigError(
                f"mlflow.tracking_uri={uri}: {problem}. Start the server there (mlflow server), or "
                f"{_INSTEAD[0].lower()}{_INSTEAD[1:]}"
            )


def _sqlite_problem(uri, path):
    """What stops MLflow from writing the SQLite file ``path`` (of ``uri``), or None."""
    folder = os.path.dirname(path)
    if os.path.isdir(path):
        return f"{path} is a folder, not a database file"
    if not os.path.exists(path):
        # MLflow makes the file and its folders; a folder that cannot hold it is said now.
        above = folder
        while not os.path.exists(above):
            above = os.path.dirname(above)
        if not os.path.isdir(above):
            return f"{above} is a file, so no folder {folder} can hold the database"
        try:
            os.makedirs(folder, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=folder, prefix=".gacli-write-test-"):
                pass
        except OSError as error:
            return f"no file can be made in {folder} ({error.strerror or error})"
        return None
    # While a sweep's first job makes the store's tables, the others wait (as to open it).
    with _store_lock(uri):
        return _database_problem(path)


def _database_problem(path):
    """What stops MLflow from writing the SQLite file ``path``, which exists, or None."""
    try:
        connection = sqlite3.connect(
            f"{pathlib.Path(path).as_uri()}?mode=rw", uri=True, timeout=_LOCK_WAIT_S
        )
    except sqlite3.Error as error:
        return f"{path} cannot be opened for writing ({error})"
    try:
        connection.execute("PRAGMA schema_version")  # reads the header: a database or not
        # A write lock, taken and given back: refused where the file or its folder is read-only
        # or another process holds the database locked for longer than the wait.
        connection.execute("BEGIN IMMEDIATE")
        connection.rollback()
    except sqlite3.DatabaseError as error:
        if "locked" in str(error) or "busy" in str(error):
            return (
                f"{path} is locked by another process (waited {_LOCK_WAIT_S:.0f} s); end that "
                "process or wait for it"
            )
        if "not a database" in str(error):
            return f"{path} is not a SQLite database ({error})"
        return f"{path} cannot be written ({error})"
    finally:
        connection.close()
    return None


def _server_problem(uri):
    """Why the tracking server at ``uri`` cannot be used, or None: one request to its health
    endpoint, waiting at most ``_SERVER_WAIT_S``. Any answer (even an error status) will do:
    MLflow names what the server then refuses."""
    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=_SERVER_WAIT_S):
            pass
    except urllib.error.HTTPError:
        return None  # it answered
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        if isinstance(reason, ssl.SSLError):
            return None  # TLS is left to MLflow's settings (MLFLOW_TRACKING_INSECURE_TLS, ...)
        if isinstance(reason, TimeoutError):
            return f"the server did not answer within {_SERVER_WAIT_S:.0f} s"
        return f"no server answers there ({getattr(reason, 'strerror', None) or reason})"
    return None


def _store_errors():
    """The errors a tracking store raises: MLflow's own, its SQL layer's (a SQLite file that
    is locked or gone read-only), and the file system's."""
    from mlflow.exceptions import MlflowException

    try:
        from sqlalchemy.exc import SQLAlchemyError
    except ImportError:  # mlflow-skinny, for servers only, comes without it
        return (MlflowException, OSError)
    return (MlflowException, SQLAlchemyError, OSError)


@contextlib.contextmanager
def _store_lock(uri):
    """The jobs of a sweep run by a parallel launcher open one SQLite file at once: the first
    makes its tables and the experiment while the others wait (a lock on its folder)."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    folder = os.path.dirname(os.path.abspath(uri[len("sqlite:///") :]))
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # closing it releases the lock


class MlflowRun(ScalarWriter):
    """One job's MLflow run, written through an ``MlflowClient`` (no active run is set in the
    process, so the jobs of a ``-m`` sweep, one after another in one process, keep apart).

    Args:
        client: an ``mlflow.MlflowClient`` of the tracking store.
        run_id: the run's id.
        run_dir: the job's run directory (the artifacts come from it).
        send_on_flush: send metrics at each flush, not only at checkpoints (a job without them).

    Example:
        >>> run = MlflowRun.open(cfg, "outputs/default/first", resolved)
        >>> run.write(1, [("train/loss", 0.7)]); run.checkpointed(); run.end("FINISHED")
    """

    def __init__(self, client, run_id, run_dir, send_on_flush=False):
        self.client = client
        self.run_id = run_id
        self.run_dir = run_dir
        self.send_on_flush = send_on_flush
        self._pending = []  # (name, value, milliseconds since 1970, step), not sent yet
        self._names = {}  # tag -> MLflow name
        self._warned = False  # a failed send was said

    @classmethod
    def open(cls, cfg, run_dir, resolved):
        """The run of ``run_dir``: the one kept in its ``mlflow_run.json`` (resumed), else a new
        one, with ``resolved`` (the config with the batch arithmetic) as its parameters."""
        for name, value in _HTTP_SETTINGS.items():
            os.environ.setdefault(name, value)  # read by MLflow at each request
        from mlflow import MlflowClient

        # Their INFO lines (tables made, ...) are not for the terminal; set after the import,
        # which sets MLflow's own.
        for name in ("mlflow", "alembic"):
            logging.getLogger(name).setLevel(logging.WARNING)

        uri = tracking_uri(cfg, run_dir)
        try:
            client = MlflowClient(tracking_uri=uri)  # MLflow 3 opens the store here
            with _store_lock(uri):
                run_id = _kept_run(client, uri, run_dir) or _new_run(client, uri, cfg, run_dir)
            run = cls(client, run_id, run_dir, send_on_flush=not cfg.checkpoint)
            run.log_params(flat_params(resolved))
        except _store_errors() as error:
            raise ConfigError(
                f"mlflow.tracking_uri={uri}: MLflow cannot use it ({first_line(error)}). {_INSTEAD}"
            ) from None
        write_json(os.path.join(run_dir, RUN_FILE), {"tracking_uri": uri, "run_id": run_id})
        return run

    def log_params(self, params):
        """``params`` ({name: text}) the run does not hold yet: a resumed run's keep their first
        values (MLflow refuses to change one; the keys a resumed run may change are the
        ``FREE_ON_RESUME`` ones, which change no update)."""
        from mlflow.entities import Param

        held = self.client.get_run(self.run_id).data.params
        new = [Param(key, value) for key, value in params.items() if key not in held]
        for start in range(0, len(new), _PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=new[start : start + _PARAMS_PER_BATCH])

    def write(self, step, scalars):
        now = int(time.time() * 1000)
        for tag, value in scalars:
            name = self._names.get(tag) or self._names.setdefault(tag, metric_name(tag))
            self._pending.append((name, float(value), now, int(step)))

    def _send(self):
        """Send the pending metrics. A store that refuses them now (a server away, a database
        locked) is said once; they are tried again at the next checkpoint and at the end."""
        from mlflow.entities import Metric

        while self._pending:
            batch = self._pending[:_METRICS_PER_BATCH]
            try:
                self.client.log_batch(self.run_id, metrics=[Metric(*kept) for kept in batch])
            except _store_errors() as error:
                if not self._warned:
                    self._warned = True
                    print(
                        f"ga-train: MLflow did not take the metrics of run {self.run_id} "
                        f"({first_line(error)}); trying again at the next checkpoint.",
                        file=sys.stderr,
                    )
                return
            del self._pending[: len(batch)]

    def flush(self):
        if self.send_on_flush:
            self._send()

    def checkpointed(self):
        self._send()

    def end(self, status, reason=None):
        """Send what is left, then (finished) the run's files as artifacts, and end the run. A
        store that fails now is named, and the job's own outcome stands: its files are whole in
        the run directory either way."""
        try:
            self._send()
            if status == "FINISHED":
                for name in ARTIFACTS:
                    path = os.path.join(self.run_dir, name)
                    if os.path.isfile(path):
                        self.client.log_artifact(self.run_id, path)
            elif reason:
                self.client.set_tag(self.run_id, ENDED_BY, reason[:_TAG_LENGTH])
            self.client.set_terminated(self.run_id, status)
        except _store_errors() as error:
            print(
                f"ga-train: MLflow run {self.run_id} could not be ended as {status} "
                f"({first_line(error)}); the run directory holds its "
                "metrics and files.",
                file=sys.stderr,
            )


def _kept_run(client, uri, run_dir):
    """The id of the MLflow run ``run_dir`` was logged to in the same store, set running again;
    None when it has none (a new run, another store, or a run deleted since)."""
    from mlflow.exceptions import MlflowException

    try:
        kept = read_json(os.path.join(run_dir, RUN_FILE))
    except (OSError, ValueError):  # unreadable: as if there were none
        kept = None
    if not isinstance(kept, dict) or kept.get("tracking_uri") != uri:
        return None
    try:
        run = client.get_run(str(kept.get("run_id")))
    except MlflowException:
        return None
    if run.info.lifecycle_stage != "active":
        return None
    client.update_run(run.info.run_id, status="RUNNING")
    if ENDED_BY in run.data.tags:
        # Why the last process stopped is no longer why the run ends: end() sets it again if
        # this one fails or is stopped too.
        client.delete_tag(run.info.run_id, ENDED_BY)
    return run.info.run_id


def _new_run(client, uri, cfg, run_dir):
    """A new run in the experiment ``mlflow.experiment_name`` (made if the store has none: with
    a SQLite store, its artifacts beside the file); its id."""
    name = cfg.mlflow.experiment_name or f"ga-train-{cfg.config}"
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        location = None
        if uri.startswith("sqlite:///"):
            folder = os.path.dirname(os.path.abspath(uri[len("sqlite:///") :]))
            location = pathlib.Path(folder, ARTIFACTS_DIR).as_uri()
        experiment_id = client.create_experiment(name, artifact_location=location)
    elif experiment.lifecycle_stage != "active":
        client.restore_experiment(experiment.experiment_id)
        experiment_id = experiment.experiment_id
    else:
        experiment_id = experiment.experiment_id
    run = client.create_run(
        experiment_id,
        run_name=cfg.mlflow.run_name or os.path.basename(os.path.abspath(run_dir)),
        tags={"gacli.run_dir": os.path.abspath(run_dir)},
    )
    return run.info.run_id
