"""ga-report on values no ga-train run writes, and on runs that are not plain finished ones.

Two classes of input, each with its members:

- Every number and text ga-report reads from a run directory, made unreadable: a folder name that
  is not UTF-8, files nested deeper than Python recurses, numbers too large for a float, NaN and
  infinity, text where numbers belong, lone surrogates, FIFOs. The run is left out with a one-line
  reason; the others are reported (exit code 0); nothing prints a traceback.
- Runs that are not plain training runs: a finished ``probe=batch`` (``probe.json``, no
  ``result.json``), a finished ``check=equivalence`` (``equivalence.json``), and a run another
  process is training in now (it holds the lock, :func:`gacli.rundir.lock`). ga-report says what
  each is; ``ga-train resume=`` refuses each with what to type instead (exit code 2).

Runs are written by hand as in tests/report/test_report_faults.py: no TensorFlow.
"""

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from test_report_faults import _event_file, _report, _rewrite, ga_report, make_run, make_sweep

from gacli import rundir
from gacli.errors import ConfigError

DEEP = "[" * 100_000 + "]" * 100_000


def _edit_json(name, **changes):
    def edit(run_dir):
        path = os.path.join(run_dir, name)
        with open(path) as handle:
            value = json.load(handle)
        _rewrite(path, json.dumps({**value, **changes}))

    return edit


def _raw_result_value(key, literal):
    """result.json with ``key``'s value replaced by ``literal`` as written (NaN, 9999...)."""

    def edit(run_dir):
        path = os.path.join(run_dir, "result.json")
        with open(path) as handle:
            value = json.load(handle)
        value[key] = "@@"
        _rewrite(path, json.dumps(value).replace('"@@"', literal))

    return edit


def _events(scalars, pid=77):
    """A second process's event file with these scalars (tag -> [(step, value)])."""

    def edit(run_dir):
        _event_file(run_dir, scalars, pid, start=1_790_000_100, number=9)

    return edit


def _fifo(name):
    def edit(run_dir):
        os.remove(os.path.join(run_dir, name))
        os.mkfifo(os.path.join(run_dir, name))

    return edit


def _non_utf8_event_name(run_dir):
    folder = os.fsencode(os.path.join(run_dir, "tensorboard"))
    (name,) = os.listdir(folder)
    os.rename(os.path.join(folder, name), os.path.join(folder, name + b".\xff"))


def _unfinished(edit):
    def both(run_dir):
        os.remove(os.path.join(run_dir, "result.json"))
        edit(run_dir)

    return both


