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
import math
import os
import signal
import time

import numpy as np
import tensorflow as tf
from omegaconf import OmegaConf

from gacli.engine.accumulate_model import (
    AccumulatingModelWrapper,
    set_accum_steps,
)
from gacli.engine.remat import recompute
from gacli.errors import ConfigError, Interrupted, TrainingFailed
from gacli.rundir import (
    BATCH_PLAN_FILE,
    is_chief,
    read_json,
    write_json,
)
from gacli.runner.builders.job import build_job, run_remat
from gacli.runner.config.arguments import section_arguments
from gacli.runner.config.schema import (
    AutoRemat,
    PartialWindow,
    Wrapper,
    remat_setting,
    shown_name,
)
from gacli.runner.plan.batch import AutoPlan, BatchPlan
from gacli.runner.plan.job_plan import PlanSettings
from gacli.runner.plan.out_of_memory import oom_line
from gacli.runner.plan.steps import execution_steps, plan_steps
from gacli.runner.reporting.console import make_console
from gacli.runner.reporting.memory import (
    _memory_devices,
    host_peak_bytes,
    start_host_peak,
)


@dataclasses.dataclass
class Probe:
    """One probed micro-batch size (per replica)."""

    micro_batch_size: int
    fits: bool
    samples_per_second: float | None = None
    peak_device_bytes: int | None = None
    error: str | None = None  # the first line of the out-of-memory error
    # On a CPU: the peak of TensorFlow's CPU allocator, or of the process's resident memory
    # where the allocator keeps no statistics (see memory_kind)
    peak_cpu_bytes: int | None = None
    over_budget: bool = False  # it ran, and its peak was above auto_batch.memory_budget_mib

    @property
    def peak_bytes(self):
        """The peak compared with the memory budget: the device's, else the host's."""
        return self.peak_device_bytes or self.peak_cpu_bytes

    @property
    def out_of_memory(self):
        return not self.fits and not self.over_budget

    def row(self):
        speed = f"{self.samples_per_second:,.0f}" if self.samples_per_second else ""
        peak = self.peak_bytes
        memory = f"{peak / 2**20:,.0f} MiB" if peak is not None else ""
        result = "fits" if self.fits else "over budget" if self.over_budget else "out of memory"
        return f"{self.micro_batch_size:>11}  {result:<13}" + f"  {speed:>9}  {memory}".rstrip()


def header(memory="device"):
    """The probe's table's header: the columns of Probe.row(); ``memory``: a
    :func:`memory_kind`."""
    columns = f"{'micro-batch':>11}  {'result':<13}  {'samples/s':>9}"
    return f"{columns}  peak {memory or 'device'} memory"


# What each memory_kind() measures, in the panel's words.
MEMORY_KINDS = {
    "device": "peak device memory",
    "CPU": "peak of TensorFlow's CPU allocator",
    "host": "process's peak resident memory",
}


HEADER = header()
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


def memory_kind():
    """Where the probe reads each size's peak: ``"device"`` (GPUs and TPUs: the memory TensorFlow
    tracks there); on a CPU ``"CPU"``, the peak of TensorFlow's CPU allocator where it keeps
    statistics (builds with oneDNN, the default on x86 Linux: it counts tensors of 256 KiB and
    more, the ones a micro-batch grows; smaller ones go to malloc uncounted); else ``"host"``,
    the process's peak resident memory (Linux); None where neither can be read.

    Not the process's resident memory where the allocator can be read: TensorFlow's oneDNN
    allocator keeps the memory a step freed for the next one, so after one size the resident
    memory stays at that size's peak, and a smaller size probed later (the bisection, the probe
    with recomputation) would read it again. The allocator's peak counts what the micro-batch
    changes (weights, optimizer and accumulator state, activations, workspaces), as device
    memory does; not the runtime's own memory."""
    if _memory_devices():
        return "device"
    try:
        tf.config.experimental.reset_memory_stats("CPU:0")
        return "CPU"
    except ValueError:  # an allocator that keeps no statistics
        pass
    return "host" if start_host_peak() else None


