"""Step planning: how many micro-batches, windows and compiled steps an epoch holds, and the
checks that the data can give the batch plan at all (before anything is built)."""

import dataclasses
import math

from gacli.errors import ConfigError
from gacli.runner.config.schema import (
    PartialWindow,
    Wrapper,
    shown_name,
)


def check_validation_split(cfg, data):
    """ConfigError, before anything is built, when ``dataset.validation_split`` asks for
    validation data and the split leaves none: the run would log no val_ metric, and its
    objective (val_loss by default) would be missing only once training had ended."""
    split = cfg.dataset.validation_split
    if not split or data.validation_size:
        return
    total = data.train_size + data.validation_size
    smallest = f"a larger split, e.g. dataset.validation_split={float(f'{1.0 / total:.2g}')}, or "
    raise ConfigError(
        f"the validation split is empty: dataset {shown_name(cfg.dataset)} holds {total} samples, "
        f"and dataset.validation_split={split} of them rounds to 0 for validation, so this run "
        "would log no val_loss to report or compare. Use "
        + (smallest if total > 1 else "")
        + "dataset.validation_split=0 to train on every sample without validation (the "
        "objective is then loss), or more data."
    )


def check_batch_fits_data(settings, plan, train_size):
    """ConfigError when a micro-batch, or a window meant to lie within one pass, is larger than
    the training set: each update would see fewer samples than the configured batch.
    ``settings``: the plan's :class:`~gacli.runner.plan.job_plan.PlanSettings`."""
    windows_span_passes = (
        settings.steps_per_epoch is not None or settings.partial_window == PartialWindow.carry
    )
    if train_size == 0:
        raise ConfigError(
            f"the training set is empty: dataset {settings.dataset_name} leaves no sample for "
            f"training after validation_split={settings.validation_split} takes its share for "
            "validation. Lower dataset.validation_split (e.g. dataset.validation_split=0.2), or "
            "give more data."
        )
    if plan.global_micro_batch_size > train_size:
        per_replica = " x replicas" if plan.replicas > 1 else ""
        raise ConfigError(
            f"micro_batch_size{per_replica} = {plan.global_micro_batch_size} is larger than the "
            f"training set, which holds {train_size} samples (dataset "
            f"{settings.dataset_name}, after validation_split={settings.validation_split}): "
            "every micro-batch would hold "
            f"{train_size} samples, not {plan.global_micro_batch_size}. Use a smaller "
            f"micro_batch_size, e.g. micro_batch_size={max(1, train_size // (2 * plan.replicas))}"
            ", or more data."
        )
    if plan.effective_batch_size > train_size and not windows_span_passes:
        fitting = train_size // plan.global_micro_batch_size
        if settings.accum_schedule is not None:
            # Not partial_window=carry: a schedule changes accum_steps where a window closes.
            raise ConfigError(
                f"accum_schedule reaches accum_steps={plan.accum_steps}, an effective batch of "
                f"{plan.effective_batch_size}, larger than the training set, which holds "
                f"{train_size} samples (dataset {settings.dataset_name}, after validation_split="
                f"{settings.validation_split}): every update would see {train_size} samples. "
                + (
                    f"Start accum_schedule=gns from accum_steps={fitting} or less"
                    if settings.accum_schedule == "gns"
                    else f"Keep every stage at accum_steps={fitting} or less, e.g. "
                    + (f"'accum_schedule={{0:1,1:{fitting}}}'" if settings.epochs > 1 else "")
                    + (f"'accum_schedule={{0:{fitting}}}'" if settings.epochs == 1 else "")
                )
                + f" (effective batch {fitting * plan.global_micro_batch_size}), or use a "
                "smaller micro_batch_size, or more data."
            )
        raise ConfigError(
            f"effective_batch_size = {plan.effective_batch_size} is larger than the training set, "
            f"which holds {train_size} samples (dataset {settings.dataset_name}, after "
            f"validation_split={settings.validation_split}): every update would see "
            f"{train_size} samples, not {plan.effective_batch_size}. Use accum_steps={fitting} "
            f"(effective batch {fitting * plan.global_micro_batch_size}) or fewer, or more data; "
            "or let windows run across passes with partial_window=carry."
        )


def execution_steps(settings, plan, wrapper):
    """Micro-batches per compiled call: by default a window's, so that fit()'s per-step cost
    (Python, callbacks, the function call) is paid once an update instead of once a micro-batch."""
    if wrapper is Wrapper.optimizer and plan.replicas > 1:
        # A plain keras.Model's loop over several steps fails with several replicas in sync
        # (Keras 3.15); the model wrappers run a loop of their own (AccumulationMixin).
        if settings.steps_per_execution not in (None, 1):
            raise ConfigError(
                f"steps_per_execution={settings.steps_per_execution} with wrapper=optimizer fails "
                f"under {plan.replicas} replicas (Keras' own loop over several steps breaks under "
                "tf.distribute); use wrapper=auto, which runs several steps a call, or "
                "steps_per_execution=1."
            )
        return 1
    return settings.steps_per_execution or plan.accum_steps


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """How the data is cut into micro-batches, epochs and updates for one :class:`BatchPlan`."""

    micro_batches: int  # per pass over the training data
    epoch_length: int  # micro-batches per epoch (steps_per_epoch x accum_steps, when set)
    fit_steps: int | None  # steps_per_epoch given to fit(), or None for a whole pass
    total_updates: int
    steps_per_execution: int
    # At the plan's accum_steps (an accumulation schedule's first stage); partial_window=carry:
    # on average, a fraction.
    updates_per_epoch: float = 0


def plan_steps(settings, plan, train_size, schedule=None):
    """The :class:`StepPlan` of a job whose training set holds ``train_size`` samples (and
    follows ``schedule``, an :class:`~gacli.runner.plan.accum_schedule.AccumSchedule`, when set);
    ``settings``: the plan's :class:`~gacli.runner.plan.job_plan.PlanSettings`."""
    micro_batches = math.ceil(train_size / plan.global_micro_batch_size)
    fit_steps = None
    if settings.steps_per_epoch:
        updates_per_epoch = settings.steps_per_epoch
        fit_steps = settings.steps_per_epoch * plan.accum_steps
    elif settings.partial_window == PartialWindow.drop:
        updates_per_epoch = micro_batches // plan.accum_steps
    elif settings.partial_window == PartialWindow.carry:
        # Windows run across epochs: on average this many updates an epoch.
        updates_per_epoch = micro_batches / plan.accum_steps
    else:
        updates_per_epoch = math.ceil(micro_batches / plan.accum_steps)
    total_updates = math.ceil(updates_per_epoch * settings.epochs)
    if schedule is not None:
        window = settings.partial_window.value
        total_updates = schedule.total_updates(micro_batches, settings.epochs, window)
    return StepPlan(
        micro_batches,
        fit_steps or micro_batches,
        fit_steps,
        total_updates,
        execution_steps(settings, plan, settings.wrapper),
        updates_per_epoch,
    )
