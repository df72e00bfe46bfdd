"""TensorBoard logging of a run, stepped by optimizer update.

Tags: ``batch/{effective_size,micro_size,accum_steps,replicas}`` (the configuration),
``batch/update_samples`` (the samples the update was taken over), ``train/<metric>``,
``val/<metric>``, ``optimizer/{lr,step,micro_step}``,
``throughput/{samples_per_sec,mean_samples_per_sec}`` and ``time/first_call_seconds``
(:mod:`gacli.runner.throughput`), ``memory/{device_current_bytes,device_peak_bytes}`` (where
TensorFlow tracks device memory: GPUs; the CPU allocator reports nothing),
``memory/{host_rss_bytes,host_peak_rss_bytes}`` (:mod:`gacli.runner.memory_stats`), plus
``precision/loss_scale`` and ``precision/skipped_*`` when loss scaling is on,
``schedule/{noise_scale,accum_steps,effective_size}`` at each decision of ``accum_schedule=gns``,
and the run's hyper-parameters for TensorBoard's HParams tab.
"""

import os
import time

import keras
import tensorflow as tf
from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
from tensorboard.plugins.hparams import summary_v2 as hparams_summary
from tensorboard.plugins.scalar import metadata as scalar_metadata
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from gacli.engine.window import read_now
from gacli.runner.console import micro_batches_done
from gacli.runner.memory_stats import device_memory_bytes, host_memory_bytes
from gacli.runner.throughput import samples_per_second

_SCALAR = scalar_metadata.create_summary_metadata(display_name=None, description=None)


def _scalar_value(tag, value):
    """A TensorBoard scalar (a float32 tensor with the scalar plugin's metadata, as tf.summary
    writes it)."""
    # Built directly: tensorboard's make_tensor_proto costs 0.14 ms a scalar, a twelfth of a
    # small model's update.
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
    if isinstance(value, (tf.Variable, keras.Variable)):
        value = read_now(value)  # the learning rate's variable
    elif hasattr(value, "numpy"):
        value = value.numpy()
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


