"""``GradientAccumulateModel``: a Keras 3 model whose ``fit`` accumulates gradients.

``model.fit(x, y, batch_size=16)`` on a model with ``accum_steps=4`` trains on micro-batches of 16
and updates the weights once per 64 samples, exactly as one batch of 64 would (including a short
last micro-batch, which is weighted by its real size, and the short last window of an epoch, which
is applied per ``partial_window`` before validation runs). The accumulators live in a
:class:`~gacli.accumulation.GradientAccumulateOptimizer` that ``compile`` wraps around the optimizer
you pass, so ``count_params()`` is unchanged and checkpoints carry the open window.
"""

import keras
import tensorflow as tf
from keras.src.backend.tensorflow.trainer import reduce_per_replica
from keras.src.losses.loss import unscale_loss_for_distribution
from keras.src.models.functional import Functional, functional_from_config
from keras.src.trainers.data_adapters import data_adapter_utils

from gacli._keras_versions import autoconvert_optionals, functional_config  # version:
from gacli.accumulation import (
    GradientAccumulateOptimizer,
    StopOnNonFinite,
    find_accumulating_optimizer,
    validate_accum_steps,
)
from gacli.batchnorm import accum_batchnorm_layers
from gacli.host_memory import HostMemoryCallback
from gacli.options import LossNormalization, NonFinite, PartialWindow, Reduction, parse_option

# The accumulation settings a model stores and serialises (their defaults are in the signatures).
_ACCUMULATION_KEYS = (
    "accum_steps", "use_agc", "clip_factor", "eps", "partial_window", "accumulator_dtype",
    "nonfinite", "loss_normalization",
)


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
    return keras.losses.LossFunctionWrapper(
        loss, reduction="mean_with_sample_weight", name=getattr(loss, "__name__", None)
    )


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


def _reducible_logs(logs, strategy):
    """Logs that Keras can average over workers.

    Across workers Keras averages a step's logs with ``strategy.reduce("MEAN", value, axis=0)``,
    which fails on the scalars every step returns (keras-team/keras#20585); as vectors of one they
    average to the same scalar. One process keeps its scalars.
    """
    extended = getattr(strategy, "extended", None)
    if not (isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
            and extended._in_multi_worker_mode()):
        return logs
    return tf.nest.map_structure(
        lambda value: tf.reshape(value, [1]) if getattr(value, "shape", None) == () else value,
        logs,
    )


