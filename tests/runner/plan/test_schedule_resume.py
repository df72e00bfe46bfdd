"""A resumed run decides from its restored state, not from the configured values (contract S2):
under ``accum_schedule=gns``, resumed at an epoch start, the next stage grows from the restored
stage and the run ends with the uninterrupted run's weights, update count and stages; resumed after
its last epoch, it reports the stage it ended in; under ``oom=recover`` it counts the recoveries
before the resume."""

import glob
import json
import os
import shutil

from helpers import compose_config, event_tags, record, run_difference, scalars

# The digits MLP at micro-batches of 8 (180 an epoch): the noise scale grows accum_steps from 2 to
# 16 at the second epoch's start, and at the third measures a B_simple whose nearest power of two
# is below 16, so growth keeps 16. Decided from the configured 2 instead, the third epoch would
# train at a smaller accum_steps than the uninterrupted run.
GNS_JOB = (
    "epochs=3",
    "accum_schedule=gns",
    "monitor.gns=true",
    "micro_batch_size=8",
    "accum_steps=2",
    "optimizer.learning_rate=0.01",
    "progress=plain",
)


def _decisions(printed):
    return [line for line in printed.splitlines() if line.startswith("accum_schedule=gns")]


def _keep_checkpoints_up_to(run_dir, number):
    """The run directory as a kill -9 after checkpoint ``number`` leaves it."""
    for name in ("result.json", "model.keras"):
        os.remove(os.path.join(run_dir, name))
    checkpoints = os.path.join(run_dir, "checkpoints")
    for path in glob.glob(os.path.join(checkpoints, "ckpt-*")):
        if int(os.path.basename(path).split(".")[0][5:]) > number:
            os.remove(path)
    with open(os.path.join(checkpoints, "checkpoint"), "w") as index:
        index.write(f'model_checkpoint_path: "ckpt-{number}"\n')


def test_gns_resumed_at_an_epoch_start_grows_from_the_restored_stage(tmp_path, capsys):
    from gacli.runner.training.run import train

    uninterrupted = str(tmp_path / "uninterrupted")
    train(compose_config(*GNS_JOB), run_dir=uninterrupted)
    decisions = _decisions(capsys.readouterr().out)
    expected = json.load(open(os.path.join(uninterrupted, "result.json")))
    stages = [stage["accum_steps"] for stage in expected["accum_schedule"]]
    # The case this test is about: a grown stage that the third epoch's decision keeps.
    assert stages == [2, 16], (stages, decisions)
    assert "accum_steps stays 16" in decisions[1], decisions

    # Resumed from the second epoch's end (ckpt-2: a checkpoint at each epoch end).
    resumed = str(tmp_path / "resumed")
    shutil.copytree(uninterrupted, resumed)
    _keep_checkpoints_up_to(resumed, 2)
    train(compose_config(*GNS_JOB, f"resume={resumed}"), run_dir=resumed)
    again = _decisions(capsys.readouterr().out)
    assert again == decisions[1:], (again, decisions)
    result = json.load(open(os.path.join(resumed, "result.json")))
    assert result["optimizer_step"] == expected["optimizer_step"] == 90 + 2 * 12
    assert result["accum_schedule"] == expected["accum_schedule"]
    assert result["accum_steps"] == expected["accum_steps"] == 16
    measured = record(
        run_difference(resumed, uninterrupted),
        "test_schedule_resume gns resumed at the third epoch's start",
    )
    assert measured == 0.0
    assert result["weights_sha256"] == expected["weights_sha256"]


def test_resumed_after_the_last_epoch_reports_the_last_stage(tmp_path):
    """Resumed from the final epoch's checkpoint (nothing left to train): result.json names the
    stage the run ended in, not the configured accum_steps."""
    from gacli.runner.training.run import train

    job = ("epochs=2", "accum_schedule={0:1,1:4}", "micro_batch_size=64")
    uninterrupted = str(tmp_path / "uninterrupted")
    train(compose_config(*job), run_dir=uninterrupted)
    expected = json.load(open(os.path.join(uninterrupted, "result.json")))
    resumed = str(tmp_path / "resumed")
    shutil.copytree(uninterrupted, resumed)
    _keep_checkpoints_up_to(resumed, 2)
    train(compose_config(*job, f"resume={resumed}"), run_dir=resumed)
    result = json.load(open(os.path.join(resumed, "result.json")))
    for key in ("accum_steps", "effective_batch_size", "optimizer_step", "accum_schedule"):
        assert result[key] == expected[key], key
    assert result["accum_steps"] == 4


def test_oom_recoveries_before_a_resume_are_counted_after_it(tmp_path, monkeypatch):
    """oom=recover halves 16 -> 8 in the first epoch; resumed from that epoch's checkpoint, a
    second recovery (8 -> 4) is the run's second: batch_plan.json and the logged count say 2."""
    from gacli.runner.training.run import train

    job = ("optimizer=momentum", "epochs=2", "micro_batch_size=16", "accum_steps=8", "oom=recover")
    monkeypatch.setenv("GACLI_FAKE_OOM_ABOVE", "8")
    monkeypatch.setenv("GACLI_FAKE_OOM_FROM_MICRO_STEP", "20")
    run_dir = str(tmp_path / "run")
    train(compose_config(*job), run_dir)
    plan_file = os.path.join(run_dir, "batch_plan.json")
    assert json.load(open(plan_file))["oom_recoveries"] == 1
    _keep_checkpoints_up_to(run_dir, 1)
    shutil.rmtree(os.path.join(run_dir, "tensorboard"))
    monkeypatch.setenv("GACLI_FAKE_OOM_ABOVE", "4")
    train(compose_config(*job, f"resume={run_dir}"), run_dir)
    plan = json.load(open(plan_file))
    assert (plan["micro_batch_size"], plan["accum_steps"], plan["oom_recoveries"]) == (4, 32, 2)
    _, events = event_tags(run_dir)
    assert scalars(events, "batch/oom_recoveries")[-1] == 2
