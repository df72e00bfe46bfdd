"""Run directories are never lost or rewritten: every command that writes one refuses a finished
one, and a sweep's job refused one changes nothing in it; a process removes only a directory it
made and holds, and a command Hydra cannot compose leaves none; a worker that is not the chief is
refused under a strategy of one process instead of training and saving nothing, and so is the
chief of a cluster of several, which would train alone; result.json and epoch_logs.json get the
umask's permissions; a SIGTERM before training says what was saved; a folder of the user's is
never written into, nor one whose checkpoint folder cannot be written, nor one another run holds;
a run killed before its first checkpoint is not mixed with another command's;
a full disk is named as such and the run resumes once there is room."""

import glob
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time

import pytest

from gacli import rundir
from gacli.runner.tools.batch_probe import PROBE_FILE
from gacli.runner.tools.equivalence_check import EQUIVALENCE_FILE
from helpers import ga_train, run_dir_of, start_ga_train

QUICK = ("epochs=1", "progress=none")
PROBE = ("probe=batch", "probe.effective_sizes=[32,128]", "probe.samples=512", "progress=none")
CHECK = ("check=equivalence", "progress=none")


def first_line(output):
    return next(line for line in output.splitlines() if line.startswith("ga-train: "))


def run_dirs(cwd):
    root = cwd / "outputs" / "default"
    return sorted(os.listdir(root)) if root.is_dir() else []


def worker_one_of_two(index=1):
    cluster = {"worker": ["127.0.0.1:20001", "127.0.0.1:20002"]}
    return json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})


# A process that is not the chief, under a strategy of one process.
@pytest.mark.parametrize(
    "env, who, variable",
    [
        ({"SLURM_PROCID": "1"}, "SLURM task 1 (SLURM_PROCID=1)", "SLURM_PROCID"),
        ({"TF_CONFIG": worker_one_of_two()}, "worker 1 (TF_CONFIG)", "TF_CONFIG"),
    ],
)
@pytest.mark.parametrize("strategy", ["default", "one_device"])
def test_a_worker_that_is_not_the_chief_is_refused_under_one_process(
    tmp_path, env, who, variable, strategy
):
    code, output = ga_train(*QUICK, f"strategy={strategy}", cwd=tmp_path, env=env)
    assert code == 2 and "Traceback" not in output, output
    assert first_line(output).startswith(f"ga-train: this process is {who}, not its cluster's")
    assert f"strategy={strategy} trains in this one process" in output
    assert "add strategy=multi_worker" in output and f"unset {variable}" in output
    assert run_dirs(tmp_path) == []  # the empty directory Hydra made for it is gone too
    assert "run directory:" not in output  # refused before the run began


