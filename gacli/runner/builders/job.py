"""Building a job: the model with its precision policy, loss and metrics, the accumulation
wrapper (model- or optimizer-based) and the engine's settings, checked against the data's shapes
before anything trains."""

import contextlib
import dataclasses
import re
import warnings

import keras
import tensorflow as tf
from omegaconf import OmegaConf

from gacli.engine.accumulate_model import (
    wrap_model,
)
from gacli.engine.accumulation import (
    GradientAccumulateOptimizer,
    find_accumulating_optimizer,
)
from gacli.engine.batchnorm import (
    BatchNormWarning,
    apply_batchnorm_policy,
    plain_batchnorm_layers,
)
from gacli.engine.model_graph import sublayers
from gacli.engine.options import BatchNormPolicy, NonFinite
from gacli.engine.schedules import ScaledLearningRate
from gacli.engine.settings import AccumulationConfig
from gacli.engine.tf32 import tf32_description, tf32_enabled
from gacli.errors import ConfigError
from gacli.runner.builders.model import build_model
from gacli.runner.builders.optimizer import build_optimizer, learning_rate_schedule
from gacli.runner.builders.targets import build_loss, build_metrics, own_parts
from gacli.runner.config.objective import check_metric, metric_name
from gacli.runner.config.schema import (
    Policy,
    Wrapper,
    remat_setting,
    shown_name,
)
from gacli.runner.training.fault_injection import install_fake_oom

# ga-train's one default that differs from the library's (docs/getting-started.md, "Options"):
# without loss scaling a non-finite gradient stops the run, so that a nan never reaches the weights
# unnoticed; the library leaves it unchecked there.
NONFINITE_WITHOUT_LOSS_SCALING = NonFinite.stop


_KERAS_POLICY = {
    Policy.fp32: "float32",
    Policy.mixed_float16: "mixed_float16",
    Policy.mixed_bfloat16: "mixed_bfloat16",
}


