"""What differs between the Keras 3 versions gacli supports (see ``keras`` in pyproject.toml).

Every branch on the Keras version lives here, each named by the upstream change it follows, so
that it can move into ``gacli/_keras_compat.py`` (the one module that reaches into ``keras.src``)
as it is. Elsewhere, a line that calls into this module is marked ``# version:``.
"""

import threading

import keras

KERAS_VERSION = tuple(int(part) for part in keras.__version__.split(".")[:2])


def keras_at_least(major, minor):
    """Whether the installed Keras is ``major.minor`` or newer."""
    return KERAS_VERSION >= (major, minor)


_functional_like_lock = threading.Lock()


def functional_config(model):
    """The functional part of ``model``'s config (its layers and their connections).

    ``Functional.get_config`` serialises the graph only for classes whose ``__init__`` looks like
    ``Functional.__init__``; a subclass with arguments of its own gets a bare ``Model`` config
    without its layers. Keras 3.15 (keras-team/keras#23036) counts an ``__init__`` that forwards
    ``*args, **kwargs`` as functional-like, as gacli's models do; before it (Keras <= 3.14, see
    keras-team/keras#21546) the check is passed here for the span of the call.
    """
    from keras.src.models import functional

    if keras_at_least(3, 15):
        return functional.Functional.get_config(model)
    with _functional_like_lock:
        check = functional.functional_like_constructor
        functional.functional_like_constructor = lambda cls: True
        try:
            return functional.Functional.get_config(model)
        finally:
            functional.functional_like_constructor = check


def autoconvert_optionals(model, step_function):
    """``step_function`` as Keras' own TensorFlow trainer wraps a step before compiling it.

    Keras 3.12 hands a step ``tf.experimental.Optional`` for the optional inputs a batch leaves out
    (keras-team/keras#21548 and its follow-ups) and converts them back to None in
    ``Trainer._autoconvert_optionals``; Keras <= 3.11 has neither, and the step is used as is.
    """
    if keras_at_least(3, 12):
        return model._autoconvert_optionals(step_function)
    return step_function