# (folder name, how the run is damaged, what ga-report says about it). Each is one member of
# the class "a value ga-report reads is not one ga-train writes".
DAMAGED = [
    ("result-deep", lambda d: _rewrite(f"{d}/result.json", DEEP), "result.json is nested too"),
    ("val-loss-400-digits", _raw_result_value("val_loss", "9" * 400), "a 400-digit number"),
    ("val-loss-nan", _raw_result_value("val_loss", "NaN"), "val_loss is nan, not a finite"),
    ("loss-infinity", _raw_result_value("loss", "Infinity"), "loss is inf, not a finite"),
    ("updates-huge", _raw_result_value("optimizer_step", "1" * 401), "optimizer_step is a 401"),
    ("peak-minus-inf", _raw_result_value("host_peak_rss_bytes", "-Infinity"), "is -inf, not"),
    ("noise-text", _edit_json("result.json", gradient_noise_scale="4"), "is '4', not a number"),
    ("result-surrogate", _raw_result_value("val_iou", '"\\udcff"'), "not Unicode"),
    ("key-surrogate", _edit_json("result.json", **{"val_\udcff": 1.0}), "not Unicode"),
    ("result-fifo", _fifo("result.json"), "result.json is not a regular file"),
    ("resolved-deep", lambda d: _rewrite(f"{d}/resolved.yaml", DEEP), "resolved.yaml is nested"),
    (
        "resolved-digits",
        lambda d: _rewrite(f"{d}/resolved.yaml", "seed: " + "7" * 5000 + "\n"),
        "resolved.yaml is not ga-train's",
    ),
    (
        "overrides-deep",
        lambda d: _rewrite(f"{d}/.hydra/overrides.yaml", DEEP),
        ".hydra/overrides.yaml is nested",
    ),
    (
        "overrides-self",
        lambda d: _rewrite(f"{d}/.hydra/overrides.yaml", "&a [*a]\n"),
        "refers to itself",
    ),
    (
        "overrides-surrogate",
        lambda d: _rewrite(f"{d}/.hydra/overrides.yaml", '- "lr=\\uDCFF"\n'),
        "not Unicode",
    ),
    (
        "micro-batch-nan",
        _events({"batch/micro_size": [(9, float("nan"))]}),
        "tensorboard: batch/micro_size is nan, not a finite number",
    ),
    (
        "accum-inf",
        _events({"batch/accum_steps": [(9, float("inf"))]}),
        "batch/accum_steps is inf",
    ),
    (
        "resolved-inf",  # without event files, the batch comes from resolved.yaml
        lambda d: (
            [os.remove(os.path.join(d, "tensorboard", n)) for n in os.listdir(f"{d}/tensorboard")],
            _rewrite(f"{d}/resolved.yaml", "resolved: {micro_batch_size: .inf}\n"),
        ),
        "resolved.yaml: micro_batch_size is inf",
    ),
    ("events-name-not-utf8", _non_utf8_event_name, "an event file's name is not valid UTF-8"),
    (
        "failure-surrogate",
        _unfinished(
            lambda d: _rewrite(f"{d}/failure.json", '{"error": "\\ud800", "exit_code": 1}')
        ),
        "failure.json holds text that is not Unicode",
    ),
    (
        "failure-deep",
        _unfinished(lambda d: _rewrite(f"{d}/failure.json", '{"error": ' + DEEP + "}")),
        "failure.json is nested too deeply",
    ),
    (
        "probe-no-critical",
        lambda d: (
            os.remove(f"{d}/result.json"),
            rundir.write_json(f"{d}/probe.json", {"critical_batch_size": 64, "sizes": []}),
        ),
        "probe.json: no size is its critical_batch_size 64",
    ),
    (
        "check-passed-text",
        lambda d: (
            os.remove(f"{d}/result.json"),
            rundir.write_json(f"{d}/equivalence.json", {"passed": "yes", "window": {}}),
        ),
        "equivalence.json: passed is 'yes', not true or false",
    ),
]


def test_each_unreadable_value_leaves_its_run_out_with_one_line(tmp_path):
    sweep = make_sweep(tmp_path, accum_steps=(1, 2))
    damaged = {}
    for number, (name, damage, reason) in enumerate(DAMAGED, start=2):
        run_dir = make_run(os.path.join(sweep, f"{number}_{name}"), 4)
        damage(run_dir)
        damaged[run_dir] = reason
    # A folder whose name is not UTF-8 (TensorBoard's reader raised UnicodeEncodeError on it).
    not_utf8 = os.fsdecode(os.path.join(os.fsencode(sweep), b"99_run-\xff"))
    make_run(not_utf8, 4)
    shown = os.path.join(sweep, "99_run-\\xff")
    damaged[shown] = "its path is not valid UTF-8"

    code, output = ga_report(sweep, cwd=tmp_path)  # with plots
    assert code == 0 and "Traceback" not in output, output
    data = _report(sweep)
    assert [row["accum_steps"] for row in data["runs"]] == [1, 2]
    reasons = {place["path"]: place["reason"] for place in data["skipped"]}
    assert sorted(reasons) == sorted(damaged), output
    for path, reason in damaged.items():
        assert reason in reasons[path], (path, reasons[path])
        assert f"ga-report: skipped {path}: {reasons[path]}" in output.splitlines()
        assert "\n" not in reasons[path] and len(reasons[path]) < 160
    report = open(os.path.join(sweep, "report.md"), encoding="utf-8").read()
    assert f"- `{shown}`: its path is not valid UTF-8" in report


