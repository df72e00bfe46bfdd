"""``check_equivalence``: does one accumulated window equal one big-batch update on *your* model?

gacli's own tests prove exactness on the project's models (``docs/contract.md``, E1 and E2). This
module answers the same question for a user's model and data: from the same weights and optimizer
state it applies (a) one gacli update over ``accum_steps`` micro-batches and (b) one plain-Keras
``train_on_batch`` over the same samples as one batch, on one device, and compares every weight.
Both run on copies (clones) of the model and optimizer: the user's model, optimizer and random
state are left as they were. The gacli side runs every setting of the user's
:class:`~gacli.AccumulationConfig` (reduction, accumulator dtype, AGC, loss normalisation, ...);
the reference is plain Keras with what the big batch has of them (AGC on its gradient, the
window-weighted loss). TF32 is off for both runs and put back after. When they differ it says
which layers, grouped by the kind of cause: batch normalisation, dropout and other random layers,
a loss normalised per call, a custom ``train_step``, inputs or a loss that are not finite, a
setting that is not the big batch's. ``docs/guides/equivalence-check.md`` shows it in use.

When is a check *conclusive*? A weight passes when its difference is within the tolerance
(relative, as in :func:`_compare`), so an update that itself moves no weight by more than the
tolerance passes whatever it is: no update at all would pass too. An update of relative size u
hides any error smaller than tolerance / u of itself. The check calls itself conclusive when the
update it can read the accumulation from is at least ``CONCLUSIVE_FACTOR`` (10) times the
tolerance, so that an error of a tenth of the update (one micro-batch in ten left out) shows:
for SGD the weights' update; for adaptive optimizers the window's gradient (their first update
moves each weight by about the learning rate times its gradient's sign, whatever the gradient's
size). Below that it says INCONCLUSIVE and does not pass. In float32 units, 10 x 1e-6 is about
84 units of round-off of a weight of magnitude 1 (float32's epsilon is 1.19e-07).
"""

import contextlib
import dataclasses
import math
import random

import keras
import numpy as np
import tensorflow as tf

from gacli.engine import _keras_compat as compat
from gacli.engine.accumulate_model import (
    AccumulatingModelWrapper,
    AccumulationMixin,
    _window_weighted_loss,
    accumulation_callbacks,
    wrap_model,
)
from gacli.engine.accumulation import (
    GradientAccumulateOptimizer,
    NonFiniteError,
    find_accumulating_optimizer,
)
from gacli.engine.batchnorm import accum_batchnorm_layers, apply_batchnorm_policy
from gacli.engine.options import (
    BatchNormPolicy,
    LossNormalization,
    PartialWindow,
    Reduction,
    parse_option,
)
from gacli.engine.remat import recompute
from gacli.engine.settings import AccumulationConfig, refuse_unknown_keywords

# The contract's tolerances (docs/contract.md, E1): float32 round-off after one update. Adaptive
# optimizers divide by the root of the second moment, which magnifies round-off.
SGD_TOLERANCE = 1e-6
ADAPTIVE_TOLERANCE = 1e-5
# The smallest update, in tolerances, from which a check tells anything (the module's docstring).
CONCLUSIVE_FACTOR = 10
_PLAIN_GRADIENT_OPTIMIZERS = (keras.optimizers.SGD,)


class EquivalenceInputError(ValueError):
    """What was given to :func:`check_equivalence` cannot be checked; the message says what to
    give instead."""


@dataclasses.dataclass
class EquivalenceSettings:
    """The settings of :func:`check_equivalence` (its keyword arguments).

    Args:
        accum_steps: micro-batches in the window (default: a wrapped model's own).
        micro_batch_size: samples per micro-batch and replica.
        optimizer: the optimizer to check (default: the one the model was compiled with; a
            ``GradientAccumulateOptimizer``'s inner one). It is copied, never stepped.
        loss: the loss (default: the compiled one).
        wrapper: ``"model"`` (``wrap_model``) or ``"optimizer"`` (``GradientAccumulateOptimizer``
            in a plain model); default: the one the model already uses, else ``"model"``.
        tolerance: the largest relative difference that passes (default: the contract's, 1e-6
            for SGD, 1e-5 for other optimizers).
        strategy: a ``tf.distribute`` strategy for the gacli side (default: the current one);
            the reference is always the single-device big batch.
        batchnorm: a ``batchnorm`` policy for the gacli side (``accumulate``, ``freeze``,
            ``group_norm``, ``keep``); ``freeze`` and ``group_norm`` change the model, so the
            reference gets them too.
        window_samples: samples in the window (default: a full one, micro_batch_size x
            accum_steps x replicas); fewer makes its last micro-batch short.
        explain: when it fails, look for the causes (and re-run with them switched off).
        sample_weight: the samples' weights (an array, or one per output), as ``fit`` takes
            them; with a dataset, its third element.
        config: the :class:`~gacli.AccumulationConfig` (or its dict) to check (default: the
            wrapped model's or the accumulating optimizer's own, else the defaults);
            ``accum_steps`` overrides its count.

    Example:
        >>> EquivalenceSettings(accum_steps=4, micro_batch_size=16)
    """

    accum_steps: int = None
    micro_batch_size: int = None
    optimizer: object = None
    loss: object = None
    wrapper: str = None
    tolerance: float = None
    strategy: object = None
    batchnorm: str = None
    window_samples: int = None
    explain: bool = True
    sample_weight: object = None
    config: object = None


@dataclasses.dataclass
class VariableDifference:
    """One weight after the two updates: its largest absolute difference, that divided by the
    larger of 1 and the reference's largest magnitude (``relative_diff``), the same for the
    window's gradient (``gradient_diff``, when the optimizer is not SGD) and the verdict."""

    name: str
    layer: str
    kind: str
    max_abs_diff: float
    relative_diff: float
    passed: bool
    gradient_diff: float = None  # relative difference of the window's gradient (not for SGD)
    update: float = 0.0  # the reference update's largest change, on relative_diff's scale
    gradient_update: float = None  # the window's gradient, on the same scale (not for SGD)


@dataclasses.dataclass
class Cause:
    """A kind of layer or code that breaks equivalence, the layers of that kind, and why."""

    kind: str
    layers: list
    why: str


