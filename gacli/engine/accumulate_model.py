"""``GradientAccumulateModel``: a Keras 3 model whose ``fit`` accumulates gradients.

``model.fit(x, y, batch_size=16)`` on a model with ``accum_steps=4`` trains on micro-batches of 16
and updates the weights once per 64 samples, exactly as one batch of 64 would (including a short
last micro-batch, which is weighted by its real size, and the short last window of an epoch, which
is applied per ``partial_window`` before validation runs). The accumulators live in a
:class:`~gacli.engine.accumulation.GradientAccumulateOptimizer` that ``compile`` wraps around the
optimizer you pass, so ``count_params()`` is unchanged and checkpoints carry the open window.
"""

import keras
import tensorflow as tf

from gacli.engine import _keras_compat as compat
from gacli.engine.accumulation import (
    _LOSS_SCALE_OPTIMIZER,
    COUNTERS_LOG_KEY,
    NOISE_STATE_LOG_KEY,
    GradientAccumulateOptimizer,
    StopOnNonFinite,
    find_accumulating_optimizer,
)
from gacli.engine.batchnorm import (
    accum_batchnorm_layers,
    shared_accum_batchnorm_layers,
    shared_layer_message,
    warn_micro_batch_statistics,
)
from gacli.engine.host_memory import HostMemoryCallback
from gacli.engine.options import LossNormalization, NonFinite, Reduction
from gacli.engine.remat import plan_for as remat_plan
from gacli.engine.remat import recomputing_call
from gacli.engine.settings import (
    OLDER_SETTING_NAMES,
    AccumulationConfig,
    keyword_names,
    pop_settings,
    refuse_unknown_keywords,
    settings_as_attributes,
    shows_config_defaults,
    take_agc_alias,
)

# keras.Model's own keywords, those of any layer (name, trainable, dtype, ...), and a functional
# model's graph ends. Keras' functional constructor passes over any other keyword without a word
# (only a subclassed model's refuses one, with a ValueError), so the wrappers check them first.
_LAYER_KEYWORDS = keyword_names(keras.layers.Layer.__init__)
_GRAPH_KEYWORDS = ("inputs", "outputs")


def _model_settings(config, mixed_precision=False, experimental_distributed_support=False, **given):
    """The AccumulationConfig of a model wrapper, from ``config`` and the settings given (None:
    not given). ``mixed_precision`` is the older package's switch (in Keras 3 the policy says);
    ``experimental_distributed_support`` is accepted for its users and changes nothing: gacli
    always supports tf.distribute."""
    del experimental_distributed_support
    if mixed_precision and keras.mixed_precision.global_policy().name != "mixed_float16":
        raise ValueError(
            "mixed_precision=True needs the mixed_float16 policy in Keras 3: call "
            "keras.mixed_precision.set_global_policy('mixed_float16') before building the "
            "model's layers; model.compile then adds loss scaling by itself."
        )
    return AccumulationConfig.given(config, **given)


def _window_weighted_loss(loss):
    """``loss`` with Keras' ``mean_with_sample_weight`` reduction: sum(l * w) / sum(w)."""
    if loss is None:
        return None
    if isinstance(loss, dict):
        return {key: _window_weighted_loss(value) for key, value in loss.items()}
    if isinstance(loss, (list, tuple)):
        return type(loss)(_window_weighted_loss(value) for value in loss)
    loss = keras.losses.get(loss)
    if isinstance(loss, keras.losses.Loss):
        config = loss.get_config()
        config["reduction"] = "mean_with_sample_weight"
        return loss.__class__.from_config(config)
    return compat.loss_from_function(loss, reduction="mean_with_sample_weight")


