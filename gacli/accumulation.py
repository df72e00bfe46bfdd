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
import numbers
import threading

import keras
import tensorflow as tf

from gacli.options import NonFinite, PartialWindow, Reduction, parse_option

# Arguments of keras.optimizers.Optimizer that belong to the inner optimizer: they act once per
# update, which is the inner optimizer's business.
_INNER_ONLY_ARGUMENTS = (
    "learning_rate",
    "weight_decay",
    "clipnorm",
    "global_clipnorm",
    "clipvalue",
    "use_ema",
    "ema_momentum",
    "ema_overwrite_frequency",
    "loss_scale_factor",
    "gradient_accumulation_steps",
)


def validate_accum_steps(accum_steps):
    """Return ``accum_steps`` as an int >= 1, or raise a ValueError that says what to pass."""
    if isinstance(accum_steps, bool) or not isinstance(accum_steps, numbers.Integral):
        raise ValueError(
            f"accum_steps={accum_steps!r} must be a whole number >= 1 (the number of micro-batches "
            "summed into one optimizer update), e.g. accum_steps=4."
        )
    accum_steps = int(accum_steps)
    if accum_steps < 1:
        raise ValueError(
            f"accum_steps={accum_steps} must be >= 1 (the number of micro-batches summed into one "
            "optimizer update); use accum_steps=1 to train without accumulation."
        )
    return accum_steps


@contextlib.contextmanager
def _clipping_off(optimizer):
    """The optimizer's own clipping switched off, while tracing an apply of clipped gradients."""
    names = ("clipnorm", "global_clipnorm", "clipvalue")
    saved = {name: getattr(optimizer, name, None) for name in names}
    try:
        for name in names:
            setattr(optimizer, name, None)
        yield
    finally:
        for name, value in saved.items():
            setattr(optimizer, name, value)


def _in_distributed_replica_context():
    return tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context()


