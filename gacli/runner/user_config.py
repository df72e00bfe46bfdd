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
from gacli.runner import overrides as command_line
from gacli.runner.config import GROUPS, OPEN_SECTIONS, OWN, TARGET_SECTIONS, TrainConfig

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


def unknown_key(key, own=()):
    """None when ``key`` (dotted) is read by the config, else a ConfigError's message. ``own``:
    the groups whose section is the user's own, every key of which is its target's argument."""
    if key in SCHEMA_KEYS or key == "hydra" or key.startswith(("hydra.", "hydra/")):
        return None  # Hydra's own settings and plugin choices (hydra/launcher=joblib): Hydra's
    parts = key.split(".")
    if parts[0] in {*own, *TARGET_SECTIONS} and parts[0] in OPEN_SECTIONS and len(parts) > 1:
        near = _near_declared(parts) if parts[0] in TARGET_SECTIONS else None
        if near is None:
            return None  # the target's arguments: its call checks them (gacli.runner.targets)
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


def gone_spelling(key, value=None, where=""):
    """A ConfigError's message for a spelling that ga-train no longer reads, saying what to type
    instead, else None. ``where``: how the message starts (the assignment, or the file).

    The optimizer is chosen by its file (optimizer=sgd), whose _target_ names the Keras class:
    optimizer.name and optimizer=own went with the optimizer registry. Without this check
    optimizer.name=sgd would be passed to the target as an argument, and refused only after
    TensorFlow loaded, in the target's terms."""
    options = _shipped("optimizer")
    if key == "optimizer.name":
        shown = str(value) if value is not None else None
        choose = (
            f"optimizer={shown}"
            if shown in options
            else "optimizer=<name>, one of " + ", ".join(options)
        )
        return (
            f"{where}optimizer.name is no longer read: an optimizer is chosen by its file, whose "
            f"_target_ names the Keras class (configs/optimizer/sgd.yaml: keras.optimizers.SGD). "
            f"Type {choose} instead, or optimizer._target_=keras.optimizers.Lion for one of your "
            "own."
        )
    if key == "optimizer" and str(value) == OWN:
        return (
            f"{where}optimizer=own is no longer a choice: every optimizer is built from its "
            "_target_, so give yours alone, e.g. optimizer._target_=keras.optimizers.Lion (it "
            "replaces the default optimizer's class and keeps its learning_rate)."
        )
    return None


def own_sections(assignments, content=None):
    """(the groups whose section is the user's own, the ``<group>=own`` overrides to add).

    ``<group>._target_`` on the command line, or in the section of the YAML file ``content``
    (recipe or the user's), makes the group's section the user's own: ``<group>=own`` is chosen
    unless the command line (or, for the file's target, the file's defaults) chooses another,
    which :func:`gacli.runner.validate.validate` then refuses, naming both."""
    content = content if isinstance(content, dict) else {}
    chosen = {command_line.key(a): command_line.value(a) for a in assignments}
    in_file = {}
    for entry in content.get("defaults") or []:
        for name, choice in entry.items() if isinstance(entry, dict) else ():
            in_file[str(name).split("/")[-1]] = choice
    # The optimizer's section is always built by its _target_ (TARGET_SECTIONS): giving one
    # replaces the chosen file's, and chooses nothing.
    groups = [group for group in GROUPS if group not in TARGET_SECTIONS]
    given = {group for group in groups if f"{group}._target_" in chosen}
    written = {
        group
        for group in groups
        if isinstance(content.get(group), dict) and "_target_" in content[group]
    }
    added = [
        f"{group}={OWN}"
        for group in sorted(given | written)
        if group not in chosen and (group in given or group not in in_file)
    ]
    own = given | written | {g for g in groups if OWN in (chosen.get(g), in_file.get(g))}
    return own, added


def check_overrides(assignments, own=()):
    """ConfigError for a ``key=value`` (``+key=``, ``++key=``, ``~key``) that no field reads;
    ``own``: the groups whose section is the user's own (:func:`own_sections`)."""
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
        problem = unknown_key(key, own)
        if problem:
            raise ConfigError(f"{assignment}: {problem}")


def _check_probe_key(key, assignments):
    """ConfigError for a ``probe.`` key that probe=batch does not read, or given without it."""
    from gacli.runner.config import PROBE_KEYS

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
    optimizer = content.get("optimizer")
    if isinstance(optimizer, dict) and "name" in optimizer:
        name = optimizer["name"]
        choice = name if name in group_options.get("optimizer", ()) else "<name>"
        raise ConfigError(
            f"config={shown} sets optimizer: {{name: {name}}}, which is no longer read: an "
            "optimizer is chosen by its file, whose _target_ names the Keras class. Add "
            f"'- override /optimizer: {choice}' to the defaults list (before _self_) and drop the "
            "name: line, or give optimizer: {_target_: keras.optimizers.Lion} for one of your own."
        )


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
        name = chosen.get("name") if isinstance(chosen, dict) else None
        if name in group_options.get(group, ()) and group not in overridden:
            # model.name / dataset.name pick the builder, but the settings come from the group's
            # file: {name: image_folder} under dataset: keeps the default dataset's settings.
            raise ConfigError(
                f"config={shown} sets {group}: {{name: {name}}}, which picks the {name} code but "
                f"keeps the default {group}'s settings. To choose {name} with its own settings, "
                f"add '- override /{group}: {name}' to the defaults list (before _self_) and drop "
                f"the name: line; then set its keys under {group}:."
            )
    own, _ = own_sections([], content)
    for key in _walk({k: v for k, v in content.items() if k not in ("defaults", "hydra")}):
        problem = unknown_key(key, own)
        if problem:
            raise ConfigError(f"config={shown}: {problem}")
    return content
