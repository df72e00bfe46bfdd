"""``train(cfg) -> metrics``: one ``ga-train`` job, from a composed config to a trained model.

The Hydra entry point (:mod:`gacli.cli`) only composes the config and calls this; tests call it
directly. Batch arithmetic is resolved once (:func:`gacli.config.resolve_batch`), printed at start
and logged.
"""

import contextlib
import dataclasses
import hashlib
import logging
import math
import os
import shutil

import keras
import numpy as np
import tensorflow as tf
from omegaconf import OmegaConf

from gacli.accumulate_model import accumulation_callbacks, set_accum_steps, wrap_model
from gacli.accumulation import (
    GradientAccumulateOptimizer,
    NonFiniteError,
    find_accumulating_optimizer,
)
from gacli.autobatch import find_micro_batch_size, probe_key, probe_lines
from gacli.batchnorm import apply_batchnorm_policy, plain_batchnorm_layers
from gacli.config import (
    FREE_ON_RESUME,
    AutoPlan,
    BatchPlan,
    OutOfMemory,
    PartialWindow,
    Policy,
    Wrapper,
    resolve_batch,
)
from gacli.console import ProgressCallback, make_console, startup_panel, summary_table
from gacli.data import load_dataset
from gacli.errors import ConfigError, ProcessUnusable, TrainingFailed
from gacli.faults import install_fake_oom
from gacli.memory_stats import reset_memory_peaks
from gacli.models import build_model
from gacli.objective import check_metric, metric_name
from gacli.oom import WindowStart, oom_line, out_of_memory_message, position_in, smaller_plan
from gacli.optimizers import build_optimizer
from gacli.options import BatchNormPolicy
from gacli.precise_batchnorm import precise_batchnorm_callback
from gacli.run_logging import TensorBoardLogger, host_memory_bytes
from gacli.rundir import (
    BATCH_PLAN_FILE,
    CHECKPOINT_DIR,
    RESULT_FILE,
    check_usable,
    check_writable,
    is_chief,
    read_json,
    write_json,
)
from gacli.runstate import (
    RunCheckpoint,
    RunState,
    StopSignals,
    micro_batch_stream,
    pass_order,
    scratch_or,
)
from gacli.settings import AccumulationConfig
from gacli.strategy import is_multi_worker, make_strategy
from gacli.throughput import ChangedLayout, MicroBatchLayout, TrainingClock

_KERAS_POLICY = {
    Policy.fp32: "float32",
    Policy.mixed_float16: "mixed_float16",
    Policy.mixed_bfloat16: "mixed_bfloat16",
}


def choose_wrapper(cfg):
    """(``Wrapper.model`` or ``Wrapper.optimizer``, the reason shown in the start-up panel)."""
    if cfg.wrapper == Wrapper.optimizer:
        return Wrapper.optimizer, (
            "optimizer wrapper, as configured: in fit() it weighs every micro-batch the same and "
            "lets windows run across epochs"
        )
    if cfg.wrapper == Wrapper.model:
        return Wrapper.model, "model wrapper, as configured"
    return Wrapper.model, (
        "model wrapper (auto): it tells the accumulator each micro-batch's size and closes each "
        "epoch's window, which a plain fit() cannot; it runs under "
        f"strategy={cfg.strategy.name.value}"
    )


def loss_and_metrics(task, num_outputs):
    if task == "segmentation" and num_outputs == 1:
        return keras.losses.BinaryCrossentropy(from_logits=True), [
            keras.metrics.BinaryIoU(target_class_ids=[1], threshold=0.0, name="iou")
        ]
    if task == "segmentation":
        return keras.losses.CategoricalCrossentropy(from_logits=True), ["accuracy"]
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True), [
        keras.metrics.SparseCategoricalAccuracy(name="accuracy")
    ]


def _check_fits(model, data):
    """A clear error, before training, when the data's shapes do not fit the model."""
    expected = tuple(model.input_shape[1:])
    given = tuple(data.input_shape)
    if len(expected) != len(given) or any(e not in (None, g) for e, g in zip(expected, given)):
        raise ConfigError(
            f"the model takes inputs of shape {expected} but the dataset gives {given}; choose a "
            "model built for the data (a factory gets the data's shape), or resize image data "
            "(dataset.image_size=, dataset.channels= for image_folder and shapes)."
        )
    output = tuple(model.output_shape[1:])
    if data.task == "classification" and output[-1] != data.num_outputs:
        raise ConfigError(
            f"the model has {output[-1]} outputs but the data has {data.num_outputs} classes; "
            f"build the model for {data.num_outputs} classes (model.kwargs for a factory), or "
            "give the data the classes the model predicts."
        )
    if data.task == "segmentation" and output[:-1] != tuple(data.label_shape[:-1]):
        raise ConfigError(
            f"the model predicts masks of shape {output} but the data's masks are "
            f"{tuple(data.label_shape)}; give masks of the image's height and width."
        )


