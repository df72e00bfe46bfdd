"""Checks of what a user typed, before Hydra composes it: the user's own YAML file and the
command line's keys.

Hydra would report most of these too, but late and in its own terms: a YAML syntax error as a long
traceback, a file without gacli's defaults as "Could not override 'config'", and a key added with
``+`` that no field reads not at all (it is accepted and ignored). Here each gets one paragraph that
names the file, line or key and says what to type. No TensorFlow import.
"""

import dataclasses
import difflib
import typing

import yaml

from gacli.errors import ConfigError
from gacli.runner.command import overrides as command_line
from gacli.runner.config.schema import GROUPS, TARGET_SECTIONS, TrainConfig

_DEFAULTS_LINES = "defaults:\n  - /train\n  - _self_"


def _fields(schema, prefix=""):
    """{dotted key: is an open dict} for every field of a config dataclass, nested ones too."""
    keys = {}
    for field in dataclasses.fields(schema):
        key = prefix + field.name
        if dataclasses.is_dataclass(
            field.default_factory if field.default_factory is not dataclasses.MISSING else None
        ):
            keys[key] = False
            keys.update(_fields(field.default_factory, key + "."))
        else:
            kind = field.type
            if typing.get_origin(kind) is typing.Union:  # Optional[Dict[...]]: the dict inside
                kind = next(arg for arg in typing.get_args(kind) if arg is not type(None))
            keys[key] = typing.get_origin(kind) in (dict, typing.Dict) or kind is dict
    return keys


SCHEMA_KEYS = _fields(TrainConfig)


def unknown_key(key):
    """None when ``key`` (dotted) is read by the config, else a ConfigError's message."""
    if key in SCHEMA_KEYS or key == "hydra" or key.startswith(("hydra.", "hydra/")):
        return None  # Hydra's own settings and plugin choices (hydra/launcher=joblib): Hydra's
    parts = key.split(".")
    if parts[0] in TARGET_SECTIONS and len(parts) > 1:
        near = _near_declared(parts)
        if near is None:
            return None  # the target's arguments: its signature checks them
        return (
            f"{key} is not a key ga-train reads, so setting it would change nothing; did you "
            f"mean {near}? (Any other key of the {parts[0]} section is passed to its _target_ "
            "as an argument; a name this close to one of ga-train's own keys is taken for a "
            "misspelling of it.)"
        )
    for end in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[:end])
        if parent in SCHEMA_KEYS:
            if SCHEMA_KEYS[parent]:  # model.kwargs.*, dataset.features.*: free-form by design
                return None
            break
    close = difflib.get_close_matches(key, SCHEMA_KEYS, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}? " if close else ""
    return (
        f"{key} is not a key ga-train reads, so setting it would change nothing; {hint}"
        "ga-train --cfg job lists every key with its value, and the config reference "
        "(docs/reference/config.md) says what each does."
    )


# How alike (difflib's ratio) an argument of a section always built by its _target_ and one of the
# section's declared keys must be to be taken for a misspelling: learnig_rate / learning_rate is
# 0.96, momentun / momentum 0.88, while arguments of Keras' own optimizers stay below it
# (ema_momentum / momentum 0.80, clipvalue / clipnorm 0.59).
_MISSPELT = 0.85


def _near_declared(parts):
    """``section.key``, the declared key of that section that the undeclared argument ``parts``
    (a dotted key split) is a near miss of; None when there is none or the key is nested."""
    if len(parts) != 2:
        return None
    section = parts[0] + "."
    declared = [
        key[len(section) :]
        for key in SCHEMA_KEYS
        if key.startswith(section) and "." not in key[len(section) :]
    ]
    close = difflib.get_close_matches(parts[1], declared, n=1, cutoff=_MISSPELT)
    return section + close[0] if close else None


def _shipped(group):
    """The names of a config group's shipped files."""
    from importlib import resources

    folder = resources.files("gacli.configs") / group
    return sorted(e.name[: -len(".yaml")] for e in folder.iterdir() if e.name.endswith(".yaml"))


