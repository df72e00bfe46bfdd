"""The job's plan is a value: make_plan makes it, checked against the data; a stage and an
out-of-memory recovery are new plans from the same function, and the old one stays as it was."""

import dataclasses

import pytest

from gacli.errors import ConfigError
from gacli.runner.config.schema import LRScaling, PartialWindow, Wrapper
from gacli.runner.plan.batch import BatchPlan
from gacli.runner.plan.job_plan import JobPlan, PlanSettings, make_plan

TRAIN_SIZE = 1438  # the digits' training split


def settings(**changes):
    """The default job's plan settings (what PlanSettings.of reads of its config), changed."""
    values = dict(
        epochs=2,
        steps_per_epoch=None,
        steps_per_execution=None,
        partial_window=PartialWindow.apply,
        wrapper=Wrapper.model,
        accum_schedule=None,
        accum_schedule_max=None,
        lr_scaling=LRScaling.none,
        dataset_name="digits",
        validation_split=0.2,
    )
    return PlanSettings(**{**values, **changes})


def test_the_plan_of_a_micro_batch_holds_its_steps():
    plan = make_plan(settings(), TRAIN_SIZE, BatchPlan(32, 4, 1))
    assert (plan.micro_batch_size, plan.accum_steps, plan.effective_batch_size) == (32, 4, 128)
    assert plan.steps.micro_batches == 45  # ceil(1438 / 32)
    assert plan.steps.total_updates == 2 * 12  # ceil(45 / 4) an epoch, the last window ragged
    assert plan.steps.steps_per_execution == 4  # a window a compiled call
    assert plan.schedule is None


def test_a_recovery_is_a_new_plan_with_the_same_effective_batch():
    plan = make_plan(settings(), TRAIN_SIZE, BatchPlan(6, 4, 2))
    smaller = plan.halved()
    assert isinstance(smaller, JobPlan)
    assert (smaller.micro_batch_size, smaller.accum_steps, smaller.replicas) == (3, 8, 2)
    assert smaller.effective_batch_size == plan.effective_batch_size == 48
    assert smaller.steps == make_plan(settings(), TRAIN_SIZE, BatchPlan(3, 8, 2)).steps
    assert (plan.micro_batch_size, plan.accum_steps) == (6, 4)  # the old plan is unchanged
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.batch = smaller.batch
    assert make_plan(settings(), TRAIN_SIZE, BatchPlan(1, 4, 1)).halved() is None


def test_a_schedule_starts_at_its_first_stage_and_each_stage_is_a_new_plan():
    schedule = settings(accum_schedule={0: 1, 1: 4}, lr_scaling=LRScaling.linear)
    first = make_plan(schedule, TRAIN_SIZE, BatchPlan(32, 4, 1))
    assert first.accum_steps == 1 and first.steps.steps_per_execution == 1
    assert first.steps.total_updates == 45 + 12  # epoch 1 at accum 1, epoch 2 at accum 4
    second = first.at_stage(4)
    assert (second.accum_steps, second.steps.steps_per_execution) == (4, 4)
    # Counted for the whole run, whichever stage the plan is at.
    assert second.steps.total_updates == first.steps.total_updates
    assert second.schedule == first.schedule and first.accum_steps == 1


def test_a_plan_the_data_cannot_give_is_refused_where_it_is_made():
    with pytest.raises(ConfigError, match="larger than the training set"):
        make_plan(settings(), TRAIN_SIZE, BatchPlan(2048, 1, 1))
    with pytest.raises(ConfigError, match="Keep every stage at accum_steps=44 or less"):
        make_plan(settings(accum_schedule={0: 1, 1: 100}), TRAIN_SIZE, BatchPlan(32, 1, 1))