def _nonfinite_policy(precision):
    """The configured policy; by default loss scaling's skip under mixed_float16 (an overflow
    there is routine: the scale halves and training goes on) and stop otherwise, so that a nan
    never reaches the weights unnoticed."""
    if precision.nonfinite is not None:
        return precision.nonfinite.value
    return "skip_micro_batch" if precision.policy == Policy.mixed_float16 else "stop"


def _check_batch_fits_data(cfg, plan, train_size):
    """ConfigError when a micro-batch, or a window meant to lie within one pass, is larger than
    the training set: each update would see fewer samples than the configured batch."""
    windows_span_passes = (
        cfg.steps_per_epoch is not None or cfg.partial_window == PartialWindow.carry
    )
    if plan.global_micro_batch_size > train_size:
        per_replica = " x replicas" if plan.replicas > 1 else ""
        raise ConfigError(
            f"micro_batch_size{per_replica} = {plan.global_micro_batch_size} is larger than the "
            f"training set, which holds {train_size} samples (dataset {cfg.dataset.name}, after "
            f"validation_split={cfg.dataset.validation_split}): every micro-batch would hold "
            f"{train_size} samples, not {plan.global_micro_batch_size}. Use a smaller "
            f"micro_batch_size, e.g. micro_batch_size={max(1, train_size // (2 * plan.replicas))}"
            ", or more data."
        )
    if plan.effective_batch_size > train_size and not windows_span_passes:
        fitting = train_size // plan.global_micro_batch_size
        raise ConfigError(
            f"effective_batch_size = {plan.effective_batch_size} is larger than the training set, "
            f"which holds {train_size} samples (dataset {cfg.dataset.name}, after "
            f"validation_split={cfg.dataset.validation_split}): every update would see "
            f"{train_size} samples, not {plan.effective_batch_size}. Use accum_steps={fitting} "
            f"(effective batch {fitting * plan.global_micro_batch_size}) or fewer, or more data; "
            "or let windows run across passes with partial_window=carry."
        )


def _steps_per_execution(cfg, plan, wrapper):
    """Micro-batches per compiled call: by default a window's, so that fit()'s per-step cost
    (Python, callbacks, the function call) is paid once an update instead of once a micro-batch."""
    if wrapper is Wrapper.optimizer and plan.replicas > 1:
        # A plain keras.Model's loop over several steps fails with several replicas in sync
        # (Keras 3.15); the model wrappers run a loop of their own (AccumulationMixin).
        if cfg.steps_per_execution not in (None, 1):
            raise ConfigError(
                f"steps_per_execution={cfg.steps_per_execution} with wrapper=optimizer fails "
                f"under {plan.replicas} replicas (Keras' own loop over several steps breaks under "
                "tf.distribute); use wrapper=auto, which runs several steps a call, or "
                "steps_per_execution=1."
            )
        return 1
    return cfg.steps_per_execution or plan.accum_steps


def _guard_run_dir(cfg, run_dir):
    """Refuse to write over a finished run, or into an unfinished one without ``resume``, or to
    resume with settings that change the maths."""
    check_usable(run_dir, cfg.resume)
    resolved = os.path.join(run_dir, "resolved.yaml")
    if cfg.resume and os.path.exists(resolved):
        before = OmegaConf.to_container(OmegaConf.load(resolved))
        now = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
        changed = _differences(
            {k: v for k, v in before.items() if k not in FREE_ON_RESUME + ("resolved",)},
            {k: v for k, v in now.items() if k not in FREE_ON_RESUME},
        )
        if changed:
            shown = ", ".join(f"{key}={old!r} (now {new!r})" for key, old, new in changed[:4])
            raise ConfigError(
                f"resume: {run_dir} was started with {shown}; a resumed run must use the settings "
                f"it started with ({resolved}). Drop those overrides, or start a new run without "
                "resume=."
            )


def _differences(before, now, prefix=""):
    """[(dotted key, before, now)] where two nested dicts differ."""
    changed = []
    for key in sorted(set(before) | set(now)):
        old, new = before.get(key), now.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            changed += _differences(old, new, f"{prefix}{key}.")
        elif old != new:
            changed.append((f"{prefix}{key}", old, new))
    return changed