class WindowCallback(keras.callbacks.Callback):
    """Closes each epoch's last window, in the optimizer and in AccumBatchNormalization layers,
    before validation and at the end of every epoch."""

    def __init__(self, optimizer):
        super().__init__()
        self._optimizer = optimizer
        self._training = False

    def _finish_epoch(self, last=False):
        action = self._optimizer.epoch_end_action(last)
        if action is None:
            return
        self._optimizer.finish_epoch(last)
        for layer in accum_batchnorm_layers(self.model):
            layer.finish_window(apply=action == "apply")

    def on_train_begin(self, logs=None):
        self._training = True

    def on_train_end(self, logs=None):
        self._training = False

    def on_test_begin(self, logs=None):
        # Keras runs validation between the last batch and on_epoch_end: the partial window must
        # be applied first, as the big batch would have been.
        if self._training:
            self._finish_epoch()

    def on_epoch_end(self, epoch, logs=None):
        last = epoch + 1 >= self.params.get("epochs", epoch + 1) or self.model.stop_training
        self._finish_epoch(last=last)


class CountersFromLogs(keras.callbacks.Callback):
    """Keeps the counters a compiled call returned in its logs (a model wrapper with
    ``counters_in_logs``) for the callbacks after it, and takes them out of the logs; forgets
    them before anything else can move the counters (the next call, validation, an epoch's end;
    the model's fit() forgets them when it ends, also by an error). Put it first."""

    def __init__(self, optimizer):
        super().__init__()
        self._optimizer = optimizer

    def on_train_batch_begin(self, batch, logs=None):
        self._optimizer.forget_counters()

    def on_train_batch_end(self, batch, logs=None):
        self._optimizer.take_counters(logs)

    def on_test_begin(self, logs=None):
        self._optimizer.forget_counters()

    def on_epoch_end(self, epoch, logs=None):
        self._optimizer.forget_counters()
        _drop_counters(logs)  # the epoch's logs are its last call's

    def on_train_end(self, logs=None):
        _drop_counters(logs)


def _drop_counters(logs):
    """Take what a compiled call returned for :class:`CountersFromLogs` out of ``logs``."""
    for key in (COUNTERS_LOG_KEY, NOISE_STATE_LOG_KEY):
        (logs or {}).pop(key, None)


def accumulation_callbacks(optimizer, callbacks=()):
    """``callbacks`` with what training with ``optimizer`` (a GradientAccumulateOptimizer) needs,
    in the order it needs them: the window closer first (an epoch's last window is applied
    before validation), then, under ``nonfinite="stop"``, the check that stops a run before a
    later callback (a checkpoint) sees the bad step; host memory readings last."""
    callbacks = list(callbacks)
    if optimizer.nonfinite is NonFinite.stop and not any(
        isinstance(callback, StopOnNonFinite) for callback in callbacks
    ):
        callbacks.insert(0, StopOnNonFinite(optimizer))
    if not any(isinstance(callback, WindowCallback) for callback in callbacks):
        callbacks.insert(0, WindowCallback(optimizer))
    if not any(isinstance(callback, HostMemoryCallback) for callback in callbacks):
        callbacks.append(HostMemoryCallback())
    return callbacks