class AccumulationMixin:
    """``compile``/``train_step``/``fit`` of a Keras model that accumulates gradients."""

    def _configure_accumulation(
        self,
        accum_steps=1,
        mixed_precision=False,
        use_agc=False,
        clip_factor=0.01,
        eps=1e-3,
        experimental_distributed_support=False,
        partial_window="apply",
        accumulator_dtype="float32",
        nonfinite=None,
        loss_normalization="batch",
    ):
        # experimental_distributed_support is accepted for gradient-accumulator users; gacli
        # always supports tf.distribute, so it changes nothing.
        del experimental_distributed_support
        if mixed_precision and keras.mixed_precision.global_policy().name != "mixed_float16":
            raise ValueError(
                "mixed_precision=True needs the mixed_float16 policy in Keras 3: call "
                "keras.mixed_precision.set_global_policy('mixed_float16') before building the "
                "model's layers; model.compile then adds loss scaling by itself."
            )
        self.accum_steps = validate_accum_steps(accum_steps)
        self.use_agc = bool(use_agc)
        self.clip_factor = float(clip_factor)
        self.eps = float(eps)
        self.partial_window = parse_option(PartialWindow, partial_window, "partial_window").value
        self.accumulator_dtype = keras.backend.standardize_dtype(accumulator_dtype)
        self.nonfinite = (
            None if nonfinite is None else parse_option(NonFinite, nonfinite, "nonfinite").value
        )
        self.loss_normalization = parse_option(
            LossNormalization, loss_normalization, "loss_normalization"
        ).value

    def _accumulation_config(self):
        return {key: getattr(self, key) for key in _ACCUMULATION_KEYS}

    def compile(self, optimizer="rmsprop", loss=None, *args, **kwargs):
        if isinstance(optimizer, str):
            optimizer = optimizer.lower()
        optimizer = keras.optimizers.get(optimizer)
        if isinstance(optimizer, GradientAccumulateOptimizer):
            if optimizer.accum_steps != self.accum_steps:
                raise ValueError(
                    f"The model has accum_steps={self.accum_steps} but its "
                    f"GradientAccumulateOptimizer has accum_steps={optimizer.accum_steps}; pass "
                    "the plain optimizer to compile and the model wraps it."
                )
        else:
            optimizer = GradientAccumulateOptimizer(
                optimizer,
                accum_steps=self.accum_steps,
                use_agc=self.use_agc,
                clip_factor=self.clip_factor,
                eps=self.eps,
                partial_window=self.partial_window,
                accumulator_dtype=self.accumulator_dtype,
                # Under mixed_float16 the accumulator scales the loss itself (P2), so that each
                # micro-batch is unscaled with its own scale and overflows follow `nonfinite`.
                loss_scaling=self.dtype_policy.name == "mixed_float16",
                nonfinite=self.nonfinite,
            )
        if optimizer.loss_scaling:
            kwargs["auto_scale_loss"] = False
        if self.loss_normalization == LossNormalization.window_weights.value:
            loss = _window_weighted_loss(loss)
        mismatched = [
            layer.name for layer in accum_batchnorm_layers(self)
            if layer.accum_steps != self.accum_steps
        ]
        if mismatched:
            raise ValueError(
                f"AccumBatchNormalization layers {mismatched} have a different accum_steps than "
                f"the model ({self.accum_steps}); build them with accum_steps={self.accum_steps} "
                "so their windows are the optimizer's windows."
            )
        super().compile(optimizer, loss, *args, **kwargs)

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

    def train_step(self, data):
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        sample_count = tf.shape(next(t for t in tf.nest.flatten(x) if t is not None))[0]
        if self.loss_normalization == LossNormalization.window_weights.value:
            if sample_weight is None:
                raise ValueError(
                    "loss_normalization='window_weights' divides the window's loss by its total "
                    "sample weight, but fit() got none: pass sample_weight= (e.g. the token "
                    "mask), or use loss_normalization='batch'."
                )
            sample_count = tf.add_n(
                [tf.reduce_sum(tf.cast(w, "float32")) for w in tf.nest.flatten(sample_weight)]
            )
        with tf.GradientTape() as tape:
            if self._call_has_training_arg:
                y_pred = self(x, training=True)
            else:
                y_pred = self(x)
            # Keras divides the loss by the number of replicas; the accumulator instead divides
            # by the window's global sample count, so it needs the per-replica mean loss.
            loss = unscale_loss_for_distribution(
                self._compute_loss(
                    x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
                )
            )
            self._loss_tracker.update_state(loss, sample_weight=sample_count)
            accumulator = self.accumulating_optimizer
            # The accumulator weighs each micro-batch by its count: weighing the loss gives the
            # weighted gradients straight from the backward pass, one pass over them less. Not
            # under loss scaling: float16 gradients times the count would overflow sooner.
            summed = (accumulator.reduction is Reduction.mean and accumulator is self.optimizer
                      and not accumulator.loss_scaling)
            if summed:
                loss = loss * tf.cast(sample_count, loss.dtype)
            scaled_loss = self.optimizer.scale_loss(loss)
        trainable_weights = self.trainable_weights
        if trainable_weights:
            gradients = tape.gradient(scaled_loss, trainable_weights)
            if accumulator is self.optimizer:
                accumulator.apply(gradients, trainable_weights, sample_count=sample_count,
                                  summed=summed)
            else:
                # A LossScaleOptimizer around the accumulator unscales each micro-batch with its
                # own scale and skips non-finite ones; it cannot forward the count, so it is
                # handed over beside the call.
                with accumulator.sample_count_scope(sample_count):
                    self.optimizer.apply(gradients, trainable_weights)
        logs = self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        return _reducible_logs({**logs, **self._accumulation_logs()}, self.distribute_strategy)

    def test_step(self, data):
        return _reducible_logs(super().test_step(data), self.distribute_strategy)

    def _accumulation_logs(self):
        """Loss scale and skip counts, when in use, beside the loss in fit()'s logs."""
        accumulator = self.accumulating_optimizer
        logs = {}
        if accumulator.nonfinite is not None:
            logs["skipped_micro_batches"] = tf.convert_to_tensor(
                accumulator.skipped_micro_batches
            )
            logs["skipped_windows"] = tf.convert_to_tensor(accumulator.skipped_windows)
        if accumulator.loss_scaling:
            logs["loss_scale"] = tf.convert_to_tensor(accumulator.loss_scale)
        return logs

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Keras builds the model from one batch before fit/evaluate under a strategy, averaging
        # the per-replica batches with strategy.reduce; MultiWorkerMirroredStrategy cannot reduce
        # an input batch eagerly (keras-team/keras#20585). Only the batch's shapes matter here, so
        # the first local replica's batch builds the model just as well, under any strategy.
        if self._distribute_strategy is None or iterator is None:
            return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)
        for _, _, batches in iterator:
            batch = next(batches)
            data_batch = tf.nest.map_structure(
                lambda value: self._distribute_strategy.experimental_local_results(value)[0]
                if isinstance(value, tf.distribute.DistributedValues) else value,
                batch,
            )
            break
        with self._distribute_strategy.scope():
            self._symbolic_build(data_batch=data_batch)

    def _make_function(self, step_function):
        # Keras runs steps_per_execution > 1 steps in a tf.while_loop whose body puts each step in
        # a tf.cond; with several replicas in sync that graph fails when it runs ("You must feed
        # a value for placeholder tensor 'while/body/.../Placeholder_1'", Keras 3.15, with or
        # without accumulation). The same loop without the tf.cond (its condition already checks
        # that data is left) runs, for training and validation alike.
        strategy = self.distribute_strategy
        if self.steps_per_execution == 1 or self.run_eagerly or (
            strategy.num_replicas_in_sync == 1
        ):
            return super()._make_function(step_function)
        steps = self.steps_per_execution

        def one_step(data):
            outputs = strategy.run(step_function, args=(data,))
            return reduce_per_replica(outputs, strategy, reduction="auto")

        one_step = autoconvert_optionals(  # version: Keras <= 3.11 (_keras_versions)
            self, tf.function(one_step, reduce_retracing=True, jit_compile=self.jit_compile)
        )

        @tf.function(reduce_retracing=True)
        def several_steps(iterator):
            # The outputs' structure is known once the body is traced (as in Keras' own loop).
            none_yet = tf.experimental.Optional.empty(None)

            def data_left(step, outputs, inputs):
                return tf.logical_and(step < steps, inputs.has_value())

            def body(step, outputs, inputs):
                outputs = tf.experimental.Optional.from_value(one_step(inputs.get_value()))
                none_yet._element_spec = outputs.element_spec
                inputs = tf.cond(step + 1 < steps, iterator.get_next_as_optional,
                                 lambda: inputs)
                return step + 1, outputs, inputs

            _, outputs, _ = tf.while_loop(
                data_left, body, [tf.constant(0), none_yet, iterator.get_next_as_optional()]
            )
            outputs._element_spec = none_yet.element_spec
            return outputs

        def function(iterator):
            outputs = several_steps(iterator)
            if not outputs.has_value():
                raise StopIteration
            return outputs.get_value()

        return function

    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
            **kwargs):
        if self.accumulating_optimizer is None:
            raise RuntimeError("Call model.compile(optimizer=..., loss=...) before fit().")
        if self.built and not self.optimizer.built:
            # Keras builds optimizers inside the first trace when no strategy is set, which makes
            # tf.function trace twice (twice the XLA compile time); build the accumulators first.
            with self.distribute_strategy.scope():
                self.optimizer.build(self.trainable_variables)
        callbacks = list(callbacks or [])
        if self.accumulating_optimizer.nonfinite is NonFinite.stop and not any(
            isinstance(callback, StopOnNonFinite) for callback in callbacks
        ):
            # First: it must stop the run before a checkpoint callback saves the step.
            callbacks.insert(0, StopOnNonFinite(self.accumulating_optimizer))
        callbacks.insert(0, WindowCallback(self.accumulating_optimizer))
        if not any(isinstance(callback, HostMemoryCallback) for callback in callbacks):
            callbacks.append(HostMemoryCallback())
        return super().fit(x, y, batch_size=batch_size, epochs=epochs, verbose=verbose,
                           callbacks=callbacks, **kwargs)


