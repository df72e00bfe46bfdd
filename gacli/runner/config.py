"""The typed configuration of ``ga-train`` and its one validation function.

Dataclasses registered in Hydra's ConfigStore carry the types (OmegaConf rejects a wrong type or an
unknown key at composition); YAML files under ``configs/`` and ``recipes/`` carry the values.
Cross-field rules (the batch arithmetic above all) live in :func:`validate` and
:func:`resolve_batch`, called once at start-up.
Nothing here imports TensorFlow: a config error must answer in well under two seconds.
"""

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

from gacli.engine.options import TF32, BatchNormPolicy, LossNormalization, NonFinite, PartialWindow
from gacli.engine.settings import AccumulationConfig
from gacli.errors import ConfigError, Interrupted  # noqa: F401  (imported from here by callers)
from gacli.runner.accum_schedule import check_schedule
from gacli.runner.loggers import check_loggers

# The accumulation settings that ga-train shares with the library take the library's defaults;
# the one that differs, nonfinite, is gacli.runner.train.NONFINITE_WITHOUT_LOSS_SCALING.
_LIBRARY = AccumulationConfig()

# Enum members are lower case because OmegaConf matches a YAML/command-line string to a member by
# its name: optimizer.name=adam must find OptimizerName.adam (see gacli.engine.options).


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


class OptimizerName(str, enum.Enum):
    sgd = "sgd"
    momentum = "momentum"
    adam = "adam"
    adamw = "adamw"
    rmsprop = "rmsprop"
    own = "own"  # optimizer._target_: your own Keras optimizer, wrapped for accumulation


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
    # float targets (samples,) or (samples, k) of npz or tfrecord: k linear outputs, squared error
    regression = "regression"


class Pick(str, enum.Enum):
    largest = "largest"  # the largest that fits (none failed: the largest within 3% of the fastest)
    fastest = "fastest"  # the one with the most samples/s among those that fit


# A section whose _target_ is the user's own (model=own, dataset=own, optimizer=own; setting
# <section>._target_ chooses it): the target, "package.module.callable", is called with the
# section's other keys, except those ga-train reads itself (OWN_SECTION_KEYS), and returns what
# the section makes (docs/guides/own-model.md). The section takes keys the schema does not
# declare, as the callable's arguments (register_configs leaves it open).
OWN = "own"


@dataclass
class ModelConfig:
    # model=own: what builds your keras.Model, e.g. my_pkg.nets.Net; its arguments are the other
    # model.* keys, and input_shape and num_outputs (and task) come from the data where it takes
    # them and they are not given
    _target_: Optional[str] = None
    name: str = "mlp"  # a registered model, or a keras.applications name (e.g. ResNet50)
    factory: Optional[str] = None  # "package.module:function" returning a keras.Model
    kwargs: Dict[str, Any] = field(default_factory=dict)  # passed to the factory / application
    hidden_units: Optional[List[int]] = field(default_factory=lambda: [64, 64])  # mlp
    filters: Optional[List[int]] = field(default_factory=lambda: [16, 32])  # cnn
    depth: Optional[int] = 3  # unet levels; resnet stages
    base_filters: Optional[int] = 16  # unet and resnet width
    dropout: Optional[float] = 0.0


@dataclass
class DatasetConfig:
    # dataset=own: what returns (train, validation) as tf.data.Datasets of unbatched (x, y) or
    # (x, y, sample_weight), or as tuples of arrays; validation may be None. Its arguments are the
    # other dataset.* keys, and seed and validation_split where it takes them.
    _target_: Optional[str] = None
    name: str = "digits"  # shapes | digits | npz | image_folder | tfrecord | own
    path: Optional[str] = None  # file or directory for npz, image_folder, tfrecord
    num_samples: Optional[int] = 256  # shapes
    image_size: Optional[int] = 32  # shapes; image_folder resize
    channels: Optional[int] = 1  # shapes; image_folder (1 or 3)
    num_classes: int = 0  # 0: inferred from the data
    # the fraction held out for validation (a seeded split); dataset=own: of the training data
    # when the target returns no validation data (0: the run has none)
    validation_split: float = 0.1
    shuffle: bool = True  # each pass over the training data in its own seeded order
    x_key: Optional[str] = "x"  # npz
    y_key: Optional[str] = "y"  # npz: labels, or masks of the images' size (then segmentation)
    # tfrecord: name -> {shape, dtype}
    features: Optional[Dict[str, Any]] = field(default_factory=dict)
    input_key: Optional[str] = "image"  # tfrecord feature used as input
    label_key: Optional[str] = "label"  # tfrecord feature used as target
    # image_folder: train without images that cannot be decoded
    skip_bad_files: Optional[bool] = False
    task: Task = Task.auto  # what the targets are; picks the model's head, loss and metrics


