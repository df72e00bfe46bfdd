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
"""

import contextlib
import fcntl
import json
import logging
import os
import pathlib
import re
import sys
import time

from gacli.errors import ConfigError
from gacli.rundir import read_json, write_json
from gacli.runner.loggers import ScalarWriter

RUN_FILE = "mlflow_run.json"  # in the run directory: the tracking URI and the run's id
ARTIFACTS_DIR = "mlartifacts"  # beside a SQLite store's file (ga-report does not look in it)
ARTIFACTS = ("result.json", "model.keras", "model.weights.h5", "resolved.yaml")
# MLflow's limits: names of word characters, ".", "/", "-" and spaces, at most 250 long; param
# values at most 6000 characters, tags 5000 (the lowest of the 2.x and 3.x releases); batches of
# at most 1000 metrics and 100 params.
_NOT_IN_NAMES = re.compile(r"[^\w./\- ]")
_NAME_LENGTH, _VALUE_LENGTH, _TAG_LENGTH = 250, 6000, 5000
_METRICS_PER_BATCH, _PARAMS_PER_BATCH = 1000, 100


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
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        # Their INFO lines (tables made, ...) are not for the terminal; set after the import,
        # which sets MLflow's own.
        for name in ("mlflow", "alembic"):
            logging.getLogger(name).setLevel(logging.WARNING)

        uri = cfg.mlflow.tracking_uri or default_tracking_uri(run_dir)
        try:
            client = MlflowClient(tracking_uri=uri)  # MLflow 3 opens the store here
            with _store_lock(uri):
                run_id = _kept_run(client, uri, run_dir) or _new_run(client, uri, cfg, run_dir)
            run = cls(client, run_id, run_dir, send_on_flush=not cfg.checkpoint)
            run.log_params(flat_params(resolved))
        except MlflowException as error:
            raise ConfigError(
                f"mlflow.tracking_uri={uri}: MLflow cannot use it ({_first_line(error)}). Give a "
                "tracking URI MLflow reads, e.g. mlflow.tracking_uri=sqlite:///mlflow.db or "
                "http://localhost:5000, or leave it unset for mlflow.db beside the run directory."
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
        from mlflow.exceptions import MlflowException

        while self._pending:
            batch = self._pending[:_METRICS_PER_BATCH]
            try:
                self.client.log_batch(self.run_id, metrics=[Metric(*kept) for kept in batch])
            except MlflowException as error:
                if not self._warned:
                    self._warned = True
                    print(
                        f"ga-train: MLflow did not take the metrics of run {self.run_id} "
                        f"({_first_line(error)}); trying again at the next checkpoint.",
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
        from mlflow.exceptions import MlflowException

        try:
            self._send()
            if status == "FINISHED":
                for name in ARTIFACTS:
                    path = os.path.join(self.run_dir, name)
                    if os.path.isfile(path):
                        self.client.log_artifact(self.run_id, path)
            elif reason:
                self.client.set_tag(self.run_id, "gacli.ended_by", reason[:_TAG_LENGTH])
            self.client.set_terminated(self.run_id, status)
        except (MlflowException, OSError) as error:
            print(
                f"ga-train: MLflow run {self.run_id} could not be ended as {status} "
                f"({_first_line(error)}); the run directory holds its "
                "metrics and files.",
                file=sys.stderr,
            )


def _first_line(error):
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]


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
