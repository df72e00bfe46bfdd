"""The parts of accumulation, each with one job and its own state, none of them aware of Keras'
trainer (in the manner of optax's ``MultiSteps``, a transformation of gradients and state):

- :class:`Window` sums the micro-batch gradients of the open window with their weights, and
  gives back the window's gradient;
- :class:`LossScale` is dynamic loss scaling for float16 (the one loss-scaling path of gacli);
- :class:`NonFiniteGuard` keeps inf and nan out of the window per the ``nonfinite`` policy;
- :class:`NoiseScale` measures the gradient noise scale from the micro-batch gradients the window
  already has (``noise_scale=True``).

Every part keeps its state in variables made by the ``add_state(name, shape, dtype, per_replica,
initial_value)`` callable it is built with, so the state is checkpointed with the optimizer and
a restore, a retrace or a second ``fit()`` finds it as it was. Nothing is learnt while tracing.
:class:`~gacli.engine.accumulation.GradientAccumulateOptimizer` composes them and adds what is
Keras' and tf.distribute's.
"""

import math
import struct

import numpy as np
import tensorflow as tf

# TensorFlow's own test for "this graph is part of an XLA computation" (not public API).
from tensorflow.python.ops.control_flow_util import GraphOrParentsInXlaContext

from gacli.engine.options import NonFinite, Reduction

# The name of the conditional that adds a micro-batch unless the non-finite check drops it.
ADD_IF_KEPT = "add_if_kept"

# Elements summed per row by the matrix product of _sum_by_product, and the largest tensor summed
# that way (what it sums is a temporary copy: at most 16 MiB).
_ROW = 128
_MOST_BY_PRODUCT = 1 << 22


def _all_finite(gradient):
    """Whether every element of ``gradient`` is finite; a sparse one's rows only (its other
    rows are zeros). Under XLA on a CPU the non-finite elements are counted by
    :func:`_sum_by_product` (a count below 2**24 is exact in float32); without XLA on a CPU,
    a float32 gradient is tested by :func:`_finite_by_scaled_product`."""
    if isinstance(gradient, tf.IndexedSlices):
        gradient = gradient.values
    if _by_product(gradient):
        flags = tf.cast(tf.logical_not(tf.math.is_finite(gradient)), "float32")
        return _sum_by_product(flags) == 0.0
    rows = _scaled_product_rows(gradient)
    if rows is not None:
        return _finite_by_scaled_product(gradient, rows)
    return tf.reduce_all(tf.math.is_finite(gradient))


def _scaled_product_rows(gradient):
    """The row length that :func:`_finite_by_scaled_product` lays ``gradient`` out in (its last
    axis, or all of a vector), or None where it does not apply: under XLA, with a GPU visible,
    for other dtypes than float32, or rows shorter than 16 (the product's output, one number
    per row, would be a copy of a sixteenth of the gradient or more)."""
    if gradient.dtype != tf.float32 or gradient.shape.rank is None or gradient.shape.rank == 0:
        return None
    length = gradient.shape[-1]
    if length is None or length < 16 or in_xla_computation() or not _on_cpu_only():
        return None
    return length


def _finite_by_scaled_product(gradient, length):
    """Whether every element is finite, in one pass and no copy: the gradient, in rows of
    ``length``, times a column of 2**-64, summed. A nan or an infinity in any element makes
    that sum nan or infinite (inf times 2**-64 is inf, inf - inf is nan), and finite elements
    cannot make it overflow: each product is at most 3.4e38 * 2**-64 = 1.8e19. It is used
    instead of TensorFlow's test of every element (``is_finite``, then ``reduce_all``), which
    writes a copy of flags as large as the gradient first (``benchmarks/xla_sums.py``; the
    figures are in ``docs/performance.md``)."""
    matrix = tf.reshape(gradient, [-1, length])
    column = tf.fill([length, 1], tf.constant(2.0**-64, tf.float32))
    return tf.math.is_finite(tf.reduce_sum(tf.matmul(matrix, column)))


