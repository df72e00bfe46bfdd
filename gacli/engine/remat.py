"""Recomputation of activations in the backward pass (contract row M1).

A block of layers run under recomputation keeps only its input for the backward pass; the
activations inside it are computed again there, from that input, when its gradient is needed. Its
forward pass runs once as usual (outside the gradient tape), and ``tf.recompute_grad`` runs it a
second time inside the backward pass. Two things make that second pass differ from the first in
plain ``tf.recompute_grad``, and both are undone here, so that recomputing changes no number:

* random layers: each ``keras.random.SeedGenerator`` moves on at every draw, so the second pass
  would draw new dropout masks (gradients of a network that never ran forward). The state of every
  seed generator in the block is read before the first pass and set back before the second; after
  it, the state is what the first pass left.
* state updated by the forward pass: batch norm's moving statistics (and
  ``AccumBatchNormalization``'s window sums) would be updated a second time. Every variable of the
  block that is not trained is read before the second pass and assigned back after it.

Keyword arguments (``training``, masks, a transformer block's padding mask) are closed over, not
passed through ``tf.recompute_grad``, whose graph mode takes positional tensors only; the floating
point tensors among them are passed positionally, so that their gradients flow.

How a model is cut into blocks:

* a functional (or Sequential) model, ``"every"`` or ``n``: at the tensors through which
  everything flows (one tensor alive between two layers: a skip connection that spans a tensor
  makes it no boundary). The runs between such tensors are joined so that each block starts at a
  layer with weights that are not a normalisation's (a convolution with its normalisation,
  activation, dropout and pooling is one block; a residual block is one). ``"every"`` recomputes
  each block; ``n`` recomputes runs of ``n`` consecutive blocks as one, keeping the activation at
  every ``n``-th block boundary only.
* any model, a list of layer names: each named layer (at any depth: a subclassed model's
  attribute, a KerasHub backbone's transformer layer) is a block; its call is recomputed.
"""

import contextlib
import difflib
import threading

import keras
import tensorflow as tf
from keras import tree

from gacli.engine import _keras_compat as compat
from gacli.engine.settings import EVERY, parse_remat, remat_choices

# -- state that the recomputed pass must leave as the first pass did --------------------------


def _block_variables(layers):
    """(seed generator states, every variable that is not trained) of ``layers`` and their
    sublayers, each once."""
    seeds, state, seen = [], [], set()
    for layer in layers:
        trained = {id(v) for v in layer.trainable_weights}
        weights = {id(v) for v in layer.weights}
        for variable in layer.variables:
            if id(variable) in seen or id(variable) in trained:
                continue
            seen.add(id(variable))
            state.append(variable)
            if id(variable) not in weights:  # a seed generator's state (random_state.py)
                seeds.append(variable)
    return seeds, state


def _read(variable):
    # The stored value, not cast by a mixed-precision autocast scope.
    return tf.identity(compat.raw_variable(variable))


_recomputing = threading.local()


@contextlib.contextmanager
def _recomputing_pass():
    depth = getattr(_recomputing, "depth", 0)
    _recomputing.depth = depth + 1
    try:
        yield
    finally:
        _recomputing.depth = depth


def _in_recomputed_pass():
    return getattr(_recomputing, "depth", 0) > 0


@tf.custom_gradient
def _gradient_after(output):
    """``output`` as it is; its gradient waits, by data, for ``output`` to be computed.

    The recomputed pass reads the block's weights again, and the block's backward uses those
    reads: a Dense at the end of a block multiplies the incoming gradient by the kernel read
    there, while the kernel's own gradient needs no read of it. In a ``tf.function`` that also
    applies the gradients (a custom loop's ``apply_gradients``), only a control edge of its
    automatic control dependencies orders that read before the kernel's update, and TensorFlow's
    Grappler drops it: its dependency optimizer finds the edge implied by a path through an
    ``IdentityN`` (``tf.custom_gradient``'s, the optimizer's) and then removes the ``IdentityN``.
    In the runs where the update comes first, the recomputed pass sees the updated kernel and the
    gradients of the blocks below are other ones
    (``test_remat.py::test_m1_custom_loop_gradients_and_statistics_equal``). With every gradient
    of the block computed from one that depends on the recomputed output, every update comes
    after the reads of the recomputed pass.
    """

    def gradient(upstream):
        # A zero computed from one element of ``output``, compared as a bool (which equals itself
        # where the element is NaN, too): adding it is exact, and Grappler cannot fold it away.
        first = tf.cast(tf.reduce_max(tf.reshape(output, [-1])[:1]), tf.bool)
        zero = tf.where(tf.equal(first, first), 0.0, float("nan"))
        return upstream + tf.cast(zero, upstream.dtype)

    return tf.identity(output), gradient


