"""``probe=batch``: the critical batch, measured by branching.

Every size in ``probe.effective_sizes`` is trained from the same weights (the model's initial ones,
or those of the run given as ``probe.from``) on the same ``probe.samples`` training samples, in the
same order, then evaluated on the validation data. Each branch is a plain :class:`Run` of its own in
``<run dir>/branches/effective_<size>/``: the run that ``ga-train micro_batch_size=<m>
effective_batch_size=<size> epochs=1 steps_per_epoch=<samples / size>`` would make
(tests/runner/tools/test_batch_probe.py compares them), so accumulation reaches every size at the
memory of one micro-batch and no branch sees another's model, optimizer or data stream.
``probe.samples`` larger than the training set (the default 2048 on the digits' 1438) is cut, with a
printed line, to the largest multiple of every size within it, so that no branch sees a sample
twice.

The answer, ``critical_batch_size``, is the largest size whose val_loss is within
``probe.tolerance`` (a share) of the best one: beyond it a larger batch buys fewer updates with
worse loss for the same samples. Beside it, the gradient noise scale B_simple measured at the
start weights (McCandlish et al. 2018, appendix A: unbiased estimates of |G|^2 and tr(Sigma) from
the micro-batch gradients and their mean), the usual guess at the same quantity.
"""

import copy
import math
import os
import time

import keras
import numpy as np
import tensorflow as tf

from gacli.engine.window import noise_from_two_sizes
from gacli.errors import ConfigError, TrainingFailed
from gacli.rundir import CHECKPOINT_DIR, checkpoint_numbers, write_json
from gacli.runner.builders.job import build_job, job_loss_and_metrics, precision_policy
from gacli.runner.config.schema import shown_name
from gacli.runner.reporting.console import make_console
from gacli.runner.reporting.throughput import samples_per_second
from gacli.runner.training.run import Run
from gacli.runner.training.run_state import micro_batch_stream

PROBE_FILE = "probe.json"
PLOT_FILE = "probe.png"
BRANCHES_DIR = "branches"


def branch_config(cfg, effective_batch_size):
    """The config of the plain run one branch is: ``effective_batch_size`` at the job's
    micro-batch, one epoch of ``probe.samples / effective_batch_size`` updates."""
    branch = copy.deepcopy(cfg)
    branch.probe = {"name": "none"}
    branch.effective_batch_size = effective_batch_size
    branch.accum_steps = None
    branch.epochs = 1
    branch.steps_per_epoch = cfg.probe.samples // effective_batch_size
    return branch


# The batch keys a branch's config gives, as the command line of the plain run would.
BRANCH_GIVEN = ("micro_batch_size", "effective_batch_size")


class BranchRun(Run):
    """One branch: a plain :class:`Run` that starts from ``start_weights`` (None: the model's
    initial weights, as a plain run has them) and times its training.

    Args:
        cfg: the branch's config (:func:`branch_config`).
        run_dir: the branch's run directory.
        start_weights: ``model.get_weights()`` to start from, or None.
        parallel_jobs: jobs share the terminal (no live progress bar then).

    Example:
        >>> BranchRun(branch_config(cfg, 64), "outputs/probe/branches/effective_64", None).execute()
    """

    def __init__(self, cfg, run_dir, start_weights=None, parallel_jobs=False):
        super().__init__(cfg, run_dir, BRANCH_GIVEN, parallel_jobs)
        self.start_weights = start_weights
        self.seconds = None  # fit()'s wall time, tracing, validation and batch-norm passes included

    def restore(self):
        if self.start_weights is not None:
            self.job.model.set_weights(self.start_weights)
        super().restore()

    def fit(self):
        start = time.perf_counter()
        super().fit()
        self.seconds = time.perf_counter() - start


