"""``micro_batch_size=auto``: find the micro-batch that fits the device, by training on it.

The probe runs the job's own compiled train step (forward, backward, accumulate: the step the run
will run) on real micro-batches of its training data, at growing sizes, until TensorFlow raises
``tf.errors.ResourceExhaustedError``; then it bisects between the largest size that ran and the
smallest that did not. Each size that runs is timed (samples/s, after a call that traces and
warms up) and, on a GPU or TPU, its peak device memory is read.

The choice: the largest size that ran or, with ``auto_batch.pick=fastest``, the one with the most
samples/s. After an out-of-memory error the margin is taken off the failure, not off a size that
ran: where peak device memory is measured, a size may use at most ``(1 - auto_batch.margin)`` of
the memory that the first size to fail would need (a line through the measured peaks); elsewhere
it is at most ``(1 - auto_batch.margin)`` x that size. When nothing runs out of memory (a CPU),
``pick=largest`` says so and takes the largest size within a few percent of the fastest
samples/s: the largest one is then a bound of the data, not of the device.

The probe leaves nothing behind: every variable of the model, its optimizer and
its metrics is put back as it was, so the run that follows ends with the same weights as one
given the chosen size by hand (tests/runner/plan/test_autobatch.py).
"""

import contextlib
import dataclasses
import logging
import os
import signal
import time

import numpy as np
import tensorflow as tf
from omegaconf import OmegaConf

from gacli.engine.accumulate_model import (
    set_accum_steps,
)
from gacli.errors import ConfigError, Interrupted, TrainingFailed
from gacli.rundir import (
    BATCH_PLAN_FILE,
    is_chief,
    read_json,
    write_json,
)
from gacli.runner.builders.job import build_job
from gacli.runner.config.arguments import section_arguments
from gacli.runner.config.schema import (
    PartialWindow,
    shown_name,
)
from gacli.runner.plan.batch import AutoPlan, BatchPlan
from gacli.runner.plan.job_plan import PlanSettings
from gacli.runner.plan.out_of_memory import oom_line
from gacli.runner.plan.steps import execution_steps, plan_steps
from gacli.runner.reporting.console import make_console
from gacli.runner.reporting.memory import _memory_devices


@dataclasses.dataclass
class Probe:
    """One probed micro-batch size (per replica)."""

    micro_batch_size: int
    fits: bool
    samples_per_second: float | None = None
    peak_device_bytes: int | None = None
    error: str | None = None  # the first line of the out-of-memory error

    def row(self):
        speed = f"{self.samples_per_second:,.0f}" if self.samples_per_second else ""
        memory = f"{self.peak_device_bytes / 2**20:,.0f} MiB" if self.peak_device_bytes else ""
        return f"{self.micro_batch_size:>11}  {'fits' if self.fits else 'out of memory':<13}" + (
            f"  {speed:>9}  {memory}".rstrip()
        )


# The probe's table: the columns of Probe.row().
HEADER = f"{'micro-batch':>11}  {'result':<13}  {'samples/s':>9}  peak device memory"
# Sizes within this share of the fastest samples/s count as equally fast: within the spread of
# two timed calls of the same size.
EQUALLY_FAST = 0.03


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


def _failure_bound(probes, margin):
    """The test a size must pass after an out-of-memory error: at most ``(1 - margin)`` of the
    memory the smallest failed size would need, by a line through the two largest measured peaks
    (through zero with one); without measured peaks, at most ``(1 - margin)`` x that size."""
    failed = min(size for size, probe in probes.items() if not probe.fits)
    measured = sorted(
        (size, probe.peak_device_bytes)
        for size, probe in probes.items()
        if probe.fits and probe.peak_device_bytes
    )
    if not measured:
        return lambda size: size <= (1.0 - margin) * failed
    (low, low_bytes), (high, high_bytes) = ([(0, 0)] + measured)[-2:]
    per_sample = max(0.0, (high_bytes - low_bytes) / (high - low))

    def needs(size):  # bytes
        return high_bytes + per_sample * (size - high)

    return lambda size: needs(size) <= (1.0 - margin) * needs(failed)


