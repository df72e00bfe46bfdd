"""Adaptive gradient clipping (AGC, Brock et al. 2021, "High-Performance Large-Scale Image
Recognition Without Normalization").

Each unit (an output unit of a kernel; the whole tensor for biases and scalars) has its gradient
rescaled so that ``||g_unit|| <= clip_factor * max(||w_unit||, eps)``. gacli applies it once per
optimizer update, to the accumulated window gradient, so k micro-batches clip exactly like one big
batch would (contract row C2).

Which axes a unit's norm runs over (every axis but the unit's own) depends on the tensor's rank,
the NFNets rule: rank <= 1 the whole tensor; rank 2 Dense ``[in, out]`` (and an EinsumDense bias
``[heads, dim]``) axis 0; rank 4 Conv2D ``[h, w, in, out]`` axes (0, 1, 2); rank 5 Conv3D axes
(0, 1, 2, 3). Rank 3 is ambiguous, so gacli decides it by the layer that owns the weight
(:func:`agc_unit_axes`): a 1D convolution's kernel (Conv1D ``[w, in, out]``, Conv1DTranspose,
DepthwiseConv1D, SeparableConv1D) every axis but the last, (0, 1), as for its 2D and 3D versions;
an EinsumDense kernel the axes its equation sums over: (0,) for MultiHeadAttention's query, key
and value ``[in, heads, dim]`` (one unit per head and dim), (0, 1) for its output projection
``[heads, dim, out]``.

:func:`adaptive_clip_gradients` takes that table as ``unit_axes``. Without it (a bare list of
variables) it reads the kind from the variables alone: a rank-3 kernel whose layer has a
``[heads, dim]`` bias among the variables is a multi-head kernel (axis 0), every other rank-3
kernel gets axes (0, 1). The NFNets reference code and ``gradient-accumulator`` take axis 0 for
every rank-3 tensor; :func:`unitwise_norm` and :func:`adaptive_clip_grad`, which get bare tensors,
keep that.
"""

import keras
import tensorflow as tf

from gacli.engine import _keras_compat as compat

# Axes of the per-unit norm by rank, as NFNets define them (rank 3: multi-head linear [in, heads,
# dim]). Ranks 0 and 1 are one unit.
_NFNETS_AXES = {2: (0,), 3: (0,), 4: (0, 1, 2), 5: (0, 1, 2, 3)}


def compute_norm(x, axis, keepdims):
    """Euclidean (L2) norm of ``x`` over ``axis`` (``None``: all axes).

    Kept with ``gradient-accumulator``'s name and arguments.

    Example:
        >>> compute_norm(dense.kernel, axis=0, keepdims=True)  # one norm per output unit
    """
    return tf.sqrt(tf.reduce_sum(tf.square(x), axis=axis, keepdims=keepdims))


def unitwise_norm(x):
    """Per-unit L2 norm of ``x`` by its rank alone, as NFNets and ``gradient-accumulator`` take it.

    Rank 0 or 1: a scalar, the norm of the whole tensor. Rank 2 ``[in, out]`` and rank 3 (read as a
    multi-head kernel ``[in, heads, dim]``): axis 0. Rank 4 ``[h, w, in, out]``: axes (0, 1, 2).
    Rank 5 ``[d, h, w, in, out]``: axes (0, 1, 2, 3). Ranks 2 to 5 keep their dimensions, so the
    result broadcasts against ``x``. A Conv1D kernel (also rank 3) wants axes (0, 1):
    :func:`adaptive_clip_gradients`, which sees the variables, gives it those.

    Raises:
        ValueError: for rank 6 and above, which no Keras layer's weight has.

    Example:
        >>> unitwise_norm(dense.kernel)  # shape (1, units): one norm per output unit
    """
    x = tf.convert_to_tensor(x)
    axes = _nfnets_axes(x.shape)
    if axes is None:
        return compute_norm(x, axis=None, keepdims=False)
    return compute_norm(x, axis=list(axes), keepdims=True)


def _nfnets_axes(shape):
    """The NFNets axes for a tensor of ``shape``; ``None`` for one unit (rank 0 or 1)."""
    rank = len(shape)
    if rank <= 1:
        return None
    if rank not in _NFNETS_AXES:
        raise ValueError(
            f"unitwise_norm takes tensors of rank 0 to 5 (biases, Dense, multi-head, Conv2D and "
            f"Conv3D kernels); got shape {tuple(shape)}. For other layouts call "
            "compute_norm(x, axis, keepdims=True) with the axes that index one unit's inputs."
        )
    return _NFNETS_AXES[rank]


