"""A run that skips non-finite micro-batches fails once it has skipped too many of them: training
that mostly did not happen is not reported as a success (``precision.max_skipped_fraction``)."""

import keras

from gacli.engine.options import NonFinite
from gacli.errors import TrainingFailed


class SkipBudget(keras.callbacks.Callback):
    """At each epoch end, fails the run when the share of its micro-batches (``skip_micro_batch``)
    or windows (``skip_window``) skipped so far exceeds ``max_fraction``.

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
        """(skipped, out of, unit) so far, in the unit the policy skips."""
        accumulator = self.accumulator
        if accumulator.nonfinite is NonFinite.skip_window:
            skipped = int(accumulator.skipped_windows.numpy())
            return skipped, int(accumulator.optimizer_step.numpy()) + skipped, "windows"
        skipped = int(accumulator.skipped_micro_batches.numpy())
        return skipped, int(accumulator.micro_step.numpy()) * self.replicas, "micro-batches"

    def on_epoch_end(self, epoch, logs=None):
        skipped, total, unit = self.skipped()
        if total and skipped / total > self.max_fraction:
            raise TrainingFailed(
                f"training stopped at the end of epoch {epoch + 1}: {skipped} of its {total} "
                f"{unit} so far ({skipped / total:.0%}) were skipped because their loss or "
                "gradient was not finite (inf or nan), more than precision.max_skipped_fraction="
                f"{self.max_fraction:g}, so the model has not trained on most of its data. Look "
                "for inf or nan in the inputs or labels, lower optimizer.learning_rate, or add "
                "optimizer.clipnorm=1.0; precision.nonfinite=stop halts at the first such "
                "micro-batch and names its samples."
            )