def choose(probes, candidates, pick, margin):
    """The chosen size, or None when not even the smallest candidate ran."""
    fitting = [size for size, probe in probes.items() if probe.fits]
    if not fitting:
        return None
    allowed = [size for size in candidates if size <= max(fitting)]
    if any(not probe.fits for probe in probes.values()):
        within = _failure_bound(probes, margin)
        allowed = [size for size in allowed if within(size)] or [min(fitting)]
    timed = [size for size in allowed if size in probes and probes[size].samples_per_second]
    if not timed:
        return max(allowed)
    fastest = max(probes[size].samples_per_second for size in timed)
    if pick == "fastest":
        return max(timed, key=lambda size: probes[size].samples_per_second)
    if any(not probe.fits for probe in probes.values()):
        return max(allowed)
    # Nothing ran out of memory: the largest size is where the data ends, not the device.
    return max(s for s in timed if probes[s].samples_per_second >= (1 - EQUALLY_FAST) * fastest)


class _SignalWhileProbing(BaseException):
    """A signal's arrival, raised by the handler wherever the probe is. A BaseException, so that
    no library between here and :func:`stop_on_signals` (OmegaConf rebuilds the exceptions it
    sees inside an attribute lookup) catches or changes it on the way."""

    def __init__(self, number):
        super().__init__(number)
        self.number = number


@contextlib.contextmanager
def stop_on_signals():
    """SIGTERM and SIGINT while probing end the run at once: nothing is trained yet, so there is
    nothing to save. :class:`~gacli.errors.Interrupted` (exit code 128 + N), marked
    ``before_training`` so that the run directory is removed."""

    def stop(number, frame):
        raise _SignalWhileProbing(number)

    previous = {}
    for number in (signal.SIGTERM, signal.SIGINT):
        try:
            previous[number] = signal.signal(number, stop)
        except ValueError:  # not the main thread: leave signals alone
            pass
    try:
        yield
    except _SignalWhileProbing as arrived:
        error = Interrupted(
            f"stopped by {signal.Signals(arrived.number).name} while micro_batch_size=auto was "
            "probing micro-batch sizes: nothing was trained, and the run directory is removed. "
            "Run the same command again to start over.",
            128 + arrived.number,
        )
        error.before_training = True
        raise error from None
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def find_micro_batch_size(model, strategy, train, candidates, settings, hooks):
    """(chosen size or None, probes by size): the probe of ``model`` (compiled, its optimizer
    built) on ``train`` (unbatched samples) over ``candidates`` (sorted sizes); ``settings``:
    the run's ``auto_batch`` config; ``hooks.prepare(size)`` sets the model up for a size (its
    accum_steps and steps_per_execution) and makes its train function, ``hooks.finished(probe)``
    shows each probe as it finishes. Every variable is put back after each size."""
    snapshot = VariableSnapshot(model)

    def run_one(size):
        hooks.prepare(size)
        try:
            probe = probe_size(model, strategy, train, size, settings.timed_calls)
        finally:
            snapshot.restore()
        hooks.finished(probe)
        return probe

    # Every size is a new trace by design: TensorFlow's retracing warning says nothing here.
    tf_logger = logging.getLogger("tensorflow")
    level = tf_logger.level
    tf_logger.setLevel(logging.ERROR)
    try:
        with stop_on_signals():
            probes = search(run_one, candidates)
    finally:
        tf_logger.setLevel(level)
    return choose(probes, candidates, settings.pick.value, settings.margin), probes


def probe_lines(chosen, probes, settings, bounds=()):
    """The start-up panel's account of the probe: the choice, why, the bounds put on the sizes
    before probing, then the table."""
    failed = [size for size, probe in probes.items() if not probe.fits]
    measured = any(probe.peak_device_bytes for probe in probes.values())
    if settings.pick.value == "fastest":
        why = "the fastest that fits"
    elif not failed:
        why = (
            f"nothing ran out of memory, so the largest size within {EQUALLY_FAST:.0%} of the "
            "fastest samples/s"
        )
    else:
        why = "the largest that fits"
    if failed:
        share = f"{1 - settings.margin:.0%}"
        why += (
            f", using at most {share} of the memory the first size that failed ({min(failed)}) "
            "would need"
            if measured
            else f", at most {share} of the first size that failed ({min(failed)})"
        )
    return [
        f"{chosen} (micro_batch_size=auto: {why})",
        *bounds,
        HEADER,
        *(p.row() for p in probes.values()),
    ]