def _cpu_peak_reset(memory):
    if memory == "CPU":
        tf.config.experimental.reset_memory_stats("CPU:0")


def _cpu_peak_read(memory):
    if memory == "CPU":
        return tf.config.experimental.get_memory_info("CPU:0")["peak"]
    return host_peak_bytes() if memory == "host" else None


@dataclasses.dataclass(frozen=True)
class ProbeTarget:
    """What the probe trains: a compiled model (its optimizer built), under its strategy, on
    ``train``, the unbatched training samples."""

    model: object
    strategy: object
    train: object


def probe_size(target, micro_batch_size, timed_calls, budget_bytes=None, memory="device"):
    """Train ``1 + timed_calls`` compiled calls of ``target``'s model on micro-batches of
    ``micro_batch_size`` per replica (the first ``micro_batch_size x replicas`` samples of its
    training data, repeated); a :class:`Probe`, over budget where its peak (``memory``: a
    :func:`memory_kind`) is above ``budget_bytes`` (None: no budget)."""
    model, strategy, train = target.model, target.strategy, target.train
    global_size = micro_batch_size * strategy.num_replicas_in_sync
    batches = train.take(global_size).batch(global_size, drop_remainder=True).repeat()
    iterator = iter(strategy.experimental_distribute_dataset(batches))
    _peak_reset()
    _cpu_peak_reset(memory)
    try:
        model.train_function(iterator)  # traces, compiles and warms up
        if memory == "host":
            # The timed calls' peak: tracing's memory is freed before the run's steps, and
            # malloc keeps what it freed unless handed back (gacli/engine/host_memory.py).
            start_host_peak()
        start = time.perf_counter()
        for _ in range(timed_calls):
            logs = model.train_function(iterator)
        tf.nest.map_structure(np.asarray, logs)  # waits for the last call
        seconds = time.perf_counter() - start
    except tf.errors.ResourceExhaustedError as error:
        return Probe(micro_batch_size, fits=False, error=oom_line(error))
    samples = timed_calls * model.steps_per_execution * global_size
    probe = Probe(
        micro_batch_size,
        True,
        samples / seconds,
        _peak_read(),
        peak_cpu_bytes=_cpu_peak_read(memory),
    )
    if budget_bytes is not None and (probe.peak_bytes or 0) > budget_bytes:
        probe.fits, probe.over_budget = False, True
    return probe


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
    (through zero with one); without measured peaks, at most ``(1 - margin)`` x that size. Only
    out-of-memory errors count: a size over the memory budget was measured against it."""
    failed = min(size for size, probe in probes.items() if probe.out_of_memory)
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


def choose(probes, candidates, pick, margin, memory_bound=False):
    """The chosen size, or None when not even the smallest candidate ran. ``memory_bound``: the
    sizes are known to be bound by memory (the probe with recomputation, after the one without
    failed), so that ``pick=largest`` takes the largest that ran even where none failed."""
    fitting = [size for size, probe in probes.items() if probe.fits]
    if not fitting:
        return None
    allowed = [size for size in candidates if size <= max(fitting)]
    if any(probe.out_of_memory for probe in probes.values()):
        within = _failure_bound(probes, margin)
        allowed = [size for size in allowed if within(size)] or [min(fitting)]
    timed = [size for size in allowed if size in probes and probes[size].samples_per_second]
    if not timed:
        return max(allowed)
    fastest = max(probes[size].samples_per_second for size in timed)
    if pick == "fastest":
        return max(timed, key=lambda size: probes[size].samples_per_second)
    if memory_bound or any(not probe.fits for probe in probes.values()):
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


def find_micro_batch_size(target, candidates, settings, hooks, memory_bound=False):
    """(chosen size or None, probes by size): the probe of ``target`` (a :class:`ProbeTarget`)
    over ``candidates`` (sorted sizes); ``settings``:
    the run's ``auto_batch`` config; ``hooks.prepare(size)`` sets the model up for a size (its
    accum_steps and steps_per_execution) and makes its train function, ``hooks.finished(probe)``
    shows each probe as it finishes, ``hooks.memory`` says where peaks are read
    (:func:`memory_kind`). Every variable is put back after each size."""
    snapshot = VariableSnapshot(target.model)
    budget = settings.memory_budget_mib
    budget_bytes = None if budget is None else budget * 2**20

    def run_one(size):
        hooks.prepare(size)
        try:
            probe = probe_size(target, size, settings.timed_calls, budget_bytes, hooks.memory)
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
    chosen = choose(probes, candidates, settings.pick.value, settings.margin, memory_bound)
    return chosen, probes


@dataclasses.dataclass
class Choice:
    """``micro_batch_size=auto``'s answer: the micro-batch, the recomputation it needs, and the
    probes behind them."""

    micro_batch_size: int | None  # None: nothing fits
    probes: dict  # size -> Probe, with the config's remat
    remat: object = None  # the recomputation chosen (None: the config's)
    plain_micro_batch_size: int | None = None  # the choice with the config's remat
    recomputed: dict = dataclasses.field(default_factory=dict)  # size -> Probe, remat=every
    untried: str | None = None  # why recomputation was not tried where it could have helped
    memory: str | None = "device"  # where the peaks were read (memory_kind())

    @property
    def chosen_probe(self):
        """The probe of the chosen size (None where it was allowed without being probed)."""
        probes = self.recomputed if self.remat is not None else self.probes
        return probes.get(self.micro_batch_size)

    def summary(self, plan, settings, lines):
        """What batch_plan.json and result.json keep of the choice: ``lines``, the panel's."""
        probe = self.chosen_probe
        plain = self.plain_micro_batch_size
        return {
            "micro_batch_size": self.micro_batch_size,
            "remat": remat_record(self.remat),
            "passes": plan.with_micro_batch_size(self.micro_batch_size).accum_steps,
            "passes_without_recomputation": (
                plan.with_micro_batch_size(plain).accum_steps if plain is not None else None
            ),
            "recomputation_tried": bool(self.recomputed),
            "peak_bytes": probe.peak_bytes if probe is not None else None,
            "memory": MEMORY_KINDS.get(self.memory),
            "memory_budget_mib": settings.memory_budget_mib,
            "why": "; ".join(lines),
        }


