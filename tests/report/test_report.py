"""ga-report as a user runs it: on a real 3-run sweep of a tiny UNet, and on a resumed run."""

import glob
import json
import os
import resource
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers import event_tags, ga_report, ga_train, interrupt_after_checkpoints, record, scalars

# The UNet recipe, tiny: 64 training samples of 16x16, 8 a micro-batch, one epoch.
TINY_UNET = (
    "config=unet.yaml",
    "epochs=1",
    "dataset.num_samples=73",
    "dataset.image_size=16",
    "model.depth=2",
    "progress=none",
)
TRAIN_SAMPLES = 64


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """(the folder the sweep ran in, the sweep's directory) of ``-m accum_steps=1,2,4``."""
    cwd = tmp_path_factory.mktemp("sweep")
    code, output = ga_train("-m", "accum_steps=1,2,4", *TINY_UNET, cwd=cwd)
    assert code == 0, output
    (sweep_dir,) = glob.glob(str(cwd / "multirun" / "unet" / "*"))
    return cwd, sweep_dir


@pytest.fixture(scope="module")
def report(sweep, tmp_path_factory):
    """(exit code, output, report.json) of ga-report on the sweep, files written to --out."""
    out = tmp_path_factory.mktemp("report")
    code, output = ga_report(sweep[1], "--out", str(out), cwd=sweep[0])
    data = json.loads((out / "report.json").read_text()) if code == 0 else None
    return code, output, data, out


# Slow: the tests of the sweep fixture share one ga-train sweep of three UNet runs.
@pytest.mark.slow
def test_the_table_has_one_row_per_run_with_its_effective_batch(report):
    code, output, data, out = report
    assert code == 0, output
    assert "Traceback" not in output
    rows = data["runs"]
    assert [row["accum_steps"] for row in rows] == [1, 2, 4]
    assert [row["effective_batch_size"] for row in rows] == [8, 16, 32]
    assert data["swept"] == ["accum_steps"]
    for row in rows:
        assert f"8 x {row['accum_steps']} x 1 = {row['effective_batch_size']}" in output
        assert row["status"] == "finished"
        # Every update's samples, each update once: one pass over the training set.
        assert row["samples_seen"] == TRAIN_SAMPLES
        assert row["updates"] == TRAIN_SAMPLES // row["effective_batch_size"]
    text = (out / "report.md").read_text()
    assert text.count("| 8 x ") == 3
    for accum_steps in (1, 2, 4):
        assert f"ga-train config=unet.yaml accum_steps={accum_steps} epochs=1" in text


@pytest.mark.slow
def test_values_equal_each_runs_result_and_event_file(report):
    _, output, data, _ = report
    for row in data["runs"]:
        result = json.loads(open(os.path.join(row["path"], "result.json")).read())
        for key in ("loss", "iou", "val_loss", "val_iou"):
            side = "val" if key.startswith("val_") else "train"
            assert row[f"{side}_{key.removeprefix('val_')}"] == result[key]
        assert row["updates"] == result["optimizer_step"]
        assert row["host_peak_rss_bytes"] == result["host_peak_rss_bytes"]
        assert row["gradient_noise_scale"] == result["gradient_noise_scale"]
        _, events = event_tags(row["path"])
        assert row["samples_per_sec"] == scalars(events, "throughput/mean_samples_per_sec")[-1]
        assert row["train_loss_best"] == min(scalars(events, "train/loss") + [result["loss"]])
        assert row["samples_seen"] == sum(scalars(events, "batch/update_samples"))
    # The best of each column is marked: the lowest validation loss, the highest samples/s.
    assert data["best"]["val_loss"] == min(row["val_loss"] for row in data["runs"])
    assert data["best"]["samples_per_sec"] == max(row["samples_per_sec"] for row in data["runs"])


def _colour_present(pixels, colour):
    """Pixels of exactly this matplotlib colour (a line's or marker's own, not anti-aliased)."""
    from matplotlib.colors import to_rgb

    target = np.round(np.array(to_rgb(colour)) * 255)
    return int(np.sum(np.all(np.abs(pixels[..., :3].astype(float) - target) <= 2, axis=-1)))


@pytest.mark.slow
def test_plots_are_pngs_with_one_line_per_run(report):
    from PIL import Image

    _, output, data, out = report
    labels = [f"accum_steps={row['accum_steps']}" for row in data["runs"]]
    for name in ("validation.png", "speed_memory.png", "loss_time.png"):
        with Image.open(out / name) as image:
            assert image.format == "PNG" and image.size[0] > 300 and image.size[1] > 200
            lines = json.loads(image.text["gacli-lines"])
            pixels = np.asarray(image.convert("RGB"))
        assert lines and all(labelled == labels for labelled in lines.values()), (name, lines)
        # Each run drew in its own colour (C0, C1, C2), and no fourth run did.
        drawn = [_colour_present(pixels, f"C{index}") for index in range(4)]
        assert all(count > 20 for count in drawn[:3]) and drawn[3] == 0, (name, drawn)
    assert set(lines) == {"training loss"}
    assert "![validation against samples seen](validation.png)" in (out / "report.md").read_text()


@pytest.mark.slow
def test_sort_by_any_column_best_first(sweep, tmp_path):
    code, output = ga_report(
        sweep[1], "--sort", "samples_per_sec", "--no-plots", "--out", str(tmp_path), cwd=sweep[0]
    )
    assert code == 0, output
    rates = [
        r["samples_per_sec"] for r in json.loads((tmp_path / "report.json").read_text())["runs"]
    ]
    assert rates == sorted(rates, reverse=True)
    assert not glob.glob(str(tmp_path / "*.png"))
    code, output = ga_report(sweep[1], "--sort", "val_loss", "--out", str(tmp_path), cwd=sweep[0])
    losses = [r["val_loss"] for r in json.loads((tmp_path / "report.json").read_text())["runs"]]
    assert code == 0 and losses == sorted(losses), output


