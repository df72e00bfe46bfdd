"""A target's arguments, read from its config section and checked against its signature.

No TensorFlow: ``ga-train`` checks the arguments of a shipped model or dataset
(``gacli.models``, ``gacli.datasets``, whose modules import Keras only when called) while it
validates the config, and :mod:`gacli.runner.builders.targets` checks every target's again when it
calls it.
"""

import dataclasses
import difflib
import inspect

from omegaconf import OmegaConf

from gacli.errors import ConfigError
from gacli.runner.config.schema import EXAMPLE_TARGETS, OWN_SECTION_KEYS, SHIPPED


@dataclasses.dataclass(frozen=True)
class Parameters:
    named: frozenset  # the parameters it takes by name
    required: tuple  # those without a default
    any_keyword: bool  # it takes **kwargs
    known: bool  # the signature could be read


def parameters_of(target):
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # some builtins have none: nothing is checked or filled
        return Parameters(frozenset(), (), True, False)
    by_name = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    named = [p for p in signature.parameters.values() if p.kind in by_name]
    return Parameters(
        frozenset(p.name for p in named),
        tuple(p.name for p in named if p.default is inspect.Parameter.empty),
        any(p.kind == inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()),
        True,
    )


def check_arguments(where, path, parameters, arguments, filled):
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


def section_arguments(section, group):
    """The ``_target_`` of a section (model, dataset, optimizer, loss) and its arguments: the
    keys that are set (not null), but those ga-train reads itself."""
    values = OmegaConf.to_container(section, resolve=True, enum_to_str=True)
    if not values.get("_target_"):
        choose = {"model": "model=mlp", "dataset": "dataset=digits", "optimizer": "optimizer=adam"}
        shipped = f"choose a shipped one, e.g. {choose[group]}, or " if group in choose else ""
        raise ConfigError(
            f"{group}._target_ is not set, so no {group} is named; {shipped}give your own, e.g. "
            f"{group}._target_={EXAMPLE_TARGETS[group]} (docs/guides/own-model.md)."
        )
    arguments = {
        name: value
        for name, value in values.items()
        if name not in OWN_SECTION_KEYS[group] and value is not None
    }
    return {"_target_": values["_target_"], **arguments}


# The values ga-train fills in for a section's target where it takes them by name and the section
# does not give them: what the data says (model), ga-train's own keys and the seed (dataset).
FILLED = {
    "model": ("input_shape", "num_outputs", "task"),
    "dataset": ("seed", "validation_split", "task", "num_classes"),
    "optimizer": ("learning_rate",),
}


def shipped_target(section):
    """The function of ``gacli.models`` or ``gacli.datasets`` that ``section``'s ``_target_``
    names; None for a target of the user's own (or a name the module does not hold: building it
    refuses the path, naming what the module holds)."""
    import importlib

    module, _, name = str(section.get("_target_")).rpartition(".")
    if module not in SHIPPED.values():
        return None
    return getattr(importlib.import_module(module), name, None)


def check_shipped(group, section):
    """ConfigError, before TensorFlow loads, for a key of ``section`` that its shipped target
    (``gacli.models.unet``) does not take, or an argument it needs that is not given; nothing for
    a target of the user's own (checked when it is called)."""
    target = shipped_target(section)
    if target is None:
        return
    module, name = target.__module__, target.__name__
    arguments = section_arguments(section, group)
    arguments.pop("_target_")
    filled = dict.fromkeys(FILLED[group])
    taken = parameters_of(target)
    for key in sorted(set(arguments) - taken.named if not taken.any_keyword else ()):
        readers = [
            f"{group}={other}"
            for other, function in _shipped_functions(module)
            if key in parameters_of(function).named
        ]
        if readers:
            raise ConfigError(
                f"{group}.{key} is read only with {' or '.join(readers)}, and this run has "
                f"{group}={name}, so setting it would change nothing. Drop it, or choose what "
                f"reads it (e.g. {readers[0]})."
            )
        own = [n for n in sorted(taken.named) if n not in FILLED[group]]
        near = difflib.get_close_matches(key, [*own, *OWN_SECTION_KEYS[group][1:]], n=1)
        reads = ", ".join(f"{group}.{n}" for n in own) or f"no {group}.* key of its own"
        raise ConfigError(
            f"{group}.{key} is not a key ga-train reads with {group}={name}, which reads {reads}"
            + (f"; did you mean {group}.{near[0]}? " if near else "; ")
            + f"Drop {group}.{key}, or name a {group} of your own that takes it "
            f"({group}._target_=..., docs/guides/own-model.md)."
        )
    check_arguments(group, str(section._target_), parameters_of(target), arguments, filled)
    signature = inspect.signature(target).parameters
    for key, value in arguments.items():
        if key in signature:
            _check_kind(f"{group}.{key}", value, signature[key].default)


# The kind of value a shipped target's argument takes, told by its default: (accepts, in words).
_KINDS = (
    (bool, lambda v: isinstance(v, bool), "true or false"),
    (int, lambda v: isinstance(v, int) and not isinstance(v, bool), "a whole number"),
    (float, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    ((tuple, list), lambda v: isinstance(v, (tuple, list)), "a list"),
    (str, lambda v: isinstance(v, str), "a string"),
)


def _check_kind(key, value, default):
    """ConfigError for a value of another kind than the argument's default: Hydra reads
    ``model.depth=abc`` as a string, which the target would take and fail on deep in Keras."""
    for kind, accepts, words in _KINDS:
        if isinstance(default, kind):
            if kind == (tuple, list) and default and isinstance(default[0], int) and accepts(value):
                # a list of whole numbers (layer widths): each entry of the kind of the first
                words, accepts = (
                    "a list of whole numbers",
                    lambda v: all(_KINDS[1][1](item) for item in v),
                )
            if not accepts(value):
                shown = list(default) if isinstance(default, tuple) else default
                typed = str(value).lower() if isinstance(value, bool) else value
                raise ConfigError(
                    f"{key}={typed} must be {words}, as its default {shown!r} is; e.g. "
                    f"{key}={str(shown).replace(' ', '').lower() if kind is not str else shown}."
                )
            return


def _shipped_functions(module):
    """(name, function) of each public function of a shipped module, by name."""
    import importlib
    import inspect

    found = importlib.import_module(module)
    return [
        (name, value)
        for name, value in sorted(vars(found).items())
        if inspect.isfunction(value) and value.__module__ == module and not name.startswith("_")
    ]
