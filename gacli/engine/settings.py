"""``AccumulationConfig``: every accumulation setting, declared and validated once.

Both model wrappers, ``wrap_model``, ``GradientAccumulateOptimizer`` and ``ga-train`` build one
and read their settings from it; ``get_config`` of each writes :meth:`AccumulationConfig.to_dict`
and ``from_config`` reads it back. No TensorFlow import here.
"""

import dataclasses
import difflib
import inspect
import numbers

from gacli.engine.options import (
    LossNormalization,
    NonFinite,
    PartialWindow,
    Reduction,
    parse_option,
)

_FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")

# remat: each block of a functional model (gacli/engine/remat.py).
EVERY = "every"


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


def _positive(value, name, example):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ValueError(f"{name}={value!r} must be a number > 0, e.g. {name}={example}.")
    return value


def parse_remat(value):
    """``remat`` as stored: None (off), ``"every"``, an int >= 1 or a tuple of layer names; a
    ValueError that says what to pass for anything else."""
    if isinstance(value, str) and value.lower() in ("off", "none", "false"):
        return None
    if value is None or value is False:
        return None
    if value is True or (isinstance(value, str) and value.lower() == EVERY):
        return EVERY
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        if value < 1:
            raise ValueError(remat_choices(value))
        return EVERY if value == 1 else int(value)
    if isinstance(value, str) and value.strip():
        return (value,)  # one layer's name
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        return tuple(dict.fromkeys(value))
    raise ValueError(remat_choices(value))


def remat_choices(value):
    return (
        f"remat={value!r} is not a choice of blocks to recompute. Pass remat='every' (each block "
        "of a functional or Sequential model), remat=n (runs of n consecutive blocks, e.g. "
        "remat=2), remat=['layer_name', ...] (named layers of any model, e.g. a subclassed "
        "model's or a KerasHub backbone's transformer layers) or remat=None (off, the default)."
    )


