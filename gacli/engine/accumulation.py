"""The accumulation engine: an optimizer that sums micro-batch gradients and updates once a window.

Everything that must happen once per optimizer update (LR schedule, Adam bias correction, weight
decay, EMA, clipnorm / global_clipnorm / clipvalue, AGC) is left to the wrapped ("inner") optimizer
or done here on the accumulated gradient, so it acts on the window exactly as it would on one big
batch. The inner optimizer's ``iterations`` therefore counts optimizer updates, and the wrapper adds
a ``micro_step`` counter of its own.

Exactness with ragged micro-batches (contract E2) uses deferred normalisation: a caller that knows
the micro-batch size passes ``sample_count`` and the gradient of the micro-batch *mean* loss; the
wrapper accumulates ``gradient * sample_count`` and the counts, and divides once, by the total
count, when the window is applied.

The apply/accumulate decision is a graph conditional. Under ``tf.distribute`` it is taken in
cross-replica context inside ``merge_call`` (as Keras' own ``LossScaleOptimizer`` does), never as a
replica-context ``tf.cond`` around a synchronisation: that shape is what makes Keras' built-in
``gradient_accumulation_steps`` crash under every strategy (keras-team/keras#20582).
"""

import contextlib

import keras
import numpy as np
import tensorflow as tf

from gacli.engine import _keras_compat as compat
from gacli.engine.options import LossNormalization, NonFinite, PartialWindow, Reduction
from gacli.engine.settings import (
    OLDER_SETTING_NAMES,
    AccumulationConfig,
    keyword_names,
    pop_settings,
    refuse_unknown_keywords,
    settings_as_attributes,
    shows_config_defaults,
    take_agc_alias,
    validate_accum_steps,
)
from gacli.engine.window import (
    LossScale,
    NoiseScale,
    NonFiniteGuard,
    Window,
    finite_by_squared_norm,
    in_xla_computation,
    marks_non_finite,
    read_now,
    squared_norm,
    sum_of_squares,
)

__all__ = [
    "GradientAccumulateOptimizer",
    "NonFiniteError",
    "StopOnNonFinite",
    "find_accumulating_optimizer",
    "validate_accum_steps",
]

# Arguments of keras.optimizers.Optimizer that belong to the inner optimizer: they act once per
# update, which is the inner optimizer's business.
_INNER_ONLY_ARGUMENTS = (
    "learning_rate",
    "weight_decay",
    "use_ema",
    "ema_momentum",
    "ema_overwrite_frequency",
    "loss_scale_factor",
    "gradient_accumulation_steps",
)


def _summed(variable):
    """A per-replica variable read in cross-replica context: its sum over replicas."""
    return tf.cast(tf.convert_to_tensor(variable), "float32")


def _in_distributed_replica_context():
    return tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context()


def _inner_optimizer(optimizer):
    if isinstance(optimizer, str):
        optimizer = optimizer.lower()
    inner = keras.optimizers.get(optimizer)
    if isinstance(inner, GradientAccumulateOptimizer):
        raise ValueError(
            "GradientAccumulateOptimizer cannot wrap another GradientAccumulateOptimizer; "
            "wrap the plain optimizer once with the accum_steps you want."
        )
    if isinstance(inner, keras.optimizers.LossScaleOptimizer):
        raise ValueError(_LOSS_SCALE_OPTIMIZER)
    if getattr(inner, "gradient_accumulation_steps", None):
        raise ValueError(
            "The inner optimizer already accumulates (gradient_accumulation_steps="
            f"{inner.gradient_accumulation_steps}); remove that argument and let "
            "GradientAccumulateOptimizer do it: it is exact with ragged micro-batches and "
            "runs LR schedules and EMA once per update."
        )
    return inner


_LOSS_SCALE_OPTIMIZER = (
    "GradientAccumulateOptimizer does its own dynamic loss scaling (loss_scaling=True, on by "
    "default under the mixed_float16 policy): each micro-batch is unscaled with its own scale and "
    "an overflow follows nonfinite. Do not wrap it in, or around, a LossScaleOptimizer. In "
    "model.compile pass auto_scale_loss=False, e.g. model.compile(optimizer=gacli."
    "GradientAccumulateOptimizer(opt, accum_steps=4), loss=..., auto_scale_loss=False), or use "
    "gacli.GradientAccumulateModel / gacli.wrap_model, whose compile does it; in a custom loop "
    "call optimizer.scale_loss(loss) before the backward pass."
)


_DEFAULT_NAME = "GradientAccumulateOptimizer"
_POSITIONAL = (
    "GradientAccumulateOptimizer takes optimizer, accum_steps and reduction by position, and "
    "a fourth positional argument only as gradient-accumulator's releases did: use_agc (a bool) "
    "or name (a string). Pass the rest by keyword, e.g. GradientAccumulateOptimizer(opt, 4, "
    "use_agc=True, name='ga'); got {given} positional argument(s) after reduction."
)


def _older_positional(positional, use_agc, name):
    """(use_agc, name) from a fourth positional argument, read as gradient-accumulator read it:
    ``name`` in its early releases (optimizer, accum_steps, reduction, name), ``use_agc`` in its
    last and in gacli; nothing else is guessed."""
    if not positional:
        return use_agc, name
    (value,) = positional if len(positional) == 1 else (None,)
    if len(positional) == 1 and isinstance(value, str) and name == _DEFAULT_NAME:
        return use_agc, value
    if len(positional) == 1 and isinstance(value, bool) and use_agc is None:
        return value, name
    raise TypeError(_POSITIONAL.format(given=len(positional)))


