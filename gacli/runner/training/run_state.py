"""A run's position and its checkpoints: what ``resume=`` restores and what SIGTERM saves.

A checkpoint holds the model, the optimizer (accumulators, both counters, the loss scale), the
random state of the model's layers (their seed generators', and Keras' global one) and the
position in the run: the epoch and the micro-batches already done in it. Because every pass over the
data has its own seeded order (:func:`micro_batch_stream`), a restored run reads exactly the
micro-batches the uninterrupted run would have read next, even from the middle of a window.

TensorFlow writes a checkpoint's data files first and its index file last, so an interrupted save
leaves the previous checkpoint intact; a checkpoint damaged afterwards (a full disk, a copy cut
short) is found on restore, set aside, and the newest intact one is used instead. Under
MultiWorkerMirroredStrategy every worker takes part in a save (reading the accumulators is a
collective); only the chief writes into the run directory, the others into a temporary directory
that is removed afterwards.
"""

import dataclasses
import glob
import hashlib
import logging
import math
import os
import re
import shutil
import signal
import tempfile
import time

import keras
import numpy as np
import tensorflow as tf

from gacli.engine.random_state import random_state
from gacli.errors import ConfigError, Interrupted, first_line
from gacli.rundir import CHECKPOINT_DIR, checkpoint_numbers, looks_intact, read_json, write_json


def pass_seed(seed, pass_index):
    """The shuffle seed of one pass over the data: from the run's seed and the pass alone."""
    return (seed * 1_000_003 + pass_index) % (2**31 - 1)


# Samples in tf.data's shuffle buffer: every pass over the training data, the order a halted run's
# message names its samples in, and the precise batch-norm statistics shuffle with it, so that a
# resumed run reads exactly the samples the uninterrupted one would have.
SHUFFLE_BUFFER = 10_000


@dataclasses.dataclass(frozen=True)
class PassOrder:
    """How each pass over the training data is shuffled: with its own seed, derived from the
    run's ``seed`` (``None``: not shuffled), in a buffer of ``buffer_size`` samples.

    Example:
        >>> order = PassOrder.of(train_size=1438, seed=0)
        >>> order.positions(1438, pass_index=2)[:3]  # the first samples pass 3 reads
    """

    seed: int | None = None
    buffer_size: int = SHUFFLE_BUFFER

    @classmethod
    def of(cls, train_size, seed):
        """The order of a training set of ``train_size`` samples (a buffer no larger)."""
        return cls(seed, min(train_size, SHUFFLE_BUFFER))

    def shuffled(self, dataset, pass_index):
        """``dataset`` in the order of pass ``pass_index``."""
        if self.seed is None:
            return dataset
        return dataset.shuffle(
            self.buffer_size, seed=pass_seed(self.seed, pass_index), reshuffle_each_iteration=False
        )

    def positions(self, size, pass_index):
        """The positions in the unshuffled data of the ``size`` samples, in the order pass
        ``pass_index`` reads them. tf.data's seeded shuffle orders by the seed, buffer and count
        alone, never by the elements, so a range of positions shuffles as the data does."""
        positions = self.shuffled(tf.data.Dataset.range(size), pass_index)
        return np.fromiter(positions.as_numpy_iterator(), dtype=np.int64, count=size)


def pass_order(size, pass_index, shuffle_seed=None, buffer_size=SHUFFLE_BUFFER):
    """The order in which pass ``pass_index`` of :func:`micro_batch_stream` reads the ``size``
    samples: :meth:`PassOrder.positions`."""
    return PassOrder(shuffle_seed, buffer_size).positions(size, pass_index)