READ_WITHOUT_TENSORFLOW = """
import sys, time
start = time.perf_counter()
from gacli.report.cli import main
code = main(sys.argv[1:])
print("SECONDS", time.perf_counter() - start)
print("TENSORFLOW", "tensorflow" in sys.modules, "keras" in sys.modules)
sys.exit(code)
"""


@pytest.mark.slow
def test_ga_report_reads_event_files_without_tensorflow(sweep, tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", READ_WITHOUT_TENSORFLOW, sweep[1], "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "TENSORFLOW False False" in done.stdout, done.stdout
    record(float(done.stdout.split("SECONDS")[1].split()[0]), "ga-report, 3 runs, seconds")


@pytest.mark.slow
def test_sixteen_runs_are_read_in_under_five_seconds(sweep, tmp_path):
    jobs = sorted(glob.glob(os.path.join(sweep[1], "*_accum_steps=*")))
    for copy in range(16):
        shutil.copytree(jobs[copy % len(jobs)], tmp_path / "runs" / f"run{copy:02d}")
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    code, output = ga_report(str(tmp_path / "runs"), cwd=tmp_path)
    after, seconds = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter() - start
    assert code == 0, output
    assert len(json.loads((tmp_path / "runs" / "report.json").read_text())["runs"]) == 16
    record(seconds, "ga-report, 16 runs, wall seconds")
    # CPU time, which the other processes of a busy test machine do not stretch as they do the
    # wall time: start-up, reading, the table, the files and the plots.
    cpu = record(
        after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
        "ga-report, 16 runs, CPU seconds",
    )
    assert cpu < 5, output


BAD_INPUT = [
    (["missing"], "ga-report: missing is not a directory. Give a sweep's directory"),
    (["empty"], "ga-report: no ga-train runs under empty"),
    (["SWEEP", "--sort", "speed"], "ga-report: --sort speed: no such column. Sort by one of:"),
]


@pytest.mark.parametrize(
    "arguments, message",
    [
        pytest.param(*BAD_INPUT[0], id="missing"),
        pytest.param(*BAD_INPUT[1], id="empty"),
        pytest.param(*BAD_INPUT[2], id="sort", marks=pytest.mark.slow),  # reads the sweep
    ],
)
def test_bad_input_is_a_clear_error(arguments, message, request, tmp_path):
    (tmp_path / "empty" / "some" / "folder").mkdir(parents=True)
    if "SWEEP" in arguments:
        sweep = request.getfixturevalue("sweep")
        arguments = [sweep[1] if argument == "SWEEP" else argument for argument in arguments]
    code, output = ga_report(*arguments, cwd=tmp_path)
    assert code == 2 and "Traceback" not in output, output
    assert output.splitlines()[0].startswith(message), output


def test_help(tmp_path):
    code, output = ga_report("--help", cwd=tmp_path)
    assert code == 0 and "ga-report multirun/unet/" in output and "--sort COLUMN" in output


def _updates_logged(run_dir):
    """optimizer/step points in each of the run's event files, as TensorBoard reads them."""
    counts = []
    for path in sorted(glob.glob(os.path.join(run_dir, "tensorboard", "events.out.tfevents.*"))):
        events = EventAccumulator(path, size_guidance={"tensors": 0})  # 0: keep every point
        events.Reload()
        counts.append(len(events.Tensors("optimizer/step")))
    return counts


@pytest.mark.slow
def test_a_resumed_run_counts_each_update_once(sweep, tmp_path):
    # Three epochs of 8 updates. SIGTERM after the first epoch's checkpoint; the checkpoint it
    # saves at the signal is then deleted, so the resumed process goes on from the end of
    # epoch 1 (or from the start), doing again updates the first process logged.
    job = [*TINY_UNET[:1], "accum_steps=1", *TINY_UNET[2:], "epochs=3"]
    run_dir = interrupt_after_checkpoints(tmp_path, 1, job, label="unet")
    numbers = sorted(glob.glob(os.path.join(run_dir, "checkpoints", "ckpt-*.index")))
    for path in glob.glob(numbers[-1][: -len(".index")] + ".*"):
        os.remove(path)
    code, output = ga_train(*job, f"resume={run_dir}", cwd=tmp_path)
    assert code == 0, output
    logged = _updates_logged(run_dir)
    assert len(logged) == 2 and sum(logged) > 24, logged  # the overlap is there to be merged

    # Reported with the sweep's runs (started by one process, this by two).
    shutil.copytree(sweep[1], tmp_path / "multirun")
    code, output = ga_report(str(tmp_path), cwd=tmp_path)
    assert code == 0, output
    rows = json.loads((tmp_path / "report.json").read_text())["runs"]
    assert len(rows) == 4, [row["run"] for row in rows]
    (resumed,) = [row for row in rows if row["event_files"] == 2]
    result = json.loads(open(os.path.join(run_dir, "result.json")).read())
    assert resumed["updates"] == result["optimizer_step"] == 24
    assert resumed["samples_seen"] == 3 * TRAIN_SAMPLES
    assert resumed["status_text"] == "finished, resumed 1x"
    assert resumed["val_loss"] == result["val_loss"]
