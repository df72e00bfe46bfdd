"""The run's scalars, stepped by optimizer update, and TensorBoard's writer of them.

:class:`RunLogger` works them out once per update and hands the same (tag, number) pairs to each
writer that ``logger=`` names (:mod:`gacli.runner.reporting.writers`); :class:`TensorBoardWriter`
is the default one.

Tags: ``batch/{effective_size,micro_size,accum_steps,replicas,recompute}`` (the configuration;
``recompute`` is 1 where activations are recomputed),
``batch/update_samples`` (the samples the update was taken over), ``train/<metric>``,
``val/<metric>``, ``optimizer/{lr,step,micro_step}``,
``throughput/{samples_per_sec,mean_samples_per_sec}`` and ``time/first_call_seconds``
(:mod:`gacli.runner.reporting.throughput`), ``memory/{device_current_bytes,device_peak_bytes}``
(where TensorFlow tracks device memory: GPUs; the CPU allocator reports nothing),
``memory/{host_rss_bytes,host_peak_rss_bytes}`` (:mod:`gacli.runner.reporting.memory`), plus
``precision/loss_scale`` and ``precision/skipped_*`` when loss scaling is on,
``schedule/{noise_scale,accum_steps,effective_size}`` at each decision of ``accum_schedule=gns``,
and the run's hyper-parameters for TensorBoard's HParams tab.

Every cost here is paid on the training thread, between compiled calls, once an update: the
counters come from the call's own logs where the model wrapper returns them (no op after the
call), an update's event is a kept one whose numbers are set (:class:`UpdateEvents`), and the
file is written by TensorFlow's record writer (:class:`EventFile`). A thread of its own to write
the events made training slower on a 2-core CPU, not faster: its Python competed with the compiled
call for the cores and the interpreter's lock.
"""

import itertools
import os
import socket
import time

import keras
import tensorflow as tf
from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
from tensorboard.plugins.hparams import summary_v2 as hparams_summary
from tensorboard.plugins.scalar import metadata as scalar_metadata

from gacli.engine.window import read_now
from gacli.runner.reporting.console import micro_batches_done
from gacli.runner.reporting.memory import device_memory_bytes, host_memory_bytes
from gacli.runner.reporting.throughput import samples_per_second
from gacli.runner.reporting.writers import CSV_FILE, ScalarWriter, logger_names

_SCALAR = scalar_metadata.create_summary_metadata(display_name=None, description=None)


def _scalar_value(tag, value):
    """A TensorBoard scalar (a float32 tensor with the scalar plugin's metadata, as tf.summary
    writes it)."""
    # Built directly: tensorboard's make_tensor_proto is general-purpose Python, paid per scalar
    # on every update of a small model.
    return summary_pb2.Summary.Value(
        tag=tag,
        metadata=_SCALAR,
        tensor=tensor_pb2.TensorProto(
            dtype=types_pb2.DT_FLOAT,
            float_val=[float(value)],
            tensor_shape=tensor_shape_pb2.TensorShapeProto(),
        ),
    )


def _number(value):
    """A log's value as a float, or None where it is not a number."""
    if hasattr(value, "numpy"):
        value = value.numpy()
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


_FILES = itertools.count()
_FLUSH_EVERY_S = 10.0  # what tf.summary's writers wait at most (flush_millis)


class EventFile:
    """A TensorBoard event file: a record file of ``Event`` protos, written by TensorFlow's record
    writer (C++: framing and checksums). TensorBoard's own Python writer computes each record's
    CRC32C in Python, on a thread that then competes with training for the interpreter's
    lock. Flushed at most every 10 s as events come, and by
    :meth:`flush`."""

    def __init__(self, log_dir):
        name = "events.out.tfevents.%010d.%s.%s.%s" % (
            time.time(),
            socket.gethostname(),
            os.getpid(),
            next(_FILES),
        )
        self.path = os.path.join(log_dir, name)
        self._records = tf.io.TFRecordWriter(self.path)
        self._flushed = time.monotonic()
        self.add_event(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))
        self.flush()

    def add_event(self, event):
        self._records.write(event.SerializeToString())
        if time.monotonic() - self._flushed > _FLUSH_EVERY_S:
            self.flush()

    def flush(self):
        self._records.flush()
        self._flushed = time.monotonic()

    def close(self):
        self._records.close()