@dataclasses.dataclass
class EquivalenceResult:
    """What :func:`check_equivalence` found. ``str()`` gives the table and the verdict.

    Args:
        passed: every weight within ``tolerance``, and the check conclusive.
        max_abs_diff: the largest absolute difference over all weights.
        variables: one :class:`VariableDifference` per weight.
        tolerance: the relative difference allowed, and ``tolerance_source`` where it came from.
        causes: when it failed, the kinds of layer or code responsible (:class:`Cause`).
        window: samples, accum_steps, micro_batch_size, replicas and wrapper of the check.
        conclusive: the update was large enough to tell (the module's docstring).
        tf32_disabled_for_check: TF32 was on, and the check turned it off for its runs.
        settings: the accumulation settings checked (``AccumulationConfig.to_dict()``).

    Example:
        >>> result = gacli.check_equivalence(model, x, y, accum_steps=4, micro_batch_size=16)
        >>> result.passed, result.max_abs_diff
    """

    passed: bool
    max_abs_diff: float
    variables: list
    tolerance: float
    tolerance_source: str
    causes: list = dataclasses.field(default_factory=list)
    window: dict = dataclasses.field(default_factory=dict)
    conclusive: bool = True
    tf32_disabled_for_check: bool = False
    settings: dict = dataclasses.field(default_factory=dict)

    @property
    def status(self):
        """``EQUIVALENT``, ``NOT EQUIVALENT`` or ``INCONCLUSIVE``."""
        if self.failing:
            return "NOT EQUIVALENT"
        return "EQUIVALENT" if self.conclusive else "INCONCLUSIVE"

    @property
    def max_update(self):
        """The reference update's largest relative change of a weight."""
        return max((v.update for v in self.variables), default=0.0)

    @property
    def max_gradient_update(self):
        """The window's gradient's largest relative size (None: not compared, SGD)."""
        found = [v.gradient_update for v in self.variables if v.gradient_update is not None]
        return max(found) if found else None

    @property
    def max_relative_diff(self):
        return max((v.relative_diff for v in self.variables), default=0.0)

    @property
    def failing(self):
        return [v for v in self.variables if not v.passed]

    def verdict(self):
        """The one-line verdict."""
        window = self.window
        replicas = window.get("replicas", 1)
        what = (
            f"{window.get('accum_steps')} micro-batches of {window.get('micro_batch_size')}"
            f"{f' x {replicas} replicas' if replicas > 1 else ''} ({window.get('samples')} samples)"
        )
        if not self.failing and not self.conclusive:
            gradient = self.max_gradient_update
            read = (
                f"the window's gradient is no larger than {gradient:.3g} relative"
                if gradient is not None
                else f"the update moves no weight by more than {self.max_update:.3g} relative"
            )
            return (
                f"INCONCLUSIVE: {what} agree with the big batch within {self.tolerance:g} "
                f"({self.tolerance_source}), but {read}, less than {CONCLUSIVE_FACTOR} times "
                "the tolerance: an error of a tenth of the update could pass, and no update at "
                "all nearly would. Check with a larger learning rate (optimizer=...) or a loss "
                "whose gradient is not vanishing on this data."
            )
        if self.passed:
            gradient = ""
            if self.max_gradient_diff is not None:
                gradient = (
                    f"; the window's gradient agrees to {self.max_gradient_diff:.3g} relative"
                )
            return (
                f"EQUIVALENT: {what} give the big batch's update; largest difference "
                f"{self.max_abs_diff:.3g} (relative {self.max_relative_diff:.3g} <= "
                f"{self.tolerance:g}, {self.tolerance_source}){gradient}."
            )
        kinds = {}
        for _, kind in sorted({(v.layer, v.kind) for v in self.failing}):
            kinds[kind] = kinds.get(kind, 0) + 1
        where = ", ".join(f"{count} {kind}" for kind, count in kinds.items())
        layers = sum(kinds.values())
        gradient = ""
        if self.max_gradient_diff is not None:
            gradient = f", the window's gradient by {self.max_gradient_diff:.3g} relative"
        return (
            f"NOT EQUIVALENT: {len(self.failing)} of {len(self.variables)} weights differ from "
            f"the big batch's by more than {self.tolerance:g} relative "
            f"({self.tolerance_source}); the update by up to {self.max_abs_diff:.3g}{gradient}; "
            f"in {where} layer{'s' if layers > 1 else ''}."
        )

    @property
    def max_gradient_diff(self):
        """The largest relative difference of the window's gradient (None: not compared, SGD)."""
        found = [v.gradient_diff for v in self.variables if v.gradient_diff is not None]
        return max(found) if found else None

    def to_dict(self):
        return {
            "passed": self.passed,
            "status": self.status,
            "conclusive": self.conclusive,
            "max_update": self.max_update,
            "max_gradient_update": self.max_gradient_update,
            "tf32_disabled_for_check": self.tf32_disabled_for_check,
            "settings": self.settings,
            "max_abs_diff": self.max_abs_diff,
            "max_relative_diff": self.max_relative_diff,
            "max_gradient_diff": self.max_gradient_diff,
            "tolerance": self.tolerance,
            "tolerance_source": self.tolerance_source,
            "window": self.window,
            "verdict": self.verdict(),
            "variables": [dataclasses.asdict(v) for v in self.variables],
            "causes": [dataclasses.asdict(c) for c in self.causes],
        }

    def table(self):
        """The per-weight table, as text."""
        gradients = any(v.gradient_diff is not None for v in self.variables)
        header = ("variable", "layer", "max abs diff", "relative")
        header += ("gradient", "verdict") if gradients else ("verdict",)
        rows = [
            (
                v.name,
                f"{v.layer} ({v.kind})",
                f"{v.max_abs_diff:.3g}",
                f"{v.relative_diff:.3g}",
                *((f"{v.gradient_diff:.3g}",) if gradients else ()),
                "ok" if v.passed else "DIFFERS",
            )
            for v in self.variables
        ]
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)) for row in rows]
        head = "  ".join(cell.ljust(width) for cell, width in zip(header, widths))
        return "\n".join([head, "-" * len(head), *lines])

    def explanation(self):
        """The causes, one paragraph each."""
        return "\n".join(
            f"- {cause.kind}{_named(cause.layers)}: {cause.why}" for cause in self.causes
        )

    def __str__(self):
        parts = [self.table(), "", self.verdict()]
        if self.tf32_disabled_for_check:
            parts.append(
                "TF32 was on (TensorFlow's default; on Ampere and newer GPUs it rounds float32 "
                "products to 10 mantissa bits): the check turned it off for its two updates and "
                "back on after. Training with it on is not exact to this tolerance: "
                "tf.config.experimental.enable_tensor_float_32_execution(False), or ga-train "
                "tf32=off, turns it off."
            )
        if self.causes:
            parts += ["", "Why:", self.explanation()]
        return "\n".join(parts)


def _named(layers, shown=6):
    if not layers:
        return ""
    more = f" and {len(layers) - shown} more" if len(layers) > shown else ""
    return f" ({', '.join(layers[:shown])}{more})"