def _bias_of(variable, variables_by_path):
    """The bias of ``variable``'s layer (the weight named ``bias`` beside it), if it is given."""
    path = getattr(variable, "path", None)
    if not path or "/" not in path:
        return None
    return variables_by_path.get(path.rsplit("/", 1)[0] + "/bias")


def _unit_axes(variable, variables_by_path):
    """Axes of ``variable``'s per-unit norm, as :func:`adaptive_clip_gradients` takes them.

    ``None`` for rank 0 and 1 (the whole tensor is one unit). Otherwise every axis but the output
    unit's: for ranks 2, 4 and 5 that is every axis but the last, which is the NFNets rule. For
    rank 3 the layer decides: when the layer's bias is among the update's variables and spans the
    kernel's last two axes (``EinsumDense`` with ``bias_axes`` over heads and dim, as
    ``MultiHeadAttention`` builds its query, key and value projections ``[in, heads, dim]``), a
    unit is one (head, dim) pair and the norm runs over axis 0, as in NFNets and
    ``gradient-accumulator``. Otherwise
    (``Conv1D`` ``[w, in, out]`` with or without a bias, ``MultiHeadAttention``'s output projection
    ``[heads, dim, out]``, a bias-free ``EinsumDense``) a unit is one output channel and the norm
    runs over axes (0, 1), the unit's whole fan-in.

    ``variable``: a Keras variable (its ``path`` names its layer) or a tensor;
    ``variables_by_path``: the update's variables by path, searched for the layer's bias.
    """
    rank = len(variable.shape)
    if rank <= 1:
        return None
    if rank == 3:
        bias = _bias_of(variable, variables_by_path)
        if (
            bias is not None
            and len(bias.shape) == 2
            and tuple(bias.shape) == tuple(variable.shape[1:])
        ):
            return _NFNETS_AXES[3]
    return tuple(range(rank - 1))


def _clip_each(gradients, parameters, axes_of, clip_factor, eps):
    """Each gradient clipped against its parameter over the axes ``axes_of(parameter)`` gives."""
    clipped = []
    for gradient, parameter in zip(gradients, parameters):
        if gradient is None:
            clipped.append(None)
            continue
        gradient = tf.convert_to_tensor(gradient)
        axes = axes_of(parameter)
        parameter = tf.cast(tf.convert_to_tensor(parameter), gradient.dtype)
        clipped.append(_clip(gradient, parameter, axes, clip_factor, eps))
    return clipped


def _clip(gradient, parameter, axes, clip_factor, eps):
    keepdims = axes is not None
    axes = None if axes is None else list(axes)
    max_norm = tf.maximum(compute_norm(parameter, axes, keepdims), eps) * clip_factor
    gradient_norm = compute_norm(gradient, axes, keepdims)
    # 1e-6 keeps the division finite where a unit's gradient is exactly zero; such units are never
    # clipped because their norm is below max_norm.
    scale = max_norm / tf.maximum(gradient_norm, 1e-6)
    return tf.where(gradient_norm > max_norm, gradient * scale, gradient)


def adaptive_clip_gradients(gradients, variables, clip_factor=0.01, eps=1e-3, *, unit_axes=None):
    """Return ``gradients`` clipped unit-wise relative to the norms of ``variables``.

    A unit's norm runs over the NFNets axes for ranks 0 to 2, 4 and 5; for rank 3 over the axes
    ``unit_axes`` gives for the variable's path, or, for a variable it does not name, axis 0 for a
    multi-head projection ``[in, heads, dim]`` (told by its ``[heads, dim]`` bias among
    ``variables``) and axes (0, 1) for a Conv1D kernel ``[w, in, out]`` and every other rank-3
    kernel. Both wrappers' ``use_agc=True`` call this.

    Args:
        gradients: list of dense gradient tensors (``None`` entries are passed through).
        variables: the matching list of variables (or tensors).
        clip_factor: largest allowed ratio of gradient norm to parameter norm per unit.
        eps: floor on the parameter norm, so that zero-initialised units can still move.
        unit_axes: optional ``{variable path: axes}`` (``None`` for the whole tensor), as
            :func:`agc_unit_axes` reads it from the layers that own the variables.

    Example:
        >>> clipped = adaptive_clip_gradients(grads, model.trainable_variables, clip_factor=0.01,
        ...                                   unit_axes=agc_unit_axes(model))
    """
    variables = list(variables)
    by_path = {getattr(variable, "path", None): variable for variable in variables}
    unit_axes = unit_axes or {}

    def axes_of(variable):
        path = getattr(variable, "path", None)
        if path in unit_axes:
            return unit_axes[path]
        return _unit_axes(variable, by_path)

    return _clip_each(gradients, variables, axes_of, clip_factor, eps)


