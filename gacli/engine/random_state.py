"""A model's random state: what decides the next numbers its layers draw, to checkpoint with it.

Every Keras layer that draws random numbers (``Dropout``, ``GaussianNoise``, the random
augmentation layers, a layer of one's own that calls ``keras.random`` with a
``keras.random.SeedGenerator``) keeps the position of its stream in its generator's state variable,
which moves on at every draw. The generator is a plain Python object, not a TensorFlow trackable,
so ``tf.train.Checkpoint(model=model)`` never reaches that variable, and ``model.save_weights``
and ``model.keras`` do not hold it either (they hold the layers' weights). A model restored from
such a checkpoint draws its first numbers again: from the middle of a run, its dropout masks and
noise differ from those of the uninterrupted run, and so do its final weights.
:func:`random_state` names those variables, so that a checkpoint can hold them.
"""

import contextlib

from gacli.engine import _keras_compat as compat


def random_state(model, global_generator=True):
    """The variables that decide the next random numbers ``model`` draws, as a dict to add to a
    ``tf.train.Checkpoint`` beside the model: ``"layers"``, the state of every seed generator of
    its layers, at any depth (nested models, a subclassed model's layers), in the order of
    ``model.variables``; ``"global"``, with ``global_generator``, that of Keras' global seed
    generator, which ``keras.random`` functions called without ``seed=`` draw from (made now if it
    was not yet, inside the model's distribution strategy, as its layers' are).

    Call it after the model is built, and again for each new model: the variables are the model's
    own. A checkpoint made with it restores into a model built the same way.

    Example:
        >>> checkpoint = tf.train.Checkpoint(
        ...     model=model, optimizer=model.optimizer, random_state=random_state(model)
        ... )
    """
    # Layer.variables is Layer.weights and the seed generators' states (Keras documents both).
    weights = {id(weight) for weight in model.weights}
    layers, seen = [], set()
    for variable in model.variables:
        if id(variable) not in weights and id(variable) not in seen:
            seen.add(id(variable))
            layers.append(variable)
    state = {"layers": layers}
    if global_generator:
        strategy = getattr(model, "distribute_strategy", None)
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            state["global"] = compat.global_seed_generator().state
    return state