def check_equivalence(model, x=None, y=None, **settings):
    """Whether one accumulated window equals one big-batch update on ``model`` and this data.

    From the model's current weights and optimizer state, applies one gacli update over the
    first ``accum_steps`` micro-batches of ``x``, ``y`` (in order) and one plain-Keras
    ``train_on_batch`` over the same samples as one batch, and compares every weight. Both run on
    copies: ``model``, its optimizer and the random state (Python's, NumPy's and every layer's
    seed) are as they were afterwards.

    Args:
        model: a built Keras model: plain, made with ``gacli.wrap_model``, or compiled with a
            ``GradientAccumulateOptimizer``.
        x: the inputs: an array, a dict or list of arrays (a model with several inputs), or a
            ``tf.data.Dataset`` of (inputs, targets) or (inputs, targets, sample weights),
            batched or not, whose parts may be dicts.
        y: the targets: an array, or a dict or list of them (one per output); None with a
            dataset.
        **settings: :class:`EquivalenceSettings`: ``accum_steps``, ``micro_batch_size``,
            ``optimizer``, ``loss``, ``wrapper``, ``tolerance``, ``strategy``, ``batchnorm``,
            ``window_samples``, ``explain``, ``sample_weight``, ``config``.

    Returns:
        An :class:`EquivalenceResult`.

    Example:
        >>> result = gacli.check_equivalence(model, x, y, accum_steps=4, micro_batch_size=16)
        >>> print(result)
    """
    refuse_unknown_keywords(
        "check_equivalence()",
        settings,
        ("model", "x", "y", *(f.name for f in dataclasses.fields(EquivalenceSettings))),
    )
    return EquivalenceCheck(model, x, y, EquivalenceSettings(**settings)).run()


