"""TensorFlow's start-up lines, kept off the terminal.

While it loads and finds its devices, TensorFlow's C++ runtime writes straight to file descriptor
2, before Python can configure any logging: that no CUDA driver was found, which CPU instructions
the binary was built for, and, on a machine without a GPU, an ERROR line ("failed call to cuInit:
... UNKNOWN ERROR (303)") that reads like a failure of the run. ``ga-train`` sends fd 2 through a
filter for that span only: the known lines are dropped, every other line (a real error among
them) passes unchanged, and afterwards fd 2 is the terminal again.

The filter is a forked process, not a thread: it needs no lock of this process (C++ code may
write while holding Python's), and it still forwards what was written if this process aborts
(a fatal error while TensorFlow loads).
"""

import contextlib
import os
import re
import sys

# Each pattern names a line TensorFlow prints on every start on some machines, never a fault of
# the run: the absl preamble, INFO lines about CUDA and CPU features, and the failed CUDA probe.
_KNOWN = re.compile(
    r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|I\d{4} [\d:.]+ +\d+ (cudart_stub|cpu_feature_guard|port)\.cc:\d+\]"
    r"|To enable the following instructions: .*rebuild TensorFlow with the appropriate compiler"
    r"|E\d{4} [\d:.]+ +\d+ cuda_(platform|executor|diagnostics)\.cc:\d+\] failed call to cuInit"
    # version: TensorFlow 2.17 and 2.18 write a date and the source path first, probe CUDA from
    # cuda_driver.cc, and register their CUDA plugins twice in a CPU-only run (the "Unable to
    # register ... factory" lines, tensorflow/tensorflow#62075).
    r"|[\d-]+ [\d:.]+: I \S*/(cudart_stub|cpu_feature_guard)\.cc:\d+\]"
    r"|[\d-]+ [\d:.]+: E \S*/cuda_driver\.cc:\d+\] failed call to cuInit"
    r"|([\d-]+ [\d:.]+: E \S*/|E\d{4} [\d:.]+ +\d+ )cuda_(fft|dnn|blas)\.cc:\d+\] Unable to "
    r"register cu(FFT|DNN|BLAS) factory"
    # version: TensorFlow 2.17 also looks for TensorRT on every start.
    r"|[\d-]+ [\d:.]+: W \S*/py_utils\.cc:\d+\] TF-TRT Warning: Could not find TensorRT"
)
# A user who asked TensorFlow for its own logging gets all of it, unfiltered.
_USER_LOGGING = ("TF_CPP_MIN_LOG_LEVEL", "TF_CPP_MAX_VLOG_LEVEL", "TF_CPP_VMODULE")


@contextlib.contextmanager
def tensorflow_startup():
    """Inside, lines written to fd 2 that match the known start-up messages are dropped."""
    if (
        not hasattr(os, "fork")
        or "tensorflow" in sys.modules
        or any(name in os.environ for name in _USER_LOGGING)
    ):
        # Loaded already (a multirun's later job: its lines were filtered once, and forking a
        # process with TensorFlow's threads is not safe), or the user wants TensorFlow's logs.
        yield
        return
    sys.stderr.flush()
    terminal = os.dup(2)
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # the filter: forward until every write end is closed, then exit at once
        os.close(write_end)
        _forward(read_end, terminal)
        os._exit(0)
    os.close(read_end)
    os.dup2(write_end, 2)
    os.close(write_end)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(terminal, 2)  # the pipe's last write end closes: the filter reads to its end
        os.close(terminal)
        os.waitpid(child, 0)


def _forward(read_end, terminal):
    with os.fdopen(read_end, "rb") as lines:
        for line in lines:
            if _KNOWN.match(line.decode(errors="replace")):
                continue
            try:
                os.write(terminal, line)
            except OSError:  # stderr closed: keep draining, so the writer never blocks
                pass
