"""``train(cfg) -> metrics``: one ``ga-train`` job, from a composed config to a trained model.

The Hydra entry point (:mod:`gacli.runner.command.cli`) only composes the config and calls this;
tests call it directly. A :class:`Run` owns the job: its plan (a value that only
:func:`gacli.runner.plan.job_plan.make_plan` makes, printed at start and logged), the model and
engine (:mod:`gacli.runner.builders.job`), the data stream and its order, its callbacks,
checkpoints and resume, the out-of-memory re-plan and the result. The functions around it take
what they use, and can be run one by one.
"""

import contextlib
import dataclasses
import errno
import functools
import logging
import os
import shutil

import keras
import tensorflow as tf
from omegaconf import OmegaConf

from gacli.engine.accumulate_model import (
    AccumulatingModelWrapper,
    accumulation_callbacks,
    set_accum_steps,
)
from gacli.engine.accumulation import (
    NonFiniteError,
)
from gacli.engine.model_graph import is_functional, sublayers
from gacli.engine.options import BatchNormPolicy
from gacli.engine.precise_batchnorm import PreciseBatchNorm
from gacli.engine.tf32 import tf32_enabled, tf32_mode, tf32_used
from gacli.errors import ConfigError, Interrupted, ProcessUnusable, TrainingFailed
from gacli.rundir import (
    CHECKPOINT_DIR,
    check_writable,
    is_chief,
    write_result,
)
from gacli.runner.builders.data import load_dataset
from gacli.runner.builders.job import build_job, precision_policy
from gacli.runner.builders.targets import (
    build_callbacks,
    callback_parts,
    import_roots,
    raised_by,
)
from gacli.runner.cluster.lost_worker import is_lost_worker, lost_worker_error
from gacli.runner.cluster.strategy import is_multi_worker, make_strategy
from gacli.runner.config.schema import (
    OutOfMemory,
    shown_name,
)
from gacli.runner.plan.accum_schedule import (
    StageTable,
    grown_accum_steps,
    updates_in_epoch,
)
from gacli.runner.plan.auto_micro_batch import (
    BatchPlanFile,
    result_fields,
    settle_plan,
)
from gacli.runner.plan.batch import resolve_batch
from gacli.runner.plan.job_plan import PlanSettings, make_plan
from gacli.runner.plan.out_of_memory import (
    WindowStart,
    oom_line,
    out_of_memory_message,
    position_in,
)
from gacli.runner.plan.steps import (
    check_validation_split,
)
from gacli.runner.reporting.console import (
    ProgressCallback,
    make_console,
    startup_panel,
    summary_table,
)
from gacli.runner.reporting.memory import reset_memory_peaks
from gacli.runner.reporting.run_logs import RunLogger, host_memory_bytes, open_writers
from gacli.runner.reporting.throughput import ChangedLayout, MicroBatchLayout, TrainingClock
from gacli.runner.reporting.writers import check_logger_files, ended_with_the_job
from gacli.runner.training.resume import guard_run_dir
from gacli.runner.training.run_state import (
    EpochWeights,
    OneTraining,
    PassOrder,
    RunCheckpoint,
    RunState,
    StopSignals,
    micro_batch_stream,
    scratch_or,
    weights_fingerprint,
)
from gacli.runner.training.skip_budget import NoGradientStop, SkipBudget, check_trained


def train(cfg, run_dir, given=(), parallel_jobs=False):
    """Train the job described by ``cfg`` (the arguments are :class:`Run`'s) and return its final
    metrics: a dict of the last epoch's ``loss``, ``val_loss``, ..."""
    return Run(cfg, run_dir, given, parallel_jobs).execute()