@settings_as_attributes("accumulation_config")
class AccumulationMixin(compat.KerasWorkarounds):
    """``compile``/``train_step``/``fit`` of a Keras model that accumulates gradients; its
    settings are one :class:`~gacli.AccumulationConfig`, ``accumulation_config``."""

    # True: each step's logs carry the optimizer's counters under COUNTERS_LOG_KEY, and fit()
    # puts a CountersFromLogs first, which takes them out for the callbacks after it (ga-train
    # sets it). Only on one replica and not on a TPU (_counters_logged); set it before fit().
    counters_in_logs = False

    def _accumulating_optimizer_for(self, optimizer):
        """``optimizer`` (an instance, a name or a config) wrapped in a
        GradientAccumulateOptimizer with the model's settings, unless it is one already."""
        if isinstance(optimizer, str):
            optimizer = optimizer.lower()
        optimizer = keras.optimizers.get(optimizer)
        settings = self.accumulation_config
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            if isinstance(optimizer.inner_optimizer, GradientAccumulateOptimizer):
                raise ValueError(_LOSS_SCALE_OPTIMIZER)
            # gradient-accumulator's users compile with LossScaleOptimizer(opt): its settings go
            # to the accumulator's own loss scaling, which unscales each micro-batch by its own
            # scale (P2), and its inner optimizer is wrapped.
            if settings.loss_scaling is False:
                raise ValueError(
                    "compile() got a LossScaleOptimizer for a model made with "
                    "loss_scaling=False; pass the plain optimizer "
                    "(loss_scale_optimizer.inner_optimizer), or leave loss_scaling out."
                )
            settings = settings.replace(
                loss_scaling=True,
                initial_scale=optimizer.initial_scale,
                dynamic_growth_steps=optimizer.dynamic_growth_steps,
            )
            optimizer = optimizer.inner_optimizer
        if not isinstance(optimizer, GradientAccumulateOptimizer):
            # Under mixed_float16 the accumulator scales the loss itself (P2), so that each
            # micro-batch is unscaled with its own scale and overflows follow `nonfinite`.
            config = settings.for_policy(self.dtype_policy.name)
            return GradientAccumulateOptimizer(
                optimizer,
                config=config.replace(loss_normalization=LossNormalization.batch, remat=None),
            )
        if optimizer.accum_steps != self.accum_steps:
            raise ValueError(
                f"The model has accum_steps={self.accum_steps} but its "
                f"GradientAccumulateOptimizer has accum_steps={optimizer.accum_steps}; pass "
                "the plain optimizer to compile and the model wraps it."
            )
        return optimizer

    def compile(self, optimizer="rmsprop", loss=None, *args, **kwargs):
        optimizer = self._accumulating_optimizer_for(optimizer)
        if optimizer.use_agc and optimizer.agc_unit_axes is None:
            from gacli.engine.clipping import agc_unit_axes

            # Rank-3 kernels are told apart by their layer (a Conv1D from a multi-head one).
            optimizer.agc_unit_axes = agc_unit_axes(self)
        # The accumulator is gacli's one loss-scaling path: Keras must not add its own.
        kwargs["auto_scale_loss"] = False
        if self.loss_normalization is LossNormalization.window_weights:
            loss = _window_weighted_loss(loss)
        mismatched = [
            layer.name
            for layer in accum_batchnorm_layers(self)
            if layer.accum_steps != self.accum_steps
        ]
        if mismatched:
            raise ValueError(
                f"AccumBatchNormalization layers {mismatched} have a different accum_steps than "
                f"the model ({self.accum_steps}); build them with accum_steps={self.accum_steps} "
                "so their windows are the optimizer's windows."
            )
        shared = shared_accum_batchnorm_layers(self)
        if shared:
            raise ValueError(shared_layer_message(shared[0]))
        super().compile(optimizer, loss, *args, **kwargs)
        # Once per model: plain batch norm in training mode is where the big batch's weights
        # are not given (docs/guides/batch-norm.md).
        if not getattr(self, "_batchnorm_warned", False):
            self._batchnorm_warned = warn_micro_batch_statistics(self, self.accum_steps)

    def set_accum_steps(self, accum_steps):
        """Micro-batches per update from the next window on (the window must be empty), for the
        model, its optimizer and its AccumBatchNormalization layers; the train function is made
        again. ga-train's ``oom=recover`` uses it when it halves the micro-batch."""
        set_accum_steps(self, accum_steps)

    def compile_from_config(self, config):
        # Keras skips compile() on load when it is overridden; this one is safe to call.
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if self.built:
            self.optimizer.build(self.trainable_variables)

    @property
    def accumulating_optimizer(self):
        return find_accumulating_optimizer(getattr(self, "optimizer", None))

    @property
    def micro_step(self):
        """Micro-batches trained on (a variable, checkpointed with the optimizer)."""
        return self.accumulating_optimizer.micro_step

    @property
    def optimizer_step(self):
        """Optimizer updates applied (a variable, checkpointed with the optimizer)."""
        return self.accumulating_optimizer.optimizer_step

    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        optimizer = self.accumulating_optimizer
        # One replica only: under several, the replicas' XLA computations and the window's
        # all-reduce did not agree on their collectives in every case tried (Adam, ragged
        # micro-batches, several micro-batches a call).
        apart = bool(
            self.jit_compile
            and not self.run_eagerly
            and self.distribute_strategy.num_replicas_in_sync == 1
        )
        if optimizer is not None:
            optimizer.update_compiled_apart = apart
        if not apart:
            return super().make_train_function(force)
        # Keras' step function runs as a graph; train_step compiles the micro-step and the
        # window's update with XLA, each apart, and chooses between them in the graph (see
        # GradientAccumulateOptimizer.update_compiled_apart). Evaluation keeps Keras' XLA.
        with compat.jit_compile_off(self):
            return super().make_train_function(force)

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        accumulator = self.optimizer
        sample_count = self._sample_count(x, sample_weight)
        found = []

        def micro_step(x, y, sample_weight):
            loss, y_pred, indices = self._micro_step(x, y, sample_weight, sample_count)
            found.append(indices)
            compat.loss_tracker(self).update_state(loss, sample_weight=sample_count)
            return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

        if accumulator.update_compiled_apart:
            micro_step = tf.function(micro_step, jit_compile=True)
        logs = micro_step(x, y, sample_weight)
        if found[-1] is not None:
            accumulator.close_window(found[-1])
        return compat.reducible_logs(
            {**logs, **self._accumulation_logs()}, self.distribute_strategy
        )

    def _micro_step(self, x, y, sample_weight, sample_count):
        """Forward and backward pass of one micro-batch, added to the window: (its per-replica
        mean loss, its predictions, the indices of the variables that had gradients or None)."""
        accumulator = self.optimizer
        with tf.GradientTape() as tape:
            if compat.call_has_training_arg(self):
                y_pred = self(x, training=True)
            else:
                y_pred = self(x)
            # Keras divides the loss by the number of replicas; the accumulator instead divides
            # by the window's global sample count, so it needs the per-replica mean loss.
            loss = compat.unscale_loss_for_distribution(
                compat.compute_training_loss(self, x, y, y_pred, sample_weight)
            )
            # The accumulator weighs each micro-batch by its count: weighing the loss gives the
            # weighted gradients straight from the backward pass, one pass over them less. Not
            # under loss scaling: float16 gradients times the count would overflow sooner.
            summed = accumulator.reduction is Reduction.mean and not accumulator.loss_scaling
            weighed = loss * tf.cast(sample_count, loss.dtype) if summed else loss
            scaled_loss = accumulator.scale_loss(weighed)
        trainable_weights = self.trainable_weights
        indices = None
        if trainable_weights:
            gradients = tape.gradient(scaled_loss, trainable_weights)
            indices = accumulator.accumulate(
                gradients, trainable_weights, sample_count=sample_count, summed=summed, loss=loss
            )
        return loss, y_pred, indices

    def _sample_count(self, x, sample_weight):
        """The micro-batch's weight in its window: its samples, or under
        ``loss_normalization="window_weights"`` its total sample weight."""
        if self.loss_normalization is not LossNormalization.window_weights:
            return tf.shape(next(t for t in tf.nest.flatten(x) if t is not None))[0]
        if sample_weight is None:
            raise ValueError(
                "loss_normalization='window_weights' divides the window's loss by its total "
                "sample weight, but fit() got none: pass sample_weight= (e.g. the token "
                "mask), or use loss_normalization='batch'."
            )
        return tf.add_n(
            [tf.reduce_sum(tf.cast(w, "float32")) for w in tf.nest.flatten(sample_weight)]
        )

    def _accumulation_logs(self):
        """Loss scale and skip counts, when in use, beside the loss in fit()'s logs."""
        accumulator = self.optimizer
        logs = {}
        if accumulator.nonfinite is not None:
            logs["skipped_micro_batches"] = tf.convert_to_tensor(accumulator.skipped_micro_batches)
            logs["skipped_windows"] = tf.convert_to_tensor(accumulator.skipped_windows)
        if accumulator.loss_scaling:
            logs["loss_scale"] = tf.convert_to_tensor(accumulator.loss_scale)
        if self._counters_logged():
            logs.update(accumulator.counters_logs())
        return logs

    def fit(
        self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None, **kwargs
    ):
        if self.accumulating_optimizer is None:
            raise RuntimeError("Call model.compile(optimizer=..., loss=...) before fit().")
        if self.built and not self.optimizer.built:
            # Keras builds optimizers inside the first trace when no strategy is set, which makes
            # tf.function trace twice (twice the XLA compile time); build the accumulators first.
            with self.distribute_strategy.scope():
                self.optimizer.build(self.trainable_variables)
        callbacks = accumulation_callbacks(self.optimizer, callbacks or ())
        if self._counters_logged() and not any(isinstance(c, CountersFromLogs) for c in callbacks):
            callbacks.insert(0, CountersFromLogs(self.optimizer))
        try:
            return super().fit(
                x,
                y,
                batch_size=batch_size,
                epochs=epochs,
                verbose=verbose,
                callbacks=callbacks,
                **kwargs,
            )
        finally:
            # A callback that raises (a non-finite stop, an interruption) leaves the last call's
            # counters kept; whatever moves the counters next must not see them.
            self.optimizer.forget_counters()

    def _counters_logged(self):
        """``counters_in_logs``, where it can hold: one replica, no TPU. (Across workers Keras
        averages each log over its first axis, which would make the vector one number; on a TPU
        its float64 would be emulated.)"""
        strategy = self.distribute_strategy
        return bool(
            self.counters_in_logs
            and strategy.num_replicas_in_sync == 1
            and not compat.in_multi_worker_mode(strategy)
            and not isinstance(strategy, tf.distribute.TPUStrategy)
        )


