"""Bad input, fourth pass: every suggestion a refusal makes is a setting that works (checked by
feeding it back), refusals come before the model is built and name no directory they then remove,
and input that used to pass quietly (duplicate probe sizes, a nan tolerance, an empty validation
split, a misspelt sweep objective) is refused before anything trains."""

import glob
import io
import re

import numpy as np
import pytest
from rich.console import Console

from gacli.errors import ConfigError
from gacli.runner.config.validate import validate
from gacli.runner.plan.batch import BatchPlan, resolve_batch
from helpers import compose_config, ga_train

# -- the batch arithmetic: only suggestions that give the size they state --------------------


@pytest.mark.parametrize(
    "accum, effective, replicas", [(3, 100, 1), (3, 7, 1), (3, 101, 2), (3, 10**11, 1)]
)
def test_no_micro_batch_gives_the_effective_batch_and_every_suggestion_works(
    accum, effective, replicas
):
    with pytest.raises(ConfigError) as refused:
        resolve_batch(None, accum, effective, replicas, given=("accum_steps",))
    message = str(refused.value)
    assert "so no micro_batch_size gives it exactly" in message, message
    # Each "accum_steps=K micro_batch_size=M (effective batch E)" is what those two give.
    pairs = re.findall(
        r"accum_steps=(\d+) micro_batch_size=(\d+) \(effective batch (\d+)\)", message
    )
    assert len(pairs) == 2, message
    for k, m, stated in pairs:
        plan = resolve_batch(int(m), int(k), None, replicas, given=("micro_batch_size",))
        assert plan.effective_batch_size == int(stated) != effective
    # Each "accum_steps=K (micro-batches of M)" keeps the asked effective batch exactly.
    kept = re.findall(r"accum_steps=(\d+) \(micro-batches of (\d+)\)", message)
    assert kept if effective % replicas == 0 else not kept, message
    for k, m in kept:
        plan = resolve_batch(None, int(k), effective, replicas, given=("accum_steps",))
        assert (plan.micro_batch_size, plan.effective_batch_size) == (int(m), effective)


# -- refused from the data: before the model, and no directory named -------------------------


def test_a_schedule_larger_than_the_data_suggests_a_schedule_that_works():
    from gacli.runner.plan.accum_schedule import check_schedule
    from gacli.runner.plan.job_plan import PlanSettings
    from gacli.runner.plan.steps import check_batch_fits_data

    cfg = compose_config("accum_schedule={0:100000000000}", "epochs=3")
    train_size = 1438  # the digits' training split
    with pytest.raises(ConfigError) as refused:
        check_batch_fits_data(PlanSettings.of(cfg), BatchPlan(32, 100000000000, 1), train_size)
    message = str(refused.value)
    assert "partial_window=carry" not in message, message  # schedules refuse it
    (suggested,) = re.findall(r"'(accum_schedule=\{[^']*\})'", message)
    fixed = compose_config(suggested, "epochs=3")
    check_schedule(fixed)
    largest = max(dict(fixed.accum_schedule).values())
    check_batch_fits_data(PlanSettings.of(fixed), BatchPlan(32, largest, 1), train_size)
    assert largest == 44  # the most micro-batches of 32 within 1438 samples

    gns = compose_config("accum_schedule=gns", "monitor.gns=true", "accum_steps=100")
    with pytest.raises(ConfigError, match="Start accum_schedule=gns from accum_steps=44 or less"):
        check_batch_fits_data(PlanSettings.of(gns), BatchPlan(32, 100, 1), train_size)


def test_an_empty_validation_split_is_refused_before_training(tmp_path):
    from gacli.runner.training.run import train

    rng = np.random.default_rng(0)
    path = tmp_path / "two.npz"
    np.savez(path, x=rng.normal(size=(2, 4)).astype("float32"), y=np.array([0, 1]))
    job = ("dataset=npz", f"dataset.path={path}", "micro_batch_size=1", "accum_steps=1")
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError) as refused:
        train(compose_config(*job, "dataset.validation_split=0.2", "epochs=1"), str(run_dir))
    message = str(refused.value)
    assert message.startswith("the validation split is empty: dataset npz holds 2 samples"), message
    assert not glob.glob(str(run_dir / "checkpoints" / "ckpt-*")), "nothing trained"
    assert not (run_dir / "resolved.yaml").exists(), "refused before the model is built"
    # Both ways out that it names train: with a validation split that holds a sample, and without.
    (larger,) = re.findall(r"dataset.validation_split=(\d\.\d+), or", message)
    for split in (larger, "0"):
        metrics = train(
            compose_config(*job, f"dataset.validation_split={split}", "epochs=1"),
            str(tmp_path / f"split_{split}"),
        )
        assert ("val_loss" in metrics) == (split != "0"), metrics


# -- probe=batch ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arguments, expected",
    [
        (("probe.effective_sizes=[32,32]",), "lists 32 more than once"),
        (("probe.effective_sizes=[32,64,32]",), "e.g. probe.effective_sizes=[32,64]."),
        (("probe.tolerance=nan",), "probe.tolerance=nan must be >= 0 and finite"),
        (("probe.tolerance=inf",), "probe.tolerance=inf must be >= 0 and finite"),
    ],
)
def test_probe_settings_that_used_to_pass_quietly(arguments, expected):
    with pytest.raises(ConfigError) as refused:
        validate(compose_config("probe=batch", *arguments))
    assert expected in str(refused.value)


def test_the_suggested_probe_sizes_are_accepted():
    with pytest.raises(ConfigError) as refused:
        validate(compose_config("probe=batch", "probe.effective_sizes=[32,32]"))
    (suggested,) = re.findall(r"(probe.effective_sizes=\[[\d,]+\])", str(refused.value))
    validate(compose_config("probe=batch", suggested))


def test_a_nan_tolerance_is_refused_before_tensorflow(tmp_path):
    code, output = ga_train("probe=batch", "probe.tolerance=nan", cwd=tmp_path)
    assert code == 2 and "Traceback" not in output, output
    assert "ga-train: probe.tolerance=nan must be" in output
    assert not glob.glob(str(tmp_path / "outputs" / "*" / "*")), "the run's directory is removed"


def test_probe_samples_beyond_the_training_set_are_cut_with_a_line():
    from gacli.runner.tools.batch_probe import samples_within_training_set

    printed = io.StringIO()
    console = Console(file=printed, width=400)
    cfg = compose_config("probe=batch")  # 2048 samples over sizes 32, 128, 512
    cut = samples_within_training_set(cfg, 1438, console)
    assert cut.probe.samples == 1024 and cfg.probe.samples == 2048
    assert "probe.samples=2048 is more than the 1438 training samples" in printed.getvalue()
    assert "every branch trains on 1024" in printed.getvalue()
    assert samples_within_training_set(cfg, 4096, console) is cfg  # within: unchanged
    odd = compose_config("probe=batch", "probe.effective_sizes=[96,128]", "probe.samples=768")
    with pytest.raises(ConfigError, match="the smallest common multiple is 384"):
        samples_within_training_set(odd, 300, console)


# -- a sweep whose objective no run logs ------------------------------------------------------


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
