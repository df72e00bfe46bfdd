"""ga-report on damaged runs, on files it did not write, and at a terminal's width.

Runs are written by hand (result.json, .hydra/, resolved.yaml, lock file, event files) in the
layout ga-train leaves: no TensorFlow, a second or two a case. The lock file is written by
ga-train's own :func:`gacli.rundir.lock`; event files are named as TensorFlow names them
(``events.out.tfevents.<seconds>.<host>.<pid>.<number>``), which is where a run records the
process that trained it.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from gacli import rundir

HOST = "node7.example"
SWEEP_PID = 4242  # a -m sweep's jobs run one after another in this one process
METRICS = ("loss", "iou")


def _event_file(run_dir, scalars, pid, start=1_790_000_000, number=0):
    """An event file of ``scalars`` (tag -> [(step, value)]) as TensorBoard writes one."""
    from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, types_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter

    from gacli.report.run_events import use_tensorboard_stub

    use_tensorboard_stub()
    folder = os.path.join(run_dir, "tensorboard")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"events.out.tfevents.{start}.{HOST}.{pid}.{number}")
    points = sorted((step, tag, value) for tag, series in scalars.items() for step, value in series)
    with open(path, "wb") as handle:
        writer = RecordWriter(handle)
        header = event_pb2.Event(wall_time=start, file_version="brain.Event:2")
        writer.write(header.SerializeToString())
        for step, tag, value in points:  # update by update, as a run logs them
            tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, float_val=[value])
            value = summary_pb2.Summary.Value(tag=tag, tensor=tensor)
            event = event_pb2.Event(
                wall_time=start + step, step=step, summary=summary_pb2.Summary(value=[value])
            )
            writer.write(event.SerializeToString())
    return path


def make_run(run_dir, accum_steps, pid=SWEEP_PID, overrides=(), finished=True, device=False):
    """A finished run of ``accum_steps`` (micro-batch 8, 64 samples) in ``run_dir``."""
    micro, samples = 8, 64
    effective, updates = micro * accum_steps, samples // (micro * accum_steps)
    loss = 0.5 / accum_steps
    os.makedirs(os.path.join(run_dir, ".hydra"))
    listed = [f"accum_steps={accum_steps}", *overrides, "config=unet"]
    with open(os.path.join(run_dir, ".hydra", "overrides.yaml"), "w") as handle:
        yaml.safe_dump(listed, handle)
    for name in ("config.yaml", "hydra.yaml"):
        with open(os.path.join(run_dir, ".hydra", name), "w") as handle:
            yaml.safe_dump({"accum_steps": accum_steps}, handle)
    batch = dict(micro_batch_size=micro, accum_steps=accum_steps, replicas=1)
    batch["effective_batch_size"] = effective
    with open(os.path.join(run_dir, "resolved.yaml"), "w") as handle:
        yaml.safe_dump({**batch, "seed": 0, "epochs": 1, "resolved": batch}, handle)
    rundir.write_json(os.path.join(run_dir, rundir.BATCH_PLAN_FILE), {**batch, "why": "auto"})
    rundir.lock(run_dir, f"ga-train -m accum_steps=1,2,4 config=unet.yaml {' '.join(overrides)}")
    rundir.release(run_dir)
    if pid is not None:  # the lock file names this test's process: name the run's own instead
        path = os.path.join(run_dir, rundir.LOCK_FILE)
        with open(path) as handle:
            text = handle.read()
        with open(path, "w") as handle:
            handle.write(text.replace(f"pid {os.getpid()} on ", f"pid {pid} on ", 1))
    else:
        os.remove(os.path.join(run_dir, rundir.LOCK_FILE))
    steps = range(1, updates + 1)
    scalars = {
        "optimizer/step": [(s, s) for s in steps],
        "batch/update_samples": [(s, effective) for s in steps],
        "batch/micro_size": [(s, micro) for s in steps],
        "batch/accum_steps": [(s, accum_steps) for s in steps],
        "batch/replicas": [(s, 1) for s in steps],
        "batch/effective_size": [(s, effective) for s in steps],
        "throughput/mean_samples_per_sec": [(s, 500.0 + 100 * accum_steps) for s in steps],
        "memory/host_peak_rss_bytes": [(s, (800 + 40 * accum_steps) * 2**20) for s in steps],
        "gns/noise_scale": [(updates, 4.0 / accum_steps)],
        "train/loss": [(s, loss + 0.1 / s) for s in steps],
        "train/iou": [(s, 0.9 - loss / s) for s in steps],
        "val/loss": [(updates, loss + 0.05)],
        "val/iou": [(updates, 0.8)],
    }
    if device:
        scalars["memory/device_peak_bytes"] = [(s, 3 * 2**30 + accum_steps * 2**28) for s in steps]
    if pid is not None:
        _event_file(run_dir, scalars, pid, number=accum_steps)
    if finished:
        result = {
            "loss": loss + 0.1 / updates,
            "iou": 0.9 - loss / updates,
            "val_loss": loss + 0.05,
            "val_iou": 0.8,
            "skipped_micro_batches": 0.0,
            "skipped_windows": 0.0,
            "optimizer_step": updates,
            "micro_step": updates * accum_steps,
            "gradient_noise_scale": 4.0 / accum_steps,
            "effective_batch_size": effective,
            "micro_batch_size": micro,
            "accum_steps": accum_steps,
            "weights_sha256": "247cd1d7cf050734",
            "host_peak_rss_bytes": (800 + 40 * accum_steps) * 2**20,
        }
        rundir.write_json(os.path.join(run_dir, rundir.RESULT_FILE), result)
    return run_dir


def make_sweep(root, accum_steps=(1, 2, 4), **run_options):
    """A -m sweep's directory (multirun/unet/<time>/<n>_accum_steps=<k>) of finished runs."""
    sweep = os.path.join(root, "multirun", "unet", "2026-01-01_12-00-00")
    os.makedirs(sweep)
    with open(os.path.join(sweep, "multirun.yaml"), "w") as handle:
        handle.write("hydra:\n  mode: MULTIRUN\n")
    for number, accum in enumerate(accum_steps):
        make_run(os.path.join(sweep, f"{number}_accum_steps={accum}"), accum, **run_options)
    return sweep


