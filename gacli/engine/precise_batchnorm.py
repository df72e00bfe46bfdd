"""Precise batch normalisation: moving statistics recomputed from the current weights.

A BN layer's moving mean and variance are an exponential average over the whole run, most of it
taken with older weights. Under accumulation with once-per-window updates (``batchnorm=accumulate``)
a short run makes few updates, and at ``momentum=0.99`` the averages barely leave their initial
values; with per-micro-batch updates they trail the weights. Precise BN (Wu and Johnson, "Rethinking
'Batch' in BatchNorm", 2021, https://arxiv.org/abs/2105.07576) replaces them, before a
validation and after training, by the population statistics of each BN layer's input under the
current weights: the exact mean and variance pooled over N training micro-batches.

The pass runs on a copy of the model's graph in which each BN layer is replaced by a probe, an
``AccumBatchNormalization`` whose window never closes: it normalises each micro-batch by its own
statistics, as training does, and pools them (including the between-micro-batch variance). Every
other layer is the model's own, called in inference mode, so no dropout or noise layer draws a
random number; no weight, optimizer variable or counter of the model is touched, only the moving
mean and variance of its trainable BN layers (frozen ones keep theirs).
"""

import keras
import tensorflow as tf
from keras import ops

from gacli.engine.batchnorm import AccumBatchNormalization

# A window longer than any pass: the probe pools every micro-batch it sees.
_NEVER_CLOSES = 2**62


class _StatisticsProbe(AccumBatchNormalization):
    """Normalises by batch statistics whatever ``training`` says, and pools them."""

    def call(self, inputs, training=None, mask=None):
        return super().call(inputs, training=True, mask=mask)


def _graph_model(model):
    """``model``'s layer graph as a plain functional model (no custom class to rebuild)."""
    try:
        # .input, not .inputs: the structure the model is called with (no warning per trace).
        inputs, outputs = model.input, model.output
    except (AttributeError, ValueError):
        inputs = outputs = None
    if inputs is None or outputs is None:
        raise ValueError(
            "precise batch norm needs a functional or Sequential model (it runs the model's layer "
            "graph with probes in place of its BN layers); a subclassed model has no graph. Use "
            "batchnorm 'accumulate' with gacli.AccumBatchNormalization layers instead."
        )
    return keras.Model(inputs, outputs)


class BatchNormStatistics:
    """Recomputes the moving statistics of a model's BN layers from micro-batches of data.

    Args:
        model: a functional or Sequential model (a gacli model wrapper included), built.

    Example:
        >>> BatchNormStatistics(model).recompute(train_dataset.batch(8).take(200))
    """

    def __init__(self, model):
        self.pairs = []

        def swap(layer):
            if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable:
                probe = _StatisticsProbe.from_config(
                    {
                        **layer.get_config(),
                        "accum_steps": _NEVER_CLOSES,
                        "name": f"{layer.name}_statistics_probe",
                    }
                )
                self.pairs.append((layer, probe))
                return probe
            return layer  # every other layer is the model's own: same weights, no copy

        self.probe_model = keras.models.clone_model(
            _graph_model(model), clone_function=swap, recursive=True
        )
        self._pass = None

    def recompute(self, micro_batches):
        """Set each BN layer's moving mean and variance to those of its inputs over
        ``micro_batches`` (an iterable of model inputs, or of (x, y[, sample_weight]) tuples).

        Returns:
            The number of samples the statistics were pooled over.
        """
        if not self.pairs:
            return 0
        for layer, probe in self.pairs:
            for name in ("gamma", "beta"):
                if getattr(layer, name, None) is not None:
                    getattr(probe, name).assign(getattr(layer, name))
            probe.finish_window(apply=False)
        if self._pass is None:
            self._pass = tf.function(self._run, reduce_retracing=True)
        samples = int(self._pass(micro_batches))
        if samples == 0:
            raise ValueError(
                "precise batch norm got no micro-batches to pool; pass a non-empty dataset."
            )
        for layer, probe in self.pairs:
            layer.moving_mean.assign(ops.cast(probe.window_mean, layer.moving_mean.dtype))
            variance = probe.window_m2 / ops.maximum(probe.window_count, 1.0)
            layer.moving_variance.assign(ops.cast(variance, layer.moving_variance.dtype))
        return samples

    def _run(self, micro_batches):
        samples = tf.constant(0, "int64")
        for data in micro_batches:
            x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
            self.probe_model(x, training=False)
            first = tf.nest.flatten(x)[0]
            samples += tf.cast(tf.shape(first)[0], "int64")
        return samples


class PreciseBatchNorm(keras.callbacks.Callback):
    """Recomputes BN moving statistics from training data before validation and after ``fit``.

    Add it to ``fit``'s callbacks (last, after any that change the weights at epoch ends). Each
    recomputation runs the model forward over ``micro_batches`` micro-batches of ``data`` and sets
    every trainable BN layer's moving mean and variance to the exact pooled statistics of its
    inputs; training itself is not changed. It is skipped when no optimizer update happened since
    the last one.

    Args:
        data: a ``tf.data.Dataset`` of micro-batches (inputs, or (x, y[, sample_weight])), e.g.
            the training data shuffled and batched at the training micro-batch size; or a NumPy
            array of inputs, batched here by ``batch_size``.
        micro_batches: how many micro-batches to pool (fewer if ``data`` ends first).
        batch_size: the micro-batch size, for array ``data``.
        before_validation: also recompute before each validation inside ``fit``, so validation
            metrics describe the current weights; otherwise only at the end of training.

    Example:
        >>> batches = train.shuffle(1000, seed=0).batch(8)
        >>> model.fit(train.batch(8), validation_data=val.batch(8), epochs=10,
        ...           callbacks=[gacli.PreciseBatchNorm(batches, micro_batches=200)])
    """

    def __init__(self, data, micro_batches=200, batch_size=None, before_validation=True):
        super().__init__()
        if (
            isinstance(micro_batches, bool)
            or not isinstance(micro_batches, int)
            or (micro_batches < 1)
        ):
            raise ValueError(
                f"micro_batches={micro_batches!r} must be a whole number >= 1 (training "
                "micro-batches to pool the statistics over), e.g. micro_batches=200."
            )
        if not isinstance(data, tf.data.Dataset):
            if batch_size is None:
                raise ValueError(
                    "PreciseBatchNorm got array data without batch_size; pass the training "
                    "micro-batch size, e.g. batch_size=8, or a batched tf.data.Dataset."
                )
            data = tf.data.Dataset.from_tensor_slices(data).batch(batch_size)
        self.data = data.take(micro_batches)
        self.micro_batches = micro_batches
        self.before_validation = before_validation
        self._statistics = None
        self._training = False
        self._done_at = None

    def _probe(self):
        if self._statistics is None:
            self._statistics = BatchNormStatistics(self.model)
        return self._statistics

    def recompute(self):
        """Recompute now; returns the number of samples pooled."""
        statistics = self._probe()
        self._done_at = self._update_count()
        return statistics.recompute(self.data)

    def _update_count(self):
        optimizer = getattr(self.model, "optimizer", None)
        return None if optimizer is None else int(optimizer.iterations.numpy())

    def _recompute_if_trained(self):
        if self._done_at is None or self._update_count() != self._done_at:
            self.recompute()

    def on_train_begin(self, logs=None):
        self._training = True
        self._probe()  # a model it cannot probe fails here, before any training

    def on_test_begin(self, logs=None):
        if self._training and self.before_validation:
            self._recompute_if_trained()

    def on_train_end(self, logs=None):
        self._training = False
        self._recompute_if_trained()
