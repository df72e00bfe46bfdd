"""Fault injection: a real out-of-memory error on a machine that has no device to run out of.

TensorFlow's CPU allocator does not run out of memory the way a GPU does, so the code that reacts
to one (``micro_batch_size=auto``'s probe, ``oom=recover``) could not be tested without a GPU. With
``GACLI_FAKE_OOM_ABOVE=N`` set, a training step whose micro-batch (per replica) holds more than
``N`` samples asks TensorFlow's allocator for a petabyte per extra sample, from inside the compiled
step. The allocation fails and TensorFlow raises its own ``tf.errors.ResourceExhaustedError``, with
``jit_compile`` on or off and under any strategy, so what follows is what follows a GPU's error.

``GACLI_FAKE_OOM_FROM_MICRO_STEP=S`` (default 0) holds the fault back until the call that starts at
micro-step ``S`` or later: an error in the middle of a run, as a longer sequence or a fragmented
allocator would give.

Nothing here runs unless the variable is set; ``ga-train`` installs it on the model it builds.
"""

import os

import keras
import tensorflow as tf

from gacli.errors import ConfigError

FAKE_OOM_ABOVE = "GACLI_FAKE_OOM_ABOVE"
FAKE_OOM_FROM = "GACLI_FAKE_OOM_FROM_MICRO_STEP"

# float32 elements asked for per sample over the ceiling: 2**48 of them are 1 PiB, more than any
# machine's memory or address space, so the request fails at once instead of swapping.
_ELEMENTS_PER_EXTRA_SAMPLE = 2**48


def _setting(name, minimum):
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        number = int(value)
    except ValueError:
        number = minimum - 1
    if number < minimum:
        raise ConfigError(
            f"{name}={value!r} must be a whole number >= {minimum} (fault injection for tests, "
            f"e.g. {name}={max(minimum, 8)}), or unset it."
        )
    return number


def fake_oom_settings():
    """(ceiling in samples per micro-batch, first micro-step) from the environment; (None, 0)
    when ``GACLI_FAKE_OOM_ABOVE`` is not set."""
    return _setting(FAKE_OOM_ABOVE, 0), _setting(FAKE_OOM_FROM, 0) or 0


def _batch_size(data):
    """Samples in a step's micro-batch (this replica's), as an int64 scalar tensor."""
    first = tf.nest.flatten(data)[0]
    return tf.cast(tf.shape(first)[0], "int64")


def exhaust_memory_above(data, ceiling):
    """A float32 scalar (0.0) that can only be computed by allocating 1 PiB per sample of ``data``
    over ``ceiling``; a few bytes when there is none. Under XLA the allocation is a buffer the
    scatter must write into, which XLA cannot fuse away. It is filled with zero taken from the
    data, so that no graph optimisation can fold the request into a constant ahead of time."""
    extra = tf.maximum(_batch_size(data) - ceiling, 0)
    first = tf.cast(tf.reshape(tf.nest.flatten(data)[0], [-1])[0], "float32")
    filler = tf.where(tf.math.is_finite(first), first, 0.0) * 0.0
    block = tf.fill(tf.reshape(extra * _ELEMENTS_PER_EXTRA_SAMPLE + 4, [1]), filler)
    written = tf.tensor_scatter_nd_update(block, [[3]], [1.0])
    return tf.reduce_max(written) - 1.0


class FakeOutOfMemory(keras.callbacks.Callback):
    """Installs the fault on ``model`` (see the module's docstring) and arms it once the
    accumulation engine ``accumulator`` counts ``first_micro_step`` micro-steps."""

    def __init__(self, model, ceiling, first_micro_step, accumulator):
        super().__init__()
        self.ceiling = ceiling
        self.first_micro_step = first_micro_step
        self.accumulator = accumulator
        self.armed = first_micro_step == 0
        step = model.train_step

        def train_step(data):
            if not self.armed:
                return step(data)
            # A data dependency, not a control one: XLA keeps only what the outputs need.
            zero = exhaust_memory_above(data, self.ceiling)
            data = tf.nest.map_structure(
                lambda t: t if t is None else t + tf.cast(zero, t.dtype), data
            )
            return step(data)

        model.train_step = train_step

    def on_train_batch_begin(self, batch, logs=None):
        if not self.armed and int(self.accumulator.micro_step.numpy()) >= self.first_micro_step:
            self.armed = True
            self.model.make_train_function(force=True)


def install_fake_oom(model, accumulator):
    """The :class:`FakeOutOfMemory` callback for ``model`` (compiled with the accumulation engine
    ``accumulator``) when the environment asks for one, else None."""
    ceiling, first = fake_oom_settings()
    if ceiling is None:
        return None
    return FakeOutOfMemory(model, ceiling, first, accumulator)