def test_values_a_diverged_or_damaged_event_file_holds_are_reported(tmp_path):
    # NaN and infinity in the event files: a diverged run's loss is reported as it was; a wall
    # time, a peak or a sample count that is not finite is no measurement and is left out.
    sweep = make_sweep(tmp_path, accum_steps=(1, 2))
    run_dir = os.path.join(sweep, "1_accum_steps=2")
    os.remove(os.path.join(run_dir, "result.json"))
    _events(
        {
            "optimizer/step": [(5, 5)],
            "batch/update_samples": [(5, float("nan"))],
            "memory/host_peak_rss_bytes": [(5, float("inf"))],
            "train/loss": [(5, float("nan"))],
            "val/loss": [(5, float("inf"))],
        }
    )(run_dir)
    path = os.path.join(run_dir, "tensorboard")
    (later,) = [name for name in os.listdir(path) if name.endswith(".9")]
    # A record whose wall time is NaN is the process's last event: its time is not counted.
    from tensorboard.compat.proto import event_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter

    with open(os.path.join(path, later), "ab") as handle:
        RecordWriter(handle).write(event_pb2.Event(wall_time=float("nan")).SerializeToString())
    code, output = ga_report(sweep, "--sort", "val_loss", cwd=tmp_path)
    assert code == 0 and "Traceback" not in output, output
    rows = {row["accum_steps"]: row for row in _report(sweep)["runs"]}
    diverged = rows[2]
    assert diverged["status"] == "unfinished" and diverged["updates"] == 5
    assert diverged["samples_seen"] == 5 * 16  # the NaN count taken as a full window
    assert diverged["host_peak_rss_bytes"] == 880 * 2**20  # the first file's; inf left out
    assert diverged["train_loss"] is None and diverged["val_loss"] is None  # NaN, inf: JSON null
    assert diverged["wall_seconds"] == 4 + 5  # 4 s in the first file, 5 in the second
    assert [row["accum_steps"] for row in _report(sweep)["runs"]] == [1, 2]  # inf sorts last


def _loss(name):
    """An edit: the run trained the loss ``name`` (resolved.yaml's ``resolved.loss``)."""

    def edit(run_dir):
        import yaml

        path = os.path.join(run_dir, "resolved.yaml")
        with open(path) as handle:
            config = yaml.safe_load(handle)
        config["resolved"]["loss"] = name
        _rewrite(path, yaml.safe_dump(config))

    return edit


def test_a_best_loss_is_marked_only_among_runs_of_one_loss(tmp_path):
    sweep = make_sweep(tmp_path, accum_steps=(1, 2, 4))
    runs = sorted(os.listdir(sweep))[:3]
    for name, loss in zip(runs, ("sparse_categorical_crossentropy",) * 2 + ("mean_squared_error",)):
        _loss(loss)(os.path.join(sweep, name))
    code, output = ga_report(sweep, "--no-plots", cwd=tmp_path, columns=200)
    assert code == 0 and "Traceback" not in output, output
    data = _report(sweep)
    assert not {"train_loss", "train_loss_best", "val_loss", "val_loss_best"} & set(data["best"])
    assert {"samples_per_sec", "wall_seconds"} <= set(data["best"]), data["best"]  # the others
    why = (
        "no best train or val loss is marked: the runs trained different losses "
        "(sparse_categorical_crossentropy in 0, 1; mean_squared_error in 2)"
    )
    assert data["no_best_loss"].startswith(why), data["no_best_loss"]
    assert why in " ".join(output.split()), output
    report = open(os.path.join(sweep, "report.md")).read()
    assert f"Losses: {why}" in report and "| **0.1" not in report, report
    # One loss: its best is marked again.
    _loss("sparse_categorical_crossentropy")(os.path.join(sweep, runs[2]))
    code, output = ga_report(sweep, "--no-plots", cwd=tmp_path)
    assert code == 0, output
    data = _report(sweep)
    assert data["no_best_loss"] is None and data["best"]["val_loss"] == 0.5 / 4 + 0.05


def test_the_command_of_a_run_of_the_user_s_modules_sets_their_pythonpath(tmp_path):
    sweep = make_sweep(tmp_path, accum_steps=(1, 2))
    first, second = sorted(os.listdir(sweep))[:2]
    import yaml

    path = os.path.join(sweep, first, "resolved.yaml")
    with open(path) as handle:
        config = yaml.safe_load(handle)
    config["resolved"]["pythonpath"] = "/home/me/my project:/opt/lib"  # as resolved.yaml keeps it
    _rewrite(path, yaml.safe_dump(config))
    code, output = ga_report(sweep, "--no-plots", cwd=tmp_path)
    assert code == 0, output
    commands = {row["run"]: row["command"] for row in _report(sweep)["runs"]}
    assert commands["0"] == (
        "PYTHONPATH='/home/me/my project:/opt/lib' ga-train config=unet.yaml accum_steps=1"
    )
    assert commands["1"] == "ga-train config=unet.yaml accum_steps=2"  # installed modules only
    report = open(os.path.join(sweep, "report.md")).read()
    assert f"- `0`: `{commands['0']}`" in report, report