@keras.saving.register_keras_serializable(package="gacli")
class GradientAccumulateModel(AccumulationMixin, keras.Model):
    """A functional Keras model that trains with gradient accumulation.

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
        nonfinite: ``"skip_micro_batch"`` or ``"skip_window"``: what an inf/nan micro-batch
            gradient does (default under mixed_float16: skip_micro_batch; otherwise unchecked).
        loss_normalization: ``"batch"`` (Keras' semantics) or ``"window_weights"``: divide by the
            window's total sample weight, e.g. its unmasked tokens, over all replicas.
        *args, **kwargs: ``inputs=...``, ``outputs=...``, ``name=...`` as for ``keras.Model``.

    Example:
        >>> model = GradientAccumulateModel(accum_steps=4, inputs=base.input, outputs=base.output)
        >>> model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
        >>> model.fit(x, y, batch_size=16)  # micro-batches of 16, one update per 64 samples
    """

    def __init__(
        self,
        accum_steps=1,
        mixed_precision=False,
        use_agc=False,
        clip_factor=0.01,
        eps=1e-3,
        experimental_distributed_support=False,
        partial_window="apply",
        accumulator_dtype="float32",
        nonfinite=None,
        loss_normalization="batch",
        *args,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self._configure_accumulation(
            accum_steps, mixed_precision, use_agc, clip_factor, eps,
            experimental_distributed_support, partial_window, accumulator_dtype, nonfinite,
            loss_normalization,
        )

    def get_config(self):
        if isinstance(self, Functional):
            config = functional_config(self)  # version: Keras <= 3.14 (_keras_versions)
        else:
            config = {"name": self.name, "trainable": self.trainable}
        config.update(self._accumulation_config())
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        accumulation = {key: config.pop(key) for key in _ACCUMULATION_KEYS if key in config}
        model = functional_from_config(cls, config, custom_objects=custom_objects)
        model._configure_accumulation(**accumulation)
        return model


@keras.saving.register_keras_serializable(package="gacli")
class AccumulatingModelWrapper(AccumulationMixin, keras.Model):
    """Wraps a subclassed model (one without symbolic inputs/outputs) for accumulation."""

    def __init__(self, model, accum_steps=1, partial_window="apply", accumulator_dtype="float32",
                 use_agc=False, clip_factor=0.01, eps=1e-3, nonfinite=None,
                 loss_normalization="batch", **kwargs):
        super().__init__(**kwargs)
        self.model = model
        # The wrapper owns no weights of its own: it is built when the wrapped model is.
        self.built = model.built
        self._configure_accumulation(
            accum_steps, use_agc=use_agc, clip_factor=clip_factor, eps=eps,
            partial_window=partial_window, accumulator_dtype=accumulator_dtype,
            nonfinite=nonfinite, loss_normalization=loss_normalization,
        )

    def call(self, inputs, training=None):
        return self.model(inputs, training=training)

    def get_config(self):
        config = {"name": self.name, "model": keras.saving.serialize_keras_object(self.model)}
        config.update(self._accumulation_config())
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["model"] = keras.saving.deserialize_keras_object(
            config["model"], custom_objects=custom_objects
        )
        return cls(**config)


def wrap_model(model, accum_steps, **accumulation):
    """Return a model that trains ``model``'s own layers and weights with accumulation.

    Functional and built Sequential models are rewired into a :class:`GradientAccumulateModel` on
    the same layers; a subclassed model is wrapped in an :class:`AccumulatingModelWrapper`. Either
    way no weight is copied or re-initialised and ``count_params()`` is unchanged.

    Example:
        >>> model = wrap_model(keras.applications.ResNet50(weights=None), accum_steps=8)
    """
    if isinstance(model, AccumulationMixin):
        raise ValueError("This model already accumulates gradients; set its accum_steps instead.")
    try:
        inputs, outputs = model.inputs, model.outputs
    except (AttributeError, ValueError):
        inputs = outputs = None
    if inputs and outputs:
        return GradientAccumulateModel(
            accum_steps=accum_steps, inputs=inputs, outputs=outputs, name=model.name,
            **accumulation,
        )
    return AccumulatingModelWrapper(model, accum_steps=accum_steps, **accumulation)


# Whichever of gacli's modules is imported first, Keras then knows the classes of all of them.
from gacli import _register_with_keras  # noqa: E402

_register_with_keras(finished=__name__)
