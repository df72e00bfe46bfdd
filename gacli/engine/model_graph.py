"""What gacli reads of a model's structure: its layers at any depth, and whether it is a graph of
layers (functional or Sequential) that can be cut and rebuilt, or a subclassed model whose
``call`` is code. Keras keeps both facts private; they are read through ``_keras_compat``."""

from gacli.engine import _keras_compat as compat


def sublayers(model, include_self=False):
    """Every layer inside ``model`` (a layer or a model), nested ones included, each once, in
    Keras' tracking order; with ``include_self``, ``model`` first.

    Example:
        >>> [layer.name for layer in gacli.sublayers(model) if not layer.weights]
    """
    return compat.sublayers(model, include_self=include_self)


def is_functional(model):
    """Whether ``model`` is a graph of layers (a functional or Sequential model), which
    ``remat="every"`` can cut and Keras can rebuild from its config, rather than a subclassed
    model whose ``call`` is Python code."""
    return compat.is_functional(model)
