"""logger=[tensorboard,csv,mlflow]: the same scalars at the same updates in TensorBoard's event
files, metrics.csv and an MLflow run, through a resume; a sweep as one MLflow experiment; names
and settings that are not loggers refused before training (docs/guides/loggers.md).

The MLflow tests skip where MLflow is not installed (scripts/ci_oldest.sh installs the test extra
alone); the README's test command installs the mlflow extra, so CI runs them.
"""

import csv
import glob
import importlib.util
import json
import os
import signal
import socket
import sqlite3
import time

import numpy as np
import pytest
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util.tensor_util import make_ndarray

from gacli.errors import ConfigError, TrainingFailed
from gacli.runner.config.validate import validate
from gacli.runner.reporting import mlflow_run
from gacli.runner.reporting.csv_file import MetricsCsv
from gacli.runner.training.run import train
from helpers import compose_config, ga_report, ga_train, start_ga_train

needs_mlflow = pytest.mark.skipif(
    importlib.util.find_spec("mlflow") is None,
    reason='MLflow is not installed here: pip install "gacli[mlflow]" (the README\'s test '
    "command installs it)",
)

# The default job, two epochs of 12 updates, a checkpoint every 5: stopped by SIGTERM after its
# first checkpoint, it resumes in the middle of an epoch.
JOB = (
    "logger=[tensorboard,csv,mlflow]",
    "epochs=2",
    "checkpoint_every_updates=5",
    "progress=none",
)


def _tensorboard_series(run_dir, tag):
    """{step: value} of ``tag`` over the run's event files, one a process; a later file wins
    from its first step on, as ga-report reads them."""
    series = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "tensorboard", "events.out.tfevents.*"))):
        events = EventAccumulator(path, size_guidance={"tensors": 0})
        events.Reload()
        if tag in events.Tags()["tensors"]:
            for event in events.Tensors(tag):
                series[event.step] = float(make_ndarray(event.tensor_proto))
    return series


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    """(run directory, output of the resumed process) of JOB, stopped by SIGTERM after its first
    checkpoint and resumed."""
    cwd = tmp_path_factory.mktemp("resumed")
    process = start_ga_train(*JOB, cwd=cwd)
    deadline = time.time() + 300
    while not glob.glob(os.path.join(cwd, "outputs", "default", "*", "checkpoints", "*.index")):
        assert process.poll() is None and time.time() < deadline, process.communicate()[0]
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=300)[0]
    assert process.returncode == 128 + signal.SIGTERM, output
    (hydra,) = glob.glob(os.path.join(cwd, "outputs", "default", "*", ".hydra"))
    run_dir = os.path.dirname(hydra)
    code, output = ga_train(*JOB, f"resume={run_dir}", cwd=cwd)
    assert code == 0, output
    # Beside it: the MLflow store that outputs/default/ holds for its runs, and its artifacts.
    assert sorted(os.listdir(os.path.dirname(run_dir))) == [
        os.path.basename(run_dir),
        "mlartifacts",
        "mlflow.db",
    ]
    return run_dir, output