class StartPoint:
    """The weights every branch starts from, and the gradient noise scale measured at them, from
    a model built as the first branch builds it (then thrown away).

    Args:
        cfg: the probe's config.
        run: a :class:`Run` of the first branch whose batch plan and data are made.
    """

    def __init__(self, cfg, run):
        self.cfg = cfg
        self.run = run
        self.job = build_job(run.cfg, run.plan, run.data, run.steps, run.strategy)
        self.given = cfg.probe["from"]
        if self.given:
            self._load(os.path.abspath(os.path.expanduser(self.given)))
        self.weights = self.job.model.get_weights()
        self.noise = None  # noise_scale(), once measured

    def _load(self, from_dir):
        """The weights of the run in ``from_dir``: its model.keras, else its newest checkpoint."""
        model = self.job.model
        saved = os.path.join(from_dir, "model.keras")
        try:
            if os.path.exists(saved):
                import gacli.engine.accumulate_model  # noqa: F401  (registers model.keras' classes)

                model.set_weights(keras.saving.load_model(saved, compile=False).get_weights())
            else:
                number = checkpoint_numbers(from_dir)[0]
                prefix = os.path.join(from_dir, CHECKPOINT_DIR, f"ckpt-{number}")
                tf.train.Checkpoint(model=model).restore(prefix).expect_partial()
        except (ValueError, tf.errors.OpError) as error:
            raise ConfigError(
                f"probe.from={self.given}: its model does not fit this job's ({error}). Give the "
                "run directory of a run of the same model and data, or leave probe.from out to "
                "start from the initial weights."
            ) from None

    def noise_scale(self):
        """B_simple at the start weights from the micro-batch gradients over the probe's samples
        (whole micro-batches only): a dict, or None with fewer than two micro-batches."""
        cfg, run = self.cfg, self.run
        model = self.job.model
        loss, _ = job_loss_and_metrics(cfg, run.data.task, run.data.num_outputs)
        micro = run.plan.global_micro_batch_size
        count = cfg.probe.samples // micro
        if count < 2:
            return None
        # The micro-batches the branches train on, in their order (a pass's last one may be
        # short: skipped below).
        per_pass = math.ceil(run.data.train_size / micro)
        stream = micro_batch_stream(run.data.train, micro, per_pass, 0, count, run.order)

        @tf.function
        def gradients(x, y, sample_weight=None):
            with tf.GradientTape() as tape:
                predicted = tf.cast(model(x, training=True), "float32")
                value = loss(y, predicted, sample_weight=sample_weight)
            return tape.gradient(value, model.trainable_variables)

        total, squared, used = None, 0.0, 0
        for x, y, *weights in stream:  # (x, y) or (x, y, sample weights); x may be a dict
            if int(tf.shape(y)[0]) != micro:
                continue
            grads = [np.asarray(g, "float64") for g in gradients(x, y, *weights) if g is not None]
            squared += sum(float(np.sum(g * g)) for g in grads)
            total = grads if total is None else [t + g for t, g in zip(total, grads)]
            used += 1
        model.set_weights(self.weights)  # the batch-norm statistics training=True moved
        if used < 2:
            return None
        big_sq = sum(float(np.sum((t / used) ** 2)) for t in total)
        grad_sq, trace_cov = noise_from_two_sizes(squared / used, 1 / micro, big_sq, micro * used)
        scale = trace_cov / grad_sq if grad_sq > 0 else None
        return {
            "noise_scale": scale,
            "grad_sq": grad_sq,
            "trace_cov": trace_cov,
            "micro_batches": used,
            "micro_batch_size": micro,
        }


def critical_batch_size(rows, tolerance):
    """The largest ``effective_batch_size`` of ``rows`` whose val_loss is within ``tolerance``
    (a share of it) of the best."""
    finite = [row for row in rows if math.isfinite(row["val_loss"])]
    if not finite:
        raise TrainingFailed(
            "probe=batch: every branch ended with a val_loss that is not finite; use a lower "
            "optimizer.learning_rate."
        )
    best = min(row["val_loss"] for row in finite)
    bound = best + tolerance * abs(best)
    return max(row["effective_batch_size"] for row in finite if row["val_loss"] <= bound)


