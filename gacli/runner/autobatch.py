"""``micro_batch_size=auto``: find the micro-batch that fits the device, by training on it.

The probe runs the job's own compiled train step (forward, backward, accumulate: the step the run
will run) on real micro-batches of its training data, at growing sizes, until TensorFlow raises
``tf.errors.ResourceExhaustedError``; then it bisects between the largest size that ran and the
smallest that did not. Each size that runs is timed (samples/s, after a call that traces and
warms up) and, on a GPU or TPU, its peak device memory is read.

The choice: the largest size that ran or, with ``auto_batch.pick=fastest``, the one with the most
samples/s. After an out-of-memory error it is at most ``(1 - auto_batch.margin)`` x the largest
size that ran. The probe leaves nothing behind: every variable of the model, its optimizer and
its metrics is put back as it was, so the run that follows ends with the same weights as one
given the chosen size by hand (tests/test_autobatch.py).
"""

import dataclasses
import logging
import time

import numpy as np
import tensorflow as tf
from omegaconf import OmegaConf

from gacli.runner.memory_stats import _memory_devices
from gacli.runner.oom import oom_line


@dataclasses.dataclass
class Probe:
    """One probed micro-batch size (per replica)."""

    micro_batch_size: int
    fits: bool
    samples_per_second: float | None = None
    peak_device_bytes: int | None = None
    error: str | None = None  # the first line of the out-of-memory error

    def row(self):
        speed = f"{self.samples_per_second:,.0f}/s" if self.samples_per_second else ""
        memory = f"{self.peak_device_bytes / 2**20:,.0f} MiB" if self.peak_device_bytes else ""
        return f"{self.micro_batch_size:>6}  {'fits' if self.fits else 'out of memory':<13}" + (
            f"  {speed:>10}  {memory}".rstrip()
        )


class VariableSnapshot:
    """Host copies of every variable of a compiled model: weights, statistics, random-seed state,
    the optimizer's (the accumulation state included) and the metrics'."""

    def __init__(self, model):
        self.variables = [
            *model.variables,
            *model.optimizer.variables,
            *model.metrics_variables,
        ]
        self.values = [variable.numpy() for variable in self.variables]

    def restore(self):
        for variable, value in zip(self.variables, self.values):
            variable.assign(value)


def ladder(candidates):
    """The sizes to try first: from the smallest candidate, each next one at least twice the last,
    and the largest candidate last."""
    sizes = [candidates[0]]
    for size in candidates[1:]:
        if size >= 2 * sizes[-1]:
            sizes.append(size)
    if sizes[-1] != candidates[-1]:
        sizes.append(candidates[-1])
    return sizes


def _peak_reset():
    for device in _memory_devices():
        try:
            tf.config.experimental.reset_memory_stats(device)
        except ValueError:
            pass


def _peak_read():
    devices = _memory_devices()
    if not devices:
        return None
    return max(tf.config.experimental.get_memory_info(device)["peak"] for device in devices)


def probe_size(model, strategy, train, micro_batch_size, timed_calls):
    """Train ``1 + timed_calls`` compiled calls on micro-batches of ``micro_batch_size`` per
    replica (the first ``micro_batch_size x replicas`` samples of ``train``, repeated);
    a :class:`Probe`."""
    global_size = micro_batch_size * strategy.num_replicas_in_sync
    batches = train.take(global_size).batch(global_size, drop_remainder=True).repeat()
    iterator = iter(strategy.experimental_distribute_dataset(batches))
    _peak_reset()
    try:
        model.train_function(iterator)  # traces, compiles and warms up
        start = time.perf_counter()
        for _ in range(timed_calls):
            logs = model.train_function(iterator)
        tf.nest.map_structure(np.asarray, logs)  # waits for the last call
        seconds = time.perf_counter() - start
    except tf.errors.ResourceExhaustedError as error:
        return Probe(micro_batch_size, fits=False, error=oom_line(error))
    samples = timed_calls * model.steps_per_execution * global_size
    return Probe(micro_batch_size, True, samples / seconds, _peak_read())


def search(run_one, candidates):
    """Probe ``candidates`` (sorted sizes) by the ladder, then bisect between the largest that ran
    and the smallest that did not; the probes, by size."""
    probes = {}
    for size in ladder(candidates):
        probes[size] = run_one(size)
        if not probes[size].fits:
            break
    fitting = [size for size, probe in probes.items() if probe.fits]
    failed = [size for size, probe in probes.items() if not probe.fits]
    if fitting and failed:
        between = [size for size in candidates if max(fitting) < size < min(failed)]
        while between:
            size = between[len(between) // 2]
            probes[size] = run_one(size)
            between = [s for s in between if (s > size if probes[size].fits else s < size)]
    return dict(sorted(probes.items()))


def choose(probes, candidates, pick, margin):
    """The chosen size, or None when not even the smallest candidate ran."""
    fitting = [size for size, probe in probes.items() if probe.fits]
    if not fitting:
        return None
    allowed = fitting
    if any(not probe.fits for probe in probes.values()):
        ceiling = (1.0 - margin) * max(fitting)
        allowed = [size for size in candidates if size <= ceiling] or [min(fitting)]
    if pick == "fastest":
        timed = [size for size in allowed if size in probes]
        if timed:
            return max(timed, key=lambda size: probes[size].samples_per_second)
    return max(allowed)


def find_micro_batch_size(model, strategy, train, candidates, settings, prepare):
    """(chosen size or None, probes by size): the probe of ``model`` (compiled, its optimizer
    built) on ``train`` (unbatched samples) over ``candidates`` (sorted sizes); ``settings``:
    the run's ``auto_batch`` config; ``prepare(size)`` sets the model up for a size (its
    accum_steps and steps_per_execution) and makes its train function. Every variable is put
    back after each size."""
    snapshot = VariableSnapshot(model)

    def run_one(size):
        prepare(size)
        try:
            return probe_size(model, strategy, train, size, settings.timed_calls)
        finally:
            snapshot.restore()

    # Every size is a new trace by design: TensorFlow's retracing warning says nothing here.
    tf_logger = logging.getLogger("tensorflow")
    level = tf_logger.level
    tf_logger.setLevel(logging.ERROR)
    try:
        probes = search(run_one, candidates)
    finally:
        tf_logger.setLevel(level)
    return choose(probes, candidates, settings.pick.value, settings.margin), probes


def probe_lines(chosen, probes, settings):
    """The start-up panel's account of the probe: the choice, then a line per size."""
    failed = [size for size, probe in probes.items() if not probe.fits]
    rule = "the fastest" if settings.pick.value == "fastest" else "the largest"
    why = (
        f"{rule} that fits, at most {1 - settings.margin:.0%} of the largest that ran"
        if failed
        else f"{rule} probed (none ran out of memory)"
    )
    return [f"{chosen} (micro_batch_size=auto: {why})", *(p.row() for p in probes.values())]


def probe_key(cfg, data, strategy):
    """What the probe's answer depends on: model, input shape, precision and devices."""
    devices = [
        tf.config.experimental.get_device_details(device).get("device_name", device.name)
        for device in tf.config.list_physical_devices()
        if device.device_type != "CPU"
    ] or ["CPU"]
    return {
        "model": cfg.model.factory or cfg.model.name,
        "model_kwargs": OmegaConf.to_container(cfg.model.kwargs, resolve=True),
        "input_shape": list(data.input_shape),
        "precision": cfg.precision.policy.value,
        "devices": devices,
        "replicas": strategy.num_replicas_in_sync,
    }