@keras.saving.register_keras_serializable(package="gacli")
class GradientAccumulateOptimizer(keras.optimizers.Optimizer):
    """Wraps any Keras 3 optimizer so that it updates once every ``accum_steps`` calls.

    Call ``apply_gradients`` (or ``apply``) once per micro-batch, as with any optimizer. Gradients
    are summed into float32 accumulators (``accumulator_dtype``); on every ``accum_steps``-th call
    the inner optimizer applies their (weighted) mean once.

    Args:
        optimizer: the inner optimizer: an instance, a name (``"adam"``) or a config dict.
        accum_steps: micro-batches per optimizer update (>= 1).
        reduction: ``"mean"`` (default; the big-batch gradient) or ``"sum"``.
        use_agc: apply adaptive gradient clipping to the accumulated gradient.
        clip_factor: AGC's maximum ratio of unit gradient norm to unit parameter norm.
        eps: AGC's floor on the parameter norm.
        mixed_precision: kept for compatibility with ``gradient-accumulator``; in Keras 3 loss
            scaling comes from the dtype policy (see the error raised when it is set).
        partial_window: ``"apply"``, ``"drop"`` or ``"carry"``; what :meth:`finish_epoch` does with
            a window that is not full.
        accumulator_dtype: dtype of the gradient accumulators (default float32 whatever the
            compute dtype, contract P1).
        loss_scaling: dynamic loss scaling for float16 (what Keras' ``LossScaleOptimizer`` does,
            done here so that each micro-batch is unscaled with its own scale and overflowing
            micro-batches follow ``nonfinite``). Compile with ``auto_scale_loss=False``.
        initial_scale: the first loss scale.
        dynamic_growth_steps: updates without overflow after which the scale doubles.
        nonfinite: what a micro-batch with an inf or nan gradient does. ``"stop"``: it and every
            later micro-batch are left out and no update is applied from its window on, so the
            weights stay those of the last good update; :class:`StopOnNonFinite` (added by the
            model wrappers' ``fit``) then raises :class:`NonFiniteError`. ``"skip_micro_batch"``
            (default with loss scaling) or ``"skip_window"``: training goes on without it.
            ``None`` without loss scaling means no check. Skips are counted in
            ``skipped_micro_batches`` and ``skipped_windows``.
        name: optimizer name.
        dtype: alias of ``accumulator_dtype`` kept for ``gradient-accumulator`` users.

    Example:
        >>> optimizer = GradientAccumulateOptimizer(keras.optimizers.Adam(1e-3), accum_steps=4)
        >>> model.compile(optimizer=optimizer, loss="mse")
        >>> # custom loop, exact with a short last micro-batch:
        >>> optimizer.apply_gradients(zip(grads, model.trainable_variables), sample_count=n)
    """

    def __init__(
        self,
        optimizer="sgd",
        accum_steps=1,
        reduction="mean",
        use_agc=False,
        clip_factor=0.01,
        eps=1e-3,
        mixed_precision=False,
        partial_window="apply",
        accumulator_dtype="float32",
        loss_scaling=False,
        initial_scale=2.0**15,
        dynamic_growth_steps=2000,
        nonfinite=None,
        name="GradientAccumulateOptimizer",
        dtype=None,
        **kwargs,
    ):
        misplaced = sorted(key for key in kwargs if key in _INNER_ONLY_ARGUMENTS)
        if misplaced:
            raise ValueError(
                f"GradientAccumulateOptimizer does not take {', '.join(misplaced)}: these act once "
                "per update and belong to the inner optimizer, e.g. GradientAccumulateOptimizer("
                "keras.optimizers.Adam(learning_rate=1e-3, clipnorm=1.0), accum_steps=4)."
            )
        if kwargs:
            raise TypeError(
                f"GradientAccumulateOptimizer got unexpected arguments: {', '.join(sorted(kwargs))}."
            )
        if mixed_precision:
            raise ValueError(
                "mixed_precision=True no longer applies in Keras 3: set the policy before building "
                "the model, keras.mixed_precision.set_global_policy('mixed_float16'), and "
                "model.compile wraps this optimizer in a LossScaleOptimizer by itself (in a custom "
                "loop: keras.optimizers.LossScaleOptimizer(GradientAccumulateOptimizer(...)))."
            )
        super().__init__(learning_rate=0.0, name=name)
        if isinstance(optimizer, str):
            optimizer = optimizer.lower()
        inner = keras.optimizers.get(optimizer)
        if isinstance(inner, GradientAccumulateOptimizer):
            raise ValueError(
                "GradientAccumulateOptimizer cannot wrap another GradientAccumulateOptimizer; "
                "wrap the plain optimizer once with the accum_steps you want."
            )
        if getattr(inner, "gradient_accumulation_steps", None):
            raise ValueError(
                "The inner optimizer already accumulates (gradient_accumulation_steps="
                f"{inner.gradient_accumulation_steps}); remove that argument and let "
                "GradientAccumulateOptimizer do it: it is exact with ragged micro-batches and "
                "runs LR schedules and EMA once per update."
            )
        self.inner_optimizer = inner
        self.accum_steps = validate_accum_steps(accum_steps)
        self.reduction = parse_option(Reduction, reduction, "reduction")
        self.partial_window = parse_option(PartialWindow, partial_window, "partial_window")
        self.use_agc = bool(use_agc)
        self.clip_factor = float(clip_factor)
        self.eps = float(eps)
        self.accumulator_dtype = keras.backend.standardize_dtype(dtype or accumulator_dtype)
        self.loss_scaling = bool(loss_scaling)
        self.initial_scale = float(initial_scale)
        self.dynamic_growth_steps = int(dynamic_growth_steps)
        if nonfinite is None and self.loss_scaling:
            nonfinite = NonFinite.skip_micro_batch
        self.nonfinite = None if nonfinite is None else parse_option(NonFinite, nonfinite, "nonfinite")
        # Indices (into the trainable variables) that received gradients in the traced apply();
        # a variable that never gets a gradient must not be "updated" with a zero gradient, which
        # would still move it under Adam or momentum.
        self._gradient_indices = None
        self._window_functions = {}
        self._fit_continues = False
        # Per thread, because MirroredStrategy runs each replica's step in its own thread.
        self._scoped_counts = threading.local()

    @contextlib.contextmanager
    def sample_count_scope(self, sample_count, summed=False, loss_divisor=None):
        """Hand ``sample_count`` (and ``summed`` or ``loss_divisor``, see :meth:`apply`) to the
        ``apply`` calls made inside, through wrappers such as ``LossScaleOptimizer`` whose
        ``apply`` has no such argument."""
        previous = getattr(self._scoped_counts, "value", None)
        self._scoped_counts.value = (sample_count, summed, loss_divisor)
        try:
            yield
        finally:
            self._scoped_counts.value = previous

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
        self._track_variable(variable)
        return variable

    def build(self, var_list):
        if self.built:
            return
        self.inner_optimizer.build(var_list)
        super().build(var_list)
        self.micro_step = self._add_state("micro_step", dtype="int64")
        self.window_micro_steps = self._add_state("window_micro_steps", dtype="int64")
        # Sum of the sample counts (or of the calls, when none is given) in the open window.
        self.window_weight = self._add_state("window_weight", per_replica=True)
        if self.nonfinite is not None:
            # Per replica: whether this replica's last micro-batch / open window had an overflow.
            self.step_nonfinite = self._add_state("step_nonfinite", per_replica=True)
            self.window_nonfinite = self._add_state("window_nonfinite", per_replica=True)
            # Counted in cross-replica context from the summed step flags: one total, not one
            # count per replica.
            self.skipped_micro_batches = self._add_state("skipped_micro_batches", dtype="int64")
            self.skipped_windows = self._add_state("skipped_windows", dtype="int64")
        if self.nonfinite is NonFinite.stop:
            # 0 while training is healthy; then the micro_step (counted from 1) of the first
            # micro-batch with a non-finite gradient on any replica (set in cross-replica context).
            self.halted_at = self._add_state("halted_at_micro_step", dtype="int64")
        if self.loss_scaling:
            self.loss_scale = self._add_state("loss_scale", initial_value=self.initial_scale)
            self.growth_steps = self._add_state("growth_steps", dtype="int64")
        self._accumulators = [
            self._add_state(
                f"{variable.path.replace('/', '_')}_accumulator"
                if hasattr(variable, "path")
                else f"accumulator_{index}",
                shape=variable.shape,
                dtype=self.accumulator_dtype,
                per_replica=True,
            )
            for index, variable in enumerate(var_list)
        ]
        self.built = True

    @property
    def variables(self):
        return self._variables + self.inner_optimizer.variables

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    def _get_current_learning_rate(self):
        return self.inner_optimizer._get_current_learning_rate()

    @property
    def iterations(self):
        """Optimizer updates applied (the inner optimizer's counter)."""
        return self.inner_optimizer.iterations

    @property
    def optimizer_step(self):
        """Optimizer updates applied; ``micro_step`` counts the calls to ``apply``."""
        return self.inner_optimizer.iterations

    def scale_loss(self, loss):
        if self.loss_scaling:
            scale = self.loss_scale if self.built else self.initial_scale
            return loss * tf.cast(scale, loss.dtype)
        return self.inner_optimizer.scale_loss(loss)

    @contextlib.contextmanager
    def fit_continues(self):
        """Inside, the end of a ``fit()`` call is not the end of training (a run split into
        several calls, as a resumed one is): a carried window stays open and EMA is not yet
        written into the weights."""
        self._fit_continues = True
        try:
            yield
        finally:
            self._fit_continues = False

    def finalize_variable_values(self, var_list):
        # Keras calls this once at the end of fit(): the last open window is applied (contract E4:
        # never silently lost), before the inner optimizer's EMA overwrite.
        if self._fit_continues:
            return
        self.finish_epoch(last=True)
        self.inner_optimizer.finalize_variable_values(var_list)

    # -- the micro-step ---------------------------------------------------------------------------
    def apply_gradients(self, grads_and_vars, sample_count=None, summed=False, loss_divisor=None):
        grads, variables = zip(*grads_and_vars)
        self.apply(grads, variables, sample_count=sample_count, summed=summed,
                   loss_divisor=loss_divisor)
        return self.iterations

    def apply(self, grads, trainable_variables=None, sample_count=None, summed=False,
              loss_divisor=None):
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
        grads = list(grads)
        if not grads:
            return
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "Pass the variables on the first call, e.g. "
                    "optimizer.apply(grads, model.trainable_variables)."
                )
            trainable_variables = self._trainable_variables
        trainable_variables = list(trainable_variables)
        if not self.built:
            self.build(trainable_variables)
        if sample_count is None:
            sample_count, summed, loss_divisor = (
                getattr(self._scoped_counts, "value", None) or (None, False, None)
            )
        weighted = sample_count is not None
        weight = tf.cast(sample_count, "float32") if weighted else tf.constant(1.0)
        if loss_divisor is not None and (summed or not weighted):
            raise ValueError(
                "loss_divisor says what the loss was divided by, so that the engine can weigh it "
                "by sample_count: pass sample_count (this replica's samples) with it, and not "
                "summed=True (which means loss_divisor=1)."
            )
        if self.reduction is Reduction.sum:
            if summed or loss_divisor is not None:
                raise ValueError(
                    "summed=True and loss_divisor describe a loss to be weighed by "
                    "sample_count, which reduction='sum' would add as it is; pass the gradients "
                    "of the mean loss."
                )
            weight = tf.constant(1.0)
        # One product per gradient element at most: the weight (unless the caller weighed the
        # loss) and the loss scale (P2: each micro-batch is unscaled with its own scale) together.
        factor = None
        if weighted and not summed and self.reduction is Reduction.mean:
            # The gradient of this replica's summed loss: the mean loss's times its divisor.
            factor = weight if loss_divisor is None else tf.cast(loss_divisor, "float32")
        if self.loss_scaling:
            inverse_scale = 1.0 / tf.cast(self.loss_scale, "float32")
            factor = inverse_scale if factor is None else factor * inverse_scale
        indices, pairs = [], []
        for gradient, variable in zip(grads, trainable_variables):
            if gradient is None:
                continue
            index = self._get_variable_index(variable)
            indices.append(index)
            accumulator = self._accumulators[index]
            # Sparse (IndexedSlices) gradients are densified here; contract row E5 is open.
            gradient = tf.cast(tf.convert_to_tensor(gradient), accumulator.dtype)
            pairs.append((accumulator, gradient))
        self._gradient_indices = tuple(sorted(indices))
        self._weighted = weighted
        finite = None
        if self.nonfinite is not None:
            finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for _, g in pairs])
        if self.nonfinite is NonFinite.stop:
            # Once halted, every micro-batch is left out until fit() sees it and stops.
            finite = tf.logical_and(finite, tf.convert_to_tensor(self.halted_at) == 0)
        for accumulator, gradient in pairs:
            contribution = gradient
            if factor is not None:
                contribution = gradient * tf.cast(factor, accumulator.dtype)
            if finite is not None:
                # where, not multiplication: 0 * inf is nan.
                contribution = tf.where(finite, contribution, tf.zeros_like(contribution))
            accumulator.assign_add(contribution)
        if finite is not None:
            nonfinite = 1.0 - tf.cast(finite, "float32")
            self.step_nonfinite.assign(nonfinite)
            if self.nonfinite in (NonFinite.skip_micro_batch, NonFinite.stop):
                weight = weight * (1.0 - nonfinite)
            else:
                self.window_nonfinite.assign_add(nonfinite)
        self.window_weight.assign_add(weight)
        self.window_micro_steps.assign_add(1)
        self.micro_step.assign_add(1)
        self._apply_window_if(self.window_micro_steps >= self.accum_steps, micro_step=True)

    # -- the update -------------------------------------------------------------------------------
    def _apply_window_if(self, window_closes, micro_step=False):
        """Apply (or skip) the open window when ``window_closes``.

        The decision is taken in cross-replica context: inside ``merge_call`` under a
        tf.distribute strategy, directly otherwise. Both branches are graph conditionals whose
        bodies enter replica context again through ``call_for_each_replica``, so the inner
        optimizer's all-reduce never sits in a replica-context ``tf.cond`` (contract X2).
        """
        if _in_distributed_replica_context():

            def merge_fn(distribution, window_closes):
                # Read in cross-replica context, the per-replica window weights come summed: the
                # global sample count of the window (D3).
                global_weight = tf.convert_to_tensor(self.window_weight)
                self._decide(
                    distribution.experimental_local_results(window_closes)[0],
                    lambda fn, *args: distribution.extended.call_for_each_replica(fn, args=args),
                    global_weight,
                    micro_step,
                    distribution.num_replicas_in_sync,
                )

            tf.distribute.get_replica_context().merge_call(merge_fn, args=(window_closes,))
        else:
            self._decide(window_closes, lambda fn, *args: fn(*args), None, micro_step, 1)

    def _decide(self, closes, in_each_replica, global_weight, micro_step, replicas):
        """``closes``: one boolean; ``in_each_replica(fn, *args)`` runs fn in replica context;
        ``global_weight``: the window's count summed over replicas (None on one device)."""
        apply_now = closes
        if self.nonfinite is NonFinite.stop:
            if micro_step:
                first_bad = tf.logical_and(
                    self.halted_at == 0, tf.convert_to_tensor(self.step_nonfinite) > 0
                )
                self.halted_at.assign(tf.where(first_bad, self.micro_step, self.halted_at))
            apply_now = tf.logical_and(apply_now, self.halted_at == 0)
        if self.nonfinite is not None:
            if micro_step and self.nonfinite in (NonFinite.skip_micro_batch, NonFinite.stop):
                # Per-replica flags summed on read: how many replicas dropped this micro-step.
                self.skipped_micro_batches.assign_add(
                    tf.cast(tf.convert_to_tensor(self.step_nonfinite), "int64")
                )
            if self.loss_scaling and micro_step:
                # Any replica's overflow halves everyone's scale.
                overflow = tf.convert_to_tensor(self.step_nonfinite) > 0
                self.loss_scale.assign(
                    tf.where(overflow, tf.maximum(self.loss_scale / 2.0, 1.0), self.loss_scale)
                )
                self.growth_steps.assign(
                    tf.where(overflow, tf.zeros_like(self.growth_steps), self.growth_steps)
                )
            healthy = tf.logical_and(
                tf.convert_to_tensor(self.window_nonfinite) == 0,
                tf.convert_to_tensor(self.window_weight) > 0,
            )
            apply_now = tf.logical_and(apply_now, healthy)
            tf.cond(
                tf.logical_and(closes, tf.logical_not(healthy)),
                lambda: in_each_replica(self._skip_window),
                lambda: None,
            )
        tf.cond(
            apply_now,
            lambda: self._apply_in_replicas(in_each_replica, global_weight, replicas),
            lambda: None,
        )

    def _clips(self):
        inner = self.inner_optimizer
        return self.use_agc or any(
            getattr(inner, name, None) for name in ("clipnorm", "global_clipnorm", "clipvalue")
        )

    def _apply_in_replicas(self, in_each_replica, global_weight, replicas):
        """Apply the window. Clipping (AGC, clipnorm, global_clipnorm, clipvalue) must see the
        gradient summed over replicas, but Keras' optimizers clip each replica's part before
        their all-reduce: with several replicas and clipping, the window's gradient is reduced
        and clipped here, in cross-replica context, and handed to every replica."""
        if global_weight is None or replicas == 1 or not self._clips():
            in_each_replica(self._apply_window, global_weight)
            return
        indices = self._gradient_indices or ()
        variables = [self._trainable_variables[index] for index in indices]
        if self.reduction is Reduction.sum:
            denominator = tf.constant(1.0)
        elif self._weighted:
            denominator = global_weight
        else:
            # Keras' train_step already divided each replica's gradient by the replica count.
            denominator = global_weight / replicas
        grads = [
            # Read in cross-replica context, the accumulators come summed over replicas.
            tf.cast(tf.math.divide_no_nan(tf.convert_to_tensor(self._accumulators[index]),
                                          tf.cast(denominator, self._accumulators[index].dtype)),
                    variable.dtype)
            for index, variable in zip(indices, variables)
        ]
        if self.use_agc:
            from gacli.clipping import adaptive_clip_gradients

            grads = adaptive_clip_gradients(grads, variables, self.clip_factor, self.eps)
        grads = self.inner_optimizer._clip_gradients(grads)
        # Each replica passes 1/R of the clipped gradient; the inner all-reduce sums them back.
        # Clipping is switched off here, once: replicas trace in threads of their own.
        with _clipping_off(self.inner_optimizer):
            in_each_replica(self._apply_window, global_weight, [g / replicas for g in grads])

    def _skip_window(self):
        self.skipped_windows.assign_add(1)
        self._reset_window()

    def _apply_window(self, global_weight=None, clipped=None):
        """Update from the open window; ``global_weight``: its count summed over replicas;
        ``clipped``: this replica's share of the window's gradient, already reduced and clipped."""
        indices = self._gradient_indices or ()
        variables = [self._trainable_variables[index] for index in indices]
        if clipped is not None:
            # A copy on this replica's device: the inner all-reduce reads its destination there.
            clipped = [tf.identity(gradient) for gradient in clipped]
            self.inner_optimizer.apply(clipped, variables)
            self._after_update()
            return
        accumulators = [self._accumulators[index] for index in indices]
        if self.reduction is Reduction.sum:
            denominator = tf.constant(1.0)
        else:
            denominator = tf.convert_to_tensor(self.window_weight)
            if self._weighted and global_weight is not None:
                # Contract D3: normalise by the samples of the whole window on all replicas.
                denominator = global_weight
        grads = [
            # divide_no_nan: a replica whose micro-batches were all skipped holds zeros, not 0/0.
            tf.cast(tf.math.divide_no_nan(tf.convert_to_tensor(accumulator),
                                          tf.cast(denominator, accumulator.dtype)),
                    variable.dtype)
            for accumulator, variable in zip(accumulators, variables)
        ]
        if self.use_agc:
            from gacli.clipping import adaptive_clip_gradients

            grads = adaptive_clip_gradients(grads, variables, self.clip_factor, self.eps)
        self.inner_optimizer.apply(grads, variables)
        self._after_update()

    def _after_update(self):
        if self.loss_scaling:
            # Grow the scale after dynamic_growth_steps updates without an overflow.
            growth = self.growth_steps + 1
            grow = growth >= self.dynamic_growth_steps
            self.loss_scale.assign(tf.where(grow, self.loss_scale * 2.0, self.loss_scale))
            self.growth_steps.assign(tf.where(grow, tf.zeros_like(growth), growth))
        self._reset_window()

    def _reset_window(self):
        for accumulator in self._accumulators:
            accumulator.assign(tf.zeros(accumulator.shape, accumulator.dtype))
        self.window_weight.assign(0.0)
        self.window_micro_steps.assign(0)
        if self.nonfinite is not None:
            self.window_nonfinite.assign(0.0)

    # -- windows that are not full ----------------------------------------------------------------
    def _run_window_function(self, kind):
        """Run ``flush`` or ``discard`` as a compiled function in the right distribution context."""
        if not self.built:
            return
        if tf.executing_eagerly() and int(self.window_micro_steps.numpy()) == 0:
            # Every window closed (the usual epoch end): nothing to apply or drop. Tracing the
            # function anyway costs seconds and ~10 MB of host memory at the first epoch end.
            # (Every micro-step counts itself in window_micro_steps, and every worker of a run
            # holds the same count, so all of them skip or none does.)
            return
        if self._gradient_indices is None:
            # Nothing traced apply() in this process yet (e.g. a checkpoint restored mid-window):
            # the open window is applied to every variable that has an accumulator.
            self._gradient_indices = tuple(range(len(self._accumulators)))
            self._weighted = True
        function = self._window_functions.get(kind)
        if function is None:
            # The strategy the optimizer was created under (Keras calls callbacks and
            # finalize_variable_values outside the strategy's scope).
            strategy = self._distribution_strategy
            step = self._flush_step if kind == "flush" else self._reset_window

            @tf.function
            def function():
                if tf.distribute.has_strategy():
                    strategy.run(step)
                else:
                    step()

            self._window_functions[kind] = function
        with self._distribution_strategy.scope():
            function()

    def _flush_step(self):
        self._apply_window_if(self.window_micro_steps > 0)

    def flush(self):
        """Apply the open window now, normalised by the samples it holds (no-op when empty)."""
        self._run_window_function("flush")

    def discard_window(self):
        """Drop the gradients of the open window without updating."""
        self._run_window_function("discard")

    def epoch_end_action(self, last=False):
        """``"apply"``, ``"drop"`` or ``None``: what ``partial_window`` does to an open window at
        an epoch end (``last=True``: the end of training, where a carried window is applied)."""
        last = last and not self._fit_continues
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

    def halted_micro_step(self):
        """0 while training is healthy; under ``nonfinite="stop"``, the micro_step (counted from
        1) of the first micro-batch whose gradient was not finite."""
        if self.nonfinite is not NonFinite.stop or not self.built:
            return 0
        return int(self.halted_at.numpy())

    # -- serialisation ----------------------------------------------------------------------------
    def get_config(self):
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "accum_steps": self.accum_steps,
            "reduction": self.reduction.value,
            "use_agc": self.use_agc,
            "clip_factor": self.clip_factor,
            "eps": self.eps,
            "partial_window": self.partial_window.value,
            "accumulator_dtype": self.accumulator_dtype,
            "loss_scaling": self.loss_scaling,
            "initial_scale": self.initial_scale,
            "dynamic_growth_steps": self.dynamic_growth_steps,
            "nonfinite": None if self.nonfinite is None else self.nonfinite.value,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["optimizer"] = keras.saving.deserialize_keras_object(
            config["optimizer"], custom_objects=custom_objects
        )
        return cls(**config)


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
