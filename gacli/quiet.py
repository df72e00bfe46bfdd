"""TensorFlow's start-up lines, kept off the terminal.

While it loads and finds its devices, TensorFlow's C++ runtime writes straight to file descriptor
2, before Python can configure any logging: that no CUDA driver was found, which CPU instructions
the binary was built for, and, on a machine without a GPU, an ERROR line ("failed call to cuInit:
... UNKNOWN ERROR (303)") that reads like a failure of the run. ``ga-train`` sends fd 2 through a
filter for that span only: the known lines are dropped, every other line (a real error among
them) passes unchanged, and afterwards fd 2 is the terminal again, so nothing later (a crash
report above all) can be held back by the filter.
"""

import contextlib
import os
import re
import sys
import threading

# Each pattern names a line TensorFlow prints on every start on some machines, never a fault of
# the run: the absl preamble, INFO lines about CUDA and CPU features, and the failed CUDA probe.
_KNOWN = re.compile(
    r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|I\d{4} [\d:.]+ +\d+ (cudart_stub|cpu_feature_guard|port)\.cc:\d+\]"
    r"|To enable the following instructions: .*rebuild TensorFlow with the appropriate compiler"
    r"|E\d{4} [\d:.]+ +\d+ cuda_(platform|executor|diagnostics)\.cc:\d+\] failed call to cuInit"
)


@contextlib.contextmanager
def tensorflow_startup():
    """Inside, lines written to fd 2 that match the known start-up messages are dropped."""
    sys.stderr.flush()
    terminal = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)
    forwarder = threading.Thread(target=_forward, args=(read_end, terminal), daemon=True)
    forwarder.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(terminal, 2)  # the pipe's last write end closes: the forwarder reads to its end
        forwarder.join()
        os.close(terminal)


def _forward(read_end, terminal):
    with os.fdopen(read_end, "rb") as lines:
        for line in lines:
            if not _KNOWN.match(line.decode(errors="replace")):
                os.write(terminal, line)
