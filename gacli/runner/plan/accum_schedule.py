"""The effective batch over training: ``accum_schedule`` and its stages.

The micro-batch stays fixed (memory stays flat) and ``accum_steps`` changes at epoch starts, after
``partial_window`` has closed the previous epoch's short window, so every update is still the big
batch's over exactly the samples of its window (docs/guides/batch-schedule.md).

- ``accum_schedule={0:1,2:2,4:4}``: epoch -> accum_steps from that epoch on (before the first key,
  the configured ``accum_steps``).
- ``accum_schedule=gns`` (with ``monitor.gns=true``): at each epoch start after the first,
  ``accum_steps`` becomes the power of two whose effective batch is nearest, on a log scale, to the
  smoothed noise scale B_simple; it never goes down and stops at ``accum_schedule_max``.

``lr_scaling`` scales the learning rate with each stage's effective batch relative to the first
stage's; the learning-rate schedule keeps counting optimizer updates. The stage of every epoch is
recorded in the checkpoint (:class:`StageTable`), so a resumed run trains each epoch at the
``accum_steps`` the uninterrupted run used, and ``accum_schedule=gns`` decides from the noise
scale's averages, which the optimizer's checkpoint holds.

Nothing here imports TensorFlow at module level: :func:`check_schedule` runs before it loads.
"""

import dataclasses
import math

from gacli.errors import ConfigError

GNS = "gns"


def _is_whole(value):
    return isinstance(value, int) and not isinstance(value, bool)


def schedule_items(schedule):
    """[(epoch, accum_steps)] of a dict schedule, by epoch; ConfigError for a bad entry."""
    items = []
    for key, value in dict(schedule).items():
        epoch = int(key) if isinstance(key, str) and key.isdigit() else key
        if not _is_whole(epoch) or epoch < 0:
            raise ConfigError(
                f"accum_schedule: the key {key!r} is not an epoch; keys are whole numbers >= 0 "
                "(epochs counted from 0), each mapped to the accum_steps used from that epoch on, "
                "e.g. 'accum_schedule={0:1,2:2,4:4}'."
            )
        if not _is_whole(value) or value < 1:
            raise ConfigError(
                f"accum_schedule: epoch {epoch} maps to accum_steps={value!r}, which must be a "
                "whole number >= 1 (micro-batches per update), e.g. "
                "'accum_schedule={0:1,2:2,4:4}'."
            )
        items.append((epoch, value))
    return sorted(items)


def check_schedule(cfg, given=()):
    """Cross-field checks of ``accum_schedule``, ``accum_schedule_max`` and ``lr_scaling``;
    ConfigError saying what to type. No TensorFlow."""
    schedule = cfg.accum_schedule
    if (
        "lr_scaling" in given
        and cfg.lr_scaling.value != "none"
        and schedule is None
        and cfg.lr_reference_batch is None
    ):
        raise ConfigError(
            f"lr_scaling={cfg.lr_scaling.value} scales the learning rate with the effective batch "
            "relative to a reference batch, and this run has neither lr_reference_batch (the "
            "effective batch optimizer.learning_rate was tuned at) nor an accum_schedule (whose "
            "first stage is then the reference), so it would change nothing. Add "
            "lr_reference_batch=256 (your tuned batch), or a schedule, e.g. "
            "'accum_schedule={0:1,2:2,4:4}'."
        )
    if cfg.accum_schedule_max is not None and schedule != GNS and "accum_schedule_max" in given:
        raise ConfigError(
            f"accum_schedule_max={cfg.accum_schedule_max} bounds accum_schedule=gns, and this run "
            "has no gns schedule, so it would change nothing; drop it, or add "
            "accum_schedule=gns monitor.gns=true."
        )
    if schedule is None:
        return
    if isinstance(schedule, str):
        if schedule != GNS:
            raise ConfigError(
                f"accum_schedule={schedule} is neither a schedule nor gns; use e.g. "
                "'accum_schedule={0:1,2:2,4:4}' (epoch -> accum_steps from that epoch on, quoted "
                "for the shell) or accum_schedule=gns monitor.gns=true."
            )
        _check_gns(cfg)
    elif not hasattr(schedule, "items"):
        raise ConfigError(
            f"accum_schedule={schedule} is not a mapping of epochs to accum_steps; use e.g. "
            "'accum_schedule={0:1,2:2,4:4}' or accum_schedule=gns."
        )
    else:
        items = schedule_items(schedule)
        if not items:
            raise ConfigError(
                "accum_schedule={} holds no stage; give one, e.g. 'accum_schedule={0:1,2:2,4:4}', "
                "or drop the key."
            )
        late = [epoch for epoch, _ in items if epoch >= cfg.epochs]
        if late:
            raise ConfigError(
                f"accum_schedule: epoch {late[0]} is past the run's last epoch ({cfg.epochs - 1}, "
                f"counted from 0 with epochs={cfg.epochs}), so that stage would never start; use "
                f"epochs below {cfg.epochs}, or more epochs."
            )
    _refuse_companions(cfg)