@contextlib.contextmanager
def precision_policy(policy):
    """Keras' global policy set to ``policy`` for the job, and the caller's put back after it
    (not float32: a notebook that set mixed_bfloat16 keeps it)."""
    callers_policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(_KERAS_POLICY[policy])
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy(callers_policy)


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
    (:mod:`gacli.runner.builders.targets` builds them), else the task's
    (:func:`loss_and_metrics`)."""
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


def check_fits(model, data, own_loss=False):
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
    if data.task == "classification" and not _fits_labels(output, data.label_shape):
        wanted = (*data.label_shape, data.num_outputs)
        raise ConfigError(
            f"the model predicts outputs of shape {output} a sample, but the data's class labels "
            f"are of shape {tuple(data.label_shape)} a sample, so it must predict {wanted}: one"
            + (
                " logit per class and label; build the model to predict that"
                if data.label_shape
                else " logit per class; end the model in a layer that drops the other axes (e.g. "
                "keras.layers.GlobalAveragePooling2D() or Flatten() before its last Dense)"
            )
            + ", or give it a loss of its own (loss._target_=...) for what it predicts."
        )
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


def check_trainable(model, model_cfg, policy):
    """A clear error, before training, for a model that training cannot change (no trainable
    weights) or could not change safely: layers that compute in float16 under a policy without
    loss scaling, where gradients below float16's smallest number (6e-8) underflow to 0 and large
    ones overflow."""
    name = shown_name(model_cfg)
    if not model.trainable_weights:
        if model.weights:
            raise ConfigError(
                f"the model ({name}) has {len(model.weights)} weights but none of them is "
                "trainable (model.trainable = False, or every layer frozen), so no update could "
                "change it and the run would train nothing. Set model.trainable = True, or the "
                "layers to train trainable, where the model is built."
            )
        raise ConfigError(
            f"the model ({name}) has no weights, so training cannot change it and the run would "
            "train nothing. Give it layers with weights (e.g. keras.layers.Dense)."
        )
    if policy == Policy.mixed_float16:
        return
    half = [
        layer.name
        for layer in sublayers(model, include_self=True)
        if layer.compute_dtype == "float16"
    ]
    if half:
        shown = ", ".join(half[:3]) + (f" and {len(half) - 3} more" if len(half) > 3 else "")
        raise ConfigError(
            f"the model ({name}) computes in float16 ({len(half)} of its layers: {shown}), but "
            f"precision={policy.value} trains without loss scaling, and in float16 small "
            "gradients become 0 and large ones inf. Add precision=mixed_float16, which scales the "
            "loss, or build the model in float32 (without "
            "keras.mixed_precision.set_global_policy('mixed_float16') or dtype='mixed_float16')."
        )


def _fits_labels(output, label_shape):
    """Whether a classifier's output shape (no batch axis) holds one logit per class for each
    label of ``label_shape``; a trailing label axis of 1 is squeezed away, as Keras' sparse
    cross-entropy does."""
    shapes = [tuple(label_shape)]
    if shapes[0][-1:] == (1,):
        shapes.append(shapes[0][:-1])
    return any(
        len(output) == len(shape) + 1 and all(o in (None, d) for o, d in zip(output, shape))
        for shape in shapes
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
        remat=run_remat(cfg, plan),
    )


def run_remat(cfg, plan):
    """The recomputation the job trains with: the one ``plan`` was chosen with
    (``micro_batch_size=auto``'s probe), else the config's ``remat``; None: none."""
    if getattr(plan, "remat", None) is not None:
        return remat_setting(plan.remat)
    return remat_setting(cfg.get("remat"))


def remat_description(remat):
    """What ``remat`` (as :func:`run_remat` gives it) recomputes, in the panel's words."""
    if isinstance(remat, tuple):
        return f"the layers {', '.join(remat)}, each as one block"
    if remat == "every":
        return "every block of the model"
    return f"runs of {remat} blocks"


def batchnorm_warning(policy, accum_steps, layers):
    """What :class:`gacli.BatchNormWarning` says, in ``ga-train``'s words: printed once after the
    start-up panel when the BatchNormalization ``layers`` train on micro-batch statistics (the
    ``keep`` policy, ``accum_steps`` > 1); None when they do not. Its advice follows the measured
    comparison of the policies in docs/guides/batch-norm.md."""
    if policy != BatchNormPolicy.keep or accum_steps <= 1 or not layers:
        return None
    names = ", ".join(layer.name for layer in layers[:3]) + (
        f" and {len(layers) - 3} more" if len(layers) > 3 else ""
    )
    return (
        f"batch norm: {len(layers)} BatchNormalization layer{'s' if len(layers) > 1 else ''} "
        f"({names}) normalise each micro-batch by its own statistics, so with accum_steps="
        f"{accum_steps} the weights are not those of one big batch (every other part of the "
        "update is). batchnorm=freeze (inference mode, for fine-tuning) or batchnorm=group_norm "
        "(GroupNormalization in their place) make the update exact; batchnorm=precise trains as "
        "now and recomputes the moving statistics before each validation (the best validation "
        "of the policies measured in the batch-norm guide); batchnorm=accumulate gives the big "
        "batch's moving statistics, which take thousands of updates to settle."
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
    # GACLI_FAKE_OOM_ABOVE's callback (gacli.runner.training.fault_injection), when set
    fault: object = None
    scaled_rate: ScaledLearningRate | None = None  # accum_schedule: the stage's learning rate
    batchnorm_warning: str | None = None  # printed after the panel (batchnorm_warning())
    # (config key, object) of each part a _target_ of the user's built: what raised names it
    # (gacli.runner.builders.targets.raised_by)
    own: tuple = ()

    def facts(self, cfg, plan, data, steps, strategy):
        """The start-up panel's lines."""
        replicas = strategy.num_replicas_in_sync
        layers = self.batchnorm_layers
        return {
            "wrapper": self.reason,
            "model": f"{shown_name(cfg.model)} ({self.model.count_params():,} parameters)",
            "data": f"{shown_name(cfg.dataset)}: {data.train_size} train / "
            f"{data.validation_size} val samples, inputs {_shapes(data.input_shape)}",
            "updates": f"{steps.total_updates} in {cfg.epochs} epochs, "
            f"{steps.epoch_length} micro-batches per epoch",
            "compiled calls": f"{steps.steps_per_execution} micro-batches each "
            "(steps_per_execution)",
            "precision": cfg.precision.policy.value,
            "tf32": tf32_description(tf32_enabled(), cfg.tf32),
            "batch norm": f"{cfg.batchnorm.value} ({layers} layer{'s' if layers != 1 else ''}"
            + (
                "; statistics per micro-batch, not the big batch's: see below"
                if cfg.batchnorm == BatchNormPolicy.keep and plan.accum_steps > 1 and layers
                else ""
            )
            + ")",
            "strategy": f"{cfg.strategy.name.value} ({replicas} replica"
            f"{'s' if replicas > 1 else ''})",
            "learning rate": f"{self.learning_rate:.3g} at update 0",
            **self._recompute_line(cfg, plan),
        }

    def _recompute_line(self, cfg, plan):
        """The panel's line for recomputation, where there is any: what is recomputed, and
        whether the setting or the probe chose it."""
        remat = run_remat(cfg, plan)
        if remat is None:
            return {}
        if remat_setting(cfg.get("remat")) == remat:
            why = f"remat={cfg.remat}"
        else:
            why = f"remat={remat}, chosen by micro_batch_size=auto"
        return {"recompute": f"{remat_description(remat)}, in the backward pass ({why})"}


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
        check_fits(model, data, own_loss=OmegaConf.select(cfg, "loss._target_") is not None)
        own = own_parts(cfg, model, loss, metrics)
        batchnorm = plain_batchnorm_layers(model)
        training = [layer for layer in batchnorm if layer.trainable]  # frozen ones: inference
        model = apply_batchnorm_policy(model, cfg.batchnorm.value, plan.accum_steps, warn=False)
        check_trainable(model, cfg.model, cfg.precision.policy)
        scaling = (cfg.lr_scaling, cfg.lr_reference_batch)
        rate = learning_rate_schedule(
            cfg.optimizer, plan.effective_batch_size, steps.total_updates, scaling
        )
        scaled_rate = ScaledLearningRate(rate) if cfg.get("accum_schedule") is not None else None
        inner = build_optimizer(
            cfg.optimizer, plan.effective_batch_size, steps.total_updates, scaled_rate, scaling
        )
        model, optimizer = _with_accumulation(model, inner, wrapper, settings)
        with warnings.catch_warnings():
            # Said in ga-train's words instead: Job.batchnorm_warning, after the start-up panel.
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
        len(batchnorm),
        float(inner.learning_rate.numpy()),
        fault,
        scaled_rate,
        batchnorm_warning(cfg.batchnorm, plan.accum_steps, training),
        own=own,
    )


def remat_as_typed(message):
    """The library's ``remat=`` suggestions in ``message`` (Python: ``remat=['a', 'b']``,
    ``remat='every'``) as they are typed on ga-train's command line (``'remat=[a,b]'``,
    ``remat=every``)."""

    def listed(match):
        names = re.findall(r"'([^']*)'", match.group(1))
        return "'remat=[" + ",".join(names) + "]'"

    message = re.sub(r"remat=\[([^\]]*)\]", listed, message)
    return re.sub(r"remat='(\w+)'", r"remat=\1", message)


def _with_accumulation(model, inner, wrapper, settings):
    """(model, optimizer) to compile: the model wrapped and the inner optimizer, or the model as
    it is and the inner optimizer wrapped."""
    if wrapper is Wrapper.model:
        try:
            model = wrap_model(model, config=settings)
        except ValueError as error:
            if settings.remat is None or not str(error).startswith("remat"):
                raise
            # The model cannot be cut as remat asks (a subclassed model, one skip connection
            # spanning it): the library's paragraph says what to give instead, spelt as
            # ga-train's command line takes it.
            raise ConfigError(remat_as_typed(str(error))) from None
        # The callbacks read the counters from each call's logs where the model can return them
        # (one replica, not a TPU); elsewhere they read the variables after each call.
        model.counters_in_logs = True
        return model, inner
    from gacli.engine.clipping import agc_unit_axes

    axes = agc_unit_axes(model) if settings.use_agc else None
    return model, GradientAccumulateOptimizer(inner, config=settings, agc_unit_axes=axes)