def probe_batch(cfg, run_dir, parallel_jobs=False):
    """Run ``probe=batch`` for the job ``cfg`` in ``run_dir``: the branches, ``probe.json``,
    ``probe.png`` and the table; the critical size's final metrics."""
    console = make_console()
    console.print(f"run directory: {run_dir}", soft_wrap=True)
    sizes = sorted(set(cfg.probe.effective_sizes))
    first_dir = os.path.join(run_dir, BRANCHES_DIR, f"effective_{sizes[0]}")
    start = _start_point(cfg, BranchRun(branch_config(cfg, sizes[0]), first_dir), console)
    cfg = start.cfg  # probe.samples within the training set
    samples = cfg.probe.samples
    rows, metrics = [], {}
    for index, size in enumerate(sizes):
        branch_dir = os.path.join(run_dir, BRANCHES_DIR, f"effective_{size}")
        branch = BranchRun(branch_config(cfg, size), branch_dir, None, parallel_jobs)
        console.print(
            f"probe=batch: branch {index + 1} of {len(sizes)}, effective batch {size} "
            f"({samples // size} updates over {samples} samples)",
            style="bold",
            soft_wrap=True,
        )
        branch.start_weights = start.weights if start.given else None
        final = branch.execute()
        metrics[size] = final
        rows.append(_row(branch, final, samples, os.path.relpath(branch_dir, run_dir)))
        keras.backend.clear_session()
    critical = critical_batch_size(rows, cfg.probe.tolerance)
    noise = start.noise
    record = {
        "micro_batch_size": int(cfg.micro_batch_size),
        "samples": samples,
        "tolerance": float(cfg.probe.tolerance),
        "from": start.given,
        "metric": _metric_name(rows),
        "sizes": rows,
        "critical_batch_size": critical,
        "noise_scale_at_start": noise,
    }
    write_json(os.path.join(run_dir, PROBE_FILE), record)
    _plot(record, os.path.join(run_dir, PLOT_FILE))
    _table(console, record)
    console.print(f"run directory: {run_dir}", soft_wrap=True)
    return dict(metrics[critical], critical_batch_size=critical)


def _start_point(cfg, branch, console=None):
    """The :class:`StartPoint` of the probe, made once the first branch has its plan and data
    (which every branch shares: same seed, same split, same order); its ``cfg`` holds
    ``probe.samples`` within the training set (:func:`samples_within_training_set`)."""
    with_data = Run(branch.cfg, branch.run_dir, BRANCH_GIVEN)
    with_data.plan_batch()
    with precision_policy(cfg.precision.policy):
        with_data.load_data()
        cfg = samples_within_training_set(cfg, with_data.data.train_size, console or make_console())
        with_data.settle_plan()
        start = StartPoint(cfg, with_data)
        start.noise = start.noise_scale()
    return start


def samples_within_training_set(cfg, train_size, console):
    """``cfg`` with ``probe.samples`` at most the training set's ``train_size``: more would have
    every branch pass over some samples twice. Cut to the largest multiple of every size within
    the training set, with a printed line saying so; a ConfigError where no multiple fits."""
    samples, sizes = cfg.probe.samples, sorted(set(cfg.probe.effective_sizes))
    if samples <= train_size:
        return cfg
    common = math.lcm(*sizes)
    where = (
        f"the {train_size} training samples (dataset {shown_name(cfg.dataset)}, after "
        f"validation_split={cfg.dataset.validation_split})"
    )
    if common > train_size:
        raise ConfigError(
            f"probe.samples={samples} is more than {where}, and no number of samples within them "
            f"is a multiple of every size in probe.effective_sizes={sizes} (the smallest common "
            f"multiple is {common}): every branch trains on the same samples, each once, in "
            f"whole updates. Use sizes whose smallest common multiple is {train_size} or less "
            "(powers of two divide each other), or more data."
        )
    kept = train_size // common * common
    console.print(
        f"probe=batch: probe.samples={samples} is more than {where}; every branch trains on "
        f"{kept} (the largest multiple of every size within them), so no sample is seen twice. "
        f"Give probe.samples={kept} or less to choose it yourself.",
        style="yellow",
        soft_wrap=True,
    )
    cfg = copy.deepcopy(cfg)
    cfg.probe.samples = kept
    return cfg