class EquivalenceCheck:
    """One equivalence check: the model's parts, the window, the two updates and the verdict.

    Args:
        model: as for :func:`check_equivalence`.
        x: as for :func:`check_equivalence`.
        y: as for :func:`check_equivalence`.
        settings: an :class:`EquivalenceSettings`.

    Example:
        >>> EquivalenceCheck(model, x, y, EquivalenceSettings(accum_steps=4)).run()
    """

    def __init__(self, model, x, y, settings):
        self.settings = settings
        self.base, self.optimizer, self.loss, self.wrapper, own = _unwrap(model, settings)
        self.loss_weights = compat.compiled_loss_weights(model) if settings.loss is None else None
        config = _accumulation_config(settings.config, own)
        known = own is not None or settings.config is not None
        self.accum_steps = settings.accum_steps or (config.accum_steps if known else None)
        self.strategy = settings.strategy or tf.distribute.get_strategy()
        self.replicas = self.strategy.num_replicas_in_sync
        _check_numbers(self)
        self.config = config.replace(accum_steps=self.accum_steps)
        self.batchnorm = parse_option(BatchNormPolicy, settings.batchnorm or "keep", "batchnorm")
        self.tolerance, self.tolerance_source = _tolerance(settings.tolerance, self.optimizer)
        full = settings.micro_batch_size * self.accum_steps * self.replicas
        self.samples = settings.window_samples or full
        self.x, self.y, self.sample_weight = _window(
            x, y, settings.sample_weight, self.samples, full
        )
        _refuse_what_cannot_be_checked(self, model, full)

    @property
    def global_micro_batch_size(self):
        return self.settings.micro_batch_size * self.replicas

    def run(self):
        # TF32 (on by default) rounds float32 products far beyond the tolerance: off for both
        # updates, as it was afterwards, even after an error.
        with _random_state_kept(), _tf32_off() as tf32_was_on:
            self.base = self._with_model_policy(self.base)
            start = _Start.of(self.base, self.optimizer)
            variables, trained = self._comparison(start)
            conclusive = self._conclusive(variables)
            result = EquivalenceResult(
                passed=all(v.passed for v in variables) and conclusive,
                conclusive=conclusive,
                tf32_disabled_for_check=tf32_was_on,
                settings=self.config.to_dict(),
                max_abs_diff=max((v.max_abs_diff for v in variables), default=0.0),
                variables=variables,
                tolerance=self.tolerance,
                tolerance_source=self.tolerance_source,
                window={
                    "samples": self.samples,
                    "accum_steps": self.accum_steps,
                    "micro_batch_size": self.settings.micro_batch_size,
                    "replicas": self.replicas,
                    "wrapper": self.wrapper,
                    "optimizer": type(self.optimizer).__name__,
                },
            )
            if result.failing and self.settings.explain:
                result.causes = self._causes(start, result, trained)
        return result

    def _conclusive(self, variables):
        """Whether the update the accumulation is read from is large enough to tell (see the
        module's docstring): the window's gradient for adaptive optimizers, else the update."""
        sizes = [v.update if v.gradient_update is None else v.gradient_update for v in variables]
        return max(sizes, default=0.0) >= CONCLUSIVE_FACTOR * self.tolerance

    def _comparison(self, start, neutralise=False):
        """(a VariableDifference per weight, the gacli-trained model)."""
        reference, trained = self._two_updates(start, neutralise)
        variables = _compare(reference, trained, self.tolerance, start.weights)
        if not isinstance(self.optimizer, keras.optimizers.SGD):
            # Adam's first update keeps little more than each gradient's sign: the window's
            # gradient itself is compared too, through SGD with learning rate 1.
            gradients = _compare(
                *self._two_updates(start, neutralise, gradient=True),
                self.tolerance,
                start.weights,
            )
            for variable, gradient in zip(variables, gradients):
                variable.gradient_diff = gradient.relative_diff
                variable.gradient_update = gradient.update
                variable.passed = variable.passed and gradient.passed
        return variables, trained

    def _with_model_policy(self, model):
        """``model``, or under batchnorm=freeze or group_norm (which change the model that
        trains, on both sides) a copy with the policy applied."""
        if self.batchnorm not in (BatchNormPolicy.freeze, BatchNormPolicy.group_norm):
            return model
        copy = _clone(model)
        _Start.of(model, None).put_weights(copy)
        return apply_batchnorm_policy(copy, self.batchnorm.value, self.accum_steps, warn=False)

    # -- the two updates --------------------------------------------------------------------------
    def _two_updates(self, start, neutralise=False, gradient=False):
        """(reference model, gacli-trained model) after one update each from ``start``;
        ``gradient``: with SGD at learning rate 1, so that the update is the gradient."""
        reference = self._reference(start, neutralise, gradient)
        trained = self._accumulated(start, neutralise, gradient)
        return reference, trained

    def _optimizer_copy(self, start, gradient):
        if gradient:
            return keras.optimizers.SGD(learning_rate=1.0), None
        return _copy_optimizer(self.optimizer), start

    def _prepare(self, start, neutralise, gacli_side):
        model = _clone(self.base)
        if gacli_side and self.batchnorm is BatchNormPolicy.accumulate:
            model = apply_batchnorm_policy(model, "accumulate", self.accum_steps, warn=False)
        start.put_weights(model)
        if neutralise:
            _neutralise(model)
        return model

    def _reference_loss(self):
        """The big batch's loss: the compiled one, or under loss_normalization="window_weights"
        the same divided by the window's total sample weight (what the model wrapper trains)."""
        if self.config.loss_normalization is LossNormalization.window_weights:
            return _window_weighted_loss(self.loss)
        return self.loss

    def _reference(self, start, neutralise, gradient):
        """Plain Keras' update over the window as one batch, on one device (with AGC, when the
        user's settings have it, on the big batch's gradient)."""
        with tf.distribute.OneDeviceStrategy(_first_device()).scope():
            model = self._prepare(start, neutralise, gacli_side=False)
            optimizer, state = self._optimizer_copy(start, gradient)
            model.compile(
                optimizer=optimizer,
                loss=self._reference_loss(),
                loss_weights=self.loss_weights,
                jit_compile=False,
            )
            optimizer.build(model.trainable_variables)
            if state is not None:
                state.put_optimizer_state(optimizer)
        embedding = any(
            isinstance(layer, keras.layers.Embedding) for layer in compat.sublayers(model)
        )
        if embedding or self.config.use_agc:
            clip = None
            if self.config.use_agc:
                from gacli.engine.clipping import adaptive_clip_gradients, agc_unit_axes

                axes = agc_unit_axes(model)
                clip = lambda grads, variables: adaptive_clip_gradients(  # noqa: E731
                    grads, variables, self.config.clip_factor, self.config.eps, unit_axes=axes
                )
            _dense_gradient_step(model, self.x, self.y, self.sample_weight, clip)
        else:
            model.train_on_batch(self.x, self.y, sample_weight=self.sample_weight)
        return model

    def _accumulated(self, start, neutralise, gradient):
        config = self.config
        with self.strategy.scope():
            model = self._prepare(start, neutralise, gacli_side=True)
            inner, state = self._optimizer_copy(start, gradient)
            if self.wrapper == "model":
                trainer = wrap_model(model, config=config)
                optimizer = inner
            else:
                from gacli.engine.clipping import agc_unit_axes

                # Recomputation is the model's, not the optimizer's: the model runs it.
                trainer = recompute(model, config.remat) if config.remat is not None else model
                optimizer = GradientAccumulateOptimizer(
                    inner,
                    config=config.replace(remat=None),
                    agc_unit_axes=agc_unit_axes(model) if config.use_agc else None,
                )
            trainer.compile(
                optimizer=optimizer,
                loss=self.loss,
                loss_weights=self.loss_weights,
                jit_compile=False,
            )
            accumulator = find_accumulating_optimizer(trainer.optimizer)
            accumulator.build(trainer.trainable_variables)
            if state is not None:
                state.put_optimizer_state(inner)
        try:
            trainer.fit(
                self.x,
                self.y,
                sample_weight=self.sample_weight,
                batch_size=self.global_micro_batch_size,
                epochs=1,
                shuffle=False,
                verbose=0,
                callbacks=accumulation_callbacks(accumulator),
            )
        except NonFiniteError:
            # nonfinite="stop": the weights are those before the bad micro-batch; the
            # comparison shows the difference and _not_finite says why.
            pass
        return model

    # -- why it failed ----------------------------------------------------------------------------
    def _causes(self, start, result, trained):
        not_finite = self._not_finite(result)
        if not_finite is not None:
            return [not_finite]  # every other diagnosis would read the same NaNs
        causes = self._setting_causes()
        batchnorm = [
            layer
            for layer in compat.sublayers(trained)
            if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable
        ]
        randomness = _random_layers(trained)
        if batchnorm:
            causes.append(_batchnorm_cause(batchnorm, self.batchnorm))
        if randomness:
            causes.append(
                Cause(
                    "dropout and other random layers",
                    [layer.name for layer in randomness],
                    "each micro-batch draws its own random mask (or noise), so the k micro-batches "
                    "do not see the mask the big batch draws: their gradients differ by chance, "
                    "not by an error in the accumulation. Training is not harmed (the masks are "
                    "as random as the big batch's), but no update can equal the big batch's.",
                )
            )
        loss_gap = self._loss_gap()
        if loss_gap is not None:
            causes.append(loss_gap)
        if _has_custom_train_step(self.base):
            causes.append(
                Cause(
                    "custom train_step",
                    [type(self.base).__name__],
                    "the model defines its own train_step: the reference runs it, but gacli's "
                    "model wrapper runs its own step, which cannot see into yours. Use "
                    "wrapper='optimizer' (your train_step then calls the accumulating "
                    "optimizer), and let your step compute the mean loss over its micro-batch.",
                )
            )
        if batchnorm or randomness:
            causes.append(self._rest_without(start, batchnorm, randomness))
        if not causes:
            causes.append(
                Cause(
                    "no known cause",
                    sorted({v.layer for v in result.failing}),
                    "no batch normalisation, random layer, per-call loss, custom train_step or "
                    "setting that changes the update was found. Look at what these layers "
                    "compute from the whole batch (a per-batch sum, a count, a statistic), or at "
                    "regularisation losses computed per call.",
                )
            )
        return causes

    def _rest_without(self, start, batchnorm, randomness):
        """The check again with random layers off and batch norm in inference mode, both sides."""
        switched = []
        if randomness:
            switched.append("random layers off")
        if batchnorm:
            switched.append("batch norm in inference mode")
        variables, _ = self._comparison(start, neutralise=True)
        largest = max((v.max_abs_diff for v in variables), default=0.0)
        if all(v.passed for v in variables):
            why = (
                f"with {' and '.join(switched)} in both updates the weights differ by at most "
                f"{largest:.3g}: within tolerance, so everything else in the model accumulates "
                "exactly and these layers are the whole difference."
            )
        else:
            left = sorted({v.layer for v in variables if not v.passed})
            why = (
                f"with {' and '.join(switched)} in both updates the weights still differ by "
                f"{largest:.3g} (layers {', '.join(left[:6])}): something else breaks "
                "equivalence too."
            )
        return Cause("the rest, re-checked", [], why)

    def _not_finite(self, result):
        """A Cause when the window's data, its loss or the update is not finite."""
        parts = (("inputs", self.x), ("targets", self.y), ("sample weights", self.sample_weight))
        bad = [name for name, part in parts if part is not None and not _finite(part)]
        if bad:
            why = (
                f"the window's {' and '.join(bad)} hold NaN or infinite values, so the loss, "
                "the gradients and both updates are not finite and no comparison means "
                "anything. Clean the data (np.isfinite), or check a window without them."
            )
            return Cause("inputs or loss not finite", bad, why)
        loss = self._window_loss(slice(0, self.samples))
        if math.isfinite(loss) and all(math.isfinite(v.max_abs_diff) for v in result.variables):
            return None
        return Cause(
            "inputs or loss not finite",
            _loss_names(self.loss),
            f"the inputs are finite but the loss of the window is {loss:.6g} on its starting "
            "weights, or the update is not finite: the loss (or the model) makes an inf or NaN "
            "(a log of zero, a division by zero, an overflow). Fix that first; with "
            "nonfinite='skip_micro_batch' gacli would leave such micro-batches out, which the "
            "big batch cannot.",
        )

    def _setting_causes(self):
        """Causes in the user's accumulation settings: what they ask for is not the big batch."""
        causes = []
        config = self.config
        if config.reduction is Reduction.sum:
            causes.append(
                Cause(
                    "reduction='sum'",
                    [],
                    f"the update is the sum of the {self.accum_steps} micro-batches' gradients "
                    "of their mean losses, not their mean (about accum_steps times the big "
                    "batch's gradient), as the older gradient-accumulator package did. "
                    "reduction='mean' (the default) gives the big batch's update.",
                )
            )
        bits = {"float16": 10, "bfloat16": 7}.get(config.accumulator_dtype)
        if bits is not None:
            causes.append(
                Cause(
                    f"accumulator_dtype='{config.accumulator_dtype}'",
                    [],
                    f"the gradients are summed in {config.accumulator_dtype}, {bits} bits of "
                    f"mantissa: each addition rounds by up to {2.0 ** -(bits + 1):.2g} of the "
                    "sum, far beyond the float32 round-off the tolerance allows. "
                    "accumulator_dtype='float32' (the default) keeps the sums exact to it.",
                )
            )
        size = self.global_micro_batch_size
        short = self.samples % size
        if self.wrapper == "optimizer" and short:
            causes.append(
                Cause(
                    "optimizer wrapper: every micro-batch weighs the same",
                    [],
                    "GradientAccumulateOptimizer inside a plain fit() is not told each "
                    "micro-batch's size (Keras' train_step calls optimizer.apply without "
                    "sample_count), so, as documented, it averages the micro-batches with equal "
                    f"weights: the short last one of {short} samples counts as much as one of "
                    f"{size}. Use the model wrapper (gacli.wrap_model, wrapper='model'), which "
                    "weighs each by its samples, pass sample_count in a custom loop, or make "
                    "the data divide into micro-batches.",
                )
            )
        return causes

    def _window_loss(self, rows, model=None):
        """The loss of the window's ``rows`` (a slice) on the starting weights, in inference
        mode, as the training step computes it (the model's compute_loss, loss_weights)."""
        if model is None:
            model = self._loss_model()
        x, y = _rows(self.x, rows), _rows(self.y, rows)
        weights = None if self.sample_weight is None else _rows(self.sample_weight, rows)
        y_pred = model(x, training=False)
        loss = compat.compute_training_loss(model, x, y, y_pred, weights, training=False)
        return float(np.mean(np.asarray(loss)))

    def _loss_model(self):
        model = _clone(self.base)
        _Start.of(self.base, None).put_weights(model)
        model.compile(optimizer="sgd", loss=self._reference_loss(), loss_weights=self.loss_weights)
        return model

    def _loss_gap(self):
        """A Cause when the loss of the window is not the weighted mean of its micro-batch
        losses, each weighted by its samples (or, under window_weights, its total sample weight):
        a loss normalised per call (by its own token count, a per-batch sum, ...)."""
        model = self._loss_model()
        whole = self._window_loss(slice(0, self.samples), model)
        size = self.global_micro_batch_size
        weighted = total = 0.0
        for first in range(0, self.samples, size):
            part = slice(first, min(first + size, self.samples))
            weight = float(part.stop - part.start)
            if self.config.loss_normalization is LossNormalization.window_weights:
                weight = sum(
                    float(np.sum(w)) for w in tf.nest.flatten(_rows(self.sample_weight, part))
                )
            weighted += weight * self._window_loss(part, model)
            total += weight
        weighted /= max(total, 1e-12)
        gap = abs(whole - weighted) / max(abs(whole), 1e-12)
        if not gap > self.tolerance:
            return None
        return Cause(
            "loss normalised per call",
            _loss_names(self.loss),
            f"the loss of the whole window ({whole:.6g}) is not the sample-weighted mean of its "
            f"micro-batches' losses ({weighted:.6g}; relative gap {gap:.2g}): the loss divides by "
            "something of its own call (a count of tokens or items, a per-batch sum), so a "
            "micro-batch is weighted by that and not by its samples. Return the mean over samples "
            "(Keras' sum_over_batch_size), or pass the mask as sample_weight with "
            "loss_normalization='window_weights' to divide by the whole window's count.",
        )


