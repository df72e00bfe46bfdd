"""Optimizers and learning-rate schedules for ``ga-train``; schedules count optimizer updates.

The schedule classes that a saved model holds are the engine's (:mod:`gacli.engine.schedules`).

The inner optimizer's ``iterations`` counts updates (the accumulator keeps its own micro-step
counter), so every schedule here is in updates, whatever ``accum_steps`` is.
"""

import math

import keras

from gacli.engine.schedules import LinearWarmup
from gacli.runner.builders import targets
from gacli.runner.config.arguments import section_arguments
from gacli.runner.config.schema import LRScaling, Schedule


def scaled_learning_rate(learning_rate, effective_batch_size, lr_scaling, lr_reference_batch):
    """``learning_rate`` scaled with the effective batch relative to ``lr_reference_batch``
    (``lr_scaling``: none, linear, sqrt; no reference batch: unscaled, as at the first stage of an
    accumulation schedule)."""
    if lr_reference_batch is None:
        return learning_rate
    ratio = effective_batch_size / lr_reference_batch
    if lr_scaling == LRScaling.linear:
        return learning_rate * ratio
    if lr_scaling == LRScaling.sqrt:
        return learning_rate * math.sqrt(ratio)
    return learning_rate


def learning_rate_schedule(
    cfg, effective_batch_size, total_updates, scaling=(LRScaling.none, None)
):
    """A float or a schedule in optimizer updates; ``scaling``: (lr_scaling, lr_reference_batch)."""
    peak = scaled_learning_rate(cfg.learning_rate, effective_batch_size, *scaling)
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


def build_optimizer(
    cfg, effective_batch_size, total_updates, learning_rate=None, scaling=(LRScaling.none, None)
):
    """The inner (update-level) Keras optimizer for ``cfg``; ``learning_rate``: a float or a
    schedule in updates to use instead of :func:`learning_rate_schedule`'s (an accumulation
    schedule's scaled rate); ``scaling``: (lr_scaling, lr_reference_batch).

    A shipped optimizer (``optimizer=adam``: keras.optimizers.Adam) and the user's own
    (``optimizer._target_=keras.optimizers.Lion``) are built alike: the target is called with the
    section's arguments, and the schedule, warm-up and scaling stay ga-train's, the target getting
    their result as its learning_rate."""
    if learning_rate is None:
        learning_rate = learning_rate_schedule(cfg, effective_batch_size, total_updates, scaling)
    arguments = section_arguments(cfg, "optimizer")
    fill = {"learning_rate": learning_rate}
    return targets.build("optimizer", arguments, targets.OPTIMIZER, fill)