@dataclasses.dataclass(frozen=True)
class AccumulationConfig:
    """How gradients are accumulated.

    Args:
        accum_steps: micro-batches per optimizer update (>= 1).
        reduction: ``"mean"`` (the big batch's gradient) or ``"sum"`` (the older package's SUM).
        use_agc: adaptive gradient clipping of the window's gradient.
        clip_factor: AGC's largest ratio of unit gradient norm to unit parameter norm.
        eps: AGC's floor on the parameter norm.
        partial_window: ``"apply"``, ``"drop"`` or ``"carry"``: a window that is not full at an
            epoch's end.
        accumulator_dtype: dtype of the gradient sums (float32 whatever the compute dtype).
        loss_scaling: dynamic loss scaling for float16. ``None``: on under the
            ``mixed_float16`` policy (the model's; for the optimizer, the global policy when it is
            created).
        initial_scale: the first loss scale.
        dynamic_growth_steps: updates without an overflow after which the scale doubles.
        nonfinite: ``"stop"``, ``"skip_micro_batch"`` or ``"skip_window"``: a micro-batch whose
            gradient holds an inf or nan. ``None``: ``skip_micro_batch`` with loss scaling,
            otherwise unchecked.
        loss_normalization: ``"batch"`` or ``"window_weights"`` (model wrappers only): what the
            window's loss is divided by.
        noise_scale: measure the gradient noise scale from the micro-batches
            (:class:`gacli.engine.window.NoiseScale`): one squared norm per micro-batch.
        noise_scale_every: measure it on every ``n``-th window only (its micro-batches and its
            whole), by the optimizer's update count: the others' squared norms are not computed
            (the conditional that skips them still costs a little without XLA).
        noise_scale_decay: the decay of its moving averages, per measured window.
        remat: recompute activations in the backward pass instead of keeping them (model
            wrappers only; :func:`gacli.recompute` for other models): ``None`` (off),
            ``"every"`` (each block of a functional or Sequential model), ``n`` (runs of ``n``
            blocks) or a tuple of layer names (each named layer one block). No number changes.
    """

    accum_steps: int = 1
    reduction: Reduction = Reduction.mean
    use_agc: bool = False
    clip_factor: float = 0.01
    eps: float = 1e-3
    partial_window: PartialWindow = PartialWindow.apply
    accumulator_dtype: str = "float32"
    loss_scaling: bool | None = None
    initial_scale: float = 2.0**15
    dynamic_growth_steps: int = 2000
    nonfinite: NonFinite | None = None
    loss_normalization: LossNormalization = LossNormalization.batch
    noise_scale: bool = False
    noise_scale_every: int = 1
    noise_scale_decay: float = 0.95
    remat: str | int | tuple | None = None

    def __post_init__(self):
        def set_(name, value):
            object.__setattr__(self, name, value)

        set_("accum_steps", validate_accum_steps(self.accum_steps))
        set_("reduction", parse_option(Reduction, self.reduction, "reduction"))
        set_("partial_window", parse_option(PartialWindow, self.partial_window, "partial_window"))
        set_(
            "loss_normalization",
            parse_option(LossNormalization, self.loss_normalization, "loss_normalization"),
        )
        if self.nonfinite is not None:
            set_("nonfinite", parse_option(NonFinite, self.nonfinite, "nonfinite"))
        set_("use_agc", bool(self.use_agc))
        set_("clip_factor", float(_positive(self.clip_factor, "clip_factor", 0.01)))
        set_("eps", float(_positive(self.eps, "eps", 1e-3)))
        set_("initial_scale", float(_positive(self.initial_scale, "initial_scale", 2.0**15)))
        steps = self.dynamic_growth_steps
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
            raise ValueError(
                f"dynamic_growth_steps={steps!r} must be a whole number >= 1, e.g. 2000."
            )
        set_("dynamic_growth_steps", int(steps))
        if self.loss_scaling is not None:
            set_("loss_scaling", bool(self.loss_scaling))
        dtype = str(getattr(self.accumulator_dtype, "name", self.accumulator_dtype))
        if dtype not in _FLOAT_DTYPES:
            raise ValueError(
                f"accumulator_dtype={self.accumulator_dtype!r} is not a float dtype; use "
                "accumulator_dtype='float32' (the default)."
            )
        set_("accumulator_dtype", dtype)
        set_("noise_scale", bool(self.noise_scale))
        decay = self.noise_scale_decay
        if isinstance(decay, bool) or not isinstance(decay, numbers.Real) or not 0 <= decay < 1:
            raise ValueError(
                f"noise_scale_decay={decay!r} must be in [0, 1), e.g. noise_scale_decay=0.95."
            )
        set_("noise_scale_decay", float(decay))
        every = self.noise_scale_every
        if isinstance(every, bool) or not isinstance(every, numbers.Integral) or every < 1:
            raise ValueError(
                f"noise_scale_every={every!r} must be a whole number >= 1 (windows between "
                "measurements), e.g. noise_scale_every=4."
            )
        set_("noise_scale_every", int(every))
        set_("remat", parse_remat(self.remat))
        if self.noise_scale and self.reduction is Reduction.sum:
            raise ValueError(
                "noise_scale compares mean gradients of two batch sizes; reduction='sum' gives "
                "none. Use reduction='mean' (the default) with noise_scale=True."
            )
        if self.reduction is Reduction.sum and (
            self.loss_normalization is not LossNormalization.batch
        ):
            raise ValueError(
                "loss_normalization='window_weights' divides the window's loss by its weight; "
                "reduction='sum' adds micro-batch gradients as they are. Use one of them."
            )

    @classmethod
    def fields(cls):
        """The setting names, in declaration order."""
        return tuple(field.name for field in dataclasses.fields(cls))

    @classmethod
    def from_kwargs(cls, config=None, **settings):
        """``config`` (an AccumulationConfig or its dict) with ``settings`` set on top; unknown
        names raise a TypeError that names the nearest setting and lists them all."""
        refuse_unknown_keywords("AccumulationConfig", settings, cls.fields())
        if config is None:
            return cls(**settings)
        if isinstance(config, dict):
            config = cls(**config)
        return dataclasses.replace(config, **settings) if settings else config

    @classmethod
    def given(cls, config=None, **settings):
        """:meth:`from_kwargs` with the settings that were given: ``None`` means "not given" (the
        wrappers' arguments default to None, and this dataclass holds the defaults)."""
        return cls.from_kwargs(
            config, **{name: value for name, value in settings.items() if value is not None}
        )

    def replace(self, **settings):
        refuse_unknown_keywords("AccumulationConfig.replace()", settings, self.fields())
        return dataclasses.replace(self, **settings)

    def for_policy(self, policy_name):
        """These settings with the defaults that follow the dtype policy filled in: loss
        scaling on under ``mixed_float16``, and with loss scaling, ``nonfinite="skip_micro_batch"``
        (an overflow there is routine). A model wrapper passes its model's policy; an optimizer
        made on its own, the global policy as it is made (the only one it can know)."""
        config = self
        if config.loss_scaling is None:
            config = config.replace(loss_scaling=policy_name == "mixed_float16")
        if config.nonfinite is None and config.loss_scaling:
            config = config.replace(nonfinite=NonFinite.skip_micro_batch)
        return config

    def to_dict(self):
        """Plain values (strings for the choices): what ``get_config`` stores."""
        return {
            name: list(value) if isinstance(value, tuple) else getattr(value, "value", value)
            for name, value in ((name, getattr(self, name)) for name in self.fields())
        }