@keras.saving.register_keras_serializable(package="gacli")
class GradientAccumulateModel(AccumulationMixin, keras.Model):
    """A functional Keras model that trains with gradient accumulation.

    The settings are those of :class:`~gacli.AccumulationConfig` (whose defaults apply to any
    left as ``None``), as keyword arguments or all at once as ``config=``; ``reduction``,
    ``loss_scaling``, ``initial_scale`` and ``dynamic_growth_steps`` go in ``**kwargs``.

    Args:
        accum_steps: micro-batches per optimizer update; ``fit(batch_size=b)`` gives an effective
            batch of ``b * accum_steps`` (times the number of replicas).
        mixed_precision: compatibility with ``gradient-accumulator``; requires the
            ``mixed_float16`` policy, under which ``compile`` adds loss scaling by itself.
        use_agc: adaptive gradient clipping on the accumulated gradient.
        clip_factor: AGC's maximum ratio of gradient norm to parameter norm.
        eps: AGC's floor on the parameter norm.
        experimental_distributed_support: accepted and ignored: distribution always works.
        partial_window: ``"apply"`` (default), ``"drop"`` or ``"carry"``: the short last window
            of an epoch.
        accumulator_dtype: dtype of the gradient sums (float32 by default).
        nonfinite: ``"stop"``, ``"skip_micro_batch"`` or ``"skip_window"``: what an inf/nan
            micro-batch gradient does (default under mixed_float16: skip_micro_batch;
            otherwise unchecked).
        loss_normalization: ``"batch"`` (Keras' semantics) or ``"window_weights"``: divide by the
            window's total sample weight, e.g. its unmasked tokens, over all replicas.
        *args: ``keras.Model``'s positional arguments, after the ones above.
        config: every setting above at once, as a ``gacli.AccumulationConfig``.
        **kwargs: ``inputs=...``, ``outputs=...``, ``name=...`` as for ``keras.Model``, the
            settings named above, and ``remat=``: recompute activations in the backward pass
            instead of keeping them: ``"every"`` (each block between single tensors), ``n``
            (runs of ``n`` blocks) or a list of layer names (each one a block); see
            :func:`gacli.recompute`. No number changes.

    Example:
        >>> model = GradientAccumulateModel(accum_steps=4, inputs=base.input, outputs=base.output)
        >>> model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
        >>> model.fit(x, y, batch_size=16)  # micro-batches of 16, one update per 64 samples
    """

    @shows_config_defaults
    def __init__(
        self,
        accum_steps=None,
        mixed_precision=False,
        use_agc=None,
        clip_factor=None,
        eps=None,
        experimental_distributed_support=False,
        partial_window=None,
        accumulator_dtype=None,
        nonfinite=None,
        loss_normalization=None,
        *args,
        config=None,
        **kwargs,
    ):
        refuse_unknown_keywords(
            f"{type(self).__name__}()",
            kwargs,
            _accepted_keywords(GradientAccumulateModel, _GRAPH_KEYWORDS),
        )
        settings = take_agc_alias(pop_settings(kwargs), use_agc)
        super().__init__(*args, **kwargs)
        self.accumulation_config = _model_settings(
            config,
            mixed_precision,
            accum_steps=accum_steps,
            clip_factor=clip_factor,
            eps=eps,
            partial_window=partial_window,
            accumulator_dtype=accumulator_dtype,
            nonfinite=nonfinite,
            loss_normalization=loss_normalization,
            **settings,
        )
        # A choice of blocks that cannot be made is refused now, not at the first step.
        remat_plan(self, self.accumulation_config.remat)

    def call(self, inputs, training=None, mask=None, **kwargs):
        remat = self.accumulation_config.remat
        if remat is None or kwargs:
            return super().call(inputs, training=training, mask=mask, **kwargs)

        def plain_call():  # the functional call, with the named layers' calls recomputed
            return super(GradientAccumulateModel, self).call(inputs, training=training, mask=mask)

        return recomputing_call(
            self, remat, inputs, training=training, mask=mask, plain_call=plain_call
        )

    def get_config(self):
        if compat.is_functional(self):
            config = compat.functional_config(self)
        else:
            config = {"name": self.name, "trainable": self.trainable}
        config.update(self.accumulation_config.to_dict())
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        settings = pop_settings(config)
        model = compat.functional_from_config(cls, config, custom_objects=custom_objects)
        model.accumulation_config = AccumulationConfig(**settings)
        return model


