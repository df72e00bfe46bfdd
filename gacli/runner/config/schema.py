"""The typed configuration of ``ga-train``.

Dataclasses registered in Hydra's ConfigStore carry the types (OmegaConf rejects a wrong type or an
unknown key at composition); YAML files under ``configs/`` and ``recipes/`` carry the values.
Cross-field rules live in :func:`gacli.runner.config.validate.validate` and the batch arithmetic in
:func:`gacli.runner.plan.batch.resolve_batch`, both called once at start-up.
Nothing here imports TensorFlow: a config error must answer in well under two seconds.
"""

import enum
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

from gacli.engine.options import TF32, BatchNormPolicy, LossNormalization, NonFinite, PartialWindow
from gacli.engine.settings import AccumulationConfig
from gacli.errors import ConfigError, Interrupted  # noqa: F401  (imported from here by callers)

# The accumulation settings that ga-train shares with the library take the library's defaults;
# the one that differs, nonfinite, is gacli.runner.builders.job.NONFINITE_WITHOUT_LOSS_SCALING.
_LIBRARY = AccumulationConfig()

# Enum members are lower case because OmegaConf matches a YAML/command-line string to a member by
# its name: strategy.name=mirrored must find StrategyName.mirrored (see gacli.engine.options).


# Keys a resumed run may change: they change neither the updates nor the order of the data.
FREE_ON_RESUME = (
    "resume",
    "progress",
    "output_dir",
    "steps_per_execution",
    "monitor",
    "oom",
    "auto_batch",
    "objective",
    "logger",
    "mlflow",
    "remat",  # recomputation changes no number: a resumed run may turn it on or off
)
AUTO = "auto"  # micro_batch_size=auto: probe the device for the micro-batch
# probe=batch's keys (configs/probe/batch.yaml): an open dict in the schema, because one of its
# keys is "from", a Python keyword no dataclass field can be named.
PROBE_KEYS = ("name", "effective_sizes", "samples", "from", "tolerance")


class Wrapper(str, enum.Enum):
    auto = "auto"  # the model wrapper, and the start-up panel says why
    model = "model"  # GradientAccumulateModel: each micro-batch's size, each epoch's window closed
    # GradientAccumulateOptimizer in a plain fit(): every micro-batch weighs the same and windows
    # run across epochs (exact when the data divides into windows)
    optimizer = "optimizer"


class Schedule(str, enum.Enum):
    constant = "constant"
    cosine = "cosine"
    exponential = "exponential"


class LRScaling(str, enum.Enum):
    none = "none"
    linear = "linear"  # lr * effective batch / reference batch (Goyal et al. 2017)
    sqrt = "sqrt"  # lr * sqrt(effective batch / reference batch)


class Policy(str, enum.Enum):
    fp32 = "fp32"
    mixed_float16 = "mixed_float16"
    mixed_bfloat16 = "mixed_bfloat16"


class StrategyName(str, enum.Enum):
    default = "default"
    one_device = "one_device"
    mirrored = "mirrored"
    multi_worker = "multi_worker"
    tpu = "tpu"


class Progress(str, enum.Enum):
    auto = "auto"  # a rich progress bar on a terminal, plain lines otherwise
    rich = "rich"  # a rich progress bar
    plain = "plain"  # a line every 10 seconds and at each epoch end, for logs
    none = "none"  # nothing while training; the start-up panel and summary still print


class OutOfMemory(str, enum.Enum):
    fail = "fail"  # stop with a message that says which micro_batch_size to try
    recover = "recover"  # halve the micro-batch, double accum_steps, redo the window


class Task(str, enum.Enum):
    auto = "auto"  # from the data: integer labels classify, masks of the images' size segment
    # float targets (samples,) or (samples, k) of npz, tfrecord or a dataset target: k linear
    # outputs, squared error
    regression = "regression"


class Pick(str, enum.Enum):
    largest = "largest"  # the largest that fits (none failed: the largest within 3% of the fastest)
    fastest = "fastest"  # the one with the most samples/s among those that fit


