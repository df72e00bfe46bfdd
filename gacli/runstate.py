"""A run's position and its checkpoints: what ``resume=`` restores and what SIGTERM saves.

A checkpoint holds the model, the optimizer (accumulators, both counters, the loss scale) and the
position in the run: the epoch and the micro-batches already done in it. Because every pass over the
data has its own seeded order (:func:`micro_batch_stream`), a restored run reads exactly the
micro-batches the uninterrupted run would have read next, even from the middle of a window.

TensorFlow writes a checkpoint's data files first and its index file last, so an interrupted save
leaves the previous checkpoint intact. Under MultiWorkerMirroredStrategy every worker takes part in
a save (reading the accumulators is a collective); only the chief writes into the run directory,
the others into a temporary directory that is removed afterwards.
"""

import os
import shutil
import signal
import tempfile

import keras
import tensorflow as tf

from gacli.config import Interrupted

CHECKPOINT_DIR = "checkpoints"


def pass_seed(seed, pass_index):
    """The shuffle seed of one pass over the data: from the run's seed and the pass alone."""
    return (seed * 1_000_003 + pass_index) % (2**31 - 1)


def micro_batch_stream(dataset, batch_size, micro_batches_per_pass, start, count, shuffle_seed=None,
                       buffer_size=10_000):
    """Micro-batches ``start .. start + count - 1`` of the run, as one ``tf.data`` pipeline.

    Pass ``p`` over ``dataset`` is shuffled with its own seed (``shuffle_seed=None``: not at all)
    and batched on its own, so its last micro-batch is short when the data does not divide. The
    same ``start`` gives the same micro-batches in any process: that is what makes a resumed run
    equal to an uninterrupted one.
    """
    per_pass = micro_batches_per_pass
    first, offset = divmod(start, per_pass)
    last = (start + count - 1) // per_pass

    def one_pass(index):
        data = dataset
        if shuffle_seed is not None:
            data = data.shuffle(buffer_size, seed=pass_seed(shuffle_seed, index),
                                reshuffle_each_iteration=False)
        return data.batch(batch_size)

    passes = [one_pass(index) for index in range(first, last + 1)]
    passes[0] = passes[0].skip(offset)
    if len(passes) == 1:
        stream = passes[0]
    else:
        # A flat choice over the passes (not a chain of concatenations, which nests per pass).
        lengths = tf.constant([per_pass - offset] + [per_pass] * (len(passes) - 1), "int64")
        choice = tf.data.Dataset.range(len(passes)).flat_map(
            lambda index: tf.data.Dataset.from_tensors(index).repeat(tf.gather(lengths, index))
        )
        stream = tf.data.Dataset.choose_from_datasets(passes, choice)
    options = tf.data.Options()
    # tf.data's default graph rewrites serialise each pass's pipeline, and with it a copy of
    # in-memory data per pass (measured: ten passes over 32 MB of arrays, +295 MB of peak RSS;
    # +0 without them). The loaders parallelise their maps themselves; the prefetch is explicit.
    options.experimental_optimization.apply_default_optimizations = False
    stream = stream.take(count).apply(tf.data.experimental.assert_cardinality(count))
    return stream.prefetch(tf.data.AUTOTUNE).with_options(options)


class RunState:
    """The checkpointed state of a run: model, optimizer, epoch and micro-batches done in it."""

    def __init__(self, model, run_dir, chief, max_to_keep=2):
        self.epoch = tf.Variable(0, dtype="int64", trainable=False)
        self.micro_batch = tf.Variable(0, dtype="int64", trainable=False)
        self.checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer,
                                              epoch=self.epoch, micro_batch=self.micro_batch)
        self.directory = os.path.join(run_dir, CHECKPOINT_DIR)
        self.chief = chief
        self._scratch = None if chief else tempfile.mkdtemp(prefix="gacli-worker-")
        self.manager = tf.train.CheckpointManager(
            self.checkpoint, self.directory if chief else self._scratch, max_to_keep=max_to_keep
        )

    def restore(self):
        """Load the run directory's latest checkpoint: (epoch, micro-batch) to go on from, or
        None when there is none."""
        latest = tf.train.latest_checkpoint(self.directory)
        if latest is None:
            return None
        self.checkpoint.restore(latest).assert_existing_objects_matched()
        return int(self.epoch.numpy()), int(self.micro_batch.numpy())

    def save(self, epoch, micro_batch):
        self.epoch.assign(epoch)
        self.micro_batch.assign(micro_batch)
        return self.manager.save()

    def close(self):
        if self._scratch:
            shutil.rmtree(self._scratch, ignore_errors=True)


