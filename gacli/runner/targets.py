"""What the user brings by Hydra's ``_target_``, found, called and checked before training.

A section (``model=own``, ``dataset=own``, ``optimizer=own``, ``loss``) or an entry of ``metrics``
or ``callbacks`` names a class or function by its import path in ``_target_``; the section's
other keys are its arguments (docs/guides/own-model.md). :func:`build` imports the target, checks
the arguments against its signature, fills in what ga-train knows where the target takes it and
the config does not give it (``input_shape``, ``num_outputs`` ...), calls it through
``hydra.utils.instantiate`` (so an argument may itself be a ``_target_``) and checks that it
returned the kind of object the key needs. Each failure is one :class:`~gacli.errors.ConfigError`
that names the key, what came back and what to write instead; nothing has trained yet.
"""

import dataclasses
import difflib
import importlib
import inspect
from typing import Callable

import keras
from omegaconf import OmegaConf

from gacli.errors import ConfigError
from gacli.runner.config import EXAMPLE_TARGETS, OWN_SECTION_KEYS


@dataclasses.dataclass(frozen=True)
class Kind:
    """What a key's target must return.

    Args:
        what: its name in a message, e.g. "a keras.Model".
        accepts: whether a returned object is one.
        instead: what to return instead, said when something else came back.

    Example:
        >>> MODEL.accepts(keras.Sequential())
        True
    """

    what: str
    accepts: Callable[[object], bool]
    instead: str


def _is_optimizer(made):
    from gacli.engine.accumulation import GradientAccumulateOptimizer

    return isinstance(made, keras.optimizers.Optimizer) and not isinstance(
        made, GradientAccumulateOptimizer
    )


MODEL = Kind(
    "a keras.Model",
    lambda made: isinstance(made, keras.Model),
    "return a model: keras.Sequential([...]), keras.Model(inputs, outputs) or an instance of a "
    "keras.Model subclass (built or not)",
)
OPTIMIZER = Kind(
    "a Keras optimizer",
    _is_optimizer,
    "return a plain keras.optimizers.Optimizer such as keras.optimizers.Lion(learning_rate); "
    "ga-train wraps it for accumulation itself",
)
LOSS = Kind(
    "a Keras loss",
    lambda made: (
        isinstance(made, keras.losses.Loss) or (callable(made) and not isinstance(made, type))
    ),
    "return a keras.losses.Loss (e.g. keras.losses.Huber(delta=1.0)) or a function of "
    "(y_true, y_pred)",
)
METRIC = Kind(
    "a Keras metric",
    lambda made: isinstance(made, keras.metrics.Metric),
    "return a keras.metrics.Metric, e.g. keras.metrics.MeanAbsoluteError(name='mae'), or give "
    "a metric's name as a string (metrics=[mae])",
)
CALLBACK = Kind(
    "a Keras callback",
    lambda made: isinstance(made, keras.callbacks.Callback),
    "return an instance of a keras.callbacks.Callback subclass",
)
# What a dataset target returns is checked by gacli.runner.data, which says what each part is.
ANYTHING = Kind("anything", lambda made: True, "")


def locate(key, path):
    """The object at ``path`` (``package.module.name``); ConfigError naming ``key`` when it
    cannot be imported."""
    parts = path.split(".")
    module, end = None, len(parts)
    for end in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:end])
        try:
            module = importlib.import_module(name)
            break
        except ModuleNotFoundError as missing:
            if missing.name and name != missing.name and not name.startswith(missing.name + "."):
                raise ConfigError(
                    f"{key}={path} cannot be imported: importing {name} needs the module "
                    f"{missing.name}, which is not installed. Install it where ga-train runs, "
                    f"or drop that import from {name}."
                ) from missing
        except Exception as failure:  # the user's module raised while it was being imported
            raise ConfigError(
                f"{key}={path} cannot be imported: importing {name} raised "
                f"{type(failure).__name__}: {_first_line(failure)}. Fix that module; "
                "HYDRA_FULL_ERROR=1 shows where it raised."
            ) from failure
    if module is None:
        raise ConfigError(
            f"{key}={path} cannot be imported: there is no module {parts[0]} where ga-train "
            "runs. Give the full import path of a class or function, package.module.name (e.g. "
            f"{key}=my_pkg.nets.Net), of a package that is installed (pip install -e .) or on "
            "PYTHONPATH."
        )
    found = module
    for index in range(end, len(parts)):
        owner = ".".join(parts[:index])
        if not hasattr(found, parts[index]):
            names = [name for name in dir(found) if not name.startswith("_")]
            near = difflib.get_close_matches(parts[index], names, n=1)
            hint = f"did you mean {key}={owner}.{near[0]}? " if near else ""
            raise ConfigError(
                f"{key}={path} cannot be imported: {owner} has no {parts[index]!r}; {hint}"
                f"Give the full import path of a class or function in {owner} or another module."
            )
        found = getattr(found, parts[index])
    return found


