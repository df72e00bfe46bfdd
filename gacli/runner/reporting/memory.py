"""The memory figures a run reports, and where their peaks start.

Host memory comes from one read of ``/proc/self/status`` (Linux): ``VmRSS`` and ``VmHWM`` are
computed by the kernel from the same counters in that read. (``getrusage`` and
``/proc/self/statm`` read at two moments disagree while other threads allocate:
``tests/runner/reporting/test_run_logging.py`` shows it.) The kernel's counters are approximate and
its high-water mark is raised lazily, so a later ``VmHWM`` can be a few pages below an earlier
``VmRSS``; the peak reported is the largest value read since the job started, which never goes down
and is never below the current value.

A ``ga-train -m`` sweep runs its jobs one after another in one process (Hydra's basic launcher):
:func:`reset_memory_peaks` at each job's start makes the peaks that job's, not the process's.
"""

import functools
import gc
import os
import re
import resource
import sys

import tensorflow as tf

from gacli.engine.host_memory import release_free_memory

_STATUS = "/proc/self/status"
_largest_read = 0  # bytes: the largest VmHWM or VmRSS read since the last reset_memory_peaks()


_status = (None, None)  # (pid, file descriptor) of /proc/self/status, kept open: see below
_FIELD = re.compile(rb"^(VmRSS|VmHWM):\s+(\d+)", re.MULTILINE)


def _read_status():
    """This process's ``/proc/self/status``, or None without one. The file stays open and is read
    from its start each time (the kernel writes it afresh on every read): the logger reads it
    once an update, so an open and a line-by-line parse each time would be paid on every
    update. A forked child opens its own."""
    global _status
    pid, fd = _status
    try:
        if pid != os.getpid():
            if fd is not None:
                os.close(fd)  # a forked child's copy of its parent's file
            fd = os.open(_STATUS, os.O_RDONLY)
            _status = (os.getpid(), fd)
        return os.pread(fd, 16384, 0)
    except OSError:
        _status = (None, None)  # opened again at the next read
        return None


def host_memory_bytes():
    """(current RSS, peak RSS) of this process in bytes; the peak counts from the last
    :func:`reset_memory_peaks`, or from the process's start, and is never below a current value
    returned before.

    Where there is no ``/proc`` the current value is None and the peak is the process's.
    """
    global _largest_read
    # /proc gives kB (KiB)
    fields = {name: int(kib) * 1024 for name, kib in _FIELD.findall(_read_status() or b"")}
    if len(fields) == 2:
        _largest_read = max(_largest_read, fields[b"VmHWM"], fields[b"VmRSS"])
        return fields[b"VmRSS"], _largest_read
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return None, peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, else KiB


@functools.cache
def _memory_devices():
    """Logical devices whose memory TensorFlow tracks: GPUs and TPUs (not the CPU). Listed once a
    job (:func:`reset_memory_peaks` lists them again), not once an update."""
    return [
        device.name.split("device:")[-1]
        for kind in ("GPU", "TPU")
        for device in tf.config.list_logical_devices(kind)
    ]


def device_memory_bytes():
    """(current, peak) bytes of the first accelerator, or None where TF does not track it."""
    devices = _memory_devices()
    if not devices:
        return None
    info = tf.config.experimental.get_memory_info(devices[0])
    return info["current"], info["peak"]


def reset_high_water_mark():
    """Start a new host peak at the current RSS; False where the kernel does not allow it.

    Writing 5 to ``/proc/self/clear_refs`` resets ``VmHWM`` (Linux 4.0 and later; ``getrusage``'s
    ``ru_maxrss`` follows it).
    """
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


def start_host_peak():
    """Start a new host high-water mark for one measurement (``micro_batch_size=auto``'s probe of
    one size): what an earlier measurement freed is handed back to the OS first, so that memory
    malloc kept does not count again. The job's own peak (:func:`host_memory_bytes`) keeps what
    came before. False where the kernel does not allow it (no ``/proc/self/clear_refs``)."""
    host_memory_bytes()
    gc.collect()
    release_free_memory()
    return reset_high_water_mark()


def host_peak_bytes():
    """``VmHWM`` now, in bytes: the peak resident memory since :func:`start_host_peak`; None
    without ``/proc``. The job's own peak takes it into account too."""
    host_memory_bytes()
    fields = dict(_FIELD.findall(_read_status() or b""))
    return int(fields[b"VmHWM"]) * 1024 if b"VmHWM" in fields else None


def reset_memory_peaks():
    """Start the host and device peaks of a new job at what is live now.

    Memory an earlier job of the same process left unreachable is collected and handed back to
    the OS first, so that it does not count as this job's; what earlier jobs still hold (the
    TensorFlow runtime, compiled functions they cached) stays in the new job's figures.
    """
    global _largest_read
    gc.collect()
    release_free_memory()
    reset_high_water_mark()
    _largest_read = 0
    _memory_devices.cache_clear()  # a TPU's appear once a job initialises it
    for device in _memory_devices():
        # TensorFlow raises ValueError for a device whose allocator keeps no statistics: it then
        # has no peak to reset either.
        try:
            tf.config.experimental.reset_memory_stats(device)
        except ValueError:
            pass
