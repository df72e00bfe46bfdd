"""``train(cfg) -> metrics``: one ``ga-train`` job, from a composed config to a trained model.

The Hydra entry point (:mod:`gacli.runner.cli`) only composes the config and calls this; tests call
it directly. A :class:`Run` owns the job: its batch plan (resolved once by
:func:`gacli.runner.config.resolve_batch`, printed at start and logged), the model and engine, the
data stream and its order, its callbacks, checkpoints and resume, the out-of-memory re-plan and the
result. The functions around it take what they use, and can be run one by one.
"""

import contextlib
import dataclasses
import errno
import functools
import hashlib
import logging
import math
import os
import shutil
import warnings

import keras
import numpy as np
import tensorflow as tf
from omegaconf import OmegaConf

from gacli.engine.accumulate_model import (
    AccumulatingModelWrapper,
    accumulation_callbacks,
    set_accum_steps,
    wrap_model,
)
from gacli.engine.accumulation import (
    GradientAccumulateOptimizer,
    NonFiniteError,
    find_accumulating_optimizer,
)
from gacli.engine.batchnorm import (
    BatchNormWarning,
    apply_batchnorm_policy,
    plain_batchnorm_layers,
)
from gacli.engine.options import BatchNormPolicy, NonFinite
from gacli.engine.precise_batchnorm import PreciseBatchNorm
from gacli.engine.schedules import ScaledLearningRate
from gacli.engine.settings import AccumulationConfig
from gacli.engine.tf32 import tf32_description, tf32_enabled, tf32_mode
from gacli.errors import ConfigError, ProcessUnusable, TrainingFailed
from gacli.rundir import (
    BATCH_PLAN_FILE,
    CHECKPOINT_DIR,
    check_usable,
    check_writable,
    is_chief,
    read_json,
    write_json,
    write_result,
)
from gacli.runner.accum_schedule import (
    AccumSchedule,
    StageTable,
    grown_accum_steps,
    updates_in_epoch,
)
from gacli.runner.autobatch import HEADER, find_micro_batch_size, probe_key, probe_lines
from gacli.runner.config import (
    FREE_ON_RESUME,
    AutoPlan,
    BatchPlan,
    OutOfMemory,
    PartialWindow,
    Policy,
    Wrapper,
    resolve_batch,
    shown_name,
)
from gacli.runner.console import ProgressCallback, make_console, startup_panel, summary_table
from gacli.runner.data import load_dataset
from gacli.runner.faults import install_fake_oom
from gacli.runner.loggers import ended_with_the_job, open_writers
from gacli.runner.memory_stats import reset_memory_peaks
from gacli.runner.models import build_model
from gacli.runner.objective import check_metric, metric_name
from gacli.runner.oom import WindowStart, oom_line, out_of_memory_message, position_in, smaller_plan
from gacli.runner.optimizers import build_optimizer, learning_rate_schedule
from gacli.runner.run_logging import RunLogger, host_memory_bytes
from gacli.runner.runstate import (
    PassOrder,
    RunCheckpoint,
    RunState,
    StopSignals,
    micro_batch_stream,
    scratch_or,
)
from gacli.runner.skip_budget import SkipBudget
from gacli.runner.strategy import is_multi_worker, make_strategy
from gacli.runner.targets import build_callbacks, build_loss, build_metrics
from gacli.runner.throughput import ChangedLayout, MicroBatchLayout, TrainingClock

# ga-train's one default that differs from the library's (docs/getting-started.md, "Options"):
# without loss scaling a non-finite gradient stops the run, so that a nan never reaches the weights
# unnoticed; the library leaves it unchecked there.
NONFINITE_WITHOUT_LOSS_SCALING = NonFinite.stop

_KERAS_POLICY = {
    Policy.fp32: "float32",
    Policy.mixed_float16: "mixed_float16",
    Policy.mixed_bfloat16: "mixed_bfloat16",
}


def train(cfg, run_dir, given=(), parallel_jobs=False):
    """Train the job described by ``cfg`` (the arguments are :class:`Run`'s) and return its final
    metrics: a dict of the last epoch's ``loss``, ``val_loss``, ..."""
    return Run(cfg, run_dir, given, parallel_jobs).execute()


@contextlib.contextmanager
def _precision_policy(policy):
    """Keras' global policy set to ``policy`` for the job, and the caller's put back after it
    (not float32: a notebook that set mixed_bfloat16 keeps it)."""
    callers_policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(_KERAS_POLICY[policy])
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy(callers_policy)