def remat_record(remat):
    """A ``remat`` value as JSON holds it (layer names as a list)."""
    return list(remat) if isinstance(remat, tuple) else remat


def recompute_in(model, remat):
    """Set a compiled model wrapper to recompute ``remat``'s blocks from its next train function
    on (which :func:`~gacli.engine.accumulate_model.set_accum_steps` makes); ValueError, saying
    why, where the model cannot be cut so."""
    inner = model.model if isinstance(model, AccumulatingModelWrapper) else model
    recompute(inner, remat)  # the same check of the blocks as the model wrapper's
    model.accumulation_config = model.accumulation_config.replace(remat=remat)


def _recomputation_could_help(plan, candidates, micro, probes):
    """Whether memory kept the micro-batch below the size the fewest passes need, or left no
    size at all. With accum_steps kept (no effective batch), the passes are fixed: only the
    latter."""
    if all(probe.fits for probe in probes.values()):
        return False
    if micro is None:
        return True
    if plan.effective_batch_size is None:
        return False
    fewest = plan.with_micro_batch_size(candidates[-1]).accum_steps
    return plan.with_micro_batch_size(micro).accum_steps > fewest


def _recomputation_refused(cfg, job):
    """Why recomputation is not offered (None: it is, and the model now recomputes every
    block)."""
    if cfg.auto_batch.remat == AutoRemat.off:
        return "auto_batch.remat=off"
    if job.wrapper != Wrapper.model:
        return "wrapper=optimizer does not recompute"
    try:
        recompute_in(job.model, "every")
    except ValueError as error:
        return f"the model cannot be cut into blocks: {str(error).split('; ')[0]}"
    return None