def _squared_norm_of_rows(values, indices):
    """The squared norm of the dense tensor that rows ``values`` at ``indices`` (repeats
    allowed) add up to: repeated rows are summed first, then squared (the norm of the
    gradient, not the sum of its occurrences' norms). Sorting gives the repeats static shapes,
    so XLA compiles it; the cost is that of sorting the micro-batch's rows."""
    order = tf.argsort(indices)
    ordered = tf.gather(indices, order)
    starts = tf.concat([[0], tf.cast(ordered[1:] != ordered[:-1], "int32")], axis=0)
    rows = tf.math.unsorted_segment_sum(
        tf.gather(tf.cast(values, "float32"), order),
        tf.cumsum(starts),
        num_segments=tf.shape(indices)[0],
    )
    return tf.reduce_sum(tf.square(rows))


def squared_norm(gradients, factor=None, marked=False):
    """The squared norm of ``gradients`` (a list, dense or ``tf.IndexedSlices``) times
    ``factor`` (None: 1), in float32; a sparse one's from its rows only.

    ``marked`` (dense gradients only): each non-finite element counts as a nan, so the norm is
    nan exactly when an element is not finite, and otherwise the same number (finite elements
    whose squares overflow make it inf, never nan): the non-finite check reads it
    (:func:`all_finite`), in the same pass."""
    sparse = [g for g in gradients if isinstance(g, tf.IndexedSlices)]
    dense = [g for g in gradients if not isinstance(g, tf.IndexedSlices)]
    if marked and sparse:
        raise ValueError("a marked squared norm is for dense gradients only")
    squares = [_squared_norm_of_rows(g.values, g.indices) for g in sparse]
    squares.extend((_marked_sum_of_squares if marked else sum_of_squares)(g) for g in dense)
    return times_squared(tf.add_n(squares), factor)


def _marked_sum_of_squares(tensor):
    """:func:`sum_of_squares` with the square of every non-finite element made a nan: under XLA
    the select is fused into the pass that squares, and the sum is a reduction of the squares
    (or :func:`_sum_by_product`), not ``l2_loss``."""
    tensor = tf.cast(tensor, "float32")
    squares = tf.where(tf.math.is_finite(tensor), tf.square(tensor), tf.constant(np.nan))
    return _sum_by_product(squares) if _by_product(tensor) else tf.reduce_sum(squares)


def marks_non_finite():
    """Whether the non-finite check and the noise scale share one marked squared norm
    (:func:`squared_norm`'s ``marked``): under XLA on a CPU. There the check's test then costs a
    select fused into the norm's pass, with no conditional and no second pass over the
    gradients for the check (``docs/performance.md``). Without XLA the squared norm is
    TensorFlow's own kernel, which a select would precede with a copy (see
    :func:`finite_by_squared_norm`)."""
    return _compiled_by_xla_on_cpu()


def times_squared(squared, factor):
    """A squared norm of gradients times ``factor`` squared: that of the gradients times
    ``factor`` (None: 1)."""
    return squared if factor is None else squared * tf.square(tf.cast(factor, "float32"))


def all_finite(gradients, squared=None, marked=False):
    """Whether every element of ``gradients`` (a list) is finite, a boolean tensor.

    ``squared``, their squared norm (:func:`squared_norm` without a factor), answers without
    another pass: an inf or a nan anywhere makes it inf or nan, so a finite one proves every
    element finite. Only where it is not finite are the elements tested one by one, for it is
    also inf when finite elements' squares overflow float32 (a norm above 1.8e19), and those
    are kept. On a CPU only: a GPU's own reductions are fast, and its conditional waits for
    the predicate on the host. Under XLA the engine takes this way only for a micro-batch with
    a sparse gradient (the conditional copies no gradient there); a dense one's check reads the
    marked norm instead.

    ``marked``: ``squared`` is :func:`squared_norm`'s marked norm, nan exactly when an element
    is not finite: the answer is that it is not nan, with no conditional and no other pass."""
    if marked:
        return tf.logical_not(tf.math.is_nan(squared))
    if squared is None or not _on_cpu_only():
        return _elements_finite(gradients)
    return tf.cond(
        tf.math.is_finite(squared),
        lambda: tf.constant(True),
        lambda: _elements_finite(gradients),
        name="elements_finite",
    )


def finite_by_squared_norm():
    """Whether the non-finite check alone computes a squared norm to test (:func:`all_finite`):
    without XLA (inside it a sum by matrix product tests the elements as fast as it squares
    them) on a CPU (a GPU's own reductions are fast, and its conditional waits for the
    predicate on the host)."""
    return not in_xla_computation() and _on_cpu_only()


def _elements_finite(gradients):
    return tf.reduce_all([_all_finite(g) for g in gradients])