@keras.saving.register_keras_serializable(package="gacli")
class AccumulatingModelWrapper(AccumulationMixin, keras.Model):
    """Wraps a subclassed model (one without symbolic inputs/outputs) for accumulation; takes
    the same settings as :class:`GradientAccumulateModel`."""

    @shows_config_defaults
    def __init__(
        self,
        model,
        accum_steps=None,
        mixed_precision=False,
        experimental_distributed_support=False,
        config=None,
        **kwargs,
    ):
        refuse_unknown_keywords(
            f"{type(self).__name__}()", kwargs, _accepted_keywords(AccumulatingModelWrapper)
        )
        settings = pop_settings(kwargs)
        super().__init__(**kwargs)
        self.model = model
        # The wrapper owns no weights of its own: it is built when the wrapped model is.
        self.built = model.built
        self.accumulation_config = _model_settings(
            config, mixed_precision, accum_steps=accum_steps, **settings
        )
        remat_plan(model, self.accumulation_config.remat)

    def call(self, inputs, training=None):
        remat = self.accumulation_config.remat
        if remat is None:
            return self.model(inputs, training=training)
        return recomputing_call(
            self.model,
            remat,
            inputs,
            training=training,
            plain_call=lambda: self.model(inputs, training=training),
        )

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        # The wrapped model's own compute_loss, where its class defines one, is the loss it
        # would train on in plain Keras (whose train_step calls it); it reads the compiled loss
        # of this wrapper, which is the one compiled (tests/engine/test_user_models.py).
        if not compat.overrides_compute_loss(self.model):
            return super().compute_loss(x, y, y_pred, sample_weight, training=training)
        with compat.compiled_loss_lent(self.model, self):
            return compat.compute_training_loss(
                self.model, x, y, y_pred, sample_weight, training=training
            )

    def get_config(self):
        config = {"name": self.name, "model": keras.saving.serialize_keras_object(self.model)}
        config.update(self.accumulation_config.to_dict())
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["model"] = keras.saving.deserialize_keras_object(
            config["model"], custom_objects=custom_objects
        )
        return cls(**config)