def train(cfg, run_dir, given=(), parallel_jobs=False):
    """Train the job described by ``cfg`` and return its final metrics.

    Args:
        cfg: a composed :class:`~gacli.config.TrainConfig` (DictConfig).
        run_dir: where TensorBoard events, checkpoints, the resolved config and the result go.
        given: the config keys set on the command line (they win in the batch arithmetic).
        parallel_jobs: jobs share the terminal (no live progress bar then).

    Returns:
        dict of the last epoch's metrics (``loss``, ``val_loss``, ...).
    """
    console = make_console()
    console.print(f"run directory: {run_dir}", soft_wrap=True)
    _guard_run_dir(cfg, run_dir)
    if is_chief():
        # Found now, not at the first save after an epoch of training.
        check_writable(run_dir, "the run directory")
        if cfg.checkpoint:
            check_writable(os.path.join(run_dir, CHECKPOINT_DIR), "the checkpoint folder")
    strategy = make_strategy(cfg.strategy)
    # A multirun's jobs share a process: each reports its own memory peaks. (After the strategy,
    # which may split devices: listing them, as the reset does, fixes TensorFlow's device setup.)
    reset_memory_peaks()
    plan = resolve_batch(
        cfg.micro_batch_size,
        cfg.accum_steps,
        cfg.effective_batch_size,
        strategy.num_replicas_in_sync,
        given,
    )
    keras.utils.set_random_seed(cfg.seed)
    callers_policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(_KERAS_POLICY[cfg.precision.policy])
    try:
        return _train(cfg, run_dir, plan, strategy, console, parallel_jobs)
    finally:
        # The caller's policy, not float32: a notebook that set mixed_bfloat16 keeps it.
        keras.mixed_precision.set_global_policy(callers_policy)


