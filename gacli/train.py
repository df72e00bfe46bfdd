"""``train(cfg) -> metrics``: one ``ga-train`` job, from a composed config to a trained model.

The Hydra entry point (:mod:`gacli.cli`) only composes the config and calls this; tests call it
directly. Batch arithmetic is resolved once (:func:`gacli.config.resolve_batch`), printed at start
and logged.
"""

import json
import logging
import math
import os

import keras
from omegaconf import OmegaConf

from gacli.accumulation import GradientAccumulateOptimizer, find_accumulating_optimizer
from gacli.accumulate_model import WindowCallback, wrap_model
from gacli.batchnorm import apply_batchnorm_policy
from gacli.config import ConfigError, PartialWindow, Policy, Wrapper, resolve_batch
from gacli.console import ProgressCallback, make_console, startup_panel, summary_table
from gacli.data import load_dataset
from gacli.models import build_model
from gacli.optimizers import build_optimizer
from gacli.run_logging import TensorBoardLogger, host_memory_bytes
from gacli.strategy import is_chief, make_strategy

RESULT_FILE = "result.json"  # written last: its presence marks a finished run
_KERAS_POLICY = {
    Policy.fp32: "float32",
    Policy.mixed_float16: "mixed_float16",
    Policy.mixed_bfloat16: "mixed_bfloat16",
}


class EpochCheckpoint(keras.callbacks.Callback):
    """Saves model, optimizer (accumulators and both counters included) and the epoch after every
    epoch. TensorFlow writes the data files first and the index last, by rename, so an
    interrupted save leaves the previous checkpoint intact."""

    def __init__(self, directory, model, max_to_keep=2):
        super().__init__()
        import tensorflow as tf

        self.epoch = tf.Variable(0, dtype="int64", trainable=False)
        checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer, epoch=self.epoch)
        self.manager = tf.train.CheckpointManager(checkpoint, directory, max_to_keep=max_to_keep)

    def on_epoch_end(self, epoch, logs=None):
        self.epoch.assign(epoch + 1)
        self.manager.save(checkpoint_number=epoch + 1)


