"""What the TensorBoard figures mean: samples per update, training throughput, memory peaks.

Tiny in-process runs (``train(cfg)``) on npz data whose sizes make short windows and ragged
micro-batches; the event files are read back with TensorBoard's EventAccumulator.
"""

import io
import json
import os
import re
import threading
import time

import keras
import numpy as np
import pytest
from rich.console import Console

import gacli.runner.training.run
from gacli.runner.reporting.run_logs import host_memory_bytes
from gacli.runner.training.run import train
from helpers import compose_config, event_tags, scalars

BATCH_TAGS = (
    "batch/effective_size",
    "batch/micro_size",
    "batch/accum_steps",
    "batch/replicas",
    "batch/update_samples",
)


def npz_run(tmp_path, monkeypatch, samples, *overrides, validation_split=0.0):
    """train() on ``samples`` rows of 3-class data; returns (run directory, console output)."""
    rng = np.random.default_rng(0)
    path = tmp_path / "data.npz"
    np.savez(path, x=rng.normal(size=(samples, 6)), y=rng.integers(0, 3, samples))
    run_dir = str(tmp_path / "run")
    buffer = io.StringIO()
    monkeypatch.setattr(
        gacli.runner.training.run,
        "make_console",
        lambda: Console(file=buffer, force_terminal=False, width=200),
    )
    train(
        compose_config(
            "dataset=npz",
            f"dataset.path={path}",
            f"dataset.validation_split={validation_split}",
            *overrides,
        ),
        run_dir=run_dir,
    )
    return run_dir, buffer.getvalue()


UPDATE_SAMPLES = [
    # 36 samples in micro-batches of 8: 8, 8, 8, 8, 4 an epoch; windows of 2 micro-batches.
    (("micro_batch_size=8", "accum_steps=2"), [16, 16, 4] * 2),
    (
        ("micro_batch_size=8", "accum_steps=2", "wrapper=optimizer", "partial_window=drop"),
        [16, 16] * 2,
    ),
    # Windows run across the epoch end; the carried one is applied at the end of training.
    (
        ("micro_batch_size=8", "accum_steps=2", "wrapper=optimizer", "partial_window=carry"),
        [16, 16, 4 + 8, 16, 8 + 4],
    ),
    # 10, 10, 10, 6: the second window is full length but holds a short micro-batch.
    (("micro_batch_size=10", "accum_steps=2"), [20, 16] * 2),
]


@pytest.mark.parametrize(
    "overrides, expected", UPDATE_SAMPLES, ids=["apply", "drop", "carry", "ragged"]
)
def test_update_samples_are_the_samples_each_update_took(
    tmp_path, monkeypatch, overrides, expected
):
    run_dir, _ = npz_run(tmp_path, monkeypatch, 36, "epochs=2", *overrides)
    tags, events = event_tags(run_dir)
    assert scalars(events, "batch/update_samples") == expected
    micro, accum = (int(o.split("=")[1]) for o in overrides[:2])
    assert scalars(events, "batch/effective_size") == [micro * accum] * len(expected)
    # Every batch tag has a point at every update, so each draws a line in TensorBoard.
    steps = [event.step for event in events.Tensors("optimizer/step")]
    assert steps == list(range(1, len(expected) + 1))
    for tag in BATCH_TAGS:
        assert [event.step for event in events.Tensors(tag)] == steps, tag


def test_throughput_counts_training_calls_only_and_the_console_shows_the_same(
    tmp_path, monkeypatch
):
    """Validation made 3 s slower and the first call's compile must not reach the throughput;
    the console's samples/s is the event file's mean."""
    pause = 3.0
    evaluate = keras.Model.evaluate

    def slow_evaluate(self, *args, **kwargs):
        time.sleep(pause)
        return evaluate(self, *args, **kwargs)

    monkeypatch.setattr(keras.Model, "evaluate", slow_evaluate)
    # 48 samples, 12 of them for validation: micro-batches of 8, 8, 8, 8, 4, windows of 2.
    run_dir, output = npz_run(
        tmp_path,
        monkeypatch,
        48,
        "micro_batch_size=8",
        "accum_steps=2",
        "epochs=2",
        "progress=plain",
        validation_split=0.25,
    )
    tags, events = event_tags(run_dir)
    assert {"val/loss", "time/first_call_seconds"} <= tags
    assert len(scalars(events, "time/first_call_seconds")) == 1
    sizes = [8, 8, 8, 8, 4]
    micro_steps = [int(value) for value in scalars(events, "optimizer/micro_step")]
    assert micro_steps == [2, 4, 5, 7, 9, 10]

    def samples(end):
        return sum(sizes[index % len(sizes)] for index in range(end))

    # The first point's interval is the first call alone: no throughput there.
    rates = {
        event.step: value
        for event, value in zip(
            events.Tensors("throughput/samples_per_sec"),
            scalars(events, "throughput/samples_per_sec"),
        )
    }
    assert sorted(rates) == [2, 3, 4, 5, 6]
    seconds = {
        step: (samples(micro_steps[step - 1]) - samples(micro_steps[step - 2])) / rate
        for step, rate in rates.items()
    }
    # Each interval is one compiled call of a tiny model; with validation in it, one would take
    # the pause and more.
    assert max(seconds.values()) < pause / 3, seconds
    mean = scalars(events, "throughput/mean_samples_per_sec")
    trained = samples(micro_steps[-1]) - samples(micro_steps[0])
    assert mean[-1] == pytest.approx(trained / sum(seconds.values()), rel=1e-4)
    shown = [float(value) for value in re.findall(r"([\d.]+) samples/s", output)]
    assert shown and shown[-1] == pytest.approx(mean[-1], abs=0.051), output


def test_peak_rss_is_never_below_current_while_another_thread_allocates():
    stop = threading.Event()

    def allocate():
        held = []
        while not stop.is_set() and len(held) < 300:
            held.append(b"x" * 2**20)  # written, so resident: RSS climbs to new highs
            time.sleep(0.0005)  # lets the reader in between allocations, however busy the CPU

    worker = threading.Thread(target=allocate)
    worker.start()
    readings = []
    try:
        while worker.is_alive():
            readings.append(host_memory_bytes())
    finally:
        stop.set()
        worker.join()
    assert len(readings) > 10
    assert [r for r in readings if r[1] < r[0]] == []
    peaks = [peak for _, peak in readings]
    assert peaks == sorted(peaks)


def test_a_job_reports_its_own_peak_not_the_process_s(tmp_path, monkeypatch):
    """A multirun's jobs run in one process: what an earlier job held must not be this job's
    peak. 400 MiB held and freed before train() stands in for the earlier job."""
    blob = np.ones(400 * 2**20, dtype=np.uint8)
    del blob
    process_peak = host_memory_bytes()[1]
    run_dir, _ = npz_run(
        tmp_path, monkeypatch, 36, "micro_batch_size=8", "accum_steps=2", "epochs=1"
    )
    result = json.load(open(os.path.join(run_dir, "result.json")))
    assert result["host_peak_rss_bytes"] < process_peak - 200 * 2**20
    _, events = event_tags(run_dir)
    peaks = scalars(events, "memory/host_peak_rss_bytes")
    currents = scalars(events, "memory/host_rss_bytes")
    assert max(peaks) < process_peak - 200 * 2**20
    assert all(peak >= current for peak, current in zip(peaks, currents))
    assert peaks == sorted(peaks)
