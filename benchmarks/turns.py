"""Configurations that take turns: the processes of one repetition run side by side, and only one
of them trains at a time, for a few optimizer updates, before it hands the machine to the next.

Why: on a shared machine the speed drifts during a run and differs from process to process. Two
fresh processes of the *same* configuration, one after the other, gave paired ratios from 0.81x to
1.35x on the 2-core machine these benchmarks were written on, and within one process the rate
moved from 29,000 to 19,000 samples/s over a minute. A difference of a few percent between two
configurations cannot be seen through that. Taking turns every few updates puts every
configuration of a repetition in the same minutes of the machine's life, so a slow minute slows
them all; each process still compiles, warms up and trains on its own, with the machine's cores to
itself while it trains.

The parent (:func:`run_in_turns`) starts the processes together. Each trains through its warm-up,
says it is ready and waits; once all are ready the parent hands the turn round: each process
trains ``turn_updates`` updates, stops its clock, says so and waits for its next turn. A process's
time is the sum of its own turns. Waiting happens in a callback between compiled calls, so no
computation is in flight while another process trains. A process that ends its timed window exits
before the next turn starts, so its tear-down runs on no one's clock.

The pipes are anonymous, passed to each worker as two file descriptors (``spec["baton"]``).
"""

import json
import os
import random
import select
import subprocess
import sys
import time
from pathlib import Path

READY, TURN_DONE, WINDOW_DONE, GO = b"R", b"T", b"E", b"G"


class Baton:
    """A worker's end of the turn-taking: ``wait_for_turn`` blocks until the parent says go."""

    def __init__(self, go_fd, done_fd, turn_steps):
        self.go_fd, self.done_fd, self.turn_steps = go_fd, done_fd, turn_steps

    @classmethod
    def from_spec(cls, spec, batch_size):
        """The spec's baton, its turn counted in steps of ``batch_size`` samples; None without."""
        baton = spec.get("baton")
        if not baton:
            return None
        turn_samples = baton["turn_updates"] * spec["micro_batch_size"] * spec["accum_steps"]
        return cls(baton["go_fd"], baton["done_fd"], max(1, turn_samples // batch_size))

    def _say(self, what):
        os.write(self.done_fd, what)

    def wait_for_turn(self, what):
        """Say ``what`` (ready or turn done) and block until it is this process's turn again."""
        self._say(what)
        if os.read(self.go_fd, 1) != GO:
            raise RuntimeError("the benchmark's parent went away while this worker waited")

    def window_done(self):
        self._say(WINDOW_DONE)
        os.close(self.done_fd)


def _read(fd, deadline):
    """One byte from ``fd``; b"" if the writer went away. TimeoutError after ``deadline``
    (``time.monotonic()``)."""
    ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
    if not ready:
        raise TimeoutError("a benchmark worker said nothing before the time limit")
    try:
        return os.read(fd, 1)
    except OSError:
        return b""


class _Worker:
    """The parent's handle on one worker process."""

    def __init__(self, command, spec, job_dir, env):
        go_r, self.go_w = os.pipe()
        self.done_r, done_w = os.pipe()
        spec["baton"] = dict(spec["baton"], go_fd=go_r, done_fd=done_w)
        command = command + [json.dumps(spec)]
        self.log = open(Path(job_dir) / "worker.log", "w")
        self.process = subprocess.Popen(
            command,
            cwd=job_dir,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            pass_fds=(go_r, done_w),
        )
        os.close(go_r)
        os.close(done_w)
        self.ended = None  # time.perf_counter() once the process has exited

    def give_turn(self, deadline):
        """Let the worker train one turn; what it said at the turn's end (b"" if it died)."""
        try:
            os.write(self.go_w, GO)
        except OSError:
            return b""
        return _read(self.done_r, deadline)

    def close(self, timeout_s):
        if self.ended is not None:
            return
        for fd in (self.go_w, self.done_r):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()
        self.ended = time.perf_counter()


def run_in_turns(commands, specs, job_dirs, env, timeout_s, seed):
    """Run the workers ``commands[i] + [json(specs[i])]`` side by side, taking turns; returns
    each one's (returncode, seconds from the start until its process exited). The order of turns
    within a round is shuffled (seeded), so that no configuration always follows the same one.
    Past ``timeout_s`` the workers are killed and TimeoutError raised."""
    started = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    workers = []
    try:
        for command, spec, job_dir in zip(commands, specs, job_dirs):
            workers.append(_Worker(command, dict(spec), job_dir, env))
        # Warm-ups run together; each worker then says it is ready (or dies: b"").
        active = [worker for worker in workers if _read(worker.done_r, deadline) == READY]
        rng = random.Random(seed)
        while active:
            rng.shuffle(active)
            for worker in list(active):
                if worker.give_turn(deadline) != TURN_DONE:
                    # Its window is over (or it failed): it finishes before the next turn.
                    active.remove(worker)
                    worker.close(max(1.0, deadline - time.monotonic()))
    except TimeoutError:
        for worker in workers:
            worker.process.kill()
        raise
    finally:
        for worker in workers:
            worker.close(max(1.0, deadline - time.monotonic()))
    return [(worker.process.returncode, worker.ended - started) for worker in workers]


def worker_command(script):
    return [sys.executable, str(script), "--worker"]
