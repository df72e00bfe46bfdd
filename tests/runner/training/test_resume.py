"""Contract row C5 for ga-train: a run killed (-9) or preempted (SIGTERM) and resumed ends with
the weights of an uninterrupted run; run directories are never overwritten."""

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from helpers import (
    compose_config,
    ga_train,
    interrupt_after_checkpoints,
    record,
    run_difference,
    run_dir_of,
    start_ga_train,
)

# The default job, shortened; a checkpoint every 3 updates lands inside epochs (45 micro-batches,
# 12 updates each), so a kill usually resumes from the middle of an epoch and of a window.
JOB = ("epochs=3", "progress=plain", "checkpoint_every_updates=3", "accum_steps=4")


def start_and_interrupt(cwd, number, arguments=JOB):
    """Start ga-train, wait for its first checkpoint, send ``number``; (exit code, output)."""
    process = start_ga_train(*arguments, cwd=cwd)
    deadline = time.time() + 300
    while not glob.glob(os.path.join(cwd, "outputs", "default", "*", "checkpoints", "checkpoint")):
        assert process.poll() is None and time.time() < deadline, process.communicate()[0]
        time.sleep(0.05)
    process.send_signal(number)
    output = process.communicate(timeout=300)[0]
    return process.returncode, output


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """JOB's run directory, trained without a stop: ga-train's training, in this process (the
    reference the interrupted runs, started as users start them, must end at)."""
    from gacli.runner.training.run import train

    run_dir = str(tmp_path_factory.mktemp("uninterrupted") / "run")
    train(compose_config(*JOB), run_dir)
    return run_dir


