"""Checking a composed config before anything is built: ranges, keys that do nothing with the
chosen kind (model, dataset, strategy), targets, the batch choice, the probe and the check, each
refused with one paragraph that says what to type instead."""

from collections.abc import Sequence

from gacli.engine.options import PartialWindow
from gacli.errors import ConfigError
from gacli.runner.config.arguments import (
    check_shipped,
    parameters_of,
    section_arguments,
    shipped_target,
)
from gacli.runner.config.schema import (
    AUTO,
    EXAMPLE_TARGETS,
    PROBE_KEYS,
    SHIPPED,
    CheckName,
    OutOfMemory,
    Policy,
    StrategyName,
    Task,
    Wrapper,
    expected_replicas,
    is_shipped,
    remat_setting,
    shown_name,
)
from gacli.runner.plan.accum_schedule import check_schedule
from gacli.runner.plan.batch import resolve_batch
from gacli.runner.reporting.writers import check_loggers


def validate(cfg, given=()):
    """Cross-field checks that need no TensorFlow; raises ConfigError saying what to type."""
    replicas = expected_replicas(cfg.strategy)
    resolve_batch(
        cfg.micro_batch_size, cfg.accum_steps, cfg.effective_batch_size, replicas or 1, given
    )
    if cfg.epochs < 1:
        raise ConfigError(f"epochs={cfg.epochs} must be >= 1, e.g. epochs=3.")
    if cfg.steps_per_epoch is not None and cfg.steps_per_epoch < 1:
        raise ConfigError(
            f"steps_per_epoch={cfg.steps_per_epoch} must be >= 1 (optimizer updates per epoch), "
            "or null for one pass over the data."
        )
    if not 0.0 <= cfg.dataset.validation_split < 1.0:
        raise ConfigError(
            f"dataset.validation_split={cfg.dataset.validation_split} must be in [0, 1), "
            "e.g. dataset.validation_split=0.1."
        )
    if cfg.optimizer.learning_rate <= 0:
        raise ConfigError(
            f"optimizer.learning_rate={cfg.optimizer.learning_rate} must be > 0, "
            "e.g. optimizer.learning_rate=0.001."
        )
    if cfg.wrapper == Wrapper.optimizer and cfg.strategy.name == StrategyName.multi_worker:
        raise ConfigError(
            "wrapper=optimizer trains a plain keras.Model, whose fit() fails under "
            "strategy=multi_worker (keras-team/keras#20585); use wrapper=auto (the model wrapper, "
            "which works around it)."
        )
    _refuse_jit_across_devices(cfg, replicas)
    _validate_batch_choice(cfg, given)
    _validate_ranges(cfg)
    _refuse_inert_keys(cfg, given)
    if cfg.steps_per_execution is not None and cfg.steps_per_execution < 1:
        raise ConfigError(
            f"steps_per_execution={cfg.steps_per_execution} must be >= 1 (micro-batches per "
            "compiled call), or null for accum_steps (one window a call), e.g. "
            "steps_per_execution=8."
        )
    if cfg.checkpoint_every_updates < 0:
        raise ConfigError(
            f"checkpoint_every_updates={cfg.checkpoint_every_updates} must be >= 0 (0: a "
            "checkpoint at each epoch end only), e.g. checkpoint_every_updates=100."
        )
    if cfg.resume and not cfg.checkpoint:
        raise ConfigError(
            "resume needs checkpoints, but checkpoint=false; drop checkpoint=false to resume."
        )
    if cfg.precise_bn_micro_batches < 1:
        raise ConfigError(
            f"precise_bn_micro_batches={cfg.precise_bn_micro_batches} must be >= 1 (training "
            "micro-batches that batchnorm=precise pools), e.g. precise_bn_micro_batches=200."
        )
    _validate_check(cfg)
    _validate_remat(cfg)
    _validate_targets(cfg)
    check_loggers(cfg, given)