def _without_loss_scale_optimizer(optimizer, loss_scaling, initial_scale, growth_steps):
    """(the optimizer to wrap, loss-scaling settings): a Keras ``LossScaleOptimizer``, as the
    older package's users wrap theirs, gives its inner optimizer and its scale's settings to
    gacli's own loss scaling (each micro-batch unscaled with the scale it was computed with)."""
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer, dict(
            loss_scaling=loss_scaling,
            initial_scale=initial_scale,
            dynamic_growth_steps=growth_steps,
        )
    if loss_scaling is False:
        raise ValueError(
            "GradientAccumulateOptimizer got a LossScaleOptimizer and loss_scaling=False: one "
            "asks for loss scaling, the other refuses it. Pass the plain optimizer "
            "(loss_scale_optimizer.inner_optimizer) with loss_scaling=False, or leave "
            "loss_scaling out."
        )
    return optimizer.inner_optimizer, dict(
        loss_scaling=True,
        initial_scale=optimizer.initial_scale if initial_scale is None else initial_scale,
        dynamic_growth_steps=(
            optimizer.dynamic_growth_steps if growth_steps is None else growth_steps
        ),
    )


_CLIPPING = ("clipnorm", "clipvalue", "global_clipnorm")


def _clipping_for_inner(kwargs):
    """Pop ``clipnorm``, ``clipvalue`` or ``global_clipnorm`` given to the wrapper: they clip the
    window's gradient once per update, which is what the inner optimizer's own clipping does."""
    given = {key: kwargs.pop(key) for key in _CLIPPING if kwargs.get(key) is not None}
    for key in _CLIPPING:
        kwargs.pop(key, None)
    if len(given) > 1:
        raise ValueError(
            f"Only one of clipnorm, clipvalue and global_clipnorm can be set; got "
            f"{', '.join(f'{k}={v}' for k, v in sorted(given.items()))}."
        )
    return given


def _clip_inner(inner, clipping):
    """Set the wrapper's clipping on the inner optimizer, unless it clips otherwise already."""
    if not clipping:
        return
    ((key, value),) = clipping.items()
    own = {k: getattr(inner, k, None) for k in _CLIPPING if getattr(inner, k, None) is not None}
    if own and own != clipping:
        raise ValueError(
            f"GradientAccumulateOptimizer got {key}={value} but its inner optimizer clips with "
            f"{', '.join(f'{k}={v}' for k, v in own.items())}; set the clipping in one place, "
            f"e.g. keras.optimizers.Adam(1e-3, {key}={value})."
        )
    setattr(inner, key, value)


def _state(part, name, setting):
    """A part's state variable; AttributeError when the part is off or not yet built."""
    if part is None or name not in vars(part):
        raise AttributeError(f"{name} exists once the optimizer is built, with {setting} on")
    return vars(part)[name]


def _check_arguments(kwargs, mixed_precision):
    older = sorted(key for key in kwargs if key in ("lr", "decay"))
    if older:
        raise ValueError(
            f"GradientAccumulateOptimizer does not take {', '.join(older)}: gradient-accumulator "
            "accepted them on its wrapper, where they set a learning rate that no update used. "
            "The inner optimizer's learning rate is the one that counts: "
            "GradientAccumulateOptimizer(keras.optimizers.SGD(learning_rate=1e-2), "
            "accum_steps=4); for a decay, give it a schedule, e.g. keras.optimizers.schedules."
            "InverseTimeDecay(1e-2, decay_steps=1, decay_rate=1e-4)."
        )
    misplaced = sorted(key for key in kwargs if key in _INNER_ONLY_ARGUMENTS)
    if misplaced:
        raise ValueError(
            f"GradientAccumulateOptimizer does not take {', '.join(misplaced)}: these act once "
            "per update and belong to the inner optimizer, e.g. GradientAccumulateOptimizer("
            "keras.optimizers.AdamW(learning_rate=1e-3, weight_decay=0.01), accum_steps=4)."
        )
    refuse_unknown_keywords(
        "GradientAccumulateOptimizer()",
        kwargs,
        (
            *keyword_names(GradientAccumulateOptimizer.__init__),
            *AccumulationConfig.fields(),
            *OLDER_SETTING_NAMES,
            *_CLIPPING,
        ),
    )
    if mixed_precision:
        raise ValueError(
            "mixed_precision=True no longer applies in Keras 3: set the policy before building "
            "the model, keras.mixed_precision.set_global_policy('mixed_float16'); the "
            "optimizer then scales the loss itself (loss_scaling is on by default under "
            "that policy). Compile with auto_scale_loss=False."
        )


def _optimizer_settings(config, kwargs, mixed_precision, **given):
    """The optimizer's AccumulationConfig: ``config``, the arguments given (None: not given) and
    any other setting in ``kwargs`` (``agc`` is ``use_agc``, the older package's name); loss
    scaling follows the global policy unless set, and turns on the skip of overflows."""
    given = take_agc_alias(given, kwargs.pop("agc", None))
    given.update(pop_settings(kwargs))
    _check_arguments(kwargs, mixed_precision)
    config = AccumulationConfig.given(config, **given)
    if config.loss_normalization is not LossNormalization.batch:
        raise ValueError(
            "loss_normalization is a setting of the model wrappers (it changes the loss, "
            "which an optimizer never sees); pass it to gacli.GradientAccumulateModel or "
            "gacli.wrap_model."
        )
    if config.remat is not None:
        raise ValueError(
            "remat is a setting of the model wrappers (it changes how the model runs, which an "
            "optimizer never sees); pass it to gacli.wrap_model, or run the model as "
            f"gacli.recompute(model, remat={config.remat!r}) with this optimizer."
        )
    return config.for_policy(keras.mixed_precision.global_policy().name)


# The counters a model wrapper's step returns in its logs when asked (``counters_in_logs``): read
# on the host from the call's own outputs, they cost no op after the call (a variable's read is
# the first op after a compiled call and waits for TensorFlow's worker threads, and ga-train's
# callbacks would make several an update).
COUNTERS_LOG_KEY = "gacli_counters"
AFTER_CALL = ("optimizer_step", "micro_step", "window_micro_steps", "halted_at", "learning_rate")
# With the noise scale on, its state vector rides beside them in the logs, under the first name,
# and is kept with the counters under the second.
NOISE_STATE_LOG_KEY = "gacli_noise_state"
NOISE_STATE = "noise_state"