def _loss_names(loss):
    """The names of a loss, or of each of a dict or list of them."""
    return [
        getattr(one, "name", None) or getattr(one, "__name__", None) or str(one)
        if not isinstance(one, str)
        else one
        for one in tf.nest.flatten(loss)
    ]


_EXACT_BATCHNORM = (
    "batchnorm=freeze (inference mode, for fine-tuning) or batchnorm=group_norm "
    "(GroupNormalization, no batch statistics) make the update exact."
)


def _dense_gradient_step(model, x, y, sample_weight=None, clip=None):
    """One big-batch step with every gradient dense (and ``clip(gradients, variables)`` applied
    to them: AGC). An embedding's gradient is a tf.IndexedSlices with a row per occurrence, and
    Keras' sparse Adam path squares each occurrence apart, which is not the gradient of any loss;
    the reference is the big batch with each row's occurrences summed, which is the dense
    gradient (docs/contract.md, E5)."""
    variables = model.trainable_variables
    with tf.GradientTape() as tape:
        y_pred = model(x, training=True)
        loss = compat.compute_training_loss(model, x, y, y_pred, sample_weight)
    gradients = [
        tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
        for g in tape.gradient(loss, variables)
    ]
    if clip is not None:
        gradients = clip(gradients, variables)
    model.optimizer.apply(gradients, variables)


