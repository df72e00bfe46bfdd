"""gacli: exact gradient accumulation for Keras 3 on TensorFlow.

The public names are imported lazily so that ``import gacli`` (and the ``ga-train`` command line,
which lives inside this package) does not pay for a TensorFlow import until a name that needs it is
used.
"""

from importlib import import_module

__version__ = "0.1.0"

_LAZY = {
    "GradientAccumulateOptimizer": "gacli.accumulation",
    "PartialWindow": "gacli.options",
    "NonFinite": "gacli.options",
    "LossNormalization": "gacli.options",
    "find_accumulating_optimizer": "gacli.accumulation",
    "GradientAccumulateModel": "gacli.accumulate_model",
    "wrap_model": "gacli.accumulate_model",
    "adaptive_clip_gradients": "gacli.clipping",
    "AccumBatchNormalization": "gacli.batchnorm",
    "BatchNormPolicy": "gacli.options",
    "apply_batchnorm_policy": "gacli.batchnorm",
    "PreciseBatchNorm": "gacli.precise_batchnorm",
    "BatchNormStatistics": "gacli.precise_batchnorm",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gacli' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
