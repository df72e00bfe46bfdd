"""``oom=recover``: an out-of-memory error in the middle of a run costs one window, not the run.

Before each window's first call, :class:`WindowStart` copies (on the device) what a micro-batch can
change before the window's update: the engine's shared state (counters, mask, loss scale), the
model's non-trainable variables (batch-norm statistics, AccumBatchNormalization windows, random
seeds) and the metrics. Weights and optimizer slots change only at the update, and accumulators are
zero at every window's start, so nothing larger is copied. When a call fails with
``tf.errors.ResourceExhaustedError``, the window is put back to its start, the micro-batch halved
(to its largest divisor at most half of it) and ``accum_steps`` multiplied to keep the effective
batch, and training goes on from the window's first sample.
"""

import dataclasses

import keras
import tensorflow as tf


class WindowStart(keras.callbacks.Callback):
    """Keeps the state at the start of the open window, and its place in the data.

    Args:
        accumulator: the run's GradientAccumulateOptimizer.
        position: a callable that returns (epoch, micro-batches of it done) at a call's start.
    """

    def __init__(self, accumulator, position):
        super().__init__()
        self.accumulator = accumulator
        self.position = position
        self.saved = None
        self.count = 0  # recoveries so far
        self._read = None
        self._kept, self._shadows = [], []
        self._carried_metrics = None  # (metric variable, value) of the open epoch, after a rewind

    def _model_variables(self):
        return [*self.model.non_trainable_variables, *self.model.metrics_variables]

    def _reader(self):
        """One compiled copy of everything kept into shadow variables on the same device, and a
        read of the window's micro-steps and update count: one call a window, two scalars to the
        host (a read of each variable from the host would wait on the device once per
        variable)."""
        kept = [*self.accumulator.shared_state, *self._model_variables()]
        # Made again when Keras adds variables (a compiled metric builds its own in the first
        # call): what was kept stays kept, and a variable made since the window began was at
        # its initial zero then.
        earlier = {id(v): shadow for v, shadow in zip(self._kept, self._shadows)}
        self._kept = kept
        self._shadows = [
            tf.Variable(
                earlier[id(v)].read_value() if id(v) in earlier else tf.zeros_like(v),
                trainable=False,
            )
            for v in kept
        ]
        counters = (self.accumulator.window_micro_steps, self.accumulator.optimizer_step)

        @tf.function
        def read():
            in_window = tf.identity(counters[0])

            def copy():
                for shadow, variable in zip(self._shadows, kept):
                    shadow.assign(variable)
                return tf.constant(True)

            tf.cond(in_window == 0, copy, lambda: tf.constant(False))
            return in_window, tf.identity(counters[1])

        return read

    def on_train_batch_begin(self, batch, logs=None):
        if not self.accumulator.built:
            return
        if self._read is None or len(self._kept) != len(self.accumulator.shared_state) + len(
            self._model_variables()
        ):
            self._read = self._reader()
        in_window, updates = self._read()
        if int(in_window):
            return
        self.saved = {"position": self.position(), "updates": int(updates)}

    def rewind(self):
        """Put the saved window start back; its (epoch, micro-batches done)."""
        if (
            self.saved is None
            or int(self.accumulator.optimizer_step.numpy()) != (self.saved["updates"])
        ):
            return None  # the failed call applied an update: the window start is gone
        engine = len(self.accumulator.shared_state)
        shadows = [shadow.numpy() for shadow in self._shadows]
        self.accumulator.rewind_window(shadows[:engine])
        for variable, value in zip(self._kept[engine:], shadows[engine:]):
            variable.assign(value)
        # The next fit() resets the metrics when its first epoch begins: the epoch's training
        # metrics so far are put back then, so that they cover the whole epoch.
        metrics = {id(v) for v in self.model.metrics_variables}
        self._carried_metrics = [
            (v, value) for v, value in zip(self._kept, shadows) if id(v) in metrics
        ]
        self._read = None  # set_accum_steps makes the train function, and Keras its variables
        return self.saved["position"]

    def on_epoch_begin(self, epoch, logs=None):
        carried, self._carried_metrics = self._carried_metrics, None
        for variable, value in carried or ():
            variable.assign(value)


def smaller_micro_batch(micro_batch_size):
    """The largest divisor of ``micro_batch_size`` that is at most half of it (None for 1)."""
    for size in range(micro_batch_size // 2, 0, -1):
        if micro_batch_size % size == 0:
            return size
    return None


def smaller_plan(plan):
    """The plan with the micro-batch from :func:`smaller_micro_batch` and the same effective batch;
    None when the micro-batch is 1."""
    size = smaller_micro_batch(plan.micro_batch_size)
    if size is None:
        return None
    return dataclasses.replace(
        plan, micro_batch_size=size, accum_steps=plan.accum_steps * (plan.micro_batch_size // size)
    )


def oom_line(error):
    """The line of TensorFlow's out-of-memory message that says what did not fit."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for line in lines:
        if "OOM when allocating" in line or "Out of memory" in line or "RESOURCE_EXHAUSTED" in line:
            return line.split(" [[")[0][:200]
    return lines[0][:200] if lines else type(error).__name__


def out_of_memory_message(plan, recover, error):
    """Why a run stopped on an out-of-memory error, and what to type instead."""
    first_line = oom_line(error)
    smaller = smaller_plan(plan)
    if smaller is None:
        return (
            f"Out of device memory at micro_batch_size=1 ({first_line}): not even one sample per "
            "micro-batch fits, so halving cannot help. Make the job smaller: a smaller model or "
            "input (the model.* and dataset.image_size settings), precision=mixed_bfloat16 or "
            "mixed_float16 (half the activation memory), or a device with more memory."
        )
    advice = (
        f"micro_batch_size={smaller.micro_batch_size} accum_steps={smaller.accum_steps} (the "
        f"same effective batch of {plan.effective_batch_size})"
    )
    if recover:
        cause = "and it cannot go back to the window's start (the failed call applied an update)"
        return (
            f"Out of device memory at micro_batch_size={plan.micro_batch_size} ({first_line}), "
            f"{cause}. Continue from the last checkpoint with resume=true and {advice}."
        )
    return (
        f"Out of device memory at micro_batch_size={plan.micro_batch_size} ({first_line}). Try "
        f"{advice}, or add oom=recover to halve the micro-batch and go on when this happens, or "
        "micro_batch_size=auto to find the largest that fits before training."
    )


def position_in(position, old_plan, new_plan):
    """(epoch, micro-batches done) of ``old_plan`` in micro-batches of ``new_plan``: the same
    sample (the old micro-batch is a multiple of the new one)."""
    epoch, done = position
    return epoch, done * (old_plan.micro_batch_size // new_plan.micro_batch_size)