class Run:
    """One ``ga-train`` job, from its plan to its result.

    Its steps, in :meth:`execute`: check the run directory; plan the batch; load the data; settle
    the plan (a probed or kept micro-batch) and the steps; build the model and engine; make the
    callbacks; restore a checkpoint; fit, re-planning after an out-of-memory error; save the
    results. What one step makes, the next reads from the run: ``plan``, ``data``, ``steps``,
    ``job``, ``callbacks``, ``state``, ``position``.

    Args:
        cfg: a composed :class:`~gacli.runner.config.TrainConfig` (DictConfig).
        run_dir: where TensorBoard events, checkpoints, the resolved config and the result go.
        given: the config keys set on the command line (they win in the batch arithmetic).
        parallel_jobs: jobs share the terminal (no live progress bar then).

    Example:
        >>> metrics = Run(compose_config("epochs=2"), "outputs/first").execute()
    """

    def __init__(self, cfg, run_dir, given=(), parallel_jobs=False):
        self.cfg = cfg
        self.run_dir = run_dir
        self.given = given
        self.parallel_jobs = parallel_jobs
        self.console = make_console()
        self.plan_file = BatchPlanFile(run_dir)
        self.chief = None  # known once the strategy is made (it may set TF_CONFIG)
        self.strategy = None
        self.plan = None  # the BatchPlan; replaced by the out-of-memory re-plan
        self.data = None
        self.steps = None  # the StepPlan of the plan
        self.job = None
        self.callbacks = None
        self.state = None
        self.position = (0, 0)  # (epoch, micro-batches done in it) that fit() starts from
        self.chosen = {}  # start-up panel lines on how the micro-batch was chosen
        self.history = {}  # metric name -> values per epoch, of the fit() that finished
        self.schedule = None  # the AccumSchedule of accum_schedule, when set
        self.stages = None  # its StageTable: each epoch's accum_steps, checkpointed
        self.announced = False  # the run directory's line has been printed
        self.tf32 = None  # whether TF32 is on while the job runs (cfg.tf32 applied)
        self.user_callbacks = []  # the callbacks= list's, built before the model

    def execute(self):
        """The job's steps; the last epoch's metrics."""
        self.check_run_dir(announce=False)
        self.plan_batch()
        with _precision_policy(self.cfg.precision.policy), tf32_mode(self.cfg.tf32) as tf32:
            self.tf32 = tf32
            self.load_data()
            _check_validation_split(self.cfg, self.data)  # a check=equivalence needs none
            self.settle_plan()
            self.build()
            self.make_callbacks()
            self.callbacks.user = self.user_callbacks
            try:
                with ended_with_the_job(self.callbacks.logger):  # MLflow's run: FINISHED, ...
                    try:
                        self.restore()
                        self.fit()
                    finally:
                        self.close()  # the event files are whole before result.json says "done"
                    return self.save_results()
            except (OSError, tf.errors.OpError) as error:
                if not disk_full(error):
                    raise
                raise TrainingFailed(disk_full_message(self.run_dir, error)) from None

    def check_run_dir(self, announce=True):
        """Refuse an unusable run directory before anything is built. ``announce``: name it now;
        :meth:`execute` names it once the job's input is checked, as a run refused on its input
        (exit 2) leaves no directory behind."""
        if announce:
            self.announce_run_dir()
        _guard_run_dir(self.cfg, self.run_dir)
        if is_chief():
            # Found now, not at the first save after an epoch of training.
            check_writable(self.run_dir, "the run directory")
            if self.cfg.checkpoint:
                check_writable(os.path.join(self.run_dir, CHECKPOINT_DIR), "the checkpoint folder")

    def announce_run_dir(self):
        """The run directory's line, printed once, before training (and last, with the result)."""
        if not self.announced:
            self.console.print(f"run directory: {self.run_dir}", soft_wrap=True)
            self.announced = True

    def plan_batch(self):
        """The strategy and the batch arithmetic over its replicas."""
        cfg = self.cfg
        self.strategy = make_strategy(cfg.strategy)
        # A multirun's jobs share a process: each reports its own memory peaks. (After the
        # strategy, which may split devices: listing them, as the reset does, fixes TensorFlow's
        # device setup.)
        reset_memory_peaks()
        self.plan = resolve_batch(
            cfg.micro_batch_size,
            cfg.accum_steps,
            cfg.effective_batch_size,
            self.strategy.num_replicas_in_sync,
            self.given,
        )
        keras.utils.set_random_seed(cfg.seed)

    def load_data(self):
        # Hydra sets the root logger to INFO; TensorFlow's absl chatter is not for the terminal.
        for name in ("absl", "tensorflow"):
            logging.getLogger(name).setLevel(logging.WARNING)
        self.data = load_dataset(self.cfg.dataset, self.cfg.seed)

    def settle_plan(self):
        """The micro-batch probed or kept from before, checked against the data; its steps."""
        self.plan, self.chosen = settle_plan(
            self.cfg, self.plan, self.data, self.strategy, self.run_dir, self.announce_run_dir
        )
        self.schedule = AccumSchedule.of(
            self.cfg,
            self.plan.accum_steps,
            max(1, self.data.train_size // self.plan.global_micro_batch_size),
        )
        if self.schedule is not None:
            plan = self.plan
            largest = BatchPlan(plan.micro_batch_size, self.schedule.largest, plan.replicas)
            _check_batch_fits_data(self.cfg, largest, self.data.train_size)
            self.plan = BatchPlan(plan.micro_batch_size, self.schedule.start, plan.replicas)
            self.chosen["accum schedule"] = _schedule_line(self.schedule, plan)
        _check_batch_fits_data(self.cfg, self.plan, self.data.train_size)
        self.steps = plan_steps(self.cfg, self.plan, self.data.train_size, self.schedule)

    def build(self):
        """The compiled model and engine; the start-up panel; ``resolved.yaml``."""
        cfg, plan, data, steps = self.cfg, self.plan, self.data, self.steps
        self.user_callbacks = build_callbacks(cfg.get("callbacks"))
        try:
            self.job = build_job(cfg, plan, data, steps, self.strategy)
        except tf.errors.ResourceExhaustedError as error:
            raise ConfigError(
                f"the model does not fit in memory: building {shown_name(cfg.model)} for inputs of "
                f"shape {tuple(data.input_shape)} ran out of memory ({oom_line(error)}) before "
                "training began. Give it smaller inputs (dataset.image_size) or fewer or narrower "
                "layers (the model.* settings)."
            ) from None
        facts = self.job.facts(cfg, plan, data, steps, self.strategy)
        self.announce_run_dir()
        startup_panel(self.console, cfg, plan, {**facts, **self.chosen})
        self.chief = is_chief()
        if self.chief:
            _write_resolved(cfg, plan, steps, self.job, self.run_dir)

    def make_callbacks(self):
        """The run's callbacks, each kept by its name, and its checkpointed state."""
        cfg, plan, data, accumulator = self.cfg, self.plan, self.data, self.job.accumulator
        clock = TrainingClock(accumulator, data.train_size, plan.global_micro_batch_size)
        progress = ProgressCallback(
            self.console,
            cfg.progress,
            plan,
            accumulator,
            self.steps.total_updates,
            cfg.epochs,
            self.parallel_jobs,
            clock=clock,
        )
        logger = self._logger(clock)
        self.state = self._run_state()
        if logger is not None:
            self.state.after_save.append(logger.checkpointed)
        checkpoint = RunCheckpoint(
            self.state,
            accumulator,
            StopSignals(),
            f"To continue, run the same command with resume=true, or resume={self.run_dir}.",
            cfg.checkpoint_every_updates,
            save=cfg.checkpoint,
            multi_worker=is_multi_worker(self.strategy),
        )
        precise_batchnorm = None
        if cfg.batchnorm == BatchNormPolicy.precise:
            # Micro-batches of their own order (they neither depend on nor move the training
            # order), at the training micro-batch size per replica.
            statistics = data.train.shuffle(
                self.order.buffer_size, seed=cfg.seed, reshuffle_each_iteration=False
            )
            precise_batchnorm = PreciseBatchNorm(
                statistics.batch(plan.micro_batch_size), micro_batches=cfg.precise_bn_micro_batches
            )
        window_start = None
        if cfg.oom == OutOfMemory.recover:
            window_start = WindowStart(accumulator, lambda: (checkpoint.epoch, checkpoint.done))
        skip_budget = None
        if accumulator.nonfinite is not NonFinite.stop:
            skip_budget = SkipBudget(accumulator, plan.replicas, cfg.precision.max_skipped_fraction)
        self.callbacks = RunCallbacks(
            clock,
            progress,
            logger,
            checkpoint,
            precise_batchnorm,
            window_start,
            self.job.fault,
            skip_budget,
        )

    def _logger(self, clock):
        """The chief's :class:`RunLogger`, writing to the loggers ``logger=`` names; None on the
        other workers."""
        if not self.chief:
            return None
        cfg, plan, job = self.cfg, self.plan, self.job
        writers = open_writers(
            cfg, self.run_dir, _hparams(cfg, plan, job), _resolved(cfg, plan, self.steps, job)
        )
        return RunLogger(writers, plan, job.accumulator, clock)

    def _run_state(self):
        """The run's checkpointed state; under ``accum_schedule``, each epoch's stage in it."""
        if self.schedule is not None:
            self.stages = StageTable(self.cfg.epochs)
        extra = {"accum_schedule": self.stages.module} if self.stages else None
        return RunState(self.job.model, self.run_dir, self.chief, extra=extra)

    @property
    def order(self):
        """How every pass over the training data is shuffled: the stream and the message of a
        halted run read the same order."""
        seed = self.cfg.seed if self.cfg.dataset.shuffle else None
        return PassOrder.of(self.data.train_size, seed)

    def restore(self):
        """A resumed run's checkpoint, counted in the plan's micro-batches."""
        if self.cfg.resume:
            self.position = self._restored_position()
        self._recount_checkpoint()
        self._restore_stage()
        self._restore_recoveries()

    def _restored_position(self):
        """(epoch, micro-batches done in it) of the latest checkpoint, or (0, 0)."""
        job = self.job
        with self.strategy.scope():
            job.model.optimizer.build(job.model.trainable_variables)
        restored = self.state.restore(
            warn=lambda message: self.console.print(message, style="yellow", soft_wrap=True)
        )
        if restored is None:
            self.console.print(
                f"resume: no checkpoint in {self.run_dir} yet; starting from the beginning",
                soft_wrap=True,
            )
            return (0, 0)
        self.console.print(
            f"resume: from epoch {restored[0] + 1}, micro-batch {restored[1]} of it (update "
            f"{int(job.accumulator.optimizer_step.numpy())}, micro-step "
            f"{int(job.accumulator.micro_step.numpy())})",
            soft_wrap=True,
        )
        return restored

    def _restore_recoveries(self):
        """``oom=recover``'s count goes on from the recoveries before the resume (batch_plan.json
        keeps it): the next recovery's record and batch/oom_recoveries count them all."""
        count = (self.plan_file.read() or {}).get("oom_recoveries", 0) if self.cfg.resume else 0
        if not count:
            return
        if self.callbacks.window_start is not None:
            self.callbacks.window_start.count = count
        for reporter in self.callbacks.reporters():
            reporter.replan(self.plan, count)

    def _recount_checkpoint(self):
        """A run resumed after an out-of-memory error under XLA (:meth:`_stop_for_resume`): the
        checkpoint counts micro-batches of the old size; its position and open window are counted
        again in the new size, and saved so, before training goes on."""
        plan, accumulator = self.plan, self.job.accumulator
        saved = self.plan_file.read() or {}
        old = saved.pop("checkpoint_micro_batch_size", None)
        if old is None or old == plan.micro_batch_size:
            return
        ratio = old // plan.micro_batch_size
        accumulator.window_micro_steps.assign(accumulator.window_micro_steps * ratio)
        clock = self.callbacks.clock
        clock.layout = ChangedLayout(
            MicroBatchLayout(clock.layout.train_size, old * plan.replicas),
            int(accumulator.micro_step.numpy()),
            plan.global_micro_batch_size,
        )
        for reporter in self.callbacks.reporters():
            reporter.replan(plan, saved.get("oom_recoveries", 0))
        self.position = (self.position[0], self.position[1] * ratio)
        if self.chief and (self.position != (0, 0) or int(accumulator.optimizer_step.numpy())):
            self.state.save(*self.position)
        self.plan_file.write(saved)

    def fit(self):
        """fit() from ``position`` to the end of training; under ``oom=recover`` an out-of-memory
        error puts the open window back to its start, halves the micro-batch (doubling
        accum_steps) and goes on from the window's first sample."""
        with self.callbacks.checkpoint.signals:
            while True:
                try:
                    self.history = self._fit_from_position()
                    return
                except tf.errors.ResourceExhaustedError as error:
                    if disk_full(error):  # TensorFlow reports a full disk as exhausted too
                        raise
                    self._recover(error)

    def _fit_from_position(self):
        """fit() from ``position`` to the end of training, one call per segment; what the
        segments' fit() calls returned, metric name -> values per epoch."""
        cfg, plan, data, steps, job = self.cfg, self.plan, self.data, self.steps, self.job
        history = {}
        validation = None
        if data.validation is not None:
            validation = data.validation.batch(plan.global_micro_batch_size)
        # One fit() per epoch where a compiled call would run past an epoch's end, and where
        # accum_steps may change at the next epoch's start.
        per_epoch = steps.epoch_length % steps.steps_per_execution != 0 or bool(self.schedule)
        for first, end, count, offset in _segments(
            self.position, steps.epoch_length, cfg.epochs, per_epoch
        ):
            stream = micro_batch_stream(
                data.train,
                plan.global_micro_batch_size,
                steps.micro_batches,
                start=first * steps.epoch_length + offset,
                count=count * (end - first),
                order=self.order,
            )
            self._enter_stage(first, restored=offset > 0)
            self.callbacks.checkpoint.start_segment(first, offset)
            # A resumed epoch is a fit() of its own: its end is not the run's end.
            last = end == cfg.epochs
            with contextlib.nullcontext() if last else job.accumulator.fit_continues():
                try:
                    segment = job.model.fit(
                        stream,
                        validation_data=validation,
                        initial_epoch=first,
                        epochs=end,
                        steps_per_epoch=count,
                        verbose=0,
                        callbacks=self.callbacks.in_order,
                        shuffle=False,
                    )
                except NonFiniteError as error:
                    raise TrainingFailed(self._where_nonfinite(error.micro_step)) from None
            for key, values in segment.history.items():
                history.setdefault(key, []).extend(values)
        if not history:
            # Resumed after the last epoch's checkpoint: only the end of training is left, and
            # the last epoch's metrics are the ones kept with its checkpoint.
            job.model.optimizer.finalize_variable_values(job.model.trainable_variables)
            history = {key: [value] for key, value in self.state.epoch_logs(cfg.epochs).items()}
            if not history and data.validation is not None:
                # Kept by an older gacli without them: the validation metrics are measured again
                # on the final weights (the training ones cannot be).
                history = {
                    f"val_{key}": [value]
                    for key, value in job.model.evaluate(
                        validation, verbose=0, return_dict=True
                    ).items()
                }
        return history

    def _enter_stage(self, epoch, restored=False):
        """The stage of ``epoch`` under ``accum_schedule``: its accum_steps (under gns decided
        now, from the noise scale), recorded in the checkpointed StageTable, set in the engine and
        the reporters, and the learning rate scaled for its effective batch. ``restored``: the
        open window was restored from a checkpoint of this stage."""
        if self.schedule is None:
            return
        accumulator = self.job.accumulator
        accum_steps = self.stages.accum_steps(epoch)
        if not accum_steps:
            accum_steps = self._stage_accum_steps(epoch)
            self.stages.record(epoch, accum_steps, int(accumulator.optimizer_step.numpy()))
        self._set_stage(accum_steps, restored)
        if self.schedule.grows:  # the updates left, at this stage's accum_steps from now on
            window = self.cfg.partial_window.value
            left = updates_in_epoch(self.steps.micro_batches, accum_steps, window)
            done = self.stages.first_update(epoch)
            self.callbacks.progress.set_total(done + left * (self.cfg.epochs - epoch))

    def _set_stage(self, accum_steps, restored=False):
        """The plan, the engine, the reporters and the learning rate's scale at ``accum_steps``."""
        plan = self.plan
        if accum_steps != plan.accum_steps:
            self.plan = BatchPlan(plan.micro_batch_size, accum_steps, plan.replicas)
            spe = _steps_per_execution(self.cfg, self.plan, self.job.wrapper)
            self.steps = dataclasses.replace(self.steps, steps_per_execution=spe)
            set_accum_steps(self.job.model, accum_steps, spe, restored=restored)
            for reporter in self.callbacks.reporters():
                reporter.replan(self.plan, 0)
        self.job.scaled_rate.set_scale(self.schedule.learning_rate_factor(accum_steps))

    def _restore_stage(self):
        """A run resumed under ``accum_schedule`` is put in the stage of the last epoch its
        checkpoint started, as the uninterrupted run is at that point: what decides at the next
        epoch start (gns growth, which never goes below the current accum_steps; the learning
        rate's scale) and what result.json reports read the restored stage, not the configured
        accum_steps (tests/test_schedule_resume.py)."""
        if self.schedule is None:
            return
        started = [epoch for epoch in range(self.cfg.epochs) if self.stages.accum_steps(epoch)]
        if started:
            self._set_stage(self.stages.accum_steps(started[-1]), restored=True)

    def _stage_accum_steps(self, epoch):
        """accum_steps of an epoch not yet started: the fixed schedule's, or gns's decision."""
        schedule, plan = self.schedule, self.plan
        if not schedule.grows:
            return schedule.fixed[epoch]
        if epoch == 0:
            return schedule.start
        noise = self.job.accumulator.noise_scale()
        scale = noise["noise_scale"] if noise["windows"] else 0.0
        grown = grown_accum_steps(
            plan.accum_steps, scale, plan.global_micro_batch_size, schedule.largest
        )
        measured = f"~{scale:,.0f} (over {noise['windows']} windows)" if scale > 0 else "unmeasured"
        change = (
            f"accum_steps {plan.accum_steps} -> {grown} (effective batch "
            f"{plan.effective_batch_size} -> {grown * plan.global_micro_batch_size})"
            if grown != plan.accum_steps
            else f"accum_steps stays {grown} (effective batch {plan.effective_batch_size}"
            + (", at accum_schedule_max)" if grown >= schedule.largest else ")")
        )
        make_console().print(
            f"accum_schedule=gns: epoch {epoch + 1}: noise scale B_simple {measured}: {change}",
            soft_wrap=True,
        )
        if self.callbacks.logger is not None:
            self.callbacks.logger.write_scalars(
                int(self.job.accumulator.optimizer_step.numpy()),
                {
                    "schedule/noise_scale": scale,
                    "schedule/accum_steps": grown,
                    "schedule/effective_size": grown * plan.global_micro_batch_size,
                },
            )
        return grown

    def _recover(self, error):
        """After an out-of-memory error: the open window put back to its start and the job
        re-planned with half the micro-batch, or an error that says what to type."""
        cfg, plan = self.cfg, self.plan
        recover = cfg.oom == OutOfMemory.recover
        smaller = smaller_plan(plan)
        if recover and smaller is not None and cfg.jit_compile:
            self._stop_for_resume(smaller, error)
        rewound = self.callbacks.window_start.rewind() if recover else None
        if rewound is None or smaller is None:
            raise TrainingFailed(out_of_memory_message(plan, recover, error)) from None
        self.position = position_in(rewound, plan, smaller)
        self._replan(smaller, error)
        if cfg.checkpoint and is_chief():
            self.state.save(*self.position)
        self.plan_file.write(
            self.plan_file.record(
                self.plan, "oom=recover", oom_recoveries=self.callbacks.window_start.count
            )
        )

    def _stop_for_resume(self, smaller, error):
        """Under XLA an out-of-memory error leaves the variables unusable (TensorFlow 2.21 frees
        their memory when the compiled program fails to allocate: docs/guides/batch-size.md, "Out
        of memory in the middle of a run"), so the run stops; the smaller plan is recorded for
        resume=true, which goes on from the last checkpoint."""
        plan = self.plan
        saved = self.plan_file.read() or {}
        self.plan_file.write(
            self.plan_file.record(
                smaller,
                "oom=recover",
                oom_recoveries=saved.get("oom_recoveries", 0) + 1,
                # The checkpoints count micro-batches of this size until the next one is saved.
                checkpoint_micro_batch_size=saved.get(
                    "checkpoint_micro_batch_size", plan.micro_batch_size
                ),
            )
        )
        raise ProcessUnusable(
            f"Out of device memory at micro_batch_size={plan.micro_batch_size} "
            f"({oom_line(error)}) inside an XLA program (jit_compile=true), after which "
            "TensorFlow's variables cannot be used again in this process. Run the same command "
            "with resume=true: it goes on from the last checkpoint with micro_batch_size="
            f"{smaller.micro_batch_size} x accum_steps={smaller.accum_steps} (the same effective "
            f"batch of {plan.effective_batch_size})."
        )

    def _replan(self, plan, error):
        """The job set up for ``plan`` after an out-of-memory error."""
        self.plan = plan
        self.steps = plan_steps(self.cfg, plan, self.data.train_size)
        set_accum_steps(self.job.model, plan.accum_steps, self.steps.steps_per_execution)
        window_start = self.callbacks.window_start
        window_start.count += 1
        self.callbacks.clock.replan(plan, window_start.count)
        for reporter in self.callbacks.reporters():
            reporter.replan(plan, window_start.count)
        make_console().print(
            f"out of device memory ({oom_line(error)}); the window starts again with "
            f"micro_batch_size={plan.micro_batch_size} x accum_steps={plan.accum_steps} "
            f"(effective batch {plan.effective_batch_size} kept, recovery {window_start.count})",
            style="yellow",
            soft_wrap=True,
        )

    def _where_nonfinite(self, micro_step):
        """The message of a run halted on a non-finite gradient: where, which samples, what is
        kept."""
        data, plan, steps = self.data, self.plan, self.steps
        epoch_length, micro_batches = steps.epoch_length, steps.micro_batches
        index = micro_step - 1  # micro-batches are counted from 1 by the engine
        epoch, in_epoch = divmod(index, epoch_length)
        data_pass, in_pass = divmod(index, micro_batches)
        first = in_pass * plan.global_micro_batch_size
        last = min(first + plan.global_micro_batch_size, data.train_size)
        order = self.order.positions(data.train_size, data_pass)
        names = [data.sample_name(int(position)) for position in order[first:last]]
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        saved = self.state.latest()
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
            "skip_micro_batch would train on past such micro-batches instead. If they are not, "
            f"fix them and continue from the last checkpoint with resume={self.run_dir}."
        )

    def close(self):
        self.callbacks.close()
        self.state.close()

    def save_results(self):
        """model.keras (atomically), result.json and the summary table; the final metrics."""
        cfg, plan, run_dir, chief = self.cfg, self.plan, self.run_dir, self.chief
        model, accumulator = self.job.model, self.job.accumulator
        final = {key: float(values[-1]) for key, values in self.history.items()}
        # Equal on every worker of a run, and across runs that trained the same way.
        fingerprint = hashlib.sha256(
            b"".join(np.ascontiguousarray(weight).tobytes() for weight in model.get_weights())
        ).hexdigest()[:16]
        if cfg.checkpoint:
            # Every worker saves (reading the accumulators is a collective); only the chief keeps
            # it. Written under another name first: a model.keras that exists is a whole one.
            saved = _save_model(model, run_dir, chief)
            if saved != "model.keras":
                self.console.print(
                    f"The model cannot be saved whole (it defines no get_config), "
                    f"so its weights are in {saved}: build the model again and call "
                    f"model.load_weights('{saved}').",
                    soft_wrap=True,
                )
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
                tf32=self.tf32,
            )
            if self.stages is not None:
                result["samples_seen"] = self.callbacks.clock.layout.samples_before(micro_steps)
                result["accum_schedule"] = self.stages.stages(updates, plan.global_micro_batch_size)
            write_result(run_dir, result)
        rows = {key: f"{value:.4f}" for key, value in final.items()}
        rows["updates / micro-batches"] = f"{updates} / {micro_steps}"
        rows["effective batch"] = plan.effective_batch_size
        if self.stages is not None:
            rows["stages"] = ", ".join(
                f"{stage['effective_batch_size']} from epoch {stage['epoch'] + 1} "
                f"({stage['updates']} updates)"
                for stage in self.stages.stages(updates, plan.global_micro_batch_size)
            )
        if noise is not None:
            rows["noise scale"] = noise_scale_verdict(plan.effective_batch_size, noise)
        rows["weights sha256"] = fingerprint
        summary_table(self.console, rows)
        self.console.print(f"run directory: {run_dir}", soft_wrap=True)
        return final