def test_the_chief_of_a_cluster_of_several_is_refused_under_one_process(tmp_path, monkeypatch):
    code, output = ga_train(*QUICK, cwd=tmp_path, env={"TF_CONFIG": worker_one_of_two(0)})
    assert code == 2 and "Traceback" not in output, output
    assert first_line(output).startswith(
        "ga-train: TF_CONFIG names a cluster of 2 tasks, and this process is its chief (worker "
        "0), but strategy=default trains in this one process, so it would train alone"
    )
    assert "add strategy=multi_worker" in output and "unset TF_CONFIG" in output
    assert run_dirs(tmp_path) == []
    # A cluster of one (and an evaluator beside it) is a process on its own.
    from gacli.runner.command.cli import _refuse_lone_worker
    from helpers import compose_config

    alone = {"worker": ["127.0.0.1:20001"], "evaluator": ["127.0.0.1:20002"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": alone, "task": {"type": "worker"}}))
    _refuse_lone_worker(compose_config(), str(tmp_path / "alone"), None)


@pytest.mark.parametrize(
    "tf_config, says",
    [
        ("garbage{", "TF_CONFIG is not valid JSON (Expecting value at character 0): 'garbage{'"),
        ("[1]", "TF_CONFIG='[1]' is JSON but not a cluster"),
        ('{"task": "worker"}', "is JSON but not a cluster"),
        ('{"task": {"type": "worker", "index": "1"}}', "is JSON but not a cluster"),
    ],
)
def test_a_tf_config_that_cannot_be_read_is_one_paragraph(tmp_path, tf_config, says):
    code, output = ga_train(*QUICK, cwd=tmp_path, env={"TF_CONFIG": tf_config})
    assert code == 2 and "Traceback" not in output, output
    assert first_line(output).startswith("ga-train: TF_CONFIG") and says in first_line(output)
    assert "unset TF_CONFIG" in output
    assert not (tmp_path / "outputs").exists()  # refused before Hydra started


@pytest.mark.parametrize(
    "environ, role",
    [
        ({}, None),
        ({"SLURM_PROCID": "0"}, None),
        ({"SLURM_PROCID": "3"}, "SLURM task 3 (SLURM_PROCID=3)"),
        ({"TF_CONFIG": worker_one_of_two(0)}, None),
        ({"TF_CONFIG": worker_one_of_two(1)}, "worker 1 (TF_CONFIG)"),
        # TF_CONFIG wins over SLURM's rank (ga-train writes it from SLURM's for a cluster).
        ({"TF_CONFIG": worker_one_of_two(0), "SLURM_PROCID": "1"}, None),
        ({"TF_CONFIG": '{"cluster": {"chief": ["a:1"]}, "task": {"type": "chief"}}'}, None),
        (
            {"TF_CONFIG": '{"cluster": {"chief": ["a:1"], "worker": ["b:1"]}, "task": '
             '{"type": "worker", "index": 0}}'},
            "worker 0 (TF_CONFIG)",
        ),
    ],
)  # fmt: skip
def test_cluster_role(monkeypatch, environ, role):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert rundir.cluster_role() == role
    assert rundir.is_chief() == (role is None)


# A finished directory, refused to every command that writes one.
def finished_probe(directory, command):
    """A probe=batch run's directory as it ends: its lock, Hydra's record of ``command``, each
    branch's result and probe.json."""
    (directory / ".hydra").mkdir(parents=True)
    (directory / ".hydra" / "overrides.yaml").write_text("".join(f"- {a}\n" for a in command))
    (directory / rundir.LOCK_FILE).write_text("ga-train, pid 1 on a host that ended\n")
    for size in (32, 128):
        branch = directory / "branches" / f"effective_{size}"
        branch.mkdir(parents=True)
        (branch / "result.json").write_text('{"val_loss": 2.3}')
    (directory / PROBE_FILE).write_text('{"critical_batch_size": 128}')


def finished_check(directory, command):
    (directory / ".hydra").mkdir(parents=True)
    (directory / ".hydra" / "overrides.yaml").write_text("".join(f"- {a}\n" for a in command))
    (directory / rundir.LOCK_FILE).write_text("ga-train, pid 1 on a host that ended\n")
    (directory / EQUIVALENCE_FILE).write_text('{"passed": true}')


def listing(directory):
    """Every file under ``directory`` with its modification time and content, the lock file's
    record of the run that held it included: a command refused the directory changes none."""
    found = []
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as handle:
                found.append(
                    (os.path.relpath(path, directory), os.path.getmtime(path), handle.read())
                )
    return sorted(found)


@pytest.mark.parametrize(
    "make, what, command",
    [
        (finished_probe, "probe=batch run", PROBE),  # the same probe again: it retrained all
        (finished_probe, "probe=batch run", QUICK),
        (finished_probe, "probe=batch run", CHECK),
        (finished_check, "check=equivalence run", CHECK),
        (finished_check, "check=equivalence run", QUICK),
        (finished_check, "check=equivalence run", PROBE),
    ],
)
def test_a_finished_directory_is_refused_to_every_command(tmp_path, make, what, command):
    run_dir = tmp_path / "finished"
    make(run_dir, command)
    before = listing(run_dir)
    code, output = ga_train(*command, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert code == 2 and "Traceback" not in output, output
    assert first_line(output) == (
        f"ga-train: {run_dir} holds a finished {what}, which is never written to again. Leave "
        "hydra.run.dir unset (each run gets a new directory) or pick a new one."
    )
    assert listing(run_dir) == before


def test_a_sweeps_jobs_given_finished_runs_change_nothing_in_them(tmp_path):
    """Hydra writes its record of a job (.hydra/*.yaml) into the job's directory before the job
    runs; jobs whose hydra.sweep.subdir names a finished run, with its lock file or without, are
    refused and leave everything of it as it was: ga-report still shows the run's own command."""
    trained = tmp_path / "finished2"
    (trained / ".hydra").mkdir(parents=True)
    (trained / ".hydra" / "overrides.yaml").write_text("- accum_steps=4\n")
    (trained / rundir.RESULT_FILE).write_text('{"val_loss": 2.3}')
    (trained / rundir.LOCK_FILE).write_text(
        "ga-train, pid 1 on a host that ended, started 2026-01-01 00:00:00: ga-train "
        "accum_steps=4\n"
    )
    probed = tmp_path / "finished3"
    finished_probe(probed, PROBE)
    (probed / rundir.LOCK_FILE).unlink()  # copied elsewhere, say: no lock file
    before = [listing(trained), listing(probed)]
    code, output = ga_train(
        "-m", *QUICK, "accum_steps=2,3", f"hydra.sweep.subdir={tmp_path}/finished${{accum_steps}}",
        cwd=tmp_path,
    )  # fmt: skip
    assert code == 2 and "Traceback" not in output, output
    assert f"{trained} holds a finished run, which is never written to again" in output, output
    assert f"{probed} holds a finished probe=batch run" in output, output
    assert [listing(trained), listing(probed)] == before


def test_a_sweeps_job_is_refused_a_finished_probe(tmp_path):
    run_dir = tmp_path / "finished"
    finished_probe(run_dir, PROBE)
    (run_dir / rundir.LOCK_FILE).unlink()  # copied elsewhere, say: no lock file
    code, output = ga_train("-m", *PROBE, f"hydra.sweep.subdir={run_dir}", cwd=tmp_path)
    assert code == 2 and "Traceback" not in output, output
    assert f"{run_dir} holds a finished probe=batch run" in output, output
    assert (run_dir / PROBE_FILE).read_text() == '{"critical_batch_size": 128}'
    assert sorted(os.listdir(run_dir / "branches")) == ["effective_128", "effective_32"]


@pytest.mark.slow
def test_a_finished_run_is_refused_to_a_probe_and_a_check_and_its_files_get_the_umask(tmp_path):
    """A finished run's directory is refused to a probe, a check and the same command again, each
    with the line that says it is never written to again, and nothing in it changes; the files
    the run wrote have the umask's permissions."""
    first = (*QUICK, "steps_per_epoch=1", "hydra.run.dir=run")
    old = os.umask(0o027)
    try:
        code, output = ga_train(*first, cwd=tmp_path)
    finally:
        os.umask(old)
    assert code == 0, output
    run_dir = tmp_path / "run"
    for name in ("result.json", "checkpoints/epoch_logs.json", "model.keras", "resolved.yaml"):
        assert stat.S_IMODE(os.stat(run_dir / name).st_mode) == 0o640, name
    result = (run_dir / "result.json").read_text()
    for command in ((*PROBE, "hydra.run.dir=run"), (*CHECK, "hydra.run.dir=run"), first):
        code, output = ga_train(*command, cwd=tmp_path)
        assert code == 2 and "Traceback" not in output, output
        assert f"{run_dir} holds a finished run, which is never written to again" in output, output
    assert (run_dir / "result.json").read_text() == result
    assert not (run_dir / "branches").exists() and not (run_dir / EQUIVALENCE_FILE).exists()


def test_write_json_gives_the_umask_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        rundir.write_json(str(tmp_path / "record.json"), {"loss": float("nan")})
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "record.json").st_mode) == 0o644
    assert json.loads((tmp_path / "record.json").read_text()) == {"loss": None}
    assert os.listdir(tmp_path) == ["record.json"]  # no scratch file left


# A process removes only a directory it made and holds.
def test_discard_unstarted_removes_only_a_directory_this_process_made_and_holds(tmp_path):
    made = tmp_path / "made"
    rundir.lock(str(made), "this test")
    (made / "tensorboard").mkdir()
    rundir.discard_unstarted(str(made))
    assert not made.exists()

    # Another run's directory (its lock file made by a process that has ended): held now, kept.
    other = tmp_path / "other"
    other.mkdir()
    (other / rundir.LOCK_FILE).write_text("ga-train, pid 1 on a host that ended\n")
    (other / "tensorboard").mkdir()
    rundir.lock(str(other), "this test")
    try:
        rundir.discard_unstarted(str(other))
    finally:
        rundir.release(str(other))
    assert sorted(os.listdir(other)) == [rundir.LOCK_FILE, "tensorboard"]

    # Not held at all: kept.
    (tmp_path / "loose" / "tensorboard").mkdir(parents=True)
    rundir.discard_unstarted(str(tmp_path / "loose"))
    assert os.listdir(tmp_path / "loose") == ["tensorboard"]


@pytest.mark.parametrize(
    "arguments, says",
    [
        ((), "{live} is in use by another run: "),
        # Refused on its settings before it takes the directory: it still leaves it alone.
        (("probe=batch", "dataset.validation_split=0"), "probe=batch compares the sizes by"),
    ],
)
def test_a_sweeps_job_never_removes_a_directory_another_run_holds(tmp_path, arguments, says):
    live = tmp_path / "live"
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; from gacli import rundir; rundir.lock(sys.argv[1], 'ga-train epochs=4'); "
         "print('held', flush=True); sys.stdin.read()", str(live)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        (live / "tensorboard").mkdir()  # what the live run has written so far
        # A sweep's job given the same directory (hydra.sweep.subdir=x for every job): refused,
        # and the directory stays, lock and all.
        code, output = ga_train(
            "-m", *QUICK, *arguments, f"hydra.sweep.subdir={live}", cwd=tmp_path
        )
        assert code == 2 and "Traceback" not in output, output
        assert says.format(live=live) in output, output
        assert {rundir.LOCK_FILE, "tensorboard"} <= set(os.listdir(live))
        # So the lock still stops a third run.
        code, output = ga_train(*QUICK, f"hydra.run.dir={live}", cwd=tmp_path)
        assert code == 2 and f"{live} is in use by another run: " in output, output
    finally:
        holder.communicate("", timeout=30)
    assert (live / "tensorboard").is_dir()


# SIGTERM before training.
def test_sigterm_before_training_says_nothing_was_saved(tmp_path):
    process = start_ga_train(*QUICK, "hydra.run.dir=early", cwd=tmp_path)
    record = tmp_path / "early" / ".hydra" / "overrides.yaml"
    deadline = time.time() + 120
    while not record.exists():  # Hydra has started the job; TensorFlow is not trained yet
        assert process.poll() is None and time.time() < deadline, process.communicate()[0]
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=120)[0]
    assert process.returncode == 128 + signal.SIGTERM, output
    assert first_line(output) == (
        "ga-train: stopped by SIGTERM before training started: nothing was trained or saved, and "
        f"its run directory {tmp_path / 'early'} is removed."
    ), output
    assert "Traceback" not in output
    assert not (tmp_path / "early").exists()


