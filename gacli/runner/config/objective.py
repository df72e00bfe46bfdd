"""What a ``ga-train`` job returns to a Hydra sweeper: one final metric, named by ``objective``.

A sweeper such as Optuna minimises or maximises the number the task returns. ``objective`` names a
metric of the run's last epoch (the model that is saved): ``loss``, ``val_loss``, or a compiled
metric (``accuracy``, ``val_accuracy``, ``iou`` ...). Its direction follows from its name (losses
and errors are minimised, accuracies and overlaps maximised) and must agree with the sweeper's
``direction``. A run that failed, or whose objective is not finite, returns None: Optuna's sweeper
records a failed trial ("Return value must be float-castable") and the search goes on, where NaN
would end it (optuna 2.10 refuses to be told NaN).

No TensorFlow import.
"""

import difflib
import math
import re

from gacli.errors import ConfigError

MINIMIZE, MAXIMIZE = "minimize", "maximize"
FAILED = None
_SMALLER_IS_BETTER = (
    "loss",
    "error",
    "crossentropy",
    "mse",
    "rmse",
    "mae",
    "mape",
    "msle",
    "hinge",
    "perplexity",
)
_LARGER_IS_BETTER = ("accuracy", "acc", "iou", "auc", "precision", "recall", "f1", "dice", "r2")
# Every metric a ga-train run can log (gacli.runner.builders.job.loss_and_metrics compiles them):
# the loss and its compiled metrics: accuracy, iou for masks of one class, or mae and rmse for
# regression; val_ of each with validation data; or, where metrics= is given, those
# (logged_metrics). A sweep whose objective is none of them is refused before its first trial
# trains.
LOGGED = ("loss", "accuracy", "iou", "mae", "rmse")


def logged_metrics(metrics=None):
    """The metric names a run logs besides val_ ones: LOGGED, or with ``metrics=`` given, the loss
    and the names of those: a string as written, a ``_target_``'s ``name``, else the name Keras
    gives its class (keras.metrics.MeanAbsoluteError: mean_absolute_error)."""
    if metrics is None:
        return LOGGED
    names = ["loss"]
    for entry in metrics:
        if isinstance(entry, str):
            names.append(entry)
        elif entry.get("name"):
            names.append(str(entry["name"]))
        else:
            words = re.findall(
                r"[A-Z]+(?![a-z])|[A-Z]?[a-z0-9]+", str(entry["_target_"]).split(".")[-1]
            )
            names.append("_".join(word.lower() for word in words))
    return tuple(names)


def metric_name(objective, validation_split):
    """The metric ``objective`` names; None means val_loss, or loss without validation data."""
    return objective or ("val_loss" if validation_split else "loss")


def direction(objective):
    """``minimize`` or ``maximize`` for a metric name, or None when the name does not tell."""
    words = objective.lower().removeprefix("val_").replace("-", "_").split("_")
    if any(word in _SMALLER_IS_BETTER for word in words):
        return MINIMIZE
    if any(word in _LARGER_IS_BETTER for word in words):
        return MAXIMIZE
    return None


def check(objective, validation_split, sweeper_directions, metrics=None):
    """ConfigError, before training, for an objective no run can report or that the sweeper would
    optimise the wrong way. ``sweeper_directions``: the sweeper's ``direction`` setting (a string
    or a list of one), or None for sweepers that optimise nothing (Hydra's basic sweeper);
    ``metrics``: the ``metrics=`` setting (None: the task's)."""
    if objective is not None and not objective.strip():
        raise ConfigError("objective= is empty; name a metric, e.g. objective=val_loss.")
    objective = metric_name(objective, validation_split)
    if objective.startswith("val_") and not validation_split:
        raise ConfigError(
            f"objective={objective} is a validation metric, but dataset.validation_split=0 "
            f"holds no validation data; use objective={objective[4:]} or set "
            "dataset.validation_split=0.1."
        )
    if sweeper_directions is None:
        return  # one run: check_metric names the metrics of its data before training
    check_logged(objective, validation_split, metrics)
    several = isinstance(sweeper_directions, (list, tuple))
    wanted = list(sweeper_directions) if several else [sweeper_directions]
    wanted = [str(getattr(item, "name", item)).lower() for item in wanted]
    if len(wanted) != 1:
        raise ConfigError(
            f"the sweeper optimises {len(wanted)} objectives, but a ga-train job returns one "
            f"(objective={objective}); give the sweeper one direction, e.g. "
            "hydra.sweeper.direction=minimize."
        )
    implied = direction(objective)
    if implied and wanted[0] != implied:
        raise ConfigError(
            f"objective={objective} is {implied}d, but the sweeper is set to {wanted[0]} it, "
            f"which would search for the worst settings; add hydra.sweeper.direction={implied}."
        )


def check_logged(objective, validation_split, metrics=None):
    """ConfigError when ``objective`` names no metric a ga-train run can log.

    A sweep's objective is the same for every job: a name no run logs ends the sweep before its
    first job, where every job would otherwise build its model and then be refused (or, under a
    search, train and leave the sweeper no result)."""
    objective = metric_name(objective, validation_split)
    logged = logged_metrics(metrics)
    if objective.removeprefix("val_") not in logged:
        known = [*logged, *(f"val_{name}" for name in logged)] if validation_split else logged
        near = difflib.get_close_matches(objective, known, n=1)
        raise ConfigError(
            f"objective={objective} is not a metric a ga-train run logs; it logs "
            f"{', '.join(known)}"
            + (
                " (accuracy for classes, iou for masks of one class, mae and rmse for regression). "
                if metrics is None
                else " (the loss and metrics=). "
            )
            + (f"Did you mean objective={near[0]}? " if near else "")
            + f"Give one of those, e.g. objective={'val_loss' if validation_split else 'loss'}."
        )


def check_metric(objective, metric_names, validation):
    """ConfigError, before training, when ``objective`` is none of the metrics the run will log.

    ``metric_names``: the compiled metrics' names; ``validation``: whether val_ versions exist.
    """
    names = ["loss", *metric_names]
    names += [f"val_{name}" for name in names] if validation else []
    if objective not in names:
        raise ConfigError(
            f"objective={objective} is not a metric this run logs; it logs {', '.join(names)}. "
            f"Give one of those, e.g. objective={names[-1] if validation else 'loss'}."
        )


def value(objective, metrics):
    """The objective's final value from a run's metrics; FAILED when it is not finite.

    Raises ConfigError naming the metrics the run has when ``objective`` is not one of them.
    """
    if objective not in metrics:
        raise ConfigError(
            f"objective={objective} is not a metric of this run; it has "
            f"{', '.join(sorted(metrics))}. Give one of those, e.g. objective=val_loss."
        )
    number = float(metrics[objective])
    return number if math.isfinite(number) else FAILED