def _train(cfg, run_dir, plan, strategy, console, parallel_jobs):
    """The job's steps: data, schedule, model, callbacks, fit, results."""
    # Hydra sets the root logger to INFO; TensorFlow's absl chatter is not for the terminal.
    for name in ("absl", "tensorflow"):
        logging.getLogger(name).setLevel(logging.WARNING)
    data = load_dataset(cfg.dataset, cfg.seed)
    plan, chosen = settle_plan(cfg, plan, data, strategy, run_dir)
    _check_batch_fits_data(cfg, plan, data.train_size)
    schedule = plan_schedule(cfg, plan, data.train_size)
    job = build_job(cfg, plan, data, schedule, strategy)
    facts = job.facts(cfg, plan, data, schedule, strategy)
    startup_panel(console, cfg, plan, {**facts, **chosen})
    chief = is_chief()
    if chief:
        _write_resolved(cfg, plan, schedule, job, run_dir)
    callbacks, run_checkpoint, state = make_callbacks(
        cfg, plan, data, schedule, job, run_dir, console, parallel_jobs, chief, strategy
    )
    try:
        position = _restore(cfg, job, state, strategy, console, run_dir)
        position = _recount_checkpoint(plan, job, callbacks, state, position, run_dir)
        with run_checkpoint.signals:
            history, plan = run_fit(
                cfg, plan, data, schedule, job, callbacks, run_checkpoint, state, position, run_dir
            )
    finally:
        for callback in callbacks:
            if hasattr(callback, "close"):
                callback.close()
        state.close()
    return save_results(cfg, plan, job, history, run_dir, chief, console)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How the data is cut: micro-batches per pass, per fit() epoch, and updates."""

    micro_batches: int  # per pass over the training data
    epoch_length: int  # micro-batches per epoch (steps_per_epoch x accum_steps, when set)
    fit_steps: int | None  # steps_per_epoch given to fit(), or None for a whole pass
    total_updates: int
    steps_per_execution: int


def plan_schedule(cfg, plan, train_size):
    """The :class:`Schedule` of a job whose training set holds ``train_size`` samples."""
    micro_batches = math.ceil(train_size / plan.global_micro_batch_size)
    fit_steps = None
    if cfg.steps_per_epoch:
        updates_per_epoch = cfg.steps_per_epoch
        fit_steps = cfg.steps_per_epoch * plan.accum_steps
    elif cfg.partial_window == PartialWindow.drop:
        updates_per_epoch = micro_batches // plan.accum_steps
    elif cfg.partial_window == PartialWindow.carry:
        # Windows run across epochs: on average this many updates an epoch.
        updates_per_epoch = micro_batches / plan.accum_steps
    else:
        updates_per_epoch = math.ceil(micro_batches / plan.accum_steps)
    wrapper, _ = choose_wrapper(cfg)
    return Schedule(
        micro_batches,
        fit_steps or micro_batches,
        fit_steps,
        math.ceil(updates_per_epoch * cfg.epochs),
        _steps_per_execution(cfg, plan, wrapper),
    )


def settle_plan(cfg, plan, data, strategy, run_dir):
    """(the run's BatchPlan, start-up panel lines on how it was chosen).

    A run that chose its micro-batch before (``micro_batch_size=auto``'s probe, or ``oom=recover``
    after an out-of-memory error) keeps that choice when it resumes: ``batch_plan.json`` in the run
    directory holds it, and the checkpoints count micro-batches of that size."""
    saved = read_json(os.path.join(run_dir, BATCH_PLAN_FILE))
    if saved is not None and cfg.resume:
        kept = BatchPlan(saved["micro_batch_size"], saved["accum_steps"], saved["replicas"])
        if kept.replicas == plan.replicas:
            return kept, {"micro-batch": f"{kept.micro_batch_size}, as before ({saved['why']})"}
    if not isinstance(plan, AutoPlan):
        return plan, {}
    largest = data.train_size // plan.replicas
    if plan.effective_batch_size is None:  # accum_steps kept: the effective batch follows
        largest //= plan.accum_steps  # and stays within the training set
    if cfg.auto_batch.max_micro_batch_size:
        largest = min(largest, cfg.auto_batch.max_micro_batch_size)
    candidates = plan.candidates(max(1, largest))
    first = plan.with_micro_batch_size(candidates[-1])
    # Without XLA: an out-of-memory error inside an XLA program leaves the variables unusable
    # (see _stop_for_resume). XLA's fused step usually needs less memory than this one.
    probed = OmegaConf.merge(cfg, {"jit_compile": False})
    job = build_job(probed, first, data, plan_schedule(cfg, first, data.train_size), strategy)

    def prepare(size):
        sized = plan.with_micro_batch_size(size)
        spe = _steps_per_execution(cfg, sized, job.wrapper)
        set_accum_steps(job.model, sized.accum_steps, spe)

    micro, probes = find_micro_batch_size(
        job.model,
        strategy,
        data.train,
        candidates,
        cfg.auto_batch,
        prepare,
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
        **_plan_record(chosen, why),
        "key": probe_key(cfg, data, strategy),
        "probes": [dataclasses.asdict(probe) for probe in probes.values()],
    }
    if is_chief():
        write_json(os.path.join(run_dir, BATCH_PLAN_FILE), record)
    return chosen, {"micro-batch": "\n".join(probe_lines(micro, probes, cfg.auto_batch))}


def _plan_record(plan, why, **more):
    return {
        "micro_batch_size": plan.micro_batch_size,
        "accum_steps": plan.accum_steps,
        "replicas": plan.replicas,
        "effective_batch_size": plan.effective_batch_size,
        "why": why,
        **more,
    }


def accumulation_config(cfg, plan):
    """The job's :class:`~gacli.AccumulationConfig` (loss scaling follows the precision policy,
    which is set when the model is built)."""
    return AccumulationConfig(
        accum_steps=plan.accum_steps,
        partial_window=cfg.partial_window,
        use_agc=cfg.optimizer.use_agc,
        clip_factor=cfg.optimizer.clip_factor,
        nonfinite=_nonfinite_policy(cfg.precision),
        noise_scale=cfg.monitor.gns,
    )


@dataclasses.dataclass
class Job:
    """The built parts of a job: the compiled model and what the panel says about them."""

    model: object
    accumulator: object
    wrapper: Wrapper
    reason: str
    batchnorm_layers: int
    learning_rate: float
    fault: object = None  # GACLI_FAKE_OOM_ABOVE's callback (gacli.faults), when set

    def facts(self, cfg, plan, data, schedule, strategy):
        """The start-up panel's lines."""
        replicas = strategy.num_replicas_in_sync
        layers = self.batchnorm_layers
        return {
            "wrapper": self.reason,
            "model": f"{cfg.model.factory or cfg.model.name} "
            f"({self.model.count_params():,} parameters)",
            "data": f"{cfg.dataset.name}: {data.train_size} train / {data.validation_size} val "
            f"samples, inputs {tuple(data.input_shape)}",
            "updates": f"{schedule.total_updates} in {cfg.epochs} epochs, "
            f"{schedule.epoch_length} micro-batches per epoch",
            "compiled calls": f"{schedule.steps_per_execution} micro-batches each "
            "(steps_per_execution)",
            "precision": cfg.precision.policy.value,
            "batch norm": f"{cfg.batchnorm.value} ({layers} layer{'s' if layers != 1 else ''}"
            + (
                "; statistics per micro-batch, batchnorm=precise recomputes them"
                if cfg.batchnorm == BatchNormPolicy.keep and plan.accum_steps > 1 and layers
                else ""
            )
            + ")",
            "strategy": f"{cfg.strategy.name.value} ({replicas} replica"
            f"{'s' if replicas > 1 else ''})",
            "learning rate": f"{self.learning_rate:.3g} at update 0",
        }