class Run:
    """One ``ga-train`` job, from its plan to its result.

    Its steps, in :meth:`execute`: check the run directory; plan the batch; load the data; settle
    the plan (a probed or kept micro-batch) and the steps; build the model and engine; make the
    callbacks; restore a checkpoint; fit, re-planning after an out-of-memory error; save the
    results. What one step makes, the next reads from the run: ``plan``, ``data``, ``steps``,
    ``job``, ``callbacks``, ``state``, ``position``.

    Args:
        cfg: a composed :class:`~gacli.runner.config.schema.TrainConfig` (DictConfig).
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
        self.asked = None  # the batch arithmetic asked for: a BatchPlan, or an AutoPlan to probe
        # The JobPlan (gacli.runner.plan.job_plan): a value, replaced by a stage's or an
        # out-of-memory recovery's, never changed.
        self.plan = None
        self.data = None
        self.job = None
        self.callbacks = None
        self.state = None
        self.position = (0, 0)  # (epoch, micro-batches done in it) that fit() starts from
        self.chosen = {}  # start-up panel lines on how the micro-batch was chosen
        self.history = {}  # metric name -> values per epoch, of the fit() that finished
        self.stages = None  # its StageTable: each epoch's accum_steps, checkpointed
        self.announced = False  # the run directory's line has been printed
        # Whether float32 products run in TF32 while the job runs: cfg.tf32 applied, on a GPU
        # that has it (on a CPU, false whatever the setting).
        self.tf32 = None
        self.user_callbacks = []  # the callbacks= list's, built before the model

    def execute(self):
        """The job's steps; the last epoch's metrics."""
        self.check_run_dir(announce=False)
        self.plan_batch()
        with precision_policy(self.cfg.precision.policy), tf32_mode(self.cfg.tf32) as tf32:
            self.tf32 = tf32_used(tf32)
            self.load_data()
            check_validation_split(self.cfg, self.data)  # a check=equivalence needs none
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
        guard_run_dir(self.cfg, self.run_dir)
        if is_chief():
            # Found now, not at the first save after an epoch of training.
            check_writable(self.run_dir, "the run directory")
            if self.cfg.checkpoint:
                check_writable(os.path.join(self.run_dir, CHECKPOINT_DIR), "the checkpoint folder")
            check_logger_files(self.cfg, self.run_dir)  # metrics.csv, MLflow's store

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
        self.asked = resolve_batch(
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
        """The micro-batch probed or kept from before; the plan made from it, checked against the
        data."""
        settled, self.chosen = settle_plan(
            self.cfg, self.asked, self.data, self.strategy, self.run_dir, self.announce_run_dir
        )
        self.plan = make_plan(PlanSettings.of(self.cfg), self.data.train_size, settled)
        if self.schedule is not None:
            self.chosen["accum schedule"] = _schedule_line(self.schedule, settled)

    @property
    def steps(self):
        """The plan's StepPlan."""
        return self.plan.steps

    @property
    def schedule(self):
        """The plan's AccumSchedule of accum_schedule, when set."""
        return self.plan.schedule

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
        if self.job.batchnorm_warning:
            self.console.print(self.job.batchnorm_warning, style="yellow", soft_wrap=True)
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
        if accumulator.nonfinite is not None:
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
            no_gradient=NoGradientStop(accumulator),
            # Only with callbacks of the user's own, which may set the weights back.
            epoch_weights=EpochWeights(accumulator) if self.user_callbacks else None,
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
                    check_trained(self.job.accumulator)
                    return
                except tf.errors.ResourceExhaustedError as error:
                    if disk_full(error):  # TensorFlow reports a full disk as exhausted too
                        raise
                    self._recover(error)
                except tf.errors.OpError as error:
                    if not (is_multi_worker(self.strategy) and is_lost_worker(error)):
                        raise
                    raise lost_worker_error(
                        error,
                        self.run_dir,
                        self.state.latest(),
                        self.cfg.strategy.peer_timeout_seconds,
                    ) from error
                except Exception as error:
                    failed = self._users_code_failed(error)
                    if failed is None:
                        raise
                    raise failed from error

    def _users_code_failed(self, error):
        """TrainingFailed naming the user's loss, metric, callback or model that raised
        ``error`` inside fit(), where it stopped and what is kept; None for an error not raised
        by the user's code, or one that already says what to do."""
        if isinstance(error, (ConfigError, TrainingFailed, Interrupted)):
            return None
        own = self.job.own + callback_parts(self.cfg.get("callbacks"), self.user_callbacks)
        found = raised_by(error, own)
        if found is None:
            return None
        key, raised = found
        checkpoint = self.callbacks.checkpoint
        saved = self.state.latest()
        kept = (
            f"The last checkpoint, {saved} (epoch {int(self.state.epoch.numpy()) + 1}, "
            f"micro-batch {int(self.state.micro_batch.numpy())}), is kept: fix that code, then "
            f"continue from it with resume={self.run_dir} (the same command with resume=true)."
            if saved
            else "No checkpoint was written before it: fix that code and run the command again."
        )
        return TrainingFailed(
            f"training stopped at epoch {checkpoint.epoch + 1}, after micro-batch "
            f"{checkpoint.done} of {self.steps.epoch_length}: {key} raised {raised}. {kept} "
            "HYDRA_FULL_ERROR=1 shows where it raised."
        )

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
            self.callbacks.user_training.last = last
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
            if self._stopped_by_a_callback(last, segment.history):
                break
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

    def _stopped_by_a_callback(self, last, logs):
        """Whether a callback of the user's stopped training (EarlyStopping) in a fit() that was
        not the run's last (``last``): training then ends as the last fit() would have ended it,
        with the open window applied and the optimizer's EMA written, and then the user's
        callbacks told (EarlyStopping sets its best epoch's weights back). ``logs``: that fit()'s,
        metric -> values."""
        job = self.job
        if last or not job.model.stop_training:
            return False
        job.model.optimizer.finalize_variable_values(job.model.trainable_variables)
        self.callbacks.user_training.last = True
        self.callbacks.user_training.on_train_end({key: v[-1] for key, v in logs.items() if v})
        return True

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
        if accum_steps != self.plan.accum_steps:
            self.plan = self.plan.at_stage(accum_steps)
            spe = self.steps.steps_per_execution
            set_accum_steps(self.job.model, accum_steps, spe, restored=restored)
            for reporter in self.callbacks.reporters():
                reporter.replan(self.plan, 0)
        self.job.scaled_rate.set_scale(self.schedule.learning_rate_factor(accum_steps))

    def _restore_stage(self):
        """A run resumed under ``accum_schedule`` is put in the stage of the last epoch its
        checkpoint started, as the uninterrupted run is at that point: what decides at the next
        epoch start (gns growth, which never goes below the current accum_steps; the learning
        rate's scale) and what result.json reports read the restored stage, not the configured
        accum_steps (tests/runner/plan/test_schedule_resume.py)."""
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
        smaller = plan.halved()
        if recover and smaller is not None and cfg.jit_compile:
            self._stop_for_resume(smaller, error)
        rewound = self.callbacks.window_start.rewind() if recover else None
        if rewound is None or smaller is None:
            raise TrainingFailed(out_of_memory_message(plan.batch, recover, error)) from None
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
        fingerprint = weights_fingerprint(model)
        final, weights_from = self._final_metrics(fingerprint)
        if cfg.checkpoint:
            # Every worker saves (reading the accumulators is a collective); only the chief keeps
            # it. Written under another name first: a model.keras that exists is a whole one.
            saved, why = _save_model(model, run_dir, chief)
            if saved != "model.keras":
                self.console.print(
                    f"The model cannot be saved whole: {why}. Its weights are in {saved}: build "
                    f"the model again and call model.load_weights('{saved}').",
                    soft_wrap=True,
                )
        updates = int(accumulator.optimizer_step.numpy())
        micro_steps = int(accumulator.micro_step.numpy())
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
                **weights_from,
                **result_fields(cfg, plan, self.plan_file.read()),
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
        if weights_from:
            rows["weights"] = (
                f"epoch {weights_from['weights_epoch']}'s (update "
                f"{weights_from['weights_optimizer_step']}), set back by a callback: the metrics "
                "above are that epoch's"
            )
        rows["weights sha256"] = fingerprint
        summary_table(self.console, rows)
        self.console.print(f"run directory: {run_dir}", soft_wrap=True)
        return final

    def _final_metrics(self, fingerprint):
        """The metrics of the weights the run ends with (``fingerprint``), metric -> value: the
        last epoch's, or where a callback set the weights back to an earlier epoch's
        (EarlyStopping's restore_best_weights) that epoch's; and then, for result.json, which
        epoch that is and the updates its weights had (else {})."""
        final = {key: float(values[-1]) for key, values in self.history.items()}
        recorder = self.callbacks.epoch_weights
        set_back = recorder.set_back_to(fingerprint) if recorder is not None else None
        if set_back is None:
            return final, {}
        final = {key: set_back.logs[key] for key in final if key in set_back.logs}
        return final, {
            "weights_epoch": set_back.epoch + 1,
            "weights_optimizer_step": set_back.optimizer_step,
        }


