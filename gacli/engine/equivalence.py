"""``check_equivalence``: does one accumulated window equal one big-batch update on *your* model?

gacli's own tests prove exactness on the project's models (``docs/contract.md``, E1 and E2). This
module answers the same question for a user's model and data: from the same weights and optimizer
state it applies (a) one gacli update over ``accum_steps`` micro-batches and (b) one plain-Keras
``train_on_batch`` over the same samples as one batch, on one device, and compares every weight.
Both run on copies (clones) of the model and optimizer: the user's model, optimizer and random
state are left as they were. When they differ it says which layers, grouped by the kind of cause:
batch normalisation, dropout and other random layers, a loss normalised per call, a custom
``train_step``. ``docs/guides/equivalence-check.md`` shows it in use.
"""

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
    accumulation_callbacks,
    wrap_model,
)
from gacli.engine.accumulation import GradientAccumulateOptimizer, find_accumulating_optimizer
from gacli.engine.batchnorm import accum_batchnorm_layers, apply_batchnorm_policy
from gacli.engine.options import BatchNormPolicy, parse_option
from gacli.engine.settings import AccumulationConfig

# The contract's tolerances (docs/contract.md, E1): float32 round-off after one update. Adaptive
# optimizers divide by the root of the second moment, which magnifies round-off.
SGD_TOLERANCE = 1e-6
ADAPTIVE_TOLERANCE = 1e-5
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
        passed: every weight within ``tolerance``.
        max_abs_diff: the largest absolute difference over all weights.
        variables: one :class:`VariableDifference` per weight.
        tolerance: the relative difference allowed, and ``tolerance_source`` where it came from.
        causes: when it failed, the kinds of layer or code responsible (:class:`Cause`).
        window: samples, accum_steps, micro_batch_size, replicas and wrapper of the check.

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
        x: the inputs (an array), or a ``tf.data.Dataset`` of (inputs, targets), batched or not.
        y: the targets (an array); None with a dataset.
        **settings: :class:`EquivalenceSettings`: ``accum_steps``, ``micro_batch_size``,
            ``optimizer``, ``loss``, ``wrapper``, ``tolerance``, ``strategy``, ``batchnorm``,
            ``window_samples``, ``explain``.

    Returns:
        An :class:`EquivalenceResult`.

    Example:
        >>> result = gacli.check_equivalence(model, x, y, accum_steps=4, micro_batch_size=16)
        >>> print(result)
    """
    unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(EquivalenceSettings)})
    if unknown:
        raise TypeError(
            f"check_equivalence() got unknown settings {unknown}; it takes "
            f"{[f.name for f in dataclasses.fields(EquivalenceSettings)]}."
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
        self.base, self.optimizer, self.loss, self.wrapper, accum = _unwrap(model, settings)
        self.accum_steps = settings.accum_steps or accum
        self.strategy = settings.strategy or tf.distribute.get_strategy()
        self.replicas = self.strategy.num_replicas_in_sync
        _check_numbers(self)
        self.batchnorm = parse_option(BatchNormPolicy, settings.batchnorm or "keep", "batchnorm")
        self.tolerance, self.tolerance_source = _tolerance(settings.tolerance, self.optimizer)
        full = settings.micro_batch_size * self.accum_steps * self.replicas
        self.samples = settings.window_samples or full
        self.x, self.y = _window(x, y, self.samples, full)

    @property
    def global_micro_batch_size(self):
        return self.settings.micro_batch_size * self.replicas

    def run(self):
        with _random_state_kept():
            self.base = self._with_model_policy(self.base)
            start = _Start.of(self.base, self.optimizer)
            variables, trained = self._comparison(start)
            result = EquivalenceResult(
                passed=all(v.passed for v in variables),
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
            if not result.passed and self.settings.explain:
                result.causes = self._causes(start, result, trained)
        return result

    def _comparison(self, start, neutralise=False):
        """(a VariableDifference per weight, the gacli-trained model)."""
        reference, trained = self._two_updates(start, neutralise)
        variables = _compare(reference, trained, self.tolerance)
        if not isinstance(self.optimizer, keras.optimizers.SGD):
            # Adam's first update keeps little more than each gradient's sign: the window's
            # gradient itself is compared too, through SGD with learning rate 1.
            gradients = _compare(
                *self._two_updates(start, neutralise, gradient=True), self.tolerance
            )
            for variable, gradient in zip(variables, gradients):
                variable.gradient_diff = gradient.relative_diff
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

    def _reference(self, start, neutralise, gradient):
        """Plain Keras' update over the window as one batch, on one device."""
        with tf.distribute.OneDeviceStrategy(_first_device()).scope():
            model = self._prepare(start, neutralise, gacli_side=False)
            optimizer, state = self._optimizer_copy(start, gradient)
            model.compile(optimizer=optimizer, loss=self.loss, jit_compile=False)
            optimizer.build(model.trainable_variables)
            if state is not None:
                state.put_optimizer_state(optimizer)
        if any(isinstance(layer, keras.layers.Embedding) for layer in compat.sublayers(model)):
            _dense_gradient_step(model, self.x, self.y)
        else:
            model.train_on_batch(self.x, self.y)
        return model

    def _accumulated(self, start, neutralise, gradient):
        config = AccumulationConfig(accum_steps=self.accum_steps, partial_window="apply")
        with self.strategy.scope():
            model = self._prepare(start, neutralise, gacli_side=True)
            inner, state = self._optimizer_copy(start, gradient)
            if self.wrapper == "model":
                trainer = wrap_model(model, config=config)
                trainer.compile(optimizer=inner, loss=self.loss, jit_compile=False)
            else:
                trainer = model
                trainer.compile(
                    optimizer=GradientAccumulateOptimizer(inner, config=config),
                    loss=self.loss,
                    jit_compile=False,
                )
            accumulator = find_accumulating_optimizer(trainer.optimizer)
            accumulator.build(trainer.trainable_variables)
            if state is not None:
                state.put_optimizer_state(inner)
        trainer.fit(
            self.x,
            self.y,
            batch_size=self.global_micro_batch_size,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=accumulation_callbacks(accumulator),
        )
        return model

    # -- why it failed ----------------------------------------------------------------------------
    def _causes(self, start, result, trained):
        causes = []
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
                    "no batch normalisation, random layer, per-call loss or custom train_step was "
                    "found. Look at what these layers compute from the whole batch (a per-batch "
                    "sum, a count, a statistic), or at regularisation losses computed per call.",
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

    def _loss_gap(self):
        """A Cause when the loss of the window is not the sample-weighted mean of its micro-batch
        losses (a loss normalised per call: by its own token count, a per-batch sum, ...)."""
        if not callable(self.loss) and not isinstance(self.loss, str):
            return None  # one loss per output: not measured
        model = _clone(self.base)
        _Start.of(self.base, None).put_weights(model)
        loss = keras.losses.get(self.loss) if isinstance(self.loss, str) else self.loss
        whole = float(np.mean(loss(self.y, model(self.x, training=False))))
        size = self.global_micro_batch_size
        weighted = 0.0
        for first in range(0, self.samples, size):
            part = slice(first, min(first + size, self.samples))
            count = part.stop - part.start
            weighted += count * float(
                np.mean(loss(self.y[part], model(self.x[part], training=False)))
            )
        weighted /= self.samples
        gap = abs(whole - weighted) / max(abs(whole), 1e-12)
        if gap <= self.tolerance:
            return None
        return Cause(
            "loss normalised per call",
            [getattr(loss, "name", None) or getattr(loss, "__name__", type(loss).__name__)],
            f"the loss of the whole window ({whole:.6g}) is not the sample-weighted mean of its "
            f"micro-batches' losses ({weighted:.6g}; relative gap {gap:.2g}): the loss divides by "
            "something of its own call (a count of tokens or items, a per-batch sum), so a "
            "micro-batch is weighted by that and not by its samples. Return the mean over samples "
            "(Keras' sum_over_batch_size), or pass the mask as sample_weight with "
            "loss_normalization='window_weights' to divide by the whole window's count.",
        )


