"""ga-train as a user runs it: the installed console script in a subprocess."""

import glob
import json
import os
import signal
import subprocess
import sys

import pytest

from helpers import event_tags, ga_train, run_dir_of, scalars, shipped

TRAIN_TAGS = {
    "batch/effective_size",
    "batch/micro_size",
    "batch/accum_steps",
    "batch/replicas",
    "train/loss",
    "optimizer/lr",
    "optimizer/step",
    "optimizer/micro_step",
    "throughput/samples_per_sec",
    "memory/host_rss_bytes",
    "memory/host_peak_rss_bytes",
}


COMPOSE_CASES = [("config=" + name + ".yaml",) for name in shipped("gacli.recipes")] + [
    (f"{group}={name}",)
    for group in ("model", "dataset", "optimizer", "precision", "strategy", "check")
    for name in shipped("gacli.configs", group)
]


@pytest.mark.parametrize("arguments", COMPOSE_CASES, ids=[c[0] for c in COMPOSE_CASES])
def test_every_shipped_config_and_recipe_composes(arguments, tmp_path):
    code, output = ga_train("--cfg", "job", *arguments, cwd=tmp_path)
    assert code == 0, output
    assert "micro_batch_size:" in output and "Traceback" not in output


@pytest.mark.slow
def test_unet_recipe_with_the_batch_from_the_command_line_runs_and_logs_every_tag(tmp_path):
    """One small run of the UNet recipe checks:

    - the batch arithmetic from the command line wins over the recipe's (its micro_batch_size 8
      and accum_steps 4): effective_batch_size=64 micro_batch_size=4 give accum_steps 16, printed
      at start, in resolved.yaml and logged as batch/accum_steps (contract row D4);
    - the run directory is under outputs/unet/, and every training, validation and IoU tag is
      logged (no device memory on a CPU), one point per update, stepped by optimizer update;
    - result.json's counters, model.keras and the last checkpoint (one a epoch).
    """
    code, output = ga_train(
        "config=unet.yaml",
        "effective_batch_size=64",
        "micro_batch_size=4",
        "epochs=2",
        "dataset.num_samples=73",
        "dataset.image_size=16",
        "model.depth=2",
        cwd=tmp_path,
    )
    assert code == 0, output
    run_dir = run_dir_of(output)
    assert run_dir.startswith(str(tmp_path / "outputs" / "unet"))
    assert "effective batch  64 = micro_batch_size 4 x accum_steps 16 x replicas 1" in output
    tags, events = event_tags(run_dir)
    assert TRAIN_TAGS | {"train/iou", "val/loss", "val/iou"} <= tags
    assert not {tag for tag in tags if tag.startswith("memory/device")}  # the CPU reports none
    accum = scalars(events, "batch/accum_steps")
    steps = [e.step for e in events.Tensors("optimizer/step")]
    # 64 train samples = 16 micro-batches of 4: one update an epoch, logged at steps 1 and 2.
    assert accum == [16.0, 16.0] and steps == [1, 2]
    result = json.loads(open(os.path.join(run_dir, "result.json")).read())
    assert (result["optimizer_step"], result["micro_step"]) == (2, 32)
    resolved = open(os.path.join(run_dir, "resolved.yaml")).read()
    assert "effective_batch_size: 64" in resolved and "accum_steps: 16" in resolved
    assert os.path.exists(os.path.join(run_dir, "model.keras"))
    import tensorflow as tf

    assert tf.train.latest_checkpoint(os.path.join(run_dir, "checkpoints")).endswith("ckpt-2")


@pytest.mark.slow
def test_multirun_sweep_gives_one_tensorboard_run_per_job(tmp_path):
    code, output = ga_train("-m", "accum_steps=1,2", "epochs=1", "steps_per_epoch=2", cwd=tmp_path)
    assert code == 0, output
    jobs = sorted(glob.glob(str(tmp_path / "multirun" / "default" / "*" / "*_accum_steps=*")))
    assert [os.path.basename(job) for job in jobs] == [
        "0_accum_steps=1,epochs=1,steps_per_epoch=2",
        "1_accum_steps=2,epochs=1,steps_per_epoch=2",
    ]
    for job, accum_steps in zip(jobs, (1, 2)):
        tags, events = event_tags(job)
        assert TRAIN_TAGS <= tags
        micro = scalars(events, "optimizer/micro_step")
        assert micro == [accum_steps * update for update in (1, 2)]


# Refused before TensorFlow loads (about a second each).
BAD_INPUT = [
    (["acum_steps=4"], "ga-train: acum_steps=4: acum_steps is not a key ga-train reads"),
    (["accum_steps=abc"], "Value 'abc' of type 'str' could not be converted to Integer"),
    (["accum_steps=0"], "ga-train: accum_steps=0 must be a whole number >= 1"),
    (
        ["effective_batch_size=100", "micro_batch_size=16"],
        "ga-train: effective_batch_size=100 is not a multiple of micro_batch_size x replicas",
    ),
    (["config=nope.yaml"], "ga-train: config=nope.yaml is neither a shipped recipe"),
    (
        ["optimizer.name=adamm"],
        "ga-train: optimizer.name=adamm: optimizer.name is no longer read: an optimizer is chosen "
        "by its file",
    ),
    (["optimizer.name=sgd"], "Type optimizer=sgd instead, or optimizer._target_="),
    (["optimizer=own"], "ga-train: optimizer=own: optimizer=own is no longer a choice"),
    (["steps_per_execution=0"], "ga-train: steps_per_execution=0 must be >= 1"),
    (["precise_bn_micro_batches=0"], "ga-train: precise_bn_micro_batches=0 must be >= 1"),
    (
        ["strategy=mirrored", "strategy.logical_cpus=2", "jit_compile=true"],
        "ga-train: jit_compile=true fails under strategy=mirrored with several devices",
    ),
]
# Refused once TensorFlow has loaded (the model, the data or the devices are looked at): slow.
BAD_INPUT_WITH_TENSORFLOW = [
    (
        ["dataset=npz", "dataset.path=/nonexistent/train.npz"],
        "ga-train: dataset.path=/nonexistent/train.npz does not exist",
    ),
    (
        ["config=unet.yaml", "dataset.image_size=20"],
        "ga-train: model=unet with model.depth=3 halves the image 3 times",
    ),
    (["model=unet"], "ga-train: model=unet segments images"),
    (
        [
            "wrapper=optimizer",
            "strategy=mirrored",
            "strategy.logical_cpus=2",
            "steps_per_execution=4",
        ],
        "ga-train: steps_per_execution=4 with wrapper=optimizer fails under 2 replicas",
    ),
]


