"""The batch arithmetic: micro-batch x accum_steps x replicas = effective batch, from whichever
two of the three the config gives (or ``micro_batch_size=auto``'s plan still to be completed by
the probe), with a paragraph naming what to type when no whole numbers give the asked batch."""

import math
from dataclasses import dataclass
from typing import Optional

from gacli.errors import ConfigError
from gacli.runner.config.schema import AUTO


@dataclass(frozen=True)
class BatchPlan:
    """The batch arithmetic of a run, derived once and printed at start, and the recomputation
    the micro-batch was chosen with (``remat``: a value of the ``remat`` setting, as
    :func:`~gacli.runner.config.schema.remat_setting` gives it; None: the config's)."""

    micro_batch_size: int
    accum_steps: int
    replicas: int
    remat: object = None

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