def recompute_block(function, tensors, layers, training=None):
    """``function(tensors)`` (a list of tensors in, a structure of tensors out) under
    recomputation: its activations are not kept for the backward pass but computed again there.
    ``layers``: the layers ``function`` calls, whose random and stateful variables are put back
    around the second pass; ``training``: the training flag of the call, set again for the second
    pass (the layers' call context is gone by then)."""
    seeds, state = _block_variables(layers)
    seeds_before = [_read(v) for v in seeds]
    first = {}

    def run(*xs):
        if "structure" not in first:
            outputs = function(list(xs))
            first["structure"] = outputs
            first["masks"] = tree.map_structure(compat.get_keras_mask, outputs)
            return tree.flatten(outputs)
        # The backward pass: draw the first pass's random numbers again, and leave every state
        # variable as the first pass left it (batch norm's statistics are updated once).
        after = [_read(v) for v in state]
        with tf.control_dependencies(after):
            for variable, value in zip(seeds, seeds_before, strict=True):
                variable.assign(value)
        with _recomputing_pass(), compat.call_context(training):
            outputs = tree.flatten(function(list(xs)))
        with tf.control_dependencies(outputs):
            for variable, value in zip(state, after, strict=True):
                variable.assign(value)
            return [_gradient_after(x) if x.dtype.is_floating else tf.identity(x) for x in outputs]

    flat = tf.recompute_grad(run)(*tensors)
    outputs = tree.pack_sequence_as(first["structure"], flat)
    for output, mask in zip(tree.flatten(outputs), tree.flatten(first["masks"]), strict=False):
        if mask is not None:
            compat.set_keras_mask(output, mask)
    return outputs


# -- named layers --------------------------------------------------------------------------------


def _differentiable(value):
    return tf.is_tensor(value) and value.dtype.is_floating


def _recomputing_call(layer, original):
    """``layer``'s call, under recomputation; its tensor arguments that carry gradients go
    through ``tf.recompute_grad`` positionally, everything else is closed over."""

    def call(*args, **kwargs):
        if _in_recomputed_pass():
            return original(*args, **kwargs)
        flat = tree.flatten((args, kwargs))
        positions = [i for i, value in enumerate(flat) if _differentiable(value)]
        training = kwargs.get("training")

        def function(tensors):
            values = list(flat)
            for i, tensor in zip(positions, tensors, strict=True):
                mask = compat.get_keras_mask(flat[i])
                if mask is not None:
                    compat.set_keras_mask(tensor, mask)
                values[i] = tensor
            call_args, call_kwargs = tree.pack_sequence_as((args, kwargs), values)
            if _in_recomputed_pass():
                # Through Layer.__call__ again: its autocast scope and call context.
                return layer(*call_args, **call_kwargs)
            return original(*call_args, **call_kwargs)

        return recompute_block(function, [flat[i] for i in positions], [layer], training)

    return call


@contextlib.contextmanager
def named_blocks_recomputed(layers):
    """While open, each of ``layers`` recomputes its call in the backward pass."""
    patched = []
    try:
        for layer in layers:
            if "call" in vars(layer):
                continue
            object.__setattr__(layer, "call", _recomputing_call(layer, layer.call))
            patched.append(layer)
        yield
    finally:
        for layer in patched:
            object.__delattr__(layer, "call")


def find_named_layers(model, names):
    """The layers of ``model`` (at any depth) named ``names``, or a ValueError naming the one
    not found with the nearest name."""
    layers = {layer.name: layer for layer in compat.sublayers(model)}
    top = [layer.name for layer in model.layers]
    found = []
    for name in names:
        if name not in layers:
            near = difflib.get_close_matches(name, list(layers), n=1)
            hint = f" Did you mean {near[0]!r}?" if near else ""
            raise ValueError(
                f"remat names layer {name!r}, which model {model.name!r} does not have.{hint} "
                f"Its own layers are: {', '.join(top[:20])}{', ...' if len(top) > 20 else ''} "
                "(and the layers inside them). Name the layers to recompute, each a block, e.g. "
                f"remat={example_names(model)!r}."
            )
        found.append(layers[name])
    for layer in found:
        inner = [
            other.name for other in found if other is not layer and other in compat.sublayers(layer)
        ]
        if inner:
            raise ValueError(
                f"remat names layer {layer.name!r} and, inside it, {inner[0]!r}: a layer "
                "recomputed inside a recomputed layer would run three times. Name either the "
                "outer layer or the inner ones."
            )
    return found