def _validate_targets(cfg):
    """The ``_target_`` of each section, the entries of ``metrics`` and ``callbacks``: each a
    dotted path where one is given, and one only where it is read; a shipped model's or
    dataset's arguments against its signature."""
    from omegaconf import OmegaConf

    for group in ("model", "dataset"):
        section = cfg[group]
        if OmegaConf.is_missing(section, "_target_") or not section._target_:
            section_arguments(section, group)  # refuses, saying what to give
        _check_target_path(f"{group}._target_", section._target_)
        check_shipped(group, section)
    # Every optimizer, shipped or the user's, is built by its _target_.
    _check_target_path("optimizer._target_", cfg.optimizer._target_)
    if cfg.loss._target_ is not None:
        _check_target_path("loss._target_", cfg.loss._target_)
    elif len(cfg.loss) > 1:
        extra = sorted(set(cfg.loss) - {"_target_"})[0]
        raise ConfigError(
            f"loss.{extra} is an argument of loss._target_, which is not set; give the loss too, "
            f"e.g. loss._target_=keras.losses.Huber loss.{extra}=..., or drop loss.{extra}."
        )
    for key, entries in (("metrics", cfg.metrics or []), ("callbacks", cfg.callbacks)):
        for index, entry in enumerate(entries):
            if key == "metrics" and isinstance(entry, str) and entry.strip():
                continue
            target = entry.get("_target_") if OmegaConf.is_dict(entry) else None
            if not isinstance(target, str):
                example = EXAMPLE_TARGETS[key]
                raise ConfigError(
                    f"{key}[{index}]={entry} is not "
                    + ("a metric's name nor " if key == "metrics" else "")
                    + f"a mapping with a _target_; write e.g. '{key}=[{{_target_: {example}}}]'."
                )
            _check_target_path(f"{key}[{index}]._target_", target)


def _check_target_path(key, target):
    """ConfigError for a ``_target_`` that is not a dotted import path."""
    parts = str(target).split(".")
    if len(parts) < 2 or not all(part.isidentifier() for part in parts):
        raise ConfigError(
            f"{key}={target} must name a class or function by its full import path, "
            "package.module.name, e.g. my_pkg.nets.Net (a module of your own importable where "
            "ga-train runs, or keras.losses.Huber)."
        )


def _refuse_jit_across_devices(cfg, replicas):
    """ConfigError for jit_compile=true under strategy=mirrored with several devices."""
    if cfg.jit_compile and cfg.strategy.name == StrategyName.mirrored and replicas != 1:
        raise ConfigError(
            "jit_compile=true fails under strategy=mirrored with several devices: Keras' fit() "
            "compiles the whole replicated step as one XLA program, and TensorFlow cannot run "
            'one XLA program on variables held by several devices ("Trying to access resource '
            '... located in device CPU:1 from device CPU:0", the same on GPUs; '
            "tensorflow/tensorflow#53140, keras-team/keras#18145). Use jit_compile=false with "
            "strategy=mirrored, or jit_compile=true on one device (strategy=default)."
        )


def check_tolerance_argument(assignments):
    """ConfigError, before Hydra composes, for a ``check.tolerance=`` that is not a number."""
    for assignment in assignments:
        key, _, value = assignment.partition("=")
        if key.lstrip("+~") != "check.tolerance" or value.strip().lower() in ("null", "none"):
            continue
        try:
            float(value)
        except ValueError:
            raise ConfigError(
                f"{assignment}: check.tolerance takes a positive number (the largest relative "
                "weight difference that passes), e.g. check.tolerance=1e-5; leave it unset for "
                "the contract's (1e-6 for SGD, 1e-5 for adaptive optimizers)."
            ) from None


def _validate_remat(cfg):
    """ConfigError for a ``remat`` that names no blocks, or that the chosen wrapper cannot do."""
    try:
        remat = remat_setting(cfg.get("remat"))
    except ValueError:
        raise ConfigError(
            f"remat={cfg.remat} is not a choice of blocks to recompute; give remat=every (each "
            "block of a functional or Sequential model), remat=2 (runs of 2 blocks), "
            "remat=[block_1,block_2] (those layers, of any model) or remat=null (off)."
        ) from None
    if remat is not None and cfg.wrapper == Wrapper.optimizer:
        raise ConfigError(
            "remat recomputes in the model wrapper's train step, and wrapper=optimizer trains a "
            "plain keras.Model with Keras' own step; use wrapper=auto (the model wrapper) with "
            "remat, or drop remat."
        )