def test_epoch_logs_keep_only_finite_numbers(tmp_path):
    from types import SimpleNamespace

    from gacli.runner.training.run_state import EPOCH_LOGS, RunState

    os.makedirs(tmp_path / "checkpoints")
    _rewrite(
        str(tmp_path / "checkpoints" / EPOCH_LOGS),
        '{"1": {"loss": 0.5, "val_loss": NaN, "iou": "high", "acc": ' + "9" * 400 + "}, "
        '"2": [1], "3": {"loss": 0.25, "ok": true}}',
    )
    state = SimpleNamespace(run_dir=str(tmp_path))
    assert RunState.epoch_logs(state) == {"1": {"loss": 0.5}, "3": {"loss": 0.25}}
    assert RunState.epoch_logs(state, 2) == {}
    _rewrite(str(tmp_path / "checkpoints" / EPOCH_LOGS), DEEP)
    assert RunState.epoch_logs(state, 1) == {}


# Runs that are not plain training runs.


def _job(run_dir, overrides):
    os.makedirs(os.path.join(run_dir, ".hydra"))
    _rewrite(os.path.join(run_dir, ".hydra", "overrides.yaml"), json.dumps(list(overrides)))
    rundir.lock(run_dir, f"ga-train {' '.join(overrides)}")
    rundir.release(run_dir)
    return run_dir


def make_probe(run_dir):
    """A finished probe=batch run as batch_probe.probe_batch leaves it: no result.json."""
    _job(run_dir, ["probe=batch"])
    sizes = [
        dict(effective_batch_size=size, accum_steps=size // 8, updates=256 // size, loss=loss,
             val_loss=loss + 0.1, val_accuracy=0.9, samples_per_second=900.0, seconds=0.5,
             run_dir=f"branches/effective_{size}")
        for size, loss in ((16, 0.3), (32, 0.31), (64, 0.6))
    ]  # fmt: skip
    record = dict(micro_batch_size=8, samples=256, tolerance=0.1, sizes=sizes)
    rundir.write_json(os.path.join(run_dir, "probe.json"), {**record, "critical_batch_size": 32})
    for row in sizes:  # each branch is a finished run of its own
        branch = os.path.join(run_dir, row["run_dir"])
        os.makedirs(branch)
        rundir.write_json(os.path.join(branch, "result.json"), {"val_loss": row["val_loss"]})
    return run_dir


def make_check(run_dir, passed=True):
    """A check=equivalence run: equivalence.json; failure.json too when the check failed."""
    _job(run_dir, ["check=equivalence"])
    window = dict(samples=64, accum_steps=4, micro_batch_size=8, replicas=2, wrapper="model")
    rundir.write_json(
        os.path.join(run_dir, "equivalence.json"),
        {"passed": passed, "max_abs_diff": 1e-7, "window": window, "verdict": "..."},
    )
    if not passed:
        rundir.record_failure(run_dir, 1, "not equivalent: 2 weights differ")
    return run_dir


def make_interrupted(run_dir, overrides=()):
    """An unfinished run with an intact-looking checkpoint (what has_restorable_checkpoint
    checks: an index ending with TensorFlow's marker, its data shard)."""
    make_run(run_dir, 2, overrides=overrides, finished=False)
    folder = os.path.join(run_dir, "checkpoints")
    os.makedirs(folder)
    _rewrite(
        os.path.join(folder, "ckpt-1.index"),
        b"x" + (0xDB4775248B80FB57).to_bytes(8, "little"),
        "wb",
    )
    _rewrite(os.path.join(folder, "ckpt-1.data-00000-of-00001"), b"weights", "wb")
    return run_dir


@pytest.fixture
def live(tmp_path):
    """``hold(run_dir)``: another process holds the run's lock (as a training ga-train does; one
    that resumed, as the run may hold checkpoints) until the test ends."""
    holders = []

    def hold(run_dir):
        script = (
            "import sys, time\nfrom gacli import rundir\n"
            "rundir.lock(sys.argv[1], 'ga-train accum_steps=2', resume=True)\n"
            "print('held', flush=True)\n"
            "time.sleep(120)\n"
        )
        process = subprocess.Popen(
            [sys.executable, "-c", script, run_dir], stdout=subprocess.PIPE, text=True
        )
        holders.append(process)
        assert process.stdout.readline() == "held\n"
        return process

    yield hold
    for process in holders:
        process.kill()
        process.wait()