def _accepted_keywords(wrapper, graph=()):
    """What a model wrapper class takes by keyword: its own arguments, every accumulation
    setting (and the older package's names of them), and keras.Model's (``graph``: a functional
    model's too)."""
    return (
        *keyword_names(wrapper.__init__),
        *AccumulationConfig.fields(),
        *OLDER_SETTING_NAMES,
        *_LAYER_KEYWORDS,
        *graph,
    )


@shows_config_defaults
def set_accum_steps(model, accum_steps, steps_per_execution=None, restored=False):
    """Micro-batches per update from the next window on, for a compiled ``model`` that
    accumulates (a model wrapper, or any model compiled with a GradientAccumulateOptimizer): its
    optimizer, its AccumBatchNormalization layers and its settings; the window must be empty
    (``restored``: or hold what a checkpoint saved at ``accum_steps``).
    ``steps_per_execution``: micro-batches per compiled call from now on (None: unchanged).
    The train function is made again."""
    optimizer = find_accumulating_optimizer(model.optimizer)
    optimizer.set_accum_steps(accum_steps, restored=restored)
    if isinstance(model, AccumulationMixin):
        model.accumulation_config = model.accumulation_config.replace(
            accum_steps=optimizer.accum_steps
        )
    for layer in accum_batchnorm_layers(model):
        layer.accum_steps = optimizer.accum_steps
    if steps_per_execution is not None and steps_per_execution != model.steps_per_execution:
        model.steps_per_execution = steps_per_execution
        # Keras keeps its evaluate and predict functions, each traced for the old count of steps
        # per call, while their data iterators follow the new one: validation would then see
        # only some of its batches (tests/runner/plan/test_oom.py, the late recovery's val_loss).
        model.test_function = None
        model.predict_function = None
    model.make_train_function(force=True)


