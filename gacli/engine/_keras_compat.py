"""Everything gacli takes from Keras beyond its public API, in one place.

No other gacli module imports ``keras.src`` or reads a private member of a Keras object. Each
function here says what it reaches for; each workaround of a Keras bug names its upstream issue
and the Keras versions it is switched on for (``KERAS_VERSION``). When Keras changes one of these
internals, this is the one file to change.
"""

import contextlib
import threading

import keras
import tensorflow as tf
from keras.src.backend.tensorflow.trainer import reduce_per_replica
from keras.src.losses.loss import unscale_loss_for_distribution
from keras.src.losses.losses import LossFunctionWrapper
from keras.src.models import functional
from keras.src.models.functional import Functional, functional_from_config

# Supported: Keras 3.11 to 3.15 (pyproject.toml). The branches on it are below, each with the
# upstream change it follows.
KERAS_VERSION = tuple(int(part) for part in keras.__version__.split(".")[:2])


def keras_at_least(major, minor):
    """Whether the installed Keras is ``major.minor`` or newer."""
    return KERAS_VERSION >= (major, minor)


__all__ = [
    "KERAS_VERSION",
    "functional_from_config",
    "unscale_loss_for_distribution",
]


# -- models ---------------------------------------------------------------------------------------
def is_functional(model):
    """Whether ``model`` is a graph of layers (functional or Sequential), not a subclassed one."""
    return isinstance(model, (Functional, keras.Sequential))


def graph_ends(model):
    """(inputs, outputs) of a functional or Sequential model, to rebuild it on its layers. Its
    public ``inputs`` and ``outputs`` are flat lists; a model built on dicts gets its dicts back
    (the private ``_inputs_struct`` / ``_outputs_struct``), so that a loss, its ``loss_weights``
    and sample weights keyed by output name still find their outputs."""
    inputs, outputs = model.inputs, model.outputs
    structures = (getattr(model, "_inputs_struct", None), getattr(model, "_outputs_struct", None))
    if any(isinstance(structure, dict) for structure in structures):
        return structures
    return inputs, outputs


_functional_like_lock = threading.Lock()


def functional_config(model):
    """The functional part of ``model``'s config (its layers and their connections).

    ``Functional.get_config`` serialises the graph only for classes whose ``__init__`` looks like
    ``Functional.__init__``; a subclass with arguments of its own gets a bare ``Model`` config
    without its layers. Keras 3.15 (keras-team/keras#23036) counts an ``__init__`` that forwards
    ``*args, **kwargs`` as functional-like, as gacli's models do; before it (Keras <= 3.14, see
    keras-team/keras#21546) the check is passed here for the span of the call.
    """
    if keras_at_least(3, 15):
        return Functional.get_config(model)
    with _functional_like_lock:
        check = functional.functional_like_constructor
        functional.functional_like_constructor = lambda cls: True
        try:
            return Functional.get_config(model)
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


def compute_training_loss(model, x, y, y_pred, sample_weight, training=True):
    """The loss of one batch as ``train_step`` computes it: ``model.compute_loss`` (the model's
    own where its class overrides it; Keras': the compiled loss with the regularisation losses),
    called with ``training`` where it takes it (Keras' ``Trainer._compute_loss``)."""
    return model._compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
    )


def overrides_compute_loss(model):
    """Whether ``model``'s class defines its own ``compute_loss`` (Keras' ``train_step`` trains
    on what it returns)."""
    return type(model).compute_loss is not keras.Model.compute_loss


@contextlib.contextmanager
def compiled_loss_lent(model, lender):
    """Inside, ``model`` computes its loss with ``lender``'s compiled loss: Keras'
    ``Model.compute_loss`` reads the private ``_compile_loss`` that ``compile`` sets, and a
    wrapped model's own ``compute_loss`` calls it through ``super()`` on a model that was never
    compiled. Put back on exit."""
    saved = model._compile_loss
    model._compile_loss = lender._compile_loss
    try:
        yield model
    finally:
        model._compile_loss = saved


def compiled_loss_weights(model):
    """The ``loss_weights`` ``model`` was compiled with (None: none, or not compiled)."""
    compiled = getattr(model, "_compile_loss", None)
    return getattr(compiled, "_user_loss_weights", None)


def loss_tracker(model):
    """The metric behind ``logs["loss"]``."""
    return model._loss_tracker


def call_has_training_arg(model):
    return model._call_has_training_arg


@contextlib.contextmanager
def compile_state_hidden(model):
    """``model`` seen as not compiled (``keras.models.clone_model`` then copies no compile state:
    it would rebuild the optimizer and loss from their configs, which fails for a loss function
    that is not registered with Keras); put back on exit."""
    compiled = getattr(model, "compiled", False)
    model.compiled = False
    try:
        yield model
    finally:
        model.compiled = compiled


