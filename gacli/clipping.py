"""Adaptive gradient clipping (AGC, Brock et al. 2021, "High-Performance Large-Scale Image
Recognition Without Normalization").

Each unit (an output channel of a kernel; the whole tensor for biases and scalars) has its gradient
rescaled so that ``||g_unit|| <= clip_factor * max(||w_unit||, eps)``. gacli applies it once per
optimizer update, to the accumulated window gradient, so k micro-batches clip exactly like one big
batch would (contract row C2).
"""

import tensorflow as tf


def _unit_norm(tensor):
    """Euclidean norm per output unit, broadcastable against ``tensor``.

    Units are indexed by the last axis for rank >= 2 (Dense ``[in, out]``, Conv ``[h, w, in, out]``);
    a rank 0 or 1 tensor is one unit.
    """
    if tensor.shape.rank is not None and tensor.shape.rank <= 1:
        return tf.norm(tensor)
    axes = list(range(tensor.shape.rank - 1))
    return tf.sqrt(tf.reduce_sum(tf.square(tensor), axis=axes, keepdims=True))


def adaptive_clip_gradients(gradients, variables, clip_factor=0.01, eps=1e-3):
    """Return ``gradients`` clipped unit-wise relative to the norms of ``variables``.

    Args:
        gradients: list of dense gradient tensors (``None`` entries are passed through).
        variables: the matching list of variables (or tensors).
        clip_factor: largest allowed ratio of gradient norm to parameter norm per unit.
        eps: floor on the parameter norm, so that zero-initialised units can still move.

    Example:
        >>> clipped = adaptive_clip_gradients(grads, model.trainable_variables, clip_factor=0.01)
    """
    clipped = []
    for gradient, variable in zip(gradients, variables):
        if gradient is None:
            clipped.append(None)
            continue
        gradient = tf.convert_to_tensor(gradient)
        parameter = tf.cast(tf.convert_to_tensor(variable), gradient.dtype)
        max_norm = tf.maximum(_unit_norm(parameter), eps) * clip_factor
        gradient_norm = _unit_norm(gradient)
        # 1e-6 keeps the division finite where a unit's gradient is exactly zero; such units are
        # never clipped because their norm is below max_norm.
        scale = max_norm / tf.maximum(gradient_norm, 1e-6)
        clipped.append(tf.where(gradient_norm > max_norm, gradient * scale, gradient))
    return clipped
