"""The job's plan as one value.

:func:`make_plan` turns what the plan reads of the config (:class:`PlanSettings`), the training
set's size and a micro-batch x accum_steps x replicas into a :class:`JobPlan`: the batch arithmetic
of the current stage, the accumulation schedule and the steps of an epoch, checked against the data
there. It is the only maker of a plan. The start of a run (the micro-batch given, probed or kept
from before), a schedule's next stage (:meth:`JobPlan.at_stage`) and an out-of-memory recovery
(:meth:`JobPlan.halved`) each ask it for a new value; a plan is never changed in place.
"""

import dataclasses
from typing import Any, Optional

from gacli.runner.config.schema import LRScaling, PartialWindow, Wrapper, shown_name
from gacli.runner.plan.accum_schedule import AccumSchedule
from gacli.runner.plan.batch import BatchPlan
from gacli.runner.plan.out_of_memory import smaller_micro_batch
from gacli.runner.plan.steps import StepPlan, check_batch_fits_data, plan_steps


@dataclasses.dataclass(frozen=True)
class PlanSettings:
    """What the plan reads of the config, named as the config names it."""

    epochs: int
    steps_per_epoch: Optional[int]
    steps_per_execution: Optional[int]
    partial_window: PartialWindow
    wrapper: Wrapper  # the one chosen: model or optimizer
    accum_schedule: Any  # None, "gns" or {epoch: accum_steps}
    accum_schedule_max: Optional[int]
    lr_scaling: LRScaling
    dataset_name: str  # for messages
    validation_split: float

    @classmethod
    def of(cls, cfg):
        from omegaconf import OmegaConf

        from gacli.runner.builders.job import choose_wrapper

        schedule = cfg.get("accum_schedule")
        if OmegaConf.is_config(schedule):
            schedule = OmegaConf.to_container(schedule)
        return cls(
            epochs=cfg.epochs,
            steps_per_epoch=cfg.steps_per_epoch,
            steps_per_execution=cfg.steps_per_execution,
            partial_window=cfg.partial_window,
            wrapper=choose_wrapper(cfg)[0],
            accum_schedule=schedule,
            accum_schedule_max=cfg.get("accum_schedule_max"),
            lr_scaling=cfg.lr_scaling,
            dataset_name=shown_name(cfg.dataset),
            validation_split=cfg.dataset.validation_split,
        )


@dataclasses.dataclass(frozen=True)
class JobPlan:
    """A job's plan: made by :func:`make_plan` only.

    ``batch`` is the current stage's micro-batch, accum_steps and replicas (an accumulation
    schedule's stage, after any out-of-memory recovery); ``first_accum_steps`` the accum_steps the
    run started from at this micro-batch, which the schedule's stages are counted from.
    """

    settings: PlanSettings
    train_size: int
    batch: BatchPlan
    first_accum_steps: int
    schedule: Optional[AccumSchedule]
    steps: StepPlan

    # The batch arithmetic, read as a BatchPlan's.
    @property
    def micro_batch_size(self):
        return self.batch.micro_batch_size

    @property
    def accum_steps(self):
        return self.batch.accum_steps

    @property
    def replicas(self):
        return self.batch.replicas

    @property
    def effective_batch_size(self):
        return self.batch.effective_batch_size

    @property
    def global_micro_batch_size(self):
        return self.batch.global_micro_batch_size

    @property
    def remat(self):
        return self.batch.remat

    def at_stage(self, accum_steps):
        """The plan of the schedule's stage at ``accum_steps`` (the same micro-batch)."""
        return make_plan(self.settings, self.train_size, self.first, stage=accum_steps)

    def halved(self):
        """The plan after an out-of-memory error: the next smaller micro-batch that divides this
        one, every accum_steps (the first, the stage's) multiplied to keep each effective batch;
        None when the micro-batch is 1."""
        size = smaller_micro_batch(self.micro_batch_size)
        if size is None:
            return None
        ratio = self.micro_batch_size // size
        first = dataclasses.replace(
            self.batch, micro_batch_size=size, accum_steps=self.first_accum_steps * ratio
        )
        stage = self.accum_steps * ratio if self.schedule is not None else None
        return make_plan(self.settings, self.train_size, first, stage=stage)

    @property
    def first(self):
        return dataclasses.replace(self.batch, accum_steps=self.first_accum_steps)


def make_plan(settings, train_size, first, stage=None):
    """The :class:`JobPlan` of ``first`` (a :class:`BatchPlan`: the micro-batch, the accum_steps to
    start from, the replicas, the recomputation chosen with them) for a training set of
    ``train_size`` samples, at the schedule's ``stage`` (its accum_steps; None: the schedule's
    first stage, or ``first`` without one). A ConfigError, saying what to type, when the data
    cannot give it."""
    schedule = AccumSchedule.of(
        settings, first.accum_steps, max(1, train_size // first.global_micro_batch_size)
    )
    if schedule is not None:
        largest = dataclasses.replace(first, accum_steps=schedule.largest)
        check_batch_fits_data(settings, largest, train_size)
        stage = schedule.start if stage is None else stage
    current = dataclasses.replace(first, accum_steps=stage or first.accum_steps)
    check_batch_fits_data(settings, current, train_size)
    steps = plan_steps(settings, current, train_size, schedule)
    return JobPlan(settings, train_size, current, first.accum_steps, schedule, steps)