@dataclass
class OptimizerConfig:
    # optimizer=own: what returns your keras.optimizers.Optimizer, e.g. keras.optimizers.Lion;
    # its arguments are the other optimizer.* keys but ga-train's own (schedule, warm-up,
    # scaling, AGC), and learning_rate: the schedule ga-train makes of optimizer.learning_rate
    _target_: Optional[str] = None
    name: OptimizerName = OptimizerName.adam
    learning_rate: float = MISSING  # the optimizer group's file, then configs/train.yaml
    momentum: Optional[float] = 0.9  # the momentum optimizer's momentum
    # adamw (decoupled); other optimizers: Keras' weight_decay
    weight_decay: Optional[float] = 0.0
    clipnorm: Optional[float] = None  # each gradient's norm, clipped once per update
    global_clipnorm: Optional[float] = None  # all gradients' norm together, once per update
    use_agc: bool = _LIBRARY.use_agc  # adaptive gradient clipping, once per update
    clip_factor: float = _LIBRARY.clip_factor
    # Keras' moving average of the weights, updated once per update
    use_ema: Optional[bool] = False
    schedule: Schedule = Schedule.constant
    warmup_updates: int = 0  # linear warm-up, in optimizer updates
    decay_rate: float = 0.5  # exponential: factor per decay_updates
    # cosine: updates to decay over; exponential: updates per decay_rate; 0 = the whole run after
    # warm-up
    decay_updates: int = 0
    # The older rule: the reference batch is base_batch_size, every stage of accum_schedule too.
    # Only one of it and the top-level lr_scaling may be set.
    lr_scaling: LRScaling = LRScaling.none
    base_batch_size: int = 256  # the batch size learning_rate was tuned for (lr_scaling)


@dataclass
class PrecisionConfig:
    policy: Policy = Policy.fp32
    # None: skip_micro_batch under mixed_float16 (the library's), stop otherwise (ga-train's own)
    nonfinite: Optional[NonFinite] = None
    # Under a policy that skips: the run fails at an epoch end where more than this share of its
    # micro-batches (skip_micro_batch) or windows (skip_window) so far was skipped.
    max_skipped_fraction: float = 0.25


class ClusterSource(str, enum.Enum):
    tf_config = "tf_config"  # the TF_CONFIG environment variable (Kubernetes, most launchers)
    slurm = "slurm"  # SLURM's environment, one worker per task (gacli.runner.slurm)


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
    # The learning rate of each stage of accum_schedule, the reference batch its first stage's.
    lr_scaling: LRScaling = LRScaling.none
    auto_batch: AutoBatchConfig = field(default_factory=AutoBatchConfig)
    oom: OutOfMemory = OutOfMemory.fail  # an out-of-memory error while training
    wrapper: Wrapper = Wrapper.auto
    partial_window: PartialWindow = _LIBRARY.partial_window
    # window_weights: the window's loss divided by its total sample weight (e.g. its real tokens,
    # from a dataset that gives (x, y, sample_weight)); batch: Keras' mean per micro-batch
    loss_normalization: LossNormalization = _LIBRARY.loss_normalization
    batchnorm: BatchNormPolicy = BatchNormPolicy.keep
    precise_bn_micro_batches: int = 200  # batchnorm=precise: training micro-batches pooled
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
    # Its direction follows from its name (gacli.runner.objective).
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