def example_names(model):
    """Two of ``model``'s own layers, what a refusal shows as layers to name: the first layers
    made of layers (transformer blocks, residual blocks), else the first with weights."""
    layers = list(getattr(model, "layers", []))
    composite = [layer for layer in layers if compat.sublayers(layer)]
    weighted = [layer for layer in layers if layer.weights]
    chosen = (composite or weighted or layers)[:2]
    return [layer.name for layer in chosen] or ["block_1", "block_2"]


# -- functional models: blocks at single-tensor boundaries ---------------------------------------

_NORMALIZATION = (
    keras.layers.BatchNormalization,
    keras.layers.LayerNormalization,
    keras.layers.GroupNormalization,
    keras.layers.UnitNormalization,
)


def _heavy(layer):
    """A layer that starts a block: one with trained weights that is not a normalisation."""
    return bool(getattr(layer, "weights", None)) and not isinstance(layer, _NORMALIZATION)


class GraphPlan:
    """A functional model's nodes in execution order, cut into blocks at single tensors."""

    def __init__(self, model, remat):
        self.model = model
        self.nodes = nodes = compat.graph_nodes(model)
        produced = {id(x): 0 for x in model.inputs}
        last_use = {}
        for position, node in enumerate(nodes, start=1):
            for x in node.input_tensors:
                last_use[id(x)] = position
            for x in node.outputs:
                produced.setdefault(id(x), position)
        for x in model.outputs:
            last_use[id(x)] = len(nodes) + 1
        # After position i, the tensors still to be used; a cut where there is one.
        cuts = []
        for position in range(len(nodes) + 1):
            alive = [t for t, at in produced.items() if at <= position < last_use.get(t, -1)]
            if len(alive) == 1:
                cuts.append((position, alive[0]))
        runs = [(a, b, ta, tb) for (a, ta), (b, tb) in zip(cuts, cuts[1:], strict=False)]
        blocks = []
        for run in runs:
            heavy = any(_heavy(node.operation) for node in nodes[run[0] : run[1]])
            if blocks and not (heavy and blocks[-1][4]):
                last = blocks[-1]
                blocks[-1] = (last[0], run[1], last[2], run[3], last[4] or heavy)
            else:
                blocks.append((*run, heavy))
        self.blocks = [block[:4] for block in blocks]
        every = 1 if remat == EVERY else remat
        if len(self.blocks) < 2 or every >= len(self.blocks):
            raise ValueError(self._cannot_cut(remat))
        self.segments = []
        for start in range(0, len(self.blocks), every):
            group = self.blocks[start : start + every]
            self.segments.append((group[0][0], group[-1][1], group[0][2], group[-1][3]))

    def _cannot_cut(self, remat):
        count = len(self.blocks)
        return (
            f"remat={remat!r} cannot cut model {self.model.name!r}: it has {count} block(s) "
            "between tensors through which everything flows (a skip connection, or a second "
            "input used further on, spans the tensors in between), and recomputing "
            + ("the whole model" if count < 2 else f"runs of {remat} of its {count} blocks")
            + " keeps every activation anyway. "
            + (
                f"Use a smaller number, e.g. remat={max(1, count // 2)}, or name"
                if count >= 2
                else "Name"
            )
            + f" the layers to recompute, e.g. remat={example_names(self.model)!r} (each named "
            "layer is recomputed as one block)."
        )

    def block_layers(self, start, stop):
        # Keras operations in the graph (ops called on symbolic tensors) hold no variables.
        operations = [node.operation for node in self.nodes[start:stop]]
        return [op for op in operations if isinstance(op, keras.layers.Layer)]


def run_graph(model, plan, inputs, training=None, mask=None):
    """``model``'s functional call, with ``plan``'s segments recomputed."""
    inputs = compat.graph_inputs(model, inputs)
    if mask is not None:
        for x, m in zip(inputs, tree.flatten(mask), strict=False):
            if m is not None:
                compat.set_keras_mask(x, m)
    tensors = {id(x): y for x, y in zip(model.inputs, inputs, strict=True)}
    position = 0
    for start, stop, entry, exit_ in plan.segments:
        while position < start:
            compat.run_graph_node(model, plan.nodes[position], tensors, training)
            position += 1

        def function(xs, start=start, stop=stop, entry=entry, exit_=exit_):
            local = {entry: xs[0]}
            mask = compat.get_keras_mask(tensors[entry])
            if mask is not None:
                compat.set_keras_mask(xs[0], mask)
            for node in plan.nodes[start:stop]:
                compat.run_graph_node(model, node, local, training)
            return local[exit_]

        tensors[exit_] = recompute_block(
            function, [tensors[entry]], plan.block_layers(start, stop), training
        )
        position = stop
    while position < len(plan.nodes):
        compat.run_graph_node(model, plan.nodes[position], tensors, training)
        position += 1
    return compat.graph_outputs(model, [tensors[id(x)] for x in model.outputs])


