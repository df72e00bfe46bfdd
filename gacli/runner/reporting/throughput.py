"""Training throughput as ``ga-train`` reports it, on the terminal and in TensorBoard alike.

Samples are counted from where the micro-batches fall in the data (:class:`MicroBatchLayout`), so a
pass's short last micro-batch counts what it holds. Time is :class:`TrainingClock`'s: only the
training calls of ``fit()``, after the run's first call. Validation, callbacks (checkpoints,
logging) and closing a window at an epoch's end run between calls and are not counted; the first
call traces and compiles the train step, and is reported on its own.
"""

import time

import keras


class MicroBatchLayout:
    """Samples in the micro-batches of a run: passes over ``train_size`` samples, each batched on
    its own by ``global_micro_batch_size`` (the last micro-batch of a pass is short when the size
    does not divide), one after another
    (:func:`gacli.runner.training.run_state.micro_batch_stream`).

    Args:
        train_size: training samples in one pass.
        global_micro_batch_size: samples in a full micro-batch over all replicas.

    Example:
        >>> layout = MicroBatchLayout(train_size=10, global_micro_batch_size=4)
        >>> [layout.samples_in(start, start + 1) for start in range(4)]
        [4, 4, 2, 4]
    """

    def __init__(self, train_size, global_micro_batch_size):
        self.train_size = int(train_size)
        self.global_micro_batch_size = int(global_micro_batch_size)
        self.per_pass = -(-self.train_size // self.global_micro_batch_size)

    def samples_before(self, micro_batch):
        """Samples in the run's micro-batches ``0 .. micro_batch - 1``."""
        passes, into_pass = divmod(int(micro_batch), self.per_pass)
        # Only a pass's last micro-batch is short, and into_pass stops before it.
        return passes * self.train_size + into_pass * self.global_micro_batch_size

    def samples_in(self, first, end):
        """Samples in the run's micro-batches ``first .. end - 1``."""
        return self.samples_before(end) - self.samples_before(first)

    def index_of(self, samples):
        """The micro-batch that starts ``samples`` into the run (it must start one)."""
        passes, into_pass = divmod(int(samples), self.train_size)
        return passes * self.per_pass + into_pass // self.global_micro_batch_size


class ChangedLayout:
    """A :class:`MicroBatchLayout` whose micro-batch changed size at micro-batch ``at`` of the run
    (``oom=recover``, at a window's start): ``before`` counts up to it, ``after`` from there on."""

    def __init__(self, before, at, global_micro_batch_size):
        self.before, self.at = before, int(at)
        self.train_size = before.train_size  # ``before`` may itself be one (a second recovery)
        self.after = MicroBatchLayout(before.train_size, global_micro_batch_size)
        self.offset = self.after.index_of(before.samples_before(at)) - self.at

    def samples_before(self, micro_batch):
        if micro_batch <= self.at:
            return self.before.samples_before(micro_batch)
        return self.after.samples_before(int(micro_batch) + self.offset)

    def samples_in(self, first, end):
        return self.samples_before(end) - self.samples_before(first)


def samples_per_second(reading, since=(0, 0.0)):
    """Rate between two :meth:`TrainingClock.reading` results; None when no training time passed
    between them (the run's first call is not counted)."""
    samples, seconds = reading[0] - since[0], reading[1] - since[1]
    return samples / seconds if seconds > 0 else None


class TrainingClock(keras.callbacks.Callback):
    """Wall time spent in ``fit()``'s training calls, and the samples they trained, after the
    run's first call (whose time, trace and compile included, is ``first_call_seconds``).

    A call is timed from ``on_train_batch_begin`` to ``on_train_batch_end``: the compiled steps and
    the input pipeline feeding them. Keras turns a call's logs into Python numbers before any
    ``on_train_batch_end`` runs, which waits for the call's computation (on a GPU too). Put the
    clock before any callback that reads it, so that its ``on_train_batch_end`` has run when
    theirs does.

    Args:
        accumulator: the run's GradientAccumulateOptimizer (its ``micro_step`` places a reading
            in the data).
        train_size, global_micro_batch_size: the run's :class:`MicroBatchLayout`.

    Example:
        >>> clock = TrainingClock(accumulator, train_size=1438, global_micro_batch_size=32)
        >>> model.fit(..., callbacks=[clock, ...])
        >>> samples_per_second(clock.reading(int(accumulator.micro_step.numpy())))
    """

    def __init__(self, accumulator, train_size, global_micro_batch_size):
        super().__init__()
        self.accumulator = accumulator
        self.layout = MicroBatchLayout(train_size, global_micro_batch_size)
        self.first_call_seconds = None
        self.seconds = 0.0  # in training calls after the first one
        self._first_counted = None  # micro-batches done when the first call ended
        self._call_start = None
        # A call after an out-of-memory recovery compiles again: its samples are not counted.
        self._uncounted_from = None
        self._uncounted = 0

    def replan(self, plan, recoveries):
        """Micro-batches of ``plan``'s size from the current micro-step on (``oom=recover``).
        The next call traces and compiles the step for them: like the run's first call, it is
        not counted."""
        at = int(self.accumulator.micro_step.numpy())
        self.layout = ChangedLayout(self.layout, at, plan.global_micro_batch_size)
        self._uncounted_from = at

    def on_train_batch_begin(self, batch, logs=None):
        self._call_start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        elapsed = time.perf_counter() - self._call_start
        if self.first_call_seconds is None:
            self.first_call_seconds = elapsed
            self._first_counted = int(self.accumulator.micro_step.numpy())
        elif self._uncounted_from is not None:
            now = int(self.accumulator.micro_step.numpy())
            self._uncounted += self.layout.samples_in(self._uncounted_from, now)
            self._uncounted_from = None
        else:
            self.seconds += elapsed

    def reading(self, micro_step):
        """(samples, seconds) of training after the first call, ``micro_step`` micro-batches into
        the run."""
        if self._first_counted is None:
            return 0, 0.0
        samples = self.layout.samples_in(self._first_counted, micro_step) - self._uncounted
        return samples, self.seconds