def _validate_check(cfg):
    """``check=equivalence``: a tolerance that is a positive number, and a job it can compare."""
    tolerance = cfg.check.tolerance
    if tolerance is not None and not (0 < tolerance < float("inf")):
        raise ConfigError(
            f"check.tolerance={tolerance} must be a positive number (the largest relative weight "
            "difference that passes), e.g. check.tolerance=1e-5; leave it unset for the "
            "contract's (1e-6 for SGD, 1e-5 for adaptive optimizers)."
        )
    if cfg.check.name != CheckName.equivalence:
        return
    refused = {
        "resume": (cfg.resume, "trains nothing, so there is nothing to resume; drop resume="),
        "precision": (
            cfg.precision.policy != Policy.fp32,
            "compares float32 updates (the contract's tolerances are float32 round-off); drop "
            "precision= or use precision=fp32",
        ),
    }
    for key, (given, what_to_do) in refused.items():
        if given:
            raise ConfigError(f"check=equivalence with {key}: the check {what_to_do}.")


def _validate_batch_choice(cfg, given=()):
    """``accum_schedule`` (and its ``lr_scaling``), ``probe``, ``auto_batch`` and ``oom``."""
    check_schedule(cfg, given)
    _validate_probe(cfg, expected_replicas(cfg.strategy))
    auto = cfg.auto_batch
    if not 0 <= auto.margin < 1:
        raise ConfigError(
            f"auto_batch.margin={auto.margin} must be in [0, 1) (the share of the largest "
            "micro-batch that ran to give up after an out-of-memory error), e.g. "
            "auto_batch.margin=0.1."
        )
    if auto.timed_calls < 1:
        raise ConfigError(f"auto_batch.timed_calls={auto.timed_calls} must be >= 1, e.g. 2.")
    if auto.max_micro_batch_size is not None and auto.max_micro_batch_size < 1:
        raise ConfigError(
            f"auto_batch.max_micro_batch_size={auto.max_micro_batch_size} must be >= 1, or null "
            "for the size of the training data."
        )
    if auto.memory_budget_mib is not None and auto.memory_budget_mib < 1:
        raise ConfigError(
            f"auto_batch.memory_budget_mib={auto.memory_budget_mib} must be >= 1 (MiB), e.g. "
            "auto_batch.memory_budget_mib=8000, or null for all of the device's memory."
        )
    several_workers = cfg.strategy.name == StrategyName.multi_worker
    if several_workers and (cfg.micro_batch_size == AUTO or cfg.oom == OutOfMemory.recover):
        raise ConfigError(
            "micro_batch_size=auto and oom=recover work on one machine only: under "
            "strategy=multi_worker one worker's out-of-memory error would leave the others "
            "waiting in an exchange. Probe on one machine (micro_batch_size=auto strategy="
            "mirrored) and give every worker the micro_batch_size it chose."
        )
    if cfg.oom != OutOfMemory.recover:
        return
    if cfg.partial_window == PartialWindow.carry:
        raise ConfigError(
            "oom=recover redoes a window from its first sample, which partial_window=carry may "
            "have left in the previous epoch; use partial_window=apply (or drop) with oom=recover."
        )
    accum = cfg.accum_steps if isinstance(cfg.accum_steps, int) else None
    spe = cfg.steps_per_execution
    if spe is not None and spe > 1 and (accum is None or accum % spe):
        raise ConfigError(
            f"oom=recover needs every compiled call inside one window, but steps_per_execution="
            f"{spe} does not divide accum_steps; drop steps_per_execution (a window a call) or "
            "use steps_per_execution=1."
        )