def sublayers(model, include_self=False):
    """Every layer inside ``model``, nested ones included (and the model, ``include_self``)."""
    return list(model._flatten_layers(include_self=include_self))


def call_sites(layer):
    """The places a layer is called at in the functional graphs it belongs to (Keras' private
    inbound nodes, one per call on symbolic inputs)."""
    return list(getattr(layer, "_inbound_nodes", ()))


def batchnorm_moments(layer, inputs, mask):
    """(mean, variance) of a BatchNormalization layer's ``inputs`` over its reduction axes, as
    the layer itself takes them (its private ``_moments``: synchronised over replicas when the
    layer is, weighted by ``mask``)."""
    return layer._moments(inputs, mask)


def batchnorm_reduction_axes(layer):
    """The axes a BatchNormalization layer takes its moments over."""
    return layer._reduction_axes


def loss_from_function(function, reduction):
    """A ``keras.losses.Loss`` that calls ``function(y_true, y_pred)`` with ``reduction`` (Keras
    exports no public class for this)."""
    return LossFunctionWrapper(
        function, reduction=reduction, name=getattr(function, "__name__", None)
    )


# -- optimizers -----------------------------------------------------------------------------------
def clip_gradients(optimizer, grads):
    """``grads`` clipped by the optimizer's clipnorm / global_clipnorm / clipvalue."""
    return optimizer._clip_gradients(grads)


def current_learning_rate(optimizer):
    return optimizer._get_current_learning_rate()


def optimizer_strategy(optimizer):
    """The tf.distribute strategy the optimizer was created under."""
    return optimizer._distribution_strategy


def track_variable(optimizer, variable):
    """Make ``variable`` part of the optimizer's state: saved, restored, in ``variables``."""
    optimizer._track_variable(variable)


def own_variables(optimizer):
    """The variables the optimizer itself created (not those of an optimizer it wraps)."""
    return optimizer._variables


def built_variables(optimizer):
    """The trainable variables the optimizer was built for, in build order."""
    return optimizer._trainable_variables


def variable_index(optimizer, variable):
    """The position of ``variable`` in :func:`built_variables`."""
    return optimizer._get_variable_index(variable)


@contextlib.contextmanager
def without_own_clipping(optimizer):
    """Inside, ``optimizer.apply`` leaves gradients unclipped: for gradients already clipped
    where Keras cannot, over all replicas at once. Keras has no argument for this, so the three
    settings are set aside for the span of a trace and put back after it."""
    names = ("clipnorm", "global_clipnorm", "clipvalue")
    saved = {name: getattr(optimizer, name, None) for name in names}
    try:
        for name in names:
            setattr(optimizer, name, None)
        yield
    finally:
        for name, value in saved.items():
            setattr(optimizer, name, value)


# -- random state ---------------------------------------------------------------------------------
def global_seed_generator():
    """Keras' global ``SeedGenerator``, which ``keras.random`` functions called without ``seed=``
    draw from; made now if it does not exist yet (Keras makes it at the first such draw, and
    ``keras.utils.set_random_seed`` drops it)."""
    from keras.src.random.seed_generator import global_seed_generator

    return global_seed_generator()


# -- tf.distribute --------------------------------------------------------------------------------
def in_multi_worker_mode(strategy):
    """Whether a MultiWorkerMirroredStrategy really spans several processes."""
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and (
        strategy.extended._in_multi_worker_mode()
    )


def configure_heartbeat_timeout(seconds):
    """Set up TensorFlow's coordination service for the TF_CONFIG cluster as
    ``MultiWorkerMirroredStrategy`` does (it keeps one configured before it), with a heartbeat
    timeout of ``seconds``: a worker not heard from for that long is reported lost to the others,
    whose collectives are then aborted with ``tf.errors.UnavailableError``. TensorFlow's public
    API has no setting for it. Call before the strategy is made."""
    from tensorflow.python.distribute import collective_all_reduce_strategy, multi_worker_util
    from tensorflow.python.eager import context

    if context.context().coordination_service is not None:
        return  # configured already (an earlier job of this process): TensorFlow keeps it
    cluster_spec = tf.distribute.cluster_resolver.TFConfigClusterResolver().cluster_spec()
    # The protobuf module's path moved between TensorFlow versions; the strategy's import of it
    # is the one that fits the installed version.
    protos = collective_all_reduce_strategy.coordination_config_pb2
    jobs = [
        protos.CoordinatedJob(name=job, num_tasks=cluster_spec.num_tasks(job))
        for job in ("chief", "worker")
        if job in cluster_spec.jobs
    ]
    context.context().configure_coordination_service(
        service_type="standalone",
        service_leader=multi_worker_util.coordination_leader(cluster_spec),
        heartbeat_timeout_in_ms=int(seconds * 1000),
        coordinated_jobs=jobs,
    )