# The sections whose keys may be a target's arguments: open for keys the schema does not declare
# (the declared ones keep their types). A key that no run reads is refused before composing
# (gacli.runner.user_config), except in a section with the user's own _target_.
OPEN_SECTIONS = ("model", "dataset", "optimizer", "loss")
# The keys of an own section that ga-train reads itself: never passed to its target.
OWN_SECTION_KEYS = {
    "model": ("_target_", "name", "factory", "kwargs"),
    "dataset": ("_target_", "name", "validation_split", "shuffle", "task", "num_classes"),
    "optimizer": (
        "_target_",
        "name",
        "learning_rate",
        "schedule",
        "warmup_updates",
        "decay_rate",
        "decay_updates",
        "lr_scaling",
        "base_batch_size",
        "use_agc",
        "clip_factor",
    ),
    "loss": ("_target_",),
}


def register_configs():
    """Register the schema so that YAML files are validated against it."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    store = ConfigStore.instance()
    schema = OmegaConf.structured(TrainConfig)
    for section in OPEN_SECTIONS:
        OmegaConf.set_struct(schema[section], False)
    store.store(name="gacli_schema", node=schema)
    for group, schema in GROUPS.items():
        store.store(group=group, name="gacli_schema", node=schema)


@dataclass(frozen=True)
class BatchPlan:
    """The batch arithmetic of a run, derived once and printed at start."""

    micro_batch_size: int
    accum_steps: int
    replicas: int

    @property
    def effective_batch_size(self):
        return self.micro_batch_size * self.accum_steps * self.replicas

    @property
    def global_micro_batch_size(self):
        """Samples in one step over all replicas: what tf.data batches by."""
        return self.micro_batch_size * self.replicas


_BATCH_KEYS = ("micro_batch_size", "accum_steps", "effective_batch_size")


def resolve_batch(micro_batch_size, accum_steps, effective_batch_size, replicas, given=()):
    """Any two of micro batch, accumulation steps and effective batch determine the third.

    Args:
        micro_batch_size, accum_steps, effective_batch_size: the configured values (None: unset).
        replicas: replicas in sync (devices x workers).
        given: the keys set on the command line; they win over values from config files, so
            ``effective_batch_size=256 micro_batch_size=16`` works whatever a recipe says.

    Returns:
        A :class:`BatchPlan`.
    """
    micro, accum, effective, from_command_line = _chosen_batch_values(
        micro_batch_size, accum_steps, effective_batch_size, given
    )
    if micro == AUTO:
        return _auto_plan(accum, effective, replicas)
    if micro is not None and accum is not None:
        return _checked_plan(micro, accum, effective, replicas, from_command_line)
    if micro is not None:
        per_update = micro * replicas
        if effective % per_update:
            lower = max(per_update, effective // per_update * per_update)
            raise ConfigError(
                f"effective_batch_size={effective} is not a multiple of micro_batch_size x "
                f"replicas = {micro} x {replicas} = {per_update}; use e.g. "
                f"effective_batch_size={lower} or {lower + per_update}, or another "
                "micro_batch_size."
            )
        return BatchPlan(micro, effective // per_update, replicas)
    per_micro = accum * replicas
    if effective % per_micro:
        raise ConfigError(_no_micro_batch_gives(effective, accum, replicas))
    return BatchPlan(effective // per_micro, accum, replicas)


def _no_micro_batch_gives(effective, accum, replicas):
    """Why no micro-batch gives ``effective`` at ``accum`` x ``replicas``, and the nearest
    settings that work: each one named gives exactly the effective batch it states."""
    per_micro = accum * replicas
    lower = effective // per_micro
    near = " or ".join(
        f"accum_steps={accum} micro_batch_size={size} (effective batch {size * per_micro})"
        for size in (lower, lower + 1)
        if size >= 1
    )
    message = (
        f"effective_batch_size={effective} is not a multiple of accum_steps x replicas = "
        f"{accum} x {replicas} = {per_micro}, so no micro_batch_size gives it exactly; set "
        f"micro_batch_size instead of effective_batch_size: {near}"
    )
    if effective % replicas == 0 and effective // replicas <= 10**12:
        per_replica = effective // replicas
        small = [k for k in range(1, math.isqrt(per_replica) + 1) if per_replica % k == 0]
        divisors = sorted({*small, *(per_replica // k for k in small)})
        below = [k for k in divisors if k < accum][-1:]
        above = [k for k in divisors if k > accum][:1]
        kept = " or ".join(
            f"accum_steps={k} (micro-batches of {per_replica // k})" for k in below + above
        )
        message += f"; or keep effective_batch_size={effective} with {kept}"
    return message + "."


def _chosen_batch_values(micro_batch_size, accum_steps, effective_batch_size, given):
    """(micro, accum, effective, keys from the command line): the values that decide the plan,
    None for the one to derive."""
    values = dict(zip(_BATCH_KEYS, (micro_batch_size, accum_steps, effective_batch_size)))
    for key, value in values.items():
        if key == "micro_batch_size" and value == AUTO:
            continue
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ConfigError(
                f"{key}={value} must be a whole number >= 1, e.g. {key}="
                f"{ {'micro_batch_size': 16, 'accum_steps': 4, 'effective_batch_size': 64}[key] }"
                + (" (or micro_batch_size=auto)." if key == "micro_batch_size" else ".")
            )
    configured = [key for key in _BATCH_KEYS if values[key] is not None]
    from_command_line = [key for key in configured if key in given]
    if from_command_line:
        # Command-line keys first; then the micro-batch (it is what fits in memory), then accum.
        kept = from_command_line + [k for k in configured if k not in from_command_line]
        kept = kept[: max(2, len(from_command_line))]
    else:
        kept = configured  # all from config files: every value is checked, none dropped
    micro = values["micro_batch_size"] if "micro_batch_size" in kept else None
    accum = values["accum_steps"] if "accum_steps" in kept else None
    effective = values["effective_batch_size"] if "effective_batch_size" in kept else None
    if micro is None and (accum is None or effective is None):
        micro = 32  # the default micro-batch when it cannot be derived
    if accum is None and effective is None:
        accum = 1
    return micro, accum, effective, from_command_line


def _checked_plan(micro, accum, effective, replicas, from_command_line):
    """The plan of ``micro`` x ``accum``; a ConfigError when ``effective`` disagrees."""
    plan = BatchPlan(micro, accum, replicas)
    disagree = effective is not None and effective != plan.effective_batch_size
    if disagree and not from_command_line:
        # All three from config files: the usual cause is a YAML that sets two of them and
        # leaves the default job's accum_steps in place.
        derived = (
            ("accum_steps: null", f"accum_steps = {effective // (micro * replicas)}")
            if effective % (micro * replicas) == 0
            else (
                "effective_batch_size: null",
                f"effective_batch_size = {plan.effective_batch_size}",
            )
        )
        raise ConfigError(
            f"micro_batch_size={micro}, accum_steps={accum} and effective_batch_size="
            f"{effective} are all set in the config files (the default job sets accum_steps: "
            f"4) and disagree: {micro} x {accum} x {replicas} replica(s) = "
            f"{plan.effective_batch_size}. Set the one to derive to null in your YAML, e.g. "
            f"{derived[0]} (then {derived[1]}), or give two of them on the command line."
        )
    if disagree:
        raise ConfigError(
            f"effective_batch_size={effective} does not equal micro_batch_size x accum_steps x "
            f"replicas = {micro} x {accum} x {replicas} = {plan.effective_batch_size}; set "
            "two of the three (the third is derived), e.g. "
            f"effective_batch_size={plan.effective_batch_size}."
        )
    return plan


@dataclass(frozen=True)
class AutoPlan:
    """``micro_batch_size=auto``: the batch arithmetic that waits for the probe's micro-batch.

    With ``effective_batch_size`` set, the micro-batch is a divisor of the effective batch per
    replica and ``accum_steps`` follows, so the effective batch is kept exactly; with
    ``accum_steps`` set instead, the effective batch follows the micro-batch.
    """

    accum_steps: Optional[int]
    effective_batch_size: Optional[int]
    replicas: int

    def candidates(self, largest):
        """Every micro-batch size the arithmetic allows, up to ``largest``, smallest first."""
        if self.effective_batch_size is None:
            return list(range(1, largest + 1))
        per_replica = self.effective_batch_size // self.replicas
        return [size for size in range(1, min(largest, per_replica) + 1) if per_replica % size == 0]

    def with_micro_batch_size(self, micro_batch_size):
        if self.effective_batch_size is None:
            return BatchPlan(micro_batch_size, self.accum_steps, self.replicas)
        return BatchPlan(
            micro_batch_size,
            self.effective_batch_size // (micro_batch_size * self.replicas),
            self.replicas,
        )


def _auto_plan(accum, effective, replicas):
    if accum is not None and effective is not None:
        raise ConfigError(
            "micro_batch_size=auto chooses the micro-batch, so only one of "
            f"accum_steps={accum} and effective_batch_size={effective} can be kept: give one of "
            "them on the command line, "
            f"e.g. micro_batch_size=auto effective_batch_size={effective}."
        )
    if effective is not None and effective % replicas:
        raise ConfigError(
            f"effective_batch_size={effective} is not a multiple of the {replicas} replicas, so "
            f"no micro-batch keeps it exactly; use e.g. effective_batch_size="
            f"{max(replicas, effective // replicas * replicas)}."
        )
    return AutoPlan(accum, effective, replicas)


def is_own(section):
    """Whether a group's section is the user's own (``model=own``: built by its ``_target_``)."""
    return str(getattr(section.name, "value", section.name)) == OWN


def shown_name(section):
    """What a group's section is called in messages: its choice, or the user's own target."""
    if is_own(section):
        return str(section._target_)
    return str(getattr(section.name, "value", section.name))


def expected_replicas(strategy):
    """Replicas a strategy config will have, where that is known without TensorFlow, else None."""
    if strategy.name in (StrategyName.default, StrategyName.one_device):
        return 1
    if strategy.name == StrategyName.mirrored and strategy.devices:
        return len(strategy.devices)
    if strategy.name == StrategyName.mirrored and strategy.logical_cpus:
        return strategy.logical_cpus
    return None


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
    _validate_targets(cfg)
    check_loggers(cfg, given)


def _validate_targets(cfg):
    """The ``_target_`` of each section, the entries of ``metrics`` and ``callbacks``: each a
    dotted path where one is given, and one only where it is read; ``model.factory``'s form."""
    from omegaconf import OmegaConf

    if cfg.model.factory is not None and ":" not in cfg.model.factory:
        raise ConfigError(
            f"model.factory={cfg.model.factory} must be 'package.module:function', e.g. "
            "model.factory=mypkg.models:build_model."
        )

    for group in ("model", "dataset", "optimizer"):
        section = cfg[group]
        missing = OmegaConf.is_missing(section, "_target_")
        if not missing and section._target_ and not is_own(section):
            raise ConfigError(
                f"{group}._target_={section._target_} names your own {group}, but this run "
                f"chooses {group}={shown_name(section)}, whose settings would be passed to it. "
                f"Drop the {group}= choice: {group}._target_ alone chooses {group}=own, whose "
                f"section holds only the {group}.* keys you give."
            )
        if is_own(section) and not missing and section._target_:
            _check_target_path(f"{group}._target_", section._target_)
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