def _save_model(model, run_dir, chief):
    """Write the trained model into ``run_dir`` atomically: ``model.keras``, or where the model
    cannot be serialised (a subclassed model without ``get_config``) its weights,
    ``model.weights.h5``; the name written. Every worker saves (reading the accumulators is a
    collective); only the chief keeps it. Written under another name first: a file that exists
    is a whole one."""
    # The weights alone are the user's own model's, so that they load into it as it is built.
    own = model.model if isinstance(model, AccumulatingModelWrapper) else model
    for name, save in (("model.keras", model.save), ("model.weights.h5", own.save_weights)):
        path = scratch_or(os.path.join(run_dir, f".writing-{name}"), chief)
        try:
            save(path)
        except NotImplementedError:
            with contextlib.suppress(OSError):
                os.remove(path)
            if name == "model.keras":
                continue  # no get_config: the weights instead
            raise
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(path)  # a disk that filled up: no half-written file stays
            raise
        if chief:
            os.replace(path, os.path.join(run_dir, name))
        else:
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)
        return name


def disk_full(error):
    """Whether ``error`` (an OSError, or TensorFlow's, which reports ENOSPC as a resource
    exhausted) is a full disk."""
    if isinstance(error, OSError):
        return error.errno == errno.ENOSPC
    return "No space left on device" in str(error)