@pytest.mark.slow
def test_kill_9_then_resume_equals_uninterrupted_run(tmp_path, uninterrupted):
    """One run killed with -9 after its first checkpoint checks:

    - an unfinished run is resumed with its own settings only: started again into its directory
      without resume= it is refused with the way to resume; with another setting, refused naming
      it; resume=true finds no run of another command, and names the unfinished one;
    - then resume=true (with another progress display, free to change) goes on in the same
      directory, keeps Hydra's files of the first start, and ends with the uninterrupted run's
      weights (contract row C5).
    """
    code, output = start_and_interrupt(tmp_path, signal.SIGKILL)
    assert code == -signal.SIGKILL, output
    (run_dir,) = glob.glob(os.path.join(tmp_path, "outputs", "default", "*"))
    assert not os.path.exists(os.path.join(run_dir, "result.json"))
    first_start = open(os.path.join(run_dir, ".hydra", "config.yaml")).read()

    # Started again without resume=, into the same directory: refused, with the way to resume.
    code, output = ga_train(*JOB, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert code == 2 and f"resume={run_dir}" in output, output
    # With other settings: refused, naming the setting.
    code, output = ga_train(
        "epochs=3",
        "progress=plain",
        "checkpoint_every_updates=3",
        "accum_steps=8",
        f"resume={run_dir}",
        cwd=tmp_path,
    )
    assert code == 2 and "accum_steps=4 (now 8)" in output, output
    # resume=true looks for a run of the same command only.
    code, output = ga_train("accum_steps=8", "resume=true", cwd=tmp_path)
    assert code == 2 and "no unfinished run" in output, output
    assert os.path.basename(run_dir) in output, output

    # The same command, with another progress display (free to change on resume).
    resumed = [a for a in JOB if not a.startswith("progress=")] + ["progress=none"]
    code, output = ga_train(*resumed, "resume=true", cwd=tmp_path)
    assert code == 0, output
    assert run_dir_of(output) == run_dir
    assert "resume: from epoch" in output, output
    # Nothing of the first start is overwritten: Hydra's files of the resumed job go aside.
    assert open(os.path.join(run_dir, ".hydra", "config.yaml")).read() == first_start
    assert glob.glob(os.path.join(run_dir, ".hydra", "resumed-*", "config.yaml"))
    measured = record(run_difference(run_dir, uninterrupted), "test_kill_9_then_resume")
    assert measured <= 1e-6


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_says_how_to_resume(tmp_path, uninterrupted):
    code, output = start_and_interrupt(tmp_path, signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, output
    (run_dir,) = glob.glob(os.path.join(tmp_path, "outputs", "default", "*"))
    assert "stopped by SIGTERM" in output and "checkpoint saved" in output, output
    assert f"resume={run_dir}" in output and "resume=true" in output, output
    assert "Traceback" not in output, output

    code, output = ga_train(*JOB, f"resume={run_dir}", cwd=tmp_path)
    assert code == 0, output
    measured = record(run_difference(run_dir, uninterrupted), "test_sigterm_then_resume")
    assert measured <= 1e-6

    # Finished: a later run never writes into it, with or without resume.
    for extra in (("resume=true",), (f"hydra.run.dir={run_dir}",)):
        code, output = ga_train(*JOB, *extra, cwd=tmp_path)
        assert code == 2 and "Traceback" not in output, output
        assert "finished run" in output or "no unfinished run" in output, output


def test_resume_errors_say_what_to_type(tmp_path):
    code, output = ga_train("resume=true", cwd=tmp_path)
    assert code == 2 and "no unfinished run of this command" in output, output
    assert "resume=outputs/default/<run>" in output, output
    code, output = ga_train(f"resume={tmp_path / 'missing'}", cwd=tmp_path)
    assert code == 2 and "is not a directory" in output, output
    code, output = ga_train("-m", "accum_steps=1,2", "resume=true", cwd=tmp_path)
    assert code == 2 and "not a sweep" in output, output
    code, output = ga_train("checkpoint_every_updates=-1", cwd=tmp_path)
    assert code == 2 and "checkpoint_every_updates=100" in output, output
    code, output = ga_train(f"resume={tmp_path}", "checkpoint=false", cwd=tmp_path)
    assert code == 2 and "drop checkpoint=false" in output, output
    code, output = ga_train("wrapper=optimizer", "strategy=multi_worker", cwd=tmp_path)
    assert code == 2 and "use wrapper=auto" in output, output
    code, output = ga_train("strategy=multi_worker", "resume=true", cwd=tmp_path)
    assert code == 2 and "resume=<chief's run dir>" in output, output


def test_a_checkpoint_after_an_epochs_last_micro_batch_resumes_at_the_next_epoch():
    from gacli.runner.training.run import _segments

    # (epoch, micro-batches done) -> fit() calls: (first epoch, end, steps per epoch, skipped)
    assert _segments((0, 0), 10, 3) == [(0, 3, 10, 0)]
    assert _segments((1, 4), 10, 3) == [(1, 2, 6, 4), (2, 3, 10, 0)]
    assert _segments((1, 10), 10, 3) == [(2, 3, 10, 0)]
    assert _segments((2, 10), 10, 3) == []
    # steps_per_execution not dividing the epoch: one fit() per epoch, so that no compiled call
    # runs into the next epoch's micro-batches.
    assert _segments((0, 0), 10, 3, per_epoch=True) == [(0, 1, 10, 0), (1, 2, 10, 0), (2, 3, 10, 0)]
    assert _segments((1, 4), 10, 3, per_epoch=True) == [(1, 2, 6, 4), (2, 3, 10, 0)]


STREAM_MEMORY = """
import resource, numpy as np, tensorflow as tf
from gacli.runner.training.run_state import PassOrder, micro_batch_stream
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
data = tf.data.Dataset.from_tensor_slices(np.ones((5000, 800), "float32"))  # 16 MB
before = peak()
for _ in micro_batch_stream(data, 100, 50, start=0, count=50 * 10,
                            order=PassOrder(0, buffer_size=5000)):
    pass
print("GROWTH", peak() - before)
"""


@pytest.mark.slow
def test_a_stream_of_many_passes_holds_the_data_once():
    # Each pass over the data is a pipeline of its own; tf.data's default graph rewrites would
    # copy in-memory data into each (ten passes over 16 MB: about +150 MB).
    done = subprocess.run(
        [sys.executable, "-c", STREAM_MEMORY],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
    )
    growth = int(done.stdout.split("GROWTH")[-1])
    assert growth < 3 * 16 * 2**20, done.stdout + done.stderr[-2000:]


def newest_checkpoint(run_dir):
    numbers = [
        int(path.rsplit("ckpt-", 1)[1].split(".")[0])
        for path in glob.glob(os.path.join(run_dir, "checkpoints", "ckpt-*.index"))
    ]
    return os.path.join(run_dir, "checkpoints", f"ckpt-{max(numbers)}"), sorted(numbers)


def truncate(prefix):
    (data,) = glob.glob(prefix + ".data-*")
    with open(data, "r+b") as handle:
        handle.truncate(os.path.getsize(data) // 2)


@pytest.fixture(scope="module")
def interrupted_run(tmp_path_factory):
    """A SIGTERM'd run with two checkpoints (the newest saved at the signal), to copy and damage."""
    return interrupt_after_checkpoints(tmp_path_factory.mktemp("interrupted"), 1, JOB)


DAMAGE = {
    # The newest checkpoint's data file cut short (a full disk, a copy that stopped).
    "truncated-newest": lambda run_dir: truncate(newest_checkpoint(run_dir)[0]),
    # The newest checkpoint deleted, and the 'checkpoint' index file garbled.
    "deleted-newest-garbled-index": lambda run_dir: (
        [os.remove(path) for path in glob.glob(newest_checkpoint(run_dir)[0] + ".*")],
        open(os.path.join(run_dir, "checkpoints", "checkpoint"), "w").write("}{ garbage"),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_resume_goes_on_from_the_newest_intact_checkpoint(
    damage, interrupted_run, tmp_path, uninterrupted
):
    run_dir = str(tmp_path / "run")
    shutil.copytree(interrupted_run, run_dir)
    newest, numbers = newest_checkpoint(run_dir)
    assert len(numbers) == 2, numbers
    DAMAGE[damage](run_dir)
    code, output = ga_train(*JOB, f"resume={run_dir}", cwd=tmp_path)
    assert code == 0, output
    if damage == "truncated-newest":
        assert f"resume: ckpt-{numbers[1]} is damaged" in output, output
        # Set aside, not deleted.
        assert glob.glob(
            os.path.join(run_dir, "checkpoints", "damaged-*", f"ckpt-{numbers[1]}.index")
        )
    assert "starting from the beginning" not in output, output
    assert "resume: from epoch" in output, output
    measured = record(run_difference(run_dir, uninterrupted), f"test_resume_after_damage[{damage}]")
    assert measured <= 1e-6


@pytest.mark.slow
def test_no_readable_checkpoint_is_a_clear_error_that_deletes_nothing(interrupted_run, tmp_path):
    run_dir = str(tmp_path / "run")
    shutil.copytree(interrupted_run, run_dir)
    _, numbers = newest_checkpoint(run_dir)
    for number in numbers:
        truncate(os.path.join(run_dir, "checkpoints", f"ckpt-{number}"))
    before = sorted(os.listdir(os.path.join(run_dir, "checkpoints")))
    code, output = ga_train(*JOB, f"resume={run_dir}", cwd=tmp_path)
    assert code == 2 and "Traceback" not in output, output
    assert f"resume: none of the 2 checkpoints in {run_dir}/checkpoints can be read" in output
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == before


@pytest.mark.slow
def test_resume_true_passes_over_runs_with_nothing_to_resume(
    interrupted_run, tmp_path, uninterrupted
):
    outputs = tmp_path / "outputs" / "default"
    resumable = str(outputs / "2020-01-01_00-00-00-000000")
    shutil.copytree(interrupted_run, resumable)
    # Newer runs of the same command: one killed before its first checkpoint, one whose only
    # checkpoint is cut short.
    for name, keep in (("2030-01-01_00-00-00-000000", False), ("2031-01-01_00-00-00-000000", True)):
        shutil.copytree(interrupted_run, outputs / name)
        checkpoints = outputs / name / "checkpoints"
        if keep:
            _, numbers = newest_checkpoint(str(outputs / name))
            for number in numbers:
                (data,) = glob.glob(str(checkpoints / f"ckpt-{number}.data-*"))
                os.truncate(data, 0)
        else:
            shutil.rmtree(checkpoints)
    code, output = ga_train(*JOB, "resume=true", cwd=tmp_path)
    assert code == 0, output
    assert run_dir_of(output) == resumable, output
    measured = record(run_difference(resumable, uninterrupted), "test_resume_true_passes_over")
    assert measured <= 1e-6


@pytest.mark.slow
def test_a_run_stopped_after_its_last_checkpoint_resumes_to_the_same_metrics(tmp_path):
    # Killed after the last epoch's checkpoint, before result.json and model.keras: the resumed
    # run has nothing left to train, and its metrics are those kept with that checkpoint.
    code, output = ga_train("epochs=2", "progress=none", cwd=tmp_path)
    assert code == 0, output
    run_dir = run_dir_of(output)
    with open(os.path.join(run_dir, "result.json")) as handle:
        finished = json.load(handle)
    os.remove(os.path.join(run_dir, "result.json"))
    os.remove(os.path.join(run_dir, "model.keras"))
    # Resuming with the noise scale, which the checkpoints were written without, is refused.
    code, output = ga_train("epochs=2", "monitor.gns=true", f"resume={run_dir}", cwd=tmp_path)
    assert code == 2 and "was started without monitor.gns" in output, output
    assert "Traceback" not in output
    code, output = ga_train("epochs=2", "progress=none", f"resume={run_dir}", cwd=tmp_path)
    assert code == 0, output
    with open(os.path.join(run_dir, "result.json")) as handle:
        resumed = json.load(handle)
    for key in ("loss", "accuracy", "val_loss", "val_accuracy", "weights_sha256"):
        assert resumed[key] == finished[key], key
    assert os.path.exists(os.path.join(run_dir, "model.keras"))


# In a process of its own: the lock is checked in the process that ran, after the run ended.
FINISH_AND_CHECK_THE_LOCK = """
import fcntl, sys
from gacli import rundir
from gacli.runner.command.cli import main
try:
    main(sys.argv[1:])
except SystemExit as stop:
    print("exit code:", stop.code)
with open("run/.gacli.lock") as handle:
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError while still held
print("lock free; held:", len(rundir._held))
"""


@pytest.mark.slow
def test_a_resumed_run_that_finishes_sets_its_failure_aside_and_frees_its_lock(tmp_path):
    """A run that fails while training (an out-of-memory error injected at micro-step 50, in its
    second epoch) leaves failure.json; resumed, it finishes: result.json, no failure.json (the
    earlier one kept as failure-before-resume.json), and its lock released by the process that
    ran it; the lock file stays as the record of who ran it, which ga-report reads."""
    job = ("epochs=2", "progress=none", "hydra.run.dir=run")
    fault = {"GACLI_FAKE_OOM_ABOVE": "1", "GACLI_FAKE_OOM_FROM_MICRO_STEP": "50"}
    code, output = ga_train(*job, cwd=tmp_path, env=fault)
    assert code == 1 and "Out of device memory" in output, output
    failure = json.load(open(tmp_path / "run" / "failure.json"))
    assert not (tmp_path / "run" / "result.json").exists()

    done = subprocess.run(
        [sys.executable, "-c", FINISH_AND_CHECK_THE_LOCK, *job, "resume=run"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout + done.stderr
    assert "lock free; held: 0" in output, output
    names = set(os.listdir(tmp_path / "run"))
    assert {"result.json", "failure-before-resume.json", ".gacli.lock"} <= names, names
    assert "failure.json" not in names
    assert json.load(open(tmp_path / "run" / "failure-before-resume.json")) == failure
    assert (tmp_path / "run" / ".gacli.lock").read_text().startswith("ga-train, pid ")
    # The finished run is never written to again.
    code, output = ga_train(*job, "resume=run", cwd=tmp_path)
    assert code == 2 and "holds a finished run" in output, output


# A model whose layers draw random numbers (user_project.nets.noisy: Gaussian noise inside a
# nested Sequential, and dropout): one epoch of 45 micro-batches in windows of 4.
RANDOM_JOB = ("model._target_=user_project.nets.noisy", "epochs=1", "accum_steps=4")


def _stopped_at_micro_batch_30(run_dir, monkeypatch):
    """RANDOM_JOB in ``run_dir``, stopped as SIGTERM stops it after micro-batch 30 (in the middle
    of a window), its checkpoint saved."""
    from gacli.errors import Interrupted
    from gacli.runner.training.run import train
    from gacli.runner.training.run_state import RunCheckpoint

    batch_end = RunCheckpoint.on_train_batch_end

    def signalled_at_30(self, batch, logs=None):
        if self.offset == 0 and batch + 1 >= 30:
            self.signals.received = signal.SIGTERM
        batch_end(self, batch, logs)

    monkeypatch.setattr(RunCheckpoint, "on_train_batch_end", signalled_at_30)
    with pytest.raises(Interrupted, match="checkpoint saved"):
        train(compose_config(*RANDOM_JOB), run_dir)
    monkeypatch.undo()


def _same_weights(run_dir, other):
    measured = record(run_difference(run_dir, other))
    assert measured == 0.0
    finished = (json.load(open(os.path.join(d, "result.json"))) for d in (run_dir, other))
    assert next(finished)["weights_sha256"] == next(finished)["weights_sha256"]


def test_resume_is_exact_with_layers_that_draw_random_numbers(tmp_path, monkeypatch):
    """Stopped after micro-batch 30 and resumed: the same weights as the uninterrupted run, to
    the bit. Without the seed generators' states in the checkpoint, the resumed run draws the
    masks and noise of a fresh start."""
    import tensorflow as tf

    from gacli.runner.training.run import train

    uninterrupted, stopped = str(tmp_path / "uninterrupted"), str(tmp_path / "stopped")
    train(compose_config(*RANDOM_JOB), uninterrupted)
    _stopped_at_micro_batch_30(stopped, monkeypatch)
    newest, _ = newest_checkpoint(stopped)
    held = {name for name, _ in tf.train.list_variables(newest) if name.startswith("random_state")}
    # Dropout's and GaussianNoise's seed generators, and Keras' global one.
    assert len(held) == 3, held

    train(compose_config(*RANDOM_JOB, f"resume={stopped}"), stopped)
    _same_weights(stopped, uninterrupted)


def test_a_run_may_resume_with_recomputation_turned_on(tmp_path, monkeypatch, capsys):
    """remat changes no number, so a resumed run may turn it on (say, after running out of
    memory): stopped in the middle of a window and resumed with remat=every, it ends with the
    weights of the uninterrupted run without recomputation, its dropout and noise included."""
    from gacli.runner.training.run import train

    uninterrupted, stopped = str(tmp_path / "uninterrupted"), str(tmp_path / "stopped")
    train(compose_config(*RANDOM_JOB), uninterrupted)
    _stopped_at_micro_batch_30(stopped, monkeypatch)
    capsys.readouterr()
    train(compose_config(*RANDOM_JOB, "remat=every", f"resume={stopped}"), stopped)
    assert "recompute" in capsys.readouterr().out
    _same_weights(stopped, uninterrupted)


def _noisy_subclassed_model():
    import keras

    class Noisy(keras.Model):
        def __init__(self):
            super().__init__()
            self.front = keras.Sequential([keras.layers.GaussianNoise(1.0), keras.layers.Dense(4)])
            self.dropout = keras.layers.Dropout(0.5)

        def call(self, inputs, training=False):
            return self.dropout(self.front(inputs, training=training), training=training)

    model = Noisy()
    model(_ones())
    return model


def _ones():
    import numpy as np

    return np.ones((2, 3), "float32")


def test_random_state_lets_a_checkpoint_of_a_subclassed_model_draw_on(tmp_path):
    """The library's face: gacli.random_state(model) in a tf.train.Checkpoint; restored, a
    subclassed model's nested layers draw what they would have drawn next."""
    import numpy as np
    import tensorflow as tf

    import gacli

    model = _noisy_subclassed_model()
    checkpoint = tf.train.Checkpoint(model=model, random_state=gacli.random_state(model))
    model(_ones(), training=True)
    saved = checkpoint.save(str(tmp_path / "ckpt"))
    following = [np.array(model(_ones(), training=True)) for _ in range(2)]
    checkpoint.restore(saved).assert_consumed()
    again = [np.array(model(_ones(), training=True)) for _ in range(2)]
    assert all(np.array_equal(a, b) for a, b in zip(following, again))
    # The model alone does not hold the seed generators' states.
    tf.train.Checkpoint(model=model).restore(saved).assert_existing_objects_matched()
    assert not np.array_equal(np.array(model(_ones(), training=True)), following[0])


def test_a_checkpoint_without_random_state_resumes_and_says_so(tmp_path):
    """A checkpoint written by an earlier gacli (no random state in it) restores, with one warning
    that the random layers draw afresh; the next checkpoint is numbered on and holds the state."""
    import keras
    import tensorflow as tf

    from gacli.runner.training.run_state import RunState

    model = _noisy_subclassed_model()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.optimizer.build(model.trainable_variables)
    epoch, micro_batch = tf.Variable(1, dtype="int64"), tf.Variable(7, dtype="int64")
    older = tf.train.Checkpoint(
        model=model, optimizer=model.optimizer, epoch=epoch, micro_batch=micro_batch
    )
    tf.train.CheckpointManager(older, str(tmp_path / "checkpoints"), max_to_keep=2).save()
    state = RunState(model, str(tmp_path), chief=True)
    warnings = []
    assert state.restore(warn=warnings.append) == (1, 7)
    (warning,) = warnings
    assert "ckpt-1 was written without the state of the model's random layers" in warning
    saved = state.save(1, 8)
    assert saved.endswith("ckpt-2"), saved
    held = [name for name, _ in tf.train.list_variables(saved) if name.startswith("random_state/")]
    assert len(held) == 3, held  # the dropout's, the noise's and Keras' global generator
    state.close()


def test_a_resume_logs_no_tensorflow_deprecation_notice(tmp_path, monkeypatch):
    """A resume rewrites the ``checkpoint`` file with TensorFlow's writer, which is deprecated:
    its notice ("update_checkpoint_state ... is deprecated") is not for the user of ga-train."""
    import logging

    import keras
    import tensorflow as tf
    from tensorflow.python.util import deprecation

    from gacli.runner.training.run_state import RunState

    # TensorFlow logs each deprecation once in a process: as if none had been logged yet.
    monkeypatch.setattr(deprecation, "_PRINTED_WARNING", {})
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.optimizer.build(model.trainable_variables)
    RunState(model, str(tmp_path), chief=True).save(0, 4)
    logged = []
    handler = logging.Handler()
    handler.emit = logged.append
    logger = tf.get_logger()
    level = logger.level
    logger.setLevel(logging.WARNING)  # as ga-train sets it
    logger.addHandler(handler)
    try:
        assert RunState(model, str(tmp_path), chief=True).restore() == (0, 4)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert [record.getMessage() for record in logged] == []