@pytest.mark.parametrize(
    "arguments, first_line",
    [pytest.param(*case, id=case[0][-1]) for case in BAD_INPUT]
    + [
        pytest.param(*case, id=case[0][-1], marks=pytest.mark.slow)
        for case in BAD_INPUT_WITH_TENSORFLOW
    ],
)
def test_bad_input_gives_one_clear_message_and_no_traceback(arguments, first_line, tmp_path):
    code, output = ga_train(*arguments, cwd=tmp_path)
    assert code != 0
    assert "Traceback" not in output
    assert first_line in output, output


CHECK_IMPORTS = """
import sys
from gacli.runner.command.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print("tensorflow imported:", "tensorflow" in sys.modules)
"""


@pytest.mark.parametrize(
    "arguments",
    [
        ["--help"],
        ["accum_steps=0"],
        ["acum_steps=1"],
        ["effective_batch_size=100", "micro_batch_size=16"],
        ["optimizer.name=sgd"],
    ],
)
def test_help_and_config_errors_answer_without_importing_tensorflow(arguments, tmp_path):
    """What makes them answer at once (TensorFlow alone takes seconds to import); the time itself
    is measured by benchmarks, not asserted here."""
    result = subprocess.run(
        [sys.executable, "-c", CHECK_IMPORTS, *arguments],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "tensorflow imported: False" in result.stdout, result.stdout + result.stderr


SIGNAL_AT_ONCE = """
import os, signal, sys
from gacli.runner.command import cli
slow = {"omegaconf", "hydra", "yaml", "keras", "tensorflow"}
print("loaded by the import:", sorted(slow & {name.split(".")[0] for name in sys.modules}))
cli._versions = lambda: os.kill(os.getpid(), signal.SIGTERM)  # main's first step, signalled
cli.main(["--version"])
"""


def test_a_signal_in_the_first_moment_says_what_became_of_the_run(tmp_path):
    """ga-train answers a signal from the first line of main, and importing it loads nothing slow
    before then (OmegaConf, Hydra, TensorFlow): what is left unanswered is Python's own start."""
    result = subprocess.run(
        [sys.executable, "-c", SIGNAL_AT_ONCE], cwd=tmp_path, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert result.stdout == "loaded by the import: []\n", result.stdout + result.stderr
    assert result.returncode == 128 + signal.SIGTERM, result.stderr
    assert result.stderr == (
        "ga-train: stopped by SIGTERM before training started: nothing was trained or saved.\n"
    )
    assert os.listdir(tmp_path) == []


def test_full_error_with_hydra_full_error(tmp_path):
    code, output = ga_train("accum_steps=0", cwd=tmp_path, env={"HYDRA_FULL_ERROR": "1"})
    assert code != 0 and "accum_steps=0 must be" in output
    assert "Traceback" in output  # the full story, for whoever asked for it


def test_help_flags_work(tmp_path):
    code, output = ga_train("--version", cwd=tmp_path)
    assert code == 0 and output.startswith("gacli 0.1.0 (TensorFlow 2."), output
    assert "Keras 3." in output, output
    code, output = ga_train("--info", cwd=tmp_path)
    assert code == 0 and "Config search path" in output, output
    assert "invalid choice" not in output and "Traceback" not in output, output
    code, output = ga_train("--hydra-help", cwd=tmp_path)
    assert code == 0 and "ga-train passes these Hydra options through" in output, output


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [[], ["config=digits_cnn.yaml"]], ids=["default", "bn-keep"])
def test_a_default_run_is_quiet_and_its_log_lines_whole(recipe, tmp_path):
    """No line a user would take for an error on stderr (TensorFlow's C++ start-up lines, the
    failed CUDA probe of a machine without a GPU, a warning about BN statistics that the start-up
    panel states), no empty log file, and lines that a file receives whole, not wrapped at 80
    columns. The default job also measures no gradient noise scale (monitor.gns is off by
    default: no gns/* tag, no line about it; test_noise_scale.py runs it on)."""
    command = [
        os.path.join(os.path.dirname(sys.executable), "ga-train"),
        *recipe,
        "epochs=1",
        "steps_per_epoch=2",
        "progress=plain",
    ]
    environment = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TF_CPP_MIN_LOG_LEVEL", "COLUMNS", "HYDRA_FULL_ERROR")
    }
    result = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=environment
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr == "", result.stderr
    epoch_lines = [line for line in result.stdout.splitlines() if line.startswith("epoch 1/1")]
    assert len(epoch_lines) == 1 and "val_loss" in epoch_lines[0], result.stdout
    run_dir = run_dir_of(result.stdout)
    assert not glob.glob(os.path.join(run_dir, "*.log")), os.listdir(run_dir)
    if not recipe:
        assert not {tag for tag in event_tags(run_dir)[0] if tag.startswith("gns/")}
        assert "noise scale" not in result.stdout
