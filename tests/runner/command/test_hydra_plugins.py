"""Hydra's own launcher and sweeper plugins, installed as a user installs them: the key check lets
them through (and still refuses typos), joblib runs jobs side by side, Optuna searches with the
job's objective and goes on past a failed trial; an objective no job can report is said once,
before any job or trial runs, and every objective a sweep accepts is one a run logs. The SLURM
launcher is in test_slurm.py."""

import glob
import json
import os

import pytest
import yaml

from helpers import ga_train

QUICK = ("epochs=1", "progress=none", "hydra.sweep.dir=sweep")


@pytest.mark.parametrize(
    "arguments, first_line",
    [
        (
            ("-m", "hydra/launcher=nosuch", "accum_steps=1,2"),
            "ga-train: hydra/launcher=nosuch: Hydra's launcher plugin 'nosuch' is not installed; "
            "the installed ones are basic, joblib, submitit_local, submitit_slurm",
        ),
        (
            ("-m", "hydra/launcher=ray", "accum_steps=1,2"),
            "ga-train: hydra/launcher=ray: Hydra's launcher plugin 'ray' is not installed; "
            "install it with: pip install hydra-ray-launcher.",
        ),
        (
            ("-m", "hydra/sweeper=nevergrad"),
            "ga-train: hydra/sweeper=nevergrad: Hydra's sweeper plugin 'nevergrad' is not "
            "installed; install it with: pip install hydra-nevergrad-sweeper.",
        ),
        (
            ("hydra/launcher=joblib",),
            "ga-train: hydra/launcher=joblib: Hydra's launcher acts only in a multirun",
        ),
        (
            ("-m", "hydra/launcher=joblib", "acum_steps=1,2"),
            "ga-train: acum_steps=1,2: acum_steps is not a key ga-train reads",
        ),
        (
            ("-m", "hydra/sweeper=optuna", "objective=val_accuracy", "hydra.sweeper.n_trials=1"),
            "ga-train: objective=val_accuracy is maximized, but the sweeper is set to minimize it",
        ),
        pytest.param(
            ("objective=val_acuracy", "epochs=1"),
            "ga-train: objective=val_acuracy is not a metric this run logs; it logs loss, "
            "accuracy, val_loss, val_accuracy.",
            marks=pytest.mark.slow,  # refused once TensorFlow has built the model
        ),
        (
            ("objective=val_loss", "dataset.validation_split=0", "epochs=1"),
            "ga-train: objective=val_loss is a validation metric, but "
            "dataset.validation_split=0 holds no validation data",
        ),
    ],
)
def test_plugin_and_objective_errors(tmp_path, arguments, first_line):
    code, output = ga_train(*arguments, *QUICK, cwd=tmp_path)
    assert code == 2, output
    lines = [line for line in output.splitlines() if line.startswith("ga-train:")]
    assert lines and lines[0].startswith(first_line), output
    assert "Traceback" not in output
    assert not glob.glob(str(tmp_path / "sweep" / "*" / "result.json")), "nothing trained"


def test_a_misspelt_objective_is_said_once_before_jobs_run_side_by_side(tmp_path):
    code, output = ga_train(
        "-m", "hydra/sweeper=optuna", "hydra/launcher=joblib", "hydra.sweeper.n_trials=3",
        "hydra.sweeper.n_jobs=3", "hydra.sweeper.direction=maximize", "objective=val_acuracy",
        "optimizer.learning_rate=choice(0.003,0.01)", *QUICK, cwd=tmp_path,
    )  # fmt: skip
    assert code == 2 and "Traceback" not in output, output
    lines = [line for line in output.splitlines() if "objective=val_acuracy is not" in line]
    assert lines == [
        "ga-train: objective=val_acuracy is not a metric a ga-train run logs; it logs loss, "
        "accuracy, iou, mae, rmse, val_loss, val_accuracy, val_iou, val_mae, val_rmse (accuracy "
        "for classes, iou for masks of one class, mae and rmse for regression). Did you mean "
        "objective=val_accuracy? Give one of those, e.g. objective=val_loss."
    ], output
    assert "Error executing job" not in output and not (tmp_path / "sweep").exists(), output


