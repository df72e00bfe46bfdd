"""What can stop a ``ga-train`` run, and the exit code each ends with.

The exit codes follow one scheme, documented in docs/guides/resume.md ("When things go wrong"):

- ``0``: the run finished (``result.json`` written).
- ``1``: a failure while running: training halted on a non-finite loss or gradient, a file went bad
  during training, or an unexpected error. Checkpoints written before it are kept; the run can be
  resumed once the cause is fixed.
- ``2``: the user's input: the command line, a config file, the data, or a run directory that
  cannot be used. Nothing was trained.
- ``128 + N``: stopped by signal ``N`` (143 for SIGTERM, 130 for SIGINT), after a checkpoint.

No TensorFlow import here: the command line maps errors to codes before TensorFlow loads.
"""

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


class ConfigError(ValueError):
    """Input the user can fix (config, command line, data, run directory); the message says what
    to type. Ends the run with exit code 2 before any training."""

    exit_code = EXIT_USAGE


class TrainingFailed(RuntimeError):
    """Training stopped on a failure the message explains (exit code 1); checkpoints written
    before it are kept."""

    exit_code = EXIT_FAILURE


class ProcessUnusable(TrainingFailed):
    """Training stopped and this process cannot go on: TensorFlow left its memory damaged (an
    out-of-memory error inside an XLA program), or aborted its collectives (a lost worker). The
    command line exits at once, without the clean-up that would touch the damaged memory."""


class Interrupted(Exception):
    """Training stopped on a signal (after a checkpoint); ``exit_code`` is 128 + the signal."""

    def __init__(self, message, exit_code):
        super().__init__(message)
        self.exit_code = exit_code


def first_line(error):
    """An error's message as a refusal quotes it: its first line, at most 300 characters (the
    exception's type where it has no message)."""
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:300]