def _choose(group, value):
    """``group=value`` where ``value`` names a shipped file of the group, else the group's
    choices."""
    options = _shipped(group)
    shown = str(value) if value is not None else None
    if shown in options:
        return f"{group}={shown}"
    return f"{group}=<name>, one of " + ", ".join(options)


def gone_spelling(key, value=None, where=""):
    """A ConfigError's message for a spelling that ga-train no longer reads, saying what to type
    instead, else None. ``key``: dotted (``model.factory``) or a group (``model``, with its
    chosen ``value``); ``where``: how the message starts (the assignment, or the file).

    Every model, dataset and optimizer is a file of ``_target_`` and arguments (configs/), as a
    user's own is: the registries that ``model.name``, ``model.factory``, ``model.kwargs``,
    ``dataset.name`` and ``optimizer.name`` chose from went with them, and so did the ``own``
    files. Without this check such a key would be passed to the target as an argument and
    refused only after TensorFlow loaded, in the target's terms."""
    section, _, name = key.partition(".")
    own_target = {
        "model": "my_pkg.nets.Net",
        "dataset": "my_pkg.data.make",
        "optimizer": "keras.optimizers.Lion",
    }
    if section in own_target and name == "name":
        instead = _choose(section, value)
        if section == "model" and str(value)[:1].isupper() and f"{section}={value}" != instead:
            instead = f"model=application model.architecture={value}"
        return (
            f"{where}{key} is no longer read: {_ARTICLE[section]} {section} is chosen by its "
            "file, whose _target_ "
            f"names what builds it (configs/{section}/, e.g. _target_: "
            f"{_EXAMPLE_FILES[section]}). Type {instead} instead, or "
            f"{section}._target_={own_target[section]} for one of your own."
        )
    if key in ("model.factory", "model=factory") or (key == "model" and value == "factory"):
        path = str(value).replace(":", ".") if key == "model.factory" else "my_pkg.models.build"
        return (
            f"{where}model.factory is no longer read: a model of your own is named by its "
            f"_target_, a dotted path (no colon). Type model._target_={path} instead; the function "
            "gets input_shape, num_outputs and task by name where it takes them, and the other "
            "model.* keys as its arguments (docs/guides/own-model.md)."
        )
    if section in own_target and not name and str(value) == "own":
        return (
            f"{where}{section}=own is no longer a choice: {_ARTICLE[section]} {section} of your "
            "own is named by its "
            f"_target_ alone, e.g. {section}._target_={own_target[section]} (with its arguments "
            f"as {section}.* keys), which replaces the default {section}"
            + (" and keeps its learning_rate)." if section == "optimizer" else " and its keys.")
        )
    return _gone_setting(key, value, where)


def _gone_setting(key, value, where):
    """:func:`gone_spelling`'s message for a setting (not a choice) that went, else None."""
    if key == "model.kwargs" or key.startswith("model.kwargs."):
        argument = key[len("model.kwargs.") :]
        typed = f"model.{argument}={value}" if argument else "model.<argument>=..."
        return (
            f"{where}model.kwargs is no longer read: every model.* key is an argument of the "
            f"model's _target_. Type {typed} instead."
        )
    if key == "optimizer.lr_scaling":
        return (
            f"{where}optimizer.lr_scaling is no longer read: the learning rate's scaling with "
            f"the effective batch is one key, lr_scaling, with the batch the learning rate was "
            f"tuned at as lr_reference_batch. Type lr_scaling={value or 'linear'} "
            "lr_reference_batch=256 (your tuned batch; without it, an accum_schedule's first "
            "stage is the reference) instead."
        )
    if key == "optimizer.base_batch_size":
        return (
            f"{where}optimizer.base_batch_size is no longer read; type lr_reference_batch="
            f"{value or 256} instead (with lr_scaling=linear or sqrt)."
        )
    if key == "precision.policy":
        return (
            f"{where}precision.policy is not set on its own: the precision is chosen by its file. "
            f"Type {_choose('precision', value)} instead."
        )
    return None