# -- workarounds of Keras bugs, in a mixin for the model wrappers ---------------------------------
def reducible_logs(logs, strategy):
    """Logs that Keras can average over workers (keras-team/keras#20585).

    Across workers Keras averages a step's logs with ``strategy.reduce("MEAN", value, axis=0)``,
    which fails on the scalars every step returns; as vectors of one they average to the same
    scalar. One process keeps its scalars.
    """
    if not in_multi_worker_mode(strategy):
        return logs
    return tf.nest.map_structure(
        lambda value: tf.reshape(value, [1]) if getattr(value, "shape", None) == () else value,
        logs,
    )


@contextlib.contextmanager
def jit_compile_off(model):
    """Inside, Keras makes the model's step functions without XLA (``model.jit_compile`` is
    read when they are made); the setting is as it was after."""
    setting = model._jit_compile
    model._jit_compile = False
    try:
        yield
    finally:
        model._jit_compile = setting


class KerasWorkarounds:
    """Overrides of Keras trainer internals that route around Keras bugs; mixed into the model
    wrappers before ``keras.Model``."""

    def test_step(self, data):
        return reducible_logs(super().test_step(data), self.distribute_strategy)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # keras-team/keras#20585: Keras builds the model from one batch before fit/evaluate under
        # a strategy, averaging the per-replica batches with strategy.reduce, which
        # MultiWorkerMirroredStrategy cannot do eagerly for an input batch. Only the batch's
        # shapes matter here, so the first local replica's batch builds the model just as well.
        strategy = self._distribute_strategy
        if strategy is None or iterator is None:
            return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)
        for _, _, batches in iterator:
            batch = next(batches)
            data_batch = tf.nest.map_structure(
                lambda value: (
                    strategy.experimental_local_results(value)[0]
                    if isinstance(value, tf.distribute.DistributedValues)
                    else value
                ),
                batch,
            )
            break
        with strategy.scope():
            self._symbolic_build(data_batch=data_batch)

    def _get_metrics_result_or_logs(self, logs):
        # Keras takes an epoch's metrics (training and validation) from the metric variables of
        # its own process: across workers each reports the metrics of its own shard of the data
        # (a chief's val_accuracy 0.8722 where the whole validation set gave 0.8774; seen on
        # Keras 3.15, no upstream issue filed). Summed over the workers first, the states (a
        # total and a count; a confusion matrix) give the metrics of all the data.
        strategy = self.distribute_strategy
        if not in_multi_worker_mode(strategy) or not self.metrics_variables:
            return super()._get_metrics_result_or_logs(logs)
        variables = self.metrics_variables
        local = [variable.numpy() for variable in variables]
        if getattr(self, "_gacli_sum_over_workers", None) is None:
            self._gacli_sum_over_workers = _sum_over_workers(strategy)
        for variable, total in zip(variables, self._gacli_sum_over_workers(local)):
            variable.assign(total)
        try:
            return super()._get_metrics_result_or_logs(logs)
        finally:
            for variable, value in zip(variables, local):
                variable.assign(value)

    def _make_function(self, step_function):
        # Keras runs steps_per_execution > 1 steps in a tf.while_loop whose body puts each step
        # in a tf.cond; with several replicas in sync that graph fails when it runs ("You must
        # feed a value for placeholder tensor 'while/body/.../Placeholder_1'", seen on Keras 3.15
        # with or without accumulation; no upstream issue filed). The same loop without the
        # tf.cond (its condition already checks that data is left) runs, for training and
        # validation alike.
        strategy = self.distribute_strategy
        if (
            self.steps_per_execution == 1
            or self.run_eagerly
            or (strategy.num_replicas_in_sync == 1)
        ):
            return super()._make_function(step_function)
        return _several_steps_function(self, step_function, self.steps_per_execution)


def _sum_over_workers(strategy):
    """A function of a list of arrays: each summed over the strategy's workers (a reduce across
    them; every worker must call it at the same point)."""
    local_replicas = len(strategy.extended.worker_devices)

    def function(values):
        totals = []
        for value in values:
            # Every local replica holds the worker's value: a share of it each.
            share = value if local_replicas == 1 else value / local_replicas
            per_replica = strategy.experimental_distribute_values_from_function(
                lambda context, share=share: tf.constant(share)
            )
            totals.append(strategy.reduce("SUM", per_replica, axis=None).numpy())
        return totals

    return function


