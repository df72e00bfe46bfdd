"""Learning-rate schedules that gacli saves with a model; they count optimizer updates.

The inner optimizer's ``iterations`` counts updates (the accumulator keeps its own micro-step
counter), so a schedule here is in updates, whatever ``accum_steps`` is.
"""

import keras


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
        return cls(_deserialized(config["after"]), config["warmup_updates"])


@keras.saving.register_keras_serializable(package="gacli")
class ScaledLearningRate(keras.optimizers.schedules.LearningRateSchedule):
    """``after`` (a schedule in optimizer updates, or a float) times ``scale``, a variable: the
    learning rate of a stage of an accumulation schedule whose effective batch differs from the
    first stage's. The schedule keeps counting updates; the optimizer's ``learning_rate`` reads
    the product, so the rate logged is the rate applied. ``scale`` is state, not a value traced
    into the train step: assigning it (``set_scale``) takes effect at the next update.

    Args:
        after: the learning rate or schedule of the first stage.
        scale: the initial factor.

    Example:
        >>> rate = ScaledLearningRate(keras.optimizers.schedules.CosineDecay(1e-3, 1000))
        >>> optimizer = keras.optimizers.Adam(rate)
        >>> rate.set_scale(2.0)  # the effective batch doubled, lr_scaling=linear
    """

    def __init__(self, after, scale=1.0):
        self.after = after
        self.scale = keras.Variable(
            float(scale), trainable=False, dtype="float32", name="learning_rate_scale"
        )

    def set_scale(self, scale):
        self.scale.assign(float(scale))

    def __call__(self, step):
        return _evaluate(self.after, step) * keras.ops.convert_to_tensor(self.scale)

    def get_config(self):
        after = self.after
        return {
            "after": keras.saving.serialize_keras_object(after) if callable(after) else after,
            "scale": float(keras.ops.convert_to_numpy(self.scale)),
        }

    @classmethod
    def from_config(cls, config):
        return cls(_deserialized(config["after"]), config["scale"])


def _deserialized(after):
    """A schedule (or float) that a ``get_config`` stored as ``after``."""
    return keras.saving.deserialize_keras_object(after) if isinstance(after, dict) else after


def _evaluate(schedule, step):
    return schedule(step) if callable(schedule) else keras.ops.cast(schedule, "float32")


# Whichever of gacli's modules is imported first, Keras then knows the classes of all of them.
from gacli import _register_with_keras  # noqa: E402

_register_with_keras(finished=__name__)
