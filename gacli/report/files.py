"""The files ga-report writes: each whole or not at all (:func:`write_atomically`), and each
marked as ga-report's (report.md's first line, report.json's ``written_by``, the PNG files'
``gacli-lines`` text chunk), so that a later ga-report replaces only files it wrote
(:func:`written_by_report`). No TensorFlow here."""

import json
import os

WRITTEN_BY = "ga-report"
# report.md's first line: the mark that lets a later ga-report replace it.
MARKDOWN_MARK = "<!-- written by ga-report, which replaces this file when it runs again -->"


def write_atomically(path, write, binary=False):
    """Call ``write(handle)`` on a new file that then replaces ``path``: a reader (or a stopped
    ga-report) sees the old file or the whole new one, never half of one."""
    folder, name = os.path.split(os.path.abspath(path))
    # open(), not tempfile: the file gets the permissions the user's umask gives, not 0600.
    scratch = os.path.join(folder, f".ga-report-{os.getpid()}-{name}")
    try:
        with open(scratch, "wb" if binary else "w") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(scratch, path)
    finally:
        if os.path.lexists(scratch):
            os.remove(scratch)


def written_by_report(path):
    """Whether ``path`` is a file an earlier ga-report wrote (by its mark: see the module's
    docstring; or by the shape of the files ga-report wrote before it marked them)."""
    if os.path.islink(path) or not os.path.isfile(path):
        return False
    try:
        with open(path, "rb") as handle:
            head = handle.read(2**20)
    except OSError:
        return False
    if path.endswith(".png"):
        return head.startswith(b"\x89PNG") and b"gacli-lines\x00" in head
    if path.endswith(".md"):
        first = head.split(b"\n", 1)[0].decode("utf-8", "replace")
        return first in (MARKDOWN_MARK, "# ga-report")
    try:
        data = json.loads(head)
    except ValueError:
        return False
    earlier = {"created", "paths", "swept", "columns", "best", "runs"}
    return isinstance(data, dict) and (data.get("written_by") == WRITTEN_BY or earlier <= set(data))