def find_plan(cfg, plan, job, target, candidates, hooks):
    """The :class:`Choice` of ``micro_batch_size=auto`` over ``candidates``: the probe with the
    config's remat and, where memory kept that below the fewest passes and recomputation is
    allowed, again with ``remat=every`` from the size it chose; the plan with fewer passes wins
    (``pick=fastest``: the faster), and on a tie the one without recomputation."""
    settings = cfg.auto_batch
    micro, probes = find_micro_batch_size(target, candidates, settings, hooks)
    choice = Choice(micro, probes, plain_micro_batch_size=micro, memory=hooks.memory)
    if remat_setting(cfg.get("remat")) is not None:
        return choice  # the probe used the user's remat as given
    if not _recomputation_could_help(plan, candidates, micro, probes):
        return choice
    choice.untried = _recomputation_refused(cfg, job)
    if choice.untried is not None:
        return choice
    hooks.recomputing()
    sizes = [size for size in candidates if size >= (micro or candidates[0])]
    again, choice.recomputed = find_micro_batch_size(
        target, sizes, settings, hooks, memory_bound=True
    )
    if again is not None and (micro is None or _better(settings, plan, choice, micro, again)):
        choice.micro_batch_size, choice.remat = again, "every"
    return choice


def _better(settings, plan, choice, plain, recomputed):
    """Whether the recomputed size beats the plain one: fewer passes, or with ``pick=fastest``
    more samples/s."""
    if settings.pick.value == "fastest":
        speed = choice.recomputed[recomputed].samples_per_second or 0.0
        return speed > (choice.probes[plain].samples_per_second or 0.0)
    passes = plan.with_micro_batch_size
    return passes(recomputed).accum_steps < passes(plain).accum_steps


def _why(probes, settings, recomputed=False):
    """Why the size was chosen among ``probes`` (``recomputed``: the probes with recomputation),
    in the panel's words."""
    failed = [size for size, probe in probes.items() if probe.out_of_memory]
    over = any(probe.over_budget for probe in probes.values())
    measured = any(probe.peak_device_bytes for probe in probes.values())
    if settings.pick.value == "fastest":
        why = "the fastest that fits"
    elif failed:
        why = "the largest that fits"
    elif over:
        why = "the largest within the memory budget"
    elif recomputed:
        why = "the largest size, which fits with recomputation"
    else:
        why = (
            f"nothing ran out of memory, so the largest size within {EQUALLY_FAST:.0%} of the "
            "fastest samples/s"
        )
    if failed:
        share = f"{1 - settings.margin:.0%}"
        why += (
            f", using at most {share} of the memory the first size that failed ({min(failed)}) "
            "would need"
            if measured
            else f", at most {share} of the first size that failed ({min(failed)})"
        )
    return why


def _passes(count):
    return f"{count} pass{'es' if count != 1 else ''}"


def choice_lines(choice, plan, settings):
    """The panel's first lines on the probe: the size, the recomputation, the passes
    (micro-batches per update) with and without it, the peak against the budget; and why (on the
    same line where there is nothing else to say)."""
    passes = _passes(plan.with_micro_batch_size(choice.micro_batch_size).accum_steps)
    plain = choice.plain_micro_batch_size
    line = f"{choice.micro_batch_size}"
    if choice.remat is not None:
        line += f" with recomputation (every block): {passes} " + (
            f"instead of {plan.with_micro_batch_size(plain).accum_steps} without"
            if plain is not None
            else "(nothing fits without)"
        )
    elif choice.recomputed:
        line += f": {passes}; with recomputation (every block) no micro-batch that needs fewer fits"
    elif choice.untried:
        line += f": {passes}; recomputation not tried ({choice.untried})"
    probe = choice.chosen_probe
    budget = settings.memory_budget_mib
    if budget is not None and probe is not None and probe.peak_bytes:
        line += f"; peak {probe.peak_bytes / 2**20:,.0f} MiB of a {budget:,} MiB budget"
    if choice.remat is not None:
        why = _why(choice.recomputed, settings, recomputed=True)
    else:
        why = _why(choice.probes, settings)
    if line == f"{choice.micro_batch_size}":
        return [f"{line} (micro_batch_size=auto: {why})"]
    return [line, f"micro_batch_size=auto: {why}"]


