"""``ga-train check=equivalence``: the job's own model and data, one window, no training.

The job is planned and its data loaded as for training (:class:`gacli.runner.training.run.Run`); its
model, batch-norm policy, optimizer, loss and accumulation settings are built as
:func:`gacli.runner.builders.job.build_job` builds them; then
:func:`gacli.engine.equivalence.check_equivalence` compares one gacli update over the first window
of the first pass (in the training order) with one plain-Keras update over the same samples. It
writes ``equivalence.json`` in the run directory and no ``result.json`` or model.
"""

import os
import warnings

import keras
import numpy as np
import tensorflow as tf

from gacli.engine.batchnorm import BatchNormWarning
from gacli.engine.equivalence import EquivalenceInputError, check_equivalence
from gacli.errors import ConfigError, TrainingFailed
from gacli.rundir import is_chief, write_json
from gacli.runner.builders.job import accumulation_config, choose_wrapper, job_loss_and_metrics
from gacli.runner.builders.model import build_model
from gacli.runner.builders.optimizer import build_optimizer
from gacli.runner.config.schema import Wrapper
from gacli.runner.training.run import Run
from gacli.runner.training.run_state import micro_batch_stream

EQUIVALENCE_FILE = "equivalence.json"


class NotEquivalent(TrainingFailed):
    """The check ran and some weights differ by more than the tolerance (exit code 1)."""


def run_equivalence_check(cfg, run_dir, given=()):
    """Check the job described by ``cfg``; the result as a dict (what ``equivalence.json``
    holds). Raises :class:`NotEquivalent` when it fails, ConfigError on unusable input."""
    cfg = cfg.copy()
    cfg.checkpoint = False  # nothing is trained: no checkpoint folder in the run directory
    run = Run(cfg, run_dir, given)
    run.check_run_dir()
    run.plan_batch()
    # float32 only: validate() refuses another precision for the check.
    run.load_data()
    run.settle_plan()
    plan, data, strategy = run.plan, run.data, run.strategy
    run.console.print(
        f"check=equivalence: {plan.accum_steps} micro-batches of {plan.micro_batch_size}"
        f"{f' x {plan.replicas} replicas' if plan.replicas > 1 else ''} (the first window of "
        f"the first pass) against one batch of {plan.effective_batch_size} on one device",
        soft_wrap=True,
    )
    keras.utils.set_random_seed(cfg.seed)
    model = build_model(cfg.model, data.input_shape, data.num_outputs, data.task)
    loss, _ = job_loss_and_metrics(cfg, data.task, data.num_outputs)
    rates = (plan.effective_batch_size, run.steps.total_updates)
    optimizer = build_optimizer(
        cfg.optimizer, *rates, scaling=(cfg.lr_scaling, cfg.lr_reference_batch)
    )
    x, y, *weights = first_window(run)
    wrapper, _ = choose_wrapper(cfg)
    try:
        with warnings.catch_warnings():
            # Batch norm in training mode is named by the verdict, as a cause, with the
            # batchnorm= that make the update exact: Python's warning would say it again.
            warnings.simplefilter("ignore", BatchNormWarning)
            result = check_equivalence(
                model,
                x,
                y,
                accum_steps=plan.accum_steps,
                micro_batch_size=plan.micro_batch_size,
                optimizer=optimizer,
                loss=loss,
                sample_weight=weights[0] if weights else None,
                wrapper="optimizer" if wrapper is Wrapper.optimizer else "model",
                tolerance=cfg.check.tolerance,
                strategy=strategy,
                batchnorm=cfg.batchnorm.value,
                # Every accumulation setting the job would train with, not only accum_steps.
                config=accumulation_config(cfg, plan),
            )
    except EquivalenceInputError as error:
        raise ConfigError(f"check=equivalence: {error}") from None
    record = result.to_dict()
    if is_chief():
        write_json(os.path.join(run_dir, EQUIVALENCE_FILE), record)
    print(str(result), flush=True)
    run.console.print(f"run directory: {run_dir}", soft_wrap=True)
    if not result.passed:
        raise NotEquivalent(
            f"{result.verdict()} The figures are in {os.path.join(run_dir, EQUIVALENCE_FILE)}."
        )
    return record


def first_window(run):
    """(inputs, targets) or (inputs, targets, sample weights) of the run's first window, in the
    order training would see them: its ``accum_steps`` micro-batches of the first pass, a short
    last one included; inputs that are a dict stay one."""
    plan, data = run.plan, run.data
    if plan.effective_batch_size > data.train_size:
        raise ConfigError(
            f"check=equivalence: the training set holds {data.train_size} samples, fewer than "
            f"one window of {plan.effective_batch_size} (micro_batch_size x accum_steps x "
            "replicas). Use a smaller accum_steps or micro_batch_size, or more data."
        )
    stream = micro_batch_stream(
        data.train,
        plan.global_micro_batch_size,
        run.steps.micro_batches,
        start=0,
        count=plan.accum_steps,
        order=run.order,
    )
    batches = list(stream.as_numpy_iterator())
    return tf.nest.map_structure(lambda *parts: np.concatenate(parts), *batches)