def plan_for(model, remat):
    """What ``remat`` recomputes in ``model``: a GraphPlan, or the named layers; checked now,
    with a one-paragraph ValueError for a choice that cannot be made. Cached on the model."""
    remat = parse_remat(remat)
    cached = getattr(model, "_gacli_remat_plan", None)
    if cached is not None and cached[0] == remat:
        return cached[1]
    if remat is None:
        plan = None
    elif isinstance(remat, tuple):
        plan = find_named_layers(model, remat)
    elif not compat.is_functional(model) or not model.built:
        raise ValueError(
            f"remat={remat!r} cuts a functional or Sequential model at its single-tensor "
            f"boundaries; {type(model).__name__} {model.name!r} is a subclassed model (or not "
            "built), whose call gacli cannot cut. Name the layers to recompute instead, each one "
            f"a block, e.g. remat={example_names(model)!r} (its sublayers, such as transformer "
            "blocks)."
        )
    else:
        plan = GraphPlan(compat.graph_of(model), remat)
    object.__setattr__(model, "_gacli_remat_plan", (remat, plan))
    return plan


def recomputing_call(model, remat, inputs, training=None, mask=None, plain_call=None):
    """``model``'s call on ``inputs`` with ``remat``'s blocks recomputed. ``plain_call``: how to
    call it without recomputation (for named layers; default ``model(inputs, training=...)``)."""
    plan = plan_for(model, remat)
    if isinstance(plan, GraphPlan):
        return run_graph(plan.model, plan, inputs, training=training, mask=mask)
    if plain_call is None:

        def plain_call():
            if compat.call_has_training_arg(model):
                return model(inputs, training=training)
            return model(inputs)

    with named_blocks_recomputed(plan or ()):
        return plain_call()


@keras.saving.register_keras_serializable(package="gacli")
class Recompute(keras.Model):
    """``model`` with blocks of its layers recomputed in the backward pass, for a custom training
    loop (the model wrappers take ``remat=`` themselves). Shares ``model``'s layers and weights;
    see :func:`recompute`."""

    def __init__(self, model, remat=EVERY, **kwargs):
        super().__init__(**kwargs)
        self.model = model
        self.remat = parse_remat(remat)
        if self.remat is None:
            raise ValueError(remat_choices(remat))
        self.built = model.built
        if model.built:
            plan_for(model, self.remat)

    def build(self, input_shape):
        if not self.model.built:
            self.model.build(input_shape)
        self.built = True

    def call(self, inputs, training=None, mask=None):
        return recomputing_call(self.model, self.remat, inputs, training=training, mask=mask)

    def get_config(self):
        remat = list(self.remat) if isinstance(self.remat, tuple) else self.remat
        return {
            "name": self.name,
            "model": keras.saving.serialize_keras_object(self.model),
            "remat": remat,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["model"] = keras.saving.deserialize_keras_object(
            config["model"], custom_objects=custom_objects
        )
        return cls(**config)


def recompute(model, remat=EVERY):
    """Return a model that runs ``model``'s layers (the same ones, the same weights) with blocks
    of them recomputed in the backward pass instead of keeping their activations: for custom
    training loops with ``tf.GradientTape``, and for ``GradientAccumulateOptimizer`` in plain
    ``fit()``. The numbers are those of ``model`` itself: gradients to float32 round-off, dropout
    masks drawn once, batch norm's statistics updated once per forward pass.

    ``remat``: ``"every"`` (each block of a functional or Sequential model), ``n`` (runs of ``n``
    consecutive blocks, each recomputed as one), or a list of layer names (any model: each named
    layer, e.g. a transformer block, is one block).

    Example:
        >>> recomputing = gacli.recompute(model, remat="every")
        >>> with tf.GradientTape() as tape:
        ...     loss = loss_fn(y, recomputing(x, training=True))
    """
    return Recompute(model, remat=remat, name=f"{model.name}_recompute")