def build_job(cfg, plan, data, schedule, strategy):
    """Model, batch-norm policy, inner optimizer and accumulation wrapper, compiled."""
    wrapper, reason = choose_wrapper(cfg)
    loss, metrics = loss_and_metrics(data.task, data.num_outputs)
    check_metric(
        metric_name(cfg.objective, cfg.dataset.validation_split),
        [m if isinstance(m, str) else m.name for m in metrics],
        validation=bool(cfg.dataset.validation_split),
    )
    settings = accumulation_config(cfg, plan)
    with strategy.scope():
        keras.utils.set_random_seed(cfg.seed)
        model = build_model(cfg.model, data.input_shape, data.num_outputs, data.task)
        _check_fits(model, data)
        batchnorm_layers = len(plain_batchnorm_layers(model))
        model = apply_batchnorm_policy(model, cfg.batchnorm.value, plan.accum_steps, warn=False)
        inner = build_optimizer(cfg.optimizer, plan.effective_batch_size, schedule.total_updates)
        if wrapper is Wrapper.model:
            model = wrap_model(model, config=settings)
            optimizer = inner
        else:
            from gacli.clipping import agc_unit_axes

            optimizer = GradientAccumulateOptimizer(
                inner,
                config=settings,
                agc_unit_axes=agc_unit_axes(model) if settings.use_agc else None,
            )
        model.compile(
            optimizer=optimizer,
            loss=loss,
            metrics=metrics,
            jit_compile=cfg.jit_compile,
            auto_scale_loss=False,
            steps_per_execution=schedule.steps_per_execution,
        )
    accumulator = find_accumulating_optimizer(model.optimizer)
    if model.built:
        with strategy.scope():
            # Built now, not in the first trace: the probe and the fault injection read its state.
            model.optimizer.build(model.trainable_variables)
    fault = install_fake_oom(model, accumulator)
    return Job(
        model,
        accumulator,
        wrapper,
        reason,
        batchnorm_layers,
        float(inner.learning_rate.numpy()),
        fault,
    )


def _write_resolved(cfg, plan, schedule, job, run_dir):
    """``resolved.yaml``: the config with the batch arithmetic, written once per run."""
    if os.path.exists(os.path.join(run_dir, "resolved.yaml")):
        return
    resolved = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    resolved["resolved"] = {
        "micro_batch_size": plan.micro_batch_size,
        "accum_steps": plan.accum_steps,
        "replicas": plan.replicas,
        "effective_batch_size": plan.effective_batch_size,
        "optimizer_updates": schedule.total_updates,
        "wrapper": job.wrapper.value,
    }
    OmegaConf.save(OmegaConf.create(resolved), os.path.join(run_dir, "resolved.yaml"))


def _hparams(cfg, plan, job):
    """What TensorBoard's HParams tab compares runs by."""
    return {
        "accum_steps": plan.accum_steps,
        "micro_batch_size": plan.micro_batch_size,
        "effective_batch_size": plan.effective_batch_size,
        "precision": cfg.precision.policy.value,
        "strategy": cfg.strategy.name.value,
        "wrapper": job.wrapper.value,
        "model": cfg.model.factory or cfg.model.name,
        "lr": float(cfg.optimizer.learning_rate),
        "optimizer": cfg.optimizer.name.value,
    }


def make_callbacks(
    cfg, plan, data, schedule, job, run_dir, console, parallel_jobs, chief, strategy
):
    """(the fit() callbacks in their order, the checkpoint callback, the run's state)."""
    accumulator = job.accumulator
    clock = TrainingClock(accumulator, data.train_size, plan.global_micro_batch_size)
    callbacks = [
        clock,
        ProgressCallback(
            console,
            cfg.progress,
            plan,
            accumulator,
            math.ceil(schedule.total_updates / cfg.epochs),
            cfg.epochs,
            parallel_jobs,
            clock=clock,
        ),
    ]
    if chief:
        hparams = _hparams(cfg, plan, job)
        callbacks.append(
            TensorBoardLogger(
                os.path.join(run_dir, "tensorboard"), plan, accumulator, hparams, clock
            )
        )
    # The window closer and the non-finite stop go first: a halted step is neither logged nor
    # saved. (The model wrappers' fit() would add them too; a plain model's would not.)
    callbacks = accumulation_callbacks(accumulator, callbacks)
    state = RunState(job.model, run_dir, chief)
    hint = f"To continue, run the same command with resume=true, or resume={run_dir}."
    run_checkpoint = RunCheckpoint(
        state,
        accumulator,
        StopSignals(),
        hint,
        cfg.checkpoint_every_updates,
        save=cfg.checkpoint,
        multi_worker=is_multi_worker(strategy),
    )
    if cfg.batchnorm == BatchNormPolicy.precise:
        # After the callbacks that close an epoch's window: the statistics see its last update.
        callbacks.append(
            precise_batchnorm_callback(
                data.train,
                plan.micro_batch_size,
                cfg.precise_bn_micro_batches,
                cfg.seed,
                buffer_size=min(data.train_size, 10_000),
            )
        )
    callbacks.append(run_checkpoint)
    if cfg.oom == OutOfMemory.recover:
        callbacks.append(
            WindowStart(accumulator, lambda: (run_checkpoint.epoch, run_checkpoint.done))
        )
    if job.fault is not None:
        callbacks.append(job.fault)
    return callbacks, run_checkpoint, state


