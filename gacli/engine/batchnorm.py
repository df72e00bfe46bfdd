"""Batch normalisation under gradient accumulation (contract rows B1, B2).

A plain ``BatchNormalization`` layer updates its moving statistics on every micro-batch, so under
accumulation they describe micro-batches, updated k times too often. ``AccumBatchNormalization``
pools the statistics of all micro-batches of a window (Chan et al.'s parallel update, which keeps
the between-micro-batch variance term) and updates the moving mean and variance once per window:
after one window they equal one big-batch BN step. The forward pass still normalises each
micro-batch by its own statistics; no layer can see the rest of the window before it arrives.
"""

import warnings

import keras
from keras import ops

from gacli.engine import _keras_compat as compat
from gacli.engine.options import BatchNormPolicy, parse_option
from gacli.engine.settings import keyword_names, refuse_unknown_keywords


@keras.saving.register_keras_serializable(package="gacli")
class AccumBatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` whose moving statistics are updated once per window.

    Args:
        accum_steps: micro-batches per window; must match the model's ``accum_steps``.
        **kwargs: every argument of ``keras.layers.BatchNormalization`` (``axis``, ``momentum``,
            ``epsilon``, ``center``, ``scale``, initializers, regularizers, constraints,
            ``synchronized``). ``renorm`` is not supported.

    Example:
        >>> x = AccumBatchNormalization(accum_steps=4)(keras.layers.Conv2D(16, 3)(inputs))
    """

    def __init__(self, accum_steps=1, **kwargs):
        from gacli.engine.accumulation import validate_accum_steps

        # First: Keras 3.11 has no renorm keyword, so the check below would call it unknown.
        if kwargs.get("renorm"):
            raise ValueError(
                "AccumBatchNormalization does not support renorm=True (batch renormalisation "
                "corrects each micro-batch by its own statistics); use batchnorm policy 'keep' "
                "with keras.layers.BatchNormalization(renorm=True), or 'group_norm'."
            )
        # Keras' own refusal of an unknown keyword is a ValueError that names no near one.
        refuse_unknown_keywords(
            f"{type(self).__name__}()",
            kwargs,
            (
                *keyword_names(
                    AccumBatchNormalization.__init__,
                    keras.layers.BatchNormalization.__init__,
                    keras.layers.Layer.__init__,
                ),
                # Any layer takes these two too, with a warning to use keras.Input instead.
                "input_shape",
                "input_dim",
            ),
        )
        super().__init__(**kwargs)
        self.accum_steps = validate_accum_steps(accum_steps)

    def build(self, input_shape):
        super().build(input_shape)
        channels = (input_shape[self.axis],)

        def state(name, shape, dtype="float32"):
            return self.add_weight(
                shape=shape,
                initializer="zeros",
                dtype=dtype,
                trainable=False,
                autocast=False,
                name=name,
            )

        # Running pooled statistics of the open window: element count per channel, mean and sum
        # of squared deviations (M2), and micro-batches seen.
        self.window_count = state("window_count", ())
        self.window_mean = state("window_mean", channels)
        self.window_m2 = state("window_m2", channels)
        self.window_position = state("window_position", (), "int64")

    def _assert_input_compatibility(self, arg_0):
        # One instance in one place: its window counts the micro-batches of one input. Keras'
        # own check would only say the rank is wrong when the instance is reused on another.
        if self.built and self.input_spec is not None and self.input_spec.ndim is not None:
            rank = len(getattr(arg_0, "shape", ()))
            if rank != self.input_spec.ndim:
                raise ValueError(shared_layer_message(self, (self.input_spec.ndim, rank)))
        super()._assert_input_compatibility(arg_0)

    def _element_count(self, inputs, mask):
        """Elements per channel that the micro-batch's moments were taken over."""
        if mask is None:
            shape = ops.shape(inputs)
            count = 1.0
            for axis in compat.batchnorm_reduction_axes(self):
                count = count * ops.cast(shape[axis], "float32")
        else:
            # Keras broadcasts a mask over the channel axis: every channel sees sum(mask).
            count = ops.sum(ops.cast(mask, "float32"))
        if self.synchronized:
            import tensorflow as tf

            count = count * tf.distribute.get_strategy().num_replicas_in_sync
        return count

    def call(self, inputs, training=None, mask=None):
        if not (training and self.trainable):
            return super().call(inputs, training=False, mask=mask)
        compute_dtype = keras.backend.result_type(inputs.dtype, "float32")
        inputs = ops.cast(inputs, compute_dtype)
        mean, variance = compat.batchnorm_moments(self, inputs, mask)
        mean = ops.cast(mean, "float32")
        variance = ops.cast(variance, "float32")
        self._pool(mean, variance, self._element_count(inputs, mask))
        gamma = ops.cast(self.gamma, inputs.dtype) if self.scale else None
        beta = ops.cast(self.beta, inputs.dtype) if self.center else None
        outputs = ops.batch_normalization(
            x=inputs,
            mean=ops.cast(mean, inputs.dtype),
            variance=ops.cast(variance, inputs.dtype),
            axis=self.axis,
            offset=beta,
            scale=gamma,
            epsilon=self.epsilon,
        )
        return ops.cast(outputs, self.compute_dtype)

    def _pool(self, mean, variance, count):
        """Fold one micro-batch's moments into the window; update moving stats when it is full."""
        # A replica can get an empty micro-batch (the short end of a dataset split over replicas):
        # its moments are nan and it must fold in as nothing.
        has_samples = count > 0
        mean = ops.where(has_samples, mean, self.window_mean)
        variance = ops.where(has_samples, variance, ops.zeros_like(variance))
        previous_count = self.window_count
        total = previous_count + count
        delta = mean - self.window_mean
        pooled_mean = self.window_mean + delta * ops.divide_no_nan(count, total)
        pooled_m2 = (
            self.window_m2
            + variance * count
            + ops.square(delta) * ops.divide_no_nan(previous_count * count, total)
        )
        position = self.window_position + 1
        self._close_window_if(position >= self.accum_steps, total, pooled_mean, pooled_m2, position)

    def _close_window_if(self, close, total, pooled_mean, pooled_m2, position):
        # ops.where, not a Python or graph branch: the same graph serves every micro-step (X2).
        pooled_variance = pooled_m2 / ops.maximum(total, 1.0)
        momentum = self.momentum
        new_moving_mean = self.moving_mean * momentum + pooled_mean * (1.0 - momentum)
        new_moving_variance = self.moving_variance * momentum + pooled_variance * (1.0 - momentum)
        self.moving_mean.assign(ops.where(close, new_moving_mean, self.moving_mean))
        self.moving_variance.assign(ops.where(close, new_moving_variance, self.moving_variance))
        self.window_count.assign(ops.where(close, 0.0, total))
        self.window_mean.assign(ops.where(close, ops.zeros_like(pooled_mean), pooled_mean))
        self.window_m2.assign(ops.where(close, ops.zeros_like(pooled_m2), pooled_m2))
        self.window_position.assign(ops.where(close, ops.zeros_like(position), position))

    def finish_window(self, apply=True):
        """Close an open (partial) window: update the moving statistics from it, or drop it."""
        if not self.built:
            return
        if apply:
            self._close_window_if(
                self.window_count > 0,
                self.window_count,
                self.window_mean,
                self.window_m2,
                self.window_position,
            )
        else:
            self.window_count.assign(0.0)
            self.window_mean.assign(ops.zeros_like(self.window_mean))
            self.window_m2.assign(ops.zeros_like(self.window_m2))
            self.window_position.assign(0)

    def get_config(self):
        config = super().get_config()
        config["accum_steps"] = self.accum_steps
        return config


@keras.saving.register_keras_serializable(package="gacli")
class BatchGroupNormalization(keras.layers.GroupNormalization):
    """``GroupNormalization`` that accepts (and ignores) the ``mask`` a BN layer was called with,
    so it can take a BN layer's place in an existing graph."""

    def call(self, inputs, mask=None):
        return super().call(inputs)


def _batchnorm_layers(model):
    return [
        layer
        for layer in compat.sublayers(model)
        if isinstance(layer, keras.layers.BatchNormalization)
    ]


def plain_batchnorm_layers(model):
    """The Keras BatchNormalization layers inside ``model`` that gacli has not replaced."""
    return [
        layer
        for layer in _batchnorm_layers(model)
        if type(layer) is keras.layers.BatchNormalization
    ]


def shared_layer_message(layer, ranks=None):
    """Why one AccumBatchNormalization instance cannot be applied at two places of a model."""
    seen = f" to inputs of rank {ranks[0]} and rank {ranks[1]}" if ranks else " at two places"
    return (
        f"AccumBatchNormalization {layer.name!r} is applied{seen}. Its window counts the "
        "micro-batches of one input and pools their statistics into one set of moving "
        "statistics, so one instance belongs in one place (gradient-accumulator's own tests "
        "shared one between a Conv2D and a Dense output, which pooled both and closed its window "
        "twice as often). Make one layer per place, e.g. AccumBatchNormalization(accum_steps=k) "
        "after the convolution and another after the Dense layer."
    )


def shared_accum_batchnorm_layers(model):
    """The AccumBatchNormalization layers of ``model`` that it calls at more than one place."""
    return [layer for layer in accum_batchnorm_layers(model) if len(compat.call_sites(layer)) > 1]


class BatchNormWarning(UserWarning):
    """A model that accumulates gradients has BatchNormalization layers in training mode: each
    micro-batch is normalised by its own statistics, so its weights are not the big batch's."""


def micro_batch_statistics_message(layers, accum_steps):
    """The paragraph of :class:`BatchNormWarning` for ``layers``; its advice follows the measured
    comparison of the policies in docs/guides/batch-norm.md."""
    names = ", ".join(layer.name for layer in layers[:3]) + (", ..." if len(layers) > 3 else "")
    return (
        f"{len(layers)} BatchNormalization layer(s) in training mode ({names}) compute "
        "statistics per micro-batch and normalise each micro-batch by its own, so with "
        f"accum_steps={accum_steps} the weights are "
        "not those of one big batch (every other part of the update is). Choose a policy with "
        "gacli.apply_batchnorm_policy(model, policy, accum_steps) before wrapping (ga-train: "
        "batchnorm=policy): 'freeze' (inference mode: exact, for fine-tuning), 'group_norm' (no "
        "batch statistics: exact, but a different layer), 'precise' (training as it is, moving "
        "statistics recomputed exactly before validation: the best validation of the policies "
        "measured in gacli's batch-norm guide) or 'accumulate' (the big batch's moving "
        "statistics, which need thousands of updates to settle). Having chosen to keep them: "
        "warnings.filterwarnings('ignore', category=gacli.BatchNormWarning)."
    )


def warn_micro_batch_statistics(model, accum_steps, stacklevel=3):
    """Warn (:class:`BatchNormWarning`) when ``model`` has trainable plain BatchNormalization
    layers and ``accum_steps`` > 1; whether it warned."""
    layers = [layer for layer in plain_batchnorm_layers(model) if layer.trainable]
    if accum_steps <= 1 or not layers:
        return False
    warnings.warn(
        micro_batch_statistics_message(layers, accum_steps), BatchNormWarning, stacklevel=stacklevel
    )
    return True


def accum_batchnorm_layers(model):
    """The AccumBatchNormalization layers inside ``model`` (nested models included)."""
    return [
        layer for layer in _batchnorm_layers(model) if isinstance(layer, AccumBatchNormalization)
    ]


def _group_count(channels, groups):
    groups = min(groups, channels)
    while channels % groups:
        groups -= 1
    return groups


def _swap_layer(layer, policy, accum_steps, groups):
    if type(layer) is not keras.layers.BatchNormalization:
        return layer  # every other layer is reused as is: same weights, nothing copied
    config = layer.get_config()
    if policy is BatchNormPolicy.accumulate:
        new = AccumBatchNormalization.from_config({**config, "accum_steps": accum_steps})
        new.build(layer.input.shape)
        for name in ("gamma", "beta", "moving_mean", "moving_variance"):
            if getattr(layer, name, None) is not None:
                getattr(new, name).assign(getattr(layer, name))
        return new
    channels = layer.gamma.shape[0] if layer.scale else layer.moving_mean.shape[0]
    new = BatchGroupNormalization(
        groups=_group_count(channels, groups),
        axis=layer.axis,
        epsilon=layer.epsilon,
        center=layer.center,
        scale=layer.scale,
        name=f"{layer.name}_group_norm",
    )
    new.build(layer.input.shape)
    if layer.scale:
        new.gamma.assign(layer.gamma)
    if layer.center:
        new.beta.assign(layer.beta)
    return new


def apply_batchnorm_policy(model, policy="accumulate", accum_steps=1, groups=32, warn=True):
    """Return ``model`` with its BatchNormalization layers handled per ``policy``.

    ``accumulate`` swaps each BN layer for an :class:`AccumBatchNormalization` carrying over gamma,
    beta, moving mean and moving variance, so a pretrained model's inference output is unchanged
    (contract B2). ``group_norm`` swaps in ``GroupNormalization`` (gamma and beta carried over; its
    output differs, it has no batch statistics). ``freeze`` puts BN layers in inference mode in
    place; ``keep`` changes nothing and warns once; ``precise`` changes nothing (add a
    :class:`~gacli.engine.precise_batchnorm.PreciseBatchNorm` callback to ``fit``, which sets the
    moving statistics). Every other layer is reused, not copied.

    Args:
        model: a functional or Sequential model (subclassed models cannot be rewired; build them
            with ``AccumBatchNormalization`` directly).
        policy: ``"keep"``, ``"accumulate"``, ``"freeze"``, ``"group_norm"`` or ``"precise"``.
        accum_steps: the window length for ``accumulate``.
        groups: the largest group count for ``group_norm`` (reduced to divide the channels).
        warn: under ``keep``, warn once that BN statistics are per micro-batch (``ga-train``
            says so in its start-up panel instead).

    Example:
        >>> base = keras.applications.ResNet50(weights=None)
        >>> model = apply_batchnorm_policy(base, "accumulate", 8)
    """
    policy = parse_option(BatchNormPolicy, policy, "batchnorm")
    layers = plain_batchnorm_layers(model)
    if not layers:
        return model
    if policy is BatchNormPolicy.precise:
        return model  # the layers train as they are; PreciseBatchNorm sets their statistics
    if policy is BatchNormPolicy.keep:
        if warn:
            # Python's warning filters show it once per place it is called from.
            warn_micro_batch_statistics(model, accum_steps)
        return model
    if policy is BatchNormPolicy.freeze:
        for layer in layers:
            layer.trainable = False
        return model
    if not compat.is_functional(model):
        raise ValueError(
            f"batchnorm={policy.value!r} rewires the model's graph, which a subclassed model does "
            "not have; build it with gacli.AccumBatchNormalization (or GroupNormalization) "
            "in place of BatchNormalization, or use batchnorm='freeze' or 'keep'."
        )
    return keras.models.clone_model(
        model,
        clone_function=lambda layer: _swap_layer(layer, policy, accum_steps, groups),
    )


def replace_batchnorm_layers(model, accum_steps, position="replace"):
    """``gradient-accumulator``'s name for ``apply_batchnorm_policy(model, "accumulate", ...)``.

    Returns ``model`` with every ``BatchNormalization`` layer swapped for an
    :class:`AccumBatchNormalization` of the same configuration, carrying over gamma, beta, moving
    mean and moving variance (``gradient-accumulator`` carried over only the moving statistics).

    Args:
        model: a functional or Sequential model.
        accum_steps: the window length, the model's ``accum_steps``.
        position: only ``"replace"``. ``gradient-accumulator`` named the argument after the
            insert-a-layer recipe it came from but raised for every other value; ``"before"`` or
            ``"after"`` would put a second normalisation next to the first.

    Example:
        >>> model = replace_batchnorm_layers(keras.applications.ResNet50(weights=None), 8)
    """
    if position != "replace":
        raise ValueError(
            f"replace_batchnorm_layers(position={position!r}): only position='replace' is "
            "supported (as in gradient-accumulator); inserting an AccumBatchNormalization before "
            "or after a BatchNormalization would normalise twice. Call it with position='replace' "
            "or leave position out."
        )
    return apply_batchnorm_policy(model, BatchNormPolicy.accumulate, accum_steps)


# Whichever of gacli's modules is imported first, Keras then knows the classes of all of them.
from gacli import _register_with_keras  # noqa: E402

_register_with_keras(finished=__name__)