class TensorBoardLogger(keras.callbacks.Callback):
    """Writes the run's scalars once per optimizer update, and val metrics once per epoch.

    The event file is written with TensorBoard's own Python writer, one event per update holding
    all of that update's scalars: a tenth of the cost of a ``tf.summary`` op per scalar, which
    matters when updates take milliseconds. The optimizer's counter is read only once a window
    can have closed (``accum_steps`` micro-batches after the last update), not every micro-batch.

    Args:
        log_dir: where the event file goes (the run directory's ``tensorboard/``).
        plan: the run's :class:`~gacli.runner.config.BatchPlan`.
        accumulator: the run's GradientAccumulateOptimizer (counters, learning rate).
        hparams: dict of hyper-parameters for the HParams tab.
        clock: the run's :class:`~gacli.runner.throughput.TrainingClock`, placed before this
        callback
            (samples per micro-batch, training time); the progress display reads the same one.
    """

    def __init__(self, log_dir, plan, accumulator, hparams, clock):
        super().__init__()
        os.makedirs(log_dir, exist_ok=True)
        self.writer = EventFileWriter(log_dir)
        self.plan = plan
        self.accumulator = accumulator
        self.hparams = hparams
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

    def _write(self, step, values):
        self.writer.add_event(
            event_pb2.Event(
                step=int(step), wall_time=time.time(), summary=summary_pb2.Summary(value=values)
            )
        )

    def write_scalars(self, step, scalars):
        """``scalars`` ({tag: number}) at optimizer step ``step``, e.g. a schedule's decision."""
        self._write(step, [_scalar_value(tag, value) for tag, value in scalars.items()])

    def _open_window(self):
        """(micro-batches of the run, micro-batches of them in the open window)."""
        return (
            int(read_now(self.accumulator.micro_step)),
            int(read_now(self.accumulator.window_micro_steps)),
        )

    def on_train_begin(self, logs=None):
        # Called once per fit(); a resumed run's first epoch is a fit() of its own.
        if not self._started:
            self._started = True
            self.writer.add_event(
                event_pb2.Event(
                    wall_time=time.time(), summary=hparams_summary.hparams_pb(self.hparams)
                )
            )
        self._last_step = int(read_now(self.accumulator.optimizer_step))
        # A run resumed in the middle of a window has that window's micro-batches behind it.
        # (A plain model's fit() builds the optimizer in its first step: no window yet.)
        if self.accumulator.built:
            micro_step, in_window = self._open_window()
            self._window_start = micro_step - in_window
            self._micro_batches_since = in_window

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_done = 0

    def on_train_batch_end(self, batch, logs=None):
        done = micro_batches_done(batch, self.params)
        self._micro_batches_since += done - self._epoch_done
        self._epoch_done = done
        if self._micro_batches_since < self.plan.accum_steps:
            return  # no window can have closed since the last update
        step = int(read_now(self.accumulator.optimizer_step))
        if step != self._last_step:
            self._write_train(step, logs or {})

    def _plan_values(self):
        """The batch configuration's scalars, made again only when the plan changes (a proto
        costs 8 us, and they are logged every update)."""
        key = (self.plan, self.oom_recoveries)
        if self._plan_key != key:
            self._plan_key = key
            self._plan_scalars = [
                _scalar_value("batch/effective_size", self.plan.effective_batch_size),
                _scalar_value("batch/micro_size", self.plan.micro_batch_size),
                _scalar_value("batch/accum_steps", self.plan.accum_steps),
                _scalar_value("batch/replicas", self.plan.replicas),
                _scalar_value("batch/oom_recoveries", self.oom_recoveries),
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
        values = [
            *self._plan_values(),
            _scalar_value("batch/update_samples", self._update_samples(window_end)),
        ]
        for name, value in logs.items():
            number = _number(value)
            if number is None:
                continue
            if name in ("loss_scale", "skipped_micro_batches", "skipped_windows"):
                values.append(_scalar_value(f"precision/{name}", number))
            elif not name.startswith("val_"):
                values.append(_scalar_value(f"train/{name}", number))
        noise = self.accumulator.noise_scale()
        if noise is not None and noise["windows"]:
            values += [
                _scalar_value("gns/noise_scale", noise["noise_scale"]),
                _scalar_value("gns/grad_sq", noise["grad_sq"]),
                _scalar_value("gns/trace_cov", noise["trace_cov"]),
            ]
        values += [
            _scalar_value("optimizer/lr", _number(self.accumulator.learning_rate)),
            _scalar_value("optimizer/step", step),
            _scalar_value("optimizer/micro_step", micro_step),
        ]
        reading = self.clock.reading(micro_step)
        rates = {
            "throughput/samples_per_sec": samples_per_second(reading, self._last_reading),
            "throughput/mean_samples_per_sec": samples_per_second(reading),
        }
        # None until there is training time after the first call.
        values += [_scalar_value(tag, rate) for tag, rate in rates.items() if rate is not None]
        if self.clock.first_call_seconds is not None and not self._first_call_logged:
            self._first_call_logged = True
            values.append(_scalar_value("time/first_call_seconds", self.clock.first_call_seconds))
        device = device_memory_bytes()
        if device is not None:
            values += [
                _scalar_value("memory/device_current_bytes", device[0]),
                _scalar_value("memory/device_peak_bytes", device[1]),
            ]
        current, peak = host_memory_bytes()
        if current is not None:
            values.append(_scalar_value("memory/host_rss_bytes", current))
        values.append(_scalar_value("memory/host_peak_rss_bytes", peak))
        self._write(step, values)
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
            _scalar_value(f"val/{name[4:]}", number)
            for name, number in ((name, _number(value)) for name, value in (logs or {}).items())
            if name.startswith("val_") and number is not None
        ]
        if values:
            self._write(step, values)
        self.writer.flush()

    def on_train_end(self, logs=None):
        self.writer.flush()

    def close(self):
        self.writer.close()