@keras.saving.register_keras_serializable(package="gacli")
@settings_as_attributes("config")
class GradientAccumulateOptimizer(keras.optimizers.Optimizer):
    """Wraps any Keras 3 optimizer so that it updates once every ``accum_steps`` calls.

    Call ``apply_gradients`` (or ``apply``) once per micro-batch, as with any optimizer. Gradients
    are summed into float32 accumulators (``accumulator_dtype``); on every ``accum_steps``-th call
    the inner optimizer applies their (weighted) mean once.

    The settings are those of :class:`~gacli.AccumulationConfig`, whose defaults apply to any
    left as ``None``; ``config=`` passes them all at once. The parts (the window, loss scaling,
    the non-finite guard) are in :mod:`gacli.engine.window`.

    Args:
        optimizer: the inner optimizer: an instance, a name (``"adam"``) or a config dict. A
            Keras ``LossScaleOptimizer`` (as gradient-accumulator's users write it) gives its
            inner optimizer and its ``initial_scale`` and ``dynamic_growth_steps`` to this
            wrapper's own loss scaling.
        accum_steps: micro-batches per optimizer update (>= 1; default 1).
        reduction: ``"mean"`` (default; the big-batch gradient) or ``"sum"``.
        use_agc: apply adaptive gradient clipping to the accumulated gradient.
        clip_factor: AGC's maximum ratio of unit gradient norm to unit parameter norm (0.01).
        eps: AGC's floor on the parameter norm (1e-3).
        mixed_precision: kept for compatibility with ``gradient-accumulator``; in Keras 3 loss
            scaling comes from the dtype policy (see the error raised when it is set).
        partial_window: ``"apply"`` (default), ``"drop"`` or ``"carry"``; what
            :meth:`finish_epoch` does with a window that is not full.
        accumulator_dtype: dtype of the gradient accumulators (float32 whatever the compute
            dtype, contract P1).
        loss_scaling: dynamic loss scaling for float16, done here so that each micro-batch is
            unscaled with its own scale and overflowing micro-batches follow ``nonfinite``.
            Default: on when the global policy is ``mixed_float16`` as the optimizer is made.
            Compile with ``auto_scale_loss=False``; it is gacli's only loss-scaling path, and
            Keras' ``LossScaleOptimizer`` around it is refused.
        initial_scale: the first loss scale (2**15).
        dynamic_growth_steps: updates without overflow after which the scale doubles (2000).
        nonfinite: what a micro-batch with an inf or nan gradient does. ``"stop"``: it and every
            later micro-batch are left out and no update is applied from its window on, so the
            weights stay those of the last good update; :class:`StopOnNonFinite` (added by the
            model wrappers' ``fit``) then raises :class:`NonFiniteError`. ``"skip_micro_batch"``
            (default with loss scaling) or ``"skip_window"``: training goes on without it.
            ``None`` without loss scaling means no check. Skips are counted in
            ``skipped_micro_batches`` and ``skipped_windows``.
        name: optimizer name (``"GradientAccumulateOptimizer"``). A fourth positional argument
            is read as gradient-accumulator's releases read it: a string is ``name``, a bool
            ``use_agc``; positional arguments past it are refused.
        **kwargs: ``clipnorm``, ``clipvalue`` or ``global_clipnorm``, as on any Keras
            optimizer: the inner optimizer clips the window's gradient with it, once per update.
        dtype: alias of ``accumulator_dtype`` kept for ``gradient-accumulator`` users.
        config: an :class:`~gacli.AccumulationConfig` (or its dict); arguments given beside it
            override its values.
        agc_unit_axes: AGC's unit-norm axes by variable path, ``gacli.agc_unit_axes(model)``,
            so that rank-3 kernels are read by their layer (the model wrappers pass it
            themselves); without it, by their shape.

    Example:
        >>> optimizer = GradientAccumulateOptimizer(keras.optimizers.Adam(1e-3), accum_steps=4)
        >>> model.compile(optimizer=optimizer, loss="mse")
        >>> # custom loop, exact with a short last micro-batch:
        >>> optimizer.apply_gradients(zip(grads, model.trainable_variables), sample_count=n)
    """

    @shows_config_defaults
    def __init__(
        self,
        optimizer="sgd",
        accum_steps=None,
        reduction=None,
        *positional,
        use_agc=None,
        clip_factor=None,
        eps=None,
        mixed_precision=False,
        partial_window=None,
        accumulator_dtype=None,
        loss_scaling=None,
        initial_scale=None,
        dynamic_growth_steps=None,
        nonfinite=None,
        name=_DEFAULT_NAME,
        dtype=None,
        config=None,
        agc_unit_axes=None,
        **kwargs,
    ):
        use_agc, name = _older_positional(positional, use_agc, name)
        optimizer, scaling = _without_loss_scale_optimizer(
            optimizer, loss_scaling, initial_scale, dynamic_growth_steps
        )
        clipping = _clipping_for_inner(kwargs)
        config = _optimizer_settings(
            config,
            kwargs,
            mixed_precision,
            accum_steps=accum_steps,
            reduction=reduction,
            use_agc=use_agc,
            clip_factor=clip_factor,
            eps=eps,
            partial_window=partial_window,
            accumulator_dtype=dtype or accumulator_dtype,
            nonfinite=nonfinite,
            **scaling,
        )
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = _inner_optimizer(optimizer)
        _clip_inner(self.inner_optimizer, clipping)
        self._make_parts(config)
        # Whether the end of the current fit() is the end of training (see fit_continues).
        self.fit_ends_training = True
        # AGC's unit axes by variable path, from the model's layers (gacli.agc_unit_axes); None:
        # read from each variable's rank. The model wrappers fill it in at compile.
        self.agc_unit_axes = agc_unit_axes
        # Compiled flush/discard functions, by (kind, variables with gradients): a cache only.
        self._window_functions = {}
        # The state variables that hold one value for all replicas (see shared_state).
        self._shared_state = []
        # True (set by the model wrappers' train function under jit_compile): the window's update
        # is an XLA computation of its own, called from a graph conditional. Inside one XLA
        # computation such a conditional copies every variable it may update, each micro-step.
        self.update_compiled_apart = False
        self._constructed = True

    def _make_parts(self, config):
        """The settings and the parts they ask for (:mod:`gacli.engine.window`), not yet built."""
        self.config = config
        self._window = Window(config.accum_steps, config.reduction, config.accumulator_dtype)
        self._loss_scale = None
        if config.loss_scaling:
            self._loss_scale = LossScale(config.initial_scale, config.dynamic_growth_steps)
        self._guard = NonFiniteGuard(config.nonfinite) if config.nonfinite else None
        self._noise = NoiseScale.asked_for(config)

    def __setattr__(self, name, value):
        # Keras' LossScaleOptimizer announces itself by clearing its inner optimizer's
        # loss_scale_factor: a second loss-scaling path around this one is refused right there.
        if name == "loss_scale_factor" and getattr(self, "_constructed", False):
            raise ValueError(_LOSS_SCALE_OPTIMIZER)
        super().__setattr__(name, value)

    # -- state ------------------------------------------------------------------------------------
    def _add_state(self, name, shape=(), dtype="float32", per_replica=False, initial_value=0.0):
        """An optimizer variable; ``per_replica`` ones hold a different value on each replica.

        The initial value goes into the initializer, not an assign: Keras may build optimizers
        inside a tf.function trace, where an assign would not run before the first step.
        """
        with keras.name_scope(self.name, caller=self):
            variable = keras.Variable(
                initializer=keras.initializers.Constant(initial_value),
                shape=shape,
                dtype=dtype,
                trainable=False,
                name=name,
                aggregation="sum" if per_replica else "only_first_replica",
                synchronization="on_read" if per_replica else "auto",
            )
        compat.track_variable(self, variable)
        if not per_replica:
            self._shared_state.append(variable)
        return variable

    def build(self, var_list):
        if self.built:
            return
        self.inner_optimizer.build(var_list)
        super().build(var_list)
        self._window.build(self._add_state, var_list)
        if self._guard is not None:
            self._guard.build(self._add_state)
        if self._loss_scale is not None:
            self._loss_scale.build(self._add_state)
        if self._noise is not None:
            self._noise.build(self._add_state)
        self.built = True

    # The parts' state variables (once built), under the names users and logs know them by.
    micro_step = property(
        lambda self: self._window.micro_step,
        doc="Micro-batches accumulated (calls to apply), a variable.",
    )
    window_micro_steps = property(lambda self: self._window.window_micro_steps)
    window_weight = property(lambda self: self._window.window_weight)
    window_unweighted = property(lambda self: self._window.window_unweighted)
    gradient_mask = property(lambda self: self._window.gradient_mask)
    loss_scale = property(lambda self: _state(self._loss_scale, "loss_scale", "loss_scaling"))
    growth_steps = property(lambda self: _state(self._loss_scale, "growth_steps", "loss_scaling"))
    skipped_micro_batches = property(
        lambda self: _state(self._guard, "skipped_micro_batches", "nonfinite")
    )
    skipped_windows = property(lambda self: _state(self._guard, "skipped_windows", "nonfinite"))
    step_nonfinite = property(lambda self: _state(self._guard, "step_nonfinite", "nonfinite"))
    window_nonfinite = property(lambda self: _state(self._guard, "window_nonfinite", "nonfinite"))
    halted_at = property(lambda self: _state(self._guard, "halted_at", "nonfinite='stop'"))

    @property
    def optimizer(self):
        """The inner optimizer (gradient-accumulator's name for it)."""
        return self.inner_optimizer

    @property
    def _accumulators(self):
        return self._window.accumulators

    @property
    def variables(self):
        return compat.own_variables(self) + self.inner_optimizer.variables

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    def _get_current_learning_rate(self):
        return compat.current_learning_rate(self.inner_optimizer)

    @property
    def iterations(self):
        """Optimizer updates applied (the inner optimizer's counter)."""
        return self.inner_optimizer.iterations

    @property
    def optimizer_step(self):
        """Optimizer updates applied; ``micro_step`` counts the calls to ``apply``."""
        return self.inner_optimizer.iterations

    def scale_loss(self, loss):
        if self._loss_scale is not None:
            return self._loss_scale.scale(loss)
        return self.inner_optimizer.scale_loss(loss)

    @contextlib.contextmanager
    def fit_continues(self):
        """Inside, the end of a ``fit()`` call is not the end of training (a run split into
        several calls, as a resumed one is): a carried window stays open and EMA is not yet
        written into the weights."""
        self.fit_ends_training = False
        try:
            yield
        finally:
            self.fit_ends_training = True

    def finalize_variable_values(self, var_list):
        # Keras calls this once at the end of fit(): the last open window is applied (contract E4:
        # never silently lost), before the inner optimizer's EMA overwrite.
        if not self.fit_ends_training:
            return
        self.finish_epoch(last=True)
        self.inner_optimizer.finalize_variable_values(var_list)

    # -- the micro-step ---------------------------------------------------------------------------
    def apply_gradients(self, grads_and_vars, sample_count=None, summed=False, loss_divisor=None):
        grads, variables = zip(*grads_and_vars)
        self.apply(
            grads, variables, sample_count=sample_count, summed=summed, loss_divisor=loss_divisor
        )
        return self.iterations

    def apply(
        self, grads, trainable_variables=None, sample_count=None, summed=False, loss_divisor=None
    ):
        """Accumulate one micro-batch; update through the inner optimizer every k-th call.

        Args:
            grads: gradients of the micro-batch's mean loss (but see ``loss_divisor``).
            trainable_variables: the matching variables (optional once built).
            sample_count: samples (or total sample weight) in the micro-batch, on this replica.
                With it, the window is normalised by its total count, summed over replicas;
                without it every call weighs the same and gradients are taken as already scaled
                for distribution, as Keras' own ``train_step`` computes them (exact only when
                every micro-batch holds as many samples).
            summed: ``grads`` are already multiplied by ``sample_count``: gradients of the
                micro-batch's mean loss times its count. Weighing the loss costs a scalar
                product; weighing the gradients a pass over all of them, per micro-batch.
            loss_divisor: what the differentiated loss was divided by, when it is not this
                replica's ``sample_count`` (needs ``sample_count``). A ``keras.losses.Loss``
                called in replica context divides by ``sample_count`` times the number of
                replicas; ``tf.nn.compute_average_loss(..., global_batch_size=G)`` by ``G``.
                Given it, windows stay exact with ragged micro-batches under any strategy.
        """
        indices = self.accumulate(
            grads, trainable_variables, sample_count, summed=summed, loss_divisor=loss_divisor
        )
        if indices is not None:
            self.close_window(indices)

    def accumulate(
        self,
        grads,
        trainable_variables=None,
        sample_count=None,
        summed=False,
        loss_divisor=None,
        loss=None,
    ):
        """The first half of :meth:`apply` (same arguments): add the micro-batch to the window
        and count it. ``loss``: the micro-batch's loss, where the caller has it; under
        ``nonfinite`` a non-finite one is treated as a non-finite gradient. Returns the indices
        of the variables that had gradients, for :meth:`close_window` (None when there were no
        gradients)."""
        grads = list(grads)
        if not grads:
            return None
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "Pass the variables on the first call, e.g. "
                    "optimizer.apply(grads, model.trainable_variables)."
                )
            trainable_variables = compat.built_variables(self)
        trainable_variables = list(trainable_variables)
        if not self.built:
            self.build(trainable_variables)
        factor = self._micro_batch_factor(sample_count, summed, loss_divisor)
        gradients = {
            compat.variable_index(self, variable): gradient
            for gradient, variable in zip(grads, trainable_variables)
            if gradient is not None
        }
        values = list(gradients.values())
        measured = self._noise is not None and self._weighs(sample_count)
        squared, marked = self._shared_squared_norm(values, measured)
        keep = self._guard.keep(values, squared, marked, loss) if self._guard else None
        if measured:
            self._observe_noise(values, factor, sample_count, keep, squared)
        self._window.add(gradients, factor, keep)
        kept = self._guard.record(keep) if self._guard else tf.constant(1.0)
        self._window.count(sample_count if self._weighs(sample_count) else None, kept)
        return tuple(sorted(gradients))

    def close_window(self, indices):
        """The second half of :meth:`apply`: after a micro-batch, apply the window to the
        variables at ``indices`` if it is full (or skip it, per ``nonfinite``)."""
        self._window.step(indices)
        self._apply_window_if(self._window.closes(), indices, micro_step=True)

    def _shared_squared_norm(self, gradients, measured):
        """(squared, marked): the squared norm of the micro-batch's ``gradients``, computed once
        for the two parts that read it, or None where neither would: the noise scale, when it
        measures every window (``measured``: it measures this micro-batch's), and the
        non-finite check without XLA on a CPU, which tests it instead of every element
        (:func:`~gacli.engine.window.all_finite`: one pass over the gradients instead of a
        test of every element, and with the noise scale on the check then costs nothing more,
        ``docs/performance.md``). ``marked``: with both under XLA
        on a CPU, the norm counts a non-finite element as a nan, and the check reads that
        (:func:`~gacli.engine.window.marks_non_finite`)."""
        if not gradients:
            return None, False
        noise = measured and self._noise.every == 1
        dense = not any(isinstance(g, tf.IndexedSlices) for g in gradients)
        check = self._guard is not None and dense and finite_by_squared_norm()
        marked = noise and self._guard is not None and dense and marks_non_finite()
        squared = squared_norm(gradients, marked=marked) if noise or check else None
        return squared, marked

    def _observe_noise(self, gradients, factor, sample_count, keep, squared=None):
        """Hand the noise scale |g|^2 of this micro-batch's mean-loss gradient, from what the
        window adds (``gradients`` times ``factor``): the gradient of the micro-batch's summed
        loss, unscaled (the mean's times the sample count), however the caller wrote the loss.
        ``squared``: the squared norm of ``gradients``, where already computed."""

        def observe():
            norm = squared_norm(gradients) if squared is None else squared
            self._noise.observe(norm, sample_count, keep, factor)

        self._if_noise_measured(observe)

    def _if_noise_measured(self, measure):
        """Run ``measure`` (which returns nothing) in a window the noise scale measures: always
        with ``noise_scale_every=1``, otherwise under a graph conditional, so that the squared
        norms of the windows it skips are never computed. (Only then: a conditional that takes
        the gradients in costs its call whether it runs or not, so with every window measured
        there is none.)"""
        if self._noise.every == 1:
            measure()
            return
        tf.cond(
            self._noise.measures(self.iterations), measure, lambda: None, name="measure_noise_scale"
        )

    def _weighs(self, sample_count):
        return sample_count is not None and self.reduction is Reduction.mean

    def _micro_batch_factor(self, sample_count, summed, loss_divisor):
        """What this micro-batch's gradients are multiplied by as they are added (None: 1): its
        weight (unless the caller weighed the loss) and the inverse loss scale (P2: each
        micro-batch is unscaled with its own scale), one product per element at most."""
        weighted = sample_count is not None
        if loss_divisor is not None and (summed or not weighted):
            raise ValueError(
                "loss_divisor says what the loss was divided by, so that the engine can weigh it "
                "by sample_count: pass sample_count (this replica's samples) with it, and not "
                "summed=True (which means loss_divisor=1)."
            )
        if self.reduction is Reduction.sum and (summed or loss_divisor is not None):
            raise ValueError(
                "summed=True and loss_divisor describe a loss to be weighed by "
                "sample_count, which reduction='sum' would add as it is; pass the gradients "
                "of the mean loss."
            )
        factor = None
        if self._weighs(sample_count) and not summed:
            # The gradient of this replica's summed loss: the mean loss's times its divisor.
            factor = tf.cast(sample_count if loss_divisor is None else loss_divisor, "float32")
        if self._loss_scale is not None:
            inverse = self._loss_scale.inverse()
            factor = inverse if factor is None else factor * inverse
        return factor

    # -- the update -------------------------------------------------------------------------------
    def _apply_window_if(self, window_closes, indices, micro_step=False):
        """Apply (or skip) the open window when ``window_closes``, to the variables at
        ``indices`` (those that had gradients).

        The decision is taken in cross-replica context: inside ``merge_call`` under a
        tf.distribute strategy, directly otherwise. Both branches are graph conditionals whose
        bodies enter replica context again through ``call_for_each_replica``, so the inner
        optimizer's all-reduce never sits in a replica-context ``tf.cond`` (contract X2).
        """
        if _in_distributed_replica_context():

            def merge_fn(distribution, window_closes):
                self._decide(
                    distribution.experimental_local_results(window_closes)[0],
                    lambda fn, *args: distribution.extended.call_for_each_replica(fn, args=args),
                    indices,
                    micro_step,
                    distribution.num_replicas_in_sync,
                )

            tf.distribute.get_replica_context().merge_call(merge_fn, args=(window_closes,))
        else:
            self._decide(window_closes, lambda fn, *args: fn(*args), indices, micro_step, 1)

    def _decide(self, closes, in_each_replica, indices, micro_step, replicas):
        """In cross-replica context. ``in_each_replica(fn, *args)`` runs fn in replica context."""
        apply_now = closes
        if self._guard is not None:
            if micro_step:
                overflow = self._guard.after_micro_step(self.micro_step)
                if self._loss_scale is not None:
                    # Any replica's overflow halves everyone's scale.
                    self._loss_scale.after_micro_step(overflow)
            healthy = self._guard.healthy(self._window.held())
            tf.cond(
                tf.logical_and(closes, tf.logical_not(healthy)),
                lambda: in_each_replica(self._skip_window),
                lambda: None,
            )
            apply_now = tf.logical_and(apply_now, tf.logical_and(healthy, self._guard.running()))

        def apply():
            self._apply_in_replicas(in_each_replica, indices, replicas)

        if self.update_compiled_apart and replicas == 1:
            # Its own XLA computation, reached from a graph (not XLA) conditional: see
            # update_compiled_apart.
            apply = tf.function(apply, jit_compile=True)
        tf.cond(apply_now, apply, lambda: None)

    def _clips(self):
        inner = self.inner_optimizer
        return self.use_agc or any(
            getattr(inner, name, None) for name in ("clipnorm", "global_clipnorm", "clipvalue")
        )

    def _window_gradients(self, indices, denominator, by_rows=False, measure_noise=False):
        """(gradients, variables, rows): the window's gradients for the variables at
        ``indices``, and the rows of sparse accumulators they were taken from (see
        ``Window.gradients``; ``by_rows`` asks for that form where it can be used).
        ``measure_noise``: hand the noise scale |G_B|^2, their squared norm before any clipping
        (:meth:`_update_noise` says from what)."""
        variables = [compat.built_variables(self)[index] for index in indices]
        # Touched rows only on one device, without XLA, and unclipped by AGC (which reads
        # whole tensors): the window's own gradient in a form that needs no table-sized copy.
        by_rows = (
            by_rows
            and not self.use_agc
            and not tf.distribute.has_strategy()
            and not in_xla_computation()
        )
        grads, rows = self._window.gradients(indices, variables, denominator, by_rows)
        if measure_noise and self._noise is not None:
            self._if_noise_measured(lambda: self._update_noise(indices, denominator, grads))
        if self.use_agc:
            from gacli.engine.clipping import adaptive_clip_gradients

            grads = adaptive_clip_gradients(
                grads, variables, self.clip_factor, self.eps, unit_axes=self.agc_unit_axes
            )
        return grads, variables, rows

    def _apply_in_replicas(self, in_each_replica, indices, replicas):
        """Apply the window, normalised by its samples over all replicas (D3). Clipping (AGC,
        clipnorm, global_clipnorm, clipvalue) must see the gradient summed over replicas, but
        Keras' optimizers clip each replica's part before their all-reduce: with several
        replicas and clipping, the window's gradient is reduced and clipped here, in
        cross-replica context, and handed to every replica."""
        denominator = self._window.denominator(replicas)
        # Without a strategy the update's own gradients give |G_B|^2 (_window_gradients).
        if self._noise is not None and tf.distribute.has_strategy():
            # Read here, in cross-replica context, the accumulators come summed over replicas:
            # one all-reduce more per measured window.
            self._if_noise_measured(lambda: self._update_noise(indices, denominator))
        if replicas == 1 or not self._clips():
            in_each_replica(self._apply_window, indices, denominator)
            return
        # Read in cross-replica context, the accumulators come summed over replicas.
        grads, _, _ = self._window_gradients(indices, denominator)
        grads = compat.clip_gradients(self.inner_optimizer, grads)
        # Each replica passes 1/R of the clipped gradient; the inner all-reduce sums them back.
        # Clipping is switched off here, once: replicas trace in threads of their own.
        with compat.without_own_clipping(self.inner_optimizer):
            in_each_replica(self._apply_share, indices, [g / replicas for g in grads])

    def _update_noise(self, indices, denominator, grads=None):
        """The noise scale's estimate from the window being applied: |G_B|^2 of its gradient
        (for the variables at ``indices``, normalised by ``denominator``), from ``grads`` where
        they are that gradient as accumulated (not rounded to a narrower variable dtype), else
        from the accumulators.

        Without XLA ``grads`` serve where given: a sparse table's norm then comes from its held
        rows only (from the accumulators it would be a second read). Under XLA the accumulators
        always: the update reads them too, so the window's gradient stays fused into the
        update's pass, where a norm of ``grads`` made XLA write them out to memory first."""
        from_grads = grads is not None and not in_xla_computation()
        if from_grads and all(g.dtype == self._window.dtype for g in grads):
            squared = squared_norm(grads)
        else:
            accumulated = [_summed(self._window.accumulators[i]) for i in indices]
            squared = tf.add_n([sum_of_squares(a) for a in accumulated]) / tf.square(denominator)
        self._noise.update(
            squared,
            _summed(self._window.window_weight),
            _summed(self._window.window_unweighted),
        )

    def _apply_window(self, indices, denominator):
        """In replica context: this replica's part of the window's gradient, applied (the
        inner optimizer sums the parts over replicas)."""
        grads, variables, rows = self._window_gradients(
            indices, denominator, by_rows=True, measure_noise=not tf.distribute.has_strategy()
        )
        self.inner_optimizer.apply(grads, variables)
        self._after_update(rows)

    def _apply_share(self, indices, share):
        """In replica context: ``share``, this replica's part of the reduced, clipped gradient."""
        variables = [compat.built_variables(self)[index] for index in indices]
        # A copy on this replica's device: the inner all-reduce reads its destination there.
        self.inner_optimizer.apply([tf.identity(gradient) for gradient in share], variables)
        self._after_update()

    def _skip_window(self):
        self._guard.skip_window()
        self._reset_window()

    def _after_update(self, rows=None):
        if self._loss_scale is not None:
            self._loss_scale.after_update()
        self._reset_window(rows)

    def _reset_window(self, rows=None):
        """Zero the window (of sparse accumulators, only ``rows``: see ``Window.reset``)."""
        self._window.reset(rows)
        if self._guard is not None:
            self._guard.reset()
        if self._noise is not None:
            self._noise.reset()

    # -- windows that are not full ----------------------------------------------------------------
    def _run_window_function(self, kind, force=False):
        """Run ``flush`` or ``discard`` as a compiled function in the right distribution context
        (``force``: even when no micro-batch is counted in the window)."""
        if not self.built:
            return
        if not force and tf.executing_eagerly() and int(self.window_micro_steps.numpy()) == 0:
            # Every window closed (the usual epoch end): nothing to apply or drop. Tracing the
            # function anyway costs a trace and its host memory at the first epoch end.
            # (Every micro-step counts itself in window_micro_steps, and every worker of a run
            # holds the same count, so all of them skip or none does.)
            return
        # The variables the window's micro-batches had gradients for, from the saved mask: the
        # same after a restore as in the process that accumulated them.
        indices = tuple(int(i) for i in np.flatnonzero(self.gradient_mask.numpy()))
        key = (kind, indices)
        function = self._window_functions.get(key)
        if function is None:
            # The strategy the optimizer was created under (Keras calls callbacks and
            # finalize_variable_values outside the strategy's scope).
            strategy = compat.optimizer_strategy(self)
            step = (
                (lambda: self._apply_window_if(self.window_micro_steps > 0, indices))
                if kind == "flush"
                else self._reset_window
            )

            @tf.function
            def function():
                if tf.distribute.has_strategy():
                    strategy.run(step)
                else:
                    step()

            self._window_functions[key] = function
        with compat.optimizer_strategy(self).scope():
            function()

    def flush(self):
        """Apply the open window now, normalised by the samples it holds (no-op when empty)."""
        self._run_window_function("flush")

    def discard_window(self):
        """Drop the gradients of the open window without updating."""
        self._run_window_function("discard")

    # -- going back to a window's start (ga-train's oom=recover) ---------------------------------
    @property
    def shared_state(self):
        """The state variables that hold one value for all replicas (counters, mask, loss scale,
        noise-scale averages), once built: what :meth:`rewind_window` puts back. The rest
        (accumulators and per-replica sums) is zero at every window's start."""
        return list(self._shared_state)

    def rewind_window(self, start_state):
        """Back to the start of the open window after a call failed part-way (an out-of-memory
        error between two micro-batches, or inside one): the accumulators and per-replica sums
        are zeroed, and ``start_state`` (values of :attr:`shared_state`, in its order) is put
        back."""
        self._run_window_function("discard", force=True)
        for variable, value in zip(self._shared_state, start_state):
            variable.assign(value)

    def set_accum_steps(self, accum_steps, restored=False):
        """Micro-batches per update from the next window on; the window must be empty, unless
        ``restored``: the open window was just restored from a checkpoint saved while it was
        filled at ``accum_steps`` (a run resumed in a stage of an accumulation schedule). The
        caller makes its train function again (the count is read when the step is traced)."""
        accum_steps = validate_accum_steps(accum_steps)
        if self.built and not restored and int(self.window_micro_steps.numpy()):
            raise ValueError("accum_steps can change between windows only; the window is open.")
        self.config = self.config.replace(accum_steps=accum_steps)
        self._window.accum_steps = accum_steps
        self._window_functions.clear()

    def epoch_end_action(self, last=False):
        """``"apply"``, ``"drop"`` or ``None``: what ``partial_window`` does to an open window at
        an epoch end (``last=True``: the end of training, where a carried window is applied)."""
        last = last and self.fit_ends_training
        if self.partial_window is PartialWindow.apply or (
            last and self.partial_window is PartialWindow.carry
        ):
            return "apply"
        if self.partial_window is PartialWindow.drop:
            return "drop"
        return None

    def finish_epoch(self, last=False):
        """Treat the open window per ``partial_window``; ``last=True`` at the end of training."""
        action = self.epoch_end_action(last)
        if action == "apply":
            self.flush()
        elif action == "drop":
            self.discard_window()

    def noise_scale(self):
        """The gradient noise scale measured so far (``noise_scale=True``), as Python floats:
        ``noise_scale`` (B_simple, smoothed), ``grad_sq`` (|G|^2), ``trace_cov`` (tr Sigma),
        the last window's raw ``grad_sq_raw`` and ``trace_raw``, and ``windows`` measured."""
        if self._noise is None or not self.built:
            return None
        kept = self._after_call.get(NOISE_STATE) if self._after_call is not None else None
        grad_sq, trace, scale, grad_sq_raw, trace_raw, windows = self._noise.reading(kept)
        return {
            "noise_scale": scale,
            "grad_sq": grad_sq,
            "trace_cov": trace,
            "grad_sq_raw": grad_sq_raw,
            "trace_raw": trace_raw,
            "windows": windows,
        }

    def halted_micro_step(self):
        """0 while training is healthy; under ``nonfinite="stop"``, the micro_step (counted from
        1) of the first micro-batch whose gradient was not finite."""
        if self.nonfinite is not NonFinite.stop or not self.built:
            return 0
        return int(self.after_call("halted_at"))

    # -- the counters as a compiled call left them ------------------------------------------------
    _after_call = None

    def counters_logs(self):
        """In the step function: what a model wrapper's step returns in its logs for
        :meth:`take_counters`: the counters of :data:`AFTER_CALL` as one float64 vector (exact
        below 2**53) under :data:`COUNTERS_LOG_KEY`, and with the noise scale on its state
        vector, as it is (one read), under :data:`NOISE_STATE_LOG_KEY`. Apart, not concatenated:
        these ops run outside XLA in every micro-step of a compiled call, where each op (a cast,
        a concat) costs the graph executor's own time on every micro-step."""
        values = [self._counter(name) for name in AFTER_CALL]
        counters = tf.stack([tf.cast(tf.convert_to_tensor(value), "float64") for value in values])
        logs = {COUNTERS_LOG_KEY: counters}
        if self._noise is not None:
            logs[NOISE_STATE_LOG_KEY] = tf.convert_to_tensor(self._noise.state)
        return logs

    def _counter(self, name):
        """The variable (or, for a schedule's learning rate, the value) behind counter ``name``;
        0 for ``halted_at`` under a policy that never halts."""
        if name == "halted_at" and self.nonfinite is not NonFinite.stop:
            return 0
        return getattr(self, name)

    def take_counters(self, logs):
        """Keep the counters a compiled call returned in ``logs`` (under
        :data:`COUNTERS_LOG_KEY` and :data:`NOISE_STATE_LOG_KEY`, which are removed) until
        :meth:`forget_counters`."""
        counters = logs.pop(COUNTERS_LOG_KEY, None) if logs else None
        state = logs.pop(NOISE_STATE_LOG_KEY, None) if logs else None
        if counters is not None:
            # NumPy where Keras turns the logs into Python numbers first, else a tensor.
            counters = dict(zip(AFTER_CALL, np.asarray(counters, np.float64).tolist()))
            if state is not None:
                counters[NOISE_STATE] = np.asarray(state, np.float32)
        # Past Keras' attribute tracking, which would inspect the dict on every assignment.
        object.__setattr__(self, "_after_call", counters)

    def forget_counters(self):
        object.__setattr__(self, "_after_call", None)

    def after_call(self, name):
        """Counter ``name`` of :data:`AFTER_CALL` as a Python number: from the last compiled
        call's logs while they are kept (no op after the call), else read now."""
        if self._after_call is not None:
            return self._after_call[name]
        variable = self._counter(name)
        if isinstance(variable, (tf.Variable, keras.Variable)):
            return read_now(variable).item()
        return np.asarray(variable).item()

    # -- serialisation ----------------------------------------------------------------------------
    def get_config(self):
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            **self.config.to_dict(),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        optimizer = keras.saving.deserialize_keras_object(
            config.pop("optimizer"), custom_objects=custom_objects
        )
        name = config.pop("name", "GradientAccumulateOptimizer")
        return cls(optimizer, name=name, config=AccumulationConfig(**config))