class AutoRemat(str, enum.Enum):
    # With remat unset: when memory holds the micro-batch below what the fewest passes need, also
    # probe with recomputation (remat=every) and keep it where it needs fewer passes
    auto = "auto"
    off = "off"  # never recompute unless remat is set


@dataclass
class ModelConfig:
    # What builds the keras.Model: the chosen file's (model=unet: gacli.models.unet) or your own
    # (model._target_=my_pkg.nets.Net). It is called with the other model.* keys, and with
    # input_shape and num_outputs (and task) from the data where it takes them and they are not
    # given (docs/guides/own-model.md).
    _target_: str = MISSING


@dataclass
class DatasetConfig:
    # What loads the data: the chosen file's (dataset=digits: gacli.datasets.digits) or your own
    # (dataset._target_=my_pkg.data.make). It is called with the other dataset.* keys but
    # ga-train's own below, and with seed, validation_split, task and num_classes where it takes
    # them; it returns (train, validation), each a tf.data.Dataset of unbatched (x, y) or
    # (x, y, sample_weight) or a tuple of such arrays (validation may be None), or a
    # gacli.runner.builders.data.DataBundle as the shipped ones do.
    _target_: str = MISSING
    num_classes: int = 0  # 0: inferred from the data
    # the fraction held out for validation (a seeded split); a target that returns no validation
    # data: of its training data (0: the run has none)
    validation_split: float = 0.1
    shuffle: bool = True  # each pass over the training data in its own seeded order
    task: Task = Task.auto  # what the targets are; picks the model's head, loss and metrics


@dataclass
class OptimizerConfig:
    # What returns the Keras optimizer: the chosen file's (optimizer=sgd: keras.optimizers.SGD) or
    # your own (optimizer._target_=keras.optimizers.Lion replaces it). It is called with the other
    # optimizer.* keys that are set (not null), any key the schema does not declare too
    # (optimizer.beta_1=0.95), but ga-train's own (schedule, warm-up, scaling, AGC), and with
    # learning_rate: the schedule ga-train makes of optimizer.learning_rate; ga-train wraps it
    # for accumulation.
    _target_: str = MISSING
    learning_rate: float = MISSING  # the optimizer group's file, then configs/train.yaml
    # null: not given (the target's default); keras.optimizers.SGD and RMSprop take it
    momentum: Optional[float] = None
    # null: not given; keras.optimizers.AdamW's decoupled decay, other Keras optimizers' decay
    # of the weights
    weight_decay: Optional[float] = None
    clipnorm: Optional[float] = None  # each gradient's norm, clipped once per update
    global_clipnorm: Optional[float] = None  # all gradients' norm together, once per update
    # Keras' moving average of the weights, updated once per update (null: not given)
    use_ema: Optional[bool] = None
    use_agc: bool = _LIBRARY.use_agc  # adaptive gradient clipping, once per update
    clip_factor: float = _LIBRARY.clip_factor
    schedule: Schedule = Schedule.constant
    warmup_updates: int = 0  # linear warm-up, in optimizer updates
    decay_rate: float = 0.5  # exponential: factor per decay_updates
    # cosine: updates to decay over; exponential: updates per decay_rate; 0 = the whole run after
    # warm-up
    decay_updates: int = 0


@dataclass
class PrecisionConfig:
    policy: Policy = Policy.fp32
    # None: skip_micro_batch under mixed_float16 (the library's), stop otherwise (ga-train's own)
    nonfinite: Optional[NonFinite] = None
    # The run fails at an epoch end where more than this share of its windows so far was skipped
    # (a non-finite loss or gradient, or no sample weight in them), or of its micro-batches under
    # skip_micro_batch.
    max_skipped_fraction: float = 0.25


class ClusterSource(str, enum.Enum):
    tf_config = "tf_config"  # the TF_CONFIG environment variable (Kubernetes, most launchers)
    slurm = "slurm"  # SLURM's environment, one worker per task (gacli.runner.cluster.slurm)