_EXACT_BATCHNORM = (
    "batchnorm=freeze (inference mode, for fine-tuning) or batchnorm=group_norm "
    "(GroupNormalization, no batch statistics) make the update exact."
)


def _dense_gradient_step(model, x, y):
    """One big-batch step with every gradient dense. An embedding's gradient is a
    tf.IndexedSlices with a row per occurrence, and Keras' sparse Adam path squares each
    occurrence apart, which is not the gradient of any loss; the reference is the big batch with
    each row's occurrences summed, which is the dense gradient (docs/contract.md, E5)."""
    variables = model.trainable_variables
    with tf.GradientTape() as tape:
        y_pred = model(x, training=True)
        loss = model.compute_loss(x=x, y=y, y_pred=y_pred)
    gradients = [
        tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
        for g in tape.gradient(loss, variables)
    ]
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
    """(plain model, inner optimizer, loss, wrapper, accum_steps) of what the user gave."""
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
    accum = accumulator.accum_steps if accumulator is not None else None
    wrapper = settings.wrapper or ("optimizer" if accumulator is not None else "model")
    if isinstance(model, AccumulationMixin):
        wrapper = settings.wrapper or "model"
        accum = model.accum_steps
        if isinstance(model, AccumulatingModelWrapper):
            base = model.model
        else:
            base = keras.Model(model.inputs, model.outputs, name=model.name)
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
    return base, optimizer, loss, wrapper, accum


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