def scratch_or(path, chief):
    """``path`` for the chief; a throw-away path of the same name for the other workers."""
    if chief:
        return path
    return os.path.join(tempfile.mkdtemp(prefix="gacli-worker-"), os.path.basename(path))


class StopSignals:
    """SIGTERM and SIGINT ask training to stop at the next micro-batch, after a checkpoint.

    A second SIGINT (Ctrl-C) stops at once. Under several workers a signal stops the process
    without a new checkpoint (the workers would not agree on the step to save); the run resumes
    from its last epoch or ``checkpoint_every_updates`` checkpoint.
    """

    def __init__(self):
        self.received = None
        self._previous = {}

    def __enter__(self):
        for number in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[number] = signal.signal(number, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def _handle(self, number, frame):
        if self.received is not None and number == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = number

    def __exit__(self, *exc):
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        return False


class RunCheckpoint(keras.callbacks.Callback):
    """Checkpoints at epoch ends and every ``every_updates`` updates; stops on a signal.

    Keeps the run's position: ``epoch`` and the micro-batches done in it, counted from the
    ``offset`` at which a resumed epoch started.
    """

    def __init__(self, state, accumulator, signals, resume_hint, every_updates=0, save=True,
                 multi_worker=False):
        super().__init__()
        self.state = state
        self.accumulator = accumulator
        self.signals = signals
        self.resume_hint = resume_hint
        self.every_updates = every_updates
        self.save = save
        self.multi_worker = multi_worker
        self.offset = 0
        self.epoch = 0
        self.done = 0
        self._saves_due = None

    def start_segment(self, epoch, offset):
        self.epoch, self.offset, self.done = epoch, offset, offset
        if self._saves_due is None and self.every_updates:
            # A resumed run does not save again the update it was restored at.
            self._saves_due = int(self.accumulator.optimizer_step.numpy()) // self.every_updates

    def on_epoch_begin(self, epoch, logs=None):
        if epoch != self.epoch:
            self.offset = 0
        self.epoch, self.done = epoch, self.offset

    def on_train_batch_end(self, batch, logs=None):
        self.done = self.offset + batch + 1
        if batch + 1 >= self.params.get("steps", batch + 2):
            # The epoch's last micro-batch: its window closes, validation runs and the position
            # becomes (next epoch, 0) in on_epoch_end, which saves and stops there.
            return
        if self.signals.received is not None:
            self._stop()
        if self.save and self.every_updates:
            # A call of steps_per_execution micro-batches may apply several updates: a save is
            # due when a multiple of every_updates was passed since the last one.
            due = int(self.accumulator.optimizer_step.numpy()) // self.every_updates
            if due > self._saves_due:
                self._saves_due = due
                self.state.save(self.epoch, self.done)

    def on_epoch_end(self, epoch, logs=None):
        self.offset = 0
        if self.save:
            self.state.save(epoch + 1, 0)
        if self.signals.received is not None:
            self._stop(f"the end of epoch {epoch + 1}", saved=self.save)

    def _stop(self, where=None, saved=False):
        name = signal.Signals(self.signals.received).name
        where = where or f"epoch {self.epoch + 1}, micro-batch {self.done}"
        if self.multi_worker or not self.save:
            message = (f"stopped by {name} at {where} without a new checkpoint"
                       + (" (several workers)" if self.multi_worker else "") + ". ")
        else:
            if not saved:
                self.state.save(self.epoch, self.done)
            message = f"stopped by {name} at {where}; checkpoint saved. "
        raise Interrupted(message + self.resume_hint, 128 + self.signals.received)