def probe_key(cfg, data, strategy):
    """What the probe's answer depends on: model, input shape, precision and devices."""
    devices = [
        tf.config.experimental.get_device_details(device).get("device_name", device.name)
        for device in tf.config.list_physical_devices()
        if device.device_type != "CPU"
    ] or ["CPU"]
    return {
        "model": section_arguments(cfg.model, "model"),
        "input_shape": {name: list(shape) for name, shape in data.input_shape.items()}
        if isinstance(data.input_shape, dict)
        else list(data.input_shape),
        "precision": cfg.precision.policy.value,
        "devices": devices,
        "replicas": strategy.num_replicas_in_sync,
    }


class BatchPlanFile:
    """``batch_plan.json`` in the run directory: the micro-batch a run chose
    (``micro_batch_size=auto``'s probe, or ``oom=recover`` after an out-of-memory error), so that
    a resumed run keeps it and the checkpoints count micro-batches of that size. Only the chief
    writes it.

    Args:
        run_dir: the run directory.
    """

    def __init__(self, run_dir):
        self.path = os.path.join(run_dir, BATCH_PLAN_FILE)

    def read(self):
        """The record, or None when the run chose no micro-batch of its own."""
        return read_json(self.path)

    def write(self, record):
        if is_chief():
            write_json(self.path, record)

    @staticmethod
    def record(plan, why, **more):
        """What the file holds for ``plan``, chosen because of ``why``."""
        return {
            "micro_batch_size": plan.micro_batch_size,
            "accum_steps": plan.accum_steps,
            "replicas": plan.replicas,
            "effective_batch_size": plan.effective_batch_size,
            "why": why,
            **more,
        }


def settle_plan(cfg, plan, data, strategy, run_dir, announce=None):
    """(the run's BatchPlan, start-up panel lines on how it was chosen).

    A run that chose its micro-batch before (``micro_batch_size=auto``'s probe, or ``oom=recover``
    after an out-of-memory error) keeps that choice when it resumes: ``batch_plan.json`` in the run
    directory holds it, and the checkpoints count micro-batches of that size."""
    plan_file = BatchPlanFile(run_dir)
    saved = plan_file.read()
    if saved is not None and cfg.resume:
        kept = BatchPlan(saved["micro_batch_size"], saved["accum_steps"], saved["replicas"])
        if kept.replicas == plan.replicas:
            return kept, {"micro-batch": f"{kept.micro_batch_size}, as before ({saved['why']})"}
    if not isinstance(plan, AutoPlan):
        return plan, {}
    candidates, bounds = auto_candidates(cfg, plan, data.train_size)
    first = plan.with_micro_batch_size(candidates[-1])
    # Without XLA: an out-of-memory error inside an XLA program leaves the variables unusable
    # (see _stop_for_resume). XLA's fused step usually needs less memory than this one.
    probed = OmegaConf.merge(cfg, {"jit_compile": False})
    steps = plan_steps(PlanSettings.of(cfg), first, data.train_size)
    job = build_job(probed, first, data, steps, strategy)
    micro, probes = find_micro_batch_size(
        job.model,
        strategy,
        data.train,
        candidates,
        cfg.auto_batch,
        ProbeHooks(cfg, plan, job, announce),
    )
    if micro is None:
        raise TrainingFailed(
            f"micro_batch_size=auto: not even a micro-batch of {candidates[0]} fits the device "
            f"({probes[candidates[0]].error}). Use a smaller model or input, or "
            "precision=mixed_float16 (half the activation memory)."
        )
    chosen = plan.with_micro_batch_size(micro)
    why = f"micro_batch_size=auto, pick={cfg.auto_batch.pick.value}"
    record = {
        **plan_file.record(chosen, why),
        "key": probe_key(cfg, data, strategy),
        "probes": [dataclasses.asdict(probe) for probe in probes.values()],
    }
    plan_file.write(record)
    return chosen, {"micro-batch": "\n".join(probe_lines(micro, probes, cfg.auto_batch, bounds))}


