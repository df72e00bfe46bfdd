"""The counters a compiled call returns in its logs (``counters_in_logs``, which ga-train sets
with one replica) are the ones a read after the call gives, and nobody else sees them: not the
History, not the epoch's logs, not ga-train's results. The event file that ga-train's logger
writes with TensorFlow's record writer is one TensorBoard reads."""

import os

import keras
import numpy as np
import pytest

import gacli
from gacli.engine.accumulation import AFTER_CALL, COUNTERS_LOG_KEY, NOISE_STATE_LOG_KEY
from gacli.engine.window import read_now
from gacli.runner.reporting.run_logs import EventFile, UpdateEvents
from helpers import event_tags, ga_train, make_data, mlp_layers, run_dir_of, scalars


def _read(accumulator, name):
    variable = {
        "optimizer_step": accumulator.optimizer_step,
        "micro_step": accumulator.micro_step,
        "window_micro_steps": accumulator.window_micro_steps,
        "halted_at": accumulator.halted_at,
        "learning_rate": accumulator.learning_rate,
    }[name]
    return read_now(variable).item()


class _Compare(keras.callbacks.Callback):
    """After each call and epoch: what after_call() gives against a read of every variable."""

    def __init__(self, accumulator):
        super().__init__()
        self.accumulator = accumulator
        self.kept_calls = 0
        self.mismatches = []
        self.leaked = []

    def _check(self, where, logs):
        if COUNTERS_LOG_KEY in (logs or {}):
            self.leaked.append(where)
        for name in AFTER_CALL:
            given, read = self.accumulator.after_call(name), _read(self.accumulator, name)
            if given != read:
                self.mismatches.append((where, name, given, read))

    def on_train_batch_end(self, batch, logs=None):
        self.kept_calls += self.accumulator._after_call is not None
        self._check(f"batch {batch}", logs)

    def on_epoch_end(self, epoch, logs=None):
        # The epoch's short window was applied after the last call: a read, not the call's.
        assert self.accumulator._after_call is None
        self._check(f"epoch {epoch}", logs)


@pytest.mark.parametrize("steps_per_execution", [1, 2])
def test_the_counters_from_a_calls_logs_equal_a_read_after_it_and_are_shown_nowhere(
    steps_per_execution,
):
    x, y = make_data(70)
    inputs, outputs = mlp_layers()
    model = gacli.GradientAccumulateModel(
        accum_steps=3, inputs=inputs, outputs=outputs, nonfinite="stop"
    )
    model.counters_in_logs = True
    model.compile(
        optimizer=keras.optimizers.SGD(
            keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=2, decay_rate=0.5)
        ),
        loss="mse",
        steps_per_execution=steps_per_execution,
    )
    compare = _Compare(model.accumulating_optimizer)
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[compare])
    calls = 2 * -(-9 // steps_per_execution)  # 9 micro-batches an epoch (70 samples of 8)
    assert compare.kept_calls == calls
    assert compare.mismatches == []
    assert compare.leaked == []
    assert COUNTERS_LOG_KEY not in history.history
    # 2 epochs of 3 windows, the last one short (partial_window=apply).
    assert int(model.accumulating_optimizer.optimizer_step.numpy()) == 6


class _CompareNoise(keras.callbacks.Callback):
    """After each call: the noise scale's reading from the kept state against a read of it."""

    def __init__(self, accumulator):
        super().__init__()
        self.accumulator = accumulator
        self.readings = []

    def on_train_batch_end(self, batch, logs=None):
        assert self.accumulator._after_call is not None
        assert not {COUNTERS_LOG_KEY, NOISE_STATE_LOG_KEY} & set(logs or {})
        given = self.accumulator.noise_scale()
        read = self.accumulator._noise.reading()  # no state given: a read of the variable
        self.readings.append((given, read))


def test_the_noise_scale_from_a_calls_logs_equals_a_read_after_it():
    x, y = make_data(72)
    inputs, outputs = mlp_layers()
    model = gacli.GradientAccumulateModel(
        accum_steps=3, inputs=inputs, outputs=outputs, noise_scale=True
    )
    model.counters_in_logs = True
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", steps_per_execution=3)
    compare = _CompareNoise(model.accumulating_optimizer)
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[compare])
    assert not {COUNTERS_LOG_KEY, NOISE_STATE_LOG_KEY} & set(history.history)
    assert len(compare.readings) == 6
    order = ("grad_sq", "trace_cov", "noise_scale", "grad_sq_raw", "trace_raw", "windows")
    for given, read in compare.readings:
        assert [given[key] for key in order] == read
    # Every window measured: the estimate moved, and the last one is the one kept.
    assert [given["windows"] for given, _ in compare.readings] == [1, 2, 3, 4, 5, 6]
    model.accumulating_optimizer.forget_counters()
    assert model.accumulating_optimizer.noise_scale() == compare.readings[-1][0]