def _restore(cfg, job, state, strategy, console, run_dir):
    """(epoch, micro-batches done in it) to start from: (0, 0), or a resumed run's checkpoint."""
    if not cfg.resume:
        return (0, 0)
    with strategy.scope():
        job.model.optimizer.build(job.model.trainable_variables)
    restored = state.restore(
        warn=lambda message: console.print(message, style="yellow", soft_wrap=True)
    )
    if restored is None:
        console.print(
            f"resume: no checkpoint in {run_dir} yet; starting from the beginning", soft_wrap=True
        )
        return (0, 0)
    console.print(
        f"resume: from epoch {restored[0] + 1}, micro-batch {restored[1]} of it (update "
        f"{int(job.accumulator.optimizer_step.numpy())}, micro-step "
        f"{int(job.accumulator.micro_step.numpy())})",
        soft_wrap=True,
    )
    return restored


def _recount_checkpoint(plan, job, callbacks, state, position, run_dir):
    """A run resumed after an out-of-memory error under XLA (:func:`_stop_for_resume`): the
    checkpoint counts micro-batches of the old size; its position and open window are counted
    again in the new size, and saved so, before training goes on."""
    path = os.path.join(run_dir, BATCH_PLAN_FILE)
    saved = read_json(path) or {}
    old = saved.pop("checkpoint_micro_batch_size", None)
    if old is None or old == plan.micro_batch_size:
        return position
    ratio = old // plan.micro_batch_size
    accumulator = job.accumulator
    accumulator.window_micro_steps.assign(accumulator.window_micro_steps * ratio)
    at = int(accumulator.micro_step.numpy())
    for callback in callbacks:
        if isinstance(callback, TrainingClock):
            before = MicroBatchLayout(callback.layout.train_size, old * plan.replicas)
            callback.layout = ChangedLayout(before, at, plan.global_micro_batch_size)
        elif hasattr(callback, "replan"):
            callback.replan(plan, saved.get("oom_recoveries", 0))
    position = (position[0], position[1] * ratio)
    if is_chief():
        if position != (0, 0) or int(accumulator.optimizer_step.numpy()):
            state.save(*position)
        write_json(path, saved)
    return position


def run_fit(cfg, plan, data, schedule, job, callbacks, run_checkpoint, state, position, run_dir):
    """fit() from ``position`` to the end of training; (the history, the plan it ended with).

    Under ``oom=recover`` an out-of-memory error puts the open window back to its start, halves
    the micro-batch (doubling accum_steps) and goes on from the window's first sample."""
    history = {}
    while True:
        try:
            done = _fit_from(
                cfg, plan, data, schedule, job, callbacks, run_checkpoint, state, position, run_dir
            )
            for key, values in done.items():
                history.setdefault(key, []).extend(values)
            return history, plan
        except tf.errors.ResourceExhaustedError as error:
            recover = cfg.oom == OutOfMemory.recover
            smaller = smaller_plan(plan)
            if recover and smaller is not None and cfg.jit_compile:
                _stop_for_resume(plan, smaller, run_dir, error)
            rewound = _window_start(callbacks).rewind() if recover else None
            if rewound is None or smaller is None:
                raise TrainingFailed(out_of_memory_message(plan, recover, error)) from None
            position = position_in(rewound, plan, smaller)
            plan = smaller
            schedule = _replan(cfg, plan, data, job, callbacks, error)
            if cfg.checkpoint and is_chief():
                state.save(*position)
            if is_chief():
                write_json(
                    os.path.join(run_dir, BATCH_PLAN_FILE),
                    _plan_record(
                        plan, "oom=recover", oom_recoveries=_window_start(callbacks).count
                    ),
                )