def _validate_probe(cfg, replicas):
    """``probe=batch``: its sizes, samples and tolerance, against the micro-batch."""
    probe = cfg.probe
    unknown = sorted(set(probe) - set(PROBE_KEYS))
    if unknown:
        raise ConfigError(
            f"probe.{unknown[0]} is not a key ga-train reads; probe=batch reads "
            + ", ".join(f"probe.{key}" for key in PROBE_KEYS[1:])
            + ", e.g. probe=batch probe.effective_sizes=[16,64,256] probe.samples=2048."
        )
    if probe.get("name") == "none":
        if len(probe) > 1:
            raise ConfigError(
                f"probe.{sorted(set(probe) - {'name'})[0]} is read only with probe=batch, and this "
                "run has no probe, so setting it would change nothing. Add probe=batch, or drop it."
            )
        return
    if probe.get("name") != "batch":
        raise ConfigError(
            f"probe={probe.get('name')} is not a probe ga-train runs; use probe=batch (the "
            "critical batch, measured) or leave probe out for one run."
        )
    sizes, samples = probe.get("effective_sizes"), probe.get("samples")
    _validate_probe_values(sizes, samples, probe.get("tolerance"))
    _validate_probe_sizes(cfg, sizes, samples, replicas)
    if not cfg.dataset.validation_split:
        raise ConfigError(
            "probe=batch compares the sizes by their val_loss, but dataset.validation_split=0 "
            "holds no validation data; use e.g. dataset.validation_split=0.1."
        )
    if cfg.resume:
        raise ConfigError(
            "probe=batch runs its branches from the start and is not resumed; start it again "
            "without resume=."
        )
    if str(getattr(cfg.check.name, "value", cfg.check.name)) != "none":
        raise ConfigError(
            "probe=batch and check= each run a job of their own; run them as two commands, "
            "e.g. ga-train probe=batch first, then ga-train check=equivalence."
        )


def _validate_probe_values(sizes, samples, tolerance):
    """``probe.effective_sizes``, ``probe.samples`` and ``probe.tolerance`` on their own."""
    example = "e.g. probe=batch probe.effective_sizes=[16,64,256] probe.samples=2048"
    whole = lambda value: isinstance(value, int) and not isinstance(value, bool)  # noqa: E731
    if (
        not isinstance(sizes, Sequence)
        or len(sizes) < 2
        or not all(whole(size) and size >= 1 for size in sizes)
    ):
        raise ConfigError(
            f"probe.effective_sizes={sizes} must list two or more effective batch sizes, whole "
            f"numbers >= 1, {example}."
        )
    if not whole(samples) or samples < 1:
        raise ConfigError(f"probe.samples={samples} must be a whole number >= 1, {example}.")
    if len(set(sizes)) != len(sizes):
        repeated = sorted({size for size in sizes if list(sizes).count(size) > 1})
        distinct = sorted(set(sizes))
        distinct += [4 * distinct[0]] if len(distinct) < 2 else []
        raise ConfigError(
            f"probe.effective_sizes={list(sizes)} lists {repeated[0]} more than once; each size "
            f"is one branch of the probe, so list each once, e.g. probe.effective_sizes="
            f"[{','.join(str(size) for size in distinct)}]."
        )
    if (
        isinstance(tolerance, bool)
        or not isinstance(tolerance, (int, float))
        or not 0 <= tolerance < float("inf")
    ):
        raise ConfigError(
            f"probe.tolerance={tolerance} must be >= 0 and finite (the share of the best val_loss "
            "a size may lose and still count), e.g. probe.tolerance=0.05."
        )