def _save_model(model, run_dir, chief):
    """Write the trained model into ``run_dir`` atomically: ``model.keras``, or where
    ``keras.saving.load_model`` could not rebuild the model from it (:func:`not_loadable_whole`)
    its weights, ``model.weights.h5``; (the name written, why not whole or None). Every worker
    saves (reading the accumulators is a collective); only the chief keeps it. Written under
    another name first: a file that exists is a whole one."""
    # The weights alone are the user's own model's, so that they load into it as it is built.
    own = model.model if isinstance(model, AccumulatingModelWrapper) else model
    why = not_loadable_whole(own)
    choices = [("model.weights.h5", own.save_weights)]
    if why is None:
        choices.insert(0, ("model.keras", model.save))
    for name, save in choices:
        path = scratch_or(os.path.join(run_dir, f".writing-{name}"), chief)
        try:
            save(path)
        except NotImplementedError as error:
            with contextlib.suppress(OSError):
                os.remove(path)
            if name == "model.keras":
                # A layer whose config Keras cannot make (arguments it cannot serialise).
                why = f"Keras cannot make its config: {_one_line(error)}"
                continue
            raise
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(path)  # a disk that filled up: no half-written file stays
            raise
        if chief:
            os.replace(path, os.path.join(run_dir, name))
        else:
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)
        return name, why