@dataclass
class StrategyConfig:
    name: StrategyName = StrategyName.default
    logical_cpus: int = 0  # mirrored on a CPU machine: split the CPU into N logical devices
    devices: List[str] = field(default_factory=list)  # mirrored / one_device: explicit devices
    tpu: str = ""  # tpu: the TPU address ("" = local / from the environment)
    cluster: ClusterSource = ClusterSource.tf_config  # multi_worker: where the cluster is described
    # cluster=slurm: the first worker port on each node, the node's next tasks the ports after it
    # (None: a port from 20000 up that the SLURM job id picks, so jobs sharing a node differ).
    port: Optional[int] = None
    # multi_worker: seconds without a heartbeat from a worker before the others stop, naming it.
    peer_timeout_seconds: int = 60


@dataclass
class MonitorConfig:
    # The gradient noise scale from the micro-batches: TensorBoard's gns/ tags and a line in the
    # run's summary that compares it with the effective batch. Off by default: it costs a
    # squared norm of every micro-batch's gradients (its cost: docs/performance.md).
    gns: bool = False
    # Measure it on every n-th window only (its micro-batches and its whole), by the update
    # count: the squared norms of the others are not computed for it (without XLA on a CPU the
    # non-finite check computes them for itself). The smoothing moves once per measured window.
    # Not a way to make it cheaper: every 4th window cost the MLP benchmark no measurably less.
    gns_every: int = 1


@dataclass
class AutoBatchConfig:
    # micro_batch_size=auto: how the probe chooses.
    pick: Pick = Pick.largest
    # After a probe ran out of memory: the micro-batch may use at most (1 - margin) of what the
    # first size that failed would need (of its peak device memory where that is measured, else
    # of its size), so that a longer sequence or a fragmented allocator still fits.
    margin: float = 0.1
    max_micro_batch_size: Optional[int] = None  # the largest size probed (None: the data's)
    timed_calls: int = 2  # compiled calls timed per size, after one that warms up
    # The memory a micro-batch may use, in MiB (None: the device's, until it runs out): a size
    # whose measured peak is above it does not fit ("over budget"; no margin is taken off it).
    # Device memory on a GPU; on a CPU the peak of TensorFlow's CPU allocator (tensors: weights,
    # optimizer state, activations), not the whole process's resident memory.
    memory_budget_mib: Optional[int] = None
    # With remat unset: recomputation as the probe's second lever (docs/guides/recompute.md).
    remat: AutoRemat = AutoRemat.auto


class CheckName(str, enum.Enum):
    none = "none"  # train
    equivalence = "equivalence"  # compare one accumulated window with the big batch; no training


@dataclass
class CheckConfig:
    name: CheckName = CheckName.none
    # check=equivalence: the largest relative weight difference that passes (None: the contract's,
    # 1e-6 for SGD and momentum, 1e-5 for adaptive optimizers; docs/guides/equivalence-check.md).
    tolerance: Optional[float] = None


@dataclass
class LossConfig:
    # A keras.losses.Loss, e.g. keras.losses.Huber, its arguments the other loss.* keys (null:
    # the task's: cross-entropy for classes and masks, squared error for regression)
    _target_: Optional[str] = None


@dataclass
class MlflowConfig:
    # With mlflow in logger: the tracking store, e.g. http://localhost:5000 (None: sqlite:///<the
    # run directory's parent>/mlflow.db, one file for a sweep's jobs or a recipe's outputs/ runs).
    tracking_uri: Optional[str] = None
    experiment_name: Optional[str] = None  # None: ga-train-<config>, e.g. ga-train-unet
    run_name: Optional[str] = None  # None: the run directory's name