def _stop_for_resume(plan, smaller, run_dir, error):
    """Under XLA an out-of-memory error leaves the variables unusable (TensorFlow 2.21 frees their
    memory when the compiled program fails to allocate: docs/batch.md), so the run stops; the
    smaller plan is recorded for resume=true, which goes on from the last checkpoint."""
    saved = read_json(os.path.join(run_dir, BATCH_PLAN_FILE)) or {}
    if is_chief():
        write_json(
            os.path.join(run_dir, BATCH_PLAN_FILE),
            _plan_record(
                smaller,
                "oom=recover",
                oom_recoveries=saved.get("oom_recoveries", 0) + 1,
                # The checkpoints count micro-batches of this size until the next one is saved.
                checkpoint_micro_batch_size=saved.get(
                    "checkpoint_micro_batch_size", plan.micro_batch_size
                ),
            ),
        )
    raise ProcessUnusable(
        f"Out of device memory at micro_batch_size={plan.micro_batch_size} ({oom_line(error)}) "
        "inside an XLA program (jit_compile=true), after which TensorFlow's variables cannot be "
        "used again in this process. Run the same command with resume=true: it goes on from the "
        f"last checkpoint with micro_batch_size={smaller.micro_batch_size} x accum_steps="
        f"{smaller.accum_steps} (the same effective batch of {plan.effective_batch_size})."
    )


def _window_start(callbacks):
    return next(callback for callback in callbacks if isinstance(callback, WindowStart))


def _replan(cfg, plan, data, job, callbacks, error):
    """The job set up for ``plan`` after an out-of-memory error; the new schedule."""
    schedule = plan_schedule(cfg, plan, data.train_size)
    set_accum_steps(job.model, plan.accum_steps, schedule.steps_per_execution)
    window_start = _window_start(callbacks)
    window_start.count += 1
    for callback in callbacks:
        if hasattr(callback, "replan"):
            callback.replan(plan, window_start.count)
    make_console().print(
        f"out of device memory ({oom_line(error)}); the window starts again with micro_batch_size="
        f"{plan.micro_batch_size} x accum_steps={plan.accum_steps} (effective batch "
        f"{plan.effective_batch_size} kept, recovery {window_start.count})",
        style="yellow",
        soft_wrap=True,
    )
    return schedule


def _fit_from(cfg, plan, data, schedule, job, callbacks, run_checkpoint, state, position, run_dir):
    """fit() from ``position`` to the end of training, one call per segment; what the segments'
    fit() calls returned, metric name -> values per epoch."""
    history = {}
    validation = None
    if data.validation is not None:
        validation = data.validation.batch(plan.global_micro_batch_size)
    per_epoch = schedule.epoch_length % schedule.steps_per_execution != 0
    for first, end, steps, offset in _segments(
        position, schedule.epoch_length, cfg.epochs, per_epoch
    ):
        stream = micro_batch_stream(
            data.train,
            plan.global_micro_batch_size,
            schedule.micro_batches,
            start=first * schedule.epoch_length + offset,
            count=steps * (end - first),
            shuffle_seed=cfg.seed if cfg.dataset.shuffle else None,
            buffer_size=min(data.train_size, 10_000),
        )
        run_checkpoint.start_segment(first, offset)
        # A resumed epoch is a fit() of its own: its end is not the run's end.
        last = end == cfg.epochs
        with contextlib.nullcontext() if last else job.accumulator.fit_continues():
            try:
                segment = job.model.fit(
                    stream,
                    validation_data=validation,
                    initial_epoch=first,
                    epochs=end,
                    steps_per_epoch=steps,
                    verbose=0,
                    callbacks=callbacks,
                    shuffle=False,
                )
            except NonFiniteError as error:
                raise TrainingFailed(
                    _where_nonfinite(error.micro_step, cfg, data, plan, schedule, state, run_dir)
                ) from None
        for key, values in segment.history.items():
            history.setdefault(key, []).extend(values)
    if not history:
        # Resumed after the last epoch's checkpoint: only the end of training is left.
        job.model.optimizer.finalize_variable_values(job.model.trainable_variables)
    return history


def save_results(cfg, plan, job, history, run_dir, chief, console):
    """model.keras (atomically), result.json and the summary table; the final metrics."""
    model, accumulator = job.model, job.accumulator
    final = {key: float(values[-1]) for key, values in history.items()}
    # Equal on every worker of a run, and across runs that trained the same way.
    fingerprint = hashlib.sha256(
        b"".join(np.ascontiguousarray(weight).tobytes() for weight in model.get_weights())
    ).hexdigest()[:16]
    if cfg.checkpoint:
        # Every worker saves (reading the accumulators is a collective); only the chief keeps it.
        # Written under another name first: a model.keras that exists is a whole one.
        path = scratch_or(os.path.join(run_dir, ".model-writing.keras"), chief)
        model.save(path)
        if chief:
            os.replace(path, os.path.join(run_dir, "model.keras"))
        else:
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    updates, micro_steps = (
        int(accumulator.optimizer_step.numpy()),
        int(accumulator.micro_step.numpy()),
    )
    noise = accumulator.noise_scale()
    if chief:
        result = dict(
            final,
            optimizer_step=updates,
            micro_step=micro_steps,
            gradient_noise_scale=(noise or {}).get("noise_scale") or None,
            effective_batch_size=plan.effective_batch_size,
            micro_batch_size=plan.micro_batch_size,
            accum_steps=plan.accum_steps,
            weights_sha256=fingerprint,
            host_peak_rss_bytes=host_memory_bytes()[1],
        )
        write_json(os.path.join(run_dir, RESULT_FILE), result)
    rows = {key: f"{value:.4f}" for key, value in final.items()}
    rows["updates / micro-batches"] = f"{updates} / {micro_steps}"
    rows["effective batch"] = plan.effective_batch_size
    if noise is not None:
        rows["noise scale"] = noise_scale_verdict(plan.effective_batch_size, noise)
    rows["weights sha256"] = fingerprint
    summary_table(console, rows)
    console.print(f"run directory: {run_dir}", soft_wrap=True)
    return final


