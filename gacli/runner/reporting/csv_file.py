"""``metrics.csv``: the run's scalars as a table, a row per optimizer update (``logger=[csv]``).

The columns are ``step`` (the optimizer update, TensorBoard's step), ``wall_time`` (Unix seconds
when the row was first written) and then every TensorBoard tag the run logged, in the order they
first came (``batch/effective_size``, ``train/loss``, ``optimizer/lr``, ...). Scalars logged at an
update that already has a row join that row: an epoch's ``val/*`` join the row of its last
update. A cell is empty where the tag has no value at that update (``val/*`` between epoch ends,
the rates before the second update).

The file is written as rows come, in place: a row that gains values is rewritten over itself (the
file is cut where it began), and the whole file only when a tag that has no column yet comes (a
few times a run: the rates after the first update, ``val/*`` at the first epoch end). A resumed
run keeps the rows up to the update its checkpoint holds and drops the later ones, which it
trains again, so every update has one row.
"""

import csv
import errno
import functools
import io
import math
import os
import time

from gacli.errors import ConfigError, TrainingFailed
from gacli.runner.reporting.writers import ScalarWriter

_FLUSH_EVERY_S = 10.0  # as the TensorBoard event file (gacli.runner.reporting.run_logs)
_FIRST = ("step", "wall_time")


def _cell(value):
    """A number as the CSV shows it: whole numbers without a fraction, others round-trip."""
    value = float(value)
    if math.isfinite(value) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


def check_table(path):
    """ConfigError, before anything is built, where ``path`` (the run's ``metrics.csv``) or the
    file it is written through cannot be written: a folder of that name, or a file that cannot
    be read back (a resumed run continues it)."""
    for name in (path, f"{path}.writing"):
        if os.path.isdir(name):
            raise ConfigError(
                f"{name} is a folder, and logger=csv writes the run's table there. Move or "
                "remove that folder, or drop csv from logger=, e.g. 'logger=[tensorboard]'."
            )
    if os.path.exists(path):
        try:
            with open(path, "rb"):
                pass
        except OSError as error:
            raise ConfigError(
                f"{path} cannot be read ({error.strerror or error}), and logger=csv continues "
                "it. Make it readable (chmod u+rw), or drop csv from logger=, e.g. "
                "'logger=[tensorboard]'."
            ) from None


def _written(method):
    """``method`` of the table, with a file error while training said in one paragraph
    (TrainingFailed: exit 1, the checkpoints kept). A full disk goes on up as it is: the run
    names it (gacli.runner.training.run)."""

    @functools.wraps(method)
    def writing(self, *args):
        try:
            return method(self, *args)
        except OSError as error:
            if error.errno == errno.ENOSPC:
                raise
            raise TrainingFailed(
                f"{self.path} could not be written ({error.strerror or error}); training "
                "stopped, and the checkpoints written before it are kept. Fix the file or its "
                "folder, then continue with resume=true (or resume=<the run directory>); or "
                "drop csv from logger= when resuming, e.g. 'logger=[tensorboard]'."
            ) from None

    return writing


class MetricsCsv(ScalarWriter):
    """The run directory's ``metrics.csv``.

    Args:
        path: the file, made or (resumed) continued.

    Example:
        >>> table = MetricsCsv("outputs/first/metrics.csv")
        >>> table.start(0); table.write(1, [("train/loss", 0.7)]); table.close()
    """

    def __init__(self, path):
        self.path = path
        self.columns = list(_FIRST)
        self._file = None
        self._row = None  # the last row written, {column: cell}
        self._row_at = 0  # the byte offset at which it begins
        self._flushed = time.monotonic()

    @_written
    def start(self, step):
        """Open the file; a resumed run's rows after update ``step`` are dropped."""
        rows = [row for row in self._rows() if int(row["step"]) <= step]
        self._rewrite(rows)

    def _rows(self):
        """The rows of the file as it is (none if there is none): each whole line with a step;
        the columns become those of its header."""
        try:
            with open(self.path, newline="") as handle:
                text = handle.read()
        except FileNotFoundError:
            return []
        if not text.endswith("\n"):  # a process killed while writing: its last line is cut
            text = text[: text.rfind("\n") + 1]
        reader = csv.DictReader(io.StringIO(text, newline=""))
        header = [name for name in reader.fieldnames or () if name not in _FIRST]
        self.columns = [*_FIRST, *header]
        rows = []
        for row in reader:
            try:
                int(row["step"])
            except (TypeError, ValueError):
                continue
            rows.append({key: value for key, value in row.items() if value not in (None, "")})
        return rows

    def _line(self, row):
        out = io.StringIO()
        csv.writer(out, lineterminator="\n").writerow([row.get(c, "") for c in self.columns])
        return out.getvalue().encode()

    def _rewrite(self, rows):
        """The whole file anew (header and ``rows``), written beside it and renamed over it."""
        if self._file is not None:
            self._file.close()
        scratch = f"{self.path}.writing"
        with open(scratch, "wb") as handle:
            handle.write(self._line({c: c for c in self.columns}))
            for row in rows[:-1]:
                handle.write(self._line(row))
            self._row_at = handle.tell()
            if rows:
                handle.write(self._line(rows[-1]))
        os.replace(scratch, self.path)
        self._file = open(self.path, "ab")
        self._row = rows[-1] if rows else None
        self._flushed = time.monotonic()

    @_written
    def write(self, step, scalars):
        new = [tag for tag, _ in scalars if tag not in self.columns]
        if self._row is not None and int(self._row["step"]) == step:
            row = self._row  # more values of the update the last row holds
        else:
            row = {"step": str(int(step)), "wall_time": f"{time.time():.3f}"}
        row.update((tag, _cell(value)) for tag, value in scalars)
        if new:
            self.flush()
            rows = self._rows()
            if row is self._row:
                rows[-1] = row
            else:
                rows.append(row)
            self.columns += new
            self._rewrite(rows)
            return
        if row is self._row:
            self._file.flush()
            self._file.truncate(self._row_at)
        else:
            self._row_at = self._file.tell()
        self._file.write(self._line(row))
        self._row = row
        if time.monotonic() - self._flushed > _FLUSH_EVERY_S:
            self.flush()

    @_written
    def flush(self):
        if self._file is not None:
            self._file.flush()
            self._flushed = time.monotonic()

    def checkpointed(self):
        self.flush()

    def close(self):
        if self._file is not None:
            self._file.close()
            self._file = None