def _on_cpu_only():
    """Whether no GPU is visible: the sums by matrix product are for a CPU's kernels only."""
    return not tf.config.list_logical_devices("GPU")


def _compiled_by_xla_on_cpu():
    """Whether the op being traced goes into an XLA computation for a CPU (no GPU visible)."""
    return in_xla_computation() and _on_cpu_only()


def _by_product(tensor):
    """Whether sums over ``tensor`` go through :func:`_sum_by_product`: under XLA on a CPU,
    for a tensor of 512 to 4 Mi elements."""
    size = tensor.shape.num_elements()
    return size is not None and 4 * _ROW <= size <= _MOST_BY_PRODUCT and _compiled_by_xla_on_cpu()


def _sum_by_product(elements):
    """The sum of a float32 tensor's elements as XLA on a CPU runs it fast.

    XLA on a CPU compiles a reduction to one number into a single sequential loop, which on a
    small model's gradients is slower than TensorFlow's own kernel and weighs on every
    micro-step (the noise scale's squared norm and the non-finite check's test are such sums;
    ``benchmarks/xla_sums.py``, figures in ``docs/performance.md``). Here the elements are laid out
    in rows of 128 and summed by a matrix product with a column of ones, which XLA hands to its
    vectorised matrix kernels, and the rows' sums are added. ``elements`` is computed into a
    temporary copy for the product: hence the 4 Mi bound of :func:`_by_product` (16 MiB).
    """
    flat = tf.reshape(elements, [-1])
    size = flat.shape[0]
    whole = size - size % _ROW
    total = tf.reduce_sum(tf.matmul(tf.reshape(flat[:whole], [-1, _ROW]), tf.ones([_ROW, 1])))
    if whole < size:
        total += tf.reduce_sum(flat[whole:])
    return total


def sum_of_squares(tensor):
    """The sum of ``tensor``'s squared elements, in float32: ``2 * l2_loss`` (one pass, no
    squared copy), or under XLA on a CPU by :func:`_sum_by_product`. Not on a GPU, where a
    matrix product may round to TF32 and XLA's reductions are fast."""
    tensor = tf.cast(tensor, "float32")
    if _by_product(tensor):
        return _sum_by_product(tf.square(tensor))
    return 2.0 * tf.nn.l2_loss(tensor)


def _scatter_add(variable, rows):
    """Add ``rows`` (IndexedSlices) into ``variable``. By its handle: a ``keras.Variable`` has no
    scatter, and a per-replica (on-read) variable refuses one, but in replica context its handle
    is this replica's own copy."""
    if not isinstance(variable, tf.Variable):
        variable = variable.value
    tf.raw_ops.ResourceScatterAdd(
        resource=variable.handle, indices=rows.indices, updates=rows.values
    )


# The smallest weight the moving averages are divided by (float32's 1e-12).
_AT_LEAST_WEIGHT = float(np.float32(1e-12))


# IEEE binary32 with the standard size: packing rounds to nearest and refuses a number beyond
# float32's range (the native "f" returns an infinity there on some Python versions only).
_BINARY32 = struct.Struct("<f")


def _float32(number):
    """A Python float rounded to float32 as a float32 operation rounds its result (beyond
    float32's range: an infinity, as there)."""
    try:
        return _BINARY32.unpack(_BINARY32.pack(number))[0]
    except OverflowError:
        return math.copysign(math.inf, number)


def _value(variable):
    """A variable's value; read in cross-replica context, a per-replica one comes summed."""
    return tf.convert_to_tensor(variable)


def read_now(variable):
    """A variable's value as NumPy, read eagerly between compiled calls (callbacks' counters).

    ``variable.numpy()`` runs two eager ops, a read and a copy (``identity``). Right after a
    compiled call, while TensorFlow's worker threads still hold the cores, each op waits for
    them, so one ``ReadVariableOp`` (used here) costs less than two, and the callbacks read
    several counters an update. A distributed variable (a mirrored or per-replica one) is read
    as before.
    """
    # A keras.Variable's own tf.Variable is its ``value``.
    value = variable if isinstance(variable, tf.Variable) else getattr(variable, "value", None)
    if isinstance(value, tf.distribute.DistributedValues) or not hasattr(value, "handle"):
        return variable.numpy()
    return tf.raw_ops.ReadVariableOp(resource=value.handle, dtype=value.dtype).numpy()