def disk_full_message(run_dir, error):
    """Why a run stopped on a full disk, and what to do."""
    free = shutil.disk_usage(run_dir).free if os.path.isdir(run_dir) else 0
    return (
        f"the disk of {run_dir} is full ({free / 2**20:.1f} MiB free; "
        f"{str(error).splitlines()[0][:160]}). This is disk space, not device memory. Free some "
        "space on it, then continue with resume="
        f"{run_dir}: the checkpoints written whole are kept and a half-written one is passed "
        "over. Or start again with hydra.run.dir on a disk with room."
    )


@dataclasses.dataclass
class RunCallbacks:
    """The callbacks a :class:`Run` made, each by its name; ``None`` where the job has none."""

    clock: TrainingClock
    progress: ProgressCallback
    logger: RunLogger | None  # the chief's: TensorBoard's, metrics.csv, MLflow (logger=)
    checkpoint: RunCheckpoint
    precise_batchnorm: object = None  # batchnorm=precise
    window_start: WindowStart | None = None  # oom=recover
    fault: object = None  # GACLI_FAKE_OOM_ABOVE's (gacli.runner.faults)
    skip_budget: SkipBudget | None = None  # a non-finite policy that skips
    user: list = dataclasses.field(default_factory=list)  # the callbacks= list's, called last

    @functools.cached_property
    def in_order(self):
        """fit()'s list: the engine's window closer and non-finite stop first (a halted step is
        neither logged nor saved; the model wrappers' fit() would add them too, a plain model's
        would not); then the clock before the readers of its time; the precise batch-norm
        statistics after the callbacks that close an epoch's window, so that they see its last
        update; the skip budget, which fails a run before its epoch is saved; the checkpoint;
        the window start and the fault; the user's own callbacks last."""
        reporting = [self.clock, *self.reporters()]
        later = (
            self.precise_batchnorm,
            self.skip_budget,
            self.checkpoint,
            self.window_start,
            self.fault,
        )
        accumulator = self.clock.accumulator
        ours = accumulation_callbacks(accumulator, reporting) + [c for c in later if c is not None]
        return ours + list(self.user)

    def reporters(self):
        """The callbacks that show the plan: told when it changes."""
        return [c for c in (self.progress, self.logger) if c is not None]

    def close(self):
        for reporter in self.reporters():
            reporter.close()


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
    if task == "regression":
        return keras.losses.MeanSquaredError(), [
            keras.metrics.MeanAbsoluteError(name="mae"),
            keras.metrics.RootMeanSquaredError(name="rmse"),
        ]
    if task == "segmentation" and num_outputs == 1:
        return keras.losses.BinaryCrossentropy(from_logits=True), [
            keras.metrics.BinaryIoU(target_class_ids=[1], threshold=0.0, name="iou")
        ]
    if task == "segmentation":
        return keras.losses.CategoricalCrossentropy(from_logits=True), ["accuracy"]
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True), [
        keras.metrics.SparseCategoricalAccuracy(name="accuracy")
    ]


