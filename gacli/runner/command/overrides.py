"""The command line's ``key=value`` overrides, read in one place.

Hydra takes ``key=value``, ``+key=value`` (add), ``++key=value`` (add or replace) and ``~key``
(delete); ``ga-train`` looks at some of them before Hydra composes (the run directory, ``resume=``,
``config=``), and these helpers are how it reads them.
"""

_QUOTES = "'\""


def key(override):
    """``model.width`` for ``model.width=64``, ``+model.width=64``, ``++model.width=64``,
    ``~model.width``."""
    return override.split("=", 1)[0].lstrip("+~")


def value(override):
    """What follows the first ``=``, without surrounding blanks or quotes ("" for ``~key``)."""
    return override.partition("=")[2].strip().strip(_QUOTES)


def values(overrides, name):
    """The values given to ``name``, in the order given."""
    return [value(override) for override in overrides if key(override) == name]


def last(overrides, name, default=None):
    """The value Hydra uses for ``name``: the last one given, else ``default``."""
    given = values(overrides, name)
    return given[-1] if given else default


def given(overrides, name):
    """Whether ``name`` is set, added or deleted on the command line."""
    return any(key(override) == name for override in overrides)