# Keras' 1D convolutions, whose rank-3 kernels are read like their 2D and 3D versions' under the
# NFNets rule: every axis but the last. (A transposed convolution's last axis is its input
# channels; NFNets' rank-4 rule reads Conv2DTranspose the same way.)
_CONVOLUTIONS_1D = (
    keras.layers.Conv1D,
    keras.layers.Conv1DTranspose,
    keras.layers.DepthwiseConv1D,
    keras.layers.SeparableConv1D,
)


def _summed_kernel_axes(layer):
    """The axes of an EinsumDense kernel that its equation sums over (absent from the output);
    ``None`` where the equation cannot be read that way."""
    inputs, _, output = layer.equation.partition("->")
    kernel = inputs.split(",")[-1].strip()
    if "." in kernel or len(kernel) != len(layer.kernel.shape):
        return None
    axes = tuple(axis for axis, letter in enumerate(kernel) if letter not in output)
    return axes or None


def agc_unit_axes(model):
    """``{variable path: unit-norm axes}`` for every trainable weight of ``model``, by layer kind.

    Ranks other than 3 get the NFNets axes (``None``: the whole tensor is one unit). A rank-3
    kernel of a 1D convolution (``Conv1D``, ``Conv1DTranspose``, ``DepthwiseConv1D``,
    ``SeparableConv1D``) gets every axis but the last, (0, 1); an ``EinsumDense`` kernel (as inside
    ``MultiHeadAttention``) the axes its equation sums over: (0,) for a query, key or value
    projection ``[in, heads, dim]``, (0, 1) for the output projection ``[heads, dim, out]``. Other
    rank-3 weights get what :func:`adaptive_clip_gradients` reads from the variables alone.

    Args:
        model: a built Keras model or layer; nested layers and models are read too.

    Example:
        >>> unit_axes = agc_unit_axes(model)  # {"attention/query/kernel": (0,), ...}
        >>> clipped = adaptive_clip_gradients(grads, model.trainable_variables, unit_axes=unit_axes)
    """
    variables = list(model.trainable_variables)
    by_path = {variable.path: variable for variable in variables}
    table = {path: _unit_axes(variable, by_path) for path, variable in by_path.items()}
    # Layer.trainable_weights holds a layer's own weights and its sublayers': the walk needs every
    # layer (Keras has no public recursive listing; gacli.engine.batchnorm walks models the same
    # way).
    for layer in compat.sublayers(model, include_self=True):
        if isinstance(layer, _CONVOLUTIONS_1D):
            kernels = [
                getattr(layer, name, None)
                for name in ("kernel", "depthwise_kernel", "pointwise_kernel")
            ]
            axes = (0, 1)
        elif isinstance(layer, keras.layers.EinsumDense):
            kernels = [layer.kernel]
            axes = _summed_kernel_axes(layer)
        else:
            continue
        for kernel in kernels:
            # A LoRA-enabled layer's kernel is a sum (a tensor without a path) of frozen weights.
            path = getattr(kernel, "path", None)
            if axes is not None and path in table and len(kernel.shape) == 3:
                table[path] = axes
    return table


def adaptive_clip_grad(parameters, gradients, clip_factor=0.01, eps=1e-3):
    """``gradient-accumulator``'s AGC: ``gradients`` clipped unit-wise, parameters first.

    Units as :func:`unitwise_norm` takes them (rank 3: axis 0 for every tensor, the multi-head
    reading), so a custom loop written for ``gradient-accumulator`` clips exactly as it did. The
    wrappers' ``use_agc=True`` uses :func:`adaptive_clip_gradients`, which reads a Conv1D kernel
    per output channel instead.

    Args:
        parameters: list of variables or tensors.
        gradients: the matching list of gradients (``None`` entries are passed through).
        clip_factor: largest allowed ratio of gradient norm to parameter norm per unit.
        eps: floor on the parameter norm.

    Example:
        >>> grads = adaptive_clip_grad(model.trainable_variables, grads, clip_factor=0.01)
    """
    return _clip_each(
        gradients, parameters, lambda parameter: _nfnets_axes(parameter.shape), clip_factor, eps
    )