def probe_lines(choice, plan, settings, bounds=()):
    """The start-up panel's account of the probe: the choice, why, the bounds put on the sizes
    before probing, then the table (and the one with recomputation, where it was tried)."""
    memory = choice.memory
    lines = [*choice_lines(choice, plan, settings), *bounds]
    if choice.recomputed:
        lines.append("without recomputation:")
    lines += [header(memory), *(p.row() for p in choice.probes.values())]
    if choice.recomputed:
        lines += [
            "with recomputation (remat=every):",
            header(memory),
            *(p.row() for p in choice.recomputed.values()),
        ]
    return lines


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
            "remat": remat_record(plan.remat),
            "why": why,
            **more,
        }


def settle_plan(cfg, plan, data, strategy, run_dir, announce=None):
    """(the run's BatchPlan, start-up panel lines on how it was chosen). The plan carries the
    recomputation the run trains with (``remat``: the probe's choice, else the config's).

    A run that chose its micro-batch before (``micro_batch_size=auto``'s probe, or ``oom=recover``
    after an out-of-memory error) keeps that choice when it resumes: ``batch_plan.json`` in the run
    directory holds it, and the checkpoints count micro-batches of that size."""
    plan_file = BatchPlanFile(run_dir)
    saved = plan_file.read()
    if saved is not None and cfg.resume:
        kept = BatchPlan(
            saved["micro_batch_size"],
            saved["accum_steps"],
            saved["replicas"],
            remat_setting(saved.get("remat")),
        )
        if kept.replicas == plan.replicas:
            recomputing = (
                " with recomputation (every block)"
                if kept.remat is not None and remat_setting(cfg.get("remat")) is None
                else ""
            )
            return _with_run_remat(cfg, kept), {
                "micro-batch": f"{kept.micro_batch_size}{recomputing}, as before ({saved['why']})"
            }
    if not isinstance(plan, AutoPlan):
        return _with_run_remat(cfg, plan), {}
    candidates, bounds = auto_candidates(cfg, plan, data.train_size)
    _check_budget_measurable(cfg)
    first = plan.with_micro_batch_size(candidates[-1])
    # Without XLA: an out-of-memory error inside an XLA program leaves the variables unusable
    # (see _stop_for_resume). XLA's fused step usually needs less memory than this one.
    probed = OmegaConf.merge(cfg, {"jit_compile": False})
    steps = plan_steps(PlanSettings.of(cfg), first, data.train_size)
    job = build_job(probed, first, data, steps, strategy)
    hooks = ProbeHooks(cfg, plan, job, announce)
    choice = find_plan(
        cfg, plan, job, ProbeTarget(job.model, strategy, data.train), candidates, hooks
    )
    if choice.micro_batch_size is None:
        raise _nothing_fits(cfg, candidates[0], choice)
    chosen = dataclasses.replace(
        plan.with_micro_batch_size(choice.micro_batch_size), remat=choice.remat
    )
    lines = probe_lines(choice, plan, cfg.auto_batch, bounds)
    why = f"micro_batch_size=auto, pick={cfg.auto_batch.pick.value}"
    record = {
        **plan_file.record(chosen, why),
        "key": probe_key(cfg, data, strategy),
        "choice": choice.summary(plan, cfg.auto_batch, choice_lines(choice, plan, cfg.auto_batch)),
        "probes": [dataclasses.asdict(probe) for probe in choice.probes.values()],
        "probes_with_recomputation": [
            dataclasses.asdict(probe) for probe in choice.recomputed.values()
        ],
    }
    plan_file.write(record)
    return _with_run_remat(cfg, chosen), {"micro-batch": "\n".join(lines)}