_ARTICLE = {"model": "a", "dataset": "a", "optimizer": "an"}
# A shipped file of each section, shown where a message explains what a file holds.
_EXAMPLE_FILES = {
    "model": "gacli.models.unet in configs/model/unet.yaml",
    "dataset": "gacli.datasets.digits in configs/dataset/digits.yaml",
    "optimizer": "keras.optimizers.SGD in configs/optimizer/sgd.yaml",
}
# The groups a _target_ of the user's own replaces: given without a choice of the group, the
# default file's arguments would be passed to it, so the group's default is deleted.
_REPLACED_BY_TARGET = ("model", "dataset")


def replaced_sections(assignments, content=None):
    """The ``~<group>`` overrides to add: ``<group>._target_`` on the command line, or in the
    section of the YAML file ``content`` (recipe or the user's), names a model or dataset of the
    user's own, whose section then holds only the keys given with it. Where the command line (or,
    for the file's target, the file's defaults) also chooses a file of the group
    (``model=unet model._target_=my_pkg.UNet``), that file's keys stay its arguments.
    The optimizer is not replaced: ``optimizer._target_=keras.optimizers.Lion`` keeps the
    default's learning_rate."""
    content = content if isinstance(content, dict) else {}
    chosen = {command_line.key(a) for a in assignments}
    in_file = set()
    for entry in content.get("defaults") or []:
        for name in entry if isinstance(entry, dict) else ():
            in_file.add(str(name).split("/")[-1])
    added = []
    for group in _REPLACED_BY_TARGET:
        given = f"{group}._target_" in chosen
        written = isinstance(content.get(group), dict) and "_target_" in content[group]
        if group in chosen or f"~{group}" in chosen:
            continue
        if given or (written and group not in in_file):
            added.append(f"~{group}")
    return added


def check_overrides(assignments):
    """ConfigError for a ``key=value`` (``+key=``, ``++key=``, ``~key``) that no field reads, or
    that is spelt as ga-train no longer reads it."""
    for assignment in assignments:
        key = assignment.split("=", 1)[0].lstrip("+~")
        gone = gone_spelling(key, assignment.split("=", 1)[-1], f"{assignment}: ")
        if gone:
            raise ConfigError(gone)
        if key in GROUPS or key in ("config", "probe"):
            continue  # a group choice (model=unet): Hydra lists the valid names if it is wrong
        if key.startswith("probe."):
            _check_probe_key(key, assignments)
            continue
        problem = unknown_key(key)
        if problem:
            raise ConfigError(f"{assignment}: {problem}")


def _check_probe_key(key, assignments):
    """ConfigError for a ``probe.`` key that probe=batch does not read, or given without it."""
    from gacli.runner.config.schema import PROBE_KEYS

    if key.split(".", 1)[1] not in PROBE_KEYS[1:]:
        raise ConfigError(
            f"{key} is not a key ga-train reads; probe=batch reads "
            + ", ".join(f"probe.{name}" for name in PROBE_KEYS[1:])
            + "."
        )
    if "probe=batch" not in assignments:
        raise ConfigError(
            f"{key} is read only with probe=batch, and this command has no probe, so setting it "
            "would change nothing. Add probe=batch, or drop it."
        )


def _walk(mapping, prefix=""):
    for key, value in mapping.items():
        dotted = f"{prefix}{key}"
        yield dotted
        if isinstance(value, dict) and SCHEMA_KEYS.get(dotted) is False:
            yield from _walk(value, dotted + ".")