@needs_mlflow
def test_the_three_loggers_hold_the_same_scalars_through_a_resume(resumed_run):
    from mlflow import MlflowClient

    run_dir, output = resumed_run
    assert "INFO" not in output and "Traceback" not in output, output
    with open(os.path.join(run_dir, "metrics.csv"), newline="") as handle:
        text = handle.read()
    assert text.count("step,wall_time,") == 1, text[:300]  # one header through the resume
    rows = list(csv.DictReader(text.splitlines()))
    # Every update once: the resumed process dropped nothing and logged nothing twice.
    assert [int(row["step"]) for row in rows] == list(range(1, 25))
    # An epoch's validation joins the row of its last update.
    assert [int(row["step"]) for row in rows if row["val/loss"]] == [12, 24]
    tensorboard = _tensorboard_series(run_dir, "train/loss")
    assert sorted(tensorboard) == list(range(1, 25))
    in_csv = {int(row["step"]): float(row["train/loss"]) for row in rows}
    # TensorBoard keeps float32; the CSV the number itself.
    assert all(np.float32(in_csv[step]) == np.float32(tensorboard[step]) for step in tensorboard)

    kept = json.load(open(os.path.join(run_dir, "mlflow_run.json")))
    client = MlflowClient(kept["tracking_uri"])
    run = client.get_run(kept["run_id"])
    assert kept["tracking_uri"].endswith(os.path.join("outputs", "default", "mlflow.db"))
    assert run.info.status == "FINISHED"
    # The resumed process continued the run the first one started: the experiment holds one.
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.name == "ga-train-default"
    assert len(client.search_runs([experiment.experiment_id])) == 1
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, 25))  # each update once
    assert {m.step: m.value for m in history} == in_csv
    val = client.get_metric_history(run.info.run_id, "val/loss")
    assert {m.step: m.value for m in val} == {
        int(row["step"]): float(row["val/loss"]) for row in rows if row["val/loss"]
    }
    assert set(run.data.metrics) == {name for name in rows[0] if name not in ("step", "wall_time")}
    params = run.data.params
    assert (params["optimizer.learning_rate"], params["model._target_"]) == (
        "0.003",
        "gacli.models.mlp",
    )
    resolved = OmegaConf.load(os.path.join(run_dir, "resolved.yaml"))
    assert params["model.hidden_units"] == json.dumps(list(resolved.model.hidden_units))
    plan = {key: params[f"resolved.{key}"] for key in ("micro_batch_size", "accum_steps")}
    assert plan == {"micro_batch_size": "32", "accum_steps": "4"}
    assert (params["resolved.effective_batch_size"], params["resolved.replicas"]) == ("128", "1")
    assert params["resolved.updates_per_epoch"] == "12"
    # What the loss is: ga-report marks a best loss only among runs of one loss.
    assert params["resolved.loss"] == "sparse_categorical_crossentropy"
    assert params["resume"] == "null"  # the first start's: a resumed run changes no param
    # Stopped by SIGTERM, then resumed to the end: why the first process stopped is not kept.
    assert "gacli.ended_by" not in run.data.tags, run.data.tags
    artifacts = {item.path for item in client.list_artifacts(run.info.run_id)}
    assert {"result.json", "model.keras"} <= artifacts


@needs_mlflow
def test_a_sweep_is_one_experiment_and_ga_report_still_reads_it(tmp_path):
    from mlflow import MlflowClient

    code, output = ga_train(
        "-m",
        "accum_steps=1,2",
        "logger=[mlflow]",
        "epochs=1",
        "progress=none",
        "hydra.sweep.dir=sweep",
        "mlflow.experiment_name=accumulation",
        cwd=tmp_path,
    )
    assert code == 0, output
    sweep = tmp_path / "sweep"
    assert not glob.glob(str(sweep / "*" / "tensorboard")), "logger=[mlflow] writes no events"
    client = MlflowClient(f"sqlite:///{sweep / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("accumulation")
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time"])
    assert [run.data.params["resolved.accum_steps"] for run in runs] == ["1", "2"]
    assert [run.info.run_name[:14] for run in runs] == ["0_accum_steps=", "1_accum_steps="]
    assert {run.info.status for run in runs} == {"FINISHED"}
    # 45 micro-batches an epoch: 45 updates at accum_steps=1, 23 at 2 (the last one short).
    steps = [len(client.get_metric_history(run.info.run_id, "train/loss")) for run in runs]
    assert steps == [45, 23]
    # ga-report reads the runs, not the copies of their result.json in mlartifacts/.
    code, report = ga_report(str(sweep), "--no-plots", cwd=tmp_path)
    assert code == 0 and "2 runs" in report and "skipped" not in report, report


def test_a_name_that_is_not_a_logger_is_refused_before_training(tmp_path):
    code, output = ga_train("logger=[tensorboard,wandb]", cwd=tmp_path)
    assert code == 2, output
    first = output.splitlines()[0]
    assert first.startswith("ga-train: logger= names 'wandb', which is not a logger"), output
    assert all(name in first for name in ("tensorboard (", "csv (", "mlflow (")), first
    assert not glob.glob(str(tmp_path / "outputs" / "*" / "*")), "nothing of the run is left"


def test_mlflow_settings_and_a_missing_mlflow_are_refused(monkeypatch):
    with pytest.raises(ConfigError, match=r"^mlflow.run_name is read only with mlflow"):
        validate(compose_config("mlflow.run_name=first"), given={"mlflow.run_name"})
    validate(compose_config("logger=csv"))  # one name is a list of one
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r'pip install "gacli\[mlflow\]"'):
        validate(compose_config("logger=[tensorboard,mlflow]"))


