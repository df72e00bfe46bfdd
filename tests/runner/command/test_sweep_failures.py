"""A sweep whose jobs are refused: it goes on to the next job, and its end names the jobs that did
not finish and why; a sweep never writes into the directory of another sweep's runs."""

import glob
import json
import os

import pytest

from helpers import ga_train


@pytest.mark.slow
def test_a_sweep_goes_on_past_a_job_refused_on_its_data_and_names_it_at_the_end(tmp_path):
    # The digits' training set holds 1438 samples: a window of 100 x 32 is refused once the data
    # has loaded, the next job trains.
    code, output = ga_train(
        "-m", "accum_steps=100,2", "epochs=1", "progress=none",
        "hydra.sweep.dir=sweep", cwd=tmp_path,
    )  # fmt: skip
    assert code == 2 and "Traceback" not in output, output[-3000:]
    lines = [line for line in output.splitlines() if line.startswith("ga-train:")]
    assert lines[0].startswith("ga-train: job #0 (accum_steps=100 "), lines
    assert "was refused, the sweep goes on: effective_batch_size = 3200 is larger" in lines[0]
    assert lines[-1].startswith(
        "ga-train: 1 of the sweep's 2 jobs did not finish. #0 (accum_steps=100"
    )
    assert "effective_batch_size = 3200 is larger than the training set" in lines[-1]
    (result,) = glob.glob(str(tmp_path / "sweep" / "1_accum_steps=2*" / "result.json"))
    assert json.load(open(result))["optimizer_step"] == 23, "the second job trained: 1438 / 64"
    assert not glob.glob(str(tmp_path / "sweep" / "0_*")), "the refused job's directory is gone"


def test_an_optuna_sweep_whose_every_trial_is_refused_ends_with_their_reason(tmp_path):
    code, output = ga_train(
        "-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", "hydra.sweeper.n_jobs=1",
        "accum_steps=choice(3,3)", "effective_batch_size=100", "epochs=1", "progress=none",
        "hydra.sweep.dir=sweep", cwd=tmp_path,
    )  # fmt: skip
    assert code == 2, output[-3000:]
    assert "No trials are completed" not in output and "Traceback" not in output, output
    lines = [line for line in output.splitlines() if line.startswith("ga-train:")]
    assert lines[-1].startswith(
        "ga-train: no trial of the search completed, so it has no best one (2 trials ran). "
        "#0 (accum_steps=3 "
    ), lines
    assert ", #1 (accum_steps=3 " in lines[-1] and lines[-1].count("is not a multiple") == 1
    assert not glob.glob(str(tmp_path / "sweep" / "*" / "result.json")), "nothing trained"


def test_a_sweep_never_writes_into_another_sweeps_directory(tmp_path):
    (tmp_path / "sweep" / "0_accum_steps=1").mkdir(parents=True)
    (tmp_path / "sweep" / "0_accum_steps=1" / "result.json").write_text("{}")
    code, output = ga_train("-m", "accum_steps=1,2", "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert code == 2 and "Traceback" not in output, output
    assert "hydra.sweep.dir=sweep already holds a sweep's runs" in output, output
    assert os.listdir(tmp_path / "sweep" / "0_accum_steps=1") == ["result.json"]
