"""Named choices shared by the library and the ``ga-train`` config (no TensorFlow import here).

Members are lower case because OmegaConf matches a YAML or command-line string to an Enum member by
its *name*: ``partial_window=drop`` must find ``PartialWindow.drop``.
"""

import enum


class PartialWindow(str, enum.Enum):
    """What happens to a window that holds fewer than ``accum_steps`` micro-batches at epoch end."""

    apply = "apply"  # apply it, normalised by the samples it really holds
    drop = "drop"  # discard its gradients
    carry = "carry"  # keep accumulating into the next epoch; applied at the end of training


class NonFinite(str, enum.Enum):
    """What a micro-batch with a non-finite (inf/nan) gradient does to its window."""

    stop = "stop"  # no update from that micro-batch on; fit() raises NonFiniteError
    skip_micro_batch = "skip_micro_batch"  # drop that micro-batch; the window goes on
    skip_window = "skip_window"  # drop the whole window, as DeepSpeed and Lightning do


class Reduction(str, enum.Enum):
    """How the micro-batch gradients of a window are combined."""

    mean = "mean"  # weighted mean: one big batch over the same samples
    sum = "sum"  # plain sum of the micro-batch gradients (the older package's "SUM")


class LossNormalization(str, enum.Enum):
    """What a window's loss is divided by (contract E3)."""

    batch = "batch"  # Keras' own semantics: the samples of the window
    window_weights = "window_weights"  # the window's total sample weight, e.g. unmasked tokens


class BatchNormPolicy(str, enum.Enum):
    """What to do with the BatchNormalization layers of a model trained with accumulation."""

    keep = "keep"  # plain Keras BN: statistics per micro-batch (warned once)
    accumulate = "accumulate"  # AccumBatchNormalization: moving statistics per window
    freeze = "freeze"  # BN in inference mode, statistics frozen (fine-tuning)
    group_norm = "group_norm"  # GroupNormalization: no batch statistics at all
    # Plain BN while training; moving statistics recomputed exactly from training micro-batches
    # before each validation and at the end (gacli.PreciseBatchNorm).
    precise = "precise"


def parse_option(enum_type, value, argument):
    """``value`` (a member, or its string in any case) as a member of ``enum_type``."""
    try:
        return enum_type(str(getattr(value, "value", value)).lower())
    except ValueError:
        choices = ", ".join(repr(member.value) for member in enum_type)
        raise ValueError(
            f"{argument}={value!r} is not one of {choices}; pass one of those, "
            f"e.g. {argument}={next(iter(enum_type)).value!r}."
        ) from None


class TF32(str, enum.Enum):
    """TensorFloat-32 for float32 matrix products and convolutions on Ampere and newer GPUs
    (:mod:`gacli.engine.tf32`)."""

    auto = "auto"  # as it is: TensorFlow's default (on), or what the caller set before
    on = "on"  # faster products whose inputs are rounded to 10 mantissa bits
    off = "off"  # float32 products in float32: what exactness to float32 round-off needs