def build(where, values, kind, fill=None):
    """What the target of ``values`` (a dict: ``_target_`` and its arguments) returns, called
    with the arguments and ``fill``'s values for the parameters it takes by name and ``values``
    does not give; ``where``: the key of the section or entry (``model``, ``metrics[0]``)."""
    key = f"{where}._target_"
    path = str(values["_target_"])
    target = locate(key, path)
    if not callable(target):
        raise ConfigError(
            f"{key}={path} is {described(target)}, not a class or function, so it cannot be "
            f"called; name a class or function that returns {kind.what}."
        )
    arguments = {name: value for name, value in values.items() if name != "_target_"}
    parameters = _parameters(target)
    filled = {
        name: value
        for name, value in (fill or {}).items()
        if name in parameters.named and name not in arguments
    }
    _check_arguments(where, path, parameters, arguments, filled)
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        # An argument that is itself a _target_ is built here; the filled values (data shapes,
        # schedules) go in as they are, not through OmegaConf.
        call = instantiate({"_target_": path, **arguments}, _partial_=True, _convert_="all")
        made = call(**filled)
    except InstantiationException as failure:
        cause = failure.__cause__ or failure
        raise ConfigError(
            f"{key}={path}: an argument's _target_ failed ({type(cause).__name__}: "
            f"{_first_line(cause)}); fix that argument of {where}."
        ) from failure
    except Exception as failure:  # the user's code raised: its message, then what to do
        called = ", ".join(f"{n}={_short(v)}" for n, v in {**arguments, **filled}.items())
        raise ConfigError(
            f"{key}={path} raised {type(failure).__name__}: {_first_line(failure)} (called with "
            f"{called or 'no arguments'}). Fix the arguments ({where}.<name>=...) or the code; "
            "HYDRA_FULL_ERROR=1 shows where it raised."
        ) from failure
    if not kind.accepts(made):
        raise ConfigError(
            f"{key}={path} returned {described(made)}, not {kind.what}; {kind.instead}."
        )
    return made


@dataclasses.dataclass(frozen=True)
class _Parameters:
    named: frozenset  # the parameters it takes by name
    required: tuple  # those without a default
    any_keyword: bool  # it takes **kwargs
    known: bool  # the signature could be read


def _parameters(target):
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # some builtins have none: nothing is checked or filled
        return _Parameters(frozenset(), (), True, False)
    by_name = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    named = [p for p in signature.parameters.values() if p.kind in by_name]
    return _Parameters(
        frozenset(p.name for p in named),
        tuple(p.name for p in named if p.default is inspect.Parameter.empty),
        any(p.kind == inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()),
        True,
    )


def _check_arguments(where, path, parameters, arguments, filled):
    """ConfigError for an argument the target does not take, or one it needs and lacks."""
    if not parameters.known:
        return
    unknown = sorted(set(arguments) - parameters.named)
    if unknown and not parameters.any_keyword:
        near = difflib.get_close_matches(unknown[0], sorted(parameters.named), n=1)
        takes = ", ".join(sorted(parameters.named)) or "no arguments"
        raise ConfigError(
            f"{where}.{unknown[0]} is not an argument of {where}._target_={path}, which takes "
            f"{takes}; "
            + (f"did you mean {where}.{near[0]}? " if near else "")
            + f"Drop {where}.{unknown[0]}, or give the target an argument of that name."
        )
    missing = [name for name in parameters.required if name not in {**arguments, **filled}]
    if missing:
        raise ConfigError(
            f"{where}._target_={path} needs the argument {missing[0]}, which is not given; add "
            f"{where}.{missing[0]}=... (or give {missing[0]} a default in its definition)."
        )


def own_arguments(section, group):
    """The ``_target_`` of an own section and its arguments: the keys that are set (not null),
    but those ga-train reads itself; ``model.kwargs`` are arguments too."""
    values = OmegaConf.to_container(section, resolve=True, enum_to_str=True)
    if not values.get("_target_"):
        raise ConfigError(
            f"{group}=own builds your own {group} from {group}._target_, which is not set; give "
            f"it, e.g. {group}._target_={EXAMPLE_TARGETS[group]} (docs/guides/own-model.md)."
        )
    arguments = {
        name: value
        for name, value in values.items()
        if name not in OWN_SECTION_KEYS[group] and value is not None
    }
    if group == "model":
        arguments.update(values.get("kwargs") or {})
    return {"_target_": values["_target_"], **arguments}


def build_loss(section):
    """The ``loss`` section's loss, or None where it names none (the task's is used)."""
    if section is None or section.get("_target_") is None:
        return None
    return build("loss", own_arguments(section, "loss"), LOSS)


def build_metrics(entries):
    """The ``metrics`` list as Keras compiles it: names as they are, targets built."""
    return [
        entry
        if isinstance(entry, str)
        else build(f"metrics[{index}]", OmegaConf.to_container(entry, resolve=True), METRIC)
        for index, entry in enumerate(entries)
    ]


def build_callbacks(entries):
    """The user's callbacks of the ``callbacks`` list, built."""
    return [
        build(f"callbacks[{index}]", OmegaConf.to_container(entry, resolve=True), CALLBACK)
        for index, entry in enumerate(entries or [])
    ]


def described(value):
    """'None', 'a list', or 'a Dense (from <the module that defines it>)' for a value."""
    if value is None:
        return "None"
    kind = type(value)
    article = "an" if kind.__name__[:1].lower() in "aeiou" else "a"
    origin = "" if kind.__module__ == "builtins" else f" (from {kind.__module__})"
    return f"{article} {kind.__name__}{origin}"


def _first_line(error):
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:300]


def _short(value):
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