def micro_batch_stream(dataset, batch_size, micro_batches_per_pass, start, count, order=None):
    """Micro-batches ``start .. start + count - 1`` of the run, as one ``tf.data`` pipeline.

    Pass ``p`` over ``dataset`` is shuffled as ``order`` (a :class:`PassOrder`; ``None``: not
    shuffled) says and batched on its own, so its last micro-batch is short when the data does not
    divide. The same ``start`` gives the same micro-batches in any process: that is what makes a
    resumed run equal to an uninterrupted one.
    """
    order = order or PassOrder()
    per_pass = micro_batches_per_pass
    first, offset = divmod(start, per_pass)
    last = (start + count - 1) // per_pass

    def one_pass(index):
        return order.shuffled(dataset, index).batch(batch_size)

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
    # in-memory data per pass, so peak RSS grew with the number of passes; without them it does
    # not. The loaders parallelise their maps themselves; the prefetch is explicit.
    options.experimental_optimization.apply_default_optimizations = False
    stream = stream.take(count).apply(tf.data.experimental.assert_cardinality(count))
    return stream.prefetch(tf.data.AUTOTUNE).with_options(options)


EPOCH_LOGS = "epoch_logs.json"  # in checkpoints/: each epoch's final metrics


class RunState:
    """The checkpointed state of a run: model, optimizer, epoch and micro-batches done in it."""

    def __init__(self, model, run_dir, chief, max_to_keep=2, extra=None):
        self.epoch = tf.Variable(0, dtype="int64", trainable=False)
        self.micro_batch = tf.Variable(0, dtype="int64", trainable=False)
        # extra: more state by name (the accumulation schedule's stages, when the run has one).
        self._parts = dict(
            model=model,
            optimizer=model.optimizer,
            epoch=self.epoch,
            micro_batch=self.micro_batch,
            **(extra or {}),
        )
        # The seed generators' states, which a checkpoint of the model alone does not reach
        # (gacli.engine.random_state): a resumed run draws the dropout masks and noise the
        # uninterrupted one would.
        self.random_state = random_state(model)
        self._draws = bool(self.random_state["layers"])
        self.checkpoint = tf.train.Checkpoint(**self._parts, random_state=self.random_state)
        self.run_dir = run_dir
        self.directory = os.path.join(run_dir, CHECKPOINT_DIR)
        self.chief = chief
        self.max_to_keep = max_to_keep
        self._scratch = None if chief else tempfile.mkdtemp(prefix="gacli-worker-")
        self._manager = None  # made on the first save, after restore() has set the folder right
        # Called with no argument after each save: loggers that send only what a checkpoint
        # holds (gacli.runner.reporting.mlflow_run), so that a resumed run logs no update twice.
        self.after_save = []

    @property
    def manager(self):
        if self._manager is None:
            self._manager = tf.train.CheckpointManager(
                self.checkpoint,
                self.directory if self.chief else self._scratch,
                max_to_keep=self.max_to_keep,
            )
        return self._manager

    def restore(self, warn=print):
        """Load the newest checkpoint that reads back whole: (epoch, micro-batch) to go on from,
        or None when the run has no checkpoint at all.

        Checkpoints are tried newest first, each read in full (every tensor, with its checksum)
        before anything is restored from it. The damaged ones are named through ``warn`` and moved
        to ``checkpoints/damaged-<time>/``. The ``checkpoint`` file is not trusted (a garbled or
        stale one is rewritten). When checkpoints exist but none reads back, ConfigError: the run
        is never started again from scratch over them.
        """
        numbers = checkpoint_numbers(self.run_dir)
        if not numbers:
            return None
        damaged = []
        for number in numbers:
            prefix = os.path.join(self.directory, f"ckpt-{number}")
            problem = checkpoint_damage(prefix)
            if problem is None:
                break
            damaged.append((prefix, problem))
        else:
            listed = "; ".join(f"{os.path.basename(p)}: {problem}" for p, problem in damaged[:3])
            raise ConfigError(
                f"resume: none of the {len(damaged)} checkpoints in {self.directory} can be read "
                f"({listed}). The run cannot be continued; start it again without resume= (a new "
                "directory), or restore the checkpoints folder from a backup."
            )
        # Checked before restoring: a refused restore would leave TensorFlow's notice of values
        # left unrestored to be logged after the message, when the process ends.
        changed = _changed_model(prefix, self._parts["model"].trainable_variables)
        if changed is not None:
            raise ConfigError(_changed_model_message(prefix, changed))
        try:
            self._restore_from(prefix, warn)
        except ValueError as error:  # the model's code changed in a way not checked above
            raise ConfigError(_changed_model_message(prefix, first_line(error))) from None
        if self.chief:
            self._set_aside(damaged, warn)
            intact = [
                os.path.join(self.directory, f"ckpt-{n}") for n in sorted(numbers) if n <= number
            ]
            # TensorFlow's writer of the ``checkpoint`` file is deprecated in favour of
            # CheckpointManager, which cannot leave damaged checkpoints out of its list; its
            # deprecation notice, logged at every resume, is not for the user of ga-train.
            logger = tf.get_logger()
            level = logger.level
            logger.setLevel(logging.ERROR)
            try:
                tf.compat.v1.train.update_checkpoint_state(
                    self.directory, prefix, all_model_checkpoint_paths=intact
                )
            finally:
                logger.setLevel(level)
        else:  # the chief sets the damaged ones aside; the other workers only skip them
            for path, problem in damaged:
                warn(f"resume: {os.path.basename(path)} is damaged ({problem}); skipped")
        return int(self.epoch.numpy()), int(self.micro_batch.numpy())

    def _restore_from(self, prefix, warn):
        """Everything the checkpoint ``prefix`` holds. One written by an earlier gacli, which did
        not keep the random state, restores without it, with a warning if the model draws."""
        if any(name.startswith("random_state/") for name, _ in tf.train.list_variables(prefix)):
            self.checkpoint.restore(prefix).assert_existing_objects_matched()
            return
        older = tf.train.Checkpoint(**self._parts)
        older.restore(prefix).assert_existing_objects_matched()
        # The checkpoints' numbering goes on from the restored count, as after a full restore.
        self.checkpoint.save_counter.assign(older.save_counter)
        if self._draws:
            warn(
                f"resume: {os.path.basename(prefix)} was written without the state of the "
                "model's random layers (Dropout, noise, random augmentation): they draw from "
                "their first numbers again, so the resumed run will not end at the weights of an "
                "uninterrupted one. Its checkpoints from now on hold that state."
            )

    def _set_aside(self, damaged, warn):
        if not damaged:
            return
        aside = os.path.join(self.directory, time.strftime("damaged-%Y%m%d-%H%M%S"))
        os.makedirs(aside, exist_ok=True)
        for prefix, problem in damaged:
            for path in glob.glob(glob.escape(prefix) + ".*"):
                shutil.move(path, os.path.join(aside, os.path.basename(path)))
            warn(f"resume: {os.path.basename(prefix)} is damaged ({problem}); moved to {aside}")

    def latest(self):
        """The newest checkpoint of the run so far (its path prefix), or None."""
        numbers = checkpoint_numbers(self.run_dir)
        return os.path.join(self.directory, f"ckpt-{numbers[0]}") if numbers else None

    def save(self, epoch, micro_batch, logs=None):
        """A checkpoint at (epoch, micro-batches done in it); ``logs``: the metrics of the epoch
        that ended there, kept beside it for a run resumed with nothing left to train."""
        if logs is not None and self.chief:
            kept = self.epoch_logs()
            kept[str(epoch)] = {key: float(value) for key, value in logs.items()}
            write_json(os.path.join(self.directory, EPOCH_LOGS), kept)
        self.epoch.assign(epoch)
        self.micro_batch.assign(micro_batch)
        saved = self.manager.save()
        for listener in self.after_save:
            listener()
        return saved

    def epoch_logs(self, epochs_done=None):
        """The metrics kept at epoch ends, epochs done (a string) -> {name: value}; with
        ``epochs_done``, that epoch's metrics only ({} when none were kept)."""
        try:
            kept = read_json(os.path.join(self.run_dir, CHECKPOINT_DIR, EPOCH_LOGS))
        except (OSError, ValueError, RecursionError):  # unreadable: as if none were kept
            kept = None
        kept = kept if isinstance(kept, dict) else {}
        # Only what save() writes: epochs' metrics as finite floats. A damaged or edited file
        # (text, NaN, an integer of hundreds of digits) would end a resumed run in its result.
        kept = {
            epoch: {name: float(value) for name, value in logs.items() if _finite_number(value)}
            for epoch, logs in kept.items()
            if isinstance(logs, dict)
        }
        return kept if epochs_done is None else dict(kept.get(str(epochs_done), {}))

    def close(self):
        if self._scratch:
            shutil.rmtree(self._scratch, ignore_errors=True)