def test_a_command_hydra_cannot_compose_leaves_no_directory_it_made(tmp_path):
    """hydra.run.dir is taken before Hydra composes the config; an override Hydra refuses (a
    value of the wrong type) leaves no directory behind, nor the parents the command made."""
    code, output = ga_train("seed=", *QUICK, "hydra.run.dir=made/run", cwd=tmp_path)
    assert code == 2 and "Traceback" not in output, output
    assert "Error merging override seed=" in output, output
    assert not (tmp_path / "made").exists()


# Other people's folders, a run killed before its first checkpoint, a full disk.
@pytest.mark.slow
def test_a_folder_of_the_users_is_never_written_into(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "model.keras").write_text("the user's own model")
    code, output = ga_train("hydra.run.dir=mine", "epochs=1", cwd=tmp_path)
    assert code == 2 and "already holds files that ga-train did not write (model.keras)" in (
        output
    ), output
    assert os.listdir(tmp_path / "mine") == ["model.keras"]
    assert (tmp_path / "mine" / "model.keras").read_text() == "the user's own model"
    (tmp_path / "empty").mkdir()
    code, output = ga_train(
        "hydra.run.dir=empty", "epochs=1", "steps_per_epoch=1", "progress=none", cwd=tmp_path
    )
    assert code == 0, output  # an empty folder is fine


