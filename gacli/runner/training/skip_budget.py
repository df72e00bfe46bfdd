"""Training that did not happen is not reported as a success: a run fails once it has skipped
too many of its micro-batches or windows (``precision.max_skipped_fraction``), as soon as it is
seen that no gradient reaches any of the model's weights, and at its end when no update was
applied at all (:func:`check_trained`)."""

import math

import keras
import numpy as np

from gacli.engine.options import NonFinite
from gacli.errors import TrainingFailed

_WHAT_TO_DO = (
    "Look for inf or nan in the inputs or labels, lower optimizer.learning_rate, or add "
    "optimizer.clipnorm=1.0; precision.nonfinite=stop halts at the first such micro-batch and "
    "names its samples."
)
# A window is skipped when its loss or gradient is not finite, or when it holds no weight: under
# loss_normalization=window_weights, a window whose sample weights are all 0 (all padding).
_NO_WEIGHT = (
    "they held no sample weight (every sample weight 0, e.g. all padding, under "
    "loss_normalization=window_weights)"
)


class SkipBudget(keras.callbacks.Callback):
    """At each epoch end, fails the run when the share of its micro-batches (under
    ``skip_micro_batch``) or of its windows (under every policy) skipped so far exceeds
    ``max_fraction``; and, under ``stop``, when the epoch's loss is not finite (the optimizer
    wrapper's fit() hands the engine gradients only, not the loss).

    Args:
        accumulator: the run's GradientAccumulateOptimizer (its counters).
        replicas: micro-batches trained per micro-step (one per replica).
        max_fraction: the share, 0 to 1, beyond which the run fails.
    """

    def __init__(self, accumulator, replicas, max_fraction):
        super().__init__()
        self.accumulator = accumulator
        self.replicas = replicas
        self.max_fraction = max_fraction

    def skipped(self):
        """[(skipped, out of, unit)] so far: micro-batches where the policy skips them, then
        windows."""
        accumulator = self.accumulator
        counts = []
        if accumulator.nonfinite is NonFinite.skip_micro_batch:
            skipped = int(accumulator.skipped_micro_batches.numpy())
            counts.append(
                (skipped, int(accumulator.micro_step.numpy()) * self.replicas, "micro-batches")
            )
        skipped = int(accumulator.skipped_windows.numpy())
        counts.append((skipped, int(accumulator.optimizer_step.numpy()) + skipped, "windows"))
        return counts

    def on_epoch_end(self, epoch, logs=None):
        loss = (logs or {}).get("loss")
        stops = self.accumulator.nonfinite is NonFinite.stop
        if stops and loss is not None and not math.isfinite(float(loss)):
            raise TrainingFailed(
                f"training stopped at the end of epoch {epoch + 1}: its loss is {float(loss)}, "
                "not a finite number, so the weights it trained cannot be trusted. Look for "
                "inf or nan in the inputs, or targets so large that their squares overflow; "
                "lower optimizer.learning_rate, or add optimizer.clipnorm=1.0. wrapper=model "
                "halts at the first such micro-batch and names its samples."
            )
        for skipped, total, unit in self.skipped():
            if total and skipped / total > self.max_fraction:
                why = "their loss or gradient was not finite (inf or nan)"
                if unit == "windows":
                    why += f", or {_NO_WEIGHT}"
                if stops:  # a non-finite window would have stopped the run
                    why = _NO_WEIGHT
                raise TrainingFailed(
                    f"training stopped at the end of epoch {epoch + 1}: {skipped} of its {total} "
                    f"{unit} so far ({skipped / total:.0%}) were skipped because {why}, more "
                    f"than precision.max_skipped_fraction={self.max_fraction:g}, so the model "
                    "has not trained on most of its data. "
                    + ("Give weight to the samples that should count." if stops else _WHAT_TO_DO)
                )


class NoGradientStop(keras.callbacks.Callback):
    """After the first compiled call of each fit(), fails the run when the last micro-batch gave
    no gradient for any trainable weight: the loss does not depend on them, so no update can
    change the model (the micro-batches are counted, the updates stay 0). Reads one small
    variable, once a fit() call.

    Args:
        accumulator: the run's GradientAccumulateOptimizer (its ``gradient_mask``).
    """

    def __init__(self, accumulator):
        super().__init__()
        self.accumulator = accumulator
        self.checked = False

    def on_train_begin(self, logs=None):
        self.checked = False

    def on_train_batch_end(self, batch, logs=None):
        if self.checked:
            return
        self.checked = True
        accumulator = self.accumulator
        if np.asarray(accumulator.gradient_mask.numpy()).any():
            return
        raise TrainingFailed(
            "training stopped: no gradient of the loss reaches any of the model's trainable "
            "weights (the loss does not depend on them), so no update can change the model: "
            f"{int(accumulator.optimizer_step.numpy())} updates after "
            f"{int(accumulator.micro_step.numpy())} micro-batches. Compute the loss from the "
            "model's predictions (y_pred, in loss._target_ or the model's own compute_loss), "
            "and check that the layers between the inputs and the outputs are trainable."
        )


def check_trained(accumulator):
    """TrainingFailed at the end of a run that applied no update: a model that training did not
    change is not a result."""
    updates = int(accumulator.optimizer_step.numpy())
    if updates:
        return
    micro_steps = int(accumulator.micro_step.numpy())
    skipped = int(accumulator.skipped_windows.numpy()) if accumulator.nonfinite else 0
    why = (
        f"every one of its {skipped} windows was skipped: their loss or gradient was not "
        f"finite, or {_NO_WEIGHT}"
        if skipped
        else "no window of accum_steps micro-batches was completed and applied"
    )
    raise TrainingFailed(
        f"training ended without a single update after {micro_steps} micro-batches: {why}. "
        "The model is as it was built, so no result is written. Fix the cause and start again."
    )