def _batchnorm_cause(layers, policy):
    """Why batch norm under ``policy`` differs from the big batch, and what each policy changes."""
    names = [layer.name for layer in layers]
    per_micro_batch = (
        "in training each micro-batch is normalised by its own mean and variance, not the "
        "window's, so the gradients of these layers and of the layers around them differ from "
        "the big batch's."
    )
    if policy is BatchNormPolicy.accumulate:
        why = (
            "batchnorm=accumulate takes one step of the moving statistics per window, from the "
            f"statistics pooled over its micro-batches, as the big batch does; but "
            f"{per_micro_batch} " + _EXACT_BATCHNORM
        )
    elif policy is BatchNormPolicy.precise:
        why = (
            f"{per_micro_batch[0].upper()}{per_micro_batch[1:]} The moving statistics differ too, "
            "but batchnorm=precise recomputes them from the training data before each validation "
            "and at the end, so those differences never reach the trained model. "
            + _EXACT_BATCHNORM
        )
    else:
        why = (
            f"under batchnorm={policy.value} {per_micro_batch} The moving statistics also take a "
            "step per micro-batch, not per window: batchnorm=accumulate makes those the big "
            "batch's, batchnorm=precise recomputes them before validation. " + _EXACT_BATCHNORM
        )
    return Cause("batch normalisation", names, why)


def _has_custom_train_step(model):
    return type(model).train_step is not keras.Model.train_step


def _random_layers(model):
    """Layers that draw random numbers while training (dropout, noise, random augmentation)."""
    return [
        layer
        for layer in compat.sublayers(model)
        if any(isinstance(value, keras.random.SeedGenerator) for value in vars(layer).values())
    ]


def _neutralise(model):
    """Random layers switched off and batch norm in inference mode (a copy's layers only)."""
    for layer in _random_layers(model):
        for attribute in ("rate", "stddev", "factor"):
            if isinstance(getattr(layer, attribute, None), (int, float)):
                setattr(layer, attribute, 0)
    for layer in compat.sublayers(model):
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.trainable = False


# -- inputs -------------------------------------------------------------------------------------
def _unwrap(model, settings):
    """(plain model, inner optimizer, loss, wrapper, the user's AccumulationConfig or None) of
    what the user gave."""
    if not isinstance(model, keras.Model):
        raise EquivalenceInputError(
            f"check_equivalence needs a keras.Model, not {type(model).__name__}."
        )
    if not model.built or not model.weights:
        raise EquivalenceInputError(
            f"the model {model.name!r} is not built: it has no weights to compare yet. Build it "
            "first, e.g. model.build((None, *input_shape)) or by calling it on one batch, or make "
            "it with keras.Input."
        )
    compiled = getattr(model, "optimizer", None) if getattr(model, "compiled", False) else None
    accumulator = find_accumulating_optimizer(compiled)
    own = accumulator.config if accumulator is not None else None
    wrapper = settings.wrapper or ("optimizer" if accumulator is not None else "model")
    if isinstance(model, AccumulationMixin):
        wrapper = settings.wrapper or "model"
        own = model.accumulation_config
        if _own_compute_loss(model):
            raise EquivalenceInputError(
                f"the model's class {type(model).__name__} is a gacli model wrapper with a "
                "compute_loss of its own, which the check cannot copy onto the plain-Keras "
                "big batch it compares with. Check the model it is made of instead, as a "
                "keras.Model subclass with the same compute_loss (check_equivalence(that, x, y, "
                "accum_steps=...)); gacli.wrap_model trains such a model on its compute_loss."
            )
        if isinstance(model, AccumulatingModelWrapper):
            base = model.model
        else:
            base = keras.Model(*compat.graph_ends(model), name=model.name)
    else:
        base = model
    optimizer = settings.optimizer or compiled
    if isinstance(optimizer, GradientAccumulateOptimizer):
        optimizer = optimizer.inner_optimizer
    if isinstance(optimizer, str):
        optimizer = keras.optimizers.get(optimizer)
    loss = settings.loss or (getattr(model, "loss", None) if compiled is not None else None)
    if optimizer is None or loss is None:
        raise EquivalenceInputError(
            f"the model {model.name!r} is not compiled, and no optimizer= and loss= were given: "
            "there is no update to check. Compile it (model.compile(optimizer=..., loss=...)) or "
            "pass check_equivalence(..., optimizer=keras.optimizers.Adam(1e-3), loss='mse')."
        )
    if wrapper not in ("model", "optimizer"):
        raise EquivalenceInputError(
            f"wrapper={wrapper!r}: use 'model' (gacli.wrap_model) or 'optimizer' "
            "(gacli.GradientAccumulateOptimizer)."
        )
    return base, optimizer, loss, wrapper, own


def _own_compute_loss(model):
    """Whether a model wrapper's class has a compute_loss of its own (not gacli's or Keras')."""
    return type(model).compute_loss not in (
        keras.Model.compute_loss,
        AccumulatingModelWrapper.compute_loss,
    )


def _accumulation_config(given, own):
    """The AccumulationConfig to check: ``given`` (one or its dict), else the user's own, else
    the defaults."""
    if given is None:
        return own if own is not None else AccumulationConfig()
    if isinstance(given, dict):
        given = AccumulationConfig(**given)
    if not isinstance(given, AccumulationConfig):
        raise EquivalenceInputError(
            f"config={given!r}: pass a gacli.AccumulationConfig (or its dict), e.g. "
            "config=gacli.AccumulationConfig(accum_steps=4, reduction='mean')."
        )
    return given


def _refuse_what_cannot_be_checked(check, model, full):
    """EquivalenceInputError for what the check cannot compare, each with what to do."""
    config = check.config
    policies = {
        layer.dtype_policy.name
        for layer in [model, *compat.sublayers(model)]
        if layer.dtype_policy.compute_dtype != "float32"
        or layer.dtype_policy.variable_dtype != "float32"
    }
    if policies:
        raise EquivalenceInputError(
            f"the model {model.name!r} computes under the {', '.join(sorted(policies))} dtype "
            "policy: the check compares float32 updates (the contract's tolerances are float32 "
            "round-off), and ga-train check=equivalence refuses any precision but fp32 for the "
            "same reason. Build the model under keras.mixed_precision.set_global_policy("
            "'float32') for the check; the accumulators are float32 under any policy (contract "
            "P1)."
        )
    if config.partial_window is PartialWindow.drop and check.samples < full:
        raise EquivalenceInputError(
            f"partial_window='drop' discards a window that is not full, as this one of "
            f"{check.samples} samples (of {full}) is: there is no update to compare. Leave "
            "window_samples unset to check a full window, or pass config= with "
            "partial_window='apply'."
        )
    if config.loss_normalization is LossNormalization.window_weights:
        if check.wrapper == "optimizer":
            raise EquivalenceInputError(
                "loss_normalization='window_weights' is a setting of the model wrappers (it "
                "changes the loss); check with wrapper='model', or pass config= with "
                "loss_normalization='batch'."
            )
        if check.sample_weight is None:
            raise EquivalenceInputError(
                "loss_normalization='window_weights' divides the window's loss by its total "
                "sample weight, but the check got none: pass sample_weight= (e.g. the token "
                "mask), or a dataset of (inputs, targets, sample weights), as fit() gets them."
            )


