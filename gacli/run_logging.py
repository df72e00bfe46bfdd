"""TensorBoard logging of a run, stepped by optimizer update.

Tags: ``batch/{effective_size,micro_size,accum_steps,replicas}``, ``train/<metric>``,
``val/<metric>``, ``optimizer/{lr,step,micro_step}``, ``throughput/samples_per_sec``,
``memory/{device_current_bytes,device_peak_bytes}`` (where TensorFlow tracks device memory: GPUs;
the CPU allocator reports nothing), ``memory/{host_rss_bytes,host_peak_rss_bytes}``, plus
``precision/loss_scale`` and ``precision/skipped_*`` when loss scaling is on, and the run's
hyper-parameters for TensorBoard's HParams tab.
"""

import os
import resource
import time

import keras
import tensorflow as tf


def host_memory_bytes():
    """(current RSS, peak RSS) of this process in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    try:
        with open("/proc/self/statm") as statm:
            current = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        current = peak
    return current, peak


def device_memory_bytes():
    """(current, peak) bytes of the first accelerator, or None where TF does not track it."""
    for kind in ("GPU", "TPU"):
        devices = tf.config.list_logical_devices(kind)
        if devices:
            info = tf.config.experimental.get_memory_info(devices[0].name.split("device:")[-1])
            return info["current"], info["peak"]
    return None


def _number(value):
    if hasattr(value, "numpy"):
        value = value.numpy()
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


class TensorBoardLogger(keras.callbacks.Callback):
    """Writes the run's scalars once per optimizer update, and val metrics once per epoch.

    Args:
        log_dir: where the event file goes (the run directory's ``tensorboard/``).
        plan: the run's :class:`~gacli.config.BatchPlan`.
        accumulator: the run's GradientAccumulateOptimizer (counters, learning rate).
        hparams: dict of hyper-parameters for the HParams tab.
    """

    def __init__(self, log_dir, plan, accumulator, hparams):
        super().__init__()
        self.writer = tf.summary.create_file_writer(log_dir)
        self.plan = plan
        self.accumulator = accumulator
        self.hparams = hparams
        self._last_step = 0
        self._last_time = None
        self._samples_since = 0

    def on_train_begin(self, logs=None):
        from tensorboard.plugins.hparams import api as hparams_api

        with self.writer.as_default():
            hparams_api.hparams(self.hparams)
        self._last_step = int(self.accumulator.optimizer_step.numpy())
        self._last_time = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        # Samples of this call (steps_per_execution micro-batches over all replicas; the last
        # micro-batch of an epoch may be short, which a per-update average absorbs).
        self._samples_since += self.plan.global_micro_batch_size * self.model.steps_per_execution
        step = int(self.accumulator.optimizer_step.numpy())
        if step == self._last_step:
            return  # a micro-step inside a window
        self._write_train(step, logs or {})

    def _write_train(self, step, logs):
        now = time.perf_counter()
        elapsed = max(now - self._last_time, 1e-9)
        scalar = lambda tag, value: tf.summary.scalar(tag, float(value))  # noqa: E731
        with self.writer.as_default(step=step):
            scalar("batch/effective_size", self.plan.effective_batch_size)
            scalar("batch/micro_size", self.plan.micro_batch_size)
            scalar("batch/accum_steps", self.plan.accum_steps)
            scalar("batch/replicas", self.plan.replicas)
            for name, value in logs.items():
                number = _number(value)
                if number is None:
                    continue
                if name in ("loss_scale", "skipped_micro_batches", "skipped_windows"):
                    scalar(f"precision/{name}", number)
                elif not name.startswith("val_"):
                    scalar(f"train/{name}", number)
            scalar("optimizer/lr", _number(self.accumulator.learning_rate))
            scalar("optimizer/step", step)
            scalar("optimizer/micro_step", self.accumulator.micro_step.numpy())
            scalar("throughput/samples_per_sec", self._samples_since / elapsed)
            device = device_memory_bytes()
            if device is not None:
                scalar("memory/device_current_bytes", device[0])
                scalar("memory/device_peak_bytes", device[1])
            current, peak = host_memory_bytes()
            scalar("memory/host_rss_bytes", current)
            scalar("memory/host_peak_rss_bytes", peak)
        self._last_step, self._last_time, self._samples_since = step, now, 0

    def on_epoch_end(self, epoch, logs=None):
        step = int(self.accumulator.optimizer_step.numpy())
        with self.writer.as_default(step=step):
            for name, value in (logs or {}).items():
                number = _number(value)
                if name.startswith("val_") and number is not None:
                    tf.summary.scalar(f"val/{name[4:]}", number)
        self.writer.flush()

    def on_train_end(self, logs=None):
        self.writer.flush()
        self.writer.close()