def test_probe_check_and_live_runs_are_shown_as_what_they_are(tmp_path, live):
    root = tmp_path / "outputs"
    make_probe(str(root / "probe"))
    make_check(str(root / "check"))
    make_check(str(root / "failed-check"), passed=False)
    running = make_interrupted(str(root / "running"))
    make_interrupted(str(root / "stopped"))
    holder = live(running)
    code, output = ga_report(str(root), "--no-plots", "--sort", "run", cwd=tmp_path)
    assert code == 0 and "Traceback" not in output and "skipped" not in output, output
    rows = {row["run"]: row for row in _report(root)["runs"]}
    assert {key: row["status_text"] for key, row in rows.items()} == {
        "probe": "finished (probe=batch: critical batch 32)",
        "check": "finished (check=equivalence: passed)",
        "failed-check": "failed (check=equivalence: not equivalent)",
        "running": f"running (pid {holder.pid} on {socket.gethostname()})",
        "stopped": "interrupted (resumable)",
    }
    assert [rows[key]["status"] for key in ("probe", "running")] == ["finished", "running"]
    batch = ("micro_batch_size", "accum_steps", "replicas", "effective_batch_size")
    assert [rows["probe"][key] for key in batch] == [8, 4, 1, 32]
    assert [rows["check"][key] for key in batch] == [8, 4, 2, 64]
    assert rows["probe"]["val_loss"] == pytest.approx(0.41) and rows["probe"]["updates"] == 8
    assert rows["probe"]["val_accuracy"] == 0.9
    assert "? x ?" not in output and "8 x 4 x 1 = 32" in output, output
    # The holder gone, the same run is interrupted again.
    holder.kill()
    holder.wait()
    code, output = ga_report(str(root), "--no-plots", cwd=tmp_path)
    assert code == 0, output
    assert {row["run"]: row["status"] for row in _report(root)["runs"]}["running"] == "interrupted"


def ga_train(*arguments, cwd):
    script = os.path.join(os.path.dirname(sys.executable), "ga-train")
    done = subprocess.run(
        [script, *arguments], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    return done.returncode, done.stdout + done.stderr


def test_resume_refuses_finished_probes_and_checks_and_live_runs(tmp_path, live):
    outputs = tmp_path / "outputs" / "default"
    probe = make_probe(str(outputs / "2030-01-01_00-00-00-000000"))
    check = make_check(str(outputs / "2030-01-02_00-00-00-000000"))
    running = make_interrupted(str(tmp_path / "elsewhere" / "running"))
    live(running)

    def relative(path):  # resume=true names the runs under outputs/ as it finds them
        return os.path.relpath(path, tmp_path)

    cases = [
        (f"resume={probe}", f"{probe} holds a finished probe=batch run (its probe.json"),
        ("probe=batch resume=true", f"{relative(probe)} holds a finished probe=batch run"),
        (f"resume={check}", f"{check} holds a finished check=equivalence run"),
        ("check=equivalence resume=true", f"{relative(check)} holds a finished check="),
        (f"resume={running}", f"{running} is running now (ga-train, pid "),
    ]
    for arguments, message in cases:
        started = time.monotonic()
        code, output = ga_train(*arguments.split(), cwd=tmp_path)
        assert code == 2 and "Traceback" not in output, (arguments, output)
        lines = output.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (arguments, output)
        assert "there is nothing to resume" in lines[0] and "without resume=" in lines[0]
        assert time.monotonic() - started < 60  # refused before TensorFlow loads
    # resume=true passes over finished runs of the command to the newest that is running.
    live(make_interrupted(str(outputs / "2031-01-01_00-00-00-000000")))
    code, output = ga_train("accum_steps=2", "resume=true", cwd=tmp_path)
    assert code == 2 and "2031-01-01_00-00-00-000000 is running now" in output, output


def test_a_worker_joins_the_live_run_its_chief_resumes(tmp_path, live, monkeypatch):
    """A requeued multi-worker SLURM job starts its tasks again, each with resume=<the run>: the
    chief locks the run first, and the other tasks must join it, not be refused as a second run."""
    running = make_interrupted(str(tmp_path / "running"))
    live(running)
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.setenv("SLURM_PROCID", "1")
    rundir.check_resumable(running, f"resume={running}")  # worker 1: joins
    monkeypatch.setenv("SLURM_PROCID", "0")
    with pytest.raises(ConfigError, match="is running now"):
        rundir.check_resumable(running, f"resume={running}")