def _check_numbers(check):
    for name, value in (
        ("accum_steps", check.accum_steps),
        ("micro_batch_size", check.settings.micro_batch_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise EquivalenceInputError(
                f"{name}={value!r} must be a whole number >= 1, e.g. accum_steps=4, "
                "micro_batch_size=16."
            )


def _tolerance(given, optimizer):
    """(relative tolerance, where it came from)."""
    if given is None:
        if isinstance(optimizer, _PLAIN_GRADIENT_OPTIMIZERS):
            return SGD_TOLERANCE, "the contract's tolerance for SGD"
        return ADAPTIVE_TOLERANCE, f"the contract's tolerance for {type(optimizer).__name__}"
    if (
        isinstance(given, bool)
        or not isinstance(given, (int, float))
        or not math.isfinite(given)
        or given <= 0
    ):
        raise EquivalenceInputError(
            f"tolerance={given!r} must be a positive number (the largest relative difference "
            "that passes), e.g. tolerance=1e-5; leave it unset for the contract's (1e-6 for "
            "SGD, 1e-5 for adaptive optimizers)."
        )
    return float(given), "as given"


def _window(x, y, sample_weight, samples, full):
    """(inputs, targets, sample weights or None) of the window's first ``samples`` samples, each
    an array or a dict / list of arrays as given."""
    if isinstance(x, tf.data.Dataset):
        if y is not None or sample_weight is not None:
            raise EquivalenceInputError(
                "with a dataset, give the targets and sample weights in it, as (inputs, "
                "targets) or (inputs, targets, sample weights), and leave y and sample_weight "
                "unset."
            )
        dataset = x
        if _is_batched(dataset):
            dataset = dataset.unbatch()
        elements = list(dataset.take(samples).as_numpy_iterator())
        if not elements or not isinstance(elements[0], tuple) or len(elements[0]) not in (2, 3):
            raise EquivalenceInputError(
                "the dataset must yield (inputs, targets) or (inputs, targets, sample weights), "
                "batched or not; each part may be an array or a dict of arrays."
            )
        stacked = tf.nest.map_structure(lambda *leaves: np.stack(leaves), *elements)
        x, y = stacked[0], stacked[1]
        sample_weight = stacked[2] if len(stacked) == 3 else None
    elif x is None or y is None:
        raise EquivalenceInputError(
            "give the data as x and y (arrays, or dicts or lists of them), or x as a "
            "tf.data.Dataset of (inputs, targets)."
        )
    x, y, sample_weight = (
        tf.nest.map_structure(np.asarray, part) if part is not None else None
        for part in (x, y, sample_weight)
    )
    if samples > full or samples < 1:
        raise EquivalenceInputError(
            f"window_samples={samples} must be between 1 and one full window, {full} samples."
        )
    held = min(len(leaf) for part in (x, y) for leaf in tf.nest.flatten(part))
    if held < samples:
        raise EquivalenceInputError(
            f"the data holds {held} samples, fewer than one window of {samples} "
            "(micro_batch_size x accum_steps x replicas). Give at least that many samples, or a "
            "smaller accum_steps or micro_batch_size."
        )
    return tuple(
        _rows(part, slice(0, samples)) if part is not None else None
        for part in (x, y, sample_weight)
    )


def _rows(data, rows):
    """``data`` (an array or a nested structure of arrays) at ``rows`` (a slice)."""
    return tf.nest.map_structure(lambda array: array[rows], data)


def _finite(data):
    """Whether every number in ``data`` (arrays, nested) is finite."""
    return all(
        np.all(np.isfinite(leaf))
        for leaf in tf.nest.flatten(data)
        if np.issubdtype(np.asarray(leaf).dtype, np.number)
    )


def _is_batched(dataset):
    spec = tf.nest.flatten(dataset.element_spec)[0]
    return len(spec.shape) > 0 and spec.shape[0] is None


# -- copies and state ---------------------------------------------------------------------------
def _clone(model):
    """A new model of the same layers (same names and config), fresh uncompiled weights; a layer
    that is shared stays one layer in the copy (:class:`_SharedLayersKept`)."""
    with compat.compile_state_hidden(model):
        if compat.is_functional(model):
            return keras.models.clone_model(model, clone_function=_SharedLayersKept(model))
        return keras.models.clone_model(model)


class _SharedLayersKept:
    """``clone_model``'s ``clone_function`` that keeps a layer used both inside a nested model and
    in the graph around it one layer in the copy. ``clone_model`` copies each layer of the graph
    from its config, the nested model whole, so such a layer would be copied twice, each copy
    with weights of its own: KerasHub's ``GPT2CausalLM`` calls its backbone's token embedding
    again for the logits (tied weights), and its copy would have the embedding twice, untied.
    Here that layer's copy is the nested model's copy's own layer, found at the same place among
    its layers."""

    def __init__(self, model):
        self._copies = {}
        # Each layer nested in one of the graph's layers, with that layer and its place there.
        self._nested_in = {}
        for outer in model.layers:
            for place, inner in enumerate(compat.sublayers(outer)):
                self._nested_in.setdefault(id(inner), (outer, place))

    def __call__(self, layer):
        if id(layer) not in self._copies:
            self._copies[id(layer)] = self._copy(layer)
        return self._copies[id(layer)]

    def _copy(self, layer):
        outer, place = self._nested_in.get(id(layer), (None, None))
        if outer is not None and outer is not layer:
            inside = compat.sublayers(self(outer))
            if place < len(inside):
                copy = inside[place]
                if type(copy) is type(layer) and copy.name == layer.name:
                    return copy
        return layer.__class__.from_config(layer.get_config())


def _copy_optimizer(optimizer):
    return type(optimizer).from_config(optimizer.get_config())


def _first_device():
    gpus = tf.config.list_logical_devices("GPU")
    return gpus[0].name if gpus else "/cpu:0"


@dataclasses.dataclass
class _Start:
    """The user's weights, layer seeds and optimizer state, read once, put into each copy."""

    weights: list
    seeds: list
    optimizer_state: list
    paths: list = None

    @classmethod
    def of(cls, model, optimizer):
        seeds = [
            [generator.state.numpy() for generator in _seed_generators(layer)]
            for layer in compat.sublayers(model)
        ]
        state = []
        if optimizer is not None and optimizer.built:
            state = [variable.numpy() for variable in optimizer.variables]
        weights = model.weights
        return cls([w.numpy() for w in weights], seeds, state, [w.path for w in weights])

    def put_weights(self, model):
        for variable, value in zip(
            _matching_weights(model, self.weights, self.paths), self.weights
        ):
            variable.assign(value)
        for layer, states in zip(compat.sublayers(model), self.seeds):
            for generator, state in zip(_seed_generators(layer), states):
                generator.state.assign(state)

    def put_optimizer_state(self, optimizer):
        if not self.optimizer_state:
            return
        variables = optimizer.variables
        if [tuple(v.shape) for v in variables] != [s.shape for s in self.optimizer_state]:
            raise EquivalenceInputError(
                "the optimizer's state does not match a copy built on the model's trainable "
                "weights; pass a fresh optimizer (optimizer=...) or one built on this model."
            )
        for variable, value in zip(variables, self.optimizer_state):
            variable.assign(value)


def _matching_weights(model, values, paths=None):
    """The weights of ``model`` (a copy) that take ``values`` (the model's, with their ``paths``),
    in their order: by path where every path is there once on both sides, else (a subclassed
    model's copy names its layers afresh) by position, where the shapes agree."""
    weights = model.weights
    # batchnorm=accumulate's layers hold window accumulators after the weights they carry over.
    window_state = {
        id(variable)
        for layer in accum_batchnorm_layers(model)
        for variable in (
            layer.window_count,
            layer.window_mean,
            layer.window_m2,
            layer.window_position,
        )
    }
    carried = [w for w in weights if id(w) not in window_state]
    shapes = [v.shape for v in values]
    distinct = paths is not None and len(set(paths)) == len(paths)
    for candidates in (weights, carried):
        by_path = {w.path: w for w in candidates}
        if distinct and len(by_path) == len(candidates) and set(by_path) == set(paths):
            matched = [by_path[path] for path in paths]
            if [tuple(w.shape) for w in matched] == shapes:
                return matched
        if [tuple(w.shape) for w in candidates] == shapes:
            return candidates
    raise EquivalenceInputError(_copy_mismatch(carried, values, paths))


def _copy_mismatch(copied, values, paths):
    """What to do when the check's copy of the model does not have the model's weights."""
    found = [w.path for w in copied]
    if len(copied) != len(values):
        what = f"has {len(copied)} weights against the model's {len(values)}"
        details = []
        if paths is not None:
            for kind, names in (
                ("more often in the copy", [p for p in found if found.count(p) > paths.count(p)]),
                ("missing from the copy", [p for p in paths if paths.count(p) > found.count(p)]),
            ):
                if names:
                    details.append(f"{kind}: {_listed(list(dict.fromkeys(names)))}")
    else:
        what = "has weights of other shapes than the model's"
        details = [
            f"{path} is {tuple(w.shape)} in the copy, {v.shape} in the model"
            for w, path, v in zip(copied, paths or found, values)
            if tuple(w.shape) != v.shape
        ]
        details = [_listed(details)] if details else []
    detail = f" ({'; '.join(details)})" if details else ""
    return (
        f"the check trains copies of the model, and its copy {what}{detail}. The copy is made "
        "with keras.models.clone_model, which builds each layer again from its get_config(): a "
        "layer whose get_config() leaves out an argument that shapes its weights (units, a "
        "vocabulary size), or that builds weights it does not need, is copied otherwise. Give "
        "each of your layers (and a subclassed model) a get_config() that returns every "
        "argument of its __init__, and a from_config() where an argument is a layer or a "
        "model, then check again."
    )


def _listed(names, shown=4):
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"{', '.join(names[:shown])}{more}"


def _seed_generators(layer):
    return [v for v in vars(layer).values() if isinstance(v, keras.random.SeedGenerator)]


@contextlib.contextmanager
def _tf32_off():
    """Inside, TF32 off; yields whether it was on, and puts it back on exit, even after an
    error (TF32 rounds float32 products to 10 mantissa bits on Ampere and newer GPUs)."""
    was_on = bool(tf.config.experimental.tensor_float_32_execution_enabled())
    if was_on:
        tf.config.experimental.enable_tensor_float_32_execution(False)
    try:
        yield was_on
    finally:
        if was_on:
            tf.config.experimental.enable_tensor_float_32_execution(True)


class _random_state_kept:
    """Python's and NumPy's global random state put back on exit (making layers draws seeds)."""

    def __enter__(self):
        self.python = random.getstate()
        self.numpy = np.random.get_state()

    def __exit__(self, *error):
        random.setstate(self.python)
        np.random.set_state(self.numpy)


# -- comparison ---------------------------------------------------------------------------------
def _compare(reference, trained, tolerance, start_values=()):
    """A VariableDifference per weight of ``reference`` (``start_values``: the weights both
    started from, in its order, for the size of the update)."""
    start_of = {}
    if len(start_values) == len(reference.weights):
        start_of = {w.path: value for w, value in zip(reference.weights, start_values)}
    layer_of = {}
    for layer in compat.sublayers(reference):
        for weight in layer.weights:
            layer_of.setdefault(weight.path, layer)
    trained_by_path = {w.path: w for w in trained.weights}
    if not all(w.path in trained_by_path for w in reference.weights):
        # A subclassed model's copy names its layers afresh: its weights pair up by position.
        values = [w.numpy() for w in reference.weights]
        trained_by_path = dict(
            zip((w.path for w in reference.weights), _matching_weights(trained, values))
        )
    differences = []
    for weight in reference.weights:
        other = trained_by_path.get(weight.path)
        if other is None:
            continue
        expected = np.asarray(weight.numpy(), dtype=np.float64)
        got = np.asarray(other.numpy(), dtype=np.float64)
        largest = float(np.max(np.abs(expected - got))) if expected.size else 0.0
        scale = max(1.0, float(np.max(np.abs(expected))) if expected.size else 1.0)
        layer = layer_of.get(weight.path)
        before = start_of.get(weight.path)
        update = 0.0
        if before is not None and expected.size and before.shape == expected.shape:
            update = float(np.max(np.abs(expected - before))) / scale
        differences.append(
            VariableDifference(
                name=weight.path,
                layer=layer.name if layer is not None else "?",
                kind=type(layer).__name__ if layer is not None else "?",
                max_abs_diff=largest,
                relative_diff=largest / scale,
                passed=largest / scale <= tolerance,
                update=update,
            )
        )
    return differences