def _several_steps_function(model, step_function, steps):
    """``steps`` distributed steps a call, in a while loop without a cond in its body."""
    strategy = model.distribute_strategy

    def one_step(data):
        outputs = strategy.run(step_function, args=(data,))
        return reduce_per_replica(outputs, strategy, reduction="auto")

    one_step = autoconvert_optionals(
        model, tf.function(one_step, reduce_retracing=True, jit_compile=model.jit_compile)
    )

    @tf.function(reduce_retracing=True)
    def several_steps(iterator):
        # The outputs' structure is known once the body is traced (as in Keras' own loop).
        none_yet = tf.experimental.Optional.empty(None)

        def data_left(step, outputs, inputs):
            return tf.logical_and(step < steps, inputs.has_value())

        def body(step, outputs, inputs):
            outputs = tf.experimental.Optional.from_value(one_step(inputs.get_value()))
            none_yet._element_spec = outputs.element_spec
            inputs = tf.cond(step + 1 < steps, iterator.get_next_as_optional, lambda: inputs)
            return step + 1, outputs, inputs

        _, outputs, _ = tf.while_loop(
            data_left, body, [tf.constant(0), none_yet, iterator.get_next_as_optional()]
        )
        outputs._element_spec = none_yet.element_spec
        return outputs

    def function(iterator):
        outputs = several_steps(iterator)
        if not outputs.has_value():
            raise StopIteration
        return outputs.get_value()

    return function


# -- recomputation (remat.py) -----------------------------------------------------------------


def raw_variable(variable):
    """The backend variable under a Keras variable: reading it is not cast by a mixed-precision
    autocast scope (``KerasVariable.value`` is)."""
    return getattr(variable, "_value", variable)


@contextlib.contextmanager
def call_context(training):
    """A Keras call context with ``training`` set, where none is open (the backward pass, which
    runs a recomputed block after its model's call has returned): a layer called without
    ``training=`` inherits it, as it did in the first pass."""
    from keras.src.backend.common import global_state
    from keras.src.layers.layer import CallContext

    if global_state.get_global_attribute("current_call_ctx") is not None or training is None:
        yield
        return
    context = CallContext(entry_layer=None)
    context.training = training
    global_state.set_global_attribute("current_call_ctx", context)
    try:
        yield
    finally:
        global_state.set_global_attribute("current_call_ctx", None)


def graph_of(model):
    """The functional graph that runs ``model`` (a Sequential model's inner one)."""
    return getattr(model, "_functional", None) if isinstance(model, keras.Sequential) else model


def graph_nodes(model):
    """A functional model's nodes in the order its call runs them (Keras' ``_run_through_graph``:
    by decreasing depth), those it would skip left out."""
    nodes = []
    known = {id(x) for x in model.inputs}
    for depth in sorted(model._nodes_by_depth, reverse=True):
        for node in model._nodes_by_depth[depth]:
            if not node.operation or node.is_input:
                continue
            if any(id(x) not in known for x in node.input_tensors):
                continue
            nodes.append(node)
            known.update(id(x) for x in node.outputs)
    return nodes


def run_graph_node(model, node, tensors, training):
    """Call ``node``'s layer on the tensors it takes from ``tensors`` (by id of the symbolic
    tensor), passing ``training`` as a functional call does; its outputs go into ``tensors``."""
    args, kwargs = node.arguments.fill_in(tensors)
    # Keras 3.13 added the mapping of nodes to operations (for NNX) and call-context arguments.
    get_operation = getattr(model, "_get_operation_for_node", None)
    operation = get_operation(node) if get_operation is not None else node.operation
    takes_training = (
        "training" in operation._call_context_args
        if hasattr(operation, "_call_context_args")
        else getattr(operation, "_call_has_training_arg", False)
    )
    if training is not None and takes_training:
        kwargs["training"] = training
    outputs = operation(*args, **kwargs)
    for x, y in zip(node.outputs, keras.tree.flatten(outputs), strict=False):
        tensors[id(x)] = y


def graph_inputs(model, inputs):
    """``inputs`` as the flat list a functional model's graph takes."""
    return model._standardize_inputs(inputs)


def graph_outputs(model, outputs):
    """The flat list ``outputs`` in the structure the functional model returns."""
    packed = keras.tree.pack_sequence_as(model._outputs_struct, outputs)
    return packed[0] if isinstance(packed, list) and len(packed) == 1 else packed


def get_keras_mask(tensor):
    """The mask Keras carries on ``tensor`` (an Embedding's ``mask_zero``, Masking), or None."""
    from keras.src import backend

    return backend.get_keras_mask(tensor) if tf.is_tensor(tensor) else None


def set_keras_mask(tensor, mask):
    """Carry ``mask`` on ``tensor`` as Keras does between layers."""
    from keras.src import backend

    backend.set_keras_mask(tensor, mask)