def _check_gns(cfg):
    if not cfg.monitor.gns:
        raise ConfigError(
            "accum_schedule=gns grows accum_steps with the measured gradient noise scale, which "
            "monitor.gns=true measures; add monitor.gns=true."
        )
    accum = cfg.accum_steps
    one_replica = cfg.strategy.name.value in ("default", "one_device") or (
        cfg.strategy.name.value == "mirrored"
        and max(len(cfg.strategy.devices), cfg.strategy.logical_cpus) == 1
    )
    if one_replica and _is_whole(accum) and accum < 2:
        raise ConfigError(
            f"accum_schedule=gns starts from accum_steps={accum}, but on one replica the noise "
            "scale needs windows of at least 2 micro-batches (it compares a micro-batch's "
            "gradient with the window's); start from accum_steps=2 or more."
        )
    maximum = cfg.accum_schedule_max
    if maximum is not None and (not _is_whole(maximum) or maximum < 1):
        raise ConfigError(
            f"accum_schedule_max={maximum} must be a whole number >= 1 (the largest accum_steps "
            "accum_schedule=gns grows to), e.g. accum_schedule_max=64."
        )
    if maximum is not None and _is_whole(accum) and maximum < accum:
        raise ConfigError(
            f"accum_schedule_max={maximum} is below the accum_steps={accum} that "
            "accum_schedule=gns starts from; use accum_schedule_max="
            f"{max(accum, 2 ** math.ceil(math.log2(max(accum, 1))))} or more."
        )


def _refuse_companions(cfg):
    """The settings a schedule does not work with yet, each refused with what to use."""
    shown = "accum_schedule=gns" if cfg.accum_schedule == GNS else "accum_schedule"
    if cfg.partial_window.value == "carry":
        raise ConfigError(
            f"{shown} changes accum_steps at epoch starts, where partial_window=carry keeps a "
            "window open; use partial_window=apply (the default) or partial_window=drop."
        )
    if cfg.steps_per_epoch is not None:
        raise ConfigError(
            f"{shown} counts epochs as passes over the data, and steps_per_epoch="
            f"{cfg.steps_per_epoch} would make an epoch's length follow accum_steps; drop "
            "steps_per_epoch."
        )
    if cfg.oom.value == "recover" or cfg.micro_batch_size == "auto":
        raise ConfigError(
            f"{shown} keeps the micro-batch fixed, and "
            + ("oom=recover" if cfg.oom.value == "recover" else "micro_batch_size=auto")
            + " chooses it; give a micro_batch_size (e.g. the one micro_batch_size=auto chose "
            "in an earlier run) and use oom=fail with a schedule."
        )


def power_of_two_nearest(target):
    """The power of two nearest ``target`` (> 0) on a log scale: 2 ** round(log2(target))."""
    return 2 ** max(0, round(math.log2(target)))


def grown_accum_steps(current, noise_scale, global_micro_batch_size, largest):
    """The rule of ``accum_schedule=gns``: the power of two ``k`` whose effective batch
    ``global_micro_batch_size x k`` is nearest (log scale) the noise scale, if that is above
    ``current``, at most ``largest``; else ``current``. It never lowers ``accum_steps``."""
    if not noise_scale or noise_scale <= 0:
        return current
    wanted = power_of_two_nearest(noise_scale / global_micro_batch_size)
    return max(current, min(wanted, largest))


