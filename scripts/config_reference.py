"""Write docs/reference/config.md, ga-train's config reference, from the one declaration of its
settings: the dataclasses of gacli/runner/config/schema.py (each key, its type, and the comments
beside and above it), the enums whose members are a key's choices (with their comments), the ranges
and the keys that only some choices read (validate.py's ``_RANGES`` and ``_READ_ONLY_BY``), the keys
a resumed run may change (``FREE_ON_RESUME``), the config groups and recipes that ship with the
package (each YAML file's opening comment), and the default job's values as Hydra composes them.

    python scripts/config_reference.py           # rewrite the page
    python scripts/config_reference.py --check   # exit 1 when the page is not current

tests/project/test_docs.py fails when the committed page differs from what this writes, so a change
to the settings that leaves the page behind does not pass.
"""

import argparse
import ast
import dataclasses
import enum
import inspect
import io
import os
import re
import sys
import tokenize
import typing
from importlib import resources

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "reference", "config.md")

# Where a key is explained at length: (key or key prefix, page under docs/, title).
GUIDES = (
    (
        "micro_batch_size",
        "guides/batch-probe.md#which-micro-batch-fits-micro_batch_sizeauto",
        "auto",
    ),
    ("auto_batch", "guides/batch-probe.md#which-micro-batch-fits-micro_batch_sizeauto", "auto"),
    ("probe", "guides/batch-probe.md", "the batch probe"),
    ("oom", "guides/batch-size.md#out-of-memory-in-the-middle-of-a-run-oomrecover", "oom"),
    ("monitor.gns", "guides/batch-size.md", "noise scale"),
    ("batchnorm", "guides/batch-norm.md", "batch norm"),
    ("precise_bn_micro_batches", "guides/batch-norm.md", "batch norm"),
    ("precision", "guides/mixed-precision.md", "mixed precision"),
    ("optimizer.use_agc", "guides/clipping.md", "clipping"),
    ("optimizer.clip_factor", "guides/clipping.md", "clipping"),
    ("strategy", "guides/distributed.md", "distributed"),
    ("resume", "guides/resume.md#interrupted-runs-resume-and-preemption", "resume"),
    ("checkpoint", "guides/resume.md#what-a-run-leaves-behind", "run directory"),
    ("objective", "guides/distributed.md#hydras-launchers-and-sweepers", "sweepers"),
    ("accum_schedule", "guides/batch-schedule.md", "batch schedules"),
    ("lr_scaling", "guides/batch-schedule.md#the-learning-rate-across-stages", "learning rate"),
    (
        "optimizer.lr_scaling",
        "guides/batch-schedule.md#the-learning-rate-across-stages",
        "learning rate",
    ),
    ("logger", "guides/loggers.md", "loggers"),
    ("mlflow", "guides/loggers.md#mlflow", "MLflow"),
)

# Types the annotation cannot say: micro_batch_size is Any because it also takes the word auto,
# logger because it also takes one name.
TYPES_SHOWN = {"micro_batch_size": "int or `auto`", "logger": "list of names"}

INTRO = """# Config reference

Every key `ga-train` reads, generated from the typed schema in `gacli/runner/config/schema.py` (its
dataclasses and their comments), the config groups in `configs/` and the recipes in `recipes/`,
by `scripts/config_reference.py`; a test fails when this page is not current.

A key is set on the command line (`ga-train accum_steps=8 optimizer.learning_rate=0.01`) or in
a YAML file (`ga-train config=./my_run.yaml`, see [your own YAML](../cli.md#your-own-yaml)).
A group (`model`, `dataset`, `optimizer`, `precision`, `strategy`) is chosen by name
(`ga-train model=unet`), which sets that choice's values; its keys are then set one by one
(`model.depth=4`). Values come, last one winning, from the schema's defaults, the chosen
group files, `configs/train.yaml` (the default job), a recipe or your YAML, and the command line.
"Default job" below is the value in the default job, `ga-train` with nothing else;
`ga-train --cfg job ...` prints the composed config of any command without training.

Every bad input stops the run before training, with one paragraph that names the key, file or
sample and says what to type; see [when things go wrong](../guides/resume.md#when-things-go-wrong).
"""


def comments_of(cls):
    """{member name: comment text} for the assignments in ``cls``'s body: the comment lines just
    above a member and the comment at the end of its line, joined."""
    source = inspect.getsource(sys.modules[cls.__module__])
    tree = ast.parse(source)
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    lines = source.splitlines()
    comment_at = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comment_at[token.start[0]] = token.string.lstrip("#").strip()
    found = {}
    for statement in node.body:
        target = (
            getattr(statement, "target", None) or (getattr(statement, "targets", None) or [None])[0]
        )
        if not isinstance(target, ast.Name):
            continue
        above, line = [], statement.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, comment_at[line])
            line -= 1
        inline = [
            comment_at[n]
            for n in range(statement.lineno, statement.end_lineno + 1)
            if n in comment_at and not lines[n - 1].strip().startswith("#")
        ]
        found[target.id] = " ".join(above + inline)
    return found


