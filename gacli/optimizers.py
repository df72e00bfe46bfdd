"""Optimizers and learning-rate schedules for ``ga-train``; schedules count optimizer updates.

The inner optimizer's ``iterations`` counts updates (the accumulator keeps its own micro-step
counter), so every schedule here is in updates, whatever ``accum_steps`` is.
"""

import math

import keras

from gacli.config import LRScaling, OptimizerName, Schedule


@keras.saving.register_keras_serializable(package="gacli")
class LinearWarmup(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warm-up from 0 to ``after(warmup_updates)`` over ``warmup_updates``, then ``after``
    shifted by the warm-up."""

    def __init__(self, after, warmup_updates):
        self.after = after
        self.warmup_updates = int(warmup_updates)

    def __call__(self, step):
        step = keras.ops.cast(step, "float32")
        warmup = keras.ops.cast(self.warmup_updates, "float32")
        target = _evaluate(self.after, 0.0)
        warming = target * (step + 1.0) / warmup
        return keras.ops.where(step < warmup, warming, _evaluate(self.after, step - warmup))

    def get_config(self):
        return {
            "after": keras.saving.serialize_keras_object(self.after),
            "warmup_updates": self.warmup_updates,
        }

    @classmethod
    def from_config(cls, config):
        after = config["after"]
        if isinstance(after, dict):
            after = keras.saving.deserialize_keras_object(after)
        return cls(after, config["warmup_updates"])


def _evaluate(schedule, step):
    return schedule(step) if callable(schedule) else keras.ops.cast(schedule, "float32")


def scaled_learning_rate(cfg, effective_batch_size):
    """``learning_rate`` scaled with the effective batch (``lr_scaling``: none, linear, sqrt)."""
    ratio = effective_batch_size / cfg.base_batch_size
    if cfg.lr_scaling == LRScaling.linear:
        return cfg.learning_rate * ratio
    if cfg.lr_scaling == LRScaling.sqrt:
        return cfg.learning_rate * math.sqrt(ratio)
    return cfg.learning_rate


def learning_rate_schedule(cfg, effective_batch_size, total_updates):
    """A float or a schedule in optimizer updates."""
    peak = scaled_learning_rate(cfg, effective_batch_size)
    after_warmup = max(1, total_updates - cfg.warmup_updates)
    if cfg.schedule == Schedule.cosine:
        schedule = keras.optimizers.schedules.CosineDecay(
            peak, decay_steps=cfg.decay_updates or after_warmup
        )
    elif cfg.schedule == Schedule.exponential:
        schedule = keras.optimizers.schedules.ExponentialDecay(
            peak, decay_steps=cfg.decay_updates or after_warmup, decay_rate=cfg.decay_rate
        )
    else:
        schedule = peak
    if cfg.warmup_updates > 0:
        return LinearWarmup(schedule, cfg.warmup_updates)
    return schedule


def build_optimizer(cfg, effective_batch_size, total_updates):
    """The inner (update-level) Keras optimizer for ``cfg``."""
    common = dict(
        learning_rate=learning_rate_schedule(cfg, effective_batch_size, total_updates),
        clipnorm=cfg.clipnorm,
        global_clipnorm=cfg.global_clipnorm,
        use_ema=cfg.use_ema,
    )
    if cfg.weight_decay and cfg.name != OptimizerName.adamw:
        common["weight_decay"] = cfg.weight_decay
    if cfg.name == OptimizerName.sgd:
        return keras.optimizers.SGD(**common)
    if cfg.name == OptimizerName.momentum:
        return keras.optimizers.SGD(momentum=cfg.momentum, **common)
    if cfg.name == OptimizerName.adam:
        return keras.optimizers.Adam(**common)
    if cfg.name == OptimizerName.adamw:
        return keras.optimizers.AdamW(weight_decay=cfg.weight_decay, **common)
    return keras.optimizers.RMSprop(**common)


# Whichever of gacli's modules is imported first, Keras then knows the classes of all of them.
from gacli import _register_with_keras  # noqa: E402

_register_with_keras(finished=__name__)
