"""The documentation: every python and bash block of README.md and docs/ runs (or says why it does
not), the generated config reference is current, the API reference lists every public name, and
no page speaks in ids or paths a reader outside the project cannot follow."""

import importlib.util
import os
import re

import pytest
from doc_blocks import ROOT, PythonPage, all_blocks, markdown_files, run_shell, stray_marks

BLOCKS = all_blocks()
BLOCK_TIMEOUT = 600  # seconds for one block or its run-as command


@pytest.fixture(scope="session")
def blocks_dir(tmp_path_factory):
    """The one scratch directory every block runs in (a page shows a run, later blocks read it)."""
    return tmp_path_factory.mktemp("doc_blocks")


@pytest.fixture(scope="session")
def python_pages(blocks_dir):
    """A Python process per page, started when the page's first python block runs."""
    pages = {}

    def page(path):
        if path not in pages:
            pages[path] = PythonPage(str(blocks_dir))
        return pages[path]

    yield page
    for process in pages.values():
        process.close()


@pytest.fixture(scope="session")
def shell_runs():
    """{command: None} of the shell commands that ran and succeeded in this session: a block that
    shows the same command as an earlier one shares its run."""
    return {}


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=[block.name for block in BLOCKS])
def test_block_runs(block, blocks_dir, python_pages, shell_runs):
    if block.mark == "not run":
        pytest.skip(f"not run: {block.argument}")
    for earlier in BLOCKS:  # the page's files a later block reads, even when -k picks one
        if earlier.path == block.path and earlier.line <= block.line and earlier.mark == "save as":
            saved = os.path.join(blocks_dir, earlier.argument)
            os.makedirs(os.path.dirname(saved), exist_ok=True)
            with open(saved, "w") as file:
                file.write(earlier.code)
    if block.mark == "save as":
        return
    if block.language == "python" and block.mark is None:
        page = python_pages(block.path)
        for earlier in BLOCKS:  # a page's blocks run in order, even when -k picks one
            if earlier.path == block.path and earlier.language == "python" and earlier is not block:
                if earlier.line < block.line and earlier.mark is None:
                    assert page.run(earlier) is None, f"{earlier.name} failed first"
        error = page.run(block)
        assert error is None, f"{block.name} raised:\n{error}"
        return
    command = block.argument if block.mark == "run as" else block.code
    if block.language == "python" and block.mark is None:
        command = f"python - <<'PYTHON'\n{block.code}PYTHON\n"
    if command in shell_runs:
        return
    code, output = run_shell(command, str(blocks_dir), BLOCK_TIMEOUT)
    assert code == 0, f"{block.name} exited with {code}:\n$ {command}\n{output}"
    shell_runs[command] = None


def test_every_mark_stands_above_a_block():
    """A ``not run`` or ``run as`` mark that is not on the line just above a python or bash
    fence marks nothing: the block it was meant for would run as it is."""
    stray = [line for path in markdown_files() for line in stray_marks(path)]
    assert not stray, stray


def test_every_not_run_mark_gives_a_reason_and_run_as_a_command():
    for block in BLOCKS:
        if block.mark in ("not run", "run as"):
            assert len(block.argument) >= 10, f"{block.name}: say why, or what runs instead"


def test_blocks_are_found_in_the_readme_and_the_guides():
    """The collector sees what a reader sees: the README's examples and the guides'."""
    paths = {block.path for block in BLOCKS}
    assert "README.md" in paths and "docs/getting-started.md" in paths
    assert sum(block.language == "python" for block in BLOCKS) >= 10
    assert sum(block.language == "bash" for block in BLOCKS) >= 10


def _config_reference():
    path = os.path.join(ROOT, "scripts", "config_reference.py")
    spec = importlib.util.spec_from_file_location("config_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_config_reference_is_current():
    """docs/reference/config.md is what scripts/config_reference.py writes from config.py today:
    a key added, removed or re-commented without rerunning it fails here."""
    generator = _config_reference()
    with open(generator.PAGE) as page:
        assert page.read() == generator.page(), (
            "docs/reference/config.md is not current: run python scripts/config_reference.py"
        )


def test_the_config_reference_names_every_key():
    """Every key of the schema, nested ones too, has its row (the generator skips none)."""
    import dataclasses

    from gacli.runner.config.schema import TrainConfig

    def keys(schema, prefix=""):
        for item in dataclasses.fields(schema):
            if dataclasses.is_dataclass(item.type):
                yield from keys(item.type, f"{prefix}{item.name}.")
            elif item.name not in ("config", "output_dir"):
                yield f"{prefix}{item.name}"

    page = open(os.path.join(ROOT, "docs", "reference", "config.md")).read()
    missing = [key for key in keys(TrainConfig) if f"| `{key}` |" not in page]
    assert not missing, missing
    assert len(list(keys(TrainConfig))) > 60


def test_the_api_reference_lists_every_public_name():
    """Each name ``import gacli`` gives is rendered from its docstring, from the module that
    defines it (gacli imports its names lazily, so mkdocstrings reads them there)."""
    import gacli

    page = open(os.path.join(ROOT, "docs", "reference", "api.md")).read()
    rendered = set(re.findall(r"^::: ([\w.]+)$", page, re.M))
    expected = {f"{module}.{name}" for name, module in gacli._LAZY.items()}
    assert rendered == expected, (sorted(expected - rendered), sorted(rendered - expected))


def _pages_for_outsiders():
    for path in markdown_files():
        with open(os.path.join(ROOT, path)) as page:
            yield path, page.read()


def test_the_pages_speak_to_outsiders():
    """No pointer a reader outside the project cannot follow: no tracking ids, no paths of the
    machines gacli was built on, and the contract's row ids (E1, D5, ...) only on its own page,
    where the rows stand."""
    insider = re.compile(r"GA_CONTRACT|\.\./shared|/work/|/tmp/pytest|\bissue #?[0-9]+\b")
    row_id = re.compile(r"\b[BCDEGPRX][0-9]{1,2}\b")
    found = []
    for path, text in _pages_for_outsiders():
        found += [f"{path}: {match}" for match in insider.findall(text)]
        if path != os.path.join("docs", "contract.md"):
            found += [f"{path}: row id {match}" for match in row_id.findall(text)]
    assert not found, found


def test_the_readme_is_a_first_look_whose_links_lead_into_the_site():
    """The README stays short (the site says the rest), and every file it links exists."""
    with open(os.path.join(ROOT, "README.md")) as readme:
        text = readme.read()
    assert len(text.splitlines()) <= 250
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [target for target in targets if "://" not in target]
    assert len(local) >= 10 and all(target.startswith("docs/") for target in local), local
    missing = [target for target in local if not os.path.exists(os.path.join(ROOT, target))]
    assert not missing, missing