def _window(x, y, samples, full):
    """(inputs, targets) of the window's first ``samples`` samples, as NumPy arrays."""
    if isinstance(x, tf.data.Dataset):
        dataset = x
        if _is_batched(dataset):
            dataset = dataset.unbatch()
        pairs = list(dataset.take(samples).as_numpy_iterator())
        if pairs and not isinstance(pairs[0], tuple):
            raise EquivalenceInputError(
                "the dataset must yield (inputs, targets) pairs, batched or not."
            )
        x = np.stack([pair[0] for pair in pairs]) if pairs else np.zeros((0,))
        y = np.stack([pair[1] for pair in pairs]) if pairs else np.zeros((0,))
    elif x is None or y is None:
        raise EquivalenceInputError(
            "give the data as x and y (arrays), or x as a tf.data.Dataset of (inputs, targets)."
        )
    x, y = np.asarray(x), np.asarray(y)
    if samples > full or samples < 1:
        raise EquivalenceInputError(
            f"window_samples={samples} must be between 1 and one full window, {full} samples."
        )
    if len(x) < samples or len(y) < samples:
        raise EquivalenceInputError(
            f"the data holds {min(len(x), len(y))} samples, fewer than one window of {samples} "
            "(micro_batch_size x accum_steps x replicas). Give at least that many samples, or a "
            "smaller accum_steps or micro_batch_size."
        )
    return x[:samples], y[:samples]


def _is_batched(dataset):
    spec = tf.nest.flatten(dataset.element_spec)[0]
    return len(spec.shape) > 0 and spec.shape[0] is None


# -- copies and state ---------------------------------------------------------------------------
def _clone(model):
    """A new model of the same layers (same names and config), fresh uncompiled weights."""
    with compat.compile_state_hidden(model):
        return keras.models.clone_model(model)


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

    @classmethod
    def of(cls, model, optimizer):
        seeds = [
            [generator.state.numpy() for generator in _seed_generators(layer)]
            for layer in compat.sublayers(model)
        ]
        state = []
        if optimizer is not None and optimizer.built:
            state = [variable.numpy() for variable in optimizer.variables]
        return cls([w.numpy() for w in model.weights], seeds, state)

    def put_weights(self, model):
        for variable, value in zip(_matching_weights(model, self.weights), self.weights):
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


def _matching_weights(model, values):
    weights = model.weights
    if [tuple(w.shape) for w in weights] == [v.shape for v in values]:
        return weights
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
    matched = [w for w in weights if id(w) not in window_state]
    if [tuple(w.shape) for w in matched] != [v.shape for v in values]:
        raise EquivalenceInputError("the model's copy does not have the model's weights.")
    return matched


def _seed_generators(layer):
    return [v for v in vars(layer).values() if isinstance(v, keras.random.SeedGenerator)]


class _random_state_kept:
    """Python's and NumPy's global random state put back on exit (making layers draws seeds)."""

    def __enter__(self):
        self.python = random.getstate()
        self.numpy = np.random.get_state()

    def __exit__(self, *error):
        random.setstate(self.python)
        np.random.set_state(self.numpy)


# -- comparison ---------------------------------------------------------------------------------
def _compare(reference, trained, tolerance):
    layer_of = {}
    for layer in compat.sublayers(reference):
        for weight in layer.weights:
            layer_of.setdefault(weight.path, layer)
    trained_by_path = {w.path: w for w in trained.weights}
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
        differences.append(
            VariableDifference(
                name=weight.path,
                layer=layer.name if layer is not None else "?",
                kind=type(layer).__name__ if layer is not None else "?",
                max_abs_diff=largest,
                relative_diff=largest / scale,
                passed=largest / scale <= tolerance,
            )
        )
    return differences