def test_metrics_csv_joins_an_update_s_values_and_keeps_one_row_an_update_on_resume(tmp_path):
    path = tmp_path / "metrics.csv"
    table = MetricsCsv(str(path))
    table.start(0)
    for step in (1, 2, 3):
        table.write(step, [("train/loss", 1.0 / step)] + [("rate", 5.0)] * (step > 1))
    table.write(3, [("val/loss", 0.25)])  # a new column: the file is written anew
    table.write(3, [("schedule/accum_steps", 2)])  # and again, into the same row
    table.write(4, [("train/loss", 0.2)])
    table.close()
    with open(path, "a") as handle:
        handle.write("5,1.0,0.1")  # a process killed in the middle of a line
    resumed = MetricsCsv(str(path))
    resumed.start(3)  # the checkpoint held 3 updates: 4 is trained again
    resumed.write(3, [("schedule/noise_scale", 7.5)])  # a decision at the epoch's start
    resumed.write(4, [("train/loss", 0.21)])
    resumed.close()
    rows = list(csv.DictReader(open(path, newline="")))
    assert [row["step"] for row in rows] == ["1", "2", "3", "4"]
    assert list(rows[0]) == [
        "step",
        "wall_time",
        "train/loss",
        "rate",
        "val/loss",
        "schedule/accum_steps",
        "schedule/noise_scale",
    ]
    assert (rows[0]["rate"], rows[1]["rate"], rows[0]["train/loss"]) == ("", "5", "1")
    assert [rows[2][key] for key in ("val/loss", "schedule/accum_steps")] == ["0.25", "2"]
    assert (rows[2]["schedule/noise_scale"], rows[3]["train/loss"]) == ("7.5", "0.21")


def test_a_store_or_table_that_cannot_be_written_is_refused_in_seconds(tmp_path, monkeypatch):
    """Each refused before anything is built (exit 2), in seconds rather than after MLflow's
    retries: a file that is not a database, one another process holds locked, a folder that
    cannot be made, a server that takes the connection and never answers; and a metrics.csv
    that is a folder."""
    monkeypatch.setattr(mlflow_run, "_LOCK_WAIT_S", 0.5)
    monkeypatch.setattr(mlflow_run, "_SERVER_WAIT_S", 0.5)
    run_dir = str(tmp_path / "run")
    not_a_database = tmp_path / "notes.db"
    not_a_database.write_text("not a database\n")
    locked = tmp_path / "locked.db"
    holder = sqlite3.connect(locked, isolation_level=None)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN EXCLUSIVE")
    silent = socket.create_server(("127.0.0.1", 0))  # takes connections, never answers
    port = silent.getsockname()[1]
    cases = {
        f"sqlite:///{not_a_database}": f"{not_a_database} is not a SQLite database",
        f"sqlite:///{locked}": f"{locked} is locked by another process (waited 0 s)",
        f"sqlite:///{not_a_database}/mlflow.db": f"{not_a_database} is a file, so no folder",
        f"http://127.0.0.1:{port}": "the server did not answer within 0 s. Start the server",
    }
    try:
        for uri, problem in cases.items():
            cfg = compose_config("logger=[mlflow]", f"mlflow.tracking_uri='{uri}'")
            started = time.monotonic()
            with pytest.raises(ConfigError) as refusal:
                train(cfg, run_dir)
            assert time.monotonic() - started < 5, uri
            message = str(refusal.value)
            assert message.startswith(f"mlflow.tracking_uri={uri}: "), message
            assert problem in message and "drop mlflow from logger=" in message, message
    finally:
        holder.close()
        silent.close()
    os.makedirs(os.path.join(run_dir, "metrics.csv"))
    with pytest.raises(ConfigError, match=r"metrics.csv is a folder, and logger=csv writes"):
        train(compose_config("logger=[csv]"), run_dir)
    assert "resolved.yaml" not in os.listdir(run_dir), "refused before the model is built"


def test_metrics_csv_that_cannot_be_written_while_training_stops_in_a_paragraph(tmp_path):
    path = tmp_path / "metrics.csv"
    table = MetricsCsv(str(path))
    table.start(0)
    table.write(1, [("train/loss", 0.5)])
    os.makedirs(f"{path}.writing")  # where a new column's table is written
    with pytest.raises(TrainingFailed) as failure:
        table.write(2, [("train/loss", 0.4), ("val/loss", 0.6)])
    message = str(failure.value)
    assert message.startswith(f"{path} could not be written (Is a directory); training stopped")
    assert "resume=true" in message and "drop csv from logger=" in message, message