def wrap_model(model, accum_steps=None, config=None, **settings):
    """Return a model that trains ``model``'s own layers and weights with accumulation.

    Functional and built Sequential models are rewired into a :class:`GradientAccumulateModel` on
    the same layers; a subclassed model, and one whose class defines its own ``compute_loss``
    (which the wrapper then trains on, as Keras' ``train_step`` would), is wrapped in an
    :class:`AccumulatingModelWrapper`. Either way no weight is copied or re-initialised and
    ``count_params()`` is unchanged. ``config`` and ``settings`` are those of
    :class:`GradientAccumulateModel`.

    Example:
        >>> model = wrap_model(keras.applications.ResNet50(weights=None), accum_steps=8)
    """
    refuse_unknown_keywords(
        "wrap_model()",
        settings,
        (
            *keyword_names(wrap_model, _model_settings),
            *AccumulationConfig.fields(),
            *OLDER_SETTING_NAMES,
        ),
    )
    if isinstance(model, AccumulationMixin):
        raise ValueError("This model already accumulates gradients; set its accum_steps instead.")
    try:
        inputs, outputs = compat.graph_ends(model)
    except (AttributeError, ValueError):
        inputs = outputs = None
    # Rewired on its layers, a model would lose its class, and with it a compute_loss of its
    # own; wrapped, the wrapper trains on what that compute_loss returns.
    # A symbolic tensor has no truth value: test for "none" (None or an empty structure).
    rewirable = all(
        ends is not None and not (isinstance(ends, (list, tuple, dict)) and not ends)
        for ends in (inputs, outputs)
    )
    if rewirable and not compat.overrides_compute_loss(model):
        return GradientAccumulateModel(
            accum_steps=accum_steps,
            inputs=inputs,
            outputs=outputs,
            name=model.name,
            config=config,
            **settings,
        )
    return AccumulatingModelWrapper(model, accum_steps=accum_steps, config=config, **settings)


# Whichever of gacli's modules is imported first, Keras then knows the classes of all of them.
from gacli import _register_with_keras  # noqa: E402

_register_with_keras(finished=__name__)