# gradient-accumulator's name of a setting, beside AccumulationConfig's own (its README writes
# GradientAccumulateModel(accum_steps=4, agc=True, ...)).
OLDER_SETTING_NAMES = ("agc",)


def keyword_names(*functions):
    """The names ``functions`` take by keyword (their ``**kwargs`` aside), in order, once each."""
    names = {}
    for function in functions:
        for parameter in inspect.signature(function).parameters.values():
            if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY):
                names.setdefault(parameter.name)
    names.pop("self", None)
    return tuple(names)


def refuse_unknown_keywords(called, given, accepted):
    """Raise a TypeError, as Python does for a keyword a function does not take, when ``given``
    (keyword arguments, or their names) holds a name not in ``accepted``: it names each such
    keyword with the accepted name nearest to it, and lists the accepted ones. ``called``: what
    was called, as the user wrote it (``"wrap_model()"``). A constructor that forwards
    ``**kwargs`` would otherwise take a misspelt setting (``use_acg=True``) and do nothing."""
    accepted = tuple(dict.fromkeys(accepted))
    unknown = [name for name in given if name not in accepted]
    if not unknown:
        return
    named = []
    for name in unknown:
        near = difflib.get_close_matches(name, accepted, n=1)
        named.append(f"{name!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    plural = "s" if len(unknown) > 1 else ""
    raise TypeError(
        f"{called} got an unexpected keyword argument{plural} {', '.join(named)}. It takes "
        f"{', '.join(sorted(accepted))}."
    )


def take_agc_alias(settings, agc):
    """``settings`` with ``agc``, the older package's name of ``use_agc``, folded in."""
    if agc is not None:
        if settings.get("use_agc") not in (None, agc):
            raise ValueError("agc and use_agc are the same setting; pass one of them.")
        settings["use_agc"] = agc
    return settings


def pop_settings(kwargs):
    """Pop the accumulation settings, and the ``agc`` alias, out of a constructor's
    ``**kwargs``."""
    settings = {name: kwargs.pop(name) for name in AccumulationConfig.fields() if name in kwargs}
    return take_agc_alias(settings, kwargs.pop("agc", None))


def settings_as_attributes(attribute):
    """Class decorator: every :class:`AccumulationConfig` setting can be read as an attribute of
    the instances (``model.accum_steps``, the older package's names), from the
    AccumulationConfig they hold in ``attribute``; a name the class defines itself is left to it.
    """

    def setting(name):
        return property(lambda self: getattr(getattr(self, attribute), name))

    def decorate(cls):
        for name in AccumulationConfig.fields():
            if not hasattr(cls, name):
                setattr(cls, name, setting(name))
        return cls

    return decorate


def shows_config_defaults(function):
    """Decorator: ``function``'s signature shows :class:`AccumulationConfig`'s default for each
    setting it takes as ``None`` (which means "the default"), so ``help()`` and editors show
    ``accum_steps=1`` while the value itself is declared only in the dataclass."""
    signature = inspect.signature(function)
    defaults = {field.name: field.default for field in dataclasses.fields(AccumulationConfig)}
    parameters = [
        parameter.replace(
            default=getattr(defaults[parameter.name], "value", defaults[parameter.name])
        )
        if parameter.name in defaults and parameter.default is None
        else parameter
        for parameter in signature.parameters.values()
    ]
    function.__signature__ = signature.replace(parameters=parameters)
    return function
