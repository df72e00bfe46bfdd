"""Give the host memory that compiling left free back to the operating system.

Tracing a train step, Grappler and above all XLA's compiler allocate hundreds of MB of small
blocks and free them before the first step has run. glibc's malloc keeps freed blocks in its
arenas for reuse, and the process's resident memory (RSS) stays at the compiler's high-water mark
for the whole run; one ``malloc_trim(0)`` after the first compiled call gives it back
(``benchmarks/rss_phases.py`` splits a run's peak into these phases). Nothing live is touched:
glibc only returns whole free pages.

Elsewhere (musl, macOS, Windows) there is no ``malloc_trim`` and this module does nothing.
"""

import ctypes
import ctypes.util
import functools

import keras


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        name = ctypes.util.find_library("c")  # runs ldconfig: only off the usual glibc name
        try:
            libc = ctypes.CDLL(name) if name else None
        except OSError:
            libc = None
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_free_memory():
    """Give the pages that the C library's allocator holds free back to the operating system
    (glibc's ``malloc_trim``), so that resident memory measured after it is memory in use: call
    it before reading a process's resident size. True when the C library can do it (glibc);
    False, doing nothing, elsewhere."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


class HostMemoryCallback(keras.callbacks.Callback):
    """Releases free host memory after a fit's first training call and first validation call
    (where the train and test functions are traced and compiled) and at every epoch end.

    A ``malloc_trim`` walks the heaps: a few ms on the benchmark's models, paid a few times per
    epoch, never per step.
    """

    def __init__(self):
        super().__init__()
        self._train_calls = self._test_calls = 0

    def on_train_begin(self, logs=None):
        self._train_calls = self._test_calls = 0

    def on_train_batch_end(self, batch, logs=None):
        self._train_calls += 1
        if self._train_calls == 1:
            release_free_memory()

    def on_test_batch_end(self, batch, logs=None):
        self._test_calls += 1
        if self._test_calls == 1:
            release_free_memory()

    def on_epoch_end(self, epoch, logs=None):
        release_free_memory()