def type_name(annotation):
    """A key's type as a reader types it: int, float, bool, str, a list, a mapping, or a choice."""
    origin, arguments = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Union:
        inner = [a for a in arguments if a is not type(None)]
        return f"{type_name(inner[0])} or null"
    if origin in (list, typing.List):
        return f"list of {type_name(arguments[0])}"
    if origin in (dict, typing.Dict):
        return "mapping"
    if annotation is typing.Any:
        return "any"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return "choice"
    return getattr(annotation, "__name__", str(annotation))


def enum_of(annotation):
    """The Enum a key's value must be a member of, or None."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, enum.Enum):
            return candidate
    return None


def shown(value):
    """A value as it is written on the command line."""
    if value is None:
        return "null"
    if value == "":
        return '""'
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(shown(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {shown(v)}" for k, v in value.items()) + "}"
    return str(value)


def default_job():
    """The default job's config, composed by Hydra as ``ga-train`` composes it."""
    from hydra import compose, initialize_config_module

    from gacli.runner.config.schema import register_configs

    register_configs()
    with initialize_config_module("gacli.configs", version_base="1.3"):
        return compose("train")


def job_value(cfg, key):
    from omegaconf import OmegaConf

    node = OmegaConf.select(cfg, key, throw_on_missing=False)
    if OmegaConf.is_missing(cfg, key):
        return "(set by the run)"
    if OmegaConf.is_config(node):
        node = OmegaConf.to_container(node)
    return f"`{shown(node)}`"


def notes(key, config):
    """What the declaration says besides the comment: the range, the choices that read the key,
    whether a resumed run may change it, and the guide that explains it."""
    from gacli.runner.config import validate

    said = []
    low, high, closed, _ = validate._RANGES.get(key, (None, None, True, None))
    if low is not None:
        bound = f"{'>=' if closed else '>'} {low}"
        if high is not None:
            bound += f" and {'<' if key == 'model.dropout' else '<='} {high}"
        said.append(f"Must be {bound}.")
    if key in validate._READ_ONLY_BY:
        decider, readers = validate._READ_ONLY_BY[key]
        typed = decider.removesuffix(".name")
        choices = " or ".join(f"`{typed}={shown(r)}`" for r in readers)
        said.append(f"Read only with {choices}.")
    if key.split(".")[0] in config.FREE_ON_RESUME:
        said.append("A resumed run may change it.")
    for prefix, page, _ in GUIDES:
        if key == prefix or key.startswith(prefix + "."):
            said.append(
                f"See [{page.split('#')[0].split('/')[-1][:-3].replace('-', ' ')}](../{page})."
            )
            break
    return " ".join(said)


def choices_text(choice_enum):
    members = comments_of(choice_enum)
    return "; ".join(
        f"`{m.value}`"
        + (f": {sentence(members[m.name]).rstrip('.')}" if members.get(m.name) else "")
        for m in choice_enum
    )


def sentence(text):
    """A declaration comment as the page shows it: null (what YAML and the command line write)
    where Python's None stands, ending with a full stop."""
    text = re.sub(r"\bNone\b", "null", text.strip())
    return text + ("" if not text or text.endswith(".") else ".")


def cell(text):
    """Text that stays inside one table cell and is not read as HTML."""
    return text.replace("|", "\\|").replace("\n", " ").replace("<", "&lt;")


def key_rows(schema, prefix, cfg, config):
    """The table rows of ``schema``'s keys (nested dataclasses get a table of their own)."""
    comments = comments_of(schema)
    hints = typing.get_type_hints(schema)
    rows = []
    for item in dataclasses.fields(schema):
        annotation = hints[item.name]
        if dataclasses.is_dataclass(annotation) or item.name in ("output_dir", "config"):
            continue
        key = f"{prefix}{item.name}"
        meaning = sentence(comments.get(item.name, ""))
        choice_enum = enum_of(annotation)
        if choice_enum is not None:
            meaning = (
                (meaning + " " if meaning else "") + "One of " + choices_text(choice_enum) + "."
            )
        extra = notes(key, config)
        text = " ".join(part for part in (meaning, extra) if part)
        kind = TYPES_SHOWN.get(key) or type_name(annotation)
        rows.append(f"| `{key}` | {kind} | {job_value(cfg, key)} | {cell(text)} |")
    return rows


def table(rows):
    return "\n".join(
        ["| key | type | default job | what it does |", "| --- | --- | --- | --- |", *rows]
    )