def auto_candidates(cfg, plan, train_size):
    """(the sizes ``micro_batch_size=auto`` may probe, smallest first; lines on the bounds put on
    them): never more than the run can use, checked before anything is probed."""
    _check_auto_fits_data(cfg, plan, train_size)
    largest = train_size // plan.replicas
    bounds = []
    if plan.effective_batch_size is None:  # accum_steps kept: the effective batch follows
        largest //= plan.accum_steps  # and stays within the training set
        bounds.append(
            f"sizes up to {largest}: {train_size} training samples / accum_steps "
            f"{plan.accum_steps}" + (f" / {plan.replicas} replicas" if plan.replicas > 1 else "")
        )
    if cfg.auto_batch.max_micro_batch_size and cfg.auto_batch.max_micro_batch_size < largest:
        largest = cfg.auto_batch.max_micro_batch_size
        bounds.append(f"sizes up to {largest}: auto_batch.max_micro_batch_size")
    candidates = plan.candidates(largest)
    keeps_two = [size for size in candidates if plan.with_micro_batch_size(size).accum_steps >= 2]
    if cfg.monitor.gns and plan.replicas == 1 and plan.effective_batch_size and keeps_two:
        # The noise scale needs two micro-batches in a window (README, "How big should my batch
        # be?"): with one replica, accum_steps >= 2.
        candidates = keeps_two
        bounds.append(
            f"sizes up to {candidates[-1]}: monitor.gns needs two or more micro-batches per window"
        )
    return candidates, bounds


def _check_auto_fits_data(cfg, plan, train_size):
    """ConfigError, before probing, when no micro-batch could give the run its batch within the
    training set."""
    spans_passes = cfg.steps_per_epoch is not None or cfg.partial_window == PartialWindow.carry
    effective = plan.effective_batch_size
    if effective is not None and effective > train_size and not spans_passes:
        raise ConfigError(
            f"effective_batch_size = {effective} is larger than the training set, which holds "
            f"{train_size} samples (dataset {shown_name(cfg.dataset)}, after validation_split="
            f"{cfg.dataset.validation_split}), so no micro-batch that micro_batch_size=auto "
            f"could find would do: every update would see {train_size} samples. Use "
            f"effective_batch_size={train_size // plan.replicas * plan.replicas} or less, or more "
            "data; or let windows run across passes with partial_window=carry."
        )
    if effective is None and plan.accum_steps * plan.replicas > train_size:
        raise ConfigError(
            f"accum_steps = {plan.accum_steps} (x {plan.replicas} replicas) is larger than the "
            f"training set, which holds {train_size} samples, so even micro-batches of 1 would "
            f"make updates larger than the data. Use accum_steps={train_size // plan.replicas} "
            "or less, or give effective_batch_size= instead."
        )


class ProbeHooks:
    """What ``micro_batch_size=auto``'s search calls around each size: the model set up for it,
    and a line on the terminal as it finishes (the search can take minutes).

    Args:
        cfg: the run's config.
        plan: the :class:`AutoPlan` the sizes complete.
        job: the :class:`Job` built for the probe.
        announce: prints the run directory before the first size is probed (None: nothing).
    """

    def __init__(self, cfg, plan, job, announce=None):
        self.cfg = cfg
        self.plan = plan
        self.job = job
        self.announce = announce
        self.console = make_console()
        self.started = False

    def prepare(self, size):
        if not self.started:
            if self.announce is not None:
                self.announce()
            self.console.print(
                "micro_batch_size=auto: probing micro-batch sizes (each trains a few compiled "
                "calls)\n" + HEADER,
                soft_wrap=True,
            )
            self.started = True
        sized = self.plan.with_micro_batch_size(size)
        spe = execution_steps(PlanSettings.of(self.cfg), sized, self.job.wrapper)
        set_accum_steps(self.job.model, sized.accum_steps, spe)

    def finished(self, probe):
        self.console.print(probe.row(), soft_wrap=True)