def _validate_probe_sizes(cfg, sizes, samples, replicas):
    """``probe.effective_sizes`` against the micro-batch and ``probe.samples``; ``probe.from``."""
    whole = lambda value: isinstance(value, int) and not isinstance(value, bool)  # noqa: E731
    micro = cfg.micro_batch_size
    if not whole(micro):
        raise ConfigError(
            f"probe=batch reaches each size by accumulation at one micro-batch, so it needs "
            f"micro_batch_size as a number, not {micro}; e.g. micro_batch_size=16 (or the size "
            "micro_batch_size=auto chose for this model)."
        )
    per_update = micro * (replicas or 1)
    for size in sizes:
        if size % per_update:
            lower = size // per_update * per_update
            fitting = sorted({max(per_update, lower), lower + per_update})
            raise ConfigError(
                f"probe.effective_sizes holds {size}, which micro_batch_size x replicas = "
                f"{micro} x {replicas or 1} = {per_update} does not divide: every size is "
                "reached by accumulating whole micro-batches. Use e.g. "
                f"{' or '.join(map(str, fitting))}, "
                "or another micro_batch_size."
            )
        if samples % size:
            raise ConfigError(
                f"probe.samples={samples} is not a multiple of the effective size {size}: every "
                f"size must train on the same samples, in whole updates. Use e.g. probe.samples="
                f"{max(sizes) * max(1, samples // max(sizes))} (a multiple of every size)."
            )
    given = cfg.probe.get("from")
    if given is not None:
        import os

        from_dir = os.path.expanduser(str(given))
        saved = [os.path.join(from_dir, name) for name in ("model.keras", "checkpoints")]
        if not any(os.path.exists(path) for path in saved):
            raise ConfigError(
                f"probe.from={given} holds neither a model.keras nor a checkpoints folder; give "
                "the directory of a ga-train run of this model (it prints it at start), or leave "
                "probe.from out to start from the initial weights."
            )


# Every numeric key's range, where one call with a value outside it would otherwise fail deep in
# Keras or NumPy, or train with a value that means nothing: (low, high, inclusive low, example).
# None: no bound on that side.
_RANGES = {
    "seed": (0, 2**32 - 1, True, "seed=0"),
    "model.depth": (1, None, True, "model.depth=3"),
    "model.base_filters": (1, None, True, "model.base_filters=16"),
    "model.dropout": (0.0, 1.0, True, "model.dropout=0.1"),
    "dataset.num_samples": (1, None, True, "dataset.num_samples=256"),
    "dataset.image_size": (1, None, True, "dataset.image_size=32"),
    "dataset.num_classes": (0, None, True, "dataset.num_classes=0 (inferred from the data)"),
    "optimizer.momentum": (0.0, 1.0, True, "optimizer.momentum=0.9"),
    "optimizer.weight_decay": (0.0, None, True, "optimizer.weight_decay=0.01"),
    "optimizer.clipnorm": (0.0, None, False, "optimizer.clipnorm=1.0"),
    "optimizer.global_clipnorm": (0.0, None, False, "optimizer.global_clipnorm=1.0"),
    "optimizer.clip_factor": (0.0, None, False, "optimizer.clip_factor=0.01"),
    "optimizer.warmup_updates": (0, None, True, "optimizer.warmup_updates=100"),
    "optimizer.decay_rate": (0.0, 1.0, False, "optimizer.decay_rate=0.5"),
    "optimizer.decay_updates": (0, None, True, "optimizer.decay_updates=1000"),
    "lr_reference_batch": (1, None, True, "lr_reference_batch=256"),
    "strategy.port": (1, 65535, True, "strategy.port=29500"),
    "strategy.peer_timeout_seconds": (5, None, True, "strategy.peer_timeout_seconds=60"),
    "strategy.logical_cpus": (0, None, True, "strategy.logical_cpus=2 (0: devices as they are)"),
    "precision.max_skipped_fraction": (0.0, 1.0, True, "precision.max_skipped_fraction=0.25"),
    "monitor.gns_every": (1, None, True, "monitor.gns_every=4"),
}