def opening_comment(path):
    """The lines of a YAML file's opening comment, without their '#'."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[1:].removeprefix(" "))
    return lines


def yaml_comment(path):
    return " ".join(line.strip() for line in opening_comment(path))


def default_choice(group):
    """The default job's choice of ``group``, from the defaults list of configs/train.yaml (a
    section built by its _target_ has no name key to tell it by)."""
    import yaml

    train = yaml.safe_load((resources.files("gacli.configs") / "train.yaml").read_text())
    entries = [e for e in train["defaults"] if isinstance(e, dict) and group in e]
    return entries[0][group] if entries else None


def group_section(group, schema, cfg, config):
    from omegaconf import OmegaConf

    folder = resources.files("gacli.configs") / group
    chosen = default_choice(group)
    rows = []
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".yaml"):
            continue
        name = entry.name[:-5]
        values = OmegaConf.to_container(OmegaConf.load(str(entry)))
        sets = ", ".join(
            f"`{k}: {shown(v)}`" for k, v in values.items() if k not in ("_target_", "policy")
        )
        mark = " (default job)" if shown(chosen) == name else ""
        rows.append(
            f"| `{group}={name}`{mark} | {cell(sets or '-')} | {cell(yaml_comment(entry))} |"
        )
    head = [
        f"## `{group}`",
        "",
        f"Chosen with `{group}=<choice>`; each choice is a file in `configs/{group}/`:",
        "",
    ]
    choices = ["| choice | sets | what it is |", "| --- | --- | --- |", *rows]
    keys = ["", table(key_rows(schema, f"{group}.", cfg, config))]
    return "\n".join(head + choices + keys + shipped_arguments(group, folder, config))


def shipped_arguments(group, folder, config):
    """For the groups whose files name a function of gacli (model, dataset): each file's target
    with its docstring and its arguments, read from the function's signature, as the config's
    keys are (the data's values that ga-train fills in left out)."""
    import importlib

    from omegaconf import OmegaConf

    from gacli.runner.config.arguments import FILLED

    if group not in config.SHIPPED:
        return []
    lines = [
        "",
        f"Each file's `_target_` is a function of `{config.SHIPPED[group]}`, and every other key "
        "of the file is one of its arguments; its other arguments keep the defaults below. "
        f"`{group}.<argument>=` sets one (a key that the chosen function does not take is "
        "refused before TensorFlow loads).",
    ]
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".yaml"):
            continue
        target = str(OmegaConf.load(str(entry))._target_)
        module, _, name = target.rpartition(".")
        function = getattr(importlib.import_module(module), name)
        summary = " ".join(inspect.getdoc(function).split("\n\n")[0].split())
        rows = [
            f"| `{group}.{parameter.name}` | {shown(parameter.default)} |"
            if parameter.default is not inspect.Parameter.empty
            else f"| `{group}.{parameter.name}` | required |"
            for parameter in inspect.signature(function).parameters.values()
            if parameter.name not in FILLED[group]
            and parameter.kind is not inspect.Parameter.VAR_KEYWORD
            and parameter.name not in config.OWN_SECTION_KEYS[group]
        ]
        lines += [
            "",
            f"### `{group}={entry.name[:-5]}`: `{target}`",
            "",
            cell(summary),
            "",
            "| argument | default |",
            "| --- | --- |",
            *rows,
        ]
    return lines


def recipe_section():
    """Each shipped recipe with its opening comment, line for line."""
    folder = resources.files("gacli.recipes")
    parts = [
        "## Recipes\n\nShipped with the package (`config=<name>`); each begins with the command "
        "that runs it and what to expect."
    ]
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".yaml"):
            comment = "\n".join(opening_comment(entry))
            parts.append(f"### `{entry.name}`\n\n```text\n{comment}\n```")
    return "\n\n".join(parts)


def page():
    from gacli.runner.config import schema as config

    cfg = default_job()
    top = key_rows(config.TrainConfig, "", cfg, config)
    nested = [
        f"## `{item.name}`\n\n"
        + table(
            key_rows(
                item.type
                if not isinstance(item.type, str)
                else typing.get_type_hints(config.TrainConfig)[item.name],
                f"{item.name}.",
                cfg,
                config,
            )
        )
        for item in dataclasses.fields(config.TrainConfig)
        if dataclasses.is_dataclass(typing.get_type_hints(config.TrainConfig)[item.name])
        and item.name not in config.GROUPS
    ]
    parts = [INTRO, "## Run keys\n\n" + table(top), *nested]
    parts += [group_section(group, schema, cfg, config) for group, schema in config.GROUPS.items()]
    parts.append(recipe_section())
    return "\n\n".join(parts) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is not current")
    arguments = parser.parse_args(argv)
    text = page()
    if arguments.check:
        current = open(PAGE).read() if os.path.exists(PAGE) else ""
        if current != text:
            print(
                f"{os.path.relpath(PAGE, ROOT)} is not current: "
                "run python scripts/config_reference.py"
            )
            return 1
        return 0
    with open(PAGE, "w") as out:
        out.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
