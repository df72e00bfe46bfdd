"""A Keras callback of the user's own."""

import json

import keras


class WriteEpochs(keras.callbacks.Callback):
    """Appends one JSON line per epoch to ``path``: the epoch, its logs, the optimizer that makes
    the updates (ga-train's accumulator wraps the one the config names) and the loss."""

    def __init__(self, path):
        super().__init__()
        self.path = path

    def on_epoch_end(self, epoch, logs=None):
        optimizer = self.model.optimizer
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "inner", None)
        loss = self.model.loss
        line = {
            "epoch": epoch,
            "logs": {name: float(value) for name, value in (logs or {}).items()},
            "optimizer": type(optimizer).__name__,
            "inner": type(inner).__name__,
            "loss": [type(loss).__name__, loss.name, loss.get_config().get("from_logits")],
        }
        with open(self.path, "a") as handle:
            handle.write(json.dumps(line) + "\n")


class FailsAtEpoch(keras.callbacks.Callback):
    """Wrong while ``broken``: raises as ``epoch`` (counted from 0) begins, as a callback with a
    bug would; a test sets ``FailsAtEpoch.broken = False`` to stand for the bug fixed."""

    broken = True

    def __init__(self, epoch=1):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if self.broken and epoch == self.epoch:
            raise RuntimeError(f"no logs for epoch {epoch} yet")