class UpdateEvents:
    """The events of updates, each a kept event whose numbers are set, rather than the ~17
    scalar protos of an update made afresh each time in Python. An event is kept for each list
    of tags (a few: the rates and the noise scale join after the first updates)."""

    def __init__(self):
        self._kept = {}

    def event(self, step, scalars):
        """The event at ``step`` of ``scalars``, (tag, number) pairs."""
        tags = tuple(tag for tag, _ in scalars)
        kept = self._kept.get(tags)
        if kept is None:
            event = event_pb2.Event(
                summary=summary_pb2.Summary(value=[_scalar_value(tag, 0.0) for tag in tags])
            )
            kept = self._kept[tags] = (event, [v.tensor.float_val for v in event.summary.value])
        event, numbers = kept
        event.step, event.wall_time = int(step), time.time()
        for number, (_, value) in zip(numbers, scalars):
            number[0] = float(value)
        return event


def _memory_scalars():
    """(tag, bytes) of device memory (where TensorFlow tracks it) and host memory, read now."""
    scalars = []
    device = device_memory_bytes()
    if device is not None:
        scalars += [
            ("memory/device_current_bytes", device[0]),
            ("memory/device_peak_bytes", device[1]),
        ]
    current, peak = host_memory_bytes()
    if current is not None:
        scalars.append(("memory/host_rss_bytes", current))
    scalars.append(("memory/host_peak_rss_bytes", peak))
    return scalars


class TensorBoardWriter(ScalarWriter):
    """The run's event file under ``tensorboard/`` (``logger=[tensorboard]``, the default), with
    the run's hyper-parameters for TensorBoard's HParams tab, written when training starts.

    Args:
        log_dir: where the event file goes (the run directory's ``tensorboard/``).
        hparams: dict of hyper-parameters for the HParams tab.
    """

    def __init__(self, log_dir, hparams):
        os.makedirs(log_dir, exist_ok=True)
        self.file = EventFile(log_dir)
        self.hparams = hparams
        self._events = UpdateEvents()

    def start(self, step):
        self.file.add_event(
            event_pb2.Event(wall_time=time.time(), summary=hparams_summary.hparams_pb(self.hparams))
        )

    def write(self, step, scalars):
        self.file.add_event(self._events.event(step, scalars))

    def flush(self):
        self.file.flush()

    def close(self):
        self.file.close()


