"""probe=batch: each branch is the plain run of its effective batch over the probe's samples (same
weights, same samples in the same order), a branch leaves nothing behind in the next, and bad
probe settings end with one paragraph and exit code 2 before TensorFlow loads, those that used to
pass quietly (a size listed twice, a tolerance that is not finite) among them, with a suggestion
that is accepted; more probe samples than the training set holds are cut, with a line that says
so."""

import glob
import io
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from rich.console import Console

from gacli.errors import ConfigError
from gacli.runner.config.validate import validate
from gacli.runner.tools.batch_probe import critical_batch_size, probe_batch
from gacli.runner.training.run import train
from helpers import (
    compose_config,
    final_weights,
    ga_train,
    record,
    run_dir_of,
    weights_difference,
)

# The default job's digits MLP (micro-batch 32) on 512 samples per size.
JOB = ("optimizer=momentum", "optimizer.learning_rate=0.05", "progress=none")
PROBE = ("probe=batch", "probe.effective_sizes=[32,128]", "probe.samples=512")


def test_the_critical_batch_is_the_largest_within_the_tolerance_of_the_best():
    rows = [
        {"effective_batch_size": 16, "val_loss": 0.50},
        {"effective_batch_size": 64, "val_loss": 0.48},
        {"effective_batch_size": 256, "val_loss": 0.52},
        {"effective_batch_size": 1024, "val_loss": float("nan")},
    ]
    # The best is 0.48 at 64; a non-finite loss never counts.
    assert critical_batch_size(rows, 0.10) == 256  # 0.52 <= 1.10 x 0.48 = 0.528
    assert critical_batch_size(rows, 0.05) == 64  # 0.52 > 0.504; 16 is within, but smaller
    assert critical_batch_size(rows, 0.0) == 64


def test_each_branch_is_the_plain_run_of_its_size_and_leaves_nothing_behind(tmp_path):
    # The plain run of effective batch 128 first; then the probe, whose branch 128 runs after
    # branch 32 in the same process: any state branch 32 left behind would show in its weights.
    plain_dir = str(tmp_path / "plain")
    plain_cfg = compose_config(*JOB, "effective_batch_size=128", "epochs=1", "steps_per_epoch=4")
    plain = train(plain_cfg, plain_dir, given=("micro_batch_size", "effective_batch_size"))
    probe_dir = str(tmp_path / "probe")
    probe_batch(compose_config(*JOB, *PROBE), probe_dir)
    branch_dir = os.path.join(probe_dir, "branches", "effective_128")
    difference = record(weights_difference(final_weights(plain_dir), final_weights(branch_dir)))
    assert difference == 0.0
    with open(os.path.join(probe_dir, "probe.json")) as file:
        probe = json.load(file)
    sizes = {row["effective_batch_size"]: row for row in probe["sizes"]}
    assert sorted(sizes) == [32, 128]
    assert sizes[128]["val_loss"] == pytest.approx(plain["val_loss"], abs=0.0)
    assert [sizes[32]["updates"], sizes[128]["updates"]] == [16, 4]  # 512 samples each
    assert [sizes[32]["accum_steps"], sizes[128]["accum_steps"]] == [1, 4]
    assert probe["critical_batch_size"] == critical_batch_size(probe["sizes"], 0.05)
    assert probe["metric"] == "val_accuracy" and 0 < sizes[32]["val_accuracy"] <= 1
    assert all(row["samples_per_second"] > 0 for row in probe["sizes"])
    noise = probe["noise_scale_at_start"]
    assert noise["micro_batches"] == 16 and noise["noise_scale"] > 0
    with open(os.path.join(probe_dir, "probe.png"), "rb") as file:
        assert file.read(8) == b"\x89PNG\r\n\x1a\n"


def test_probe_from_starts_every_branch_from_that_runs_weights(tmp_path):
    from gacli.runner.tools.batch_probe import BranchRun, _start_point, branch_config

    finished = str(tmp_path / "finished")
    train(compose_config(*JOB, "epochs=1", "steps_per_epoch=3"), finished)
    unfinished = str(tmp_path / "unfinished")  # its newest checkpoint, no model.keras
    shutil.copytree(finished, unfinished)
    os.remove(os.path.join(unfinished, "model.keras"))
    for given in (finished, unfinished):
        cfg = compose_config(*JOB, *PROBE, f"probe.from={given}")
        branch = BranchRun(branch_config(cfg, 32), str(tmp_path / "branch"))
        start = _start_point(cfg, branch)
        assert record(weights_difference(start.weights, final_weights(finished))) == 0.0


BAD = [
    (
        ("probe.effective_sizes=[16,64]",),
        "probe.effective_sizes holds 16, which micro_batch_size x replicas = 32 x 1 = 32 does "
        "not divide",
    ),
    (("probe.samples=1000",), "probe.samples=1000 is not a multiple of the effective size 32"),
    (("probe.effective_sizes=[64]",), "probe.effective_sizes=[64] must list two or more"),
    (("micro_batch_size=auto",), "probe=batch reaches each size by accumulation"),
    (("dataset.validation_split=0",), "probe=batch compares the sizes by their val_loss"),
    (("probe.tolerance=-1",), "probe.tolerance=-1 must be >= 0 and finite"),
    (("check=equivalence",), "probe=batch and check= each run a job of their own"),
]