def test_without_counters_in_logs_the_logs_and_the_reads_are_as_before():
    x, y = make_data(40)
    inputs, outputs = mlp_layers()
    model = gacli.GradientAccumulateModel(accum_steps=2, inputs=inputs, outputs=outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    logs = model.train_on_batch(x[:8], y[:8], return_dict=True)
    assert COUNTERS_LOG_KEY not in logs
    accumulator = model.accumulating_optimizer
    assert accumulator._after_call is None
    assert accumulator.after_call("micro_step") == 1
    assert accumulator.after_call("halted_at") == 0


def test_the_event_file_is_read_back_by_tensorboard(tmp_path):
    log_dir = tmp_path / "tensorboard"
    log_dir.mkdir()
    writer, events = EventFile(str(log_dir)), UpdateEvents()
    for step in range(1, 4):
        # The same list of tags reuses one event; a new list makes another.
        tags = [("train/loss", 1.0 / step), ("optimizer/step", step)]
        if step == 3:
            tags.append(("throughput/samples_per_sec", 123.5))
        writer.add_event(events.event(step, tags))
    writer.close()
    _, read = event_tags(str(tmp_path), every_point=True)
    assert scalars(read, "train/loss") == pytest.approx([1.0, 0.5, 1.0 / 3])
    assert scalars(read, "optimizer/step") == [1.0, 2.0, 3.0]
    assert scalars(read, "throughput/samples_per_sec") == [123.5]
    assert [event.step for event in read.Tensors("train/loss")] == [1, 2, 3]


@pytest.mark.slow
def test_ga_train_logs_the_counters_of_each_update_and_its_results_hold_none(tmp_path):
    rng = np.random.default_rng(0)
    data = tmp_path / "data.npz"
    np.savez(data, x=rng.normal(size=(100, 8)).astype("float32"), y=rng.integers(0, 3, 100))
    code, output = ga_train(
        "dataset=npz",
        f"dataset.path={data}",
        "dataset.num_classes=3",
        "dataset.validation_split=0",
        "model=mlp",
        "model.hidden_units=[8]",
        "optimizer=sgd",
        "optimizer.learning_rate=0.05",
        "micro_batch_size=16",
        "accum_steps=3",
        "epochs=2",
        "progress=plain",
        cwd=tmp_path,
    )
    assert code == 0, output
    run_dir = run_dir_of(output)
    _, events = event_tags(run_dir, every_point=True)
    # 100 samples: 7 micro-batches an epoch (the last of 4), windows of 3, 3 and the short 1.
    assert scalars(events, "optimizer/step") == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert scalars(events, "optimizer/micro_step") == [3.0, 6.0, 7.0, 10.0, 13.0, 14.0]
    assert [event.step for event in events.Tensors("optimizer/step")] == [1, 2, 3, 4, 5, 6]
    assert scalars(events, "optimizer/lr") == pytest.approx([0.05] * 6)
    assert scalars(events, "batch/update_samples") == [48.0, 48.0, 4.0] * 2
    for name in os.listdir(run_dir):
        if name.endswith(".json"):
            with open(os.path.join(run_dir, name)) as handle:
                assert COUNTERS_LOG_KEY not in handle.read(), name
    assert COUNTERS_LOG_KEY not in output


def test_a_fit_stopped_by_a_non_finite_gradient_keeps_no_counters_behind():
    x, y = make_data(48)
    x[20] = np.nan  # micro-batch 3 of 8 samples: the first call of 2 micro-batches is clean
    inputs, outputs = mlp_layers()
    model = gacli.GradientAccumulateModel(
        accum_steps=2, inputs=inputs, outputs=outputs, nonfinite="stop"
    )
    model.counters_in_logs = True
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", steps_per_execution=2)
    with pytest.raises(gacli.NonFiniteError):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    accumulator = model.accumulating_optimizer
    assert accumulator._after_call is None
    assert accumulator.halted_micro_step() == 3
    assert accumulator.after_call("optimizer_step") == _read(accumulator, "optimizer_step") == 1