class RunLogger(keras.callbacks.Callback):
    """Works out the run's scalars once per optimizer update, and val metrics once per epoch,
    and writes them to each of ``writers``: the one list of what a run logs.

    One write per update holds all of that update's scalars, from Python (cheaper than a
    ``tf.summary`` op per scalar, which matters when updates take milliseconds). The
    optimizer's counter is looked at only once a window can have closed (``accum_steps``
    micro-batches after the last update), not every micro-batch.

    Args:
        writers: the :class:`~gacli.runner.reporting.writers.ScalarWriter` of each logger (e.g. a
            :class:`TensorBoardWriter`), from :func:`open_writers`.
        plan: the run's :class:`~gacli.runner.plan.batch.BatchPlan`.
        accumulator: the run's GradientAccumulateOptimizer (counters, learning rate).
        clock: the run's :class:`~gacli.runner.reporting.throughput.TrainingClock`, placed before
        this callback (samples per micro-batch, training time); the progress display reads the
            same one.

    Example:
        >>> logger = RunLogger([TensorBoardWriter("run/tensorboard", {})], plan, accumulator, clock)
    """

    def __init__(self, writers, plan, accumulator, clock):
        super().__init__()
        self.writers = list(writers)
        self.plan = plan
        self.accumulator = accumulator
        self.clock = clock
        self._started = False
        self._last_step = 0
        self._last_reading = (0, 0.0)
        self._first_call_logged = False
        # Micro-batches of the run before the open window: where the last window closed (applied,
        # skipped or dropped).
        self._window_start = 0
        self._micro_batches_since = 0
        self._epoch_done = 0
        self.oom_recoveries = 0
        self._plan_key, self._plan_scalars = None, []

    def replan(self, plan, recoveries):
        """The batch arithmetic after an out-of-memory recovery (``oom=recover``)."""
        self.plan, self.oom_recoveries = plan, recoveries

    def _write(self, step, scalars):
        """(tag, number) pairs at optimizer update ``step``, to every writer."""
        self._start()
        for writer in self.writers:
            writer.write(step, scalars)

    def write_scalars(self, step, scalars):
        """``scalars`` ({tag: number}) at optimizer step ``step``, e.g. a schedule's decision."""
        self._write(step, list(scalars.items()))

    def _start(self):
        """The writers told where the job starts, once: at its first fit(), or at a schedule's
        decision just before it (after a resumed run's restore, both)."""
        if not self._started:
            self._started = True
            for writer in self.writers:
                writer.start(int(read_now(self.accumulator.optimizer_step)))

    def _flush(self):
        for writer in self.writers:
            writer.flush()

    def checkpointed(self):
        """A checkpoint was saved: it holds every update logged so far
        (:class:`~gacli.runner.training.run_state.RunState` calls this after each save)."""
        for writer in self.writers:
            writer.checkpointed()

    def _open_window(self):
        """(micro-batches of the run, micro-batches of them in the open window)."""
        return (
            int(self.accumulator.after_call("micro_step")),
            int(self.accumulator.after_call("window_micro_steps")),
        )

    def on_train_begin(self, logs=None):
        # Called once per fit(); a resumed run's first epoch is a fit() of its own.
        self._start()
        self._last_step = int(read_now(self.accumulator.optimizer_step))
        # A run resumed in the middle of a window has that window's micro-batches behind it.
        # (A plain model's fit() builds the optimizer in its first step: no window yet.)
        if self.accumulator.built:
            micro_step, in_window = self._open_window()
            self._window_start = micro_step - in_window
            self._micro_batches_since = in_window

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_done = 0

    def on_test_begin(self, logs=None):
        # The file is flushed as events come, at most every 10 s: a long validation would
        # otherwise hold the last updates' events back from a live TensorBoard.
        self._flush()

    def on_train_batch_end(self, batch, logs=None):
        done = micro_batches_done(batch, self.params)
        self._micro_batches_since += done - self._epoch_done
        self._epoch_done = done
        if self._micro_batches_since < self.plan.accum_steps:
            return  # no window can have closed since the last update
        step = int(self.accumulator.after_call("optimizer_step"))
        if step != self._last_step:
            self._write_train(step, logs or {})

    def _plan_values(self):
        """The batch configuration's (tag, number) pairs, made again only when the plan
        changes."""
        key = (self.plan, self.oom_recoveries)
        if self._plan_key != key:
            self._plan_key = key
            self._plan_scalars = [
                ("batch/effective_size", self.plan.effective_batch_size),
                ("batch/micro_size", self.plan.micro_batch_size),
                ("batch/accum_steps", self.plan.accum_steps),
                ("batch/replicas", self.plan.replicas),
                ("batch/oom_recoveries", self.oom_recoveries),
                # 1 where activations are recomputed (remat, set or chosen by the probe)
                ("batch/recompute", 0.0 if getattr(self.plan, "remat", None) is None else 1.0),
            ]
        return self._plan_scalars

    def _update_samples(self, window_end):
        """Samples in the window of the last update, which closed ``window_end`` micro-batches
        into the run.

        Windows are ``accum_steps`` micro-batches long except an epoch's last one when it is
        closed early (``partial_window=apply``, or ``carry`` at the end of training). Of the
        windows closed since ``_window_start`` (applied or skipped), only the last can be short:
        it holds what is left over. Counting from the data's layout, not from the optimizer's
        window weight, works for both wrappers: the optimizer wrapper counts calls, not samples.
        """
        length = (window_end - self._window_start - 1) % self.plan.accum_steps + 1
        return self.clock.layout.samples_in(window_end - length, window_end)

    def _write_train(self, step, logs):
        micro_step, in_window = self._open_window()
        window_end = micro_step - in_window
        numbers = [("batch/update_samples", self._update_samples(window_end))]
        for name, value in logs.items():
            number = _number(value)
            if number is None:
                continue
            if name in ("loss_scale", "skipped_micro_batches", "skipped_windows"):
                numbers.append((f"precision/{name}", number))
            elif not name.startswith("val_"):
                numbers.append((f"train/{name}", number))
        noise = self.accumulator.noise_scale()
        if noise is not None and noise["windows"]:
            numbers += [
                (f"gns/{key}", noise[key]) for key in ("noise_scale", "grad_sq", "trace_cov")
            ]
        numbers += [
            ("optimizer/lr", self.accumulator.after_call("learning_rate")),
            ("optimizer/step", step),
            ("optimizer/micro_step", micro_step),
        ]
        reading = self.clock.reading(micro_step)
        rates = {
            "throughput/samples_per_sec": samples_per_second(reading, self._last_reading),
            "throughput/mean_samples_per_sec": samples_per_second(reading),
        }
        # None until there is training time after the first call.
        numbers += [(tag, rate) for tag, rate in rates.items() if rate is not None]
        if self.clock.first_call_seconds is not None and not self._first_call_logged:
            self._first_call_logged = True
            numbers.append(("time/first_call_seconds", self.clock.first_call_seconds))
        self._write(step, [*self._plan_values(), *numbers, *_memory_scalars()])
        self._last_step, self._last_reading = step, reading
        self._window_start = window_end
        self._micro_batches_since = in_window

    def on_epoch_end(self, epoch, logs=None):
        step = int(read_now(self.accumulator.optimizer_step))
        if step != self._last_step:
            # The epoch's short window was applied at its end: its update gets its point too.
            self._write_train(
                step, {k: v for k, v in (logs or {}).items() if not k.startswith("val_")}
            )
        if self.accumulator.epoch_end_action() is not None:
            # The window was applied or dropped: the next one starts with the next epoch.
            self._window_start = int(read_now(self.accumulator.micro_step))
            self._micro_batches_since = 0
        values = [
            (f"val/{name[4:]}", number)
            for name, number in ((name, _number(value)) for name, value in (logs or {}).items())
            if name.startswith("val_") and number is not None
        ]
        if values:
            self._write(step, values)
        self._flush()

    def on_train_end(self, logs=None):
        self._flush()

    def close(self):
        """Training ended: each writer closes its files (before the result is written)."""
        for writer in self.writers:
            writer.close()

    def end(self, status, reason=None):
        """The job ended (:func:`gacli.runner.reporting.writers.ended_with_the_job`)."""
        for writer in self.writers:
            writer.end(status, reason)


def open_writers(cfg, run_dir, hparams, resolved):
    """The writers of the loggers ``cfg.logger`` names, opened: the chief's.

    Args:
        cfg: the job's config.
        run_dir: the run directory.
        hparams: what TensorBoard's HParams tab compares runs by.
        resolved: the config with the batch arithmetic (``resolved.yaml``'s content), which
            MLflow records as the run's parameters.
    """
    names = logger_names(cfg.logger)
    writers = []
    if "tensorboard" in names:
        writers.append(TensorBoardWriter(os.path.join(run_dir, "tensorboard"), hparams))
    if "csv" in names:
        from gacli.runner.reporting.csv_file import MetricsCsv

        writers.append(MetricsCsv(os.path.join(run_dir, CSV_FILE)))
    if "mlflow" in names:
        from gacli.runner.reporting.mlflow_run import MlflowRun

        writers.append(MlflowRun.open(cfg, run_dir, resolved))
    return writers