class _UniqueKeyLoader(yaml.SafeLoader):
    """A safe YAML loader that refuses a key given twice in one mapping (PyYAML keeps the last,
    so the first would be silently ignored)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice (the first would be ignored)",
                    key_node.start_mark,
                )  # fmt: skip
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _read_user_yaml(path, shown):
    """The content of a user's YAML file; ConfigError, naming the line, when it cannot be read."""
    try:
        with open(path) as handle:
            content = yaml.load(handle, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as error:
        # The context mark is where the unfinished construct began (an unclosed [ on line 2);
        # the problem mark, where the parser gave up (often the end of the file).
        mark = getattr(error, "context_mark", None) or getattr(error, "problem_mark", None)
        where = f"{shown}:{mark.line + 1}:{mark.column + 1}" if mark else shown
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        context = getattr(error, "context", None)
        if "given twice" in problem:
            raise ConfigError(
                f"{where}: {problem}; keep one of the two lines, with the value you mean."
            ) from None
        raise ConfigError(
            f"{where}: not valid YAML ({context + ': ' if context else ''}{problem}). Fix that "
            "line: a common cause is an unclosed [ or {, a tab used for indenting, or a "
            "missing space after a colon."
        ) from None
    except OSError as error:
        raise ConfigError(f"config={shown} cannot be read: {error.strerror or error}.") from None
    return content


def _refuse_gone_in_file(content, shown, group_options):
    """ConfigError for a spelling of a user's YAML that ga-train no longer reads
    (:func:`gone_spelling`): ``- override /optimizer: own``, ``optimizer: {name: sgd}``."""
    for entry in content["defaults"]:
        for key, choice in entry.items() if isinstance(entry, dict) else ():
            gone = gone_spelling(key.split("/")[-1], choice, f"config={shown}: ")
            if gone:
                raise ConfigError(gone)
    for section, keys in content.items():
        for key, value in keys.items() if isinstance(keys, dict) else ():
            gone = gone_spelling(f"{section}.{key}", value, f"config={shown} sets {section}.")
            if gone is None:
                continue
            # The message says what to type on the command line; a file chooses a group's file
            # in its defaults list.
            if key == "name" and value in group_options.get(section, ()):
                gone = (
                    f"config={shown} sets {section}: {{name: {value}}}, which is no longer read: "
                    f"a {section} is chosen by its file. Add '- override /{section}: {value}' "
                    "to the defaults list (before _self_) and drop the name: line; then set its "
                    f"keys under {section}:."
                )
            raise ConfigError(gone.replace(f"sets {section}.{section}.", f"sets {section}."))


def check_user_yaml(path, shown, group_options):
    """ConfigError, naming ``shown`` (the path as given) and the line, for a user's YAML that is
    not valid YAML, is empty, does not start from gacli's defaults, or sets keys nothing reads;
    else its content.

    ``group_options``: {group: names of its shipped files}, e.g. {"dataset": ["digits", ...]}.
    """
    content = _read_user_yaml(path, shown)
    if not isinstance(content, dict):
        raise ConfigError(
            f"config={shown} is {'empty' if content is None else 'not a mapping of keys'}; a "
            f"ga-train config starts from gacli's defaults with these lines:\n{_DEFAULTS_LINES}\n"
            "followed by the keys to change, e.g. accum_steps: 8."
        )
    defaults = content.get("defaults")
    if not isinstance(defaults, list) or not any(
        entry in ("/train", "train") for entry in defaults
    ):
        raise ConfigError(
            f"config={shown} does not start from gacli's defaults: its defaults list must name "
            f"/train (and _self_, so that the file's own values win). Put these lines at its "
            f"top:\n{_DEFAULTS_LINES}"
        )
    overridden = {
        key.split("/")[-1] for entry in defaults if isinstance(entry, dict) for key in entry
    }
    _refuse_gone_in_file(content, shown, group_options)
    for group in GROUPS:
        chosen = content.get(group)
        if isinstance(chosen, str) and group not in overridden:
            # precision: mixed_bfloat16 as a plain key: OmegaConf would say "str is not a
            # subclass of PrecisionConfig".
            raise ConfigError(
                f"config={shown} sets {group}: {chosen}, but {group} is a config group, chosen in "
                f"the defaults list: add '- override /{group}: {chosen}' to it (before _self_) "
                f"and drop the {group}: line (or give {group}={chosen} on the command line)."
            )
    for key in _walk({k: v for k, v in content.items() if k not in ("defaults", "hydra")}):
        problem = unknown_key(key)
        if problem:
            raise ConfigError(f"config={shown}: {problem}")
    return content