def _with_run_remat(cfg, plan):
    """``plan`` carrying the recomputation the run trains with: its own, else the config's."""
    return dataclasses.replace(plan, remat=run_remat(cfg, plan))


def result_fields(cfg, plan, saved):
    """result.json's account of the recomputation the run trained with (``remat``, null for
    none) and, where ``micro_batch_size=auto`` chose it, of that choice (``auto_batch``, from
    ``saved``: batch_plan.json's record)."""
    fields = {"remat": remat_record(run_remat(cfg, plan))}
    if saved and saved.get("choice"):
        fields["auto_batch"] = saved["choice"]
    return fields


def _check_budget_measurable(cfg):
    """ConfigError, before probing, for a memory budget that no peak here can be compared with."""
    budget = cfg.auto_batch.memory_budget_mib
    if budget is None or memory_kind() is not None:
        return
    raise ConfigError(
        f"auto_batch.memory_budget_mib={budget}: on this machine TensorFlow tracks no device "
        "memory, its CPU allocator keeps no statistics and the process's peak resident memory "
        "cannot be reset between sizes (Linux's /proc/self/clear_refs), so no size's peak can "
        "be compared with the budget. Drop "
        "auto_batch.memory_budget_mib (sizes then fit until the device runs out of memory), or "
        "cap the size with auto_batch.max_micro_batch_size."
    )


def _nothing_fits(cfg, smallest, choice):
    """The error for a probe that found no size: over the budget (ConfigError, saying what to
    type) or out of the device's memory (TrainingFailed)."""
    probes = choice.recomputed or choice.probes
    probe = probes[smallest]
    budget = cfg.auto_batch.memory_budget_mib
    if not probe.over_budget:
        return TrainingFailed(
            f"micro_batch_size=auto: not even a micro-batch of {smallest} fits the device "
            f"({probe.error}). Use a smaller model or input, or "
            "precision=mixed_float16 (half the activation memory)."
        )
    peak = probe.peak_bytes / 2**20
    memory = MEMORY_KINDS[choice.memory]
    tried = (
        "even with recomputation (remat=every), "
        if choice.recomputed
        else f"recomputation was not tried ({choice.untried}), and "
        if choice.untried
        else ""
    )
    return ConfigError(
        f"auto_batch.memory_budget_mib={budget}: not even a micro-batch of {smallest} fits the "
        f"budget: {tried}its peak was {peak:,.0f} MiB (the {memory}). Give a budget above "
        f"that, e.g. auto_batch.memory_budget_mib={math.ceil(peak * 1.1)}, or auto_batch."
        "memory_budget_mib=null to use the device's memory as it comes; or make the job smaller "
        "(a smaller model or input, precision=mixed_bfloat16 for half the activation memory)."
    )


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
        self.memory = memory_kind()

    def prepare(self, size):
        if not self.started:
            if self.announce is not None:
                self.announce()
            self.console.print(
                "micro_batch_size=auto: probing micro-batch sizes (each trains a few compiled "
                "calls)\n" + header(self.memory),
                soft_wrap=True,
            )
            self.started = True
        sized = self.plan.with_micro_batch_size(size)
        spe = execution_steps(PlanSettings.of(self.cfg), sized, self.job.wrapper)
        set_accum_steps(self.job.model, sized.accum_steps, spe)

    def recomputing(self):
        self.console.print(
            "micro_batch_size=auto: probing again with recomputation (remat=every), from the "
            "largest size that fitted without it\n" + header(self.memory),
            soft_wrap=True,
        )

    def finished(self, probe):
        self.console.print(probe.row(), soft_wrap=True)