def _finite_number(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _changed_model(prefix, variables):
    """How the model's trainable ``variables`` (built now) differ from those the checkpoint
    ``prefix`` holds, in shape or number; None where they do not, or the checkpoint does not
    say (its optimizer keeps the variables it updates, in the model's order)."""
    saved = {}
    for name, shape in tf.train.list_variables(prefix):
        found = re.fullmatch(
            r"optimizer/_trainable_variables/(\d+)/\.ATTRIBUTES/VARIABLE_VALUE", name
        )
        if found:
            saved[int(found[1])] = tuple(shape)
    if not saved:
        return None
    for index, variable in enumerate(variables):
        if index in saved and saved[index] != tuple(variable.shape):
            name = getattr(variable, "path", variable.name)
            return (
                f"its variable {name} has shape {tuple(variable.shape)} in the model built now "
                f"and {saved[index]} in the checkpoint"
            )
    if len(saved) != len(variables):
        return (
            f"the model built now has {len(variables)} trainable variables and the checkpoint "
            f"{len(saved)}"
        )
    return None


def _changed_model_message(prefix, difference):
    return (
        f"resume: the model built now does not fit the checkpoint {os.path.basename(prefix)}: "
        f"{difference}. The code that builds the model (or its settings) changed since the run "
        "began; restore it as it was to continue this run, or start a new run without resume= "
        "for the changed model."
    )


def checkpoint_damage(prefix):
    """None when checkpoint ``prefix`` reads back whole, else what is wrong with it (one line)."""
    if not looks_intact(prefix):
        return "its index or data files are missing or cut short"
    try:
        reader = tf.train.load_checkpoint(prefix)
        for name in reader.get_variable_to_shape_map():
            reader.get_tensor(name)  # reads the bytes and checks their checksum
    except (tf.errors.OpError, IndexError, ValueError, OSError) as error:
        return str(error).strip().splitlines()[0][:200]
    return None


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


def weights_fingerprint(model):
    """The first 16 hex digits of the sha256 of ``model``'s weights: equal on every worker of a
    run, and across runs that trained the same way."""
    return hashlib.sha256(
        b"".join(np.ascontiguousarray(weight).tobytes() for weight in model.get_weights())
    ).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class EpochEnd:
    """The state at one epoch's end: the epoch (from 0), the weights' fingerprint, the updates
    applied so far and the epoch's metrics."""

    epoch: int
    fingerprint: str
    optimizer_step: int
    logs: dict


class EpochWeights(keras.callbacks.Callback):
    """Which epoch's end the weights a run ends with are from, where a callback set them back to
    an earlier epoch's (``keras.callbacks.EarlyStopping(restore_best_weights=True)`` sets its best
    epoch's at the end of fit()): the weights' fingerprint, the updates and the metrics at each
    epoch end. It reads every weight once an epoch, so a run has it only with callbacks of the
    user's own.

    Args:
        accumulator: the run's GradientAccumulateOptimizer, which counts the updates.

    Example:
        >>> recorder = EpochWeights(accumulator)  # before the user's callbacks in fit()
        >>> recorder.set_back_to(weights_fingerprint(model))  # after fit(): an EpochEnd or None
    """

    def __init__(self, accumulator):
        super().__init__()
        self.accumulator = accumulator
        self.ends = []  # EpochEnd of each epoch this process trained, in order

    def on_epoch_end(self, epoch, logs=None):
        logs = {name: float(value) for name, value in (logs or {}).items()}
        step = int(self.accumulator.optimizer_step.numpy())
        self.ends.append(EpochEnd(epoch, weights_fingerprint(self.model), step, logs))

    def set_back_to(self, fingerprint):
        """The latest EpochEnd whose weights have ``fingerprint``, where the last epoch end's do
        not (a callback set the weights back); None where they are the last epoch's, or none."""
        if not self.ends or self.ends[-1].fingerprint == fingerprint:
            return None
        return next((end for end in reversed(self.ends) if end.fingerprint == fingerprint), None)


class OneTraining(keras.callbacks.Callback):
    """The user's callbacks, told of one training where a run is several fit() calls (one per
    epoch where a compiled call would run past an epoch's end, or accum_steps may change; a
    resumed epoch's own): ``on_train_begin`` at the first call's start, ``on_train_end`` at the
    last call's end, and every other event as it comes. So a callback that keeps state over
    epochs (EarlyStopping's patience, its best epoch and weights) keeps it over the whole run.

    Args:
        callbacks: the user's callbacks, called in this order.

    Example:
        >>> user = OneTraining(callbacks)
        >>> user.last = True  # before the run's last fit(); or after one a callback stopped:
        >>> user.on_train_end()
    """

    def __init__(self, callbacks):
        super().__init__()
        self.callbacks = list(callbacks)
        self.last = True  # whether the fit() that runs next is the run's last
        self._begun = False

    def set_model(self, model):
        super().set_model(model)
        for callback in self.callbacks:
            callback.set_model(model)

    def set_params(self, params):
        super().set_params(params)
        for callback in self.callbacks:
            callback.set_params(params)

    def on_train_begin(self, logs=None):
        if not self._begun:
            self._begun = True
            self._tell("on_train_begin", logs=logs)

    def on_train_end(self, logs=None):
        if self.last:
            self._tell("on_train_end", logs=logs)

    def _tell(self, event, *arguments, **keywords):
        for callback in self.callbacks:
            getattr(callback, event)(*arguments, **keywords)


def _passed_on(event):
    def hook(self, *arguments, **keywords):
        self._tell(event, *arguments, **keywords)

    hook.__name__ = event
    return hook


# fit() calls these hooks on each callback; a Callback's own on_train_batch_* call its legacy
# on_batch_* aliases, so those are not passed on a second time.
for _event in (
    "on_epoch_begin",
    "on_epoch_end",
    "on_train_batch_begin",
    "on_train_batch_end",
    "on_test_begin",
    "on_test_end",
    "on_test_batch_begin",
    "on_test_batch_end",
    "on_predict_begin",
    "on_predict_end",
    "on_predict_batch_begin",
    "on_predict_batch_end",
):
    setattr(OneTraining, _event, _passed_on(_event))


class RunCheckpoint(keras.callbacks.Callback):
    """Checkpoints at epoch ends and every ``every_updates`` updates; stops on a signal.

    Keeps the run's position: ``epoch`` and the micro-batches done in it, counted from the
    ``offset`` at which a resumed epoch started.
    """

    def __init__(
        self,
        state,
        accumulator,
        signals,
        resume_hint,
        every_updates=0,
        save=True,
        multi_worker=False,
    ):
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
            due = int(self.accumulator.after_call("optimizer_step")) // self.every_updates
            if due > self._saves_due:
                self._saves_due = due
                self.state.save(self.epoch, self.done)

    def on_epoch_end(self, epoch, logs=None):
        self.offset = 0
        if self.save:
            self.state.save(epoch + 1, 0, logs=logs)
        if self.signals.received is not None:
            self._stop(f"the end of epoch {epoch + 1}", saved=self.save)

    def _stop(self, where=None, saved=False):
        name = signal.Signals(self.signals.received).name
        where = where or f"epoch {self.epoch + 1}, micro-batch {self.done}"
        if self.multi_worker or not self.save:
            message = (
                f"stopped by {name} at {where} without a new checkpoint"
                + (" (several workers)" if self.multi_worker else "")
                + ". "
            )
        else:
            if not saved:
                self.state.save(self.epoch, self.done)
            message = f"stopped by {name} at {where}; checkpoint saved. "
        raise Interrupted(message + self.resume_hint, 128 + self.signals.received)