def choose_wrapper(cfg):
    """(``"model"`` or ``"optimizer"``, the reason shown in the start-up panel)."""
    if cfg.wrapper == Wrapper.optimizer:
        return "optimizer", (
            "optimizer wrapper, as configured: in fit() it weighs every micro-batch the same and "
            "lets windows run across epochs"
        )
    if cfg.wrapper == Wrapper.model:
        return "model", "model wrapper, as configured"
    return "model", (
        "model wrapper (auto): it tells the accumulator each micro-batch's size and closes each "
        f"epoch's window, which a plain fit() cannot; it runs under strategy={cfg.strategy.name.value}"
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


def _guard_run_dir(run_dir):
    if os.path.exists(os.path.join(run_dir, RESULT_FILE)):
        raise ConfigError(
            f"{run_dir} holds a finished run, which is never overwritten; leave hydra.run.dir unset "
            "(each run gets a new directory) or pick a new one."
        )


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
    _guard_run_dir(run_dir)
    os.makedirs(run_dir, exist_ok=True)
    strategy = make_strategy(cfg.strategy)
    plan = resolve_batch(cfg.micro_batch_size, cfg.accum_steps, cfg.effective_batch_size,
                         strategy.num_replicas_in_sync, given)
    keras.utils.set_random_seed(cfg.seed)
    keras.mixed_precision.set_global_policy(_KERAS_POLICY[cfg.precision.policy])
    try:
        return _train(cfg, run_dir, plan, strategy, console, parallel_jobs)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _train(cfg, run_dir, plan, strategy, console, parallel_jobs):
    # Hydra sets the root logger to INFO; TensorFlow's absl chatter is not for the terminal.
    for name in ("absl", "tensorflow"):
        logging.getLogger(name).setLevel(logging.WARNING)
    data = load_dataset(cfg.dataset, cfg.seed)
    train_data = data.train
    if cfg.dataset.shuffle:
        train_data = train_data.shuffle(min(data.train_size, 10_000), seed=cfg.seed)
    train_data = train_data.batch(plan.global_micro_batch_size)
    micro_batches = math.ceil(data.train_size / plan.global_micro_batch_size)
    if cfg.steps_per_epoch:
        updates_per_epoch = cfg.steps_per_epoch
        fit_steps = cfg.steps_per_epoch * plan.accum_steps
        train_data = train_data.repeat()
    elif cfg.partial_window == PartialWindow.drop:
        updates_per_epoch = micro_batches // plan.accum_steps
        fit_steps = None
    elif cfg.partial_window == PartialWindow.carry:
        # Windows run across epochs: on average this many updates an epoch.
        updates_per_epoch = micro_batches / plan.accum_steps
        fit_steps = None
    else:
        updates_per_epoch = math.ceil(micro_batches / plan.accum_steps)
        fit_steps = None
    validation = None
    if data.validation is not None:
        validation = data.validation.batch(plan.global_micro_batch_size)
    total_updates = math.ceil(updates_per_epoch * cfg.epochs)
    wrapper, reason = choose_wrapper(cfg)
    loss, metrics = loss_and_metrics(data.task, data.num_outputs)
    optimizer_cfg = cfg.optimizer
    nonfinite = None if cfg.precision.nonfinite is None else cfg.precision.nonfinite.value
    with strategy.scope():
        keras.utils.set_random_seed(cfg.seed)
        model = build_model(cfg.model, data.input_shape, data.num_outputs, data.task)
        _check_fits(model, data)
        model = apply_batchnorm_policy(model, cfg.batchnorm.value, plan.accum_steps)
        inner = build_optimizer(optimizer_cfg, plan.effective_batch_size, total_updates)
        accumulation = dict(
            partial_window=cfg.partial_window.value, use_agc=optimizer_cfg.use_agc,
            clip_factor=optimizer_cfg.clip_factor, nonfinite=nonfinite,
        )
        if wrapper == "model":
            model = wrap_model(model, plan.accum_steps, **accumulation)
            model.compile(optimizer=inner, loss=loss, metrics=metrics,
                          jit_compile=cfg.jit_compile)
        else:
            loss_scaling = cfg.precision.policy == Policy.mixed_float16
            optimizer = GradientAccumulateOptimizer(
                inner, accum_steps=plan.accum_steps, loss_scaling=loss_scaling, **accumulation
            )
            model.compile(optimizer=optimizer, loss=loss, metrics=metrics,
                          jit_compile=cfg.jit_compile, auto_scale_loss=not loss_scaling)
    accumulator = find_accumulating_optimizer(model.optimizer)
    chief = is_chief()

    facts = {
        "wrapper": reason,
        "model": f"{cfg.model.factory or cfg.model.name} ({model.count_params():,} parameters)",
        "data": f"{cfg.dataset.name}: {data.train_size} train / {data.validation_size} val "
                f"samples, inputs {tuple(data.input_shape)}",
        "updates": f"{total_updates} in {cfg.epochs} epochs, "
                   f"{micro_batches if not fit_steps else fit_steps} micro-batches per epoch",
        "precision": cfg.precision.policy.value,
        "strategy": f"{cfg.strategy.name.value} ({strategy.num_replicas_in_sync} replica"
                    f"{'s' if strategy.num_replicas_in_sync > 1 else ''})",
        "learning rate": f"{inner.learning_rate.numpy():.3g} at update 0",
    }
    startup_panel(console, cfg, plan, facts)
    if chief:
        resolved = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
        resolved["resolved"] = {
            "micro_batch_size": plan.micro_batch_size, "accum_steps": plan.accum_steps,
            "replicas": plan.replicas, "effective_batch_size": plan.effective_batch_size,
            "optimizer_updates": total_updates, "wrapper": wrapper,
        }
        OmegaConf.save(OmegaConf.create(resolved), os.path.join(run_dir, "resolved.yaml"))

    callbacks = [ProgressCallback(console, cfg.progress, plan, accumulator,
                                  math.ceil(total_updates / cfg.epochs), cfg.epochs, parallel_jobs)]
    if wrapper == "optimizer":
        # A plain model's fit() does not close windows at epoch ends; this callback does.
        callbacks.insert(0, WindowCallback(accumulator))
    if chief:
        hparams = {
            "accum_steps": plan.accum_steps, "micro_batch_size": plan.micro_batch_size,
            "effective_batch_size": plan.effective_batch_size,
            "precision": cfg.precision.policy.value, "strategy": cfg.strategy.name.value,
            "wrapper": wrapper, "model": cfg.model.factory or cfg.model.name,
            "lr": float(optimizer_cfg.learning_rate), "optimizer": optimizer_cfg.name.value,
        }
        callbacks.append(TensorBoardLogger(os.path.join(run_dir, "tensorboard"), plan,
                                           accumulator, hparams))
        if cfg.checkpoint:
            callbacks.append(EpochCheckpoint(os.path.join(run_dir, "checkpoints"), model))
    history = model.fit(train_data, validation_data=validation, epochs=cfg.epochs,
                        steps_per_epoch=fit_steps, verbose=0, callbacks=callbacks,
                        shuffle=False)  # the tf.data pipeline shuffles
    final = {key: float(values[-1]) for key, values in history.history.items()}
    if chief:
        if cfg.checkpoint:
            model.save(os.path.join(run_dir, "model.keras"))
        result = dict(final, optimizer_step=int(accumulator.optimizer_step.numpy()),
                      micro_step=int(accumulator.micro_step.numpy()),
                      effective_batch_size=plan.effective_batch_size,
                      host_peak_rss_bytes=host_memory_bytes()[1])
        temporary = os.path.join(run_dir, RESULT_FILE + ".tmp")
        with open(temporary, "w") as handle:
            json.dump(result, handle, indent=2)
        os.replace(temporary, os.path.join(run_dir, RESULT_FILE))
    rows = {key: f"{value:.4f}" for key, value in final.items()}
    rows["updates / micro-batches"] = (
        f"{int(accumulator.optimizer_step.numpy())} / {int(accumulator.micro_step.numpy())}"
    )
    rows["effective batch"] = plan.effective_batch_size
    summary_table(console, rows)
    console.print(f"run directory: {run_dir}", soft_wrap=True)
    return final