@pytest.mark.slow
def test_joblib_runs_two_jobs_side_by_side_and_a_failure_ends_with_its_code(tmp_path):
    code, output = ga_train(
        "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
        "optimizer.learning_rate=0.003,1e30", *QUICK, cwd=tmp_path,
    )  # fmt: skip
    assert code == 1, output[-3000:]  # the second job's loss is not finite: exit code 1
    assert "Traceback" not in output
    assert "Error executing job with overrides: ['optimizer.learning_rate=1e+30'" in output
    assert "ga-train: training stopped at epoch 1" in output
    (finished,) = glob.glob(str(tmp_path / "sweep" / "0_*" / "result.json"))
    (failed,) = glob.glob(str(tmp_path / "sweep" / "1_*" / "failure.json"))
    assert json.load(open(failed))["exit_code"] == 1
    # Side by side: each started (Hydra's record of the job) before the other ended.
    starts = [os.path.getmtime(p) for p in glob.glob(str(tmp_path / "sweep" / "*" / ".hydra"))]
    ends = [os.path.getmtime(finished), os.path.getmtime(failed)]
    assert len(starts) == 2 and max(starts) < min(ends), (starts, ends)


@pytest.mark.slow
def test_optuna_searches_with_the_objective_and_goes_on_past_a_failed_trial(tmp_path):
    code, output = ga_train(
        "-m", "hydra/sweeper=optuna", "hydra/sweeper/sampler=grid", "hydra.sweeper.n_trials=3",
        "hydra.sweeper.n_jobs=1", "objective=val_accuracy", "hydra.sweeper.direction=maximize",
        "optimizer.learning_rate=choice(0.003,0.01,1e30)", *QUICK, cwd=tmp_path,
    )  # fmt: skip
    assert code == 0, output[-3000:]
    assert "this trial failed, the sweep goes on" in output and "Traceback" not in output
    results = yaml.safe_load(open(tmp_path / "sweep" / "optimization_results.yaml"))
    runs = {
        os.path.basename(os.path.dirname(path)): json.load(open(path))["val_accuracy"]
        for path in glob.glob(str(tmp_path / "sweep" / "*" / "result.json"))
    }
    assert len(runs) == 2 and len(glob.glob(str(tmp_path / "sweep" / "*" / "failure.json"))) == 1
    assert results["best_value"] == pytest.approx(max(runs.values()))
    best = f"optimizer.learning_rate={results['best_params']['optimizer.learning_rate']}"
    (best_run,) = [name for name in runs if best in name]
    assert runs[best_run] == pytest.approx(results["best_value"])


def test_an_optuna_sweep_with_a_misspelt_objective_ends_before_its_first_trial(tmp_path):
    code, output = ga_train(
        "-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", "hydra.sweeper.n_jobs=1",
        "hydra.sweeper.direction=maximize", "objective=val_acuracy",
        "optimizer.learning_rate=choice(0.003,0.01)", "epochs=1", "progress=none",
        "hydra.sweep.dir=sweep", cwd=tmp_path,
    )  # fmt: skip
    assert code == 2, output[-3000:]
    lines = [line for line in output.splitlines() if line.startswith("ga-train:")]
    assert lines[0].startswith(
        "ga-train: objective=val_acuracy is not a metric a ga-train run logs"
    ), output
    assert "Did you mean objective=val_accuracy?" in lines[0]
    assert "No trials are completed" not in output and "Traceback" not in output
    assert not glob.glob(str(tmp_path / "sweep" / "*" / "result.json")), "nothing trained"


def test_every_objective_a_sweep_accepts_is_one_a_run_logs():
    from gacli.runner.builders.job import loss_and_metrics
    from gacli.runner.config.objective import LOGGED

    logged = set()
    tasks = (("classification", 10), ("segmentation", 1), ("segmentation", 3), ("regression", 2))
    for task, outputs in tasks:
        _, metrics = loss_and_metrics(task, outputs)
        logged |= {m if isinstance(m, str) else m.name for m in metrics}
    assert logged | {"loss"} == set(LOGGED)