@pytest.mark.parametrize("arguments, expected", BAD, ids=[a[0] for a, _ in BAD])
def test_bad_probe_settings_fail_before_tensorflow_loads(tmp_path, arguments, expected):
    # In a fresh interpreter: the error comes before TensorFlow is imported at all.
    script = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('tensorflow' in sys.modules and 'tensorflow loaded' or "
        "'no tensorflow'))\n"
        "from gacli.runner.command.cli import main\n"
        f"sys.exit(main({['probe=batch', *arguments]!r}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"ga-train: {expected}"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert done.stdout.strip() == "no tensorflow"
    assert not os.path.exists(tmp_path / "outputs" / "default") or not os.listdir(
        tmp_path / "outputs" / "default"
    )


def test_a_probe_key_without_the_probe_is_refused(tmp_path):
    code, output = ga_train("probe.samples=512", cwd=tmp_path)
    assert code == 2 and "Traceback" not in output
    assert "probe.samples is read only with probe=batch" in output


@pytest.mark.slow
@pytest.mark.distributed
def test_probe_under_two_replicas_branches_are_the_plain_mirrored_runs(tmp_path):
    """strategy=mirrored on 2 logical CPUs (micro-batches of 16 per replica): branch 128 runs
    after branch 32 in the same process, and ends with the weights and val_loss of the plain
    mirrored run of effective batch 128 over the same 512 samples."""
    mirrored = ("strategy=mirrored", "strategy.logical_cpus=2", "micro_batch_size=16")
    plain = ("effective_batch_size=128", "epochs=1", "steps_per_epoch=4")
    for folder in ("plain", "probe"):
        (tmp_path / folder).mkdir()
    code, output = ga_train(*JOB, *mirrored, *plain, cwd=tmp_path / "plain")
    assert code == 0 and "(2 replicas)" in output, output
    plain_dir = run_dir_of(output)
    code, output = ga_train(*JOB, *mirrored, *PROBE, cwd=tmp_path / "probe")
    assert code == 0 and "(2 replicas)" in output, output
    (probe_dir,) = glob.glob(str(tmp_path / "probe" / "outputs" / "default" / "*"))
    branch_dir = os.path.join(probe_dir, "branches", "effective_128")
    difference = record(weights_difference(final_weights(plain_dir), final_weights(branch_dir)))
    assert difference == 0.0
    with open(os.path.join(probe_dir, "probe.json")) as file:
        probe = json.load(file)
    with open(os.path.join(plain_dir, "result.json")) as file:
        expected = json.load(file)
    sizes = {row["effective_batch_size"]: row for row in probe["sizes"]}
    assert sizes[128]["val_loss"] == expected["val_loss"]
    assert [sizes[32]["accum_steps"], sizes[128]["accum_steps"]] == [1, 4]  # 16 x 2 replicas
    assert [sizes[32]["updates"], sizes[128]["updates"]] == [16, 4]


@pytest.mark.parametrize(
    "arguments, expected",
    [
        (("probe.effective_sizes=[32,32]",), "lists 32 more than once"),
        (("probe.effective_sizes=[32,64,32]",), "e.g. probe.effective_sizes=[32,64]."),
        (("probe.tolerance=nan",), "probe.tolerance=nan must be >= 0 and finite"),
        (("probe.tolerance=inf",), "probe.tolerance=inf must be >= 0 and finite"),
    ],
)
def test_probe_settings_that_used_to_pass_quietly(arguments, expected):
    with pytest.raises(ConfigError) as refused:
        validate(compose_config("probe=batch", *arguments))
    assert expected in str(refused.value)


def test_the_suggested_probe_sizes_are_accepted():
    with pytest.raises(ConfigError) as refused:
        validate(compose_config("probe=batch", "probe.effective_sizes=[32,32]"))
    (suggested,) = re.findall(r"(probe.effective_sizes=\[[\d,]+\])", str(refused.value))
    validate(compose_config("probe=batch", suggested))


def test_a_nan_tolerance_is_refused_before_tensorflow(tmp_path):
    code, output = ga_train("probe=batch", "probe.tolerance=nan", cwd=tmp_path)
    assert code == 2 and "Traceback" not in output, output
    assert "ga-train: probe.tolerance=nan must be" in output
    assert not glob.glob(str(tmp_path / "outputs" / "*" / "*")), "the run's directory is removed"


def test_probe_samples_beyond_the_training_set_are_cut_with_a_line():
    from gacli.runner.tools.batch_probe import samples_within_training_set

    printed = io.StringIO()
    console = Console(file=printed, width=400)
    cfg = compose_config("probe=batch")  # 2048 samples over sizes 32, 128, 512
    cut = samples_within_training_set(cfg, 1438, console)
    assert cut.probe.samples == 1024 and cfg.probe.samples == 2048
    assert "probe.samples=2048 is more than the 1438 training samples" in printed.getvalue()
    assert "every branch trains on 1024" in printed.getvalue()
    assert samples_within_training_set(cfg, 4096, console) is cfg  # within: unchanged
    odd = compose_config("probe=batch", "probe.effective_sizes=[96,128]", "probe.samples=768")
    with pytest.raises(ConfigError, match="the smallest common multiple is 384"):
        samples_within_training_set(odd, 300, console)