@dataclass
class TrainConfig:
    config: str = "default"  # the recipe or YAML file this run was composed from
    model: ModelConfig = field(default_factory=ModelConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    check: CheckConfig = field(default_factory=CheckConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    # The compiled metrics: names Keras knows (mae) or {_target_: keras.metrics.AUC, name: auc},
    # which objective= may name (null: the task's: accuracy, iou, or mae and rmse)
    metrics: Optional[List[Any]] = None
    # Keras callbacks of your own, each {_target_: package.module.Callback, its arguments},
    # called after ga-train's own
    callbacks: List[Any] = field(default_factory=list)
    # Samples per forward/backward pass, per replica; "auto": the largest that fits the device.
    # The default job's values of these are in configs/train.yaml; null: derived from the others.
    micro_batch_size: Any = MISSING
    accum_steps: Optional[int] = MISSING  # micro-batches per optimizer update
    effective_batch_size: Optional[int] = None  # micro x accum x replicas
    # The effective batch over training: {epoch: accum_steps from that epoch on}, or "gns" (grow
    # with the measured noise scale, monitor.gns=true, up to accum_schedule_max).
    accum_schedule: Any = None
    # gns: the largest accum_steps (None: the largest power of two the training set allows).
    accum_schedule_max: Optional[int] = None
    # The learning rate scaled with the effective batch: linear (lr x batch / reference batch,
    # Goyal et al. 2017) or sqrt, in every stage of accum_schedule.
    lr_scaling: LRScaling = LRScaling.none
    # The effective batch optimizer.learning_rate was tuned at (None: accum_schedule's first
    # stage's, so that only the later stages are scaled).
    lr_reference_batch: Optional[int] = None
    auto_batch: AutoBatchConfig = field(default_factory=AutoBatchConfig)
    oom: OutOfMemory = OutOfMemory.fail  # an out-of-memory error while training
    wrapper: Wrapper = Wrapper.auto
    partial_window: PartialWindow = _LIBRARY.partial_window
    # window_weights: the window's loss divided by its total sample weight (e.g. its real tokens,
    # from a dataset that gives (x, y, sample_weight)); batch: Keras' mean per micro-batch
    loss_normalization: LossNormalization = _LIBRARY.loss_normalization
    batchnorm: BatchNormPolicy = BatchNormPolicy.keep
    precise_bn_micro_batches: int = 200  # batchnorm=precise: training micro-batches pooled
    # Recompute activations in the backward pass instead of keeping them: less memory a sample
    # for more time, the same weights (docs/guides/recompute.md). every: each block of a
    # functional or Sequential model; n: runs of n blocks; [name, ...]: those layers of any model
    # (a KerasHub backbone's transformer layers); null: off. The model wrapper only.
    remat: Any = None
    epochs: int = MISSING  # passes over the training data (the default job's: configs/train.yaml)
    steps_per_epoch: Optional[int] = None  # optimizer updates per epoch (None: one data pass)
    seed: int = 0  # initial weights, data order and dropout: a run with the same seed repeats
    jit_compile: bool = False  # compile the train step with XLA
    # TensorFloat-32 on Ampere and newer GPUs: auto keeps TensorFlow's default (on), which rounds
    # float32 products' inputs to 10 mantissa bits; off for float32 exactness (no effect on CPUs).
    tf32: TF32 = TF32.auto
    # Micro-batches per compiled call of the train step (None: accum_steps, one window a call;
    # 1 for wrapper=optimizer under several replicas, where Keras' own loop over steps fails).
    steps_per_execution: Optional[int] = None
    checkpoint: bool = True  # a checkpoint per epoch in <run dir>/checkpoints, the model at the end
    checkpoint_every_updates: int = 0  # also a checkpoint every N updates (0: epoch ends only)
    resume: Optional[str] = None  # true: continue this command's last unfinished run; or its dir
    progress: Progress = Progress.auto
    # The final metric the job returns to a Hydra sweeper (hydra/sweeper=optuna): loss, val_loss,
    # or a compiled metric, val_ for validation (None: val_loss, or loss without validation data).
    # Its direction follows from its name (gacli.runner.config.objective).
    objective: Optional[str] = None
    # probe=batch: train one branch per effective batch from the same weights on the same
    # samples and measure the critical batch, instead of one run; probe.effective_sizes,
    # probe.samples, probe.from, probe.tolerance (configs/probe/batch.yaml) say how.
    probe: Dict[str, Any] = field(default_factory=lambda: {"name": "none"})
    # Where the run's scalars go, a list of: tensorboard (event files in <run dir>/tensorboard),
    # csv (<run dir>/metrics.csv), mlflow (a run in the mlflow.* tracking store).
    logger: Any = field(default_factory=lambda: ["tensorboard"])
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)  # read with mlflow in logger
    output_dir: str = MISSING  # set from the Hydra run directory


# The config groups, each a folder of YAML files under configs/, by the dataclass that types them:
# the one list that the schema, the key check and --help read.
GROUPS = {
    "model": ModelConfig,
    "dataset": DatasetConfig,
    "optimizer": OptimizerConfig,
    "precision": PrecisionConfig,
    "strategy": StrategyConfig,
    "check": CheckConfig,
}


# The sections built by their _target_, each a class or function named by its import path, the
# section's other keys its arguments (docs/guides/own-model.md): open for keys the schema does not
# declare (the declared ones keep their types), as a target takes arguments the schema cannot
# know. Every key but ga-train's own (OWN_SECTION_KEYS) goes to the target, whose signature
# checks it: a shipped model's or dataset's while the config is validated
# (gacli.runner.config.arguments.check_shipped), another target's when it is called.
TARGET_SECTIONS = ("model", "dataset", "optimizer", "loss")
# The modules of the models and data sets that ship (configs/model/*.yaml, configs/dataset/*.yaml
# name their functions); importing them loads no TensorFlow.
SHIPPED = {"model": "gacli.models", "dataset": "gacli.datasets"}
# The keys of a target section that ga-train reads itself: never passed to its target.
OWN_SECTION_KEYS = {
    "model": ("_target_",),
    "dataset": ("_target_", "validation_split", "shuffle", "task", "num_classes"),
    "optimizer": (
        "_target_",
        "learning_rate",
        "schedule",
        "warmup_updates",
        "decay_rate",
        "decay_updates",
        "use_agc",
        "clip_factor",
    ),
    "loss": ("_target_",),
}
# What the refusals show as an example target, by section.
EXAMPLE_TARGETS = {
    "model": "my_pkg.nets.Net",
    "dataset": "my_pkg.data.make",
    "optimizer": "keras.optimizers.Lion",
    "metrics": "keras.metrics.AUC",
    "callbacks": "keras.callbacks.CSVLogger, filename: log.csv",
}


def register_configs():
    """Register the schema so that YAML files are validated against it."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    store = ConfigStore.instance()
    schema = OmegaConf.structured(TrainConfig)
    for section in TARGET_SECTIONS:
        OmegaConf.set_struct(schema[section], False)
    store.store(name="gacli_schema", node=schema)
    for group, schema in GROUPS.items():
        store.store(group=group, name="gacli_schema", node=schema)


def is_shipped(section):
    """Whether a model or dataset section names one that ships (``gacli.models.unet``)."""
    return str(section.get("_target_") or "").rpartition(".")[0] in SHIPPED.values()


def is_own(section):
    """Whether a model or dataset section names the user's own (``model._target_=my_pkg.Net``)."""
    return bool(section.get("_target_")) and not is_shipped(section)


def shown_name(section):
    """What a section is called in messages: its shipped name (``unet``, or the architecture of
    ``model=application``), else its target (the user's own, or an optimizer)."""
    target = str(section.get("_target_"))
    if not is_shipped(section):
        return target
    name = target.rpartition(".")[2]
    return str(section.get("architecture") or name) if name == "application" else name


def remat_setting(value):
    """The ``remat`` key as the library takes it (None, "every", n, or a tuple of layer names);
    ValueError, saying what to pass, for anything else."""
    from omegaconf import OmegaConf

    from gacli.engine.settings import AccumulationConfig

    plain = OmegaConf.to_container(value) if OmegaConf.is_list(value) else value
    return AccumulationConfig(remat=tuple(plain) if isinstance(plain, list) else plain).remat


def expected_replicas(strategy):
    """Replicas a strategy config will have, where that is known without TensorFlow, else None."""
    if strategy.name in (StrategyName.default, StrategyName.one_device):
        return 1
    if strategy.name == StrategyName.mirrored and strategy.devices:
        return len(strategy.devices)
    if strategy.name == StrategyName.mirrored and strategy.logical_cpus:
        return strategy.logical_cpus
    return None