EXAMPLE_TARGETS = {
    "model": "my_pkg.nets.Net",
    "dataset": "my_pkg.data.make",
    "optimizer": "keras.optimizers.Lion",
    "metrics": "keras.metrics.AUC",
    "callbacks": "keras.callbacks.CSVLogger, filename: log.csv",
}


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
    "optimizer.base_batch_size": (1, None, True, "optimizer.base_batch_size=256"),
    "strategy.port": (1, 65535, True, "strategy.port=29500"),
    "strategy.logical_cpus": (0, None, True, "strategy.logical_cpus=2 (0: devices as they are)"),
    "precision.max_skipped_fraction": (0.0, 1.0, True, "precision.max_skipped_fraction=0.25"),
    "monitor.gns_every": (1, None, True, "monitor.gns_every=4"),
}


def _validate_ranges(cfg):
    """ConfigError naming the key, its range and an example, for a value outside its range."""
    from omegaconf import OmegaConf

    for key, (low, high, closed, example) in _RANGES.items():
        value = OmegaConf.select(cfg, key)
        if value is None:
            continue
        below = value < low if closed else value <= low
        above = high is not None and (value >= high if key == "model.dropout" else value > high)
        if below or above:
            lower = f"{'>=' if closed else '>'} {low}"
            upper = f" and {'<' if key == 'model.dropout' else '<='} {high}" if high else ""
            raise ConfigError(f"{key}={value} must be {lower}{upper}, e.g. {example}.")
    sizes = [*(cfg.model.hidden_units or []), *(cfg.model.filters or [])]
    if any(size < 1 for size in sizes):
        raise ConfigError(
            f"model.hidden_units={list(cfg.model.hidden_units)} and model.filters="
            f"{list(cfg.model.filters)} must hold layer widths >= 1, e.g. "
            "model.hidden_units=[64,64]."
        )
    if cfg.dataset.task == Task.regression and cfg.dataset.name not in ("npz", "tfrecord", OWN):
        raise ConfigError(
            f"dataset.task=regression reads float targets from dataset=npz or dataset=tfrecord, "
            f"and dataset={cfg.dataset.name} has class labels or masks; save the inputs and "
            "targets with numpy.savez('train.npz', x=inputs, y=targets) and give dataset=npz "
            "dataset.path=train.npz dataset.task=regression, or drop dataset.task."
        )
    if cfg.dataset.channels not in (1, 3, None):
        raise ConfigError(
            f"dataset.channels={cfg.dataset.channels} must be 1 (grey) or 3 (colour), e.g. "
            "dataset.channels=3."
        )


