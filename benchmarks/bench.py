"""Throughput and memory of gradient accumulation: plain Keras, Keras' own, gacli's and ga-train's.

Every (model, jit_compile, configuration) runs in a fresh process, repetition after repetition, the
configurations of one repetition in a seeded random order. The verdict is a paired ratio: a
configuration's samples/s divided by A's in the same repetition, then the median over repetitions.

    python benchmarks/bench.py                       # the full run (5 repetitions)
    python benchmarks/bench.py --quick --reps 1      # a smoke test of tiny models
    python benchmarks/bench.py --turns 10            # configurations take turns (turns.py)

Configurations, all on the same model, data pipeline, loss, metrics and SGD optimizer:
    A  plain fit, batch b              B  plain fit, batch k*b
    C  Keras gradient_accumulation_steps=k, batch b
    gacli_model      gacli.wrap_model(model, accum_steps=k), batch b, steps_per_execution=k
    gacli_optimizer  gacli.GradientAccumulateOptimizer(SGD, accum_steps=k) in a plain Model,
                     steps_per_execution=k
    ga_train         the ga-train command line (gacli.runner.command.cli.main) on the same arrays
                     (dataset=npz); it runs a window per call by default (steps_per_execution=k)
and references outside the targets, to show where the time goes:
    A_spe            A with steps_per_execution=k: plain Keras with the same calls
    A_again          A in a second process: its paired ratio to A is the method's own spread
    gacli_model_1    gacli_model with one micro-batch a call (Keras' default)
    gacli_model_gns  gacli_model measuring the gradient noise scale as ga-train's monitor.gns
                     does (noise_scale=True, noise_scale_every=monitor.gns_every's default): its
                     paired ratio to gacli_model is the cost of monitor.gns
                     (GACLI_BENCH_GNS_EVERY=n: every n-th window measured instead)
    ga_train_gns     ga_train with monitor.gns=true: its paired ratio to ga_train is the cost of
                     monitor.gns where ga-train runs it (its non-finite check on;
                     GACLI_BENCH_GNS_EVERY=n: every n-th window measured instead)
    ga_train_again   ga_train in a second process: its paired ratio to ga_train is the method's
                     own spread for ga-train, and beside it the report gives ga_train_gns against
                     both ga-train processes (the geometric mean of the two)
    ga_train_at      ga_train as gacli at an earlier commit ran it (--commit REV, checked out
                     in a git worktree for the run): its paired ratio to ga_train says whether
                     today's engine is as fast as that one, in the same minutes of the machine
    ga_train_gns_at  ga_train_gns as gacli at --commit ran it: its paired ratio to ga_train_gns
                     says whether today's noise scale costs less than that commit's

Writes results/<name>.md (medians, paired ratios, targets), results/<name>.json (every raw number)
and results/<name>.png (paired ratio vs A per configuration).
"""

import argparse
import json
import os
import platform
import random
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from turns import READY, TURN_DONE, Baton, run_in_turns, worker_command  # noqa: E402

CONFIGS = {
    "A": "A: fit, batch b",
    "B": "B: fit, batch k*b",
    "C": "C: Keras gradient_accumulation_steps",
    "gacli_model": "gacli wrap_model",
    "gacli_optimizer": "gacli GradientAccumulateOptimizer",
    "ga_train": "ga-train (CLI)",
    "A_spe": "A, steps_per_execution=k",
    "A_again": "A again, in another process",
    "gacli_model_1": "gacli wrap_model, steps_per_execution=1",
    "gacli_model_gns": "gacli wrap_model, noise_scale=True",
    "ga_train_gns": "ga-train, monitor.gns=true",
    "ga_train_again": "ga-train again, in another process",
    "ga_train_at": "ga-train at --commit",
    "ga_train_gns_at": "ga-train, monitor.gns=true, at --commit",
}
# The configurations that run the ga-train command line.
GA_TRAIN_CONFIGS = ("ga_train", "ga_train_gns", "ga_train_again", "ga_train_at", "ga_train_gns_at")
# The configurations that run gacli at --commit, and those that measure the noise scale.
AT_COMMIT_CONFIGS = ("ga_train_at", "ga_train_gns_at")
GNS_CONFIGS = ("ga_train_gns", "ga_train_gns_at")
# The ways gacli is meant to be run: the targets are checked on these.
GACLI_CONFIGS = ("gacli_model", "gacli_optimizer", "ga_train")
# Configurations that run k micro-batches per compiled call.
WINDOW_PER_CALL = ("A_spe", "gacli_model", "gacli_optimizer", "gacli_model_gns")

# Sizes of the full run; the window is counted in optimizer updates of k*b samples each.
MODELS = {
    "unet": dict(
        short="UNet",
        title="UNet 128x128x1, 4 levels, 16 base filters",
        task="segmentation",
        input_shape=[128, 128, 1],
        num_outputs=1,
        model={"name": "unet", "depth": 4, "base_filters": 16},
        micro_batch_size=8,
        accum_steps=8,
        warmup_updates=2,
        measure_updates=4,
    ),
    "mlp": dict(
        short="MLP",
        title="MLP 784-512-256-10",
        task="classification",
        input_shape=[784],
        num_outputs=10,
        model={"name": "mlp", "hidden_units": [512, 256]},
        micro_batch_size=32,
        accum_steps=8,
        warmup_updates=2,
        measure_updates=80,
    ),
}
QUICK_MODELS = {
    "unet": dict(
        MODELS["unet"],
        title="UNet 32x32x1, 2 levels, 4 base filters (quick)",
        input_shape=[32, 32, 1],
        model={"name": "unet", "depth": 2, "base_filters": 4},
        micro_batch_size=4,
        accum_steps=2,
        warmup_updates=2,
        measure_updates=4,
    ),
    "mlp": dict(
        MODELS["mlp"],
        title="MLP 64-32-16-10 (quick)",
        input_shape=[64],
        model={"name": "mlp", "hidden_units": [32, 16]},
        micro_batch_size=8,
        accum_steps=2,
        warmup_updates=2,
        measure_updates=8,
    ),
}
LEARNING_RATE = 0.01
STARTUP_COMMANDS = {"help": ["--help"], "config_error": ["accum_steps=0"]}
STARTUP_TARGET_S = 2.0


# --------------------------------------------------------------------------------------------
# Worker: one configuration in this fresh process; writes its numbers to spec["result_path"].