def ga_report(*arguments, cwd, columns=None):
    """(exit code, stdout + stderr) of the installed ga-report."""
    env = {key: value for key, value in os.environ.items() if key != "COLUMNS"}
    env.update({"COLUMNS": str(columns)} if columns else {})
    script = os.path.join(os.path.dirname(sys.executable), "ga-report")
    done = subprocess.run(
        [script, *arguments], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )
    return done.returncode, done.stdout + done.stderr


def _report(folder):
    with open(os.path.join(folder, "report.json")) as handle:
        return json.load(handle)


def _rewrite(path, text, mode="w"):
    with open(path, mode) as handle:
        handle.write(text)


def _cut(path):
    with open(path, "rb") as handle:
        data = handle.read()
    _rewrite(path, data[: len(data) // 2], "wb")


def _edit_result(**changes):
    def edit(run_dir):
        path = os.path.join(run_dir, "result.json")
        with open(path) as handle:
            result = json.load(handle)
        _rewrite(path, json.dumps({**result, **changes}))

    return edit


def _event_path(run_dir):
    (name,) = os.listdir(os.path.join(run_dir, "tensorboard"))
    return os.path.join(run_dir, "tensorboard", name)


def _unfinished_failure(text):
    def edit(run_dir):
        os.remove(os.path.join(run_dir, "result.json"))
        _rewrite(os.path.join(run_dir, "failure.json"), text)

    return edit


def _into_folder(name):
    def edit(run_dir):
        path = os.path.join(run_dir, name) if name != "." else run_dir
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        if name == ".":
            _rewrite(path, "not a run\n")
        else:
            os.makedirs(path)

    return edit


# (case, how job 1 (accum_steps=2) is damaged, what ga-report says about it; None: the damage
# is in a file ga-report does not need, or one it reads up to the damage, and the run is reported).
DAMAGE = [
    (
        "result-cut",
        lambda d: _cut(f"{d}/result.json"),
        "result.json is not valid JSON (cut short?)",
    ),
    ("result-empty", lambda d: _rewrite(f"{d}/result.json", ""), "result.json is not valid JSON"),
    ("result-list", lambda d: _rewrite(f"{d}/result.json", "[0.5]"), "result.json holds a list"),
    ("result-binary", lambda d: _rewrite(f"{d}/result.json", b"\xff\xfe\x00", "wb"), "not text"),
    ("result-folder", _into_folder("result.json"), "result.json cannot be read (Is a directory)"),
    ("result-count-text", _edit_result(optimizer_step="8"), "optimizer_step is '8', not a number"),
    ("result-metric-text", _edit_result(val_loss="low"), "val_loss is 'low', not a number"),
    ("failure-cut", _unfinished_failure('{"exit_code": 1, "err'), "failure.json is not valid JSON"),
    ("failure-list", _unfinished_failure("[1]"), "failure.json holds a list"),
    ("failure-no-error", _unfinished_failure('{"exit_code": 1, "error": ""}'), None),
    (
        "overrides-unparsable",
        lambda d: _rewrite(f"{d}/.hydra/overrides.yaml", "- accum_steps=2\n- 'config=un"),
        ".hydra/overrides.yaml is not valid YAML at line 2",
    ),
    (
        "overrides-mapping",
        lambda d: _rewrite(f"{d}/.hydra/overrides.yaml", "accum_steps: 2\n"),
        ".hydra/overrides.yaml holds a dict, not a list",
    ),
    (
        "overrides-empty",
        lambda d: _rewrite(f"{d}/.hydra/overrides.yaml", ""),
        ".hydra/overrides.yaml holds nothing",
    ),
    ("overrides-folder", _into_folder(".hydra/overrides.yaml"), "overrides.yaml cannot be read"),
    ("resolved-cut", lambda d: _rewrite(f"{d}/resolved.yaml", "a: [1,\n"), "resolved.yaml is not"),
    ("resolved-list", lambda d: _rewrite(f"{d}/resolved.yaml", "- 1\n"), "resolved.yaml holds a"),
    (
        "resolved-batch-text",  # without event files, the batch comes from resolved.yaml
        lambda d: (
            shutil.rmtree(f"{d}/tensorboard"),
            _rewrite(f"{d}/resolved.yaml", "resolved: {micro_batch_size: auto}\n"),
        ),
        "resolved.yaml: micro_batch_size is 'auto', not a whole number",
    ),
    ("hydra-config-unparsable", lambda d: _rewrite(f"{d}/.hydra/config.yaml", "a: [\n"), None),
    ("hydra-yaml-unparsable", lambda d: _rewrite(f"{d}/.hydra/hydra.yaml", "\t- :\n"), None),
    ("batch-plan-cut", lambda d: _cut(f"{d}/batch_plan.json"), None),
    ("lock-file-binary", lambda d: _rewrite(f"{d}/.gacli.lock", b"\x00\xff'", "wb"), None),
    ("events-cut", lambda d: _cut(_event_path(d)), None),
    ("events-empty", lambda d: _rewrite(_event_path(d), ""), None),
    ("events-garbage", lambda d: _rewrite(_event_path(d), os.urandom(600), "wb"), None),
    ("events-folder", lambda d: _into_folder(_event_path(d))(d), "cannot be read (Is a directory)"),
    ("run-is-a-file", _into_folder("."), "a file, not a run folder"),
]


@pytest.mark.parametrize("damage, reason", [c[1:] for c in DAMAGE], ids=[c[0] for c in DAMAGE])
def test_a_damaged_run_is_named_and_the_others_reported(damage, reason, tmp_path):
    sweep = make_sweep(tmp_path)
    damaged = os.path.join(sweep, "1_accum_steps=2")
    damage(damaged)
    code, output = ga_report(sweep, "--no-plots", cwd=tmp_path)
    assert code == 0 and "Traceback" not in output, output
    data = _report(sweep)
    skipped = [line for line in output.splitlines() if line.startswith("ga-report: skipped")]
    if reason is None:
        assert not skipped and not data["skipped"], output
        assert [row["accum_steps"] for row in data["runs"]] == [1, 2, 4]
        return
    assert skipped == [f"ga-report: skipped {damaged}: {data['skipped'][0]['reason']}"], output
    assert reason in skipped[0]
    assert data["skipped"][0]["path"] == damaged
    assert [row["accum_steps"] for row in data["runs"]] == [1, 4]
    assert [row["val_loss"] for row in data["runs"]] == [0.55, 0.175]
    text = open(os.path.join(sweep, "report.md")).read()
    assert f"- `{damaged}`: {data['skipped'][0]['reason']}" in text.split("## Runs left out")[1]


def test_cut_event_files_keep_the_updates_before_the_cut(tmp_path):
    sweep = make_sweep(tmp_path, accum_steps=(1,))
    run_dir = os.path.join(sweep, "0_accum_steps=1")
    os.remove(os.path.join(run_dir, "result.json"))
    _cut(_event_path(run_dir))
    code, output = ga_report(sweep, cwd=tmp_path)  # with plots: a run with half its events
    assert code == 0, output
    (row,) = _report(sweep)["runs"]
    assert 0 < row["updates"] < 8 and row["samples_seen"] == 8 * row["updates"]
    assert row["status"] == "unfinished"


def test_unreadable_files_and_folders_are_named(tmp_path, monkeypatch, capsys):
    # The tests run as root, whom file permissions do not stop: the refusals are made here.
    from gacli.report import cli as report

    sweep = make_sweep(tmp_path, accum_steps=(1, 2, 4, 8))
    unreadable_file = os.path.join(sweep, "1_accum_steps=2", "resolved.yaml")
    unreadable_folder = os.path.join(sweep, "3_accum_steps=8")
    real_open, real_scandir = open, os.scandir

    def refusing_open(path, *arguments, **options):
        if os.fspath(path) == unreadable_file:
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, *arguments, **options)

    def refusing_scandir(path="."):
        if os.fspath(path) == unreadable_folder:
            raise PermissionError(13, "Permission denied", path)
        return real_scandir(path)

    monkeypatch.setattr("builtins.open", refusing_open)
    monkeypatch.setattr(os, "scandir", refusing_scandir)
    assert report.main([sweep, "--no-plots"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"ga-report: skipped {os.path.dirname(unreadable_file)}: resolved.yaml cannot be read "
        "(Permission denied)",
        f"ga-report: skipped {unreadable_folder}: cannot be listed (Permission denied)",
    ]
    assert [row["accum_steps"] for row in _report(sweep)["runs"]] == [1, 4]


def test_no_readable_run_is_exit_2_with_each_named(tmp_path):
    sweep = make_sweep(tmp_path, accum_steps=(1, 2))
    for run_dir in os.listdir(sweep):
        if run_dir != "multirun.yaml":
            _rewrite(os.path.join(sweep, run_dir, "result.json"), '{"loss": 0.')
    code, output = ga_report(sweep, cwd=tmp_path)
    lines = output.splitlines()
    assert code == 2 and "Traceback" not in output, output
    assert len(lines) == 3 and all("result.json is not valid JSON" in s for s in lines[:2])
    assert lines[2].startswith(f"ga-report: no run under {sweep} could be read: each of the 2")
    assert not os.path.exists(os.path.join(sweep, "report.json"))


def test_a_path_that_is_not_a_folder_is_named_beside_others(tmp_path):
    sweep = make_sweep(tmp_path, accum_steps=(1, 2))
    code, output = ga_report(sweep, "missing", "--out", "out", "--no-plots", cwd=tmp_path)
    assert code == 0 and "ga-report: skipped missing: not a directory" in output, output
    assert len(_report(tmp_path / "out")["runs"]) == 2


# Item: other people's files. Each file ga-report writes, already there and not its own.
OWN_FILES = ["report.md", "report.json", "validation.png", "speed_memory.png", "loss_time.png"]


@pytest.mark.parametrize("name", OWN_FILES + ["report.md/"])
def test_files_it_did_not_write_are_never_replaced(name, tmp_path):
    sweep = make_sweep(tmp_path, accum_steps=(1, 2))
    out = tmp_path / "mine"
    out.mkdir()
    if name.endswith("/"):
        (out / name).mkdir()
    else:
        (out / name).write_bytes(b"\x89PNG my own figure" if name.endswith(".png") else b"# mine\n")
    before = {path.name: path.read_bytes() for path in out.iterdir() if path.is_file()}
    code, output = ga_report(sweep, "--out", str(out), cwd=tmp_path, columns=200)
    assert code == 2 and "Traceback" not in output, output
    path = os.path.join(out, name.rstrip("/"))
    assert output.splitlines() == [
        f"ga-report: {path} is there and ga-report did not write it (it has no ga-report mark), "
        "so it is left as it is and nothing was written: ga-report never replaces files it did "
        f"not write. Write the report into another folder, e.g. ga-report {sweep} --out "
        f"{out}/ga-report, or move {name.rstrip('/')} away first."
    ]
    after = {path.name: path.read_bytes() for path in out.iterdir() if path.is_file()}
    assert after == before  # nothing written, nothing replaced, no scratch file left
    code, output = ga_report(sweep, "--out", f"{out}/ga-report", cwd=tmp_path)  # as told
    assert code == 0, output


def test_its_own_files_are_replaced_and_marked(tmp_path):
    sweep = make_sweep(tmp_path, accum_steps=(1, 2))
    for _ in range(2):
        code, output = ga_report(sweep, cwd=tmp_path)
        assert code == 0, output
    names = sorted(os.listdir(sweep))
    assert names == sorted(["multirun.yaml", "0_accum_steps=1", "1_accum_steps=2", *OWN_FILES])
    assert open(os.path.join(sweep, "report.md")).readline().startswith("<!-- written by ga-report")
    assert _report(sweep)["written_by"] == "ga-report"
    # What ga-report wrote before its files carried the mark is its own too.
    data = _report(sweep)
    del data["written_by"]
    _rewrite(os.path.join(sweep, "report.json"), json.dumps(data))
    _rewrite(os.path.join(sweep, "report.md"), "# ga-report\n\n2 runs under ...\n")
    code, output = ga_report(sweep, "--no-plots", cwd=tmp_path)
    assert code == 0 and _report(sweep)["written_by"] == "ga-report", output


def test_a_failed_write_leaves_the_earlier_report_whole(tmp_path, monkeypatch):
    from gacli.report import cli as report

    sweep = make_sweep(tmp_path, accum_steps=(1, 2))
    assert report.main([sweep, "--no-plots"]) == 0
    before = open(os.path.join(sweep, "report.json")).read()

    def full_disk(value, handle, **options):
        handle.write('{"written_by": "ga-re')
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(json, "dump", full_disk)
    with pytest.raises(OSError):
        report.main([sweep, "--no-plots"])
    assert open(os.path.join(sweep, "report.json")).read() == before
    assert not [name for name in os.listdir(sweep) if name.startswith(".ga-report-")]


# Item: only real metrics are metric columns.
def test_settings_and_counters_in_result_json_are_not_metrics(tmp_path):
    sweep = make_sweep(tmp_path, accum_steps=(1, 2))
    for run_dir in ("0_accum_steps=1", "1_accum_steps=2"):
        # A config key and a text field in result.json, as a later ga-train might write them.
        _edit_result(seed=0, epochs=1, replicas=1, precision="fp32")(os.path.join(sweep, run_dir))
        # A swept setting whose name starts as a metric column's key does.
        overrides = os.path.join(sweep, run_dir, ".hydra", "overrides.yaml")
        _rewrite(overrides, f"- {run_dir[2:]}\n- train_fraction=0.{run_dir[-1]}\n")
        shutil.rmtree(os.path.join(sweep, run_dir, "tensorboard"))  # result.json alone
    code, output = ga_report(sweep, "--no-plots", cwd=tmp_path, columns=240)
    assert code == 0, output
    data = _report(sweep)
    metric_columns = [
        c["key"]
        for c in data["columns"]
        if c["key"].startswith(("train_", "val_")) and c["key"] not in data["swept"]
    ]
    assert metric_columns == [
        f"{side}_{metric}{best}"
        for metric in METRICS
        for side in ("train", "val")
        for best in ("", "_best")
    ]
    assert data["runs"][1]["accum_steps"] == 2 and data["runs"][1]["train_loss"] == 0.275
    assert data["swept"] == ["accum_steps", "train_fraction"]
    for word in ("accum_steps best", "micro_batch_size", "optimizer_step", "sha256", "seed"):
        assert word not in output, output
    assert "train fraction" not in output and "train_fraction" in output


# Item: the terminal table at 120 and 200 columns.
def _table_rows(output):
    """The data lines of the table rich drew (between the header's rule and the bottom)."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("┡"))
    end = next(i for i, line in enumerate(lines) if line.startswith("└"))
    return lines[start + 1 : end], lines


@pytest.mark.parametrize("width", [120, 200])
def test_the_terminal_table_is_one_line_a_run(width, tmp_path):
    sweep = make_sweep(tmp_path, accum_steps=(1, 2, 4, 8), device=True)
    # A second swept key, and a failed run with a long reason.
    run_dir = os.path.join(sweep, "3_accum_steps=8")
    os.remove(os.path.join(run_dir, "result.json"))
    message = "Out of device memory while training: " + "x" * 200
    rundir.write_json(os.path.join(run_dir, "failure.json"), {"exit_code": 1, "error": message})
    for number, accum_steps in enumerate((1, 2, 4, 8)):
        listed = [f"accum_steps={accum_steps}", f"optimizer.learning_rate={accum_steps / 1000}"]
        path = os.path.join(sweep, f"{number}_accum_steps={accum_steps}", ".hydra")
        _rewrite(os.path.join(path, "overrides.yaml"), yaml.safe_dump([*listed, "config=unet"]))
    code, output = ga_report(sweep, "--no-plots", cwd=tmp_path, columns=width)
    assert code == 0, output
    data = _report(sweep)
    assert len(data["columns"]) == 22  # every column is in report.json (and report.md)
    rows, lines = _table_rows(output)
    top = next(i for i, line in enumerate(lines) if line.startswith("┏"))
    table = lines[top : lines.index(rows[-1]) + 3]  # the table and the line under it
    assert all(len(line.rstrip()) <= width for line in table), output
    assert len(rows) == 4, output  # one line a run: nothing wrapped
    assert "…" not in output, output  # nothing cut
    for line, row in zip(rows, data["runs"]):
        cells = [cell.strip() for cell in line.strip("│").split("│")]
        assert cells[0] == row["run"]
        assert str(row["accum_steps"]) in cells and str(row["optimizer.learning_rate"]) in cells
        assert f"{row['val_loss']:.4f}" in cells if row["val_loss"] is not None else "-" in cells
        assert cells[-1] == row["status_short"]
    # A failed run's reason is in report.md, not in the terminal's one line.
    reason = "failed (exit 1: Out of device memory while training"
    assert reason not in output and reason in open(os.path.join(sweep, "report.md")).read()
    shown = len(rows[0].split("│")) - 2
    also = output.split("also in report.md and report.json:")[1].split("wrote report.md")[0]
    assert shown == (9 if width == 120 else 17), output
    assert also.count(",") + 1 == 20 - shown  # 20 shown columns (not micro, replicas)


# Item: a sweep whose runs shared one process.
@pytest.mark.parametrize(
    "processes, shared",
    [("one", True), ("each its own", False), ("not recorded", None)],
)
def test_the_memory_panel_says_when_runs_shared_one_process(processes, shared, tmp_path):
    from PIL import Image

    from gacli.report.cli import SHARED_PROCESS_NOTE

    if processes == "one":
        sweep = make_sweep(tmp_path)
    elif processes == "each its own":
        sweep = os.path.join(tmp_path, "outputs", "unet")
        for accum_steps in (1, 2, 4):
            make_run(os.path.join(sweep, f"run{accum_steps}"), accum_steps, pid=100 + accum_steps)
    else:
        sweep = make_sweep(tmp_path, pid=None)
    code, output = ga_report(sweep, cwd=tmp_path)
    assert code == 0, output
    assert _report(sweep)["runs_shared_one_process"] is shared
    with Image.open(os.path.join(sweep, "speed_memory.png")) as image:
        notes = json.loads(image.text["gacli-notes"])
    text = open(os.path.join(sweep, "report.md")).read()
    if shared is False:
        assert notes == {} and "Peak memory:" not in text
    else:
        note = SHARED_PROCESS_NOTE[shared]
        assert notes == {"host RSS peak memory (MiB)": note}
        assert f"Peak memory: {note}." in text