# Packages whose classes keras.saving.load_model finds by their module, unregistered.
_FOUND_BY_MODULE = ("keras", "keras_hub", "keras_cv", "keras_nlp")


def not_loadable_whole(model):
    """Why ``keras.saving.load_model``, in a new process after ``import gacli``, could not rebuild
    ``model`` from a ``model.keras``; None when it could. Every layer in it (itself included)
    must be of a class Keras finds (Keras' or KerasHub's own, or one registered with
    ``@keras.saving.register_keras_serializable()``), and no subclassed model may rely on Keras'
    automatic config: for a model, Keras makes it from the defaults of ``__init__``, not from the
    arguments it was built with (its weights would not fit what it builds)."""
    for layer in sublayers(model, include_self=True):
        cls = type(layer)
        if cls.__module__.split(".")[0] in _FOUND_BY_MODULE:
            continue
        name = f"{cls.__module__}.{cls.__qualname__}"
        registered = keras.saving.get_registered_name(cls)
        if keras.saving.get_registered_object(registered) is not cls:
            return (
                f"{name} is not registered with @keras.saving.register_keras_serializable(), "
                "so keras.saving.load_model cannot find it"
            )
        own_config = any(
            "get_config" in vars(base)
            for base in cls.__mro__
            if base.__module__.split(".")[0] not in _FOUND_BY_MODULE
        )
        if isinstance(layer, keras.Model) and not is_functional(layer) and not own_config:
            return f"{name} is a subclassed model that defines no get_config"
    return None


def _one_line(error):
    """Keras' message of ``error`` (wrapped over several lines) as one line, shortened."""
    text = " ".join(str(error).split()).rstrip(".") or type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."


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
    fault: object = None  # GACLI_FAKE_OOM_ABOVE's (gacli.runner.training.fault_injection)
    skip_budget: SkipBudget | None = None  # any non-finite policy: skipped windows counted
    no_gradient: NoGradientStop | None = None  # a loss that no trainable weight reaches
    epoch_weights: EpochWeights | None = None  # with callbacks=: which epoch's weights end it
    user: list = dataclasses.field(default_factory=list)  # the callbacks= list's, called last

    @functools.cached_property
    def in_order(self):
        """fit()'s list: the engine's window closer and non-finite stop first (a halted step is
        neither logged nor saved; the model wrappers' fit() would add them too, a plain model's
        would not); then the clock before the readers of its time; the precise batch-norm
        statistics after the callbacks that close an epoch's window, so that they see its last
        update; the skip budget and the no-gradient stop, which fail a run before its epoch is
        saved; the checkpoint; the window start and the fault; the record of each epoch end's
        weights (with the user's callbacks, which may set them back); the user's own callbacks
        last, told of one training over the run's fit() calls (:class:`OneTraining`)."""
        reporting = [self.clock, *self.reporters()]
        later = (
            self.precise_batchnorm,
            self.skip_budget,
            self.no_gradient,
            self.checkpoint,
            self.window_start,
            self.fault,
            self.epoch_weights,
        )
        accumulator = self.clock.accumulator
        ours = accumulation_callbacks(accumulator, reporting) + [c for c in later if c is not None]
        return ours + ([self.user_training] if self.user else [])

    @functools.cached_property
    def user_training(self):
        """The user's callbacks, told of one training over the run's fit() calls."""
        return OneTraining(self.user)

    def reporters(self):
        """The callbacks that show the plan: told when it changes."""
        return [c for c in (self.progress, self.logger) if c is not None]

    def close(self):
        for reporter in self.reporters():
            reporter.close()


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
        # What the loss is (ga-report marks a best loss only among runs of one loss).
        "loss": _loss_name(getattr(job.model, "loss", None)),
    }
    roots = import_roots(resolved)
    if roots:  # the user's modules came from PYTHONPATH or here: the job needs them again
        resolved["resolved"]["pythonpath"] = os.pathsep.join(roots)
    return resolved


def _loss_name(loss):
    """Keras's name of a compiled loss (``sparse_categorical_crossentropy``,
    ``mean_squared_error``), a function's name, or None."""
    if loss is None:
        return None
    if isinstance(loss, str):
        return loss
    return getattr(loss, "name", None) or getattr(loss, "__name__", None) or type(loss).__name__


def _hparams(cfg, plan, job):
    """What TensorBoard's HParams tab compares runs by."""
    return {
        "accum_steps": plan.accum_steps,
        "micro_batch_size": plan.micro_batch_size,
        "effective_batch_size": plan.effective_batch_size,
        "precision": cfg.precision.policy.value,
        "tf32": tf32_used(tf32_enabled()),
        "strategy": cfg.strategy.name.value,
        "wrapper": job.wrapper.value,
        "model": shown_name(cfg.model),
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