def job_loss_and_metrics(cfg, task, num_outputs):
    """The job's loss and compiled metrics: its ``loss`` and ``metrics`` settings where given
    (:mod:`gacli.runner.targets` builds them), else the task's (:func:`loss_and_metrics`)."""
    loss, metrics = loss_and_metrics(task, num_outputs)
    own_loss = build_loss(cfg.get("loss"))
    if cfg.get("metrics") is not None:
        metrics = build_metrics(cfg.metrics)
    return (loss if own_loss is None else own_loss), metrics


def _model_shapes(model, data):
    """(input shape, output shape) of ``model`` without the batch axis; the input shape is None
    for data whose inputs are a dict. A subclassed model knows them only once called: it is
    called on the data's first sample, which builds it (as its first training step would)."""
    named_inputs = isinstance(data.input_shape, dict)
    try:
        if not named_inputs:
            return tuple(model.input_shape[1:]), tuple(model.output_shape[1:])
    except (AttributeError, ValueError):
        pass
    sample = next(iter(data.train.take(1).batch(1)))[0]
    try:
        outputs = model(sample, training=False)
    except (ValueError, TypeError, KeyError, tf.errors.InvalidArgumentError) as error:
        raise ConfigError(
            f"the model ({type(model).__name__}) cannot be called on the dataset's inputs of "
            f"shape {data.input_shape}: {str(error).splitlines()[0][:300]}; build the model "
            "for the data (a factory or model._target_ gets the data's shape as input_shape)."
        ) from None
    first = tf.nest.flatten(outputs)[0]
    return (None if named_inputs else tuple(data.input_shape)), tuple(first.shape[1:])


