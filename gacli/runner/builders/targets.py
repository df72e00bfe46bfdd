"""What the user brings by Hydra's ``_target_``, found, called and checked before training.

A section (``model=own``, ``dataset=own``, ``optimizer``, ``loss``) or an entry of ``metrics``
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
import functools
import importlib
import inspect
import os
import re
import sys
from typing import Callable

import keras
import tensorflow as tf
from omegaconf import OmegaConf

from gacli.errors import ConfigError, first_line
from gacli.runner.config.arguments import check_arguments, parameters_of, section_arguments
from gacli.runner.config.schema import EXAMPLE_TARGETS, is_own


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


def _is_plain_model(made):
    from gacli.engine.accumulate_model import AccumulatingModelWrapper, GradientAccumulateModel

    wrapped = (AccumulatingModelWrapper, GradientAccumulateModel)
    return isinstance(made, keras.Model) and not isinstance(made, wrapped)


MODEL = Kind(
    "a plain keras.Model",
    _is_plain_model,
    "return the plain Keras model: keras.Sequential([...]), keras.Model(inputs, outputs) or an "
    "instance of a keras.Model subclass (built or not), not one wrapped by gacli.wrap_model or "
    "a GradientAccumulateModel; ga-train wraps it for accumulation itself",
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
# What a dataset target returns is checked by gacli.runner.builders.data, which says what each part
# is.
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
                f"{type(failure).__name__}: {first_line(failure)}. Fix that module; "
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
    parameters = parameters_of(target)
    filled = {
        name: value
        for name, value in (fill or {}).items()
        if name in parameters.named and name not in arguments
    }
    check_arguments(where, path, parameters, arguments, filled)
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        # An argument that is itself a _target_ is built here; the filled values (data shapes,
        # schedules) go in as they are, not through OmegaConf.
        call = instantiate({"_target_": path, **arguments}, _partial_=True, _convert_="all")
        made = call(**filled)
    except (ConfigError, tf.errors.ResourceExhaustedError):
        # A shipped builder's own refusal (gacli.models), already in ga-train's words; out of
        # memory is the machine's, not the code's: the run says what does not fit.
        raise
    except InstantiationException as failure:
        cause = failure.__cause__ or failure
        raise ConfigError(
            f"{key}={path}: an argument's _target_ failed ({type(cause).__name__}: "
            f"{first_line(cause)}); fix that argument of {where}."
        ) from failure
    except Exception as failure:  # the user's code raised: its message, then what to do
        called = ", ".join(f"{n}={_short(v)}" for n, v in {**arguments, **filled}.items())
        raise ConfigError(
            f"{key}={path} raised {type(failure).__name__}: {first_line(failure)} (called with "
            f"{called or 'no arguments'}). Fix the arguments ({where}.<name>=...) or the code; "
            "HYDRA_FULL_ERROR=1 shows where it raised."
        ) from failure
    if not kind.accepts(made):
        raise ConfigError(
            f"{key}={path} returned {described(made)}, not {kind.what}; {kind.instead}."
        )
    return made


def build_loss(section):
    """The ``loss`` section's loss, or None where it names none (the task's is used). A target
    that is itself a loss function of ``(y_true, y_pred)`` is the loss, as Keras takes it; its
    other arguments, where given, are bound to it."""
    if section is None or section.get("_target_") is None:
        return None
    values = section_arguments(section, "loss")
    path = str(values["_target_"])
    target = locate("loss._target_", path)
    if not _is_loss_function(target):
        return build("loss", values, LOSS)
    arguments = {name: value for name, value in values.items() if name != "_target_"}
    parameters = parameters_of(target)
    taken = dataclasses.replace(
        parameters, required=tuple(n for n in parameters.required if n not in LOSS_ARGUMENTS)
    )
    given = [name for name in LOSS_ARGUMENTS if name in arguments]
    if given:
        raise ConfigError(
            f"loss.{given[0]} is not an argument to give: loss._target_={path} is a loss function, "
            "which Keras calls with y_true and y_pred at each step; drop "
            f"loss.{given[0]}."
        )
    check_arguments("loss", path, taken, arguments, {})
    if not arguments:
        return target
    return functools.update_wrapper(functools.partial(target, **arguments), target)


# The parameters Keras calls a loss function with, first and in this order.
LOSS_ARGUMENTS = ("y_true", "y_pred")


def _is_loss_function(target):
    """Whether ``target`` is a function (not a class) whose first parameters are y_true, y_pred."""
    if not inspect.isfunction(target):
        return False
    names = list(inspect.signature(target).parameters)
    return tuple(names[:2]) == LOSS_ARGUMENTS


def build_metrics(entries):
    """The ``metrics`` list as Keras compiles it: names checked and kept as they are, targets
    built."""
    return [
        _known_metric(f"metrics[{index}]", entry)
        if isinstance(entry, str)
        else build(f"metrics[{index}]", OmegaConf.to_container(entry, resolve=True), METRIC)
        for index, entry in enumerate(entries)
    ]


# The names compile() takes besides keras.metrics.get's: it picks the accuracy for the labels.
_COMPILE_METRIC_NAMES = ("accuracy", "acc")


def _known_metric(where, name):
    """``name`` when Keras' compile() knows it; else ConfigError with the nearest name (a
    misspelt name would otherwise fail only in the first training step)."""
    if name.lower() in _COMPILE_METRIC_NAMES or _metric_by_name(name):
        return name
    known = [*_COMPILE_METRIC_NAMES, *(n for n in dir(keras.metrics) if _metric_by_name(n))]
    if name == name.lower():  # snake_case names for a snake_case one, not their classes too
        known = [n for n in known if n == n.lower()]
    near = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean {near[0]}? Or give" if near else "give"
    raise ConfigError(
        f"{where} is {name}, which is not a metric Keras knows by name; {hint} a name "
        "such as accuracy, mae or auc (keras.metrics' classes and functions, in snake_case), or "
        f"an entry that builds one: {{_target_: {EXAMPLE_TARGETS['metrics']}}}."
    )


def _metric_by_name(name):
    if name.startswith("_"):
        return False
    try:
        return keras.metrics.get(name) is not None
    except (ValueError, TypeError):
        return False


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


def _short(value):
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def import_roots(config):
    """The folders the ``_target_`` modules of ``config`` (a plain dict) were imported from
    that a new shell does not search unless told: PYTHONPATH's entries and the working
    directory. To run the job again, PYTHONPATH must name them (``resolved.yaml`` keeps them, and
    ga-report's command sets them); empty where every target is of an installed package."""
    entries = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    searched = {os.path.realpath(entry) for entry in entries if entry}
    searched.add(os.path.realpath(os.getcwd()))
    roots = []
    for path in _target_paths(config):
        top = path.split(".")[0]
        module = sys.modules.get(top)
        if top == "gacli" or module is None:
            continue
        # The folder that holds the package's folder (or the module's file).
        places = list(getattr(module, "__path__", None) or [])
        if not places and getattr(module, "__file__", None):
            places = [module.__file__]
        for place in places:
            root = os.path.realpath(os.path.dirname(place))
            if root in searched and root not in roots:
                roots.append(root)
    return roots


def _target_paths(value):
    """Every ``_target_`` string in ``value``, a config as plain dicts and lists."""
    if isinstance(value, dict):
        if isinstance(value.get("_target_"), str):
            yield value["_target_"]
        for item in value.values():
            yield from _target_paths(item)
    elif isinstance(value, list):
        for item in value:
            yield from _target_paths(item)


def own_parts(cfg, model, loss, metrics):
    """(config key, object) of the parts of a job that its ``_target_``s built: the model, the
    loss and the metrics (``metrics``: as compiled, in the order of ``cfg.metrics``)."""
    parts = []
    if is_own(cfg.model):
        parts.append((f"model._target_={cfg.model._target_}", model))
    if OmegaConf.select(cfg, "loss._target_") is not None:
        parts.append((f"loss._target_={cfg.loss._target_}", loss))
    for index, (entry, metric) in enumerate(zip(cfg.get("metrics") or [], metrics)):
        if not isinstance(entry, str):
            parts.append((f"metrics[{index}]._target_={entry._target_}", metric))
    return tuple(parts)


def callback_parts(entries, callbacks):
    """(config key, callback) of the ``callbacks`` list's built callbacks."""
    return tuple(
        (f"callbacks[{index}]._target_={entry._target_}", callback)
        for index, (entry, callback) in enumerate(zip(entries or [], callbacks))
    )


def raised_by(error, parts):
    """(config key, what it raised) of the part of ``parts`` ((key, object) pairs) whose code
    raised ``error``, or None when none did. What it raised: the error's type and first line.

    An error in a loss, metric or callback raised while Keras traces a step (or calls a
    callback) reaches fit()'s caller as a Python exception whose traceback still holds the frame
    of the method (``call``, ``update_state``, ``on_train_batch_end``) or function that raised:
    of those that run a part, the innermost names it. One raised while the step runs (a
    tf.debugging assertion, a tf.py_function) is a TensorFlow error whose message lists where
    its operation was defined: the innermost of those lines in a part's source names it.
    """
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        found = None
        trace = error.__traceback__
        while trace is not None:
            for key, part in parts:
                if _runs(trace.tb_frame, part):
                    found = key
            trace = trace.tb_next
        if found is not None:
            return found, f"{type(error).__name__}: {first_line(error)}"
        frames, message = _defined_at(str(error))
        for file, line in reversed(frames):
            for key, part in parts:
                if _defines(part, file, line):
                    return key, f"{type(error).__name__}: {(message or first_line(error))[:300]}"
        error = error.__cause__ or error.__context__
    return None


# A frame of the "defined at (most recent call last):" list of a TensorFlow graph error.
_DEFINED_AT_FRAME = re.compile(r'\s*File "(?P<file>.+)", line (?P<line>\d+), in .+')


def _defined_at(text):
    """([(file, line), ...] where a graph error's operation was defined, outermost first; the
    first line of the operation's own message after them, or None)."""
    lines = text.splitlines()
    start = next(
        (i for i, line in enumerate(lines) if "defined at (most recent call" in line), None
    )
    if start is None:
        return [], None
    frames = []
    for line in lines[start + 1 :]:
        found = _DEFINED_AT_FRAME.fullmatch(line)
        if found:
            frames.append((found["file"], int(found["line"])))
        elif line.strip():
            return frames, line.strip()
    return frames, None


def _defines(part, file, line):
    """Whether the source line ``file``:``line`` lies in ``part``'s function or class (for a
    model, one of the user's own)."""
    source = _function(part) or _own_class(part)
    if source is None:
        return False
    try:
        if inspect.getsourcefile(source) != file:
            return False
        lines, first = inspect.getsourcelines(source)
    except (OSError, TypeError):  # defined where no source file is
        return False
    return first <= line < first + len(lines)


def _runs(frame, part):
    """Whether ``frame`` runs code of ``part``: the function itself (a loss function, bound or
    not), a method of the object (a loss, metric or callback, their Keras base classes'
    included), or for a model, a method of its class where that is the user's own (a model's
    calls through Keras' machinery are not its code)."""
    function = _function(part)
    if function is not None:
        return frame.f_code is function.__code__
    if frame.f_locals.get("self") is not part:
        return False
    if isinstance(part, keras.Model):
        own = _own_class(part)
        try:
            return own is not None and frame.f_code.co_filename == inspect.getsourcefile(own)
        except TypeError:  # a class without a source file
            return False
    return True


def _function(part):
    """The function a loss function part is (functools.partial: the one it binds), or None."""
    function = part.func if isinstance(part, functools.partial) else part
    return function if inspect.isfunction(function) else None


def _own_class(part):
    """The class of ``part``, or None for a model whose class is one of Keras' own."""
    kind = type(part)
    if isinstance(part, keras.Model) and kind.__module__.split(".")[0] == "keras":
        return None
    return kind