class NonFiniteError(FloatingPointError):
    """Training stopped (``nonfinite="stop"``) at a micro-batch with an inf or nan gradient.

    ``micro_step``: that micro-batch, counted from 1 over the whole run. No update used it or any
    micro-batch after it: the weights are those of the last update before its window.
    """

    def __init__(self, micro_step):
        self.micro_step = micro_step
        super().__init__(
            f"training stopped: micro-batch {micro_step} (counted from 1 since training began) "
            "gave a non-finite (inf or nan) loss or gradient, and nonfinite='stop'. No update "
            "used it: the trainable weights are those of the last update before it (the moving "
            "statistics of plain BatchNormalization layers saw it, so restore the model from a "
            "checkpoint before using it). Look for inf or nan in "
            "that micro-batch's inputs or targets; if they are clean, the model diverged (lower "
            "the learning rate, or clip the gradients with clipnorm). To train on past such "
            "micro-batches instead, use nonfinite='skip_micro_batch'."
        )


class StopOnNonFinite(keras.callbacks.Callback):
    """Raises :class:`NonFiniteError` after the compiled call in which a micro-batch's gradient
    was not finite (``nonfinite="stop"``), before later callbacks (checkpoints) see the step."""

    def __init__(self, optimizer):
        super().__init__()
        self._optimizer = optimizer

    def on_train_batch_end(self, batch, logs=None):
        halted = self._optimizer.halted_micro_step()
        if halted:
            raise NonFiniteError(halted)


def find_accumulating_optimizer(optimizer):
    """The GradientAccumulateOptimizer inside ``optimizer`` (e.g. under a LossScaleOptimizer)."""
    while optimizer is not None:
        if isinstance(optimizer, GradientAccumulateOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return None


# Whichever of gacli's modules is imported first, Keras then knows the classes of all of them.
from gacli import _register_with_keras  # noqa: E402

_register_with_keras(finished=__name__)
