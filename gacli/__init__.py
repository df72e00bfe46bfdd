"""gacli: exact gradient accumulation for Keras 3 on TensorFlow.

The public names are imported lazily so that ``import gacli`` (and the ``ga-train`` command line,
which lives inside this package) does not pay for a TensorFlow import until a name that needs it is
used. Keras still finds gacli's classes when it loads a saved model: they are registered as soon as
Keras itself is imported (see :class:`_RegisterWithKeras`), so ``import gacli`` followed by
``keras.models.load_model("model.keras")`` works with no other import.
"""

import sys
from importlib import abc, import_module

__version__ = "0.1.0"

_LAZY = {
    "GradientAccumulateOptimizer": "gacli.engine.accumulation",
    "AccumulationConfig": "gacli.engine.settings",
    "PartialWindow": "gacli.engine.options",
    "NonFinite": "gacli.engine.options",
    "LossNormalization": "gacli.engine.options",
    "find_accumulating_optimizer": "gacli.engine.accumulation",
    "NonFiniteError": "gacli.engine.accumulation",
    "StopOnNonFinite": "gacli.engine.accumulation",
    "GradientAccumulateModel": "gacli.engine.accumulate_model",
    "wrap_model": "gacli.engine.accumulate_model",
    "accumulation_callbacks": "gacli.engine.accumulate_model",
    "random_state": "gacli.engine.random_state",
    "adaptive_clip_gradients": "gacli.engine.clipping",
    "agc_unit_axes": "gacli.engine.clipping",
    # gradient-accumulator's names, kept so its users' imports work unchanged.
    "adaptive_clip_grad": "gacli.engine.clipping",
    "unitwise_norm": "gacli.engine.clipping",
    "compute_norm": "gacli.engine.clipping",
    "replace_batchnorm_layers": "gacli.engine.batchnorm",
    "AccumBatchNormalization": "gacli.engine.batchnorm",
    "BatchNormWarning": "gacli.engine.batchnorm",
    "BatchNormPolicy": "gacli.engine.options",
    "apply_batchnorm_policy": "gacli.engine.batchnorm",
    "PreciseBatchNorm": "gacli.engine.precise_batchnorm",
    "BatchNormStatistics": "gacli.engine.precise_batchnorm",
    "check_equivalence": "gacli.engine.equivalence",
    "EquivalenceResult": "gacli.engine.equivalence",
    "TF32": "gacli.engine.options",
    "tf32_mode": "gacli.engine.tf32",
    "tf32_enabled": "gacli.engine.tf32",
    "recompute": "gacli.engine.remat",
    "Recompute": "gacli.engine.remat",
    # The building blocks ga-train uses, for tools built on gacli in the same way.
    "set_accum_steps": "gacli.engine.accumulate_model",
    "AccumulatingModelWrapper": "gacli.engine.accumulate_model",
    "plain_batchnorm_layers": "gacli.engine.batchnorm",
    "EquivalenceInputError": "gacli.engine.equivalence",
    "LinearWarmup": "gacli.engine.schedules",
    "ScaledLearningRate": "gacli.engine.schedules",
    "gpus_with_tf32": "gacli.engine.tf32",
    "tf32_used": "gacli.engine.tf32",
    "tf32_description": "gacli.engine.tf32",
    "noise_from_two_sizes": "gacli.engine.window",
    "read_now": "gacli.engine.window",
    "release_free_memory": "gacli.engine.host_memory",
    "sublayers": "gacli.engine.model_graph",
    "is_functional": "gacli.engine.model_graph",
    "in_multi_worker_mode": "gacli.engine.cluster",
    "configure_heartbeat_timeout": "gacli.engine.cluster",
}

__all__ = sorted(_LAZY) + ["__version__"]


# The modules whose classes Keras deserialises by their registered names ("gacli>...").
_SERIALIZABLE = (
    "gacli.engine.accumulation",
    "gacli.engine.accumulate_model",
    "gacli.engine.batchnorm",
    "gacli.engine.schedules",
    "gacli.engine.remat",
)


def _initializing(module):
    # importlib marks a module's spec while the module's code runs (CPython since 3.4).
    return getattr(getattr(module, "__spec__", None), "_initializing", False)


def _register_with_keras(finished=None):
    """Import the modules that register gacli's classes with Keras, unless TensorFlow, Keras or
    one of those modules is still being imported (TensorFlow imports Keras from its own
    ``__init__``): then the import that finishes last registers them. ``finished``: the module
    whose code has just run (importlib still marks it as initialising)."""
    if any(
        _initializing(sys.modules.get(name))
        for name in _WAIT_FOR + _SERIALIZABLE
        if name != finished
    ):
        return
    for name in _SERIALIZABLE:
        import_module(name)
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _RegisterWithKeras)]


_WAIT_FOR = ("tensorflow", "keras")


class _RegisteringLoader(abc.Loader):
    """A loader of TensorFlow or Keras, followed by the registration of gacli's classes."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        try:
            _register_with_keras(finished=module.__name__)
        except ImportError as error:  # a broken gacli must not break the user's `import keras`
            import warnings

            warnings.warn(f"gacli's classes are not registered with Keras: {error}", stacklevel=2)

    def __getattr__(self, name):  # get_source, get_resource_reader, ...: the wrapped loader's
        return getattr(self._loader, name)


class _RegisterWithKeras(abc.MetaPathFinder):
    """Finds ``tensorflow`` and ``keras`` as the other finders do, and has gacli's classes
    registered once both are imported; then it leaves ``sys.meta_path``."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _WAIT_FOR:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and not isinstance(spec.loader, _RegisteringLoader):
                    spec.loader = _RegisteringLoader(spec.loader)
                return spec
        return None


if "keras" in sys.modules:
    _register_with_keras()
if not all(name in sys.modules for name in _WAIT_FOR) or any(
    _initializing(sys.modules.get(name)) for name in _WAIT_FOR
):
    if not any(isinstance(finder, _RegisterWithKeras) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterWithKeras())


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gacli' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    _register_with_keras()
    globals()[name] = value
    return value


def __dir__():
    return __all__
