"""The code blocks of README.md and docs/**/*.md, found and run as a reader would run them.

The convention (docs/contributing.md says it for writers): a fenced ``python`` or ``bash`` block is
run by the tests. The line just above its fence may say how:

- ``<!-- not run: <reason> -->``: the block is not run (it needs a cluster, a GPU, a container
  runtime, or hours); the test is skipped with the reason, so it is counted;
- ``<!-- run as: <command> -->``: the shell command runs instead (the same job with smaller
  settings, or the steps that make the block's placeholders real);
- ``<!-- save as: <path> -->``: the block (python, or yaml, which is otherwise not collected) is
  written to that file, not run: a module or YAML file of a user's project that later blocks of
  the page run (written before any later block of its page runs).

Any other block runs as it is: a bash block with ``bash -eo pipefail``, a python block in one
Python process per page, in order, so that a later block of a page may use what an earlier one
made (as a reader who pastes them in turn would). All blocks run in one scratch directory shared
by the session, so that a page can show a run once and the blocks after it read that run.
"""

import dataclasses
import glob
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LANGUAGES = {"python": "python", "bash": "bash", "sh": "bash", "shell": "bash", "console": "bash"}
NOT_RUN = re.compile(r"^<!-- not run: (?P<reason>.*\S) -->$")
RUN_AS = re.compile(r"^<!-- run as: (?P<command>.*\S) -->$")
SAVE_AS = re.compile(r"^<!-- save as: (?P<path>[\w./-]+) -->$")
MARK = re.compile(r"^\s*<!--\s*(not run|run as|save as)\b")
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})\s*(?P<info>[^\s`]*)")


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced block of a markdown file: where it starts, its language and code, and the mark
    on the line above it (``not run``, ``run as``, ``save as`` or None) with its argument."""

    path: str  # relative to the repository
    line: int  # the fence's line, counted from 1
    language: str  # python or bash (or yaml, saved as a file)
    code: str
    mark: str = None
    argument: str = None

    @property
    def name(self):
        return f"{self.path}:{self.line}"


def markdown_files():
    """README.md and every page under docs/, relative to the repository."""
    pages = sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
    return ["README.md"] + [os.path.relpath(page, ROOT) for page in pages]


def fenced_blocks(text):
    """(line of the fence, info string, code) of every fenced block of ``text``."""
    lines = text.split("\n")
    found, index = [], 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        fence, end = opening.group("fence"), index + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        body = [line[len(opening.group("indent")) :] for line in lines[index + 1 : end]]
        found.append((index + 1, opening.group("info").lower(), "\n".join(body) + "\n"))
        index = end + 1
    return found


def blocks_of(path):
    """The python and bash blocks of the markdown file ``path`` (relative to the repository)."""
    text = open(os.path.join(ROOT, path)).read()
    lines = text.split("\n")
    found = []
    for line, info, code in fenced_blocks(text):
        above = lines[line - 2].strip() if line >= 2 else ""
        language = LANGUAGES.get(info)
        if language is None and info in ("yaml", "yml") and SAVE_AS.match(above):
            language = "yaml"
        if language is None:
            continue
        mark = argument = None
        if SAVE_AS.match(above):
            mark, argument = "save as", SAVE_AS.match(above).group("path")
        elif NOT_RUN.match(above):
            mark, argument = "not run", NOT_RUN.match(above).group("reason")
        elif RUN_AS.match(above):
            mark, argument = "run as", RUN_AS.match(above).group("command")
        found.append(Block(path, line, language, code, mark, argument))
    return found


def all_blocks():
    return [block for path in markdown_files() for block in blocks_of(path)]


def stray_marks(path):
    """Lines of ``path`` holding a run mark that does not stand just above a python or bash
    fence (a mark a writer meant for a block that it does not reach)."""
    text = open(os.path.join(ROOT, path)).read()
    lines = text.split("\n")
    marked = {b.line - 1 for b in blocks_of(path) if b.mark}
    return [
        f"{path}:{number}: {line.strip()}"
        for number, line in enumerate(lines, start=1)
        if MARK.search(line) and number not in marked
    ]


def environment():
    """The environment blocks run in: this Python's scripts (ga-train, ga-report) first on PATH,
    TensorFlow's start-up chatter off, nothing from a terminal."""
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env.pop("HYDRA_FULL_ERROR", None)
    return env


def run_shell(command, cwd, timeout):
    """(exit code, the output's last 4,000 characters) of ``command`` run by bash in ``cwd``."""
    result = subprocess.run(
        ["bash", "-eo", "pipefail", "-c", command],
        cwd=cwd,
        env=environment(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return result.returncode, (result.stdout + result.stderr)[-4000:]


# The Python process that runs a page's blocks: it reads one JSON request per line (the code and
# where it comes from), runs the code in the page's namespace with its output sent to a log, and
# answers with one line that starts with DONE and says whether the block raised.
DRIVER = r"""
import contextlib, io, json, sys, traceback
namespace = {"__name__": "__main__"}
protocol = sys.stdout
for request in sys.stdin:
    block = json.loads(request)
    output = io.StringIO()
    error = None
    try:
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            exec(compile(block["code"], block["name"], "exec"), namespace)
    except BaseException:
        error = traceback.format_exc()
    print("DONE " + json.dumps({"error": error, "output": output.getvalue()[-4000:]}),
          file=protocol, flush=True)
"""


class PythonPage:
    """One Python process running the python blocks of one page, in order."""

    def __init__(self, cwd):
        self.process = subprocess.Popen(
            [sys.executable, "-u", "-c", DRIVER],
            cwd=cwd,
            env=environment(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.done = {}  # block name -> error text (None: it ran)

    def run(self, block):
        """The traceback of ``block`` (None when it ran), run once per page process."""
        if block.name not in self.done:
            request = {"code": block.code, "name": block.name}
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            for line in self.process.stdout:
                if line.startswith("DONE "):
                    answer = json.loads(line[5:])
                    self.done[block.name] = answer["error"] and (
                        answer["error"] + "\n--- output ---\n" + answer["output"]
                    )
                    break
            else:
                self.done[block.name] = "the Python process ended before the block did"
        return self.done[block.name]

    def close(self):
        """End the process: its blocks have run, and TensorFlow's own teardown is slow."""
        self.process.stdin.close()
        self.process.kill()
        self.process.wait(timeout=60)