def synthetic_arrays(spec):
    """The in-memory data set: four windows of samples, seeded, identical for every config."""
    import numpy as np

    rng = np.random.default_rng(spec["seed"])
    count = 4 * spec["micro_batch_size"] * spec["accum_steps"]
    x = rng.normal(size=[count] + spec["input_shape"]).astype("float32")
    if spec["task"] == "segmentation":
        y = (x > 0.5).astype("float32")  # a mask the model can learn: bright pixels
    else:
        y = rng.integers(0, spec["num_outputs"], size=count).astype("int32")
    return x, y


def rss_high_water_mark(reset=False):
    """The process's peak RSS in bytes since start or the last reset (Linux: VmHWM); None where
    /proc is missing. ``reset``: start a new high-water mark after reading this one."""
    try:
        with open("/proc/self/status") as handle:
            peak = next(int(line.split()[1]) * 1024 for line in handle if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None
    if reset:
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")  # since Linux 4.0: resets VmHWM to the current RSS
        except OSError:
            pass  # the window's peak is then the process's so far, as before the reset
    return peak


class WindowTimer:
    """Wall and process CPU time between two batch ends (the steady-state window).

    ``read_updates`` returns the optimizer updates applied so far; reading it also waits for the
    step's computation, so the clocks are read after the work they time.
    """

    def __init__(self, start_batch, end_batch, read_updates, baton=None):
        self.start_batch, self.end_batch = start_batch, end_batch
        self.read_updates = read_updates
        self.marks = {}
        self.rss_peaks = {}
        self.train_begin = None
        self.baton = baton  # --turns: the window is trained in turns (benchmarks/turns.py)
        self.paused = [0.0, 0.0]  # wall and CPU seconds waiting for turns inside the window
        self.turns = 0

    def begin(self):
        self.train_begin = time.perf_counter()

    def batch_end(self, batch):
        for name, index in (("start", self.start_batch), ("end", self.end_batch)):
            if batch == index:
                updates = int(self.read_updates())
                self.marks[name] = (time.perf_counter(), time.process_time(), updates)
                # The warm-up's peak (trace, compile, first updates), then the timed window's own.
                self.rss_peaks[name] = rss_high_water_mark(reset=name == "start")
        if self.baton is not None:
            self._take_turns(batch)

    def _take_turns(self, batch):
        """Hand the machine over at the window's start and every turn; say when it ends."""
        since = batch - self.start_batch
        if batch == self.end_batch:
            self.baton.window_done()
        elif since == 0 or (0 < since and since % self.baton.turn_steps == 0):
            self.read_updates()  # the step's computation is over before the clocks stop
            wall, cpu = time.perf_counter(), time.process_time()
            self.baton.wait_for_turn(READY if since == 0 else TURN_DONE)
            self.paused[0] += time.perf_counter() - wall
            self.paused[1] += time.process_time() - cpu
            self.turns += 1

    def figures(self):
        if set(self.marks) != {"start", "end"}:
            raise RuntimeError(f"the timed window was not reached (marks: {sorted(self.marks)})")
        (wall0, cpu0, updates0), (wall1, cpu1, updates1) = self.marks["start"], self.marks["end"]
        return {
            "wall_s": wall1 - wall0 - self.paused[0],
            "cpu_s": cpu1 - cpu0 - self.paused[1],
            "turns": self.turns,
            "updates_in_window": updates1 - updates0,
            "updates_total": updates1,
            "warmup_s": wall0 - self.train_begin,  # trace, XLA compile and warm-up steps
            "warmup_peak_rss_bytes": self.rss_peaks["start"],
            "window_peak_rss_bytes": self.rss_peaks["end"],
        }


def timer_callback(timer):
    import keras

    class TimerCallback(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            timer.begin()

        def on_train_batch_end(self, batch, logs=None):
            timer.batch_end(batch)

    return TimerCallback()


def gns_every():
    """Every how many windows the noise scale's configurations measure: GACLI_BENCH_GNS_EVERY,
    unset or empty for monitor.gns_every's default."""
    import importlib

    # The schema's module at the checked-out commit (ga_train_at): config/schema.py since the
    # runner has rooms, config.py before.
    try:
        schema = importlib.import_module("gacli.runner.config.schema")
    except ImportError:
        schema = importlib.import_module("gacli.runner.config")
    return int(os.environ.get("GACLI_BENCH_GNS_EVERY") or schema.MonitorConfig.gns_every)


def build_library_config(spec):
    """(compiled model, repeated dataset, batch size) of A, B, C or one of gacli's wrappers."""
    import keras
    import tensorflow as tf

    import gacli
    from gacli.runner.builders.job import loss_and_metrics

    name, k = spec["config"], spec["accum_steps"]
    name = "A" if name == "A_again" else name
    batch_size = spec["micro_batch_size"] * (k if name == "B" else 1)
    x, y = synthetic_arrays(spec)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size).repeat()

    keras.utils.set_random_seed(spec["seed"])
    model = shipped_model(spec)
    loss, metrics = loss_and_metrics(spec["task"], spec["num_outputs"])
    if name == "C":
        optimizer = keras.optimizers.SGD(LEARNING_RATE, gradient_accumulation_steps=k)
    elif name == "gacli_optimizer":
        optimizer = gacli.GradientAccumulateOptimizer(
            keras.optimizers.SGD(LEARNING_RATE), accum_steps=k
        )
    else:
        optimizer = keras.optimizers.SGD(LEARNING_RATE)
    if name in ("gacli_model", "gacli_model_1"):
        model = gacli.wrap_model(model, accum_steps=k)
    elif name == "gacli_model_gns":
        model = gacli.wrap_model(
            model, accum_steps=k, noise_scale=True, noise_scale_every=gns_every()
        )
    model.compile(
        optimizer=optimizer,
        loss=loss,
        metrics=metrics,
        jit_compile=spec["jit"],
        steps_per_execution=k if name in WINDOW_PER_CALL else 1,
    )
    return model, data, batch_size


def run_library_config(spec, timer_window, build=None):
    """A, B, C and gacli's two wrappers (or what ``build(spec)`` returns as (compiled model,
    repeated dataset, batch size)): build, compile and fit in this process."""
    import gacli

    model, data, batch_size = (build or build_library_config)(spec)

    def read_updates():
        accumulator = gacli.find_accumulating_optimizer(model.optimizer)
        if accumulator is not None:
            return accumulator.optimizer_step.numpy()
        # Under gradient_accumulation_steps Keras' `iterations` is already micro-steps // k.
        return model.optimizer.iterations.numpy()

    warmup_steps, measure_steps = (
        timer_window["warmup_samples"] // batch_size,
        timer_window["measure_samples"] // batch_size,
    )
    timer = WindowTimer(
        warmup_steps - 1,
        warmup_steps + measure_steps - 1,
        read_updates,
        Baton.from_spec(spec, batch_size),
    )
    rss_before_fit = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model.fit(
        data,
        epochs=1,
        steps_per_epoch=warmup_steps + measure_steps,
        verbose=0,
        callbacks=[timer_callback(timer)],
    )
    return dict(
        timer.figures(),
        params=model.count_params(),
        batch_size=batch_size,
        samples=measure_steps * batch_size,
        rss_before_fit_bytes=rss_before_fit,
    )


def run_ga_train(spec, timer_window, job_dir):
    """The ga-train command line, in this process, with a timer in its progress-callback slot.

    ``gacli.runner.command.cli.main`` composes the config with Hydra, validates it and calls
    ``train()``, which builds its own callbacks; the timer rides in a subclass of its
    ProgressCallback (progress=none, so that callback does nothing else). Everything train() runs
    per batch (its TensorBoard logger included) is inside the timed window; data loading, compile
    and the warm-up updates are not.
    """
    import numpy as np

    cli, train = ga_train_modules()
    x, y = synthetic_arrays(spec)
    data_path = os.path.join(job_dir, "data.npz")
    np.savez(data_path, x=x, y=y)
    k, micro = spec["accum_steps"], spec["micro_batch_size"]
    warmup_steps = timer_window["warmup_samples"] // micro
    measure_steps = timer_window["measure_samples"] // micro
    found = {}

    class TimedProgress(train.ProgressCallback):
        def __init__(self, console, mode, plan, accumulator, *args, **kwargs):
            super().__init__(console, mode, plan, accumulator, *args, **kwargs)
            self.timer = WindowTimer(
                warmup_steps - 1,
                warmup_steps + measure_steps - 1,
                lambda: accumulator.optimizer_step.numpy(),
                Baton.from_spec(spec, micro),
            )
            found["timer"] = self.timer

        def on_train_begin(self, logs=None):
            self.timer.begin()
            super().on_train_begin(logs)

        def on_train_batch_end(self, batch, logs=None):
            super().on_train_batch_end(batch, logs)
            self.timer.batch_end(batch)

        def on_train_end(self, logs=None):
            super().on_train_end(logs)
            found["params"] = self.model.count_params()

    train.ProgressCallback = TimedProgress
    overrides = ga_train_overrides(
        spec, data_path, (warmup_steps + measure_steps) // k, spec["config"] in GNS_CONFIGS
    ) + [f"hydra.run.dir={os.path.join(job_dir, 'run')}"]
    rss_before_fit = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    status = cli.main(overrides)
    if status:
        raise RuntimeError(f"ga-train exited with status {status}")
    if "timer" not in found:
        raise RuntimeError(
            "train() created no gacli.runner.training.run.ProgressCallback, which the timer "
            "rides in; update run_ga_train in bench.py"
        )
    return dict(
        found["timer"].figures(),
        params=found["params"],
        batch_size=micro,
        samples=measure_steps * micro,
        rss_before_fit_bytes=rss_before_fit,
        overrides=overrides,
    )


def shipped_model(spec):
    """The shipped model that ``spec["model"]`` names ({"name": "unet", its arguments}), built
    by the function its config file names (configs/model/unet.yaml: gacli.models.unet)."""
    import gacli.models

    arguments = dict(spec["model"])
    build = getattr(gacli.models, arguments.pop("name"))
    return build(tuple(spec["input_shape"]), spec["num_outputs"], spec["task"], **arguments)


def ga_train_overrides(spec, data_path, updates, gns):
    """ga-train's overrides for the job of ``spec`` on the arrays saved at ``data_path``: one
    epoch of ``updates`` updates, no checkpoints, no progress display; ``gns``: monitor.gns on
    (every ``GACLI_BENCH_GNS_EVERY``-th window)."""
    model = [f"model={spec['model']['name']}"] + [
        f"model.{key}={json.dumps(value).replace(' ', '')}"
        for key, value in spec["model"].items()
        if key != "name"
    ]
    overrides = model + [
        "dataset=npz",
        f"dataset.path={data_path}",
        "dataset.validation_split=0",
        "dataset.shuffle=false",
        f"dataset.num_classes={spec['num_outputs']}",
        "optimizer=sgd",
        f"optimizer.learning_rate={LEARNING_RATE}",
        f"micro_batch_size={spec['micro_batch_size']}",
        f"accum_steps={spec['accum_steps']}",
        "epochs=1",
        f"steps_per_epoch={updates}",
        f"jit_compile={str(spec['jit']).lower()}",
        "progress=none",
        "checkpoint=false",
        f"seed={spec['seed']}",
    ]
    if gns:
        overrides += ["monitor.gns=true", f"monitor.gns_every={gns_every()}"]
    return overrides


def ga_train_modules():
    """The modules of ``ga-train``'s entry point and of ``train()`` (whose ProgressCallback the
    timer rides in), wherever the checked-out commit keeps them (``ga_train_at`` runs older
    commits): ``gacli.runner.command.cli`` and ``gacli.runner.training.run`` since the runner
    has rooms; before that ``gacli.runner.cli`` and ``gacli.runner.run`` (``.train`` before the
    runner was split); before the runner had its own package, ``gacli.cli`` and ``gacli.train``.
    Told apart by the package's folders: an editable install's import hook would find today's
    ``gacli.runner`` for an older ``gacli`` too."""
    import importlib

    import gacli

    runner = Path(gacli.__file__).parent / "runner"
    if (runner / "command").is_dir():
        names = ("gacli.runner.command.cli", "gacli.runner.training.run")
    elif runner.is_dir():
        job = "run" if (runner / "run.py").is_file() else "train"
        names = ("gacli.runner.cli", f"gacli.runner.{job}")
    else:
        names = ("gacli.cli", "gacli.train")
    return tuple(importlib.import_module(name) for name in names)


def run_worker(spec, build=None):
    """One configuration in this process; ``build``: as for :func:`run_library_config`."""
    if spec.get("gacli_tree"):
        # ga_train_at: that commit's gacli (and its configs) before the installed one.
        sys.path.insert(0, spec["gacli_tree"])
    import tensorflow as tf

    # Before any op runs: the same thread pools for every configuration.
    tf.config.threading.set_intra_op_parallelism_threads(spec["threads"])
    tf.config.threading.set_inter_op_parallelism_threads(spec["threads"])
    window_samples = spec["micro_batch_size"] * spec["accum_steps"]
    timer_window = {
        "warmup_samples": spec["warmup_updates"] * window_samples,
        "measure_samples": spec["measure_updates"] * window_samples,
    }
    if spec["config"] in GA_TRAIN_CONFIGS:
        figures = run_ga_train(spec, timer_window, spec["job_dir"])
    else:
        figures = run_library_config(spec, timer_window, build)
    device_peak = None
    if tf.config.list_physical_devices("GPU"):
        device_peak = tf.config.experimental.get_memory_info("GPU:0")["peak"]
    import gacli

    figures.update(
        gacli_path=str(Path(gacli.__file__).parent),  # which gacli ran (ga_train_at: the commit's)
        samples_per_s=figures["samples"] / figures["wall_s"],
        cpu_ms_per_sample=1000 * figures["cpu_s"] / figures["samples"],
        # ru_maxrss (KiB on Linux) restarts with the timer's reset, and with train()'s at a job's
        # start: the process's peak is the largest of the peaks before fit, the warm-up's, the
        # window's and the rest's.
        peak_rss_bytes=max(
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            figures["rss_before_fit_bytes"],
            figures["warmup_peak_rss_bytes"] or 0,
            figures["window_peak_rss_bytes"] or 0,
        ),
        device_peak_bytes=device_peak,
    )
    with open(spec["result_path"], "w") as handle:
        json.dump(figures, handle)


# --------------------------------------------------------------------------------------------
# Parent: schedule fresh processes, interleaved, and summarise.


def worker_env(threads, full_errors=True):
    """The same environment for every process; ``full_errors``: tracebacks from ga-train too."""
    env = dict(
        os.environ,
        TF_CPP_MIN_LOG_LEVEL="2",
        PYTHONHASHSEED="0",
        KERAS_BACKEND="tensorflow",
        OMP_NUM_THREADS=str(threads),
        PYTHONUNBUFFERED="1",
    )
    env.pop("TF_XLA_FLAGS", None)
    env.pop("HYDRA_FULL_ERROR", None)
    if full_errors:
        env["HYDRA_FULL_ERROR"] = "1"
    return env


def failure_reason(stderr):
    """The one line of a worker's stderr that says what went wrong."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|Exit)\b", line)]
    line = (errors or lines or ["no output"])[-1]
    return line if len(line) <= 200 else line[:197] + "..."


def _job_paths(spec, work_dir):
    """(spec with its job directory and result path, the record its result is filed under)."""
    name = f"{spec['rep']}_{spec['model_key']}_jit{int(spec['jit'])}_{spec['config']}"
    job_dir = Path(work_dir) / name
    job_dir.mkdir(parents=True)
    spec = dict(spec, job_dir=str(job_dir), result_path=str(job_dir / "result.json"))
    record = {key: spec[key] for key in ("rep", "model_key", "jit", "config")}
    return spec, record


def _job_result(spec, record, returncode, stderr, process_s):
    record = dict(record, process_s=process_s)
    if returncode != 0 or not os.path.exists(spec["result_path"]):
        return dict(
            record,
            status="failed",
            error=failure_reason(stderr),
            returncode=returncode,
            stderr_tail=stderr.splitlines()[-20:],
        )
    with open(spec["result_path"]) as handle:
        return dict(record, status="ok", **json.load(handle))


def run_job(spec, work_dir, threads, timeout_s, script=None):
    """Run ``script`` (default: this one) with ``--worker spec`` in a fresh process."""
    spec, record = _job_paths(spec, work_dir)
    command = worker_command(script or Path(__file__).resolve()) + [json.dumps(spec)]
    started = time.perf_counter()
    try:
        done = subprocess.run(
            command,
            cwd=spec["job_dir"],
            env=worker_env(threads),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return dict(
            record,
            status="failed",
            error=f"timed out after {timeout_s} s",
            process_s=time.perf_counter() - started,
        )
    return _job_result(spec, record, done.returncode, done.stderr, time.perf_counter() - started)


def run_jobs_in_turns(specs, work_dir, threads, timeout_s, turn_updates, seed, script=None):
    """The jobs of one repetition side by side, taking turns of ``turn_updates`` updates
    (benchmarks/turns.py), each ``script`` (default: this one) ``--worker spec``; their results,
    as :func:`run_job`'s."""
    prepared = [
        _job_paths(dict(spec, baton={"turn_updates": turn_updates}), work_dir) for spec in specs
    ]
    try:
        outcomes = run_in_turns(
            [worker_command(script or Path(__file__).resolve())] * len(prepared),
            [spec for spec, _ in prepared],
            [spec["job_dir"] for spec, _ in prepared],
            worker_env(threads),
            timeout_s,
            seed,
        )
    except TimeoutError:
        # Those that had written their figures keep them; the others failed.
        error = f"the workers taking turns ran past {timeout_s} s"
        return [
            _job_result(spec, record, 0, "", timeout_s)
            if os.path.exists(spec["result_path"])
            else dict(record, status="failed", error=error)
            for spec, record in prepared
        ]
    results = []
    for (spec, record), (returncode, process_s) in zip(prepared, outcomes):
        log = Path(spec["job_dir"]) / "worker.log"
        results.append(_job_result(spec, record, returncode, log.read_text(), process_s))
    return results


def ga_train_command():
    from shutil import which

    script = which("ga-train")
    return [script] if script else [sys.executable, "-m", "gacli.runner.command.cli"]


def time_startup(kind, rep, work_dir, threads):
    """Wall time of one ga-train --help or config error, in a fresh process."""
    started = time.perf_counter()
    done = subprocess.run(
        ga_train_command() + STARTUP_COMMANDS[kind],
        cwd=work_dir,
        env=worker_env(threads, full_errors=False),
        capture_output=True,
        text=True,
        timeout=120,
    )
    wall = time.perf_counter() - started
    output = (done.stdout if kind == "help" else done.stderr).strip().splitlines()
    return {
        "rep": rep,
        "kind": kind,
        "wall_s": wall,
        "returncode": done.returncode,
        "first_line": output[0] if output else "",
    }


def paired(runs, rep_key, numerator, denominator, field="samples_per_s"):
    """Per-repetition ratios numerator/denominator (same model, jit and repetition)."""
    by_key = {
        (r["rep"], r["model_key"], r["jit"], r["config"]): r for r in runs if r["status"] == "ok"
    }
    ratios = []
    for rep in sorted({r["rep"] for r in runs}):
        top = by_key.get((rep,) + rep_key + (numerator,))
        bottom = by_key.get((rep,) + rep_key + (denominator,))
        if top and bottom and top.get(field) is not None and bottom.get(field):
            ratios.append(top[field] / bottom[field])
    return ratios


def summarise(runs, models, jits, configs):
    """Medians per (model, jit, config) and paired ratios vs A."""
    summary = {}
    for model_key in models:
        for jit in jits:
            for config in configs:
                mine = [
                    r
                    for r in runs
                    if (r["model_key"], r["jit"], r["config"]) == (model_key, jit, config)
                ]
                ok = [r for r in mine if r["status"] == "ok"]
                row = {"reps_ok": len(ok), "reps": len(mine)}
                if not ok:
                    errors = [r.get("error", "") for r in mine]
                    row["error"] = errors[-1] if errors else "not run"
                else:
                    for field in (
                        "samples_per_s",
                        "cpu_ms_per_sample",
                        "peak_rss_bytes",
                        "warmup_s",
                        "wall_s",
                        "window_peak_rss_bytes",
                    ):
                        values = [r.get(field) for r in ok if r.get(field) is not None]
                        row[field] = statistics.median(values) if values else None
                    device = [r["device_peak_bytes"] for r in ok if r["device_peak_bytes"]]
                    row["device_peak_bytes"] = statistics.median(device) if device else None
                    row["params"] = sorted({r["params"] for r in ok})
                    row["samples"] = sorted({r["samples"] for r in ok})
                    row["updates_in_window"] = sorted({r["updates_in_window"] for r in ok})
                    if len(ok) < len(mine):
                        row["error"] = next(r["error"] for r in mine if r["status"] != "ok")
                    for name, field in (
                        ("vs_A", "samples_per_s"),
                        ("rss_vs_A", "peak_rss_bytes"),
                        ("window_rss_vs_A", "window_peak_rss_bytes"),
                    ):
                        ratios = paired(runs, (model_key, jit), config, "A", field)
                        row[name] = ratios
                summary[(model_key, jit, config)] = row
    return summary


def _median(values):
    return statistics.median(values) if values else None


def evaluate_targets(runs, summary, models, jits, startup):
    """[(target, measured, met)] with met True, False or None (not measured)."""
    targets = []

    def gacli_rows(model_key, jit, measure, threshold, compare):
        values = {c: measure(c) for c in GACLI_CONFIGS if (model_key, jit, c) in summary}
        values = {c: v for c, v in values.items() if v is not None}
        if not values:
            return "not measured", None
        measured = ", ".join(f"{c} {v:.2f}x" for c, v in values.items())
        failing = [c for c, v in values.items() if not compare(v, threshold)]
        return measured, not failing

    for jit in jits:
        label = f"jit {'on' if jit else 'off'}"
        # (The targets are checked on GACLI_CONFIGS; A_spe and gacli_model_1 are references.)
        if "unet" in models:
            for title, reference, threshold, field, compare in (
                ("samples/s >= 1.0x A", "A", 1.0, "samples_per_s", lambda v, t: v >= t),
                ("samples/s >= 1.3x C", "C", 1.3, "samples_per_s", lambda v, t: v >= t),
                ("peak RSS <= 1.05x A", "A", 1.05, "peak_rss_bytes", lambda v, t: v <= t),
            ):
                measure = lambda c, ref=reference, f=field, j=jit: _median(  # noqa: E731
                    paired(runs, ("unet", j), c, ref, f)
                )
                measured, met = gacli_rows("unet", jit, measure, threshold, compare)
                targets.append((f"UNet, {label}: gacli {title}", measured, met))
        if "mlp" in models:
            measure = lambda c, j=jit: _median(paired(runs, ("mlp", j), c, "B"))  # noqa: E731
            measured, met = gacli_rows("mlp", jit, measure, 0.75, lambda v, t: v >= t)
            targets.append((f"MLP, {label}: gacli samples/s >= 0.75x B", measured, met))
    if True in jits:
        for model_key in models:
            ratios = {
                c: _median(paired(runs, (model_key, True), c, "A"))
                for c in GACLI_CONFIGS
                if (model_key, True, c) in summary
            }
            ratios = {c: v for c, v in ratios.items() if v is not None}
            if ratios:
                worst = min(ratios, key=ratios.get)
                short = MODELS[model_key]["short"]
                targets.append(
                    (
                        f"{short}, jit on: every gacli config >= 0.9x A (jit)",
                        f"lowest {worst} {ratios[worst]:.2f}x",
                        ratios[worst] >= 0.9,
                    )
                )
    for model_key in models:
        for jit in jits:
            for measured, reference, what, floor in (
                ("gacli_model_gns", "gacli_model", "noise_scale", 0.98),
                ("ga_train_gns", "ga_train", "monitor.gns in ga-train", 0.97),
            ):
                cost = _median(paired(runs, (model_key, jit), measured, reference))
                if cost is not None:
                    targets.append(
                        (
                            f"{MODELS[model_key]['short']}, jit {'on' if jit else 'off'}: {what} "
                            f"costs <= {100 - 100 * floor:.0f}% ({measured} / {reference} "
                            f">= {floor})",
                            f"{cost:.3f}x",
                            cost >= floor,
                        )
                    )
            for today, then, what in (
                ("ga_train", "ga_train_at", "ga-train"),
                ("ga_train_gns", "ga_train_gns_at", "ga-train with monitor.gns"),
            ):
                ratios = paired(runs, (model_key, jit), today, then)
                if ratios:
                    targets.append(
                        (
                            f"{MODELS[model_key]['short']}, jit {'on' if jit else 'off'}: {what} "
                            f"no slower than at --commit ({today} / {then} >= 1.00)",
                            _ratio(ratios),
                            _median(ratios) >= 1.0,
                        )
                    )
    for kind, command in STARTUP_COMMANDS.items():
        walls = [s["wall_s"] for s in startup if s["kind"] == kind]
        if walls:
            median = statistics.median(walls)
            targets.append(
                (
                    f"ga-train {' '.join(command)} < {STARTUP_TARGET_S:.0f} s",
                    f"{median:.2f} s",
                    median < STARTUP_TARGET_S,
                )
            )
    return targets


# --------------------------------------------------------------------------------------------
# Reports.


def _mib(value):
    return "n/a" if value is None else f"{value / 2**20:,.0f}"


def _ratio(ratios):
    if not ratios:
        return "-"
    if len(ratios) == 1:
        return f"{ratios[0]:.2f}x"
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def _method(meta):
    """How the processes of a repetition were run, for the report's first paragraph."""
    if meta.get("turns"):
        return (
            "Each configuration ran in its own process. The processes of a repetition ran side by "
            "side and took turns: each trained its warm-up, then only one trained at a time, "
            f"{meta['turns']} optimizer updates a turn, in a seeded random order each round, and "
            "a configuration's time is the sum of its own turns (benchmarks/turns.py)."
        )
    return (
        "Each configuration ran in its own process, the configurations of a repetition in a "
        "seeded random order."
    )


def _gns_every_words(meta):
    """What the header says of GACLI_BENCH_GNS_EVERY, where it was set."""
    every = meta.get("gns_every") or 1
    if every == 1:
        return ""
    return (
        f" The noise scale's configurations measured every {every}-th window only "
        f"(GACLI_BENCH_GNS_EVERY={every}: monitor.gns_every, noise_scale_every)."
    )


def markdown_report(meta, summary, targets, startup, models, jits, configs):
    lines = [
        f"# gacli benchmark: {meta['name']}",
        "",
        f"{meta['date']}; {meta['cpu_count']} CPU cores, {meta['threads']} TF threads; "
        f"TensorFlow {meta['tensorflow']}, Keras {meta['keras']}, gacli {meta['gacli']}; "
        f"{meta['reps']} repetitions{' (quick sizes)' if meta['quick'] else ''}."
        + _gns_every_words(meta)
        + (
            f" ga_train_at and ga_train_gns_at ran gacli at commit {meta['commit']}."
            if meta.get("commit")
            else ""
        ),
        "",
        _method(meta) + " Cells are medians over repetitions; `x A` is the paired ratio (this "
        "configuration / A in the same repetition), median (min-max). Samples/s and CPU ms/sample "
        "cover the same number of samples after a warm-up (trace, compile, first updates); peak "
        "RSS is the whole process's, and the timed-window peak RSS the high-water mark after the "
        "warm-up (Linux VmHWM, reset when the timed window starts): what training holds once "
        "tracing and compiling are over.",
    ]
    for model_key in models:
        spec = meta["models"][model_key]
        window = spec["micro_batch_size"] * spec["accum_steps"]
        for jit in jits:
            lines += [
                "",
                f"## {spec['title']}, jit_compile={jit}",
                "",
                f"micro-batch b={spec['micro_batch_size']}, k={spec['accum_steps']}; timed "
                f"window: {spec['measure_updates'] * window} samples = {spec['measure_updates']} "
                f"updates of {window} after {spec['warmup_updates']} warm-up updates.",
                "",
                "| config | params | samples/s | x A | CPU ms/sample | peak RSS MiB | RSS x A "
                "| timed-window peak RSS MiB | x A | device peak MiB | updates in window "
                "| warm-up s | status |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
            ]
            for config in configs:
                row = summary[(model_key, jit, config)]
                if not row["reps_ok"]:
                    lines.append(
                        f"| {CONFIGS[config]} | - | - | - | - | - | - | - | - | - | - "
                        f"| - | failed: {row['error']} |"
                    )
                    continue
                status = (
                    "ok"
                    if row["reps_ok"] == row["reps"]
                    else (f"{row['reps_ok']}/{row['reps']} ok; failed: {row['error']}")
                )
                lines.append(
                    f"| {CONFIGS[config]} | {'/'.join(f'{p:,}' for p in row['params'])} "
                    f"| {row['samples_per_s']:,.1f} | {_ratio(row['vs_A'])} "
                    f"| {row['cpu_ms_per_sample']:.2f} | {_mib(row['peak_rss_bytes'])} "
                    f"| {_ratio(row['rss_vs_A'])} | {_mib(row['window_peak_rss_bytes'])} "
                    f"| {_ratio(row['window_rss_vs_A'])} | {_mib(row['device_peak_bytes'])} "
                    f"| {'/'.join(map(str, row['updates_in_window']))} | {row['warmup_s']:.1f} "
                    f"| {status} |"
                )
            params = {p for c in configs for p in summary[(model_key, jit, c)].get("params", [])}
            samples = {s for c in configs for s in summary[(model_key, jit, c)].get("samples", [])}
            lines += [
                "",
                f"Parameter counts {'match' if len(params) <= 1 else 'DIFFER'}; samples "
                f"in the timed window {'equal' if len(samples) <= 1 else 'DIFFER'}.",
            ]
    lines += [
        "",
        "## ga-train start-up",
        "",
        "| command | median s | min-max s | exit code | first line |",
        "|---|---:|---:|---:|---|",
    ]
    for kind, command in STARTUP_COMMANDS.items():
        mine = [s for s in startup if s["kind"] == kind]
        if mine:
            walls = [s["wall_s"] for s in mine]
            lines.append(
                f"| ga-train {' '.join(command)} | {statistics.median(walls):.2f} | "
                f"{min(walls):.2f}-{max(walls):.2f} | {mine[-1]['returncode']} | "
                f"{mine[-1]['first_line'][:80]} |"
            )
    met_text = {True: "yes", False: "**no**", None: "not measured"}
    lines += ["", "## Targets", "", "| target | measured (paired medians) | met |", "|---|---|---|"]
    lines += [f"| {title} | {measured} | {met_text[met]} |" for title, measured, met in targets]
    return "\n".join(lines) + "\n"


def draw_chart(path, meta, summary, models, jits, configs):
    """Paired samples/s ratio vs A per configuration, grouped by model and jit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [(m, j) for m in models for j in jits]
    width = 0.8 / len(configs)
    figure, axes = plt.subplots(figsize=(2.2 + 2.4 * len(groups), 4.5))
    for index, config in enumerate(configs):
        positions, medians, low, high = [], [], [], []
        for group_index, key in enumerate(groups):
            ratios = summary[key + (config,)].get("vs_A") or []
            if not ratios:
                axes.text(
                    group_index + (index - len(configs) / 2 + 0.5) * width,
                    0.02,
                    "failed",
                    rotation=90,
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
                continue
            median = statistics.median(ratios)
            positions.append(group_index + (index - len(configs) / 2 + 0.5) * width)
            medians.append(median)
            low.append(median - min(ratios))
            high.append(max(ratios) - median)
        axes.bar(positions, medians, width, yerr=[low, high], capsize=2, label=CONFIGS[config])
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xticks(range(len(groups)))
    axes.set_xticklabels([f"{MODELS[m]['short']} / jit {'on' if j else 'off'}" for m, j in groups])
    axes.set_ylabel("samples/s relative to A (paired median, min-max)")
    axes.set_title(f"gacli benchmark {meta['name']} ({meta['reps']} repetitions)")
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# --------------------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, help="repetitions (default 5; 2 with --quick)")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--jit", choices=["off", "on", "both"], default="both")
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=list(CONFIGS),
        help="default: all (ga_train_at and ga_train_gns_at only with --commit)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny models and windows: a smoke test"
    )
    parser.add_argument("--out", help="result name (default: full, or quick with --quick)")
    parser.add_argument("--results-dir", default=str(HERE / "results"))
    parser.add_argument("--measure-updates", type=int, help="optimizer updates in the timed window")
    parser.add_argument("--warmup-updates", type=int, help="optimizer updates before the window")
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count(),
        help="TF intra- and inter-op threads, the same for every configuration",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=1800,
        help="seconds per worker process (with --turns: per repetition's group of processes)",
    )
    parser.add_argument(
        "--turns",
        type=int,
        metavar="UPDATES",
        help="run a repetition's configurations side by side, taking turns of UPDATES optimizer "
        "updates (benchmarks/turns.py): on a machine whose speed drifts, paired ratios then "
        "compare the same minutes",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--commit",
        metavar="REV",
        help="the commit (any git revision of this repository) whose gacli ga_train_at and "
        "ga_train_gns_at run",
    )
    parser.add_argument(
        "--render",
        metavar="JSON",
        help="rewrite the table and chart of an earlier run from its raw JSON",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.reps is None:
        args.reps = 2 if args.quick else 5
    if args.configs is None:
        args.configs = [c for c in CONFIGS if c not in AT_COMMIT_CONFIGS or args.commit]
    if "A" not in args.configs:
        args.configs = ["A"] + args.configs  # every ratio is paired with A
    args.configs = [c for c in CONFIGS if c in args.configs]
    args.out = args.out or ("quick" if args.quick else "full")
    at_commit = any(c in AT_COMMIT_CONFIGS for c in args.configs)
    if at_commit != bool(args.commit) and not args.worker:
        parser.error(
            "ga_train_at or ga_train_gns_at and --commit REV go together: the commit whose "
            "ga-train they run"
        )
    return args


def versions():
    from importlib.metadata import version

    return {name: version(name) for name in ("tensorflow", "keras", "gacli")}


def run_all(args):
    """Every repetition of every job, interleaved; returns (meta, runs, startup)."""
    sizes = QUICK_MODELS if args.quick else MODELS
    models = {key: dict(sizes[key]) for key in args.models}
    for spec in models.values():
        spec["measure_updates"] = args.measure_updates or spec["measure_updates"]
        spec["warmup_updates"] = args.warmup_updates or spec["warmup_updates"]
    jits = {"off": [False], "on": [True], "both": [False, True]}[args.jit]
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    meta = dict(
        versions(),
        name=args.out,
        date=now,
        cpu_count=os.cpu_count(),
        threads=args.threads,
        reps=args.reps,
        quick=args.quick,
        seed=args.seed,
        python=platform.python_version(),
        machine=platform.machine(),
        argv=sys.argv[1:],
        turns=args.turns,
        models=models,
        gns_every=gns_every(),
    )
    jobs = [
        dict(spec, model_key=key, jit=jit, config=config, seed=args.seed, threads=args.threads)
        for key, spec in models.items()
        for jit in jits
        for config in args.configs
    ]
    runs, startup = [], []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gacli-bench-") as work_dir:
        if args.commit:
            tree, meta["commit"] = checkout(args.commit, Path(work_dir) / "at_commit")
            jobs = [
                dict(job, gacli_tree=tree) if job["config"] in AT_COMMIT_CONFIGS else job
                for job in jobs
            ]
        try:
            for rep in range(1, args.reps + 1):
                order = jobs + [{"startup": kind} for kind in STARTUP_COMMANDS]
                random.Random(args.seed * 1000 + rep).shuffle(order)
                run_repetition(args, rep, order, work_dir, runs, startup)
                if rep == 1 and args.reps > 1:
                    per_rep = time.perf_counter() - started
                    print(
                        f"one repetition took {per_rep:.0f} s; about "
                        f"{per_rep * (args.reps - 1) / 60:.0f} min to go",
                        flush=True,
                    )
        finally:
            if args.commit:
                _git("worktree", "remove", "--force", tree)
    meta["total_s"] = time.perf_counter() - started
    return meta, runs, startup


def _git(*words):
    """Run git in this repository; its output."""
    return subprocess.run(
        ["git", "-C", str(HERE.parent), *words], check=True, capture_output=True, text=True
    ).stdout.strip()


def checkout(revision, path):
    """A git worktree of this repository at ``revision``, at ``path`` (in the run's scratch
    directory; :func:`run_all` removes it afterwards); returns (its path, the commit's short
    hash)."""
    try:
        commit = _git("rev-parse", "--short", f"{revision}^{{commit}}")
    except (OSError, subprocess.CalledProcessError) as error:
        raise SystemExit(
            f"bench.py: --commit {revision} is not a commit of the repository at {HERE.parent} "
            f"({(getattr(error, 'stderr', '') or str(error)).strip()}); give one git knows "
            "there, e.g. --commit HEAD~1 or a hash from git log."
        ) from None
    _git("worktree", "add", "--detach", str(path), commit)
    # The wheel ships configs/ and recipes/ as gacli.configs and gacli.recipes (pyproject.toml's
    # package-dir); the worktree, imported from its folder, finds them where the wheel has them.
    for name in ("configs", "recipes"):
        inside = path / "gacli" / name
        if (path / name).is_dir() and not inside.exists():
            inside.symlink_to(Path("..") / name)
    return str(path), commit


def run_repetition(args, rep, order, work_dir, runs, startup):
    """One repetition's jobs in ``order``: one after another, or (``--turns``) each (model, jit)
    group's configurations side by side, taking turns. Appends to ``runs`` and ``startup``."""
    groups = {}
    for job in order:
        if "startup" in job:
            groups[("startup", job["startup"])] = job
        elif args.turns:
            groups.setdefault((job["model_key"], job["jit"]), []).append(job)
        else:
            groups[(job["model_key"], job["jit"], job["config"])] = [job]
    for index, (key, group) in enumerate(groups.items(), 1):
        prefix = f"[rep {rep}/{args.reps}, {index}/{len(groups)}]"
        if key[0] == "startup":
            result = time_startup(group["startup"], rep, work_dir, args.threads)
            startup.append(result)
            print(
                f"{prefix} ga-train {' '.join(STARTUP_COMMANDS[group['startup']])}: "
                f"{result['wall_s']:.2f} s, exit {result['returncode']}",
                flush=True,
            )
            continue
        group = [dict(job, rep=rep) for job in group]
        if args.turns:
            seed = args.seed * 1000 + rep
            results = run_jobs_in_turns(
                group, work_dir, args.threads, args.timeout, args.turns, seed
            )
        else:
            results = [run_job(group[0], work_dir, args.threads, args.timeout)]
        for job, result in zip(group, results):
            runs.append(result)
            what = f"{job['model_key']} jit={'on' if job['jit'] else 'off'} {job['config']}"
            if result["status"] == "ok":
                print(
                    f"{prefix} {what}: {result['samples_per_s']:,.1f} samples/s, "
                    f"process {result['process_s']:.0f} s",
                    flush=True,
                )
            else:
                print(f"{prefix} {what}: failed: {result['error']}", flush=True)


def control_report(runs, models, jits):
    """Where ga_train_again ran: the noise scale's cost beside the method's own spread, as lines
    of the report (none otherwise). ga_train and ga_train_again are the same configuration in two
    processes; their paired ratio is what two identical processes differ by, and ga_train_gns
    over the geometric mean of the two is its cost against a baseline of both."""
    lines = []
    for model_key in models:
        for jit in jits:
            key = (model_key, jit)
            spread = paired(runs, key, "ga_train_again", "ga_train")
            if not spread:
                continue
            cost = paired(runs, key, "ga_train_gns", "ga_train")
            again = paired(runs, key, "ga_train_gns", "ga_train_again")
            speeds = {
                config: {
                    r["rep"]: r["samples_per_s"]
                    for r in runs
                    if r["status"] == "ok"
                    and (r["model_key"], r["jit"], r["config"]) == key + (config,)
                }
                for config in ("ga_train_gns", "ga_train", "ga_train_again")
            }
            first, second = speeds["ga_train"], speeds["ga_train_again"]
            both = [
                gns / (first[rep] * second[rep]) ** 0.5
                for rep, gns in sorted(speeds["ga_train_gns"].items())
                if rep in first and rep in second
            ]
            title = f"{MODELS[model_key]['short']}, jit_compile={jit}"
            rows = (
                ("ga_train_again / ga_train (the method's spread)", spread, 1.0),
                ("ga_train_gns / ga_train", cost, 0.97),
                ("ga_train_gns / ga_train_again", again, 0.97),
                ("ga_train_gns / both (geometric mean)", both, 0.97),
            )
            lines += [
                f"| {title}: {name} | {_fine_ratio(r)} | {len(r)} | {_share(r, floor)} |"
                for name, r, floor in rows
            ]
    if not lines:
        return []
    return [
        "",
        "## The noise scale's cost against two ga-train processes",
        "",
        "ga_train and ga_train_again are the same configuration in two processes of each "
        "repetition: their ratio is what the method alone makes of no difference.",
        "",
        "| paired ratio | median (min-max) | repetitions | at or above |",
        "|---|---|---:|---|",
        *lines,
    ]


def _fine_ratio(ratios):
    """Median (min-max) to three decimals: the noise scale's cost is a few thousandths."""
    return f"{statistics.median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f})"


def _share(ratios, floor):
    """'n of m >= floor'."""
    return f"{sum(r >= floor for r in ratios)} of {len(ratios)} >= {floor:.2f}"


def write_reports(meta, runs, startup, results_dir):
    """<name>.md, <name>.json and <name>.png under ``results_dir``; prints the table."""
    models = list(meta["models"])
    jits = sorted({run["jit"] for run in runs})
    configs = [config for config in CONFIGS if any(run["config"] == config for run in runs)]
    summary = summarise(runs, models, jits, configs)
    targets = evaluate_targets(runs, summary, models, jits, startup)
    report = markdown_report(meta, summary, targets, startup, models, jits, configs)
    control = control_report(runs, models, jits)
    if control:
        report += "\n".join(control) + "\n"
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    base = results_dir / meta["name"]
    base.with_suffix(".md").write_text(report)
    raw = {
        "meta": meta,
        "runs": runs,
        "startup": startup,
        "targets": [{"target": t, "measured": m, "met": met} for t, m, met in targets],
    }
    base.with_suffix(".json").write_text(json.dumps(raw, indent=1))
    print("\n" + report)
    try:
        draw_chart(base.with_suffix(".png"), meta, summary, models, jits, configs)
    except ImportError:
        print("no chart: matplotlib is missing (pip install -e '.[benchmark]')", file=sys.stderr)
    print(f"wrote {base}.md, .json, .png (the run took {meta['total_s'] / 60:.1f} min)")


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        run_worker(json.loads(args.worker))
        return 0
    if args.render:
        raw = json.loads(Path(args.render).read_text())
        write_reports(raw["meta"], raw["runs"], raw["startup"], Path(args.render).parent)
        return 0
    write_reports(*run_all(args), args.results_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
