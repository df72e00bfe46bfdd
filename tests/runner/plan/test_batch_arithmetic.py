"""Contract row D4: the batch arithmetic, resolved once, with errors that say what to type; every
setting such an error suggests gives the size it states (checked by feeding it back). A batch or
schedule larger than the training set and an empty validation split are refused from the data's
size, before the model is built, with a setting that works."""

import glob
import re

import numpy as np
import pytest

from gacli.runner.config.schema import ConfigError
from gacli.runner.plan.batch import BatchPlan, resolve_batch
from helpers import assert_refused, compose_config, ga_train


@pytest.mark.parametrize(
    "micro, accum, effective, replicas, given, expected",
    [
        (32, 4, None, 1, (), (32, 4, 128)),
        (16, None, 256, 1, (), (16, 16, 256)),
        (None, 8, 256, 2, (), (16, 8, 256)),
        (None, None, 256, 1, (), (32, 8, 256)),  # only the effective batch: micro defaults to 32
        (None, None, None, 1, (), (32, 1, 32)),
        (32, 4, 128, 1, (), (32, 4, 128)),  # all three agree
        # A recipe's micro 8 and accum 8, the command line's effective 256 and micro 16:
        (16, 8, 256, 1, ("effective_batch_size", "micro_batch_size"), (16, 16, 256)),
        # The command line's accum_steps=8 with a recipe's micro 8: effective derived.
        (8, 8, None, 4, ("accum_steps",), (8, 8, 256)),
        # The command line's effective 64 with a recipe's micro 8 and accum 4: micro kept.
        (8, 4, 64, 1, ("effective_batch_size",), (8, 8, 64)),
    ],
)
def test_any_two_determine_the_third(micro, accum, effective, replicas, given, expected):
    plan = resolve_batch(micro, accum, effective, replicas, given)
    assert (plan.micro_batch_size, plan.accum_steps, plan.effective_batch_size) == expected
    assert plan.effective_batch_size == plan.micro_batch_size * plan.accum_steps * replicas


@pytest.mark.parametrize(
    "micro, accum, effective, replicas, message",
    [
        # All three from config files: the one to set to null is named.
        (
            32,
            4,
            100,
            1,
            "= 128. Set the one to derive to null in your YAML, e.g. effective_batch_size: null",
        ),
        (16, None, 100, 1, "use e.g. effective_batch_size=96 or 112"),
        (16, None, 32, 4, "is not a multiple of micro_batch_size x replicas = 16 x 4 = 64"),
        (None, 3, 100, 1, "set micro_batch_size instead"),
        (0, 4, None, 1, "micro_batch_size=0 must be a whole number >= 1"),
        (8, True, None, 1, "accum_steps=True must be a whole number"),
    ],
)
def test_batch_errors_say_what_to_type(micro, accum, effective, replicas, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        resolve_batch(micro, accum, effective, replicas)


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


@pytest.mark.slow
def test_a_micro_batch_larger_than_the_data_is_refused(tmp_path):
    """Refused from the data's size, before the model is built: the message, and no run directory
    named (the refusal removes the one Hydra made) nor left behind."""
    code, output = ga_train("micro_batch_size=5000", "accum_steps=1", cwd=tmp_path)
    assert_refused(
        code,
        output,
        "ga-train: micro_batch_size = 5000 is larger than the training "
        "set, which holds 1438 samples",
        tmp_path,
    )
    assert "run directory:" not in output, output
    assert not glob.glob(str(tmp_path / "outputs" / "*" / "*")), "the run's directory is removed"
    code, output = ga_train("micro_batch_size=500", "accum_steps=4", cwd=tmp_path)
    assert_refused(
        code,
        output,
        "ga-train: effective_batch_size = 2000 is larger than the "
        "training set, which holds 1438 samples (dataset digits, after "
        "validation_split=0.2): every update would see 1438 samples, not "
        "2000. Use accum_steps=2 (effective batch 1000) or fewer",
        tmp_path,
    )


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