@pytest.mark.slow
def test_a_run_killed_before_its_first_checkpoint_is_not_mixed_with_another(tmp_path):
    first = ("hydra.run.dir=run", "epochs=3", "progress=plain", "micro_batch_size=8")
    process = start_ga_train(*first, cwd=tmp_path)
    deadline = time.time() + 120
    while not glob.glob(str(tmp_path / "run" / "tensorboard" / "events.*")):
        assert process.poll() is None and time.time() < deadline, process.communicate()[0]
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not glob.glob(str(tmp_path / "run" / "checkpoints" / "ckpt-*"))
    old_events = glob.glob(str(tmp_path / "run" / "tensorboard" / "events.*"))
    code, output = ga_train("hydra.run.dir=run", "epochs=1", cwd=tmp_path)
    assert code == 2 and "holds an earlier run of another command" in output, output
    assert glob.glob(str(tmp_path / "run" / "tensorboard" / "events.*")) == old_events
    code, output = ga_train(*first[:2], "progress=none", first[3], cwd=tmp_path)
    assert code == 0, output  # the same command (progress may change) starts again, clean
    events = glob.glob(str(tmp_path / "run" / "tensorboard" / "events.*"))
    assert len(events) == 1 and events != old_events


@pytest.fixture
def small_disk(tmp_path):
    """A 420 KiB tmpfs: room for the default job's first checkpoint, not its second."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=420k", "tmpfs", str(mount_point)],
        capture_output=True,
    )
    if done.returncode != 0:
        pytest.skip(f"could not mount a tmpfs: {done.stderr.decode().strip()}")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=False)


@pytest.mark.slow
def test_a_full_disk_is_named_as_such_and_the_run_resumes_once_there_is_room(tmp_path, small_disk):
    # TensorFlow reports a full disk while checkpointing as a resource exhausted: it was taken
    # for out of device memory ("try micro_batch_size=16"), then failure.json could not be
    # written either (a traceback) and its 0-byte temporary file stayed.
    run_dir = small_disk / "run"
    code, output = ga_train("epochs=2", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert code == 1 and "Traceback" not in output, output
    message = [line for line in output.splitlines() if line.startswith("ga-train: ")][-1]
    assert message.startswith(f"ga-train: the disk of {run_dir} is full ("), message
    assert "This is disk space, not device memory" in message and "micro_batch_size" not in message
    assert f"continue with resume={run_dir}" in message
    assert not glob.glob(str(run_dir / ".writing-*")) and not glob.glob(str(run_dir / ".model-*"))
    subprocess.run(["mount", "-o", "remount,size=3m", str(small_disk)], check=True)
    code, output = ga_train("epochs=2", f"resume={run_dir}", cwd=tmp_path)
    assert code == 0, output
    assert "resume: from epoch 2, micro-batch 0 of it" in output
    assert os.path.exists(run_dir / "result.json") and os.path.exists(run_dir / "model.keras")


@pytest.mark.slow
def test_an_unwritable_checkpoint_folder_is_found_at_start(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").write_text("a file where the folder should be")
    code, output = ga_train(f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert code == 2 and "Traceback" not in output, output
    assert f"the checkpoint folder {run_dir}/checkpoints cannot be written" in output, output
    assert not (run_dir / "tensorboard").exists()  # found before training, not at the first save
    assert (run_dir / "checkpoints").read_text() == "a file where the folder should be"


@pytest.mark.slow
def test_a_second_run_on_a_held_directory_is_refused(tmp_path):
    command = [
        os.path.join(os.path.dirname(sys.executable), "ga-train"),
        "epochs=4",
        "progress=plain",
        "hydra.run.dir=shared",
    ]
    first = subprocess.Popen(
        command,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
    )
    lock = tmp_path / "shared" / ".gacli.lock"
    deadline = time.time() + 120
    while not (lock.exists() and lock.read_text()):
        assert first.poll() is None and time.time() < deadline
        time.sleep(0.05)
    hydra_record = tmp_path / "shared" / ".hydra" / "overrides.yaml"
    while not (hydra_record.exists() and hydra_record.read_text()):  # created, then written
        assert first.poll() is None and time.time() < deadline
        time.sleep(0.05)
    recorded = hydra_record.read_text()
    code, output = ga_train("epochs=1", "hydra.run.dir=shared", cwd=tmp_path)
    assert code == 2 and "Traceback" not in output, output
    assert f"shared is in use by another run: ga-train, pid {first.pid}" in output, output
    first_output = first.communicate(timeout=300)[0]
    assert first.returncode == 0, first_output
    # The refused run wrote nothing: not Hydra's record of the job, not a result.
    assert hydra_record.read_text() == recorded
    assert run_dir_of(first_output).endswith("shared")


def test_bad_input_never_removes_a_directory_that_holds_something_else(tmp_path):
    # A folder of the user's is now refused as a run directory before anything else is checked
    # (test_a_folder_of_the_users_is_never_written_into), so the bad data path is never reached;
    # the folder stays whole.
    existing = tmp_path / "mine"
    existing.mkdir()
    (existing / "notes.txt").write_text("the user's own file")
    code, output = ga_train(
        "dataset=npz",
        f"dataset.path={tmp_path}/missing.npz",
        f"hydra.run.dir={existing}",
        cwd=tmp_path,
    )
    assert code == 2 and "already holds files that ga-train did not write (notes.txt)" in output
    assert os.listdir(existing) == ["notes.txt"]
    assert (existing / "notes.txt").read_text() == "the user's own file"