def updates_in_epoch(micro_batches, accum_steps, partial_window):
    """Optimizer updates of one epoch of ``micro_batches`` at ``accum_steps``."""
    if partial_window == "drop":
        return micro_batches // accum_steps
    return -(-micro_batches // accum_steps)


@dataclasses.dataclass(frozen=True)
class AccumSchedule:
    """A run's schedule: ``fixed`` (epoch -> accum_steps for every epoch) or gns growth.

    Args:
        fixed: accum_steps of every epoch, or None under ``gns``.
        start: the accum_steps of the first epoch.
        largest: the largest accum_steps gns may grow to.
        rule: ``none``, ``linear`` or ``sqrt``: how the learning rate follows the stage.

    Example:
        >>> AccumSchedule.of(cfg, accum_steps=4, largest=50).fixed
        (1, 1, 2, 2, 4)
    """

    fixed: tuple | None
    start: int
    largest: int
    rule: str = "none"

    @classmethod
    def of(cls, cfg, accum_steps, largest):
        """The schedule of ``cfg`` (None without one); ``accum_steps`` is the configured value,
        ``largest`` the largest accum_steps the training set allows."""
        schedule = cfg.accum_schedule
        if schedule is None:
            return None
        rule = cfg.lr_scaling.value
        if schedule == GNS:
            # By default the largest power of two whose effective batch fits the training set.
            maximum = cfg.accum_schedule_max or 2 ** int(math.log2(largest))
            return cls(None, accum_steps, max(accum_steps, min(maximum, largest)), rule)
        stages = dict(schedule_items(schedule))
        fixed, current = [], accum_steps
        for epoch in range(cfg.epochs):
            current = stages.get(epoch, current)
            fixed.append(current)
        return cls(tuple(fixed), fixed[0], max(fixed), rule)

    @property
    def grows(self):
        return self.fixed is None

    def learning_rate_factor(self, accum_steps):
        """What the learning rate of a stage at ``accum_steps`` is multiplied by, relative to
        the first stage (the micro-batch and replicas are the same in every stage)."""
        ratio = accum_steps / self.start
        if self.rule == "linear":
            return ratio
        if self.rule == "sqrt":
            return math.sqrt(ratio)
        return 1.0

    def total_updates(self, micro_batches, epochs, partial_window):
        """Optimizer updates of the whole run: exact for a fixed schedule; under gns, those at
        the starting accum_steps (an upper bound, as it only grows)."""
        per_epoch = self.fixed or (self.start,) * epochs
        return sum(updates_in_epoch(micro_batches, k, partial_window) for k in per_epoch)


def stage_records(accum_by_epoch, first_update_by_epoch, final_update, per_update_batch):
    """result.json's ``accum_schedule``: one record per stage (a run of epochs at one
    accum_steps): its first epoch, accum_steps, effective batch and updates applied."""
    stages = []
    for epoch, accum in enumerate(accum_by_epoch):
        if accum == 0:  # not reached
            break
        if stages and stages[-1]["accum_steps"] == accum:
            continue
        stages.append(
            {
                "epoch": epoch,
                "accum_steps": accum,
                "effective_batch_size": accum * per_update_batch,
                "first_update": first_update_by_epoch[epoch],
            }
        )
    for stage, following in zip(stages, stages[1:] + [{"first_update": final_update}]):
        stage["updates"] = following["first_update"] - stage.pop("first_update")
    return stages


class StageTable:
    """The accum_steps each epoch trained at and the optimizer step it started from: part of
    the run's checkpoint (gacli.runner.training.run_state.RunState), so that a resumed run goes on
    at the stage it stopped in, and result.json lists the stages. 0: the epoch has not started.

    Args:
        epochs: the run's epochs.
    """

    def __init__(self, epochs):
        import tensorflow as tf

        self.module = tf.Module(name="accum_schedule")
        self.module.accum_steps = tf.Variable(tf.zeros([epochs], "int64"), trainable=False)
        self.module.first_update = tf.Variable(tf.zeros([epochs], "int64"), trainable=False)

    def accum_steps(self, epoch):
        return int(self.module.accum_steps[epoch].numpy())

    def first_update(self, epoch):
        return int(self.module.first_update[epoch].numpy())

    def record(self, epoch, accum_steps, first_update):
        self.module.accum_steps[epoch].assign(accum_steps)
        self.module.first_update[epoch].assign(first_update)

    def stages(self, final_update, per_update_batch):
        return stage_records(
            [int(v) for v in self.module.accum_steps.numpy()],
            [int(v) for v in self.module.first_update.numpy()],
            final_update,
            per_update_batch,
        )