def noise_scale_verdict(effective_batch, noise):
    """One line that compares the effective batch with the measured gradient noise scale."""
    if not noise["windows"]:
        return (
            "not measured: it needs windows of more than one micro-batch (accum_steps > 1 "
            "or several replicas) and the model wrapper"
        )
    scale = noise["noise_scale"]
    if scale <= 0:
        return (
            f"not yet reliable after {noise['windows']} windows (the gradient's size is "
            "lost in its noise); train longer for an estimate"
        )
    measured = f"~{scale:,.0f} (over {noise['windows']} windows)"
    if effective_batch < scale / 2:
        return (
            f"{measured}: effective batch {effective_batch} is well below it, so a larger "
            "effective batch would still pay off (fewer updates for the same progress)"
        )
    if effective_batch > 2 * scale:
        return (
            f"{measured}: effective batch {effective_batch} is well above it, so most of "
            "each update's samples are spent for little; a smaller effective batch (more "
            "updates) would train faster per sample"
        )
    return (
        f"{measured}: effective batch {effective_batch} is close to it, near the point of "
        "diminishing returns"
    )


def _where_nonfinite(micro_step, cfg, data, plan, schedule, state, run_dir):
    """The message of a run halted on a non-finite gradient: where, which samples, what is kept."""
    epoch_length, micro_batches = schedule.epoch_length, schedule.micro_batches
    index = micro_step - 1  # micro-batches are counted from 1 by the engine
    epoch, in_epoch = divmod(index, epoch_length)
    data_pass, in_pass = divmod(index, micro_batches)
    first = in_pass * plan.global_micro_batch_size
    last = min(first + plan.global_micro_batch_size, data.train_size)
    order = pass_order(
        data.train_size,
        data_pass,
        shuffle_seed=cfg.seed if cfg.dataset.shuffle else None,
        buffer_size=min(data.train_size, 10_000),
    )
    names = [data.sample_name(int(position)) for position in order[first:last]]
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    saved = state.latest()
    kept = (
        f"The last checkpoint, {saved}, is from before it and is kept; "
        if saved
        else "No checkpoint was written before it; "
    )
    return (
        f"training stopped at epoch {epoch + 1}, micro-batch {in_epoch + 1} of {epoch_length}: "
        f"its loss or gradient was not finite (inf or nan). It held the samples at positions "
        f"{first}-{last - 1} of pass {data_pass + 1} over the training data ({data.source}: "
        f"{shown}). No update used it. {kept}result.json and model.keras are not written. If "
        "those samples are clean, the model diverged: start again with a lower "
        "optimizer.learning_rate or with optimizer.clipnorm=1.0; precision.nonfinite="
        "skip_micro_batch would train on past such micro-batches instead. If they are not, fix "
        f"them and continue from the last checkpoint with resume={run_dir}."
    )


def _segments(position, epoch_length, epochs, per_epoch=False):
    """fit() calls from ``position`` = (epoch, micro-batches done in it) to the end of training:
    [(first epoch, end epoch, micro-batches per epoch, micro-batches skipped in the first)].

    ``per_epoch``: one fit() per epoch. A compiled call of ``steps_per_execution`` micro-batches
    stops only where its data ends; in a stream of several epochs whose length it does not
    divide, an epoch's last call would run on into the next epoch's micro-batches.
    """
    epoch, done = position
    if done >= epoch_length:  # saved after an epoch's last micro-batch: the next epoch is next
        epoch, done = epoch + 1, 0
    segments = []
    if done:
        segments.append((epoch, epoch + 1, epoch_length - done, done))
        epoch += 1
    if per_epoch:
        segments += [(first, first + 1, epoch_length, 0) for first in range(epoch, epochs)]
    elif epoch < epochs:
        segments.append((epoch, epochs, epoch_length, 0))
    return segments