def _check_fits(model, data, own_loss=False):
    """A clear error, before training, when the data's shapes do not fit the model; with a loss
    of the user's own (``own_loss``), which decides what the outputs mean, only the inputs."""
    expected, output = _model_shapes(model, data)
    given = data.input_shape
    if expected is not None and (
        len(expected) != len(given) or any(e not in (None, g) for e, g in zip(expected, given))
    ):
        raise ConfigError(
            f"the model takes inputs of shape {expected} but the dataset gives {tuple(given)}; "
            "choose a model built for the data (a factory gets the data's shape), or resize image "
            "data (dataset.image_size=, dataset.channels= for image_folder and shapes)."
        )
    if own_loss:
        return
    if data.task == "classification" and output[-1] != data.num_outputs:
        raise ConfigError(
            f"the model has {output[-1]} outputs but the data has {data.num_outputs} classes; "
            f"build the model for {data.num_outputs} classes (model.kwargs for a factory), or "
            "give the data the classes the model predicts."
        )
    if data.task == "regression" and output != (data.num_outputs,):
        raise ConfigError(
            f"the model predicts outputs of shape {output} but the data's targets have "
            f"{data.num_outputs} value(s) a sample; build the model with {data.num_outputs} "
            "linear outputs (model.kwargs for a factory), or give targets of its width."
        )
    if data.task == "segmentation" and output[:-1] != tuple(data.label_shape[:-1]):
        raise ConfigError(
            f"the model predicts masks of shape {output} but the data's masks are "
            f"{tuple(data.label_shape)}; give masks of the image's height and width."
        )


def _nonfinite_policy(precision):
    """The configured ``precision.nonfinite``; unset, the library's default under
    ``mixed_float16`` (loss scaling's skip: an overflow there is routine, the scale halves and
    training goes on) and ga-train's own otherwise."""
    if precision.nonfinite is not None:
        return precision.nonfinite
    if precision.policy == Policy.mixed_float16:
        return None  # AccumulationConfig.for_policy fills it in
    return NONFINITE_WITHOUT_LOSS_SCALING