def _validate_ranges(cfg):
    """ConfigError naming the key, its range and an example, for a value outside its range."""
    from omegaconf import OmegaConf

    for key, (low, high, closed, example) in _RANGES.items():
        value = OmegaConf.select(cfg, key)
        group, _, name = key.partition(".")
        if value is None or (group in SHIPPED and not _shipped_argument(group, cfg[group], name)):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue  # an argument of a shipped target: its kind is checked with its target
        below = value < low if closed else value <= low
        above = high is not None and (value >= high if key == "model.dropout" else value > high)
        if below or above:
            lower = f"{'>=' if closed else '>'} {low}"
            upper = f" and {'<' if key == 'model.dropout' else '<='} {high}" if high else ""
            raise ConfigError(f"{key}={value} must be {lower}{upper}, e.g. {example}.")
    model, dataset = cfg.model, cfg.dataset
    for key in ("hidden_units", "filters"):
        sizes = model.get(key) or []
        if not OmegaConf.is_list(sizes) or not all(isinstance(size, int) for size in sizes):
            continue  # not a list of whole numbers: refused with its target's kind, below
        if is_shipped(model) and any(size < 1 for size in sizes):
            raise ConfigError(
                f"model.{key}={list(sizes)} must hold layer widths >= 1, e.g. model.{key}=[64,64]."
            )
    target = shipped_target(dataset)
    takes_task = target is None or "task" in parameters_of(target).named
    if dataset.task == Task.regression and is_shipped(dataset) and not takes_task:
        name = shown_name(dataset)
        raise ConfigError(
            "dataset.task=regression reads float targets from dataset=npz, dataset=tfrecord or "
            "a dataset of your own (dataset._target_=...), "
            f"and dataset={name} has class labels or masks; save the inputs and "
            "targets with numpy.savez('train.npz', x=inputs, y=targets) and give dataset=npz "
            "dataset.path=train.npz dataset.task=regression, or drop dataset.task."
        )
    if is_shipped(dataset) and dataset.get("channels") not in (1, 3, None):
        raise ConfigError(
            f"dataset.channels={dataset.channels} must be 1 (grey) or 3 (colour), e.g. "
            "dataset.channels=3."
        )


def _shipped_argument(group, section, name):
    """Whether ``name`` is ga-train's own key of a model or dataset section, or an argument of
    its shipped target: a range of ``_RANGES`` is that target's (a target of the user's own
    takes what it likes)."""
    from gacli.runner.config.schema import OWN_SECTION_KEYS

    return name in OWN_SECTION_KEYS[group] or is_shipped(section)


# Keys that only some choices read: {key: (what decides, the choices that read it)}. A key given
# on the command line that the run's choice does not read would change nothing: refused.
_READ_ONLY_BY = {
    "optimizer.decay_rate": ("optimizer.schedule", ("exponential",)),
    "optimizer.decay_updates": ("optimizer.schedule", ("cosine", "exponential")),
    "lr_reference_batch": ("lr_scaling", ("linear", "sqrt")),
    "optimizer.clip_factor": ("optimizer.use_agc", (True,)),
    "monitor.gns_every": ("monitor.gns", (True,)),
    "strategy.logical_cpus": ("strategy.name", ("mirrored",)),
    "strategy.devices": ("strategy.name", ("mirrored", "one_device")),
    "strategy.tpu": ("strategy.name", ("tpu",)),
    "strategy.cluster": ("strategy.name", ("multi_worker",)),
    "strategy.port": ("strategy.cluster", ("slurm",)),
    "strategy.peer_timeout_seconds": ("strategy.name", ("multi_worker",)),
    "check.tolerance": ("check.name", ("equivalence",)),
}


def _refuse_inert_keys(cfg, given):
    """ConfigError for a key given on the command line that this run's choices do not read."""
    from omegaconf import OmegaConf

    for key in sorted(set(given) & set(_READ_ONLY_BY)):
        decider, readers = _READ_ONLY_BY[key]
        choice = OmegaConf.select(cfg, decider)
        choice = getattr(choice, "value", choice)
        if choice in readers:
            continue
        # A group's name is chosen as the group (dataset=shapes), other deciders as keys.
        typed = decider.removesuffix(".name")
        shown = " or ".join(f"{typed}={str(reader).lower()}" for reader in readers)
        raise ConfigError(
            f"{key} is read only with {shown}, and this run has {typed}="
            f"{str(choice).lower()}, so setting it would change nothing. Drop it, or choose "
            f"what reads it (e.g. {shown.split(' or ')[0]})."
        )