# Keys that only some choices read: {key: (what decides, the choices that read it)}. A key given
# on the command line that the run's choice does not read would change nothing: refused.
_READ_ONLY_BY = {
    "model.hidden_units": ("model.name", ("mlp",)),
    "model.dropout": ("model.name", ("mlp",)),
    "model.filters": ("model.name", ("cnn",)),
    "model.depth": ("model.name", ("unet", "resnet")),
    "model.base_filters": ("model.name", ("unet", "resnet")),
    "dataset.num_samples": ("dataset.name", ("shapes",)),
    "dataset.image_size": ("dataset.name", ("shapes", "image_folder")),
    "dataset.channels": ("dataset.name", ("shapes", "image_folder")),
    "dataset.path": ("dataset.name", ("npz", "image_folder", "tfrecord")),
    "dataset.x_key": ("dataset.name", ("npz",)),
    "dataset.y_key": ("dataset.name", ("npz",)),
    "dataset.skip_bad_files": ("dataset.name", ("image_folder",)),
    "dataset.features": ("dataset.name", ("tfrecord",)),
    "dataset.input_key": ("dataset.name", ("tfrecord",)),
    "dataset.label_key": ("dataset.name", ("tfrecord",)),
    "optimizer.momentum": ("optimizer.name", ("momentum",)),
    "optimizer.decay_rate": ("optimizer.schedule", ("exponential",)),
    "optimizer.decay_updates": ("optimizer.schedule", ("cosine", "exponential")),
    "optimizer.base_batch_size": ("optimizer.lr_scaling", ("linear", "sqrt")),
    "optimizer.clip_factor": ("optimizer.use_agc", (True,)),
    "monitor.gns_every": ("monitor.gns", (True,)),
    "strategy.logical_cpus": ("strategy.name", ("mirrored",)),
    "strategy.devices": ("strategy.name", ("mirrored", "one_device")),
    "strategy.tpu": ("strategy.name", ("tpu",)),
    "strategy.cluster": ("strategy.name", ("multi_worker",)),
    "strategy.port": ("strategy.cluster", ("slurm",)),
    "check.tolerance": ("check.name", ("equivalence",)),
}


def _refuse_inert_keys(cfg, given):
    """ConfigError for a key given on the command line that this run's choices do not read."""
    from omegaconf import OmegaConf

    for key in sorted(set(given) & set(_READ_ONLY_BY)):
        decider, readers = _READ_ONLY_BY[key]
        choice = OmegaConf.select(cfg, decider)
        choice = getattr(choice, "value", choice)
        if choice in readers or (decider == "model.name" and cfg.model.factory):
            continue
        if decider.endswith(".name") and choice == OWN:
            continue  # an own section's keys are its target's arguments
        # A group's name is chosen as the group (dataset=shapes), other deciders as keys.
        typed = decider.removesuffix(".name")
        shown = " or ".join(f"{typed}={str(reader).lower()}" for reader in readers)
        raise ConfigError(
            f"{key} is read only with {shown}, and this run has {typed}="
            f"{str(choice).lower()}, so setting it would change nothing. Drop it, or choose "
            f"what reads it (e.g. {shown.split(' or ')[0]})."
        )