def _metric_name(rows):
    """The compiled metric the rows carry besides the losses (val_accuracy, val_iou, ...)."""
    names = [k for k in rows[0] if k.startswith("val_") and k != "val_loss"]
    return names[0] if names else None


def _row(branch, final, samples, where):
    plan, accumulator = branch.plan, branch.job.accumulator
    # The training clock's rate: training calls after the first (which traces), without the
    # validation and batch-norm passes; the whole fit() as a fall-back for a one-call branch.
    reading = branch.callbacks.clock.reading(int(accumulator.micro_step.numpy()))
    rate = samples_per_second(reading) or samples / branch.seconds
    return {
        "effective_batch_size": plan.effective_batch_size,
        "accum_steps": plan.accum_steps,
        "updates": int(accumulator.optimizer_step.numpy()),
        **{key: float(value) for key, value in final.items()},
        "samples_per_second": rate,
        "seconds": branch.seconds,
        "run_dir": where,
    }


def _table(console, record):
    from rich.table import Table

    metric = record["metric"]
    table = Table(title=f"probe=batch: {record['samples']} samples per size")
    for header in ("effective batch", "accum_steps", "updates", "val_loss", metric, "samples/s"):
        if header:
            table.add_column(header, justify="right")
    table.add_column("")
    critical = record["critical_batch_size"]
    best = min(record["sizes"], key=lambda row: row["val_loss"])["effective_batch_size"]
    for row in record["sizes"]:
        size = row["effective_batch_size"]
        marks = [m for m, on in (("best", size == best), ("critical", size == critical)) if on]
        cells = [str(size), str(row["accum_steps"]), str(row["updates"]), f"{row['val_loss']:.4f}"]
        if metric:
            cells.append(f"{row[metric]:.4f}")
        cells += [f"{row['samples_per_second']:,.0f}", ", ".join(marks)]
        table.add_row(*cells)
    console.print(table)
    console.print(
        f"critical batch: {critical} (the largest size whose val_loss is within "
        f"{record['tolerance']:.0%} of the best); {_noise_words(record['noise_scale_at_start'])}",
        soft_wrap=True,
    )


def _noise_words(noise):
    if noise is None or not noise["noise_scale"]:
        return (
            "noise scale at the start weights: not measurable (it needs two or more micro-batches "
            "of samples and a gradient larger than its noise)"
        )
    return (
        f"noise scale at the start weights: B_simple ~ {noise['noise_scale']:,.0f} (from "
        f"{noise['micro_batches']} micro-batches of {noise['micro_batch_size']})"
    )


def _plot(record, path):
    """val_loss against the effective batch (log 2 axis), the tolerance band, the critical size and
    the start's noise scale."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = record["sizes"]
    sizes = [row["effective_batch_size"] for row in rows]
    losses = [row["val_loss"] for row in rows]
    figure = Figure(figsize=(6, 4), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.plot(sizes, losses, "o-", color="C0", label="val_loss after the same samples")
    best = min(loss for loss in losses if math.isfinite(loss))
    bound = best + record["tolerance"] * abs(best)
    axes.axhspan(best, bound, color="C0", alpha=0.15, label=f"within {record['tolerance']:.0%}")
    axes.axvline(record["critical_batch_size"], color="C1", linestyle="--", label="critical")
    noise = record["noise_scale_at_start"]
    if noise and noise["noise_scale"] and noise["noise_scale"] > 0:
        axes.axvline(noise["noise_scale"], color="C2", linestyle=":", label="noise scale at start")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("effective batch size")
    axes.set_ylabel("val_loss")
    micro = record["micro_batch_size"]
    axes.set_title(f"{record['samples']} samples per size, micro-batch {micro}")
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path)