def in_xla_computation():
    """Whether the graph being traced is (part of) an XLA computation, ``tf.function(...,
    jit_compile=True)``'s: there a tensor's shape must be known before it runs. (TensorFlow has
    no public test; this is the one its own ``tf.function`` makes.)"""
    return bool(GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


def _held_rows(value):
    """The rows of an accumulator's ``value`` that are not all zero: those a sparse gradient
    touched in the window (a row whose sum is exactly zero is left out; the dense gradient has
    zeros there too). Its cost: one pass over the table, and one bool per element."""
    rows = tf.reshape(value, [tf.shape(value)[0], -1])
    return tf.where(tf.reduce_any(tf.not_equal(rows, 0), axis=1))[:, 0]


def _scatter_zeros(variable, rows):
    """Zero ``rows`` of ``variable`` in place (by its handle, as :func:`_scatter_add`)."""
    shape = tf.concat([tf.shape(rows, out_type="int32"), variable.shape[1:]], axis=0)
    zeros = tf.zeros(shape, variable.dtype)
    if not isinstance(variable, tf.Variable):
        variable = variable.value
    tf.raw_ops.ResourceScatterUpdate(resource=variable.handle, indices=rows, updates=zeros)


class Window:
    """The open window: a float accumulator per trainable variable, and what it holds.

    State (per replica unless said): the accumulators; ``window_weight``, the summed sample
    counts of micro-batches that gave one; ``window_unweighted``, micro-batches that gave none
    (their gradients come already divided by the replica count, as Keras' ``train_step`` makes
    them); ``window_micro_steps`` and ``micro_step`` (the same on every replica); and
    ``gradient_mask``, which variables the last micro-batch had a gradient for.

    ``sparse`` holds the indices of the variables whose gradients came as ``tf.IndexedSlices``
    (embedding tables), as traced: it chooses the form of their window's gradient, never its
    value (:meth:`gradients`).
    """

    def __init__(self, accum_steps, reduction, dtype):
        self.accum_steps = accum_steps
        self.reduction = reduction
        self.dtype = dtype
        self.sparse = set()

    def build(self, add_state, variables):
        self.micro_step = add_state("micro_step", dtype="int64")
        self.window_micro_steps = add_state("window_micro_steps", dtype="int64")
        self.window_weight = add_state("window_weight", per_replica=True)
        self.window_unweighted = add_state("window_unweighted", per_replica=True)
        # 1 for each variable that received a gradient: a variable that gets none must not be
        # "updated" with a zero gradient, which would still move it under Adam or momentum.
        # int64, never int32: TensorFlow keeps an int32 variable in host memory, where an XLA
        # computation on a GPU cannot reach it (see docs/contract.md, "On a GPU").
        self.gradient_mask = add_state(
            "gradient_mask", shape=(len(variables),), dtype="int64", initial_value=1
        )
        self.accumulators = [
            add_state(
                f"{variable.path.replace('/', '_')}_accumulator"
                if hasattr(variable, "path")
                else f"accumulator_{index}",
                shape=variable.shape,
                dtype=self.dtype,
                per_replica=True,
            )
            for index, variable in enumerate(variables)
        ]

    def add(self, gradients, factor, keep):
        """Add one micro-batch. ``gradients``: {variable index: gradient}; ``factor``: what each
        gradient is multiplied by first (None: 1); ``keep``: a boolean tensor, False to leave the
        micro-batch out (None: always keep).

        A sparse gradient (``tf.IndexedSlices``, an embedding's) is added row by row with a
        scatter: every cost here is proportional to the micro-batch's rows, never the table's
        (contract row E5)."""
        if keep is not None and not in_xla_computation():
            # Without XLA a graph conditional leaves a dropped micro-batch out outright, with no
            # pass of tf.where (and its zeros) over every gradient of every micro-batch. Inside
            # XLA a conditional copies every variable its branch writes: there, tf.where.
            tf.cond(
                keep, lambda: self._add(gradients, factor, None), lambda: None, name=ADD_IF_KEPT
            )
        else:
            self._add(gradients, factor, keep)

    def _add(self, gradients, factor, keep):
        for index, gradient in gradients.items():
            accumulator = self.accumulators[index]
            sparse = isinstance(gradient, tf.IndexedSlices)
            contribution = tf.cast(gradient.values if sparse else gradient, accumulator.dtype)
            if factor is not None:
                contribution = contribution * tf.cast(factor, accumulator.dtype)
            if keep is not None:
                # where, not multiplication: 0 * inf is nan.
                contribution = tf.where(keep, contribution, tf.zeros_like(contribution))
            if sparse:
                self.sparse.add(index)
                _scatter_add(accumulator, tf.IndexedSlices(contribution, gradient.indices))
            else:
                accumulator.assign_add(contribution)

    def count(self, sample_count, kept):
        """Weigh one micro-batch on this replica: its samples (None: unweighted), times ``kept``
        (1 or 0)."""
        if sample_count is None:
            self.window_unweighted.assign_add(kept)
        else:
            self.window_weight.assign_add(tf.cast(sample_count, "float32") * kept)

    def step(self, indices):
        """Count one micro-step, whose micro-batch had gradients for the variables at
        ``indices``. The state written here holds one value for all replicas, so under a
        strategy it is written where replicas synchronise, never inside a replica's XLA
        computation (see ``GradientAccumulateOptimizer.close_window``)."""
        mask = [0] * len(self.accumulators)
        for index in indices:
            mask[index] = 1
        self.gradient_mask.assign(tf.constant(mask, "int64"))
        self.window_micro_steps.assign_add(1)
        self.micro_step.assign_add(1)

    def closes(self):
        return self.window_micro_steps >= self.accum_steps

    def held(self):
        """More than 0 when the window holds a micro-batch that was kept."""
        return _value(self.window_weight) + _value(self.window_unweighted)

    def denominator(self, replicas):
        """What the summed gradient is divided by: the window's samples, counted over every
        replica when read in cross-replica context (contract D3), with an unweighted
        micro-batch's gradient counting once over all replicas."""
        if self.reduction is Reduction.sum:
            return tf.constant(1.0)
        return _value(self.window_weight) + _value(self.window_unweighted) / float(replicas)

    def gradients(self, indices, variables, denominator, by_rows=False):
        """The window's gradient for the variables at ``indices``, in their dtypes, and the rows
        :meth:`reset` must zero ({index: rows}; empty: every accumulator whole).

        With ``by_rows``, a sparse variable's gradient is the ``tf.IndexedSlices`` of the rows
        its accumulator holds, each once: the dense gradient's values, without a second
        table-sized tensor beside the accumulator (the optimizer makes its dense form if it
        needs one, as it does for a plain batch's embedding gradient). Finding the rows takes a
        shape known only when it runs, so not under XLA (contract E5)."""
        grads, rows = [], {}
        for index, variable in zip(indices, variables):
            # divide_no_nan: a replica whose micro-batches were all skipped holds zeros, not 0/0.
            value = _value(self.accumulators[index])
            divisor = tf.cast(denominator, value.dtype)
            if by_rows and index in self.sparse:
                rows[index] = _held_rows(value)
                held = tf.gather(value, rows[index])
                grads.append(
                    tf.IndexedSlices(
                        tf.cast(tf.math.divide_no_nan(held, divisor), variable.dtype),
                        rows[index],
                        dense_shape=tf.shape(value, out_type=rows[index].dtype),
                    )
                )
            else:
                grads.append(tf.cast(tf.math.divide_no_nan(value, divisor), variable.dtype))
        return grads, rows

    def reset(self, rows=None):
        """Zero the window; ``rows`` ({index: rows}, from :meth:`gradients`): of those
        accumulators, only these rows hold anything, and only they are zeroed, in place."""
        rows = rows or {}
        for index, accumulator in enumerate(self.accumulators):
            if index in rows:
                _scatter_zeros(accumulator, rows[index])
            else:
                accumulator.assign(tf.zeros(accumulator.shape, accumulator.dtype))
        self.window_weight.assign(0.0)
        self.window_unweighted.assign(0.0)
        self.window_micro_steps.assign(0)


class LossScale:
    """Dynamic loss scaling: the loss is multiplied by ``loss_scale`` before the backward pass,
    each micro-batch's gradient divided by the scale it was computed with; an overflow on any
    replica halves the scale at once, ``growth_steps`` updates without one double it."""

    def __init__(self, initial_scale, dynamic_growth_steps):
        self.initial_scale = initial_scale
        self.dynamic_growth_steps = dynamic_growth_steps
        self.built = False

    def build(self, add_state):
        self.loss_scale = add_state("loss_scale", initial_value=self.initial_scale)
        self.growth_steps = add_state("growth_steps", dtype="int64")
        self.built = True

    def scale(self, loss):
        scale = self.loss_scale if self.built else self.initial_scale
        return loss * tf.cast(scale, loss.dtype)

    def inverse(self):
        return 1.0 / tf.cast(self.loss_scale, "float32")

    def after_micro_step(self, overflow):
        """In cross-replica context: ``overflow`` is True when any replica overflowed."""
        self.loss_scale.assign(
            tf.where(overflow, tf.maximum(self.loss_scale / 2.0, 1.0), self.loss_scale)
        )
        self.growth_steps.assign(
            tf.where(overflow, tf.zeros_like(self.growth_steps), self.growth_steps)
        )

    def after_update(self):
        growth = self.growth_steps + 1
        grow = growth >= self.dynamic_growth_steps
        self.loss_scale.assign(tf.where(grow, self.loss_scale * 2.0, self.loss_scale))
        self.growth_steps.assign(tf.where(grow, tf.zeros_like(growth), growth))


class NonFiniteGuard:
    """What a micro-batch with an inf or nan gradient does (``policy``, a :class:`NonFinite`).

    State: per replica, ``step_nonfinite`` (the last micro-batch overflowed) and
    ``window_nonfinite`` (the open window holds one, ``skip_window``); in cross-replica context,
    the counts ``skipped_micro_batches`` and ``skipped_windows``, and for ``stop``,
    ``halted_at_micro_step``: 0 while healthy, then the micro_step (from 1) of the first bad one.
    """

    def __init__(self, policy):
        self.policy = policy

    def build(self, add_state):
        self.step_nonfinite = add_state("step_nonfinite", per_replica=True)
        self.window_nonfinite = add_state("window_nonfinite", per_replica=True)
        self.skipped_micro_batches = add_state("skipped_micro_batches", dtype="int64")
        self.skipped_windows = add_state("skipped_windows", dtype="int64")
        if self.policy is NonFinite.stop:
            self.halted_at = add_state("halted_at_micro_step", dtype="int64")

    def keep(self, gradients, squared=None, marked=False, loss=None):
        """A boolean tensor: the micro-batch's gradients are all finite (and, under ``stop``,
        training has not halted: every micro-batch after the first bad one is left out).
        ``squared``: their squared norm, where it is computed for this test or the noise
        scale, ``marked`` as :func:`squared_norm` made it (:func:`all_finite`). ``loss``: the
        micro-batch's loss, where known, which must be finite too: a loss that overflowed (a
        squared error of targets near 1e30) can still have finite gradients."""
        finite = all_finite(gradients, squared, marked)
        if loss is not None:
            finite = tf.logical_and(finite, tf.reduce_all(tf.math.is_finite(loss)))
        if self.policy is NonFinite.stop:
            finite = tf.logical_and(finite, _value(self.halted_at) == 0)
        return finite

    def record(self, keep):
        """Note this replica's micro-batch; returns what its count is multiplied by."""
        nonfinite = 1.0 - tf.cast(keep, "float32")
        self.step_nonfinite.assign(nonfinite)
        if self.policy is NonFinite.skip_window:
            self.window_nonfinite.assign_add(nonfinite)
            return tf.constant(1.0)
        return 1.0 - nonfinite

    def after_micro_step(self, micro_step):
        """In cross-replica context, once a micro-step: halt and count."""
        bad_replicas = _value(self.step_nonfinite)
        if self.policy is NonFinite.stop:
            first_bad = tf.logical_and(self.halted_at == 0, bad_replicas > 0)
            self.halted_at.assign(tf.where(first_bad, micro_step, self.halted_at))
        if self.policy is not NonFinite.skip_window:
            # Per-replica flags summed on read: how many replicas dropped this micro-step.
            self.skipped_micro_batches.assign_add(tf.cast(bad_replicas, "int64"))
        return bad_replicas > 0

    def healthy(self, window_count):
        """In cross-replica context: the window holds something, and nothing non-finite under
        ``skip_window``. A full window that is not healthy is skipped."""
        return tf.logical_and(_value(self.window_nonfinite) == 0, window_count > 0)

    def running(self):
        """False once ``stop`` has halted training: no window is applied from then on."""
        if self.policy is NonFinite.stop:
            return self.halted_at == 0
        return tf.constant(True)

    def skip_window(self):
        self.skipped_windows.assign_add(1)

    def reset(self):
        self.window_nonfinite.assign(0.0)


def noise_from_two_sizes(mean_sq, mean_inverse, big_sq, big_count):
    """(|G|^2, tr(Sigma)) from squared gradient norms at two batch sizes, by
    ``E|g_b|^2 = |G|^2 + tr(Sigma) / b``: ``mean_sq`` is the mean of ``|g_i|^2`` over batches
    whose mean of ``1 / b_i`` is ``mean_inverse``, ``big_sq`` the ``|g|^2`` of one batch of
    ``big_count`` samples. Plain arithmetic, on tensors or floats: the engine's estimator and
    ``probe=batch``'s measurement at the start weights share it."""
    spread = mean_inverse - 1.0 / big_count
    trace = (mean_sq - big_sq) / spread
    grad_sq = (big_sq * mean_inverse - mean_sq / big_count) / spread
    return grad_sq, trace


def _moving_weights(decay):
    """(keep, move): the noise scale's state vector after a measured window is ``state * keep +
    move * [raw |G|^2, raw tr(Sigma), raw |G|^2, raw tr(Sigma), 1, 1]``: the raw pair replaced,
    their averages and the averages' weight moved by ``decay``, the windows counted; the same
    products and sums as working each part apart (a nan or an infinity in the state stays, as
    it would in the averages)."""
    keep = tf.constant([0.0, 0.0, decay, decay, decay, 1.0])
    move = tf.constant([1.0, 1.0, 1.0 - decay, 1.0 - decay, 1.0 - decay, 1.0])
    return keep, move


class NoiseScale:
    """The gradient noise scale, measured from the micro-batches at the cost of one squared norm
    per micro-batch (McCandlish, Kaplan, Amodei et al., "An Empirical Model of Large-Batch
    Training", 2018, appendix A).

    A batch of ``b`` samples drawn from the data has ``E|g_b|^2 = |G|^2 + tr(Sigma) / b``. Each
    window gives that at two sizes: every micro-batch on every replica (``b_i`` samples, its
    own count, so ragged ones are exact) and the whole window (``B`` samples over all
    replicas). With ``m`` the mean of ``|g_i|^2`` and ``h`` the mean of ``1 / b_i``:

        tr(Sigma) = (m - |G_B|^2) / (h - 1/B),   |G|^2 = (|G_B|^2 h - m / B) / (h - 1/B)

    (with equal micro-batches, the paper's two formulas). ``B_simple = tr(Sigma) / |G|^2`` is
    the batch size beyond which larger batches pay off less and less. Each window's raw estimates
    are kept (in the ``gns_state`` vector); exponential moving averages of both (``decay``,
    bias-corrected) and their ratio ``noise_scale()`` smooth them, as the paper does.
    Micro-batches without a sample count, or a window holding any, give no estimate.

    With ``every`` > 1 only every ``every``-th window is measured (:meth:`measures`): the
    averages then move once per measured window, and the squared norms of the others are not
    computed for it (the non-finite check may compute them for itself, :func:`all_finite`).
    """

    def __init__(self, decay, every=1):
        self.decay = decay
        self.every = every

    @classmethod
    def asked_for(cls, config):
        """The noise scale an AccumulationConfig asks for, or None (``noise_scale=False``)."""
        if not config.noise_scale:
            return None
        return cls(config.noise_scale_decay, config.noise_scale_every)

    def measures(self, updates):
        """Whether the window after ``updates`` optimizer updates is measured (a boolean
        tensor): the first, then every ``every``-th. A skipped window leaves ``updates`` as it
        was, so its successor is measured or not as it was."""
        return tf.equal(tf.math.floormod(tf.cast(updates, "int64"), self.every), 0)

    # The fields of ``small`` and ``state``: two vectors, so that a micro-step adds to one
    # variable, a window sets one, and a reading is one read.
    _SQ, _COUNT, _INVERSE = range(3)
    _GRAD_SQ_RAW, _TRACE_RAW, _GRAD_SQ, _TRACE, _WEIGHT, _WINDOWS = range(6)

    def build(self, add_state):
        # Per replica: sums over this replica's micro-batches of the window, of |g_i|^2, of 1
        # and of 1 / b_i.
        self.small = add_state("gns_small", shape=(3,), per_replica=True)
        # Set in cross-replica context, once a window: the last raw |G|^2 and tr(Sigma), their
        # moving averages and the averages' weight (bias correction), and the windows measured
        # (exact in float32 up to 2**24).
        self.state = add_state("gns_state", shape=(6,))

    def observe(self, squared_norm, sample_count, kept=None, factor=None):
        """One micro-batch on this replica: ``squared_norm`` is the squared norm of its
        gradients as the window adds them divided by ``factor`` (None: 1), so that ``factor /
        sample_count`` takes them to its mean loss's gradient; ``kept`` a boolean tensor (False:
        left out; None: kept). Scalar ops once a micro-step, as few as can be: without XLA each
        costs the graph's executor a microsecond or two, more than its arithmetic."""
        count = tf.cast(sample_count, "float32")
        at_least_one = tf.maximum(count, 1.0)
        inverse = 1.0 / at_least_one
        # factor / b_i, exactly 1 where the window adds the summed loss's gradient (factor b_i).
        to_mean = inverse if factor is None else tf.cast(factor, "float32") / at_least_one
        terms = tf.stack([squared_norm * tf.square(to_mean), 1.0, inverse])
        counted = count > 0
        if kept is not None:
            counted = tf.logical_and(kept, counted)
        self.small.assign_add(tf.where(counted, terms, tf.zeros([3])))

    def update(self, big_squared_norm, big_count, unweighted):
        """As a window is applied (in cross-replica context under a strategy):
        ``big_squared_norm`` is ``|G_B|^2`` of its gradient, ``big_count`` its samples over all
        replicas, ``unweighted`` the micro-batches in it that gave no count. Written in few
        ops, as :meth:`observe` is."""
        # [mean |g_i|^2, 1, mean 1/b_i] over the micro-batches (all zeros where none counted).
        small = _value(self.small)
        means = small / tf.maximum(small[self._COUNT], 1.0)
        mean_sq, mean_inverse = means[self._SQ], means[self._INVERSE]
        big_count = tf.maximum(big_count, 1.0)
        grad_sq, trace = noise_from_two_sizes(mean_sq, mean_inverse, big_squared_norm, big_count)
        # Two sizes are needed: a window of one micro-batch on one replica says nothing. The
        # spread h - 1/B is positive only where micro-batches were counted (else h = 0) and the
        # window holds samples (else h - 1 <= 0, as every b_i >= 1).
        spread = mean_inverse - 1.0 / big_count
        valid = tf.logical_and(tf.equal(unweighted, 0.0), spread > 1e-9 * mean_inverse)
        # Raw estimates; averages of both and of 1 (their weight), moved by ``decay``; one
        # more window. Where not valid the estimates may divide by zero; they are not kept.
        keep, move = _moving_weights(self.decay)
        state = _value(self.state)
        new = state * keep + move * tf.stack([grad_sq, trace, grad_sq, trace, 1.0, 1.0])
        self.state.assign(tf.where(valid, new, state))

    def reading(self, state=None):
        """(|G|^2, tr(Sigma), B_simple) smoothed (zeros before the first estimate), the last
        window's raw |G|^2 and tr(Sigma), and the windows measured, as Python numbers, from
        ``state`` (the state vector as a compiled call returned it) or else one read of it.

        The same numbers as float32 arithmetic gives (a quotient of two float32 numbers worked
        in float64 and rounded to float32 is the float32 quotient), in plain Python: the logger
        reads it after every update, right after a compiled call, while TensorFlow's worker
        threads still hold the cores: there each NumPy op waits for those threads, so plain
        Python floats cost less than NumPy's small-array arithmetic."""
        if state is None:
            state = _value(self.state)
        values = np.asarray(state, dtype=np.float32).tolist()
        weight = max(values[self._WEIGHT], _AT_LEAST_WEIGHT)
        grad_sq = _float32(values[self._GRAD_SQ] / weight)
        trace = _float32(values[self._TRACE] / weight)
        scale = _float32(trace / grad_sq) if grad_sq != 0 else 0.0  # divide_no_nan
        raw = values[self._GRAD_SQ_RAW], values[self._TRACE_RAW]
        return [grad_sq, trace, scale, *raw, int(values[self._WINDOWS])]

    def reset(self):
        self.small.assign(tf.zeros([3]))