def _check_validation_split(cfg, data):
    """ConfigError, before anything is built, when ``dataset.validation_split`` asks for
    validation data and the split leaves none: the run would log no val_ metric, and its
    objective (val_loss by default) would be missing only once training had ended."""
    split = cfg.dataset.validation_split
    if not split or data.validation_size:
        return
    total = data.train_size + data.validation_size
    smallest = f"a larger split, e.g. dataset.validation_split={float(f'{1.0 / total:.2g}')}, or "
    raise ConfigError(
        f"the validation split is empty: dataset {shown_name(cfg.dataset)} holds {total} samples, "
        f"and dataset.validation_split={split} of them rounds to 0 for validation, so this run "
        "would log no val_loss to report or compare. Use "
        + (smallest if total > 1 else "")
        + "dataset.validation_split=0 to train on every sample without validation (the "
        "objective is then loss), or more data."
    )


def _check_batch_fits_data(cfg, plan, train_size):
    """ConfigError when a micro-batch, or a window meant to lie within one pass, is larger than
    the training set: each update would see fewer samples than the configured batch."""
    windows_span_passes = (
        cfg.steps_per_epoch is not None or cfg.partial_window == PartialWindow.carry
    )
    if train_size == 0:
        raise ConfigError(
            f"the training set is empty: dataset {shown_name(cfg.dataset)} leaves no sample for "
            f"training after validation_split={cfg.dataset.validation_split} takes its share for "
            "validation. Lower dataset.validation_split (e.g. dataset.validation_split=0.2), or "
            "give more data."
        )
    if plan.global_micro_batch_size > train_size:
        per_replica = " x replicas" if plan.replicas > 1 else ""
        raise ConfigError(
            f"micro_batch_size{per_replica} = {plan.global_micro_batch_size} is larger than the "
            f"training set, which holds {train_size} samples (dataset "
            f"{shown_name(cfg.dataset)}, after validation_split={cfg.dataset.validation_split}): "
            "every micro-batch would hold "
            f"{train_size} samples, not {plan.global_micro_batch_size}. Use a smaller "
            f"micro_batch_size, e.g. micro_batch_size={max(1, train_size // (2 * plan.replicas))}"
            ", or more data."
        )
    if plan.effective_batch_size > train_size and not windows_span_passes:
        fitting = train_size // plan.global_micro_batch_size
        if cfg.get("accum_schedule") is not None:
            # Not partial_window=carry: a schedule changes accum_steps where a window closes.
            raise ConfigError(
                f"accum_schedule reaches accum_steps={plan.accum_steps}, an effective batch of "
                f"{plan.effective_batch_size}, larger than the training set, which holds "
                f"{train_size} samples (dataset {shown_name(cfg.dataset)}, after validation_split="
                f"{cfg.dataset.validation_split}): every update would see {train_size} samples. "
                + (
                    f"Start accum_schedule=gns from accum_steps={fitting} or less"
                    if cfg.accum_schedule == "gns"
                    else f"Keep every stage at accum_steps={fitting} or less, e.g. "
                    + (f"'accum_schedule={{0:1,1:{fitting}}}'" if cfg.epochs > 1 else "")
                    + (f"'accum_schedule={{0:{fitting}}}'" if cfg.epochs == 1 else "")
                )
                + f" (effective batch {fitting * plan.global_micro_batch_size}), or use a "
                "smaller micro_batch_size, or more data."
            )
        raise ConfigError(
            f"effective_batch_size = {plan.effective_batch_size} is larger than the training set, "
            f"which holds {train_size} samples (dataset {shown_name(cfg.dataset)}, after "
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
        if now["monitor"]["gns"] and not before.get("monitor", {}).get("gns", False):
            raise ConfigError(
                f"resume: {run_dir} was started without monitor.gns, so its checkpoints hold no "
                "noise-scale state to go on from. Resume without monitor.gns=true (the noise "
                "scale can be measured in a new run), or start a new run with it."
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


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """How the data is cut into micro-batches, epochs and updates for one :class:`BatchPlan`."""

    micro_batches: int  # per pass over the training data
    epoch_length: int  # micro-batches per epoch (steps_per_epoch x accum_steps, when set)
    fit_steps: int | None  # steps_per_epoch given to fit(), or None for a whole pass
    total_updates: int
    steps_per_execution: int
    # At the plan's accum_steps (an accumulation schedule's first stage); partial_window=carry:
    # on average, a fraction.
    updates_per_epoch: float = 0


def plan_steps(cfg, plan, train_size, schedule=None):
    """The :class:`StepPlan` of a job whose training set holds ``train_size`` samples (and
    follows ``schedule``, an :class:`~gacli.runner.accum_schedule.AccumSchedule`, when set)."""
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
    total_updates = math.ceil(updates_per_epoch * cfg.epochs)
    if schedule is not None:
        total_updates = schedule.total_updates(micro_batches, cfg.epochs, cfg.partial_window.value)
    return StepPlan(
        micro_batches,
        fit_steps or micro_batches,
        fit_steps,
        total_updates,
        _steps_per_execution(cfg, plan, wrapper),
        updates_per_epoch,
    )


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
    job = build_job(probed, first, data, plan_steps(cfg, first, data.train_size), strategy)
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
        spe = _steps_per_execution(self.cfg, sized, self.job.wrapper)
        set_accum_steps(self.job.model, sized.accum_steps, spe)

    def finished(self, probe):
        self.console.print(probe.row(), soft_wrap=True)


def accumulation_config(cfg, plan):
    """The job's :class:`~gacli.AccumulationConfig` (loss scaling follows the precision policy,
    which is set when the model is built)."""
    return AccumulationConfig(
        accum_steps=plan.accum_steps,
        partial_window=cfg.partial_window,
        loss_normalization=cfg.loss_normalization,
        use_agc=cfg.optimizer.use_agc,
        clip_factor=cfg.optimizer.clip_factor,
        nonfinite=_nonfinite_policy(cfg.precision),
        noise_scale=cfg.monitor.gns,
        noise_scale_every=cfg.monitor.gns_every,
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
    fault: object = None  # GACLI_FAKE_OOM_ABOVE's callback (gacli.runner.faults), when set
    scaled_rate: ScaledLearningRate | None = None  # accum_schedule: the stage's learning rate

    def facts(self, cfg, plan, data, steps, strategy):
        """The start-up panel's lines."""
        replicas = strategy.num_replicas_in_sync
        layers = self.batchnorm_layers
        return {
            "wrapper": self.reason,
            "model": f"{cfg.model.factory or shown_name(cfg.model)} "
            f"({self.model.count_params():,} parameters)",
            "data": f"{shown_name(cfg.dataset)}: {data.train_size} train / "
            f"{data.validation_size} val samples, inputs {_shapes(data.input_shape)}",
            "updates": f"{steps.total_updates} in {cfg.epochs} epochs, "
            f"{steps.epoch_length} micro-batches per epoch",
            "compiled calls": f"{steps.steps_per_execution} micro-batches each "
            "(steps_per_execution)",
            "precision": cfg.precision.policy.value,
            "tf32": f"{cfg.tf32.value}: {tf32_description(tf32_enabled())}",
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


def _shapes(input_shape):
    """An input shape as the panel shows it: (8, 8, 1), or {pixels: (8, 8, 1), ...}."""
    if isinstance(input_shape, dict):
        return (
            "{" + ", ".join(f"{name}: {tuple(shape)}" for name, shape in input_shape.items()) + "}"
        )
    return str(tuple(input_shape))


def build_job(cfg, plan, data, steps, strategy):
    """Model, batch-norm policy, inner optimizer and accumulation wrapper, compiled."""
    wrapper, reason = choose_wrapper(cfg)
    loss, metrics = job_loss_and_metrics(cfg, data.task, data.num_outputs)
    check_metric(
        metric_name(cfg.objective, cfg.dataset.validation_split),
        [m if isinstance(m, str) else m.name for m in metrics],
        validation=bool(cfg.dataset.validation_split),
    )
    settings = accumulation_config(cfg, plan)
    with strategy.scope():
        keras.utils.set_random_seed(cfg.seed)
        model = build_model(cfg.model, data.input_shape, data.num_outputs, data.task)
        _check_fits(model, data, own_loss=OmegaConf.select(cfg, "loss._target_") is not None)
        batchnorm_layers = len(plain_batchnorm_layers(model))
        model = apply_batchnorm_policy(model, cfg.batchnorm.value, plan.accum_steps, warn=False)
        rate = learning_rate_schedule(cfg.optimizer, plan.effective_batch_size, steps.total_updates)
        scaled_rate = ScaledLearningRate(rate) if cfg.get("accum_schedule") is not None else None
        inner = build_optimizer(
            cfg.optimizer, plan.effective_batch_size, steps.total_updates, scaled_rate
        )
        model, optimizer = _with_accumulation(model, inner, wrapper, settings)
        with warnings.catch_warnings():
            # The start-up panel's batch norm line says it, with the batchnorm= to choose.
            warnings.simplefilter("ignore", BatchNormWarning)
            model.compile(
                optimizer=optimizer,
                loss=loss,
                metrics=metrics,
                jit_compile=cfg.jit_compile,
                auto_scale_loss=False,
                steps_per_execution=steps.steps_per_execution,
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
        scaled_rate,
    )


def _with_accumulation(model, inner, wrapper, settings):
    """(model, optimizer) to compile: the model wrapped and the inner optimizer, or the model as
    it is and the inner optimizer wrapped."""
    if wrapper is Wrapper.model:
        model = wrap_model(model, config=settings)
        # The callbacks read the counters from each call's logs where the model can return them
        # (one replica, not a TPU); elsewhere they read the variables after each call.
        model.counters_in_logs = True
        return model, inner
    from gacli.engine.clipping import agc_unit_axes

    axes = agc_unit_axes(model) if settings.use_agc else None
    return model, GradientAccumulateOptimizer(inner, config=settings, agc_unit_axes=axes)


def _write_resolved(cfg, plan, steps, job, run_dir):
    """``resolved.yaml``: the config with the batch arithmetic, written once per run."""
    if os.path.exists(os.path.join(run_dir, "resolved.yaml")):
        return
    resolved = _resolved(cfg, plan, steps, job)
    OmegaConf.save(OmegaConf.create(resolved), os.path.join(run_dir, "resolved.yaml"))


def _resolved(cfg, plan, steps, job):
    """The config with the batch arithmetic under ``resolved``: ``resolved.yaml``'s content, and
    an MLflow run's parameters."""
    resolved = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    resolved["resolved"] = {
        "micro_batch_size": plan.micro_batch_size,
        "accum_steps": plan.accum_steps,
        "replicas": plan.replicas,
        "effective_batch_size": plan.effective_batch_size,
        "optimizer_updates": steps.total_updates,
        "updates_per_epoch": steps.updates_per_epoch,
        "wrapper": job.wrapper.value,
    }
    return resolved


def _hparams(cfg, plan, job):
    """What TensorBoard's HParams tab compares runs by."""
    return {
        "accum_steps": plan.accum_steps,
        "micro_batch_size": plan.micro_batch_size,
        "effective_batch_size": plan.effective_batch_size,
        "precision": cfg.precision.policy.value,
        "tf32": tf32_enabled(),
        "strategy": cfg.strategy.name.value,
        "wrapper": job.wrapper.value,
        "model": cfg.model.factory or shown_name(cfg.model),
        "lr": float(cfg.optimizer.learning_rate),
        "optimizer": shown_name(cfg.optimizer),
    }


def _schedule_line(schedule, plan):
    """The start-up panel's line on the accumulation schedule."""
    per_update = plan.global_micro_batch_size
    if schedule.grows:
        return (
            f"gns: accum_steps {schedule.start} (effective batch {schedule.start * per_update}), "
            f"grown at epoch starts with the noise scale up to {schedule.largest} "
            f"({schedule.largest * per_update}); lr_scaling={schedule.rule}"
        )
    stages, last = [], None
    for epoch, accum in enumerate(schedule.fixed):
        if accum != last:
            stages.append(f"epoch {epoch + 1}: {accum} ({accum * per_update})")
            last = accum
    return f"accum_steps (effective batch) {', '.join(stages)}; lr_scaling={schedule.rule}"


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
